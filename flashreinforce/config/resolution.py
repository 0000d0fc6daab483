"""The resolved configuration of a run.

Resolution merges, last wins: the flag table's defaults, the preset (``--preset``), then the flags
given on the command line. The result records each value and, for each flag that has no effect
here, the reason (``inactive``); values this runtime cannot honour in a way that would change
results are errors (:class:`~flashreinforce.config.flags.ConfigError`), never silently ignored.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from flashreinforce.config.flags import EXTRA_OPTIONS, FLAG_BY_NAME, FLAGS, ConfigError
from flashreinforce.config.rules import rule_violations

__all__ = ["ResolvedConfig", "parse_worker_resources", "resolve"]


@dataclass
class ResolvedConfig:
    """The configuration of a run.

    flags: every registry flag's value (dotted name -> value). inactive: flag -> why it has no effect
    here. warnings: values accepted with a caveat. Other fields are the non-Molt options.
    """

    flags: dict[str, Any]
    inactive: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    preset: str | None = None
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    tokenizer: str | None = None
    output: str | None = None
    resume: str | None = None
    seed: int = 0
    device: str = "auto"
    torch_threads: int | None = None
    progress: bool = True
    overwrite: bool = False
    explicit: list[str] = field(default_factory=list)

    def __getitem__(self, name: str) -> Any:
        return self.flags[name]

    def to_json(self) -> dict[str, Any]:
        return {"flags": self.flags, "inactive": self.inactive, "warnings": self.warnings, "preset": self.preset,
                "env_kwargs": self.env_kwargs, "tokenizer": self.tokenizer, "output": self.output,
                "resume": self.resume, "seed": self.seed, "device": self.device,
                "torch_threads": self.torch_threads, "explicit_flags": self.explicit}

    def env_config(self, *, eval_split: bool = False) -> dict[str, Any]:
        """The flat config an environment factory receives (dotted flags plus ``env.kwargs``)."""
        cfg = dict(self.flags)
        cfg["env.kwargs"] = dict(self.env_kwargs)
        if eval_split:
            cfg["data.prompt_dataset"] = self.flags["eval.dataset"]
        return cfg


def resolve(given: Mapping[str, Any], preset: Mapping[str, Any] | None = None) -> ResolvedConfig:
    """Merge defaults, ``preset`` (dotted flags and extra options) and ``given``, then check the rules.

    Raises:
        ConfigError: a value this runtime cannot honour or a broken rule, naming the flag(s).
    """
    preset = dict(preset or {})
    merged: dict[str, Any] = {f.name: f.default for f in FLAGS}
    extras: dict[str, Any] = {}
    for source in (preset, given):
        for key, value in source.items():
            if key in FLAG_BY_NAME:
                merged[key] = value
            elif key in EXTRA_OPTIONS:
                extras[key] = value
            else:
                raise ConfigError(f"unknown flag --{key}")
    for alias, name in (("model", "actor.model_name_or_path"), ("env", "train.agent_path")):
        given_alias, given_flag = given.get(alias), given.get(name)
        if given_alias is not None and given_flag is not None and given_alias != given_flag:
            raise ConfigError(f"--{alias} {given_alias!r} and --{name} {given_flag!r} disagree; give one of them")
        if given_alias is not None:
            merged[name] = given_alias
        elif given_flag is None and preset.get(alias) is not None and preset.get(name) is None:
            merged[name] = preset[alias]
    for name in ("actor.eps_clip_low_high", "actor.adam.betas"):
        merged[name] = tuple(float(x) for x in merged[name])

    env_kwargs = extras.get("env.kwargs") or {}
    if not isinstance(env_kwargs, dict):
        raise ConfigError(f"--env.kwargs must be a JSON object (e.g. '{{\"turns\": 3}}'), got {env_kwargs!r}")
    # A preset's environment arguments belong to the preset's environment: an --env that replaces it
    # (a user's class, perhaps with a plain constructor) does not get them.
    preset_env = preset.get("train.agent_path") or preset.get("env")
    dropped = None
    if "env.kwargs" in preset and "env.kwargs" not in given and merged["train.agent_path"] != preset_env:
        dropped, env_kwargs = env_kwargs, {}
    torch_threads = extras.get("torch_threads")
    if torch_threads is not None and torch_threads <= 0:
        raise ConfigError(f"--torch_threads must be a positive integer, got {torch_threads}")
    overwrite = bool(extras.get("overwrite", False))
    if overwrite and extras.get("resume"):
        raise ConfigError("--overwrite and --resume contradict each other: --resume continues the run in --output, "
                          "--overwrite deletes it first; give one of them")

    cfg = ResolvedConfig(
        flags=merged, preset=extras.get("preset"), env_kwargs=dict(env_kwargs),
        tokenizer=extras.get("tokenizer"), output=extras.get("output"), resume=extras.get("resume"),
        seed=int(extras.get("seed", 0)), device=str(extras.get("device", "auto")),
        torch_threads=torch_threads, progress=not bool(extras.get("no_progress", False)), overwrite=overwrite,
        explicit=sorted(k for k in given if k in FLAG_BY_NAME))
    if dropped:
        reason = (f"preset {extras.get('preset')!r} sets env.kwargs {dropped} for its environment {preset_env}, which "
                  f"--env {merged['train.agent_path']} replaces: dropped (give --env.kwargs to pass arguments)")
        cfg.inactive["env.kwargs"] = reason
        cfg.warnings.append(reason)
    _check(cfg)
    return cfg


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
            raise ValueError(f"{flag}: not JSON ({err}): {value!r}") from None
    slots = [value] if isinstance(value, Mapping) else value
    if not isinstance(slots, Sequence) or not slots or not all(isinstance(x, Mapping) for x in slots):
        raise ValueError(f"{flag} must be a JSON object of resource amounts or a non-empty list of them, got "
                         f"{value!r}")
    out = []
    for slot in slots:
        clean = {}
        for name, amount in slot.items():
            if name in ("CPU", "GPU"):
                raise ValueError(f"{flag}: give {name} with --ray.num_{name.lower()}s_per_worker, not as a custom "
                                 "resource")
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount > 0:
                raise ValueError(f"{flag}: resource {name!r} needs a positive amount, got {amount!r}")
            clean[str(name)] = float(amount)
        out.append(clean)
    return tuple(out)


def _check(cfg: ResolvedConfig) -> None:
    v = cfg.flags
    errors: list[str] = []
    inactive = cfg.inactive
    warn = cfg.warnings

    def positive(*names: str, allow_zero: bool = False) -> None:
        for n in names:
            if v[n] is None or v[n] < 0 or (v[n] == 0 and not allow_zero):
                errors.append(f"--{n} must be {'>= 0' if allow_zero else 'positive'}, got {v[n]}")

    if v["rollout.max_turns"] is not None and v["rollout.max_turns"] <= 0:
        errors.append(f"--rollout.max_turns must be positive, got {v['rollout.max_turns']}")
    if v["ray.num_cpus_per_worker"] is None or not (v["ray.num_cpus_per_worker"] >= 0):
        errors.append(f"--ray.num_cpus_per_worker must be >= 0, got {v['ray.num_cpus_per_worker']}")
    if v["ray.num_gpus_per_worker"] is not None and not (v["ray.num_gpus_per_worker"] >= 0):
        errors.append(f"--ray.num_gpus_per_worker must be >= 0, got {v['ray.num_gpus_per_worker']}")
    if v["ray.max_restarts"] < -1:
        errors.append(f"--ray.max_restarts must be >= -1 (-1: unlimited), got {v['ray.max_restarts']}")
    if v["ray.worker_resources"] is not None:
        try:
            parse_worker_resources(v["ray.worker_resources"])
        except ValueError as err:
            errors.append(str(err))
    if not (0 < v["vllm.gpu_memory_utilization"] <= 1):
        errors.append(f"--vllm.gpu_memory_utilization must lie in (0, 1], got {v['vllm.gpu_memory_utilization']}")
    positive("rollout.batch_size", "rollout.n_samples_per_prompt", "train.batch_size", "rollout.max_new_tokens",
             "data.max_len", "rollout.vllm_generate_batch_size", "rollout.num_workers",
             "eval.n_samples_per_prompt", "eval.num_prompts", "logger.logging_steps", "logger.log_samples_num",
             "train.num_episodes",
             "actor.num_nodes", "actor.num_gpus_per_node", "ref.num_nodes", "ref.num_gpus_per_node",
             "vllm.num_engines", "vllm.tensor_parallel_size", "fsdp.tp_size", "fsdp.ep_size", "fsdp.cp_size")
    positive("train.async_queue_size", "train.max_steps", "ckpt.save_steps", "train.micro_batch_size",
             "train.micro_batch_tokens", "eval.steps", "rollout.top_k", "ckpt.max_ckpt_num", "logger.log_samples_steps",
             "logger.warn_zero_variance_steps", allow_zero=True)
    if v["train.max_policy_lag"] is not None and v["train.max_policy_lag"] < 0:
        errors.append(f"--train.max_policy_lag must be >= 0 or none, got {v['train.max_policy_lag']}")
    if v["data.max_samples"] is not None and v["data.max_samples"] <= 0:
        errors.append(f"--data.max_samples must be positive, got {v['data.max_samples']}")
    for n in ("actor.adam.lr", "actor.adam.weight_decay", "actor.lr_warmup_ratio", "actor.min_lr_ratio"):
        if not (math.isfinite(v[n]) and v[n] >= 0):
            errors.append(f"--{n} must be a finite number >= 0, got {v[n]}")
    if not (math.isfinite(v["rollout.temperature"]) and v["rollout.temperature"] > 0):
        errors.append(f"--rollout.temperature must be positive and finite, got {v['rollout.temperature']}")
    for n in ("rollout.top_p", "eval.top_p"):
        if not (0 < v[n] <= 1):
            errors.append(f"--{n} must lie in (0, 1], got {v[n]}")
    if not (math.isfinite(v["eval.temperature"]) and v["eval.temperature"] >= 0):
        errors.append(f"--eval.temperature must be >= 0 and finite, got {v['eval.temperature']}")
    b1, b2 = v["actor.adam.betas"]
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        errors.append(f"--actor.adam.betas must both lie in [0, 1), got {b1:g} {b2:g}")
    for n in ("rollout.env_timeout_s", "train.stall_timeout_s"):
        if not (math.isfinite(v[n]) and v[n] >= 0):
            errors.append(f"--{n} must be a finite number of seconds >= 0 (0: no limit), got {v[n]}")
    if v["rollout.max_failed_episodes_in_a_row"] < 0:
        errors.append(f"--rollout.max_failed_episodes_in_a_row must be >= 0 (0: never stop), "
                      f"got {v['rollout.max_failed_episodes_in_a_row']}")

    # The rules every run obeys (shared with the published experiment settings).
    errors.extend(rule_violations(v, native=True))
    for n in ("fsdp.tp_size", "fsdp.ep_size", "fsdp.cp_size"):
        if v[n] not in (None, 1) and v[n] > 1:
            errors.append(f"--{n} {v[n]}: the native learner runs on one device; only 1 is supported")
    mode = v["actor.loss_mode"]
    if mode == "flash_reinforce":
        agg, lsf = v["actor.flash_loss_agg"], v["actor.loss_scale_factor"]
        if agg != "seq-mean-token-sum-norm" and lsf is not None:
            inactive["actor.loss_scale_factor"] = f"only used by flash_loss_agg seq-mean-token-sum-norm (agg is {agg})"
        for n in ("actor.eps_clip_low_high", "algo.advantage.no_whiten"):
            inactive[n] = "only used by actor.loss_mode ppo"
    else:
        for n in [f.name for f in FLAGS if f.name.startswith("actor.flash_")] + ["actor.loss_scale_factor"]:
            inactive[n] = f"dropped: actor.loss_mode is {mode}"

    # Flags without an effect on this runtime: accepted and recorded, never misapplied.
    if v["rollout.engine"] == "vllm":
        if "rollout.num_workers" in cfg.explicit and v["rollout.num_workers"] != v["vllm.num_engines"]:
            errors.append(f"--rollout.num_workers {v['rollout.num_workers']} and --vllm.num_engines "
                          f"{v['vllm.num_engines']} disagree: with --rollout.engine vllm every worker runs one vLLM "
                          "engine; give --vllm.num_engines")
        inactive["rollout.num_workers"] = "rollout.engine vllm: one worker per vLLM engine (vllm.num_engines)"
        inactive["vllm.sync_backend"] = ("weights travel through the weight store (Ray object store or this process) "
                                         "and vLLM's RPC; no NCCL broadcast to vLLM engines")
    else:
        for n in ("vllm.num_engines", "vllm.tensor_parallel_size", "vllm.sync_backend",
                  "vllm.gpu_memory_utilization"):
            inactive[n] = "no vLLM engine (rollout.engine hf; workers: rollout.num_workers)"
    if v["rollout.backend"] != "ray":
        for n in ("ray.address", "ray.num_cpus_per_worker", "ray.num_gpus_per_worker", "ray.max_restarts",
                  "ray.worker_resources", "ray.scheduling_strategy"):
            inactive[n] = "rollout.backend is local (workers are threads of this process)"
    for n in ("ref.num_nodes", "ref.num_gpus_per_node"):
        inactive[n] = "no reference model (algo.kl.init_coef is 0)"
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    for n in ("actor.num_nodes", "actor.num_gpus_per_node"):
        inactive[n] = ("the learner's ranks are torchrun's (WORLD_SIZE): launch with torchrun --nnodes N "
                       "--nproc-per-node G")
        if v[n] > 1 and ranks <= 1:
            warn.append(f"--{n} {v[n]}: this run has one learner process; launch with torchrun for a data-parallel "
                        "learner (the update is the same, only slower)")
    if ranks <= 1:
        inactive["fsdp.strategy"] = "one learner process (not launched by torchrun)"
    inactive["rollout.micro_batch_size"] = "behavior log-probs come from the sampler; there is no rollout forward pass"
    inactive["train.colocate_fsdp_models"] = "learner and rollout engines already share this process"
    inactive["train.force_on_policy"] = "every collected batch gets exactly one optimizer step on this runtime"
    inactive["actor.optim"] = "adam and adamw both mean torch.optim.AdamW (decoupled weight decay)" \
        if v["actor.optim"] == "adam" else inactive.get("actor.optim", "")
    if not inactive["actor.optim"]:
        del inactive["actor.optim"]
    if v["eval.steps"] == 0 and not v["eval.eval_at_start"]:
        for n in ("eval.dataset", "eval.n_samples_per_prompt", "eval.temperature", "eval.top_p", "eval.num_prompts"):
            inactive[n] = "no evaluation (eval.steps 0 and no eval.eval_at_start)"
    if v["data.prompt_dataset"] is None:
        for n in ("data.input_key", "data.label_key", "data.max_samples"):
            inactive[n] = "no data.prompt_dataset"
    if v["train.max_steps"]:
        inactive["train.num_episodes"] = "train.max_steps sets the number of updates"
    if v["logger.wandb.run_name"] is not None and not v["logger.wandb.project"]:
        inactive["logger.wandb.run_name"] = "no W&B logging (logger.wandb.project not given)"
    if v["logger.log_samples_steps"] == 0:
        inactive["logger.log_samples_num"] = "no samples (logger.log_samples_steps 0)"
    for n, package in (("logger.tensorboard.dir", "tensorboard"), ("logger.wandb.project", "wandb")):
        if v[n] and importlib.util.find_spec(package) is None:
            errors.append(f"--{n} needs the {package} package, which is not installed: "
                          f"pip install 'flashreinforce[{package}]'  (or: pip install {package})")
    if errors:
        if len(errors) == 1:  # one line naming the flag
            raise ConfigError(errors[0])
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
