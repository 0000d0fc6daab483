"""OpenEnv environments by class or URL (``--env openenv:...``): the run serves a class itself, a session
is an episode, observations and actions are turns, the rewards of the steps add up."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from flashreinforce.config import ConfigError
from flashreinforce.envs.registry import environment_class, make_environment

HERE = Path(__file__).resolve().parent
needs_openenv = pytest.mark.skipif(importlib.util.find_spec("openenv") is None,
                                   reason="openenv-core is not installed (pip install -e '.[openenv]')")
ARITH = f"openenv:{HERE / 'openenv_arith.py'}:ArithOpenEnv"
GUESS = f"openenv:{HERE / 'openenv_guess.py'}"


def test_the_registry_names_the_openenv_environment_without_importing_openenv():
    from flashreinforce.envs.standards.openenv_env import OpenEnvEnvironment

    assert environment_class(ARITH) is OpenEnvEnvironment


def test_a_missing_openenv_names_the_extra(monkeypatch):
    from flashreinforce.envs.standards.openenv_env import check_target

    monkeypatch.setitem(sys.modules, "openenv.core.env_server", None)
    with pytest.raises(ConfigError, match=r"openenv-core.*pip install -e '\.\[openenv\]'"):
        check_target("x.py:Env")


@needs_openenv
def test_a_served_class_plays_reset_and_step_as_one_turn_episodes():
    from flashreinforce.envs.arith import ArithSpec, problem_for_seed

    spec = ArithSpec(digits=1, operations="+-*/", negative=True, heldout_size=128)
    env = make_environment(ARITH, {})
    try:
        for seed in (3, 1_000_000_007):  # a training seed and an evaluation (held-out) one
            problem, _ = problem_for_seed(spec, seed)
            assert env.reset(seed=seed) == f"What is {problem.a} {problem.op} {problem.b}? Answer with just the number."
            right = env.step(f"It is {problem.answer}.")
            assert (right.reward, right.done, right.observation, right.info["correct"]) == (1.0, True, "", 1.0)
            env.reset(seed=seed)
            wrong = env.step("no idea")
            assert (wrong.reward, wrong.done, wrong.info["correct"]) == (0.0, True, 0.0)
    finally:
        env.close()


@needs_openenv
def test_a_multi_turn_session_maps_observations_to_turns_and_sums_rewards():
    env = make_environment(GUESS, {}, max_turns=5, system_prompt="Play.")
    try:
        assert env.reset(seed=4) == "Play.\n\nGuess my number from 1 to 9."
        secret = __import__("random").Random(4).randint(1, 9)
        low = env.step(str(secret - 1)) if secret > 1 else env.step(str(secret + 1))
        assert not low.done and low.observation in ("Higher.", "Lower.") and low.reward == pytest.approx(-0.1)
        assert env.step("what?").observation == "Say a number."
        last = env.step(str(secret))
        assert last.done and last.reward == 1.0 and last.info["guesses"] == 3 and env.total == pytest.approx(0.9)
        env.reset(seed=4)
        for turn in range(5):  # the run's turn limit ends a session the environment does not end
            result = env.step("what?")
        assert result.done and result.info["failure_kind"] == "truncated" and result.info["turns"] == 5
    finally:
        env.close()


@needs_openenv
def test_a_server_already_running_is_played_by_its_url():
    served = make_environment(ARITH, {})
    try:
        served.reset(seed=3)
        by_url = make_environment(f"openenv:{served._url()}", {})
        try:
            assert by_url.reset(seed=3) == served.reset(seed=3)
            assert by_url.step("0").done
        finally:
            by_url.close()
    finally:
        served.close()


@needs_openenv
def test_bad_targets_are_one_line_errors_naming_env(tmp_path):
    from flashreinforce.envs.standards.openenv_env import check_target

    with pytest.raises(ConfigError, match=r"--env openenv:nope\.py.*does not exist"):
        check_target("nope.py")
    with pytest.raises(ConfigError, match=r"is not an openenv\.core\.Environment subclass"):
        check_target(f"{HERE / 'openenv_arith.py'}:ArithAction")
    untyped = tmp_path / "untyped.py"
    untyped.write_text("from openenv.core.env_server.interfaces import Environment\n"
                       "class Plain(Environment):\n    def reset(self, seed=None): pass\n"
                       "    def step(self, action): pass\n    state = None\n")
    with pytest.raises(ConfigError, match=r"Action and Observation models"):
        check_target(f"{untyped}:Plain")


@needs_openenv
def test_a_rollout_worker_plays_an_openenv_session_token_for_token():
    from flashreinforce.engines import HFEngine, LocalWeightStore, SamplingParams
    from flashreinforce.models.tokenizers import CharTokenizer
    from flashreinforce.trainer.rollout.buffer import RolloutBuffer, Ticket
    from flashreinforce.trainer.rollout.settings import RolloutSettings
    from flashreinforce.trainer.rollout.worker import RolloutWorker
    from python_tests.builders import tiny_causal_lm

    tok = CharTokenizer()
    model = tiny_causal_lm(tok.vocab_size, seed=0, layers=1, max_positions=4096)
    engine = HFEngine(model, pad_token_id=tok.pad_token_id, version=0)
    store = LocalWeightStore()
    store.publish(model.state_dict(), 0)
    settings = RolloutSettings(max_new_tokens=4, max_len=2048, max_turns=3,
                               sampling=SamplingParams(stop_token_ids=tok.eos_token_ids), episodes_per_call=2, seed=3)
    worker = RolloutWorker(0, engine, lambda: make_environment(GUESS, {}, max_turns=3), tok,
                           RolloutBuffer(batch_groups=2, vocab_size=tok.vocab_size), store, settings)
    try:
        groups = worker.run_tickets([Ticket(0, 5, 1), Ticket(1, 6, 1)])
    finally:
        worker.close()
    for (traj,) in groups:
        assert traj.problem(tok.vocab_size) is None and traj.num_turns == traj.info["turns"]
        prompt = tok.encode_prompt("Guess my number from 1 to 9.")
        assert traj.token_ids[:len(prompt)] == prompt and not any(traj.action_mask[:len(prompt)])
        hints = tok.decode([t for t, m in zip(traj.token_ids[len(prompt):], traj.action_mask[len(prompt):]) if not m])
        assert hints.count(".") >= traj.num_turns - 1  # each turn but the last is answered by a hint
