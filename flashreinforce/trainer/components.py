"""From a resolved configuration to the parts of a run: the policy and its tokenizer, the
environments, the learner's and the rollout's settings.

Each function reads the dotted flags it names and nothing else, so the mapping from a Molt flag to
the setting it controls is written once, here.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from flashreinforce.config import ConfigError, ResolvedConfig
from flashreinforce.engines import SamplingParams
from flashreinforce.envs.base import Environment, resolve_max_turns
from flashreinforce.envs.registry import (EnvironmentSpecError, EnvSpec, accepts_chat_template, environment_class,
                                          num_prompts)
from flashreinforce.models.attention import document_attention_unsupported
from flashreinforce.models.loading import build_model
from flashreinforce.models.tokenizers import HFTokenizer, load_tokenizer
from flashreinforce.trainer.learner import LearnerSettings
from flashreinforce.trainer.rollout import RolloutSettings

__all__ = ["Policy", "RunEnvironments", "device_of", "engine_options", "eval_environments", "learner_settings",
           "episode_turn_limit", "load_environments", "load_policy", "rollout_settings", "sampling_params", "total_updates"]


def device_of(name: str) -> torch.device:
    """``auto`` (CUDA when available) or an explicit torch device name; a device this machine does not
    have is a :class:`ConfigError` naming ``--device``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError) as err:
        raise ConfigError(f"--device {name!r} is not a device name (auto, cpu, cuda, cuda:N): {err}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name}: no CUDA device is available here (torch.cuda.is_available() is "
                              "False); use --device cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


@dataclass
class Policy:
    """The policy model (float32 master weights on its device) and its tokenizer.

    env_renders_prompt: the environment renders prompts with the chat template itself, so the
    tokenizer does not wrap them again.
    """

    model: torch.nn.Module
    tokenizer: Any
    env_renders_prompt: bool = False


def load_policy(cfg: ResolvedConfig, device: torch.device) -> Policy:
    """Build the model named by ``actor.model_name_or_path`` and the tokenizer that goes with it
    (``--tokenizer`` overrides), with the chat template applied when ``data.apply_chat_template``."""
    f = cfg.flags
    if f["actor.model_name_or_path"] is None:
        raise ConfigError("no model: give --model (or --actor.model_name_or_path, or a --preset)")
    model, tok_spec = build_model(f["actor.model_name_or_path"], device=device,
                                  attn_implementation=f["fsdp.attn_implementation"], seed=cfg.seed)
    try:
        tokenizer = load_tokenizer(cfg.tokenizer or tok_spec)
    except (OSError, ValueError) as err:
        flag = f"--tokenizer {cfg.tokenizer}" if cfg.tokenizer else f"--model {f['actor.model_name_or_path']}"
        first = (str(err).strip().splitlines() or [""])[0][:300]
        raise ConfigError(f"{flag}: cannot load a tokenizer from {cfg.tokenizer or tok_spec}: {first} (give "
                          "--tokenizer char or a directory holding a tokenizer)") from None
    spec = f["train.agent_path"]
    env_renders = False
    if f["data.apply_chat_template"] and isinstance(tokenizer, HFTokenizer):
        env_renders = spec is not None and accepts_chat_template(spec)
        tokenizer = HFTokenizer(tokenizer.tok, chat_prompt=not env_renders, chat_observations=True)
    elif f["data.apply_chat_template"]:
        cfg.inactive["data.apply_chat_template"] = "the character tokenizer has no chat template"
    emb = model.get_input_embeddings().weight.shape[0]
    if tokenizer.vocab_size > emb:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's embedding only "
                          f"{emb} rows; use a matching --tokenizer")
    if f["fsdp.packing_samples"]:
        problem = document_attention_unsupported(model)
        if problem is not None:
            raise ConfigError(f"--fsdp.packing_samples (the default): {problem}; give --fsdp.packing_samples false "
                              "for the padded learner forward")
    return Policy(model, tokenizer, env_renders)


@dataclass
class RunEnvironments:
    """The run's environments: the picklable recipe, a factory for this process, and the size of the
    prompt set (``None``: endless seeds)."""

    spec: EnvSpec
    factory: Callable[[], Environment]
    num_prompts: int | None


def episode_turn_limit(flags: dict[str, Any], env_cls: type, env_kwargs: dict[str, Any]) -> int:
    """The run's turn limit (``rollout.max_turns``, else ``$MAX_AGENT_TURNS``, else the environment's
    ``default_max_turns``), also handed to the environment as ``max_turns`` when its constructor
    takes it and ``--env.kwargs`` does not set it, so the rollout's cap and the environment's own
    last turn are the same; ``--env.kwargs`` ``max_turns`` wins when the run sets none."""
    takes_max_turns = "max_turns" in inspect.signature(env_cls).parameters
    given = flags["rollout.max_turns"]
    if given is None and takes_max_turns and env_kwargs.get("max_turns") is not None:
        given = env_kwargs["max_turns"]
    try:
        turns = resolve_max_turns(getattr(env_cls, "default_max_turns", Environment.default_max_turns), given)
    except ValueError as err:
        raise ConfigError(f"--rollout.max_turns: {err}") from None
    if takes_max_turns:
        env_kwargs.setdefault("max_turns", turns)
    return turns


def load_environments(cfg: ResolvedConfig, policy: Policy) -> RunEnvironments:
    """The environments ``train.agent_path`` names, probed once for the size of their prompt set."""
    spec = cfg.flags["train.agent_path"]
    if spec is None:
        raise ConfigError("no environment: give --env MODULE:CLASS (or --train.agent_path, or a --preset)")
    kwargs = dict(cfg.env_kwargs)
    try:
        env_cls = environment_class(spec)
    except EnvironmentSpecError as err:
        raise ConfigError(f"--env {spec!r}: {err}") from None
    except ImportError as err:  # the module (or something it imports) is not installed
        raise ConfigError(f"--env {spec!r}: cannot import it: {type(err).__name__}: {err}") from None
    except TypeError as err:  # names something that is not an Environment subclass
        raise ConfigError(f"--env {spec!r}: {err}") from None
    cfg.flags["rollout.max_turns"] = episode_turn_limit(cfg.flags, env_cls, kwargs)
    env_spec = EnvSpec(spec, cfg.env_config(), kwargs, policy.env_renders_prompt)
    factory = env_spec.factory(policy.tokenizer)  # the class resolved above, so the spec is good
    try:
        inspect.signature(env_cls).bind_partial(**cfg.env_kwargs)
    except TypeError as err:
        raise ConfigError(f"--env.kwargs {json.dumps(cfg.env_kwargs)}: the constructor of --env {spec} does not take "
                          f"them ({err})") from None
    probe = factory()
    try:
        prompts = num_prompts(probe)
    finally:
        probe.close()
    return RunEnvironments(env_spec, factory, prompts)


def eval_environments(cfg: ResolvedConfig, envs: RunEnvironments, tokenizer) -> RunEnvironments:
    """The evaluation environments: ``eval.dataset`` rows when given, else the training ones."""
    if not cfg.flags["eval.dataset"]:
        return envs
    spec = EnvSpec(envs.spec.spec, cfg.env_config(eval_split=True), envs.spec.kwargs, envs.spec.chat_template)
    factory = spec.factory(tokenizer)
    probe = factory()
    try:
        prompts = num_prompts(probe)
    finally:
        probe.close()
    return RunEnvironments(spec, factory, prompts)


def total_updates(flags: Mapping[str, Any], prompts: int | None) -> int:
    """``train.max_steps``, or the updates of ``train.num_episodes`` passes over a finite prompt set."""
    steps = flags["train.max_steps"]
    if steps:
        return int(steps)
    if prompts is None:
        raise ConfigError(f"--train.max_steps {steps} means train.num_episodes passes over a finite prompt set, but "
                          "this environment has no finite prompt set (endless seeds): give --train.max_steps N > 0")
    steps = flags["train.num_episodes"] * prompts // flags["rollout.batch_size"]
    if steps <= 0:
        raise ConfigError(f"train.num_episodes {flags['train.num_episodes']} passes over {prompts} prompts "
                          f"make no full batch of rollout.batch_size {flags['rollout.batch_size']}")
    return int(steps)


def learner_settings(flags: Mapping[str, Any], total_steps: int) -> LearnerSettings:
    """The learner's settings from the ``actor.*``, ``algo.*``, ``train.*`` and ``fsdp.*`` flags."""
    lo, hi = flags["actor.eps_clip_low_high"]
    return LearnerSettings(
        loss_mode=flags["actor.loss_mode"], delta=flags["actor.flash_gate_delta"], neg_topq=flags["actor.flash_neg_topq"],
        loss_agg=flags["actor.flash_loss_agg"], loss_scale_factor=flags["actor.loss_scale_factor"],
        no_is=flags["actor.flash_no_is"], eps_clip=(lo, hi), whiten=not flags["algo.advantage.no_whiten"],
        lr=flags["actor.adam.lr"], weight_decay=flags["actor.adam.weight_decay"], betas=tuple(flags["actor.adam.betas"]),
        scheduler=flags["actor.lr_scheduler"], warmup_ratio=flags["actor.lr_warmup_ratio"],
        min_lr_ratio=flags["actor.min_lr_ratio"], total_steps=total_steps, max_norm=flags["actor.max_norm"],
        entropy_coef=flags["actor.entropy_coef"], temperature=flags["rollout.temperature"],
        micro_batch_trajectories=flags["train.micro_batch_size"], micro_batch_tokens=flags["train.micro_batch_tokens"],
        packed_forward=bool(flags["fsdp.packing_samples"]), share_prefixes=bool(flags["train.share_prefixes"]),
        param_dtype=flags["fsdp.param_dtype"],
        gradient_checkpointing=str(flags["actor.gradient_checkpoint"]).lower() in ("full", "true"))


def sampling_params(flags: Mapping[str, Any], tokenizer, *, evaluation: bool = False) -> SamplingParams:
    """Sampling of the rollouts (``rollout.*``) or of the evaluation (``eval.*``), stopping at the
    tokenizer's end-of-sequence tokens."""
    prefix = "eval" if evaluation else "rollout"
    return SamplingParams(flags[f"{prefix}.temperature"], flags[f"{prefix}.top_p"], flags["rollout.top_k"],
                          tokenizer.eos_token_ids)


def rollout_settings(flags: Mapping[str, Any], tokenizer, seed: int) -> RolloutSettings:
    """How workers roll out: lengths, turns, sampling, episodes per engine call."""
    return RolloutSettings(max_new_tokens=flags["rollout.max_new_tokens"], max_len=flags["data.max_len"],
                           max_turns=flags["rollout.max_turns"], sampling=sampling_params(flags, tokenizer),
                           episodes_per_call=flags["rollout.vllm_generate_batch_size"], seed=seed,
                           env_timeout_s=flags["rollout.env_timeout_s"])


def engine_options(flags: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """The vLLM engine's options from the flags (empty for the local engine)."""
    if flags["rollout.engine"] != "vllm":
        return {}
    dtype = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}.get(
        flags["fsdp.param_dtype"], "auto")
    return {"tensor_parallel_size": flags["vllm.tensor_parallel_size"],
            "gpu_memory_utilization": flags["vllm.gpu_memory_utilization"], "dtype": dtype, "seed": seed,
            "max_model_len": flags["data.max_len"]}
