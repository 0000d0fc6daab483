"""An agent function trains end to end (``flashreinforce.train(agent=...)`` and ``--agent``), and the
configuration's checks of ``--agent``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flashreinforce.config import ConfigError, TrainerConfig

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
pytest.importorskip("gguf")


def agent_fn(client, row):
    """Two calls, the second continuing the first: reward 1 when the answer holds the letter 'a'."""
    messages = [{"role": "user", "content": row["prompt"]}]
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "ok"}]
    second = client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    return float("a" in (second.choices[0].message.content or ""))


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    from python_tests.models.gguf_tiny import write_tiny_gguf

    path = Path(tmp_path_factory.mktemp("gguf")) / "tiny.gguf"
    write_tiny_gguf(path, seed=2)
    return str(path)


def _config(steps=2):
    import flashreinforce as fr

    cfg = fr.load_config(None)
    cfg.train.max_steps = steps
    cfg.rollout.batch_size = 4
    cfg.rollout.max_new_tokens = 4
    cfg.data.max_len = 256
    cfg.eval.steps = 0
    cfg.ckpt.save_steps = 0
    return cfg


def test_train_with_an_agent_function(tmp_path, gguf_path):
    import flashreinforce as fr

    rows = [{"prompt": f"letter {c}"} for c in "abcdefgh"]
    summary = fr.train(_config(), model=gguf_path, agent=agent_fn, dataset=rows, output=str(tmp_path / "run"),
                       device="cpu", progress=False)
    assert summary["status"] == "completed" and summary["step"] == 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["env/agent_calls"] == 2.0 and r["env/history_rewrites"] == 0.0 for r in records)
    assert all(r["sequence_kl_mean"] < 1e-6 for r in records)  # behavior log-probs are the policy's own
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert "python_tests.agents.test_agent_training:agent_fn" in config


def test_agent_flag_resolves_to_the_agent_environment():
    cfg = TrainerConfig.from_layers({"agent": "my_agent.py:play", "env.kwargs": {"tool_parser": "hermes"}})
    assert cfg.train.agent_path == "agent"
    assert cfg.env_kwargs == {"tool_parser": "hermes", "agent": "my_agent.py:play"}
    with pytest.raises(ConfigError, match="--agent and --env math both say what the task is"):
        TrainerConfig.from_layers({"agent": "my_agent.py:play", "env": "math"})
    with pytest.raises(ConfigError, match="--agent and --reward both"):
        TrainerConfig.from_layers({"agent": "my_agent.py:play", "reward": ["r.py:f"]})


def test_a_bad_agent_spec_is_one_line_naming_the_flag(tmp_path, gguf_path):
    out = subprocess.run([sys.executable, "-m", "flashreinforce.cli", "train", "--model", gguf_path, "--agent",
                          str(tmp_path / "missing.py") + ":play", "--output", str(tmp_path / "r"), "--device", "cpu"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1].endswith(f"--agent {tmp_path / 'missing.py'}:play: "
                                                        f"{tmp_path / 'missing.py'} does not exist")


def test_a_missing_agent_package_is_named_before_the_model_loads(monkeypatch):
    from flashreinforce.trainer.run.prechecks import check_before_model

    cfg = TrainerConfig.from_layers({"agent": "flashreinforce.agents.arith_calculator:agent", "model": "tiny-qwen2"})
    check_before_model(cfg)  # everything there
    monkeypatch.setitem(sys.modules, "openai", None)  # import openai raises ImportError
    with pytest.raises(ConfigError, match=r"^--agent: the agent endpoint needs openai: pip install -e '\.\[agents\]'"):
        check_before_model(cfg)


def test_an_env_or_reward_replaces_a_preset_s_agent():
    from flashreinforce.config.presets import PRESETS

    preset = PRESETS["arith_tool_agent"]
    assert TrainerConfig.from_layers({}, preset).train.agent_path == "agent"
    cfg = TrainerConfig.from_layers({"env": "math"}, preset)
    assert cfg.train.agent_path == "math" and "agent" not in cfg.env_kwargs
    cfg = TrainerConfig.from_layers({"reward": ["r.py:f"]}, preset)
    assert cfg.train.agent_path == "reward_functions" and "agent" not in cfg.env_kwargs
    with pytest.raises(ConfigError, match="--agent and --env math both"):  # both given: still refused
        TrainerConfig.from_layers({"env": "math", "agent": "a.py:f"}, preset)


def test_an_agent_run_gets_tool_use_limits_unless_its_user_sets_them():
    from flashreinforce.config.presets import PRESETS

    cfg = TrainerConfig.from_layers({"agent": "a.py:f"}, dict(PRESETS["arith"], preset="arith"))
    assert (cfg.rollout.max_turns, cfg.data.max_len, cfg.rollout.max_new_tokens) == (8, 2048, 256)
    assert cfg.notes == ["--agent: an agent run's limits: rollout.max_turns 8, data.max_len 2048, "
                         "rollout.max_new_tokens 256 (a model call past them is refused and the episode truncated; "
                         "set the flags to change them)"]
    cfg = TrainerConfig.from_layers({"agent": "a.py:f", "rollout.max_turns": 2, "data.max_len": 300},
                                    dict(PRESETS["arith"], preset="arith"))
    assert (cfg.rollout.max_turns, cfg.data.max_len, cfg.rollout.max_new_tokens) == (2, 300, 256)
    assert "rollout.max_turns" not in cfg.notes[0] and "rollout.max_new_tokens 256" in cfg.notes[0]
    # a preset whose own agent it is keeps its limits; a verifiers taskset is an agent run too
    cfg = TrainerConfig.from_layers({}, dict(PRESETS["arith_tool_agent"], preset="arith_tool_agent"))
    assert (cfg.rollout.max_turns, cfg.data.max_len, cfg.notes) == (3, 1024, [])
    # --preset agent is made for the user's agent function: its limits stand, the flags still win
    cfg = TrainerConfig.from_layers({"agent": "a.py:f"}, dict(PRESETS["agent"], preset="agent"))
    assert (cfg.rollout.max_turns, cfg.data.max_len, cfg.rollout.max_new_tokens, cfg.notes) == (8, 1024, 64, [])
    cfg = TrainerConfig.from_layers({"agent": "a.py:f", "rollout.max_new_tokens": 128},
                                    dict(PRESETS["agent"], preset="agent"))
    assert (cfg.data.max_len, cfg.rollout.max_new_tokens) == (1024, 128)
    cfg = TrainerConfig.from_layers({"env": "verifiers:my_taskset"})
    assert cfg.rollout.max_turns == 8 and cfg.notes[0].startswith("--env verifiers:my_taskset: an agent run's limits")


SILENT = "def play(client, row):\n    return 1.0\n"
LONG = ("def play(client, row):\n"
        "    client.chat.completions.create(model='m', messages=[{'role': 'user', 'content': 'q ' * 300}])\n"
        "    return 1.0\n")


@pytest.mark.parametrize("source, line", [
    (SILENT, r"none of the first \d+ episodes gave a token to train on \(a batch is 4; "
             r"--rollout.max_failed_episodes_in_a_row 0 lets a run go on\); the last one: agent play made no model "
             r"call"),
    (LONG, r"the first episode of agent play was cut short: the prompt has \d+ tokens and leaves no room for an "
           r"answer in data.max_len 128; give a larger --data.max_len \(now 128\)"),
])
def test_a_run_that_cannot_train_stops_in_its_first_batch_with_one_line(tmp_path, gguf_path, source, line):
    import re

    (tmp_path / "agent.py").write_text(source)
    out = subprocess.run([sys.executable, "-m", "flashreinforce.cli", "train", "--model", gguf_path, "--agent",
                          f"{tmp_path / 'agent.py'}:play", "--train.max_steps", "3", "--rollout.batch_size", "4",
                          "--train.batch_size", "4", "--data.max_len", "128", "--rollout.max_new_tokens", "8",
                          "--rollout.num_workers", "1",
                          "--eval.steps", "0", "--output", str(tmp_path / "run"), "--no_progress"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 1, out.stderr[-2000:]
    assert re.search(line, out.stderr.strip().splitlines()[-1]), out.stderr[-2000:]


def test_the_preset_s_agent_loads_and_its_former_module_path_still_imports_it():
    from flashreinforce.agents import arith_calculator, arith_tool
    from flashreinforce.agents.environment import load_agent
    from flashreinforce.config.presets import PRESETS

    assert load_agent(PRESETS["arith_tool_agent"]["agent"]) is arith_calculator.agent
    assert load_agent("flashreinforce.agents.arith_tool:agent") is arith_calculator.agent  # recorded by older runs
    assert arith_tool.calculate is arith_calculator.calculate and arith_tool.calculate("12 * (3 + 4)") == "84"
