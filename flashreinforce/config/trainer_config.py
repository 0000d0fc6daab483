"""The configuration of a run as one typed object: the sections (every flag) and the run's options.

:class:`TrainerConfig` is what ``flashreinforce train`` resolves from its command line and what a
Python user builds directly::

    from flashreinforce import TrainerConfig, train

    config = TrainerConfig.from_preset("toy", output="runs/api")
    config.train.max_steps = 50          # the field of --train.max_steps
    train(config)

:func:`resolve` builds one from layers of flat dotted settings (the defaults, a preset, a config file,
the command line) and checks it. The flag table (:data:`FLAGS`, one row per field) is built here from
the sections. ``config.flags`` is the same configuration as a flat mapping of dotted flag names, for the
records and the loss mode's rules (:mod:`flashreinforce.objective`); this module resolves the published
launchers' flat names, and past it the configuration is read by attribute (environments get a small
typed view, ``flashreinforce.envs.registry.EnvConfig``).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from flashreinforce.config.checks import raise_errors, validate
from flashreinforce.config.schema import (FIELD_FLAGS, RETIRED_FLAGS, ConfigError, Freezable, check_value, flag_table,
                                          freeze, get_path, section, set_path, shown, thaw, thawed)
from flashreinforce.config.sections import (ActorConfig, AlgoConfig, CkptConfig, DataConfig, EvalConfig, FsdpConfig,
                                            LoggerConfig, LoraConfig, RayConfig, RefConfig, RolloutConfig,
                                            TrainConfig, VllmConfig)
from flashreinforce.objective import OPTION_FLAGS, LossOptions, options_from_flags

__all__ = ["FLAGS", "FLAG_BY_NAME", "RUN_OPTIONS", "TrainerConfig", "resolve"]

#: The run's own options (not Molt flags): name -> help. ``env`` and ``model`` are aliases of
#: ``train.agent_path`` and ``actor.model_name_or_path``.
RUN_OPTIONS = {
    "preset": "a named preset (see --help); other settings override it",
    "env": "environment (alias of --train.agent_path): a shipped name, MODULE:CLASS, FILE.py[:CLASS], "
           "reasoning_gym:TASK (a reasoning-gym task, its configuration in --env.kwargs), verifiers:MODULE or "
           "verifiers:FILE.py (a verifiers taskset, played through the agent endpoint), or openenv:MODULE:CLASS, "
           "openenv:FILE.py[:CLASS] or openenv:URL (an OpenEnv environment; a class is served by the run)",
    "env.kwargs": "JSON object of environment constructor arguments",
    "model": "policy model (alias of --actor.model_name_or_path)",
    "reward": "a reward function MODULE:FUNC or FILE.py:FUNC, optionally =WEIGHT (repeatable): reward(prompt, "
              "completion, **row) -> float over --data.prompt_dataset, summed with the weights; no Environment needed",
    "agent": "an agent function FILE.py:FUNC or MODULE:FUNC, FUNC(client, row) -> reward: it calls the policy through "
             "an OpenAI client (the rollout worker's endpoint) and runs its own tools; rows from --data.prompt_dataset "
             "(same as --env agent --env.kwargs '{\"agent\": SPEC}')",
    "tokenizer": "char, or a local tokenizer directory (default: the model's)",
    "output": "run directory: config.yaml, metrics.jsonl, checkpoints",
    "resume": "continue from the last checkpoint (or the checkpoint directory given), with the run's config.yaml",
    "seed": "run seed (default 0)",
    "device": "learner and engine device: auto, cpu, cuda, cuda:N (default auto)",
    "torch_threads": "torch intra-op threads (default: torch's)",
    "no_progress": "no progress bar",
    "overwrite": "start over in an --output that holds an earlier run: delete its records and checkpoints first",
    "allow_config_change": "with --resume: continue although what the run is (model, environment, preset, loss) "
                           "differs from its config.yaml",
    "config": "a YAML or JSON file of settings (keys: flag names, nested by section or dotted; a preset: key "
              "allowed); flags override it, it overrides the preset",
}


@dataclass
class TrainerConfig(Freezable):
    """A run's configuration.

    Sections (``actor``, ``algo``, ``ckpt``, ``data``, ``eval``, ``fsdp``, ``logger``, ``ray``,
    ``ref``, ``rollout``, ``train``, ``vllm``, ``lora``): every flag, as typed fields. Run options: ``preset``,
    ``env_kwargs``, ``rewards`` (reward-function specs), ``tokenizer``, ``output``, ``resume``, ``seed``,
    ``device``, ``torch_threads``, ``progress``, ``overwrite``, ``allow_config_change``. Set by the
    resolution: ``inactive`` (flag -> why it has no effect here), ``warnings``, ``explicit`` (flags
    given on the command line), ``config_file``, ``notes`` (what the resolution decided for the run, printed at
    start: the tool-use limits of an agent run).

    The trainer freezes its copy once validated (:meth:`freeze`): from then on setting a field raises
    :class:`~flashreinforce.config.schema.FrozenConfigError`; :meth:`copy` gives an unfrozen copy
    to derive another configuration from.
    """

    actor: ActorConfig = section(ActorConfig)
    ref: RefConfig = section(RefConfig)
    algo: AlgoConfig = section(AlgoConfig)
    ckpt: CkptConfig = section(CkptConfig)
    data: DataConfig = section(DataConfig)
    eval: EvalConfig = section(EvalConfig)
    fsdp: FsdpConfig = section(FsdpConfig)
    logger: LoggerConfig = section(LoggerConfig)
    rollout: RolloutConfig = section(RolloutConfig)
    ray: RayConfig = section(RayConfig)
    train: TrainConfig = section(TrainConfig)
    vllm: VllmConfig = section(VllmConfig)
    lora: LoraConfig = section(LoraConfig)
    preset: str | None = None
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    rewards: list[str] = field(default_factory=list)
    tokenizer: str | None = None
    output: str | None = None
    resume: str | None = None
    seed: int = 0
    device: str = "auto"
    torch_threads: int | None = None
    progress: bool = True
    overwrite: bool = False
    allow_config_change: bool = False
    config_file: str | None = None
    inactive: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    explicit: list[str] = field(default_factory=list)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_flags(cls, values: Mapping[str, Any], **run_options: Any) -> "TrainerConfig":
        """A config from flag values by dotted name (each checked against its flag) and run options."""
        cfg = cls(**run_options)
        for name, value in values.items():
            cfg.set(name, value)
        return cfg

    @classmethod
    def from_layers(cls, given: Mapping[str, Any], preset: Mapping[str, Any] | None = None,
                    file: Mapping[str, Any] | None = None) -> "TrainerConfig":
        """The defaults, then ``preset``, ``file`` and ``given`` (flat dotted keys: flags, aliases and run
        options), last wins; each value checked against its flag (the whole is checked by
        :func:`flashreinforce.config.checks.validate`)."""
        preset, file = dict(preset or {}), dict(file or {})
        cfg = cls()
        errors: list[str] = []
        run: dict[str, Any] = {}
        layers = (preset, file, given)
        for layer in layers:
            for key, value in layer.items():
                if key in FLAG_BY_NAME:
                    try:
                        cfg.set(key, value)
                    except ConfigError as err:
                        errors.append(str(err))
                elif key in _RUN_FIELD or key in ("no_progress", "agent"):
                    run[key] = value
                elif key in RETIRED_FLAGS:
                    cfg.inactive[key] = f"--{key} is ignored (this trainer has no such setting): {RETIRED_FLAGS[key]}"
                elif key not in _ALIASES:
                    errors.append(unknown_flag_message(key))
            # --model / --env: the alias of a layer overrides earlier layers; within a layer the alias and
            # its flag must agree.
            for alias, name in _ALIASES.items():
                value, flag_value = layer.get(alias), layer.get(name)
                if value is not None and flag_value is not None and value != flag_value:
                    errors.append(f"--{alias} {shown(value)} and --{name} {shown(flag_value)} disagree; give one of them")
                elif value is not None:
                    try:
                        cfg.set(name, value)
                    except ConfigError as err:
                        errors.append(str(err))
        if errors:
            raise_errors(errors)

        env_kwargs = run.get("env.kwargs") or {}
        if not isinstance(env_kwargs, dict):
            raise ConfigError(f"--env.kwargs must be a JSON object (e.g. '{{\"turns\": 3}}'), got {shown(env_kwargs)}")
        rewards = run.get("reward") or []
        if isinstance(rewards, (str, tuple)) or callable(rewards):
            rewards = [rewards]
        if rewards:  # reward functions are an environment of their own, replacing a preset's
            named = [layer.get("env") or layer.get("train.agent_path") for layer in (file, given)]
            named = [n for n in named if n is not None]
            if named and named[-1] != REWARD_ENVIRONMENT:
                raise ConfigError(f"--reward and --env {named[-1]} both say what the task is: --reward scores "
                                  f"completions with the {REWARD_ENVIRONMENT} environment; give one of them")
            cfg.train.agent_path = REWARD_ENVIRONMENT
        agent = run.get("agent")
        named = [layer.get("env") or layer.get("train.agent_path") for layer in (file, given)]
        named = [n for n in named if n is not None]
        if agent is not None and not any("agent" in layer for layer in (file, given)) and (rewards or named):
            agent = None  # a preset's agent is the preset's environment: an --env or --reward replaces it
        if agent is not None:  # an agent function is an environment of its own too
            if rewards or (named and named[-1] != AGENT_ENVIRONMENT):
                raise ConfigError(f"--agent and --{'reward' if rewards else 'env ' + str(named[-1])} both say what the "
                                  "task is: the agent function's return value is the reward; give one of them")
            cfg.train.agent_path = AGENT_ENVIRONMENT
        # A preset's environment arguments belong to the preset's environment: an --env that replaces it
        # (a user's class, perhaps with a plain constructor) does not get them.
        preset_env = preset.get("train.agent_path") or preset.get("env")
        dropped = None
        given_kwargs = any("env.kwargs" in layer for layer in (file, given))
        if "env.kwargs" in preset and not given_kwargs and cfg.train.agent_path != preset_env:
            dropped, env_kwargs = env_kwargs, {}
        if agent is not None:
            env_kwargs = {**env_kwargs, "agent": agent}
        spec = cfg.train.agent_path or ""
        notes = []
        if (agent is not None and any("agent" in layer for layer in (file, given))) or \
                any(str(n).startswith(VERIFIERS_PREFIX) for n in named):
            # a preset made for agent functions sets its own limits, as a user would
            own = (file, given, preset) if run.get("preset") in AGENT_PRESETS else (file, given)
            notes = _agent_limits(cfg, own, "--agent" if agent is not None else f"--env {spec}")
        overwrite = bool(run.get("overwrite", False))
        if overwrite and run.get("resume"):
            raise ConfigError("--overwrite and --resume contradict each other: --resume continues the run in --output, "
                              "--overwrite deletes it first; give one of them")
        cfg.preset = run.get("preset")
        cfg.env_kwargs = dict(env_kwargs)
        cfg.rewards = list(rewards)
        cfg.tokenizer = run.get("tokenizer")
        cfg.output = run.get("output")
        cfg.resume = run.get("resume")
        cfg.seed = run.get("seed", 0)
        cfg.device = str(run.get("device", "auto"))
        cfg.torch_threads = run.get("torch_threads")
        cfg.progress = not bool(run.get("no_progress", False))
        cfg.overwrite = overwrite
        cfg.allow_config_change = bool(run.get("allow_config_change", False))
        cfg.config_file = run.get("config")
        cfg.explicit = sorted(k for k in given if k in FLAG_BY_NAME)
        cfg.notes = notes
        if dropped:
            cfg.inactive["env.kwargs"] = (f"preset {cfg.preset!r} sets env.kwargs {shown(dropped)} for its environment "
                                          f"{preset_env}, which --env {cfg.train.agent_path} replaces: dropped (give "
                                          "--env.kwargs to pass arguments)")
        # A preset's staleness bound below a fixed lag given later would drop every trajectory: the
        # fixed lag bounds the staleness itself, so the preset's bound goes (a bound given along with
        # the lag is checked as given).
        lag, bound = cfg.train.fixed_policy_lag, cfg.train.max_policy_lag
        if (lag is not None and bound is not None and bound < lag and "train.max_policy_lag" in preset
                and not any("train.max_policy_lag" in layer for layer in (file, given))):
            cfg.train.max_policy_lag = None
            cfg.inactive["train.max_policy_lag"] = (f"preset {cfg.preset!r} sets train.max_policy_lag {bound}, below "
                                                    f"train.fixed_policy_lag {lag}: dropped (the fixed lag bounds "
                                                    "the staleness)")
        return cfg

    @classmethod
    def from_preset(cls, name: str, **run_options: Any) -> "TrainerConfig":
        """The defaults with the preset ``name`` applied (``ConfigError`` listing the presets for an
        unknown one); ``run_options`` (``output``, ``seed``, ...) as keyword arguments."""
        from flashreinforce.config.presets import PRESETS

        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
        cfg = cls.from_layers({}, dict(PRESETS[name], preset=name))
        for key, value in run_options.items():
            if key not in RUN_FIELDS:
                raise ConfigError(f"TrainerConfig.from_preset: unknown run option {key!r}; run options: "
                                  f"{', '.join(sorted(RUN_FIELDS))} (set flags on the sections, e.g. "
                                  "config.train.max_steps = 20)")
            setattr(cfg, key, value)
        validate(cfg)
        return cfg

    # ------------------------------------------------------------------ derived settings
    def value(self, name: str) -> Any:
        """The value flag ``name`` has in this run: as set (``config[name]``), but ``train.batch_size``, when
        not given (``None``), derived: ``rollout.batch_size * rollout.n_samples_per_prompt`` trajectories per
        update. What the records and the resume table compare; a config file keeps the setting as given
        (:meth:`to_file`)."""
        if name == "train.batch_size" and self.train.batch_size is None:
            return self.rollout.batch_size * self.rollout.n_samples_per_prompt
        return self[name]

    # ------------------------------------------------------------------ flat access
    @property
    def flags(self) -> dict[str, Any]:
        """Every flag's value by dotted name (a fresh dict: set values with :meth:`set`)."""
        return {f.name: get_path(self, f.attribute) for f in FLAGS}

    def __getitem__(self, name: str) -> Any:
        if name not in FLAG_BY_NAME:
            raise KeyError(name)
        return get_path(self, FLAG_BY_NAME[name].attribute)

    def set(self, name: str, value: Any) -> None:
        """Set flag ``name`` (dotted) to ``value``, checked and normalized (``ConfigError`` naming it)."""
        flag = FLAG_BY_NAME.get(name)
        if flag is None:
            raise ConfigError(unknown_flag_message(name))
        set_path(self, flag.attribute, check_value(flag, value))

    def loss_options(self) -> LossOptions:
        """The loss options of the flags (``ConfigError`` naming the flag of a bad value); built once per run
        (the trainer's components) and handed down to the learner and its loss mode."""
        try:
            return options_from_flags({flag: self[flag] for flag in OPTION_FLAGS.values()})
        except ValueError as err:
            raise ConfigError(str(err)) from None

    def copy(self) -> "TrainerConfig":
        """A deep copy, unfrozen (a frozen configuration's copy can be changed and validated again)."""
        out = copy.deepcopy(self)
        thaw(out)
        return out

    def freeze(self) -> "TrainerConfig":
        """Make this configuration read-only (fields, sections, and the lists and dicts they hold), in
        place; returns it. The trainer does this once it has validated and completed its own copy."""
        freeze(self)
        return self

    # ------------------------------------------------------------------ records
    def to_json(self) -> dict[str, Any]:
        """The record written to ``OUTPUT/config.json`` (a dataset or reward function given as a Python
        object as its description, as in :meth:`to_file`; ``train.batch_size`` as the run uses it, derived
        when not given: :meth:`value`)."""
        flags = {f.name: file_value(self.value(f.name), f.objects) for f in FLAGS}
        return thawed({"flags": flags, "inactive": self.inactive, "warnings": self.warnings, "preset": self.preset,
                "env_kwargs": self.env_kwargs, "rewards": [reward_spec(r) for r in self.rewards],
                "tokenizer": self.tokenizer,
                "output": self.output, "resume": self.resume, "seed": self.seed, "device": self.device,
                "torch_threads": self.torch_threads, "explicit_flags": self.explicit, "notes": self.notes,
                "config_file": self.config_file})

    def to_file(self) -> dict[str, Any]:
        """The resolved settings in the config-file format (``--config``): nested by section, run options
        as top-level keys; reading it back gives the same configuration."""
        out: dict[str, Any] = {"preset": self.preset}
        for f in dataclasses.fields(self):
            if "section" in f.metadata:
                out[f.name] = _section_dict(getattr(self, f.name), f.name)
        out.update({"env.kwargs": dict(self.env_kwargs), "reward": [reward_spec(r) for r in self.rewards],
                    "tokenizer": self.tokenizer,
                    "seed": self.seed, "device": self.device, "torch_threads": self.torch_threads})
        return thawed(out)


def reward_spec(reward: Any) -> str:
    """A reward as its ``--reward`` spec: a string as given, a function (or ``(function, weight)``) as
    ``MODULE:FUNC[=WEIGHT]`` where it can be imported again."""
    if isinstance(reward, str):
        return reward
    func, weight = reward if isinstance(reward, tuple) else (getattr(reward, "func", reward),
                                                            getattr(reward, "weight", 1.0))
    spec = f"{getattr(func, '__module__', '?')}:{getattr(func, '__qualname__', repr(func))}"
    return spec if weight == 1.0 else f"{spec}={weight:g}"


def file_value(value: Any, objects: bool = False) -> Any:
    """A flag value as a config file holds it: pairs as lists; for a flag that takes Python objects
    (``objects``: a dataset given as rows or a ``datasets.Dataset``), the object's description."""
    if isinstance(value, tuple):
        return list(value)
    if objects and value is not None and not isinstance(value, str):
        kind = "list" if isinstance(value, list) else "dict" if isinstance(value, dict) else type(value).__name__
        return f"<{kind} given in Python>"
    return value


def _section_dict(obj: Any, path: str) -> dict[str, Any]:
    """A section as config-file keys: its flags' names (a published spelling for the fields of
    ``FLAG_SPELLINGS``), nested sections nested."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        objects = "flag" in f.metadata and f.metadata["flag"]["objects"]
        name = f"{path}.{f.name}"
        key = FIELD_FLAGS.get(name, name).rsplit(".", 1)[-1]
        out[key] = _section_dict(value, name) if "section" in f.metadata else file_value(value, objects)
    return out


# Run options as they come from a layer (command-line dest / config-file key) -> TrainerConfig field.
_RUN_FIELD = {"preset": "preset", "env.kwargs": "env_kwargs", "reward": "rewards", "tokenizer": "tokenizer",
              "output": "output", "resume": "resume", "seed": "seed", "device": "device",
              "torch_threads": "torch_threads", "overwrite": "overwrite", "allow_config_change": "allow_config_change",
              "config": "config_file"}
_ALIASES = {"model": "actor.model_name_or_path", "env": "train.agent_path"}

#: ``--env`` values naming a verifiers taskset (played through the agent endpoint, like ``--agent``).
VERIFIERS_PREFIX = "verifiers:"
#: The limits an agent run gets unless its user sets them (a preset's single-turn limits do not fit tool use):
#: flag -> (value, whether a larger value the preset sets is kept).
AGENT_LIMITS = {"rollout.max_turns": (8, False), "data.max_len": (2048, True), "rollout.max_new_tokens": (256, True)}
#: Presets made for the user's own agent function (``--preset agent --agent FILE.py:FUNC``): their limits
#: are kept, as the config file's and the command line's are.
AGENT_PRESETS = frozenset({"agent"})


def _agent_limits(cfg: "TrainerConfig", user_layers: tuple, what: str) -> list[str]:
    """Set the tool-use limits of :data:`AGENT_LIMITS` on ``cfg`` where no user layer (the config file,
    the command line) sets them; one note saying what they are."""
    shown_limits = []
    for flag, (value, keep_larger) in AGENT_LIMITS.items():
        if any(flag in layer for layer in user_layers):
            continue
        current = cfg[flag]
        if not (keep_larger and current is not None and current >= value):
            cfg.set(flag, value)
        shown_limits.append(f"{flag} {cfg[flag]}")
    if not shown_limits:
        return []
    return [f"{what}: an agent run's limits: {', '.join(shown_limits)} (a model call past them is refused and the "
            "episode truncated; set the flags to change them)"]


#: The environment that --reward functions become.
REWARD_ENVIRONMENT = "reward_functions"
#: The environment that an --agent function becomes.
AGENT_ENVIRONMENT = "agent"

#: Every flag, in section order, from the sections' fields.
FLAGS = flag_table(TrainerConfig)
FLAG_BY_NAME = {f.name: f for f in FLAGS}
#: The run options' field names (what ``from_preset`` and the Python API take as keywords).
RUN_FIELDS = ("preset", "env_kwargs", "rewards", "tokenizer", "output", "resume", "seed", "device", "torch_threads",
              "progress", "overwrite", "allow_config_change")


def unknown_flag_message(name: str) -> str:
    """``unknown flag --NAME``, with the closest known names."""
    import difflib

    known = list(FLAG_BY_NAME) + [k for k in RUN_OPTIONS]
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    if not close:  # a misspelt last part: match on it alone within the section
        tail = name.rsplit(".", 1)[-1]
        close = [n for n in difflib.get_close_matches(tail, [k.rsplit(".", 1)[-1] for k in known], n=3, cutoff=0.7)]
        close = [k for k in known if k.rsplit(".", 1)[-1] in close][:3]
    hint = f"; did you mean {' or '.join('--' + c for c in close)}?" if close else ""
    return f"unknown flag --{name}{hint}"


def resolve(given: Mapping[str, Any], preset: Mapping[str, Any] | None = None,
            file: Mapping[str, Any] | None = None) -> TrainerConfig:
    """Merge, last wins, the defaults (the sections' fields), ``preset`` (``--preset``, or a ``preset:`` key
    of the config file), ``file`` (``--config``) and ``given`` (the command line's flags and options), all
    flat dotted keys (:meth:`TrainerConfig.from_layers`), then check the whole
    (:func:`flashreinforce.config.checks.validate`).

    Raises:
        ConfigError: a value this runtime cannot honour or a broken rule, naming the flag(s).
    """
    cfg = TrainerConfig.from_layers(given, preset, file)
    validate(cfg)
    return cfg
