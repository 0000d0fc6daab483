"""From a resolved configuration to the parts of a run: the policy and its tokenizer, the
environments, the learner's and the rollout's settings.

Each function reads the configuration sections it names and nothing else, so the mapping from a
flag to the setting it controls is written once, here. None of them changes the configuration: what
only the loaded parts can decide (the environment's turn limit, a note on a flag the tokenizer makes
moot, a warning the environment makes moot) comes back with the part, and :func:`settled_config`
derives the run's configuration with it, as a new object.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from flashreinforce.config import ConfigError, TrainerConfig
from flashreinforce.config.schema import thawed
from flashreinforce.config.sections import ENGINE_SECTIONS
from flashreinforce.config.schema import shown
from flashreinforce.dtypes import canonical_dtype, resolve_auto_dtype, resolve_dtype
from flashreinforce.engines import EngineRun, SamplingParams, engine_kind
from flashreinforce.envs.base import Environment, resolve_max_turns
from flashreinforce.envs.registry import (EnvConfig, EnvironmentSpecError, EnvSpec, accepts_chat_template,
                                          environment_class, num_prompts)
from flashreinforce.models.attention import document_attention_unsupported
from flashreinforce.models.loading import adopt_model, build_model
from flashreinforce.models.lora import LoraSettings, apply_lora
from flashreinforce.models.tokenizers import CharTokenizer, HFTokenizer, load_tokenizer
from flashreinforce.trainer.learning.learner import LearnerSettings
from flashreinforce.trainer.rollout.settings import RolloutSettings

__all__ = ["Policy", "RunEnvironments", "device_of", "dtype_notes", "engine_dtype", "engine_options", "engine_run",
           "episode_turn_limit", "eval_environments", "learner_settings", "load_environments", "load_policy",
           "lora_settings", "rollout_settings", "sampling_params", "settled_config", "total_updates"]

log = logging.getLogger("flashreinforce.trainer")


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
    tokenizer does not wrap them again. inactive: flags this policy makes moot, with the reason.
    """

    model: torch.nn.Module
    tokenizer: Any
    env_renders_prompt: bool = False
    inactive: dict[str, str] = field(default_factory=dict)


def load_policy(cfg: TrainerConfig, device: torch.device, *, model: Any = None, tokenizer: Any = None) -> Policy:
    """Build the model named by ``actor.model_name_or_path`` and the tokenizer that goes with it
    (``--tokenizer`` overrides), with the chat template applied when ``data.apply_chat_template``.
    ``model`` / ``tokenizer``: objects given in Python (``flashreinforce.train``) used instead."""
    model_given, given_tokenizer = model is not None, tokenizer
    if model is not None:
        model, tok_spec = adopt_model(model, device=device, attn_implementation=cfg.fsdp.attn_implementation)
    elif cfg.actor.model_name_or_path is None:
        raise ConfigError("no model: give --model (or --actor.model_name_or_path, or a --preset)")
    else:
        model, tok_spec = build_model(cfg.actor.model_name_or_path, device=device,
                                      attn_implementation=cfg.fsdp.attn_implementation, seed=cfg.seed)
    if tokenizer is None and tok_spec is None and cfg.tokenizer is None:
        raise ConfigError("model: the model object has no local folder to read its tokenizer from; pass "
                          "tokenizer=... (a transformers tokenizer object or a folder) beside it")
    try:
        if tokenizer is not None:
            tokenizer = tokenizer if isinstance(tokenizer, (CharTokenizer, HFTokenizer)) else HFTokenizer(tokenizer)
        else:
            tokenizer = load_tokenizer(cfg.tokenizer or tok_spec)
    except (OSError, ValueError) as err:
        flag = f"--tokenizer {cfg.tokenizer}" if cfg.tokenizer else f"--model {cfg.actor.model_name_or_path}"
        first = (str(err).strip().splitlines() or [""])[0][:300]
        raise ConfigError(f"{flag}: cannot load a tokenizer from {cfg.tokenizer or tok_spec}: {first} (give "
                          "--tokenizer char or a directory holding a tokenizer)") from None
    spec = cfg.train.agent_path
    env_renders = False
    inactive = {}
    if cfg.data.apply_chat_template and isinstance(tokenizer, HFTokenizer):
        env_renders = spec is not None and accepts_chat_template(spec)
        tokenizer = HFTokenizer(tokenizer.tok, chat_prompt=not env_renders, chat_observations=True)
    elif cfg.data.apply_chat_template:
        inactive["data.apply_chat_template"] = "the character tokenizer has no chat template"
    emb = model.get_input_embeddings().weight.shape[0]
    if tokenizer.vocab_size > emb:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's embedding only "
                          f"{emb} rows; use a matching --tokenizer")
    if model_given and given_tokenizer is None and cfg.tokenizer and tokenizer.vocab_size < emb:
        log.warning("the model object has %d embedding rows but the tokenizer %s only %d tokens: episodes in which "
                    "the model samples a token past %d are quarantined; pass the model's own tokenizer "
                    "(tokenizer=...) unless those rows are padding", emb, cfg.tokenizer, tokenizer.vocab_size,
                    tokenizer.vocab_size - 1)
    if cfg.fsdp.packed_forward:
        problem = document_attention_unsupported(model)
        if problem is not None:
            raise ConfigError(f"--fsdp.packing_samples (the default): {problem}; give --fsdp.packing_samples false "
                              "for the padded learner forward")
    if cfg.lora.rank > 0:
        apply_lora(model, lora_settings(cfg))
    return Policy(model, tokenizer, env_renders, inactive)


def lora_settings(cfg: TrainerConfig) -> LoraSettings:
    """The ``lora`` section as :class:`~flashreinforce.models.lora.LoraSettings` (rank 0: no LoRA)."""
    targets = tuple(t.strip() for t in str(cfg.lora.target_modules).split(","))
    return LoraSettings(rank=cfg.lora.rank, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout, target_modules=targets,
                        base_dtype=canonical_dtype(cfg.lora.base_dtype, what="lora.base_dtype"))


@dataclass
class RunEnvironments:
    """The run's environments: the picklable recipe, a factory for this process, and the size of the
    prompt set (``None``: endless seeds); the run's turn limit (:func:`episode_turn_limit`) and the
    configuration's warnings that do not apply to these environments."""

    spec: EnvSpec
    factory: Callable[[], Environment]
    num_prompts: int | None
    max_turns: int | None = None
    moot_warnings: tuple[str, ...] = ()
    eval_rows: tuple[int, ...] | None = None


def episode_turn_limit(cfg: TrainerConfig, env_cls: type, env_kwargs: dict[str, Any]) -> int:
    """The run's turn limit (``rollout.max_turns``, else ``$MAX_AGENT_TURNS``, else the environment's
    ``default_max_turns``), also handed to the environment as ``max_turns`` when its constructor
    takes it and ``--env.kwargs`` does not set it, so the rollout's cap and the environment's own
    last turn are the same; ``--env.kwargs`` ``max_turns`` wins when the run sets none."""
    takes_max_turns = "max_turns" in inspect.signature(env_cls).parameters
    given = cfg.rollout.max_turns
    if given is None and takes_max_turns and env_kwargs.get("max_turns") is not None:
        given = env_kwargs["max_turns"]
    try:
        turns = resolve_max_turns(getattr(env_cls, "default_max_turns", Environment.default_max_turns), given)
    except ValueError as err:
        raise ConfigError(f"--rollout.max_turns: {err}") from None
    if takes_max_turns:
        env_kwargs.setdefault("max_turns", turns)
    return turns


def load_environments(cfg: TrainerConfig, policy: Policy) -> RunEnvironments:
    """The environments ``train.agent_path`` names, probed once for the size of their prompt set."""
    spec = cfg.train.agent_path
    if spec is None:
        raise ConfigError("no environment: give --env MODULE:CLASS (or --train.agent_path, or a --preset)")
    kwargs = thawed(cfg.env_kwargs)  # the environment's own copy, plain dicts and lists
    try:
        env_cls = environment_class(spec)
    except EnvironmentSpecError as err:
        raise ConfigError(f"--env {spec!r}: {err}") from None
    except ImportError as err:  # the module (or something it imports) is not installed
        raise ConfigError(f"--env {spec!r}: cannot import it: {type(err).__name__}: {err}") from None
    except TypeError as err:  # names something that is not an Environment subclass
        raise ConfigError(f"--env {spec!r}: {err}") from None
    if cfg.rewards:
        kwargs["rewards"] = _reward_functions(cfg)
    max_turns = episode_turn_limit(cfg, env_cls, kwargs)
    moot = _moot_kwargs_warnings(cfg, env_cls)
    env_spec = EnvSpec(spec, EnvConfig.of_run(cfg), kwargs, policy.env_renders_prompt)
    factory = env_spec.factory(policy.tokenizer)  # the class resolved above, so the spec is good
    try:
        inspect.signature(env_cls).bind_partial(**cfg.env_kwargs)
    except TypeError as err:
        raise ConfigError(f"--env.kwargs {shown(cfg.env_kwargs)}: the constructor of --env {spec} does not take "
                          f"them ({err})") from None
    probe = factory()
    try:
        prompts = num_prompts(probe)
        eval_rows = _evaluation_rows(probe)
    finally:
        probe.close()
    return RunEnvironments(env_spec, factory, prompts, max_turns, moot, eval_rows)


def _evaluation_rows(env: Environment) -> tuple[int, ...] | None:
    """The rows of the environment's own evaluation split (``evaluation_rows``, a dataset wrapper unwrapped)."""
    while env is not None:
        rows = getattr(env, "evaluation_rows", None)
        if rows:
            return tuple(int(r) for r in rows)
        env = getattr(env, "env", None)
    return None


def settled_config(cfg: TrainerConfig, policy: Policy, envs: RunEnvironments) -> TrainerConfig:
    """The run's configuration once its parts are loaded, as a new object (``cfg`` is left as it is):
    ``rollout.max_turns`` the environments' turn limit, the policy's notes on flags it makes moot, and
    without the warnings the environments make moot."""
    settled = cfg.copy()
    settled.rollout.max_turns = envs.max_turns
    settled.inactive.update(policy.inactive)
    settled.warnings = [w for w in cfg.warnings if w not in envs.moot_warnings]
    return settled.freeze() if cfg.frozen else settled


def _reward_functions(cfg: TrainerConfig) -> list:
    """``--reward`` specs (or the Python API's functions), each checked now: a spec that names nothing
    usable is a :class:`ConfigError`, not a failed episode per prompt."""
    from flashreinforce.envs.rewards import RewardSpecError, load_reward

    for spec in cfg.rewards:
        try:
            load_reward(spec)
        except RewardSpecError as err:
            raise ConfigError(str(err)) from None
    if cfg.data.prompt_dataset is None:
        raise ConfigError("--reward scores completions of the rows of --data.prompt_dataset; give one (a JSONL, "
                          "JSON or Parquet file, or a datasets save_to_disk folder)")
    return list(cfg.rewards)


def _moot_kwargs_warnings(cfg: TrainerConfig, env_cls: type) -> tuple[str, ...]:
    """The warning that a preset's ``env.kwargs`` were dropped with its environment matters only when the
    replacing environment could have taken some of them; otherwise it is moot (it stays a note in
    ``inactive``)."""
    note = cfg.inactive.get("env.kwargs")
    if note is None or note not in cfg.warnings:
        return ()
    from flashreinforce.config.presets import PRESETS

    dropped = PRESETS.get(cfg.preset or "", {}).get("env.kwargs") or {}
    params = inspect.signature(env_cls).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()) and not set(dropped) & set(params):
        return (note,)
    return ()


def eval_environments(cfg: TrainerConfig, envs: RunEnvironments, tokenizer) -> RunEnvironments:
    """The evaluation environments: ``eval.dataset`` rows when given, else the training ones."""
    if not cfg.eval.dataset:
        return envs
    spec = EnvSpec(envs.spec.spec, EnvConfig.of_run(cfg, eval_split=True), envs.spec.kwargs, envs.spec.chat_template)
    factory = spec.factory(tokenizer)
    probe = factory()
    try:
        prompts = num_prompts(probe)
    finally:
        probe.close()
    return RunEnvironments(spec, factory, prompts, envs.max_turns, envs.moot_warnings)


def total_updates(cfg: TrainerConfig, prompts: int | None) -> int:
    """``train.max_steps``, or the updates of ``train.num_episodes`` passes over a finite prompt set."""
    steps = cfg.train.max_steps
    if steps:
        return int(steps)
    if prompts is None:
        raise ConfigError(f"--train.max_steps {steps} means train.num_episodes passes over a finite prompt set, but "
                          "this environment has no finite prompt set (endless seeds): give --train.max_steps N > 0")
    steps = cfg.train.num_episodes * prompts // cfg.rollout.batch_size
    if steps <= 0:
        raise ConfigError(f"train.num_episodes {cfg.train.num_episodes} passes over {prompts} prompts "
                          f"make no full batch of rollout.batch_size {cfg.rollout.batch_size}")
    return int(steps)


def learner_settings(cfg: TrainerConfig, total_steps: int, device: torch.device | str = "cpu") -> LearnerSettings:
    """The learner's settings from the ``actor``, ``algo``, ``train``, ``rollout`` and ``fsdp`` sections
    (``fsdp.param_dtype auto`` decided for ``device``)."""
    a = cfg.actor
    return LearnerSettings(
        loss_mode=a.loss_mode, loss=cfg.loss_options(), lr=a.adam.lr, weight_decay=a.adam.weight_decay,
        betas=tuple(a.adam.betas), scheduler=a.lr_scheduler, warmup_ratio=a.lr_warmup_ratio, min_lr_ratio=a.min_lr_ratio,
        total_steps=total_steps, max_norm=a.max_norm, step_on_zero_gradient=a.step_on_zero_gradient,
        statistics_without_gradient=a.statistics_without_gradient,
        scale_step_by_acceptance=a.scale_step_by_acceptance, entropy_coef=a.entropy_coef,
        temperature=cfg.rollout.temperature,
        micro_batch_trajectories=cfg.train.micro_batch_trajectories, micro_batch_tokens=cfg.train.micro_batch_tokens,
        packed_forward=cfg.fsdp.packed_forward, share_prefixes=cfg.train.share_prefixes,
        compiled_layers=cfg.train.compiled_layers,
        param_dtype=resolve_dtype(cfg.fsdp.param_dtype, torch.device(device).type, what="fsdp.param_dtype"),
        gradient_checkpointing=a.gradient_checkpoint.lower() in ("full", "true"),
        peak_tflops=cfg.train.peak_tflops, head_operand_dtype=cfg.train.head_operand_dtype)


def sampling_params(cfg: TrainerConfig, tokenizer, *, evaluation: bool = False) -> SamplingParams:
    """Sampling of the rollouts (``rollout``) or of the evaluation (``eval``), stopping at the
    tokenizer's end-of-sequence tokens."""
    section = cfg.eval if evaluation else cfg.rollout
    return SamplingParams(section.temperature, section.top_p, cfg.rollout.top_k, tokenizer.eos_token_ids)


def rollout_settings(cfg: TrainerConfig, tokenizer, seed: int) -> RolloutSettings:
    """How workers roll out: lengths, turns, sampling, episodes per engine call."""
    return RolloutSettings(max_new_tokens=cfg.rollout.max_new_tokens, max_len=cfg.data.max_len,
                           max_turns=cfg.rollout.max_turns, sampling=sampling_params(cfg, tokenizer),
                           episodes_per_call=cfg.rollout.episodes_per_call, seed=seed,
                           env_timeout_s=cfg.rollout.env_timeout_s,
                           env_parallel_calls=cfg.rollout.env_parallel_calls,
                           episodes_in_flight=cfg.rollout.episodes_in_flight,
                           stream_call_min_episodes=cfg.rollout.stream_call_min_episodes,
                           stream_call_gather_s=cfg.rollout.stream_call_gather_s,
                           inflight_weight_updates=cfg.rollout.inflight_weight_updates and
                           cfg.train.fixed_policy_lag is None,
                           agent_sampling=cfg.rollout.agent_sampling)


def engine_dtype(cfg: TrainerConfig, device: torch.device | str = "cpu") -> str:
    """The rollout engines' weight dtype: ``rollout.engine_dtype``, where ``auto`` is the learner's
    resolved ``fsdp.param_dtype``."""
    if cfg.rollout.engine_dtype != "auto":
        return canonical_dtype(cfg.rollout.engine_dtype, what="rollout.engine_dtype")
    return resolve_dtype(cfg.fsdp.param_dtype, torch.device(device).type, what="fsdp.param_dtype")


def engine_run(cfg: TrainerConfig, seed: int, device: torch.device | str = "cpu") -> EngineRun:
    """What the run hands the selected engine kind (the boundary between the configuration and the
    engines): the run-wide values engines use, and the values of the engine's own flag section."""
    section = ENGINE_SECTIONS.get(cfg.rollout.engine)
    values = dataclasses.asdict(getattr(cfg, section)) if section else {}
    return EngineRun(seed=seed, dtype=engine_dtype(cfg, device), num_workers=cfg.rollout.num_workers,
                     max_len=cfg.data.max_len, episodes_per_call=cfg.rollout.episodes_per_call,
                     inflight_check_tokens=cfg.rollout.inflight_check_tokens, section=values)


def engine_options(cfg: TrainerConfig, seed: int, device: torch.device | str = "cpu") -> Any:
    """The rollout engine's typed options (its kind's ``options_type``, built from :func:`engine_run`),
    with the policy's LoRA settings (``lora``) when it trains adapters."""
    kind = engine_kind(cfg.rollout.engine)
    options = kind.options(engine_run(cfg, seed, device))
    if cfg.lora.rank > 0:
        if "lora" not in kind.option_names():
            raise ConfigError(f"--lora.rank: the {kind.name} rollout engine cannot serve LoRA adapters; use "
                              "--rollout.engine hf or vllm")
        settings = lora_settings(cfg)
        options = dataclasses.replace(options, lora={"rank": settings.rank, "alpha": settings.alpha,
                                                     "dropout": settings.dropout,
                                                     "target_modules": settings.target_modules})
    return options


def dtype_notes(cfg: TrainerConfig, device: torch.device | str = "cpu") -> list[str]:
    """One line for each dtype option left at ``auto``, saying what it became here and why."""
    notes = []
    kind = torch.device(device).type
    if cfg.fsdp.param_dtype == "auto" or cfg.rollout.engine_dtype == "auto":
        name, why = resolve_auto_dtype(kind) if cfg.fsdp.param_dtype == "auto" else (cfg.fsdp.param_dtype, "")
        what = [f for f, v in (("fsdp.param_dtype", cfg.fsdp.param_dtype), ("rollout.engine_dtype",
                                                                             cfg.rollout.engine_dtype)) if v == "auto"]
        notes.append(f"{' and '.join(what)} auto: {canonical_dtype(name)}" + (f" ({why})" if why else ""))
    return notes
