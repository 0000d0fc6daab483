"""The Python entry point: :func:`train` does what ``flashreinforce train`` does, from Python objects.

::

    import flashreinforce as fr

    def correct(prompt, completion, answer, **row):        # a plain reward function
        return float(completion.strip() == str(answer))

    config = fr.TrainerConfig.from_preset("arith", output="runs/mine")
    config.train.max_steps = 50
    summary = fr.train(config, model="smollm2-135m-instruct", rewards=[correct],
                       dataset=[{"prompt": "What is 2+3?", "answer": 5}, ...])

The configuration is a :class:`~flashreinforce.config.TrainerConfig` (its fields are the flags), a
config file (YAML or JSON), a mapping of settings in the config-file format, or ``None`` (the
defaults); the keyword arguments set what the command line's run options set. The run is the
command's: the same checks (one ``ConfigError`` naming the setting), the same run directory, the
same summary (returned).
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from flashreinforce.config import ConfigError, TrainerConfig, read_config_file, validate
from flashreinforce.config.files import flatten_settings
from flashreinforce.config.presets import PRESETS
from flashreinforce.config.trainer_config import AGENT_ENVIRONMENT, REWARD_ENVIRONMENT, RUN_FIELDS

__all__ = ["load_config", "train"]


def load_config(source: TrainerConfig | str | os.PathLike | Mapping[str, Any] | None = None) -> TrainerConfig:
    """A checked :class:`TrainerConfig` from a config, a YAML/JSON file, a settings mapping (nested by
    section or dotted, ``preset:`` allowed: the file format) or ``None`` (the defaults). A given config
    is copied, not changed."""
    if isinstance(source, TrainerConfig):
        cfg = source.copy()
        validate(cfg)
        return cfg
    if source is None:
        flat: dict[str, Any] = {}
    elif isinstance(source, (str, os.PathLike)):
        flat = read_config_file(Path(source))
    elif isinstance(source, Mapping):
        flat = flatten_settings(source, "the settings")
    else:
        raise ConfigError(f"config must be a TrainerConfig, a path to a YAML or JSON file, a mapping of settings "
                          f"or None, got {type(source).__name__}")
    preset = flat.get("preset")
    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; known presets: {', '.join(sorted(PRESETS))}")
    cfg = TrainerConfig.from_layers({}, dict(PRESETS[preset], preset=preset) if preset else None, flat)
    validate(cfg)
    return cfg


def _env_spec(env: Any) -> str:
    """An environment as the spec the trainer's workers import: a spec string, or an Environment class."""
    from flashreinforce.envs.base import Environment

    if isinstance(env, str):
        return env
    if inspect.isclass(env) and issubclass(env, Environment):
        if "<locals>" in env.__qualname__:
            raise ConfigError(f"env {env.__qualname__}: a class defined inside a function cannot be imported by the "
                              "rollout workers; define it at module level")
        return f"{env.__module__}:{env.__qualname__}"
    raise ConfigError(f"env must be a spec (a shipped name, MODULE:CLASS, FILE.py[:CLASS]) or an Environment "
                      f"subclass, got {type(env).__name__} (for a reward over completions, pass rewards=[...])")


def train(config: TrainerConfig | str | os.PathLike | Mapping[str, Any] | None = None, *, model: Any = None,
          env: Any = None, rewards: Sequence[Callable | tuple | str] | None = None, agent: Callable | str | None = None,
          dataset: Any = None, eval_dataset: Any = None, callbacks: Sequence[Any] = (), **run_options: Any) -> dict[str, Any]:
    """Train a policy; returns the run's summary (what ``flashreinforce train`` prints).

    Args:
        config: see :func:`load_config` (copied: the caller's object is not changed).
        model: ``--model``: a Hugging Face folder, a ``.gguf`` file, an alias, a run directory or a tiny config;
            or a ``transformers`` causal LM object (``AutoModelForCausalLM.from_pretrained(...)``), trained in
            place (moved to the run's device in float32). Its tokenizer comes from its local folder, else
            give ``tokenizer=`` (a folder, ``"char"``, or a tokenizer object); a preset's tokenizer is not
            used for it (it belongs to the preset's model). A PEFT-wrapped model is refused
            (every weight is trained here): pass ``model.merge_and_unload()``.
        env: ``--env``: a spec string or an :class:`~flashreinforce.envs.Environment` subclass (defined at
            module level, so that the rollout workers can import it).
        rewards: reward functions ``reward(prompt, completion, **row) -> float`` (or ``(function, weight)``
            pairs, or ``MODULE:FUNC[=WEIGHT]`` strings), summed with their weights over the rows of
            ``dataset``: a single-turn task without an Environment class (``env`` must then be unset).
        agent: an agent function ``agent(client, row) -> reward`` (or a ``FILE.py:FUNC`` / ``MODULE:FUNC``
            string) that calls the policy through the OpenAI client it is given (``async def``: an
            ``AsyncOpenAI`` client); ``env`` and ``rewards`` must then be unset (docs/environments.md).
        dataset / eval_dataset: ``data.prompt_dataset`` / ``eval.dataset``: a path (JSONL, JSON, Parquet,
            a ``datasets`` ``save_to_disk`` folder), a list of dicts, or a ``datasets.Dataset``.
        callbacks: objects with ``on_update(metrics)`` (return True to stop), ``on_eval(step, metrics)``,
            ``on_save(step, path)``, ``on_train_begin(info)``, ``on_train_end(summary)`` (any of them; a
            plain function is ``on_update``): :mod:`flashreinforce.trainer.run.callbacks`.
        run_options: ``output`` (required), ``seed``, ``resume``, ``overwrite``, ``device``,
            ``torch_threads``, ``tokenizer`` (also a tokenizer object), ``env_kwargs``, ``progress``,
            ``allow_config_change``.

    Raises ``ConfigError`` (one line naming the setting) before anything starts, and what the command
    reports as a failed run (:class:`flashreinforce.trainer.errors.RunFailure`) after.
    """
    cfg = load_config(config)
    given = set(run_options)
    tokenizer = run_options.pop("tokenizer", None)
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        from flashreinforce.models.loading import describe_object

        cfg.tokenizer = describe_object(tokenizer)
    elif tokenizer is not None:
        cfg.tokenizer, tokenizer = os.fspath(tokenizer), None
    for key, value in run_options.items():
        if key not in RUN_FIELDS:
            raise ConfigError(f"train(): unknown option {key!r}; options: {', '.join(sorted(RUN_FIELDS))}, and the "
                              "config's fields for every flag (config.train.max_steps = ...)")
        setattr(cfg, key, value)
    model_object = None
    if isinstance(model, (str, os.PathLike)):
        cfg.actor.model_name_or_path = os.fspath(model)
    elif model is not None:
        from flashreinforce.models.loading import describe_object

        model_object, cfg.actor.model_name_or_path = model, describe_object(model)
        if "tokenizer" not in given and cfg.preset and cfg.tokenizer == PRESETS[cfg.preset].get("tokenizer"):
            # The preset's tokenizer belongs to the preset's model: a model object reads its own (from its
            # folder; without one, tokenizer= is asked for), never one whose vocabulary it may not share.
            cfg.tokenizer = None
    if agent is not None:
        if env is not None or rewards is not None:
            raise ConfigError("train(): give agent, env or rewards, not several (the agent's return value is the reward)")
        from flashreinforce.agents.environment import agent_spec

        cfg.train.agent_path = AGENT_ENVIRONMENT
        cfg.env_kwargs = {**(cfg.env_kwargs if "env_kwargs" in run_options else {}), "agent": agent_spec(agent)}
    elif rewards is not None:
        if env is not None:
            raise ConfigError("train(): give env or rewards, not both (rewards score completions with the "
                              f"{REWARD_ENVIRONMENT} environment)")
        cfg.rewards = list(rewards) if not (callable(rewards) or isinstance(rewards, (str, tuple))) else [rewards]
        cfg.train.agent_path = REWARD_ENVIRONMENT
        cfg.env_kwargs = {}
    elif env is not None:
        spec = _env_spec(env)
        if spec != cfg.train.agent_path and "env_kwargs" not in run_options:
            cfg.env_kwargs = {}  # a preset's environment arguments belong to its environment
        cfg.train.agent_path = spec
    if dataset is not None:
        cfg.data.prompt_dataset = dataset
    if eval_dataset is not None:
        cfg.eval.dataset = eval_dataset
    validate(cfg)
    from flashreinforce.distributed.scale_out import DistributedScaleOut
    from flashreinforce.trainer import Trainer
    from flashreinforce.trainer.run.callbacks import CallbackList

    try:
        hooks = CallbackList(callbacks)
    except TypeError as err:
        raise ConfigError(f"train(): {err}") from None
    return Trainer(cfg, model=model_object, tokenizer=tokenizer, callbacks=hooks,
                   scale_out=DistributedScaleOut()).run()
