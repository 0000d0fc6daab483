"""What a checkpoint must mean, beyond being readable: the checks :mod:`.checkpoints` makes when it
loads one (and, on the state it is given, before it writes one: a save never writes what a load
would refuse).

* ``state.json``: every field has its type and range (``step``, ``version`` and ``max_steps``
  integers >= 0; the buffer's counters and prompt stream; the trainer's counters finite and >= 0),
  and the fields agree: ``version == step`` (each update makes one optimizer step),
  ``step <= max_steps``, ``buffer.updates_done == step + trainer.skipped_updates`` (a skipped update
  consumes its batch), prompts handed out again were handed out before, and a step directory's
  name is its ``step``. Other keys are left to the code that wrote them.
* ``model.safetensors``: the tensor names are the model's (a tied tensor stored once), each with the
  model's shape, every value finite.
* ``optimizer.pt``: the state of exactly the model's trainable parameters, in order (by index, or
  by name for a ``fully_shard`` learner's gathered state), each moment of its parameter's shape and
  finite, the step counts at most the policy version and the largest equal to it.
* ``scheduler.pt``: one base rate per parameter group, finite, and the position ``last_epoch``
  equal to the policy version (the schedule steps once per update).

Each failure is a :class:`CheckpointError` naming the file and the first bad field or tensor.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors.torch import load_file

from flashreinforce.models.lora import adapter_state, has_lora, is_adapter_name

__all__ = ["CheckpointError", "check_optimizer", "check_scheduler", "check_state", "first_non_finite", "non_finite",
           "read_weights", "trainable_parameters"]

#: ``optimizer_format`` values of ``state.json`` (absent: the optimizer's own state dict, by index).
OPTIMIZER_FORMATS = ("fsdp_full",)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and what is wrong with it."""


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Fields:
    """Type and range checks of one JSON file's fields, each failure naming the file and the field."""

    def __init__(self, file: str | Path) -> None:
        self.file = file

    def bad(self, problem: str) -> CheckpointError:
        return CheckpointError(f"{self.file}: {problem}")

    def get(self, obj: dict, key: str, where: str) -> Any:
        if key not in obj:
            raise self.bad(f"'{where}' is missing")
        return obj[key]

    def int(self, value: Any, where: str, minimum: int = 0) -> int:
        if not _is_int(value):
            raise self.bad(f"'{where}' must be an integer, got {_shown(value)}")
        if value < minimum:
            raise self.bad(f"'{where}' must be >= {minimum}, got {value}")
        return value

    def number(self, value: Any, where: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise self.bad(f"'{where}' must be a finite number >= 0, got {_shown(value)}")
        return value

    def object(self, value: Any, where: str) -> dict:
        if not isinstance(value, dict):
            raise self.bad(f"'{where}' must be an object, got {_shown(value)}")
        return value


def _check_buffer(f: _Fields, buffer: Any) -> dict:
    """The rollout buffer's state (``RolloutBuffer.state_dict``)."""
    f.object(buffer, "buffer")
    f.int(f.get(buffer, "updates_done", "buffer.updates_done"), "buffer.updates_done")
    for key, value in f.object(f.get(buffer, "counters", "buffer.counters"), "buffer.counters").items():
        f.int(value, f"buffer.counters.{key}")
    prompts = f.object(f.get(buffer, "prompts", "buffer.prompts"), "buffer.prompts")
    next_id = f.int(f.get(prompts, "next_id", "buffer.prompts.next_id"), "buffer.prompts.next_id")
    for key in ("seed", "seed_offset"):  # optional: checkpoints of earlier versions have neither
        if key in prompts:
            f.int(prompts[key], f"buffer.prompts.{key}")
    requeued = f.get(prompts, "requeued", "buffer.prompts.requeued")
    if not isinstance(requeued, list):
        raise f.bad(f"'buffer.prompts.requeued' must be a list, got {_shown(requeued)}")
    for i, entry in enumerate(requeued):
        where = f"buffer.prompts.requeued[{i}]"
        if not (isinstance(entry, list) and len(entry) == 2):
            raise f.bad(f"'{where}' must be a [prompt id, seed] pair, got {_shown(entry)}")
        prompt_id = f.int(entry[0], f"{where}[0]")
        f.int(entry[1], f"{where}[1]")
        if prompt_id >= next_id:
            raise f.bad(f"'{where}' names prompt {prompt_id}, not handed out yet (next_id {next_id})")
    attempts = f.object(buffer.get("prompt_attempts", {}), "buffer.prompt_attempts")
    for key, value in attempts.items():
        if not (key.isdigit() and int(key) < next_id):
            raise f.bad(f"'buffer.prompt_attempts' key {key!r} is not a prompt id handed out (next_id {next_id})")
        f.int(value, f"buffer.prompt_attempts.{key}", minimum=1)
    return buffer


def check_state(state: Any, file: str | Path, *, dir_step: int | None = None) -> dict[str, Any]:
    """Check ``state.json``'s content (see the module docstring); ``dir_step``: the step its
    directory's name gives (``None``: a directory of another name, not checked)."""
    f = _Fields(file)
    if not isinstance(state, dict):
        raise f.bad(f"expected a JSON object, got {type(state).__name__}")
    step = f.int(f.get(state, "step", "step"), "step")
    version = f.int(f.get(state, "version", "version"), "version")
    max_steps = f.int(state["max_steps"], "max_steps") if "max_steps" in state else None
    buffer = _check_buffer(f, f.get(state, "buffer", "buffer"))
    trainer = f.object(state.get("trainer", {}), "trainer")
    for key, value in trainer.items():
        if key == "skipped_updates":
            f.int(value, f"trainer.{key}")
        else:
            f.number(value, f"trainer.{key}")
    if "optimizer_steps_skipped" in state:
        skipped_steps = f.int(state["optimizer_steps_skipped"], "optimizer_steps_skipped")
        if not 0 <= skipped_steps <= version:
            raise f.bad(f"'optimizer_steps_skipped' {skipped_steps} is not between 0 and 'version' {version}")
    fmt = state.get("optimizer_format")
    if fmt is not None and fmt not in OPTIMIZER_FORMATS:
        raise f.bad(f"'optimizer_format' must be absent or one of {list(OPTIMIZER_FORMATS)}, got {_shown(fmt)}")
    if version != step:
        raise f.bad(f"'version' {version} differs from 'step' {step} (every update makes one optimizer step; "
                    "the file was edited or belongs to another checkpoint)")
    if max_steps is not None and step > max_steps:
        raise f.bad(f"'step' {step} is past 'max_steps' {max_steps} of the run that wrote it")
    skipped = trainer.get("skipped_updates")
    done = buffer["updates_done"]
    if skipped is not None and done != step + skipped:
        raise f.bad(f"'buffer.updates_done' {done} is not 'step' {step} + 'trainer.skipped_updates' {skipped} "
                    "(every batch taken is an update or a skipped one)")
    if skipped is None and done < step:
        raise f.bad(f"'buffer.updates_done' {done} is less than 'step' {step}")
    if dir_step is not None and dir_step != step:
        raise f.bad(f"'step' is {step} but the directory is named for step {dir_step} (renamed, or its "
                    "state.json comes from another checkpoint)")
    return state


# ---------------------------------------------------------------- tensors


def non_finite(t: Any) -> str | None:
    """``"holds non-finite values (NaN or inf): N of M"`` for a floating-point tensor with a NaN or an
    infinity, ``None`` otherwise."""
    if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.numel():
        finite = torch.isfinite(t)
        if not bool(finite.all()):
            return f"holds non-finite values (NaN or inf): {int(finite.numel() - finite.sum())} of {t.numel()}"
    return None


def first_non_finite(named: Iterable[tuple[str, Any]]) -> str | None:
    """``"'name' holds non-finite values ..."`` for the first tensor of ``named`` with a NaN or an
    infinity (see :func:`non_finite`), ``None`` when all are finite."""
    for name, t in named:
        problem = non_finite(t)
        if problem:
            return f"'{name}' {problem}"
    return None


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters the learner's optimizer holds, in its order (shared ones once)."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def _storage(t: torch.Tensor) -> tuple | None:
    ptr = t.untyped_storage().data_ptr()
    return (t.device, ptr, t.storage_offset(), tuple(t.shape)) if ptr else None


def checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint stores of ``model``: its adapters when it trains LoRA adapters (the base is
    frozen and rebuilt from ``--model``), else its whole state dict."""
    if has_lora(model):
        return adapter_state(model)
    return model.state_dict()


def read_weights(file: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of ``model.safetensors``, checked against ``model`` (names, shapes) and for
    non-finite values; the model is not touched."""
    try:
        tensors = load_file(str(file))
    except Exception as err:  # a truncated header or body: SafetensorError, OSError, ...
        text = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
        raise CheckpointError(f"{file}: unreadable, truncated or corrupt ({type(err).__name__}: {text})") from None
    stored_lora, model_lora = any(is_adapter_name(k) for k in tensors), has_lora(model)
    if stored_lora and not model_lora:
        raise CheckpointError(f"{file}: holds LoRA adapters but this run trains the full model: resume with the "
                              "run's --lora.rank (its config.json records it)")
    if model_lora and not stored_lora:
        raise CheckpointError(f"{file}: holds full weights but this run trains LoRA adapters: resume without "
                              "--lora.rank, or start a new run from this checkpoint (--model)")
    expected = checkpoint_tensors(model)
    unexpected = sorted(set(tensors) - set(expected))
    present = {_storage(expected[k]) for k in tensors if k in expected} - {None}
    # a tensor shared with another (tied embeddings) is stored once, under one of its names
    missing = sorted(k for k, t in expected.items() if k not in tensors and _storage(t) not in present)
    if missing or unexpected:
        raise CheckpointError(f"{file}: does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]} "
                              f"({len(missing)} missing, {len(unexpected)} unexpected; a checkpoint of another model?)")
    for name in sorted(tensors):
        found, want = list(tensors[name].shape), list(expected[name].shape)
        if found != want:
            raise CheckpointError(f"{file}: tensor '{name}' has shape {found}, the model's is {want} "
                                  "(a checkpoint of another model size?)")
    problem = first_non_finite((name, tensors[name]) for name in sorted(tensors))
    if problem:
        raise CheckpointError(f"{file}: tensor {problem}; these weights cannot be trained on")
    return tensors


def _step_count(value: Any) -> float | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def check_optimizer(optimizer: Any, file: str | Path, model: torch.nn.Module, *, version: int,
                    steps_skipped: int = 0, by_name: bool = False) -> None:
    """Check an AdamW state dict against ``model``'s trainable parameters (see the module docstring);
    ``steps_skipped``: updates of the run that made no optimizer step (``actor.step_on_zero_gradient
    false``), so that the step count is ``version - steps_skipped``; ``by_name``: keyed by parameter
    name (``model.`` + the model's name), as a ``fully_shard`` learner gathers it, instead of by index."""
    f = _Fields(file)
    if not (isinstance(optimizer, dict) and isinstance(optimizer.get("state"), dict)
            and isinstance(optimizer.get("param_groups"), list)):
        raise f.bad("not an optimizer state (no 'state' and 'param_groups')")
    params = trainable_parameters(model)
    ids: list[Any] = []
    for i, group in enumerate(optimizer["param_groups"]):
        if not (isinstance(group, dict) and isinstance(group.get("params"), list)):
            raise f.bad(f"parameter group {i} has no 'params' list")
        for key in ("lr", "eps", "weight_decay"):
            value = group.get(key, 0.0)
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise f.bad(f"parameter group {i}: '{key}' must be a finite number, got {_shown(value)}")
        ids.extend(group["params"])
    if len(ids) != len(params):
        raise f.bad(f"holds {len(ids)} parameters, the model has {len(params)} trainable ones "
                    "(a checkpoint of another model?)")
    expected = [f"model.{name}" for name, _ in params] if by_name else list(range(len(params)))
    for i, (got, want) in enumerate(zip(ids, expected)):
        if got != want:
            raise f.bad(f"parameter {i} is {_shown(got)}, expected {_shown(want)} (a checkpoint of another model, "
                        "or of another optimizer_format)")
    owner = dict(zip(expected, params))
    largest = None
    for pid, entry in optimizer["state"].items():
        if pid not in owner:
            raise f.bad(f"holds a state for parameter {_shown(pid)}, which the model does not have")
        name, param = owner[pid]
        if not isinstance(entry, dict):
            raise f.bad(f"the state of parameter '{name}' is not a dict ({type(entry).__name__})")
        for key, value in entry.items():
            if key == "step":
                count = _step_count(value)
                if count is None or not math.isfinite(count) or count < 0 or count != int(count):
                    raise f.bad(f"the step count of parameter '{name}' is {_shown(value)}, not an integer >= 0")
                if count > version:
                    raise f.bad(f"parameter '{name}' has step count {int(count)}, past the policy version {version}")
                largest = count if largest is None else max(largest, count)
            elif isinstance(value, torch.Tensor):
                if list(value.shape) != list(param.shape):
                    raise f.bad(f"'{key}' of parameter '{name}' has shape {list(value.shape)}, the parameter's is "
                                f"{list(param.shape)}")
                problem = non_finite(value)
                if problem:
                    raise f.bad(f"'{key}' of parameter '{name}' {problem} (non-finite moments would make the "
                                "weights NaN at the next update)")
    steps = version - steps_skipped
    if largest is None and steps > 0:
        raise f.bad(f"no optimizer moments, but the policy version is {version}"
                    + (f" and {steps_skipped} updates made no optimizer step" if steps_skipped else ""))
    if largest is not None and largest != steps:
        raise f.bad(f"the largest step count {int(largest)} differs from the policy version {version}"
                    + (f" less the {steps_skipped} updates that made no optimizer step" if steps_skipped else ""))


def check_scheduler(scheduler: Any, file: str | Path, *, version: int, num_groups: int) -> None:
    """Check a LambdaLR state: its position is the policy version, one finite base rate per group."""
    f = _Fields(file)
    if not isinstance(scheduler, dict):
        raise f.bad(f"not a scheduler state (got {type(scheduler).__name__})")
    last_epoch = f.int(f.get(scheduler, "last_epoch", "last_epoch"), "last_epoch")
    if last_epoch != version:
        raise f.bad(f"'last_epoch' {last_epoch} differs from the policy version {version} (the schedule steps "
                    "once per update)")
    base_lrs = f.get(scheduler, "base_lrs", "base_lrs")
    if not (isinstance(base_lrs, list) and len(base_lrs) == num_groups
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in base_lrs)):
        raise f.bad(f"'base_lrs' must be {num_groups} finite number(s), one per parameter group, got {_shown(base_lrs)}")
