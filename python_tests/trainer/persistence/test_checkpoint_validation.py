"""Checkpoints are checked for meaning, not only for form: non-finite weights or optimizer moments,
a state.json whose fields are out of range or disagree with each other or with the optimizer, an
optimizer or weights file of another model, a ``latest`` pointer or step directory that is not this
run's. Each is refused at load with a message naming the file and what is wrong, before the model
is touched; ``--resume`` falls back to the newest valid checkpoint with one line per refused one."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_model

from flashreinforce.config import ConfigError
from flashreinforce.trainer.persistence.checkpoints import (CheckpointError, ResumePoint, clear_run, find_checkpoint,
                                                            latest_checkpoint, load_checkpoint)
from python_tests.trainer.persistence.checkpoint_helpers import save, same, tiny_model, weights


def _refused(path: Path, pattern: str, model: torch.nn.Module | None = None) -> str:
    """Load ``path`` into a fresh model: it must be refused with ``pattern`` and leave the model as it was."""
    model = model if model is not None else tiny_model(5)
    before = weights(model)
    with pytest.raises(CheckpointError, match=pattern) as info:
        load_checkpoint(path, model=model)
    assert same(weights(model), before), "the model was touched by a refused checkpoint"
    assert "\n" not in str(info.value)
    return str(info.value)


def _edit_json(path: Path, edit) -> None:
    state = json.loads((path / "state.json").read_text())
    edit(state)
    (path / "state.json").write_text(json.dumps(state))


def _edit_optimizer(path: Path, edit) -> None:
    opt = torch.load(path / "optimizer.pt", weights_only=True)
    edit(opt)
    torch.save(opt, path / "optimizer.pt")


# ---------------------------------------------------------------- non-finite values


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_optimizer_moments_are_refused_naming_the_parameter(tmp_path, value):
    path = save(tmp_path / "ck", 3, tiny_model(1))

    def poison(opt):
        opt["state"][3]["exp_avg"][0] = value
    _edit_optimizer(path, poison)
    message = _refused(path, r"optimizer\.pt.*non-finite")
    name = [n for n, _ in tiny_model().named_parameters()][3]
    assert name in message and "exp_avg" in message


@pytest.mark.parametrize("value", [math.nan, -math.inf])
def test_non_finite_weights_are_refused_naming_the_first_bad_tensor(tmp_path, value):
    model = tiny_model(1)
    path = save(tmp_path / "ck", 3, model)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[2, 3] = value
        model.model.norm.weight.fill_(value)
    save_model(model, str(path / "model.safetensors"))
    message = _refused(path, r"model\.safetensors.*non-finite")
    assert "model.layers.0.mlp.up_proj.weight" in message and "1 of 2048" in message  # sorted: layers < norm


def test_a_non_finite_checkpoint_is_skipped_by_resume_with_one_line(tmp_path, caplog):
    d = tmp_path / "checkpoints"
    good = tiny_model(1)
    save(d, 3, good)
    bad = save(d, 6, tiny_model(2))
    _edit_optimizer(bad, lambda opt: opt["state"][0]["exp_avg_sq"].fill_(math.nan))
    probe = tiny_model(5)
    with caplog.at_level(logging.WARNING):
        point = ResumePoint.load(d, "latest", probe)
    assert point.step == 3 and same(weights(probe), weights(good))
    (refusal,) = [r.getMessage() for r in caplog.records if "refused the checkpoint" in r.getMessage()]
    assert "step_00000006" in refusal and "non-finite" in refusal and "older" in refusal
    assert any("resuming from" in r.getMessage() and "step_00000003" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- state.json: types, ranges, consistency


def _set(key, value):
    def edit(state):
        target = state
        *parents, last = key.split(".")
        for k in parents:
            target = target[k]
        if value is _DELETE:
            del target[last]
        else:
            target[last] = value
    return edit


_DELETE = object()

STATE_CORRUPTIONS = [
    ("negative step", _set("step", -3), r"'step' must be >= 0"),
    ("step past the run", _set("step", 1_000_000), r"'version' 6 differs from 'step' 1000000"),
    ("step as a float", _set("step", 1e6), r"'step' must be an integer"),
    ("step as a string", _set("step", "6"), r"'step' must be an integer"),
    ("step as a boolean", _set("step", True), r"'step' must be an integer"),
    ("version not the step", _set("version", 5), r"'version' 5 differs from 'step' 6"),
    ("step past max_steps", lambda s: s.update(step=12, version=12), r"'step' 12 is past 'max_steps' 10"),
    ("negative max_steps", _set("max_steps", -1), r"'max_steps' must be >= 0"),
    ("buffer not an object", _set("buffer", [1, 2]), r"'buffer' must be an object"),
    ("buffer without updates_done", _set("buffer.updates_done", _DELETE), r"'buffer\.updates_done' is missing"),
    ("updates_done not step + skipped", _set("buffer.updates_done", 9),
     r"'buffer\.updates_done' 9 is not 'step' 6 \+ 'trainer\.skipped_updates' 0"),
    ("negative counter", _set("buffer.counters.taken_groups", -4), r"'buffer\.counters\.taken_groups' must be >= 0"),
    ("buffer without prompts", _set("buffer.prompts", _DELETE), r"'buffer\.prompts' is missing"),
    ("next_id a string", _set("buffer.prompts.next_id", "26"), r"'buffer\.prompts\.next_id' must be an integer"),
    ("requeued entry malformed", _set("buffer.prompts.requeued", [[24]]),
     r"'buffer\.prompts\.requeued\[0\]' must be a \[prompt id, seed\] pair"),
    ("requeued prompt never handed out", _set("buffer.prompts.requeued", [[99, 1]]),
     r"'buffer\.prompts\.requeued\[0\]' names prompt 99, not handed out yet"),
    ("negative seed", _set("buffer.prompts.requeued", [[3, -1]]), r"'buffer\.prompts\.requeued\[0\]\[1\]' must be >= 0"),
    ("prompt_attempts key not an id", _set("buffer.prompt_attempts", {"x": 1}),
     r"'buffer\.prompt_attempts' key 'x' is not a prompt id"),
    ("prompt_attempts count zero", _set("buffer.prompt_attempts", {"3": 0}),
     r"'buffer\.prompt_attempts\.3' must be >= 1"),
    ("trainer not an object", _set("trainer", 3), r"'trainer' must be an object"),
    ("skipped_updates a float", _set("trainer.skipped_updates", 0.5), r"'trainer\.skipped_updates' must be an integer"),
    ("wall time NaN", _set("trainer.wall_time_s", math.nan), r"'trainer\.wall_time_s' must be a finite number"),
    ("unknown optimizer format", _set("optimizer_format", "zero3"), r"'optimizer_format' must be"),
]


@pytest.mark.parametrize("kind,edit,pattern", STATE_CORRUPTIONS, ids=[c[0] for c in STATE_CORRUPTIONS])
def test_a_state_json_field_out_of_type_range_or_agreement_is_refused(tmp_path, kind, edit, pattern):
    path = save(tmp_path / "ck", 6, tiny_model(1))
    _edit_json(path, edit)
    _refused(path, r"state\.json: .*" + pattern)


def test_a_step_directory_whose_name_disagrees_with_its_state_is_refused(tmp_path, caplog):
    d = tmp_path / "checkpoints"
    save(d, 3, tiny_model(1))
    path = save(d, 6, tiny_model(2))
    renamed = path.rename(d / "step_00000007")
    (d / "latest").write_text(renamed.name)
    _refused(renamed, r"state\.json: 'step' is 6 but the directory is named for step 7")
    with caplog.at_level(logging.WARNING):
        assert ResumePoint.load(d, "latest", tiny_model(5)).step == 3


# ---------------------------------------------------------------- optimizer and scheduler against the model


def test_an_optimizer_moment_of_the_wrong_shape_is_refused_naming_both_shapes(tmp_path):
    path = save(tmp_path / "ck", 3, tiny_model(1))
    _edit_optimizer(path, lambda opt: opt["state"][1].update(exp_avg=torch.zeros(16, 32)))
    name = [n for n, _ in tiny_model().named_parameters()][1]
    _refused(path, rf"optimizer\.pt: 'exp_avg' of parameter '{name}' has shape \[16, 32\], the parameter's is \[32, 32\]")


def test_an_optimizer_of_another_parameter_count_is_refused(tmp_path):
    path = save(tmp_path / "ck", 3, tiny_model(1))

    def drop_last(opt):
        last = opt["param_groups"][0]["params"].pop()
        opt["state"].pop(last)
    _edit_optimizer(path, drop_last)
    _refused(path, r"optimizer\.pt: holds 13 parameters, the model has 14 trainable ones")


def test_an_optimizer_step_count_that_disagrees_with_the_version_is_refused(tmp_path):
    path = save(tmp_path / "ck", 3, tiny_model(1))
    _edit_optimizer(path, lambda opt: [entry.update(step=torch.tensor(40.0)) for entry in opt["state"].values()])
    _refused(path, r"optimizer\.pt: .*step count 40, past the policy version 3")


def test_an_empty_optimizer_state_with_a_nonzero_version_is_refused(tmp_path):
    path = save(tmp_path / "ck", 3, tiny_model(1))
    _edit_optimizer(path, lambda opt: opt["state"].clear())
    _refused(path, r"optimizer\.pt: no optimizer moments, but the policy version is 3")


def test_a_scheduler_position_that_disagrees_with_the_version_is_refused(tmp_path):
    path = save(tmp_path / "ck", 3, tiny_model(1))
    sched = torch.load(path / "scheduler.pt", weights_only=True)
    sched["last_epoch"] = 8
    torch.save(sched, path / "scheduler.pt")
    _refused(path, r"scheduler\.pt: 'last_epoch' 8 differs from the policy version 3")


def test_weights_of_another_shape_name_the_tensor_and_both_shapes(tmp_path):
    path = save(tmp_path / "ck", 3, tiny_model(1))
    bigger = tiny_model(5, vocab=50)
    # the tied embedding is stored once, under one of its two names
    _refused(path, r"model\.safetensors: tensor '(lm_head|model\.embed_tokens)\.weight' has shape \[40, 32\], the "
                   r"model's is \[50, 32\]", model=bigger)


# ---------------------------------------------------------------- the latest pointer and step directories


@pytest.mark.parametrize("pointer", ["../../other_run/checkpoints/step_00000008", "ABSOLUTE", "step_00000008/..",
                                     "notes.txt"])
def test_latest_must_name_a_step_directory_of_this_run(tmp_path, caplog, pointer):
    other = tmp_path / "other_run" / "checkpoints"
    save(other, 8, tiny_model(3))
    d = tmp_path / "runs" / "this" / "checkpoints"
    mine = tiny_model(1)
    save(d, 3, mine)
    (d / "notes.txt").mkdir()
    pointer = str(other / "step_00000008") if pointer == "ABSOLUTE" else pointer
    (d / "latest").write_text(pointer)
    assert latest_checkpoint(d) is None
    probe = tiny_model(5)
    with caplog.at_level(logging.WARNING):
        point = ResumePoint.load(d, "latest", probe)
    assert point.step == 3 and point.path == d / "step_00000003" and same(weights(probe), weights(mine))
    assert any("not a step directory of this run" in r.getMessage() and pointer in r.getMessage()
               for r in caplog.records)


def test_finding_a_checkpoint_ignores_a_latest_that_names_another_run(tmp_path):
    other = tmp_path / "other_run" / "checkpoints"
    save(other, 8, tiny_model(3))
    d = tmp_path / "this" / "checkpoints"
    d.mkdir(parents=True)
    (d / "latest").write_text("../../other_run/checkpoints/step_00000008")
    with pytest.raises(ConfigError, match=r"no checkpoint in .*this/checkpoints"):
        find_checkpoint(d, str(d))
    save(d, 3, tiny_model(1))
    assert find_checkpoint(d, str(d)) == d / "step_00000003"


def test_a_step_directory_that_links_to_another_run_is_ignored(tmp_path):
    other = tmp_path / "other_run" / "checkpoints"
    save(other, 8, tiny_model(3))
    d = tmp_path / "this" / "checkpoints"
    save(d, 3, tiny_model(1))
    os.symlink(other / "step_00000008", d / "step_00000008")
    (d / "latest").write_text("step_00000008")
    assert latest_checkpoint(d) is None
    assert ResumePoint.load(d, "latest", tiny_model(5)).step == 3
    # --overwrite removes the link, not the other run's checkpoint it points at
    clear_run(tmp_path / "this", d, tmp_path / "this" / "hf")
    assert sorted(p.name for p in d.iterdir()) == [] and (other / "step_00000008" / "state.json").is_file()


# ---------------------------------------------------------------- what the user is told


def test_an_explicit_checkpoint_that_is_refused_says_what_to_do(tmp_path):
    d = tmp_path / "checkpoints"
    save(d, 3, tiny_model(1))
    bad = save(d, 6, tiny_model(2))
    _edit_json(bad, _set("step", -3))
    with pytest.raises(ConfigError) as info:
        ResumePoint.load(d, str(bad), tiny_model(5))
    message = str(info.value)
    assert "\n" not in message and "step_00000006" in message and "'step' must be >= 0" in message
    assert f"--resume {d}" in message  # the newest valid one there


def test_no_valid_checkpoint_says_what_to_do(tmp_path):
    d = tmp_path / "checkpoints"
    _edit_optimizer(save(d, 3, tiny_model(1)), lambda opt: opt["state"][0]["exp_avg"].fill_(math.inf))
    with pytest.raises(ConfigError) as info:
        ResumePoint.load(d, "latest", tiny_model(5))
    message = str(info.value)
    assert "\n" not in message and "non-finite" in message and "--overwrite" in message


def test_a_checkpoint_past_the_runs_length_is_refused(tmp_path):
    d = tmp_path / "checkpoints"
    save(d, 6, tiny_model(1))
    point = ResumePoint.load(d, "latest", tiny_model(5))
    point.check_within(6)  # a finished run resumed: nothing left to train, not an error
    with pytest.raises(ConfigError, match=r"step_00000006 is at step 6, past this run's 4 updates.*--train\.max_steps"):
        point.check_within(4)


def test_the_newest_valid_checkpoint_is_also_found_when_latest_is_a_stale_leftover(tmp_path):
    # a crash in the middle of replacing a step leaves latest naming the hidden new copy: still this run's
    d = tmp_path / "checkpoints"
    save(d, 3, tiny_model(1))
    path = save(d, 6, tiny_model(2))
    hidden = d / ".step_00000006.tmp-0123456789ab"
    shutil.copytree(path, hidden)
    (d / "latest").write_text(hidden.name)
    assert latest_checkpoint(d) == hidden
    assert ResumePoint.load(d, "latest", tiny_model(5)).path == hidden
