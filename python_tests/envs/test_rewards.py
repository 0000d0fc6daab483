"""Reward functions over a prompt dataset (flashreinforce.envs.rewards): specs, the environment they
become, and --reward on the command line."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from flashreinforce.envs.registry import make_environment
from flashreinforce.envs.rewards import RewardFunction, RewardFunctionEnv, RewardSpecError, load_reward, parse_reward_spec

ROOT = Path(__file__).resolve().parents[2]
ROWS = [{"prompt": "say a:", "answer": "a", "level": 1}, {"prompt": [{"role": "user", "content": "say b:"}],
                                                          "answer": "b", "level": 2}]


def exact(prompt, completion, answer, **row):
    return float(completion.strip() == answer)


def level(prompt, completion, level, **row):
    return float(level)


def test_specs_weights_and_their_errors():
    assert parse_reward_spec("pkg.mod:fn") == ("pkg.mod", "fn", 1.0)
    assert parse_reward_spec("dir/r.py:fn=0.25") == ("dir/r.py", "fn", 0.25)
    for bad, needle in (("fn", "MODULE:FUNC"), ("m:fn=x", "not a number"), ("m:fn=inf", "finite"), ("m:1x", "FUNC")):
        with pytest.raises(RewardSpecError, match=needle):
            parse_reward_spec(bad)
    assert load_reward(f"{__name__}:exact").func is exact
    assert load_reward((exact, 2.0)).weight == 2.0
    with pytest.raises(RewardSpecError, match="has no nope"):
        load_reward(f"{__name__}:nope")
    with pytest.raises(RewardSpecError, match="finite"):
        RewardFunction(exact, math.nan)


def test_a_file_spec_loads_and_its_errors_are_one_line(tmp_path):
    good = tmp_path / "r.py"
    good.write_text("def longish(prompt, completion, **row):\n    return len(completion) / 10\n")
    assert load_reward(f"{good}:longish=3").func("p", "abcd") == 0.4
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    with pytest.raises(RewardSpecError) as err:
        load_reward(f"{broken}:f")
    assert "SyntaxError" in str(err.value) and f"{broken}:1" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(RewardSpecError, match="does not exist"):
        load_reward(f"{tmp_path / 'missing.py'}:f")


def test_the_episode_reward_is_the_weighted_sum_and_the_row_reaches_the_functions():
    env = make_environment("reward_functions", {"data.prompt_dataset": ROWS}, rewards=[exact, (level, 0.5)])
    assert env.reset(seed=0) == "say a:"
    result = env.step(" a")
    assert result.done and result.reward == 1.0 + 0.5 * 1
    assert result.info == {"reward/exact": 1.0, "reward/level": 1.0}
    env.reset(seed=1)  # chat messages reach the function as the dataset holds them
    seen = {}

    def spy(prompt, completion, **row):
        seen.update(prompt=prompt, row=row)
        return 0.0

    env = make_environment("reward_functions", {"data.prompt_dataset": ROWS}, rewards=[spy])
    env.reset(seed=1)
    env.step("b")
    assert seen == {"prompt": [{"role": "user", "content": "say b:"}], "row": {"answer": "b", "level": 2}}


def test_a_function_that_fails_or_returns_no_number_names_itself():
    def boom(prompt, completion, **row):
        raise KeyError("answer")

    def nan(prompt, completion, **row):
        return math.nan

    for fn, error, needle in ((boom, RuntimeError, "reward function boom raised KeyError"),
                              (nan, ValueError, "reward function nan returned nan")):
        env = make_environment("reward_functions", {"data.prompt_dataset": ROWS}, rewards=[fn])
        env.reset(seed=0)
        with pytest.raises(error, match=needle):
            env.step("a")
    with pytest.raises(RewardSpecError, match="no reward function"):
        RewardFunctionEnv([])


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "flashreinforce.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_reward_on_the_command_line_trains_over_a_dataset(tmp_path):
    (tmp_path / "my_rewards.py").write_text(
        "def first_letter(prompt, completion, target, **row):\n    return float(completion[:1] == target)\n")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"say {t}:", "target": t}) + "\n" for t in "abcd" * 4))
    common = ["--preset", "toy", "--data.prompt_dataset", str(rows), "--rollout.batch_size", "8",
              "--train.batch_size", "8", "--train.max_steps", "2", "--eval.eval_at_start", "false", "--no_progress"]
    proc = _cli("train", *common, "--reward", "my_rewards:first_letter", "--reward", "my_rewards.py:first_letter=0.5",
                "--output", str(tmp_path / "run"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert 0.0 <= record["reward_mean"] <= 1.5
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert "reward_functions" in config and "my_rewards.py:first_letter=0.5" in config
    both = _cli("train", *common, "--reward", "my_rewards:first_letter", "--env", "math", "--output",
                str(tmp_path / "x"), cwd=tmp_path)
    assert both.returncode == 2 and "--reward and --env math" in both.stderr
    missing = _cli("train", "--preset", "toy", "--reward", "my_rewards:nope", "--data.prompt_dataset", str(rows),
                   "--output", str(tmp_path / "y"), cwd=tmp_path)
    assert missing.returncode == 2 and "my_rewards has no nope" in missing.stderr and "Traceback" not in missing.stderr


def test_real_numbers_of_any_kind_count_and_the_refusal_says_why():
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    returned = {}

    def fixed(prompt, completion, **row):
        return returned["value"]

    env = make_environment("reward_functions", {"data.prompt_dataset": ROWS}, rewards=[fixed])
    accepted = [(np.float32(0.5), 0.5), (np.float16(0.25), 0.25), (np.float64(2.0), 2.0), (np.int64(3), 3.0),
                (np.int8(-2), -2.0), (np.uint16(7), 7.0), (np.array(1.5), 1.5), (torch.tensor(0.75), 0.75),
                (True, 1.0), (False, 0.0), (np.bool_(True), 1.0), (4, 4.0), (0.125, 0.125)]
    for value, expected in accepted:
        returned["value"] = value
        env.reset(seed=0)
        result = env.step("a")
        assert result.reward == expected and type(result.info["reward/fixed"]) is float, value
    refused = [("1.0", "'1.0': a str, not a number"), (None, "None: a NoneType, not a number"),
               (np.array([1.0, 2.0]), "a ndarray, not a number"), (np.float32("inf"), "not a finite number"),
               (10**400, "not a finite number"), ([0.0] * 10_000, "a list, not a number")]
    for value, needle in refused:
        returned["value"] = value
        env.reset(seed=0)
        with pytest.raises(ValueError, match=r"reward function fixed returned .*" + needle) as err:
            env.step("a")
        assert len(str(err.value)) < 300 and "\n" not in str(err.value)


def test_a_function_that_changes_its_row_changes_no_later_call():
    rows = [{"prompt": [{"role": "user", "content": "say a:"}], "answer": "a", "meta": {"tags": ["x"]}}]
    seen = []

    def vandal(prompt, completion, meta, **row):
        seen.append((json.dumps(prompt), json.dumps(meta)))
        meta["tags"].append("changed")
        prompt[0]["content"] = "changed"
        prompt.append({"role": "user", "content": "more"})
        return 1.0

    env = make_environment("reward_functions", {"data.prompt_dataset": rows}, rewards=[vandal, vandal])
    for _ in range(2):
        env.reset(seed=0)
        env.step("a")
    assert len(seen) == 4 and len(set(seen)) == 1
    assert seen[0] == (json.dumps([{"role": "user", "content": "say a:"}]), json.dumps({"tags": ["x"]}))
