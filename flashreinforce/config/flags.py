"""The trainer's flag registry, as data: one :class:`Flag` row per flag.

Flags keep Molt's dotted names (``--rollout.batch_size``, ``--actor.adam.lr``, ...) so users move
between the two trainers unchanged. Every row holds the name, type, default, help and whether the
flag means something on this runtime. Parsing the command line is
:mod:`flashreinforce.config.command_line`; merging defaults, a preset and the given flags, and
checking the result, is :mod:`flashreinforce.config.resolution`.

Types: ``float`` (``inf`` allowed), ``int``, ``str``, ``bool`` (``--flag`` alone means true; also
``--flag true|false``), ``float2`` (two floats, ``--actor.eps_clip_low_high 0.2 0.2``), ``json``
(a JSON value), ``optint`` (an int or ``none``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["EXTRA_OPTIONS", "FLAGS", "FLAG_BY_NAME", "ConfigError", "Flag"]


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
    _f("fsdp.packing_samples", "bool", True, "packed learner forward: one row per micro-batch, per-document "
       "attention (no [S, S] mask), no padding; false: padded rows"),
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
    _f("train.share_prefixes", "bool", True, "packed forward: compute once a token prefix that several "
       "trajectories of a micro-batch share (system prompt, GRPO prompt groups); exact, found from the token ids"),
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
