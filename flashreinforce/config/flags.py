"""The trainer's flag registry (as data), command-line parsing and the resolved configuration.

Flags keep Molt's dotted names (``--rollout.batch_size``, ``--actor.adam.lr``, ...) so users move
between the two trainers unchanged. Every flag is a :class:`Flag` row: name, type, default, help
and whether it means something on this runtime. Resolution merges, last wins: registry defaults,
the preset (``--preset``), then the flags given on the command line. The result records each
value and, for each flag that has no effect here, the reason (``inactive``); values this runtime
cannot honour in a way that would change results are errors (:class:`ConfigError`), never
silently ignored.

Types: ``float`` (``inf`` allowed), ``int``, ``str``, ``bool`` (``--flag`` alone means true; also
``--flag true|false``), ``float2`` (two floats, ``--actor.eps_clip_low_high 0.2 0.2``), ``json``
(a JSON value), ``optint`` (an int or ``none``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from flashreinforce.config.rules import rule_violations

__all__ = ["FLAGS", "ConfigError", "Flag", "ResolvedConfig", "build_parser", "parse_worker_resources", "resolve"]


class ConfigError(ValueError):
    """A flag value the native trainer refuses (the message names the flag)."""


@dataclass(frozen=True)
class Flag:
    name: str
    type: str
    default: Any
    help: str
    choices: tuple | None = None


def _f(name, type_, default, help_, choices=None) -> Flag:
    return Flag(name, type_, default, help_, choices)


#: Every flag ``flashreinforce train`` accepts (besides --preset/--env/--model/--output/--resume/...).
FLAGS: tuple[Flag, ...] = (
    # actor: optimizer, loss and model
    _f("actor.model_name_or_path", "str", None, "policy model: a local Hugging Face checkpoint directory, a .gguf "
       "file, the alias smollm2-135m-instruct, a run directory (its newest checkpoint), a model config JSON, or a "
       "built-in tiny config name (tiny-qwen2); alias --model"),
    _f("actor.loss_mode", "str", "flash_reinforce", "flash_reinforce (the fused loss) or ppo (GRPO comparison)",
       ("flash_reinforce", "ppo")),
    # 1e-3 is the published runs' shared value (the settings' common flags), which a trainer launched
    # without a setting inherits; the loss functions' own default, 3e-3, is the value of the published
    # math settings (R1, Qwen2.5-Math) that override it (docs/semantics.md).
    _f("actor.flash_gate_delta", "float", 1e-3, "trust threshold delta of the sequence Bernoulli-KL gate (inf: off)"),
    _f("actor.flash_gate_level", "str", "seq", "gate level; only seq (whole trajectories) exists", ("seq",)),
    _f("actor.flash_neg_topq", "float", 1.0, "entropy filter q: failed trajectories keep ceil(q T) tokens (1: off)"),
    _f("actor.flash_loss_agg", "str", "seq-mean-token-mean", "loss aggregation",
       ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")),
    _f("actor.loss_scale_factor", "float", None, "constant divisor of seq-mean-token-sum-norm"),
    _f("actor.flash_no_is", "bool", False, "no importance correction (ratio 1; the gate admits everything)"),
    _f("actor.eps_clip_low_high", "float2", (0.2, 0.2), "PPO ratio clip range (low high), loss_mode ppo"),
    _f("actor.entropy_coef", "float", 0.0, "entropy bonus coefficient (token mean over the batch)"),
    _f("actor.optim", "str", "adam", "optimizer: adam (decoupled weight decay, i.e. AdamW) or adamw", ("adam", "adamw")),
    _f("actor.adam.lr", "float", 1e-6, "learning rate"),
    _f("actor.adam.weight_decay", "float", 0.1, "decoupled weight decay"),
    _f("actor.adam.betas", "float2", (0.9, 0.95), "Adam betas"),
    _f("actor.lr_scheduler", "str", "cosine_with_min_lr", "learning-rate schedule",
       ("cosine_with_min_lr", "constant", "constant_with_warmup")),
    _f("actor.lr_warmup_ratio", "float", 0.03, "warmup steps as a fraction of the run's optimizer steps"),
    _f("actor.min_lr_ratio", "float", 0.1, "final learning rate of cosine_with_min_lr, as a fraction of lr"),
    _f("actor.max_norm", "float", 1.0, "gradient-norm clipping threshold (<= 0: no clipping)"),
    _f("actor.gradient_checkpoint", "str", "none", "activation checkpointing of the learner model: full or none",
       ("full", "none", "true", "false")),
    _f("actor.num_nodes", "int", 1, "learner nodes (the native learner uses one process)"),
    _f("actor.num_gpus_per_node", "int", 1, "learner GPUs per node (the native learner uses one device)"),
    _f("ref.num_nodes", "int", 1, "reference-model nodes (no reference model: algo.kl.init_coef is 0)"),
    _f("ref.num_gpus_per_node", "int", 1, "reference-model GPUs per node"),
    # algorithm
    _f("algo.advantage.estimator", "str", "flash_reinforce", "flash_reinforce (reward minus batch mean) or grpo "
       "(reward minus prompt-group mean)", ("flash_reinforce", "grpo")),
    _f("algo.advantage.is_correction_level", "str", "off", "external importance correction; must be off "
       "(the fused loss does its own behavior correction)"),
    _f("algo.advantage.no_whiten", "bool", False, "grpo: do not divide advantages by the group std"),
    _f("algo.kl.init_coef", "float", 0.0, "KL-to-reference coefficient; must be 0 (no reference model)"),
    # checkpoints
    _f("ckpt.path", "str", None, "training-state checkpoints directory (default OUTPUT/checkpoints)"),
    _f("ckpt.output_dir", "str", None, "final Hugging Face model export directory (default OUTPUT/hf)"),
    _f("ckpt.save_steps", "int", 10, "checkpoint every this many updates (0: only at the end and on Ctrl-C)"),
    _f("ckpt.max_ckpt_num", "int", 3, "checkpoints kept (oldest removed first)"),
    # data
    _f("data.prompt_dataset", "str", None, "prompt dataset (JSONL/JSON/Parquet) for dataset-driven environments"),
    _f("data.input_key", "str", "prompt", "dataset key of the prompt"),
    _f("data.label_key", "str", "reward_model", "dataset key of the label"),
    _f("data.max_samples", "optint", None, "use the first N dataset rows"),
    _f("data.max_len", "int", 1024, "tokens per trajectory at most (prompt, actions and observations)"),
    _f("data.apply_chat_template", "bool", False, "render prompts with the tokenizer's chat template"),
    # evaluation
    _f("eval.dataset", "str", None, "evaluation prompt dataset (default: the environment's own eval seeds)"),
    _f("eval.steps", "int", 0, "evaluate every this many updates (0: never)"),
    _f("eval.eval_at_start", "bool", False, "evaluate before the first update"),
    _f("eval.n_samples_per_prompt", "int", 1, "samples per evaluation prompt"),
    _f("eval.temperature", "float", 0.7, "evaluation sampling temperature (0: greedy)"),
    _f("eval.top_p", "float", 0.7, "evaluation top-p"),
    _f("eval.num_prompts", "int", 64, "evaluation prompts of an environment without a finite prompt set"),
    # fsdp / learner placement
    _f("fsdp.attn_implementation", "str", None, "attention implementation of the models (eager, sdpa, "
       "flash_attention_2; default: transformers' choice)"),
    _f("fsdp.packing_samples", "bool", False, "packed learner forward (one row, reset positions) instead of "
       "padded rows"),
    _f("fsdp.param_dtype", "str", "fp32", "learner compute dtype (autocast; float32 master weights)",
       ("fp32", "float32", "bf16", "bfloat16", "fp16", "float16")),
    _f("fsdp.tp_size", "int", 1, "tensor-parallel size (only 1 on this runtime)"),
    _f("fsdp.ep_size", "int", 1, "expert-parallel size (only 1 on this runtime)"),
    _f("fsdp.cp_size", "int", 1, "context-parallel size (only 1 on this runtime)"),
    _f("fsdp.strategy", "str", "replicate", "data-parallel learner under torchrun: replicate (whole model per rank, "
       "gradients all-reduced) or fully_shard (FSDP2: parameters, gradients and optimizer state sharded)",
       ("replicate", "fully_shard")),
    # logging
    _f("logger.logging_steps", "int", 1, "print a log line every this many updates (metrics.jsonl gets every update)"),
    _f("logger.tensorboard.dir", "str", None, "write TensorBoard event files (the metrics.jsonl keys) to this "
       "directory (optional extra flashreinforce[tensorboard])"),
    _f("logger.wandb.project", "str", None, "log the metrics.jsonl keys to this Weights & Biases project (optional "
       "extra flashreinforce[wandb]; WANDB_MODE=offline works without network)"),
    _f("logger.wandb.run_name", "str", None, "W&B run name (default: the output directory's name)"),
    _f("logger.log_samples_steps", "int", 10, "write decoded trajectories to OUTPUT/samples.jsonl every this many "
       "updates (0: never)"),
    _f("logger.log_samples_num", "int", 4, "trajectories written per sample step"),
    _f("logger.warn_zero_variance_steps", "int", 5, "warn once when each of the first N updates had no reward "
       "variance, so nothing was learned (0: never)"),
    # rollout
    _f("rollout.batch_size", "int", 128, "prompts per learner batch"),
    _f("rollout.n_samples_per_prompt", "int", 1, "samples per prompt (1 for flash_reinforce)"),
    _f("rollout.max_new_tokens", "int", 512, "sampled tokens per turn at most"),
    _f("rollout.max_turns", "int", None, "policy turns per episode at most (default: $MAX_AGENT_TURNS if set, else "
       "the environment's own limit; the environment gets the same value)"),
    _f("rollout.temperature", "float", 1.0, "sampling temperature (also used for the learner's log-probabilities)"),
    _f("rollout.top_p", "float", 1.0, "sampling top-p"),
    _f("rollout.top_k", "int", 0, "sampling top-k (0: off)"),
    _f("rollout.micro_batch_size", "int", 1, "Molt's rollout forward micro-batch (no such pass here)"),
    _f("rollout.vllm_generate_batch_size", "int", 16, "episodes a rollout worker samples together"),
    _f("rollout.num_workers", "int", 2, "rollout workers running concurrently with the learner (engine vllm: "
       "vllm.num_engines)"),
    _f("rollout.backend", "str", "local", "where workers run: local (threads of the learner process) or ray "
       "(Ray actors; see --ray.*)", ("local", "ray")),
    _f("rollout.engine", "str", "hf", "rollout engine: hf (a Hugging Face model in the worker's process) or vllm "
       "(optional extra flashreinforce[vllm], needs CUDA)", ("hf", "vllm")),
    _f("rollout.env_timeout_s", "float", 120.0, "seconds an environment call (reset, step) may take; its episode is "
       "then quarantined and the environment instance abandoned (0: no limit)"),
    _f("rollout.max_failed_episodes_in_a_row", "int", 256, "stop the run when this many episodes in a row were "
       "quarantined or rejected (0: never)"),
    # Ray backend
    _f("ray.address", "str", None, "Ray cluster to join (auto, HOST:PORT, ray://...; default $RAY_ADDRESS); "
       "without one a local Ray instance is started for the run and stopped after it"),
    _f("ray.num_cpus_per_worker", "float", 1.0, "Ray CPUs each rollout worker actor reserves"),
    _f("ray.num_gpus_per_worker", "float", None, "Ray GPUs each rollout worker actor reserves (default: "
       "vllm.tensor_parallel_size with the vllm engine, else 0; fractions share a GPU)"),
    _f("ray.max_restarts", "int", 3, "restarts per rollout worker after its process dies (-1: unlimited)"),
    _f("ray.worker_resources", "json", None, "custom Ray resources each rollout worker reserves: a JSON object, or a "
       "list of objects that workers take in turn (e.g. [{\"node_a\": 1}, {\"node_b\": 1}])"),
    _f("ray.scheduling_strategy", "str", "default", "how Ray places rollout workers: default (Ray's: nodes near the "
       "driver first) or spread (over as many nodes as possible)", ("default", "spread")),
    # train
    _f("train.agent_path", "str", None, "environment: MODULE:CLASS, a .py file (optionally FILE.py:CLASS), or a "
       "shipped name (math, python_tool); alias --env"),
    _f("train.batch_size", "int", 128, "trajectories per update = rollout.batch_size * n_samples_per_prompt"),
    _f("train.micro_batch_size", "int", 1, "trajectories per learner micro-batch (0: all)"),
    _f("train.micro_batch_tokens", "int", 0, "tokens per learner micro-batch at most (0: no limit)"),
    _f("train.max_epochs", "int", 1, "optimizer passes over each batch; must be 1"),
    _f("train.num_episodes", "int", 1, "passes over a finite prompt set (sets the number of updates)"),
    _f("train.max_steps", "int", 0, "optimizer updates (0: num_episodes passes over the prompt set)"),
    _f("train.async_queue_size", "int", 1, "batches that may be in flight ahead of the learner (0: synchronous)"),
    _f("train.max_policy_lag", "optint", None, "drop trajectories more than this many versions old (none: keep)"),
    _f("train.stall_timeout_s", "float", 1800.0, "stop the run when no trajectory arrived for this many seconds "
       "while the learner waited for its batch (0: never)"),
    _f("train.force_on_policy", "bool", False, "Molt's one-update-per-batch switch (always so here)"),
    _f("train.colocate_fsdp_models", "bool", False, "Molt's model colocation switch (one process here)"),
    # vLLM engine (rollout.engine vllm)
    _f("vllm.num_engines", "int", 1, "vLLM engines, one per rollout worker (rollout.engine vllm)"),
    _f("vllm.tensor_parallel_size", "int", 1, "GPUs per vLLM engine"),
    _f("vllm.sync_backend", "str", "nccl", "Molt's weight-sync backend (weights travel through the weight store "
       "and vLLM's RPC here)"),
    _f("vllm.gpu_memory_utilization", "float", 0.9, "fraction of each GPU a vLLM engine may take"),
)

FLAG_BY_NAME = {f.name: f for f in FLAGS}

#: Options that are not Molt flags.
EXTRA_OPTIONS = ("preset", "env", "env.kwargs", "model", "tokenizer", "output", "resume", "seed", "device",
                 "torch_threads", "no_progress", "overwrite")


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number (inf allowed), got {text!r}") from None


def _bool(text: str) -> bool:
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _optint(text: str) -> int | None:
    if str(text).strip().lower() in ("none", "null", ""):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or none, got {text!r}") from None


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"expected JSON, got {text!r} ({err})") from None


def build_parser(prog: str = "flashreinforce train") -> argparse.ArgumentParser:
    """The ``flashreinforce train`` parser; every option defaults to "not given" (resolution fills in)."""
    p = argparse.ArgumentParser(prog=prog, allow_abbrev=False, argument_default=argparse.SUPPRESS,
                                description="Train a policy with asynchronous FlashREINFORCE (Molt-compatible flags).")
    g = p.add_argument_group("run")
    g.add_argument("--preset", help="toy or toy_multiturn (tiny model, no download); other flags override it")
    g.add_argument("--env", help="environment (alias of --train.agent_path)")
    g.add_argument("--env.kwargs", dest="env.kwargs", type=_json, help="JSON object of environment constructor arguments")
    g.add_argument("--model", help="policy model (alias of --actor.model_name_or_path)")
    g.add_argument("--tokenizer", help="char, or a local tokenizer directory (default: the model's)")
    g.add_argument("--output", help="run directory: config.json, metrics.jsonl, checkpoints")
    g.add_argument("--resume", nargs="?", const="latest",
                   help="continue from the last checkpoint (or the checkpoint directory given)")
    g.add_argument("--seed", type=int, help="run seed (default 0)")
    g.add_argument("--device", help="learner and engine device: auto, cpu, cuda, cuda:N (default auto)")
    g.add_argument("--torch_threads", type=int, help="torch intra-op threads (default: torch's)")
    g.add_argument("--no_progress", nargs="?", const=True, type=_bool, help="no progress bar")
    g.add_argument("--overwrite", nargs="?", const=True, type=_bool,
                   help="start over in an --output that holds an earlier run: delete its records and checkpoints first")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in FLAGS:
        section = f.name.split(".")[0]
        grp = groups.setdefault(section, p.add_argument_group(section))
        default = f"(default {f.default})" if f.default is not None else ""
        kwargs: dict[str, Any] = {"dest": f.name, "help": f"{f.help} {default}".strip()}
        if f.type == "float":
            kwargs["type"] = _float
        elif f.type == "int":
            kwargs["type"] = int
        elif f.type == "optint":
            kwargs["type"] = _optint
        elif f.type == "bool":
            kwargs.update(nargs="?", const=True, type=_bool)
        elif f.type == "float2":
            kwargs.update(nargs=2, type=_float, metavar=("LOW", "HIGH") if "clip" in f.name else ("B1", "B2"))
        elif f.type == "json":
            kwargs["type"] = _json
        if f.choices:
            kwargs["choices"] = f.choices
        grp.add_argument(f"--{f.name}", **kwargs)
    return p


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


def parse_train_args(argv: Sequence[str] | None, presets: Mapping[str, Mapping[str, Any]]) -> ResolvedConfig:
    """Parse ``flashreinforce train`` arguments and resolve them against ``presets``."""
    args = vars(build_parser().parse_args(argv))
    preset = None
    if "preset" in args:
        if args["preset"] not in presets:
            raise ConfigError(f"unknown --preset {args['preset']!r}; known presets: {', '.join(sorted(presets))}")
        preset = dict(presets[args["preset"]], preset=args["preset"])
    return resolve(args, preset)
