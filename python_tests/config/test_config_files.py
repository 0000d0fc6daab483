"""Config files (--config) and the run's own config.yaml: the layers' order, the file format both
ways, and --resume reading the run's settings (refusing a change of what the run is)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flashreinforce.config import ConfigError, parse_train_args, read_config_file, resolve, write_config_file
from flashreinforce.config.presets import PRESETS

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["--rollout.batch_size", "8", "--eval.eval_at_start", "false", "--no_progress",
         "--ckpt.save_steps", "1"]


def parse(*argv):
    return parse_train_args(list(argv), PRESETS)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_nested_dotted_and_mixed_keys_and_the_order_of_the_layers(tmp_path):
    cfg_file = _write(tmp_path / "run.yaml", """
preset: toy
train: {max_steps: 20, micro_batch_size: 4}
actor.adam.lr: 2.0e-4
logger:
  tensorboard: {dir: null}
  logging_steps: 3
env:
  kwargs: {alphabet: abc, turns: 1}
""")
    cfg = parse("--config", str(cfg_file), "--output", "x", "--train.micro_batch_size", "2")
    assert cfg.preset == "toy" and cfg.train.agent_path == PRESETS["toy"]["env"]
    assert cfg.train.max_steps == 20                  # the file over the preset (400)
    assert cfg.train.micro_batch_trajectories == 2            # the flag over the file
    assert cfg.actor.adam.lr == 2e-4 and cfg.logger.logging_steps == 3
    assert cfg.env_kwargs == {"alphabet": "abc", "turns": 1}
    assert cfg.rollout.batch_size == PRESETS["toy"]["rollout.batch_size"]  # the preset under the file
    assert parse("--config", str(cfg_file), "--preset", "toy_multiturn", "--output", "x").preset == "toy_multiturn"


def test_json_files_and_yaml_numbers_written_without_a_dot(tmp_path):
    as_json = _write(tmp_path / "run.json", json.dumps({"preset": "toy", "train": {"max_steps": 7}}))
    assert parse("--config", str(as_json), "--output", "x").train.max_steps == 7
    plain = _write(tmp_path / "lr.yaml", "preset: toy\nactor.adam.lr: 1e-5\n")  # PyYAML reads 1e-5 as a string
    assert parse("--config", str(plain), "--output", "x").actor.adam.lr == 1e-5


@pytest.mark.parametrize("text,needle", [
    ("train: {max_stepz: 3}\n", "unknown key train.max_stepz; did you mean --train.max_steps"),
    ("actor:\n  adam: {lr: [1, 2]}\n", "--actor.adam.lr must be a number"),
    ("train: {max_steps: 3\n", "not valid YAML"),
    ("output: runs/x\n", "output is a command-line option"),
    ("- 1\n- 2\n", "expected a mapping of settings"),
])
def test_a_bad_file_is_one_line_naming_it(tmp_path, text, needle):
    bad = _write(tmp_path / "bad.yaml", text)
    with pytest.raises(ConfigError) as err:
        parse("--config", str(bad), "--output", "x")
    assert needle in str(err.value) and "\n" not in str(err.value)
    if "unknown" in needle or "option" in needle:
        assert str(bad) in str(err.value)


def test_the_written_config_reads_back_as_the_same_run(tmp_path):
    cfg = parse("--preset", "arith", "--output", "x", "--actor.flash_gate_delta", "inf", "--train.max_steps", "9",
                "--reward", "my_mod:f=0.5", "--data.prompt_dataset", "rows.jsonl")
    write_config_file(cfg, tmp_path / "config.yaml")
    again = resolve({}, None, read_config_file(tmp_path / "config.yaml"))
    assert again.flags == cfg.flags
    for name in ("preset", "env_kwargs", "rewards", "tokenizer", "seed", "device", "torch_threads"):
        assert getattr(again, name) == getattr(cfg, name), name


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "flashreinforce.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def _error(proc) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


@pytest.mark.slow
def test_resume_needs_only_the_output_and_refuses_to_change_what_the_run_is(tmp_path):
    out = tmp_path / "run"
    first = _cli("train", "--preset", "toy", "--output", str(out), "--train.max_steps", "2", *QUICK)
    assert first.returncode == 0, first.stderr[-3000:]
    assert read_config_file(out / "config.yaml")["train.max_steps"] == 2
    # nothing but --output and --resume (and a longer run, and another logging cadence: allowed)
    longer = _cli("train", "--output", str(out), "--resume", "--train.max_steps", "3", "--logger.logging_steps", "2")
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert read_config_file(out / "config.yaml")["rollout.batch_size"] == 8  # kept from the first invocation
    # another model, another loss threshold: listed and refused, nothing trained
    changed = _cli("train", "--output", str(out), "--resume", "--train.max_steps", "4", "--model",
                   "tests/nothing.json", "--actor.flash_gate_delta", "0.5")
    assert changed.returncode == 2
    line = _error(changed)
    assert "--actor.model_name_or_path: the run has 'tiny-qwen2', now 'tests/nothing.json'" in line
    assert "--actor.flash_gate_delta: the run has 0.05, now 0.5" in line and "--allow_config_change" in line
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    # confirmed: the run goes on with the new threshold
    allowed = _cli("train", "--output", str(out), "--resume", "--train.max_steps", "4", "--actor.flash_gate_delta",
                   "0.5", "--allow_config_change")
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert read_config_file(out / "config.yaml")["actor.flash_gate_delta"] == 0.5


@pytest.mark.slow
def test_a_run_with_only_config_json_resumes_from_its_flags_and_keeps_its_preset(tmp_path):
    out = tmp_path / "run"
    first = _cli("train", "--preset", "toy", "--output", str(out), "--train.max_steps", "1", *QUICK)
    assert first.returncode == 0, first.stderr[-3000:]
    (out / "config.yaml").unlink()  # a run written before config.yaml existed
    other = _cli("train", "--preset", "toy_multiturn", "--output", str(out), "--resume", "--train.max_steps", "2")
    assert other.returncode == 2
    line = _error(other)
    assert "--preset: the run has 'toy', now 'toy_multiturn'" in line
    same = _cli("train", "--output", str(out), "--resume", "--train.max_steps", "2")
    assert same.returncode == 0, same.stderr[-3000:]
    assert (out / "config.yaml").is_file()


_BOMB = "".join(f"    {a}: &{a} [{', '.join([f'*{p}'] * 9) if p else ', '.join(['x'] * 9)}]\n"
                for p, a in zip([None, "a", "b", "c", "d", "e", "f", "g"], "abcdefgh"))


@pytest.mark.parametrize("name,content,needle", [
    ("bomb.yaml", "preset: toy\nenv:\n  kwargs:\n" + _BOMB, "more than 100000 values once YAML aliases are expanded"),
    ("self.yaml", "env.kwargs: &a {x: *a}\n", "a value that contains itself"),
    ("deep.yaml", "env.kwargs: {x: " + "[" * 5000 + "]" * 5000 + "}\n", "nested too deeply to read"),
    ("deep40.yaml", "env.kwargs: {x: " + "[" * 40 + "]" * 40 + "}\n", "values nested deeper than 32 levels"),
    ("deep.json", '{"env.kwargs": {"x": ' + "[" * 100_000 + "]" * 100_000 + "}}", "nested too deeply to read"),
    ("twice.yaml", "train:\n  max_steps: 5\n  max_steps: 6\n", "key 'max_steps' is given twice in one mapping (lines 2 and 3)"),
    ("sections.yaml", "train:\n  max_steps: 5\nseed: 1\ntrain:\n  batch_size: 8\n",
     "key 'train' is given twice in one mapping (lines 1 and 4)"),
    ("twice.json", '{"seed": 1, "train": {"max_steps": 3}, "seed": 2}', "key 'seed' is given twice in one object"),
    ("latin1.yaml", b"seed: 1\n# caf\xe9\n", "not UTF-8 text (byte 0xe9 at offset 13, line 2)"),
    ("seed.yaml", "seed: 100000000000000000000000000\n", "--seed must be an integer in [0, 2**63 - 1]"),
    ("seed.json", '{"seed": 1e26}', "--seed must be an integer, got 1e+26"),
])
def test_a_hostile_or_broken_file_is_one_short_line(tmp_path, name, content, needle):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError) as err:
        parse("--config", str(path), "--output", str(tmp_path / "run"))
    message = str(err.value)
    assert needle in message and "\n" not in message and len(message) < 400, message[:1000]
    assert not (tmp_path / "run").exists()


def test_a_file_s_error_through_the_command_is_one_short_line(tmp_path):
    # The alias bomb that printed its expansion (1.37 GB of stderr), and a large but honest
    # env.kwargs the environment does not take: both one line of bounded length, exit status 2.
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("preset: toy\nenv:\n  kwargs:\n" + _BOMB)
    big = tmp_path / "big.yaml"
    big.write_text("preset: toy\nenv: python_tests.config.test_cli_errors:PlainEnv\nenv.kwargs:\n  rows: ["
                   + ", ".join(["x" * 40] * 20_000) + "]\n")
    for path, needle in ((bomb, "YAML aliases"), (big, "--env.kwargs")):
        done = subprocess.run([sys.executable, "-m", "flashreinforce.cli", "train", "--config", str(path), "--output",
                               str(tmp_path / "run"), "--train.max_steps", "1"], capture_output=True, text=True,
                              timeout=300, cwd=ROOT)
        assert done.returncode == 2, done.stderr[-2000:]
        lines = [ln for ln in done.stderr.splitlines() if "error" in ln]
        assert len(lines) == 1 and needle in lines[0] and len(done.stderr) < 2000, done.stderr[:3000]
