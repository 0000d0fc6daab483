"""What a resumed run does with what the user changed: the resume table (locked, or in effect and
said so), the run's own record of its settings and paths, the optimizer's settings over its restored
state, the prompt order of the pass in progress, and the history files the checkpoint vouches for."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashreinforce.config import FLAGS, ConfigError, parse_train_args, write_config_file
from flashreinforce.config.files import LOCKED, RUN_SETTINGS, absolute_paths, rule
from flashreinforce.config.presets import PRESETS
from flashreinforce.trainer.rollout.buffer import PromptStream
from flashreinforce.trainer.learning.learner import Learner, LearnerSettings
from flashreinforce.trainer.persistence.run_history import HistoryRecord, trim_history
from python_tests.builders import random_trajectory, tiny_causal_lm

ROOT = Path(__file__).resolve().parents[3]


# ---------------------------------------------------------------- the table, in the docs and the code

def _docs_table() -> dict[str, str]:
    """The resume table of docs/trainer.md: setting -> rule, for its rows naming one setting."""
    text = (ROOT / "docs" / "trainer.md").read_text()
    section = text[text.index("### The resume table"):]
    section = section[:section.index("\n## ")]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            for name in re.findall(r"`([a-z_.]+)`", cells[0]):
                rows[name] = cells[1].split(":")[0].split(" (")[0]
    return rows


def test_every_setting_has_one_rule_and_the_docs_table_lists_the_locked_ones():
    names = [f.name for f in FLAGS] + list(RUN_SETTINGS)
    assert {rule(n) for n in names} == {"locked", "takes effect"}
    assert set(LOCKED) <= set(names)
    table = _docs_table()
    documented_locked = {n for n, r in table.items() if r == "locked"}
    code_locked = {{"env_kwargs": "env.kwargs", "rewards": "reward"}.get(n, n) for n in LOCKED}
    assert documented_locked == code_locked
    for name, documented in table.items():  # every setting a row names agrees with the code too
        code = {"env.kwargs": "env_kwargs", "reward": "rewards"}.get(name, name)
        if documented in ("locked", "takes effect"):
            assert rule(code) == documented, name


# ---------------------------------------------------------------- the run's record, not the file it reads

def test_an_edited_config_yaml_is_compared_with_the_run_s_record(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "say a:", "target": "a"}) + "\n")
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"prompt": "say b:", "target": "b"}) + "\n")
    out = tmp_path / "run"
    out.mkdir()
    cfg = parse_train_args(["--preset", "toy", "--data.prompt_dataset", str(data), "--output", str(out)], PRESETS)
    (out / "config.json").write_text(json.dumps(cfg.to_json(), default=str))
    cfg.set("data.prompt_dataset", str(other))  # the user edits the dataset in OUTPUT/config.yaml
    write_config_file(cfg, out / "config.yaml")
    with pytest.raises(ConfigError) as err:
        parse_train_args(["--output", str(out), "--resume"], PRESETS)
    message = str(err.value)
    assert f"--data.prompt_dataset: the run has '{data}', now '{other}'" in message and "\n" not in message
    assert parse_train_args(["--output", str(out), "--resume", "--allow_config_change"], PRESETS).data.prompt_dataset \
        == str(other)
    # and a seed given with --resume is locked too (the prompt order of the passes in progress)
    cfg.set("data.prompt_dataset", str(data))
    write_config_file(cfg, out / "config.yaml")
    with pytest.raises(ConfigError, match=r"--seed: the run has 0, now 7"):
        parse_train_args(["--output", str(out), "--resume", "--seed", "7"], PRESETS)


def test_relative_paths_are_recorded_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rows.jsonl").write_text("{}\n")
    (tmp_path / "my_rewards.py").write_text("def f(prompt, completion, **row):\n    return 0.0\n")
    (tmp_path / "my_env.py").write_text("")
    cfg = parse_train_args(["--reward", "my_rewards.py:f=0.5", "--reward", "some.module:g", "--data.prompt_dataset",
                            "rows.jsonl", "--ckpt.path", "ck", "--model", "tiny-qwen2", "--output", "run"], PRESETS)
    changed = absolute_paths(cfg)
    assert cfg.rewards == [f"{tmp_path}/my_rewards.py:f=0.5", "some.module:g"]
    assert cfg.data.prompt_dataset == f"{tmp_path}/rows.jsonl" and cfg.ckpt.path == f"{tmp_path}/ck"
    assert cfg.actor.model_name_or_path == "tiny-qwen2"  # a built-in name, not a path
    assert set(changed) == {"rewards", "data.prompt_dataset", "ckpt.path"}
    cfg.set("train.agent_path", "my_env.py:Env")
    absolute_paths(cfg)
    assert cfg.train.agent_path == f"{tmp_path}/my_env.py:Env"


# ---------------------------------------------------------------- what takes effect really does

def _learner(lr: float, betas=(0.9, 0.99), scheduler: str = "constant") -> Learner:
    torch.manual_seed(0)
    model = tiny_causal_lm(32)
    return Learner(model, LearnerSettings(lr=lr, betas=betas, scheduler=scheduler, warmup_ratio=0.5, total_steps=8))


def test_a_changed_learning_rate_and_betas_win_over_the_restored_optimizer():
    first = _learner(1e-3)
    gen = random.Random(0)
    for _ in range(2):
        first.step([random_trajectory(gen, 32) for _ in range(4)])
    state = first.state_dict()
    resumed = _learner(0.5, betas=(0.5, 0.6))
    resumed.load_state_dict(state)
    group = resumed.optimizer.param_groups[0]
    assert group["lr"] == 0.5 and group["betas"] == (0.5, 0.6) and resumed.scheduler.base_lrs == [0.5]
    metrics = resumed.step([random_trajectory(gen, 32) for _ in range(4)])
    assert metrics["lr"] == 0.5
    # a schedule changed on resume: the restored position under the new schedule (warmup of 4 steps)
    warm = _learner(0.5, scheduler="constant_with_warmup")
    warm.load_state_dict(state)
    assert warm.optimizer.param_groups[0]["lr"] == pytest.approx(0.5 * 3 / 4)


def test_a_pass_in_progress_keeps_its_order_whatever_the_seed_on_resume():
    stream = PromptStream(num_prompts=48, seed=0)
    first = [stream.next()[1] for _ in range(12)]
    state = json.loads(json.dumps(stream.state_dict()))
    resumed = PromptStream(num_prompts=48, seed=1)  # --seed 1 --allow_config_change
    resumed.load_state_dict(state)
    rest = [resumed.next()[1] for _ in range(36)]
    assert sorted(first + rest) == list(range(48))  # each row of the pass once


# ---------------------------------------------------------------- the history the checkpoint vouches for

def _records(path: Path, steps) -> None:
    with open(path, "a") as fh:
        fh.writelines(json.dumps({"step": s, "policy_version": s, "reward_mean": 0.25}) + "\n" for s in steps)


def test_a_refused_resume_changes_nothing_on_disk(tmp_path):
    # metrics.jsonl holds records past the checkpoint (to be cut), eval.jsonl was edited (refused): the
    # refusal must come before metrics.jsonl is cut, and nothing else is written either.
    record = HistoryRecord(tmp_path)
    _records(tmp_path / "metrics.jsonl", range(1, 4))
    _records(tmp_path / "eval.jsonl", [2])
    at_three = record.snapshot()
    _records(tmp_path / "metrics.jsonl", range(4, 6))
    (tmp_path / ".metrics.jsonl.tmp-0123456789ab").write_text("a killed resume's copy")
    (tmp_path / "eval.jsonl").write_text((tmp_path / "eval.jsonl").read_text().replace("0.25", "0.75"))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    cleaned = []
    with pytest.raises(ConfigError, match=r"eval\.jsonl was changed after the checkpoint at step 3"):
        HistoryRecord(tmp_path).resume(3, at_three, before_writing=lambda: cleaned.append(1))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before and cleaned == []
    # A checkpoint without the record (trim_history's check): a broken line of eval.jsonl is refused
    # before metrics.jsonl is cut.
    (tmp_path / "eval.jsonl").write_text('not json\n{"step": 2}\n')
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ConfigError, match=r"eval\.jsonl line 1: not a JSON record"):
        HistoryRecord(tmp_path).resume(3, None)
    with pytest.raises(ConfigError, match=r"eval\.jsonl line 1: not a JSON record"):
        trim_history(tmp_path, 3)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_the_history_must_begin_as_the_checkpoint_recorded_it(tmp_path, caplog):
    record = HistoryRecord(tmp_path)
    _records(tmp_path / "metrics.jsonl", range(1, 4))
    early = record.snapshot()
    _records(tmp_path / "metrics.jsonl", range(4, 7))
    at_six = record.snapshot()  # incremental: only steps 4-6 were read
    assert at_six["metrics.jsonl"]["bytes"] == (tmp_path / "metrics.jsonl").stat().st_size
    _records(tmp_path / "metrics.jsonl", [7])
    (tmp_path / "metrics.jsonl").open("a").write('{"step": 8, "rew')  # a killed run's half line
    HistoryRecord(tmp_path).resume(6, at_six)  # later records cut off
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == list(range(1, 7))
    text = (tmp_path / "metrics.jsonl").read_text()
    (tmp_path / "metrics.jsonl").write_text(text.replace('"reward_mean": 0.25', '"reward_mean": 0.99', 1))
    with pytest.raises(ConfigError, match=r"metrics\.jsonl was changed after the checkpoint at step 6"):
        HistoryRecord(tmp_path).resume(6, at_six)
    (tmp_path / "metrics.jsonl").write_text(text[: len(text) // 2])
    with pytest.raises(ConfigError, match=r"records it vouches for were cut off; restore it, or move it aside"):
        HistoryRecord(tmp_path).resume(6, at_six)
    (tmp_path / "metrics.jsonl").unlink()
    with caplog.at_level(logging.WARNING):
        HistoryRecord(tmp_path).resume(3, early)
    assert any("metrics.jsonl is missing" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("steps,needle", [([1, 2, 4], "1 missing, the first 3"), ([1, 2, 2, 3], "step 2 appears twice"),
                                          ([1, 3, 2], "step 2 comes after step 3"), ([1, 2], "1 missing, the first 3")])
def test_a_checkpoint_without_a_record_still_needs_every_update_once(tmp_path, steps, needle):
    _records(tmp_path / "metrics.jsonl", steps)
    with pytest.raises(ConfigError) as err:
        trim_history(tmp_path, 3)
    assert needle in str(err.value) and "metrics.jsonl" in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------- end to end

_REWARDS = "def score(prompt, completion, **row):\n    return {value}\n"


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "flashreinforce.cli", "train", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=900, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def _metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _error(done) -> str:
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    (line,) = [ln for ln in done.stderr.splitlines() if ln.startswith("flashreinforce train: error:")]
    return line


@pytest.mark.slow
def test_a_resumed_run_keeps_its_files_and_takes_a_new_learning_rate(tmp_path):
    # Started in `first` with relative paths, resumed from `elsewhere`, which holds files of the
    # same names that score 1.0: the run goes on with its own (reward 0). A new learning rate
    # takes effect and is said; a changed seed, an edited config.yaml or metrics.jsonl is refused.
    first, elsewhere = tmp_path / "first", tmp_path / "elsewhere"
    for folder, value in ((first, "0.0"), (elsewhere, "1.0")):
        folder.mkdir()
        (folder / "rewards.py").write_text(_REWARDS.format(value=value))
        (folder / "rows.jsonl").write_text("".join(json.dumps({"prompt": f"say {c}:"}) + "\n" for c in "abcdefgh"))
    out = tmp_path / "run"
    common = ["--preset", "toy", "--rollout.batch_size", "8", "--eval.eval_at_start",
              "false", "--no_progress", "--ckpt.save_steps", "1", "--actor.lr_scheduler", "constant"]
    started = _cli(*common, "--data.prompt_dataset", "rows.jsonl", "--reward", "rewards.py:score", "--output", str(out),
                   "--train.max_steps", "2", cwd=first)
    assert started.returncode == 0, started.stderr[-3000:]
    assert [r["reward_mean"] for r in _metrics(out)] == [0.0, 0.0]
    resumed = _cli("--output", str(out), "--resume", "--train.max_steps", "4", "--actor.adam.lr", "0.5", cwd=elsewhere)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["reward_mean"] for r in rows] == [0.0] * 4  # its own reward file and rows, not elsewhere's
    assert [r["lr"] for r in rows] == [1e-3, 1e-3, 0.5, 0.5]
    record = json.loads((out / "config.json").read_text())
    said = [w for w in record["warnings"] if w.startswith("--resume: changed since the run's checkpoint")]
    assert len(said) == 1 and "--actor.adam.lr: the run has 0.001, now 0.5" in said[0]
    assert "--actor.adam.lr: the run has 0.001, now 0.5" in resumed.stderr
    # refused, nothing trained: another seed; an edited config.yaml; an edited history
    assert "--seed: the run has 0, now 3" in _error(_cli("--output", str(out), "--resume", "--train.max_steps", "5",
                                                         "--seed", "3", cwd=elsewhere))
    yaml_text = (out / "config.yaml").read_text()
    (out / "config.yaml").write_text(yaml_text.replace(str(first / "rows.jsonl"), str(elsewhere / "rows.jsonl")))
    line = _error(_cli("--output", str(out), "--resume", "--train.max_steps", "5", cwd=elsewhere))
    # the error line is shortened in its middle when long: its head and tail
    assert "this would change what the run in" in line and line.endswith(
        "elsewhere/rows.jsonl'. Give --allow_config_change to continue anyway, or another --output for a new run")
    (out / "config.yaml").write_text(yaml_text)
    (out / "config.json").write_text(json.dumps(record).replace(str(first / "rows.jsonl"), str(elsewhere / "rows.jsonl")))
    line = _error(_cli("--output", str(out), "--resume", "--train.max_steps", "5", cwd=elsewhere))  # both files edited
    assert "this would change what the run in" in line and line.endswith("first/rows.jsonl'. Give --allow_config_change "
                                                                       "to continue anyway, or another --output for a new run")
    (out / "config.json").write_text(json.dumps(record))
    text = (out / "metrics.jsonl").read_text()
    (out / "metrics.jsonl").write_text(text.replace('"step": 2,', '"step": 3,', 1))
    line = _error(_cli("--output", str(out), "--resume", "--train.max_steps", "5", cwd=elsewhere))
    assert "metrics.jsonl was changed after the checkpoint at step 4" in line
    assert len(_metrics(out)) == 4
