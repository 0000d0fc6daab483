"""The checks of a whole configuration: each field against its flag, each section (its ``validate``,
beside its fields in :mod:`flashreinforce.config.sections`), and the rules across sections, read from
the typed sections; and the notes on flags that have no effect on this runtime (``inactive``). Values
this runtime cannot honour in a way that would change results are errors
(:class:`~flashreinforce.config.schema.ConfigError`), never silently ignored.

The rules every FlashREINFORCE run obeys (:func:`run_rules`) are written once, over plain values: this
trainer checks them on its typed configuration, the published experiment settings (flat Molt flags,
:func:`flashreinforce.experiments.resolve.rule_violations`) on theirs, with the same messages. The
rules of the selected loss mode are the mode's own (:class:`flashreinforce.objective.LossModeConfig`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
from functools import lru_cache
from typing import Any, Mapping, Sequence

from flashreinforce.config.schema import FLAG_SPELLINGS, RETIRED_FLAGS, ConfigError, flag_table, shown, value_problem
from flashreinforce.config.sections import ENGINE_SECTIONS
from flashreinforce.objective import OPTION_FLAGS, loss_mode_config

__all__ = ["SEED_LIMIT", "parse_worker_resources", "raise_errors", "run_rules", "validate"]

#: The largest run seed (the random generators take 64-bit seeds; the evaluation's is the seed + 1).
SEED_LIMIT = 2**63 - 1


@lru_cache(maxsize=None)
def _flags(cls: type):
    return flag_table(cls)


def raise_errors(errors: list[str]) -> None:
    if len(errors) == 1:  # one line naming the flag
        raise ConfigError(errors[0])
    raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))


def parse_worker_resources(value: Any, flag: str = "--ray.worker_resources") -> tuple[dict[str, float], ...]:
    """``--ray.worker_resources``: ``None``, a mapping, a list of mappings, or their JSON text -> one
    mapping (Ray resource name -> amount) per slot; worker ``i`` takes slot ``i % len``. ``CPU`` and
    ``GPU`` are refused (they have their own flags); amounts must be positive numbers."""
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"{flag}: not JSON ({err}): {shown(value)}") from None
    slots = [value] if isinstance(value, Mapping) else value
    if not isinstance(slots, Sequence) or not slots or not all(isinstance(x, Mapping) for x in slots):
        raise ValueError(f"{flag} must be a JSON object of resource amounts or a non-empty list of them, got "
                         f"{shown(value)}")
    out = []
    for slot in slots:
        clean = {}
        for name, amount in slot.items():
            if name in ("CPU", "GPU"):
                raise ValueError(f"{flag}: give {name} with --ray.num_{name.lower()}s_per_worker, not as a custom "
                                 "resource")
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount > 0:
                raise ValueError(f"{flag}: resource {name!r} needs a positive amount, got {shown(amount)}")
            clean[str(name)] = float(amount)
        out.append(clean)
    return tuple(out)


def run_rules(*, rollout_batch_size: int, samples_per_prompt: int, train_batch_size: int | None, max_epochs: int,
              kl_init_coef: float, max_len: int, max_new_tokens: int, derives_batch: bool) -> list[str]:
    """One message per broken rule of every run, naming the flags (empty when all hold): one full-batch
    update per collected batch (``train.batch_size`` trajectories, ``rollout.batch_size *
    rollout.n_samples_per_prompt``; ``train.max_epochs`` 1), no reference-model KL (``algo.kl.init_coef``
    0), room for the prompt (``data.max_len`` above ``rollout.max_new_tokens``).

    ``derives_batch``: this trainer's form, which derives ``train.batch_size`` when it is not given
    (``None``) and checks a given one; Molt needs it given.
    """
    errors = []
    if train_batch_size is not None or not derives_batch:
        if rollout_batch_size * samples_per_prompt != train_batch_size:
            errors.append(f"train.batch_size ({train_batch_size}) must equal rollout.batch_size ({rollout_batch_size}) "
                          f"* rollout.n_samples_per_prompt ({samples_per_prompt})"
                          + (": leave --train.batch_size out and it is derived from them" if derives_batch else ""))
    if max_epochs != 1:
        errors.append(f"train.max_epochs must be 1 (one optimizer step per collected batch), got {max_epochs}")
    if kl_init_coef != 0:
        errors.append(f"algo.kl.init_coef must be 0 (no reference model), got {kl_init_coef}")
    if not max_len > max_new_tokens:
        errors.append(f"data.max_len ({max_len}) must exceed rollout.max_new_tokens ({max_new_tokens})")
    return errors


#: The settings ``TrainerConfig.from_layers`` may drop, with the reason kept through validation (and said
#: as a warning): a preset's environment arguments whose environment was replaced, a preset's staleness
#: bound below a fixed lag, a retired flag of the published launchers.
LAYER_NOTES = ("env.kwargs", "train.max_policy_lag", *RETIRED_FLAGS)


def validate(cfg) -> None:
    """Check ``cfg`` (a :class:`~flashreinforce.config.trainer_config.TrainerConfig`) as a whole (every field against its flag, each section, the rules across
    sections) and record the flags without effect; ``ConfigError`` naming every broken rule."""
    errors: list[str] = []
    for f in dataclasses.fields(cfg):
        if "section" in f.metadata:
            _stray_attributes(getattr(cfg, f.name), f.name, errors)
    for f in _flags(type(cfg)):  # a Python user may have set fields directly
        try:
            cfg.set(f.name, cfg[f.name])
        except ConfigError as err:
            errors.append(str(err))
    if errors:
        raise_errors(errors)
    cfg.inactive = {k: v for k, v in cfg.inactive.items() if k in LAYER_NOTES}
    cfg.warnings = []
    for f in dataclasses.fields(cfg):
        if "section" in f.metadata:
            section = getattr(cfg, f.name)
            if hasattr(section, "validate"):
                section.validate(errors)
    if not isinstance(cfg.seed, int) or isinstance(cfg.seed, bool):
        errors.append(f"--seed must be an integer, got {shown(cfg.seed)}")
    elif not 0 <= cfg.seed <= SEED_LIMIT:
        errors.append(f"--seed must be an integer in [0, 2**63 - 1], got {shown(cfg.seed)}")
    for name, value in [("env.kwargs", cfg.env_kwargs)] + [(f.name, cfg[f.name]) for f in _flags(type(cfg))
                                                           if f.type == "json"]:
        problem = value_problem(value)
        if problem:
            errors.append(f"--{name}: {problem}")
    if cfg.torch_threads is not None and (not isinstance(cfg.torch_threads, int) or cfg.torch_threads <= 0):
        errors.append(f"--torch_threads must be a positive integer, got {cfg.torch_threads}")
    _check(cfg, errors)
    if errors:
        raise_errors(errors)


def _stray_attributes(section: Any, path: str, errors: list[str]) -> None:
    """An attribute set from Python on a section that is none of its fields (a typo, or a flag's
    published spelling used as a field name) would be silently ignored: one error each."""
    names = {f.name for f in dataclasses.fields(section)}
    for key in vars(section):
        if key not in names and key != "_frozen":
            dotted = f"{path}.{key}"
            field = FLAG_SPELLINGS.get(dotted)
            errors.append(f"config.{dotted} is not a field: the flag --{dotted} is config.{field}" if field else
                          f"config.{dotted} is not a field of the {path} section")
    for f in dataclasses.fields(section):
        if "section" in f.metadata:
            _stray_attributes(getattr(section, f.name), f"{path}.{f.name}", errors)


def _check(cfg, errors: list[str]) -> None:
    inactive = cfg.inactive
    warn = cfg.warnings
    actor, rollout, ray, fsdp, evaluation, data = cfg.actor, cfg.rollout, cfg.ray, cfg.fsdp, cfg.eval, cfg.data
    if ray.worker_resources is not None:
        try:
            parse_worker_resources(ray.worker_resources)
        except ValueError as err:
            errors.append(str(err))
    for name in LAYER_NOTES:  # settings a later layer made moot, retired flags (TrainerConfig.from_layers)
        if name in inactive:
            warn.append(inactive[name])
    for f in _flags(type(cfg)):
        if f.no_effect:
            inactive[f.name] = f.no_effect

    # The rules every run obeys (shared with the published experiment settings), then the loss mode's own,
    # both over the typed sections' values (the loss options' values looked up by their flags, the names
    # the objective gives them).
    errors.extend(run_rules(rollout_batch_size=rollout.batch_size, samples_per_prompt=rollout.n_samples_per_prompt,
                            train_batch_size=cfg.train.batch_size, max_epochs=cfg.train.max_epochs,
                            kl_init_coef=cfg.algo.kl.init_coef, max_len=data.max_len,
                            max_new_tokens=rollout.max_new_tokens, derives_batch=True))
    mode = loss_mode_config(actor.loss_mode)
    advantage = cfg.algo.advantage
    errors.extend(mode.rule_violations(
        estimator=advantage.estimator, correction_level=advantage.is_correction_level,
        samples_per_prompt=rollout.n_samples_per_prompt,
        option_values={OPTION_FLAGS[o]: cfg[OPTION_FLAGS[o]] for o in mode.checked_options}))
    has_gate = "actor.flash_gate_delta" in mode.flags
    if actor.scale_step_by_acceptance and not has_gate:
        errors.append(f"--actor.scale_step_by_acceptance needs a loss mode with a trust gate (flash_reinforce); "
                      f"actor.loss_mode {actor.loss_mode} has none")
    for n, size in (("fsdp.tp_size", fsdp.tp_size), ("fsdp.ep_size", fsdp.ep_size), ("fsdp.cp_size", fsdp.cp_size)):
        if size not in (None, 1) and size > 1:
            errors.append(f"--{n} {size}: the native learner runs on one device; only 1 is supported")
    # The flags the selected loss mode does not read (the mode says which, and why).
    inactive.update(mode.inactive({flag: cfg[flag] for flag in mode.note_flags}))
    if not has_gate:
        inactive["logger.warn_gate_drop_steps"] = f"actor.loss_mode {actor.loss_mode} has no trust gate"
    elif math.isinf(actor.flash_gate_delta):
        inactive["logger.warn_gate_drop_steps"] = "the trust gate is off (actor.flash_gate_delta inf)"

    # Flags without an effect on this runtime: accepted and recorded, never misapplied.
    cfg.lora.check_selected(cfg, errors, inactive)
    engine = rollout.engine
    for name, section_name in ENGINE_SECTIONS.items():
        section = getattr(cfg, section_name)
        if name == engine:
            if hasattr(section, "check_selected"):
                section.check_selected(cfg, errors, inactive)
            continue
        for f in _flags(type(cfg)):
            if f.name.startswith(section_name + "."):
                inactive[f.name] = f"no {name} engine (rollout.engine is {engine})"
    if rollout.backend != "ray":
        for n in ("ray.address", "ray.num_cpus_per_worker", "ray.num_gpus_per_worker", "ray.max_restarts",
                  "ray.worker_resources", "ray.scheduling_strategy"):
            inactive[n] = "rollout.backend is local (workers are threads of this process)"
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    for n, value in (("actor.num_nodes", actor.num_nodes), ("actor.num_gpus_per_node", actor.num_gpus_per_node)):
        inactive[n] = ("the learner's ranks are torchrun's (WORLD_SIZE): launch with torchrun --nnodes N "
                       "--nproc-per-node G")
        if value > 1 and ranks <= 1:
            warn.append(f"--{n} {value}: this run has one learner process; launch with torchrun for a data-parallel "
                        "learner (the update is the same, only slower)")
    if ranks <= 1:
        inactive["fsdp.strategy"] = "one learner process (not launched by torchrun)"
    if actor.optim == "adam":
        inactive["actor.optim"] = "adam and adamw both mean torch.optim.AdamW (decoupled weight decay)"
    if evaluation.steps == 0 and evaluation.every_min == 0 and not evaluation.eval_at_start:
        for n in ("eval.dataset", "eval.n_samples_per_prompt", "eval.temperature", "eval.top_p", "eval.num_prompts"):
            inactive[n] = "no evaluation (eval.steps 0 and no eval.eval_at_start)"
    if data.prompt_dataset is None:
        for n in ("data.input_key", "data.label_key", "data.max_samples"):
            inactive[n] = "no data.prompt_dataset"
    if cfg.train.max_steps:
        inactive["train.num_episodes"] = "train.max_steps sets the number of updates"
    if cfg.train.fixed_policy_lag is not None:
        lag = cfg.train.fixed_policy_lag
        inactive["train.async_queue_size"] = f"train.fixed_policy_lag {lag} keeps {lag} batches ahead"
        inactive["rollout.inflight_weight_updates"] = ("train.fixed_policy_lag: no version is published while a "
                                                        "batch it allowed is being sampled")
    wandb = cfg.logger.wandb
    if wandb.run_name is not None and not wandb.project:
        inactive["logger.wandb.run_name"] = "no W&B logging (logger.wandb.project not given)"
    if cfg.logger.log_samples_steps == 0:
        inactive["logger.log_samples_num"] = "no samples (logger.log_samples_steps 0)"
    for n, value, package in (("logger.tensorboard.dir", cfg.logger.tensorboard.dir, "tensorboard"),
                              ("logger.wandb.project", wandb.project, "wandb")):
        if value and importlib.util.find_spec(package) is None:
            errors.append(f"--{n} needs the {package} package, which is not installed: "
                          f"pip install 'flashreinforce[{package}]'  (or: pip install {package})")
