"""`flashreinforce train`: a careless command line gets a one-line error naming the flag and exit
status 2 (never a traceback); a reused output directory is refused unless told what to do; a user's
environment with a plain constructor works under every preset."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashreinforce.cli import main
from flashreinforce.config import parse_train_args
from flashreinforce.config.presets import PRESETS
from flashreinforce.envs.base import Environment, StepResult

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["--rollout.batch_size", "4", "--rollout.num_workers", "1", "--ckpt.save_steps", "0",
         "--no_progress", "--eval.steps", "0", "--eval.eval_at_start", "false"]


class PlainEnv(Environment):
    """A user's environment whose constructor takes no argument."""

    def __init__(self):
        self.turn = 0

    def reset(self, *, seed):
        return "say a:"

    def step(self, action):
        return StepResult(reward=float(action[:1] == "a"), done=True)


def _run(argv, capsys):
    code = main(["train", *argv])
    return code, capsys.readouterr().err


def _one_line_error(code, err, needle):
    assert code == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if "error" in ln]
    assert len(lines) == 1 and needle in lines[0], err[-3000:]


@pytest.mark.parametrize("argv,needle", [
    (["--env.kwargs", "[1,2]"], "--env.kwargs"),
    (["--env", "no_such_module_xyz:Env"], "--env"),
    (["--env", "flashreinforce.envs.toy:NoSuchEnv"], "--env"),
    (["--env", f"{__name__}:PlainEnv", "--env.kwargs", '{"turns": 3}'], "--env.kwargs"),
    (["--resume", "/nonexistent/run"], "--resume"),
    (["--actor.adam.betas", "1.5", "0.99"], "--actor.adam.betas"),
    (["--train.max_steps", "0"], "--train.max_steps 0"),
    (["--torch_threads", "0"], "--torch_threads"),
    (["--seed", str(10**26)], "--seed must be an integer in [0, 2**63 - 1]"),
])
def test_a_bad_value_is_a_one_line_error_naming_the_flag(tmp_path, capsys, argv, needle):
    code, err = _run(["--preset", "toy", *QUICK, "--output", str(tmp_path / "run"), *argv], capsys)
    _one_line_error(code, err, needle)


@pytest.mark.parametrize("depth,needle", [(20_000, "nested too deeply to read"), (40, "nested deeper than 32 levels")])
def test_a_json_flag_nested_too_deeply_is_one_line(tmp_path, capsys, depth, needle):
    with pytest.raises(SystemExit) as exited:  # argparse's own exit, status 2
        main(["train", "--preset", "toy", "--output", str(tmp_path / "run"),
              "--env.kwargs", '{"x": ' + "[" * depth + "]" * depth + "}"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and "--env.kwargs: JSON out of bounds" in err and needle in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_cuda_without_a_gpu_is_a_one_line_error(tmp_path, capsys):
    code, err = _run(["--preset", "toy", *QUICK, "--output", str(tmp_path / "run"), "--device", "cuda"], capsys)
    _one_line_error(code, err, "--device")


def test_an_output_under_a_file_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    code, err = _run(["--preset", "toy", *QUICK, "--output", str(tmp_path / "file" / "run")], capsys)
    _one_line_error(code, err, "--output")


@pytest.mark.parametrize("broken", ["config", "weights"])
def test_a_model_directory_that_cannot_be_loaded_is_a_one_line_error(tmp_path, capsys, broken):
    from python_tests.builders import tiny_causal_lm

    model_dir = tmp_path / "model"
    tiny_causal_lm(100, layers=1).save_pretrained(model_dir)
    if broken == "config":
        (model_dir / "config.json").write_text('{"model_type": "qwen2", "hidden')
    else:
        weights = model_dir / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    code, err = _run(["--preset", "toy", *QUICK, "--model", str(model_dir), "--tokenizer", "char",
                      "--output", str(tmp_path / "run")], capsys)
    _one_line_error(code, err, "--model")


def test_a_missing_env_module_through_the_console_script():
    proc = subprocess.run([sys.executable, "-m", "flashreinforce.cli", "train", "--preset", "toy", "--output",
                           "/tmp/unused", "--env", "no_such_module_xyz:Env"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--env" in proc.stderr and "no_such_module_xyz" in proc.stderr


def test_a_reused_output_is_refused_unless_resumed_or_overwritten(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--preset", "toy", *QUICK, "--train.max_steps", "2", "--output", str(out)]
    code, err = _run(argv, capsys)
    assert code == 0, err[-3000:]
    before = (out / "metrics.jsonl").read_text()
    code, err = _run(argv, capsys)
    _one_line_error(code, err, str(out))
    assert "--resume" in err and "--overwrite" in err
    assert (out / "metrics.jsonl").read_text() == before  # nothing touched
    (out / "notes.txt").write_text("mine")
    code, err = _run([*argv, "--overwrite", "--train.max_steps", "1"], capsys)
    assert code == 0, err[-3000:]
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_00000001"]
    assert (out / "notes.txt").read_text() == "mine"  # only the run's own files are cleared
    code, err = _run([*argv, "--overwrite", "--resume"], capsys)
    _one_line_error(code, err, "--overwrite")


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_preset_s_environment_arguments_are_dropped_when_env_replaces_it(preset):
    cfg = parse_train_args(["--preset", preset, "--env", f"{__name__}:PlainEnv", "--output", "x"], PRESETS)
    assert cfg.env_kwargs == {}
    if PRESETS[preset].get("env.kwargs"):
        assert "env.kwargs" in cfg.inactive and any("env.kwargs" in w for w in cfg.warnings)
    # given explicitly, they are kept
    cfg = parse_train_args(["--preset", preset, "--env", f"{__name__}:PlainEnv", "--env.kwargs", '{"a": 1}',
                            "--output", "x"], PRESETS)
    assert cfg.env_kwargs == {"a": 1}


def test_a_plain_environment_trains_under_the_toy_preset(tmp_path, capsys):
    out = tmp_path / "run"
    code, err = _run(["--preset", "toy", *QUICK, "--env", f"{__name__}:PlainEnv", "--train.max_steps", "1",
                      "--output", str(out)], capsys)
    assert code == 0, err[-3000:]
    cfg = json.loads((out / "config.json").read_text())
    assert "env.kwargs" in cfg["inactive"]
    # the constructor takes none of the preset's arguments: the warning is moot (a note only)
    assert not any("env.kwargs" in w for w in cfg["warnings"])


def _float_flags():
    from flashreinforce.config.trainer_config import FLAGS

    return [(f.name, "inf:" in f.help) for f in FLAGS if f.type == "float"]


@pytest.mark.parametrize("name,says_inf", _float_flags())
def test_inf_is_taken_only_where_the_help_says_what_it_means(name, says_inf):
    from flashreinforce.config import ConfigError

    argv = ["--preset", "toy", "--output", "/nonexistent/run", f"--{name}", "inf"]
    if says_inf:
        assert parse_train_args(argv, PRESETS)[name] == float("inf")
    else:
        with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
            parse_train_args(argv, PRESETS)
