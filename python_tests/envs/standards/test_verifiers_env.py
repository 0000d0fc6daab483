"""verifiers tasksets by name (``--env verifiers:...``): verifiers' own Env runs each task against the rollout
worker's endpoint (the tiny GGUF model behind it), single-turn and with a tool; rewards, metrics and the
taskset's evaluation split; the errors, one line each.

verifiers prepares its harness program with uv (``uv sync --script`` from the package index) on first use.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

from flashreinforce.config import ConfigError
from flashreinforce.envs.registry import environment_class, make_environment

HERE = Path(__file__).resolve().parent
ARITH = f"verifiers:{HERE / 'vf_arith_taskset.py'}"
CALCULATOR = f"verifiers:{HERE / 'vf_calculator_taskset.py'}"
needs_verifiers = pytest.mark.skipif(importlib.util.find_spec("verifiers") is None or
                                     importlib.util.find_spec("verifiers.v1") is None,
                                     reason="verifiers >= 0.4 is not installed (pip install -e '.[verifiers]')")
needs_uv = pytest.mark.skipif(shutil.which("uv") is None, reason="verifiers runs its harness with uv: pip install uv")


def test_the_registry_names_the_verifiers_environment_and_the_agent_worker_plays_it():
    from flashreinforce.envs.standards.verifiers_env import VerifiersEnvironment
    from flashreinforce.trainer.rollout.worker_kinds import is_agent_spec

    assert environment_class(ARITH) is VerifiersEnvironment and is_agent_spec(ARITH)


def test_a_missing_verifiers_names_the_extra(monkeypatch):
    from flashreinforce.envs.standards.verifiers_env import check_taskset

    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(ConfigError, match=r"--env verifiers:x needs the verifiers package.*\.\[verifiers\]"):
        check_taskset("x")


@needs_verifiers
def test_tasks_rows_and_the_taskset_evaluation_split():
    env = make_environment(ARITH, {}, taskset_config={"size": 12, "heldout_size": 4},
                           eval_taskset={"split": "heldout"})
    assert len(env.tasks) == 16 and env.evaluation_rows == (12, 13, 14, 15)
    assert env.reset(seed=13) == "What is" + env.tasks[13].prompt[len("What is"):]
    assert env.row == {"prompt": env.tasks[13].prompt, "vf_task": 13} and env.max_turns == 8
    with pytest.raises(ValueError, match="makes its own prompt set"):
        make_environment(ARITH, {"data.prompt_dataset": [{"prompt": "p"}]})


@needs_verifiers
def test_bad_tasksets_are_one_line_errors(tmp_path):
    from flashreinforce.envs.standards.verifiers_env import check_taskset

    legacy = tmp_path / "legacy_env.py"
    legacy.write_text("import verifiers as vf\n\ndef load_environment(**kwargs):\n"
                      "    return vf.SingleTurnEnv(dataset=None, rubric=vf.Rubric())\n")
    with pytest.raises(ConfigError, match=r"environment module of verifiers before 0\.4.*port it"):
        check_taskset(str(legacy))
    with pytest.raises(ConfigError, match=r"no_such_taskset_module.*not found"):
        check_taskset("no_such_taskset_module")
    with pytest.raises(ConfigError, match=r"nope\.py: no such file"):
        check_taskset("nope.py")


def _worker(tiny, spec, **env_kwargs):
    from flashreinforce.engines import LocalWeightStore, SamplingParams, create_engine
    from flashreinforce.envs.registry import EnvSpec
    from flashreinforce.agents.worker import AgentRolloutWorker
    from flashreinforce.trainer.rollout.worker_kinds import worker_class
    from flashreinforce.trainer.rollout.settings import RolloutSettings

    model, tok = tiny
    factory = EnvSpec(spec, {}, env_kwargs).factory(tok)
    assert worker_class(factory) is AgentRolloutWorker
    engine = create_engine("hf", model, pad_token_id=tok.pad_token_id, version=0)
    settings = RolloutSettings(max_new_tokens=6, max_len=2048, sampling=SamplingParams(1.0, 1.0, 0, tok.eos_token_ids),
                               env_timeout_s=120, env_parallel_calls=4, seed=11)
    return AgentRolloutWorker(0, engine, factory, tok, None, LocalWeightStore(), settings)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("gguf")
    import torch

    from flashreinforce.models.loading import build_model
    from flashreinforce.models.tokenizers import load_tokenizer
    from python_tests.models.gguf_tiny import write_tiny_gguf

    path = Path(tmp_path_factory.mktemp("gguf")) / "tiny.gguf"
    write_tiny_gguf(path, seed=3)
    model, _ = build_model(str(path), device=torch.device("cpu"))
    return model.eval(), load_tokenizer(str(path))


@needs_verifiers
@needs_uv
def test_a_single_turn_taskset_plays_through_the_endpoint_with_its_rewards_in_info(tiny):
    from flashreinforce.trainer.rollout.buffer import Ticket
    from flashreinforce.trainer.rollout.trajectory import Trajectory

    worker = _worker(tiny, ARITH, taskset_config={"size": 8})
    try:
        groups = worker.run_tickets([Ticket(i, s, 1) for i, s in enumerate((0, 1, 2))])
    finally:
        worker.close()
    _, tok = tiny
    for (t,) in groups:
        assert isinstance(t, Trajectory) and t.info["agent_calls"] == 1 and t.info["history_rewrites"] == 0
        assert t.reward == t.info["reward_correct"] and t.info["metric_has_answer"] in (0.0, 1.0)
        # the harness's one model call: the task's question rendered by the chat template, then the sampled tokens
        prompt = tok.decode([x for x, m in zip(t.token_ids, t.action_mask) if not m])
        assert "What is" in prompt and t.num_action_tokens == t.info["action_tokens"] > 0


@needs_verifiers
@needs_uv
def test_a_tool_taskset_runs_its_tool_server_and_continues_one_conversation(tiny):
    from flashreinforce.agents.toolcalls import ToolParse, new_call_id, register_parser
    from flashreinforce.trainer.rollout.buffer import Ticket

    answers = []

    def calls_then_answers(text):  # the tiny model cannot write the markup: the parser stands in for it
        answers.append(text)
        if len(answers) == 1:
            arguments = json.dumps({"expression": "6*7"})
            return ToolParse(None, [{"id": new_call_id(), "type": "function",
                                     "function": {"name": "calculator_calculate", "arguments": arguments}}])
        return ToolParse("42")

    register_parser("test_calculator_once", calls_then_answers)
    worker = _worker(tiny, CALCULATOR, taskset_config={"size": 4}, tool_parser="test_calculator_once")
    try:
        ((t,),) = worker.run_tickets([Ticket(0, 0, 1)])
    finally:
        worker.close()
    _, tok = tiny
    assert t.info["agent_calls"] == 2 and t.info["tool_calls"] == 1 and t.info["metric_tool_calls"] == 1.0
    assert t.info["history_rewrites"] == 0 and t.info["trajectories_of_episode"] == 1
    context = tok.decode([x for x, m in zip(t.token_ids, t.action_mask) if not m])
    assert "<tool_response>\n42\n</tool_response>" in context  # the tool server's answer, as context
