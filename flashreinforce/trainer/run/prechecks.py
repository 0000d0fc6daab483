"""What a run checks before it loads the model: every path and setting that can be checked without it.

Loading a real model takes from seconds to minutes; a mistake in the environment, the reward
functions, a dataset, the checkpoint to resume from, the tokenizer or the model's path is reported
before that (one line naming the flag, exit status 2), not after. :func:`check_before_model` is
called by ``flashreinforce train`` (through :class:`~flashreinforce.trainer.Trainer`) and
``flashreinforce eval``. What needs the model or the tokenizer (a chat template, the vocabulary,
the environment's constructor with them) is checked when they are there, as before.
"""

from __future__ import annotations

from pathlib import Path

from flashreinforce.config import ConfigError, TrainerConfig
from flashreinforce.config.trainer_config import AGENT_ENVIRONMENT

__all__ = ["check_before_model", "check_rollout_engine"]


def check_rollout_engine(cfg: TrainerConfig) -> None:
    """Raise :class:`ConfigError` naming ``--rollout.engine`` when its engine cannot run here (vLLM
    not installed, or installed in a way that does not load): training checks it before the model
    loads (``flashreinforce eval`` samples with the hf engine and does not)."""
    from flashreinforce.engines import engine_kind

    try:
        engine_kind(cfg.rollout.engine).check_installed()
    except ImportError as err:
        raise ConfigError(f"--rollout.engine {cfg.rollout.engine}: {err}") from None


def check_before_model(cfg: TrainerConfig, *, ckpt_dir: str | Path | None = None, model_given: bool = False) -> None:
    """Raise :class:`ConfigError` (one line naming the flag) for the first problem found in ``cfg``
    that does not need the model: the environment (importable), the reward functions (their files
    and functions), ``data.prompt_dataset`` and ``eval.dataset`` (read, as the run reads them: the
    rows are cached for it), ``--resume`` (a checkpoint to resume from under ``ckpt_dir``), the
    model (an alias's package, a run directory's checkpoint, a path that exists; skipped with
    ``model_given``: a model object) and ``--tokenizer``."""
    from flashreinforce.envs.registry import (REASONING_GYM_PREFIX, EnvConfig, EnvironmentSpecError, dataset_tasks,
                                              environment_class)

    spec = cfg.train.agent_path
    if spec is None:
        if cfg.preset == "agent":
            raise ConfigError("--preset agent: name your agent function with --agent FILE.py:FUNC (or MODULE:FUNC)")
        raise ConfigError("no environment: give --env MODULE:CLASS, --agent FILE.py:FUNC, --reward FILE.py:FUNC "
                          "with --data.prompt_dataset, or a --preset")
    try:
        environment_class(spec)
    except EnvironmentSpecError as err:
        raise ConfigError(f"--env {spec!r}: {err}") from None
    except ImportError as err:
        raise ConfigError(f"--env {spec!r}: cannot import it: {type(err).__name__}: {err}") from None
    except TypeError as err:
        raise ConfigError(f"--env {spec!r}: {err}") from None
    if spec.startswith(REASONING_GYM_PREFIX):  # the package and the task's name, before the model loads
        from flashreinforce.envs.reasoning_gym_env import check_task

        check_task(spec[len(REASONING_GYM_PREFIX):])
        for flag, dataset in (("--data.prompt_dataset", cfg.data.prompt_dataset), ("--eval.dataset", cfg.eval.dataset)):
            if dataset is not None:
                raise ConfigError(f"{flag}: --env {spec} makes its own prompt set from the task's generator (its size "
                                  "and seed in --env.kwargs); give no dataset")
    if spec.startswith(("verifiers:", "openenv:")):  # the library, the taskset or class, before the model loads
        for flag, dataset in (("--data.prompt_dataset", cfg.data.prompt_dataset), ("--eval.dataset", cfg.eval.dataset)):
            if dataset is not None:
                raise ConfigError(f"{flag}: --env {spec} makes its own prompt set; give no dataset")
        if spec.startswith("verifiers:"):
            from flashreinforce.agents.server import require_server_packages
            from flashreinforce.envs.standards.verifiers_env import check_taskset

            try:
                require_server_packages()
            except ImportError as err:
                raise ConfigError(f"--env {spec}: {err}") from None
            check_taskset(spec[len("verifiers:"):])
        else:
            from flashreinforce.envs.standards.openenv_env import check_target

            check_target(spec[len("openenv:"):])
    if spec == AGENT_ENVIRONMENT and cfg.env_kwargs.get("agent") is not None:  # --agent's file and function
        from flashreinforce.agents.server import require_server_packages
        from flashreinforce.agents.environment import load_agent

        try:
            require_server_packages()
        except ImportError as err:
            raise ConfigError(f"--agent: {err}") from None
        load_agent(cfg.env_kwargs["agent"])  # AgentSpecError is a ConfigError naming --agent
    if cfg.rewards:
        from flashreinforce.envs.rewards import RewardSpecError, load_reward

        if cfg.data.prompt_dataset is None:
            raise ConfigError("--reward scores completions of the rows of --data.prompt_dataset; give one (a JSONL, "
                              "JSON or Parquet file, or a datasets save_to_disk folder)")

        for reward in cfg.rewards:
            try:
                load_reward(reward)
            except RewardSpecError as err:
                raise ConfigError(str(err)) from None
    dataset_tasks(spec, EnvConfig.of_run(cfg))  # DatasetError is a ConfigError naming the flag
    if cfg.eval.dataset is not None:
        dataset_tasks(spec, EnvConfig.of_run(cfg, eval_split=True))
    if cfg.resume and ckpt_dir is not None:
        _check_resume(cfg.resume, Path(ckpt_dir))
    if not model_given:
        _check_model(cfg.actor.model_name_or_path)
    if cfg.tokenizer not in (None, "char") and not Path(cfg.tokenizer).exists():
        from flashreinforce.models.loading import MODEL_ALIASES

        if cfg.tokenizer not in MODEL_ALIASES:
            raise ConfigError(f"--tokenizer {cfg.tokenizer}: no such file or directory (give char, a directory "
                              "holding a tokenizer, a .gguf file or a model alias)")


def _check_resume(resume: str, ckpt_dir: Path) -> None:
    from flashreinforce.trainer.persistence.checkpoints import find_checkpoint

    if resume != "latest":
        find_checkpoint(ckpt_dir, resume)  # a ConfigError naming --resume when there is nothing there
        return
    steps = [p for p in ckpt_dir.glob("step_*") if p.is_dir() and not p.is_symlink()] if ckpt_dir.is_dir() else []
    if not steps:
        raise ConfigError(f"--resume: no checkpoint in {ckpt_dir} (start the run without --resume, or name the run "
                          "directory with --output)")


def _check_model(spec: str | None) -> None:
    from flashreinforce.models.loading import MODEL_ALIASES, TINY_MODELS, resolve_model_spec

    if spec is None:
        raise ConfigError("no model: give --model (or --actor.model_name_or_path, or a --preset)")
    if spec in TINY_MODELS or spec in MODEL_ALIASES:
        resolve_model_spec(spec)  # an alias whose package is missing names its install line
        return
    if not Path(spec).exists():
        raise ConfigError(f"--model {spec!r}: no such file or directory (models are never downloaded: give a Hugging "
                          f"Face folder, a .gguf file, a run directory, a model alias ({', '.join(MODEL_ALIASES)}) "
                          f"or a tiny config ({', '.join(sorted(TINY_MODELS))}))")
    resolve_model_spec(spec)  # a run directory without a checkpoint
