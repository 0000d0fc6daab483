"""Environment resolution: from a name, ``MODULE:CLASS`` or ``FILE.py[:CLASS]`` to environments.

One place decides what ``--env`` (``train.agent_path``) means:

* a registered name (:data:`ENV_REGISTRY`; the shipped ones, :data:`SHIPPED_ENVIRONMENTS`: ``math``,
  ``python_tool``, ``alfworld``, ``textworld``, ``reward_functions``, ``agent``);
* ``MODULE:CLASS`` naming an :class:`~flashreinforce.envs.Environment` subclass;
* ``FILE.py`` (its one ``Environment`` subclass) or ``FILE.py:CLASS``;
* ``PREFIX:NAME`` for another library's environments (:data:`LIBRARY_ENVIRONMENTS`):
  ``reasoning_gym:TASK``, ``verifiers:MODULE`` / ``verifiers:FILE.py``, ``openenv:MODULE:CLASS`` /
  ``openenv:FILE.py:CLASS`` / ``openenv:URL``.

An environment class registers itself by name with the :func:`register_environment` decorator, in its
own module; a shipped one's module is imported when its name is first used, so that naming it (``--help``,
the configuration) imports no optional package. A user's ``MODULE:CLASS`` or ``FILE.py:CLASS`` is the
command line's input, never a registry entry.

A module or file whose import fails is an :class:`EnvironmentSpecError` of one line
(:func:`import_failure`): a syntax error names the file, the line and the message; any other
exception names the module, the exception's type and message and where it was raised. A
``MODULE`` that is not installed at all stays a ``ModuleNotFoundError``.

:func:`make_environment` builds one environment from a spec and what it reads of the run's
configuration (:class:`EnvConfig`, a small frozen view; the trainer's flags as a mapping are read into
one, the only place here that reads flags by name);
:class:`EnvSpec` is the picklable recipe the trainer hands to rollout workers (threads or Ray
actors), and :func:`num_prompts` tells whether an environment has a finite prompt set::

    env = make_environment("math", {"data.prompt_dataset": "train.jsonl", "data.max_samples": 7500})
    prompt = env.reset(seed=17)          # row 17 % len(dataset)
    result = env.step("... so the answer is \\boxed{42}.")
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from flashreinforce.envs.base import Environment
from flashreinforce.envs.tasks import (ChatTemplate, DatasetEnvironment, Task, TaskEnvironment,
                                       chat_template_from_tokenizer, load_tasks)

__all__ = ["BUILTIN_ENVIRONMENTS", "ENV_REGISTRY", "EnvConfig", "EnvSpec", "EnvironmentSpecError",
           "LIBRARY_ENVIRONMENTS", "SHIPPED_ENVIRONMENTS", "accepts_chat_template", "dataset_tasks",
           "environment_class", "environment_names", "library_environment", "register_environment",
           "ImportFileError", "import_failure", "import_file", "import_module", "make_environment", "num_prompts"]


class EnvironmentSpecError(ValueError):
    """An environment spec that names nothing usable (the message says what and why)."""


#: The registered environments by ``--env`` name (and the other libraries' by their ``PREFIX:``), filled by
#: :func:`register_environment`.
ENV_REGISTRY: dict[str, type[Environment]] = {}
#: The shipped task environments: name -> the module whose import registers the class of that name.
SHIPPED_ENVIRONMENTS: dict[str, str] = {
    "math": "flashreinforce.envs.math_env",
    "python_tool": "flashreinforce.envs.python_tool",
    "alfworld": "flashreinforce.envs.alfworld",
    "textworld": "flashreinforce.envs.textworld_env",
    # Plain reward functions over a prompt dataset (--reward MODULE:FUNC chooses it).
    "reward_functions": "flashreinforce.envs.rewards",
    # An agent function written against the OpenAI chat API (--agent FILE.py:FUNC chooses it).
    "agent": "flashreinforce.agents.environment",
}
#: The former name of :data:`SHIPPED_ENVIRONMENTS` (its keys are the shipped names).
BUILTIN_ENVIRONMENTS = SHIPPED_ENVIRONMENTS


def register_environment(name: str) -> Callable[[type], type]:
    """Class decorator: make an :class:`Environment` subclass ``--env NAME`` (replacing an earlier one of that
    name; a name ending in ``:`` is another library's prefix, :data:`LIBRARY_ENVIRONMENTS`). Returns the class."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_environment: a name is needed, got {name!r}")

    def register(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise TypeError(f"register_environment({name!r}): {cls!r} is not a flashreinforce.envs.Environment "
                            "subclass")
        ENV_REGISTRY[name] = cls
        return cls

    return register


def _registered(name: str, module: str | None) -> type:
    """The class registered as ``name``, importing ``module`` (whose import registers it) on first use."""
    if name not in ENV_REGISTRY and module is not None:
        _import_environment_module(module)
    cls = ENV_REGISTRY.get(name)
    if cls is None:
        raise EnvironmentSpecError(f"environment {name!r} is not registered (importing {module} did not register it)")
    return cls


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def import_module(name: str):
    """``importlib.import_module``, also finding a module in the current folder (as ``python -m`` or a
    ``python`` prompt would, though a console script's ``sys.path`` does not hold it)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        cwd = os.getcwd()
        top = name.split(".")[0]
        if err.name != top or cwd in sys.path or not (os.path.isfile(os.path.join(cwd, top + ".py"))
                                                      or os.path.isdir(os.path.join(cwd, top))):
            raise
    sys.path.insert(0, cwd)
    return importlib.import_module(name)


def _import_environment_module(module_name: str):
    """The module ``module_name``; a failing import is one line (:func:`import_failure`), but a module that
    is not installed at all stays a ``ModuleNotFoundError`` (the caller says so)."""
    try:
        return import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is not None and (module_name == err.name or module_name.startswith(err.name + ".")):
            raise  # the module itself is not installed (the caller says so)
        raise EnvironmentSpecError(import_failure(module_name, err)) from None
    except SyntaxError as err:
        raise EnvironmentSpecError(import_failure(module_name, err)) from None
    except (Exception, SystemExit) as err:
        raise EnvironmentSpecError(import_failure(module_name, err)) from None


def _import_class(spec: str) -> type:
    """The :class:`Environment` subclass of a user's ``module:Class``."""
    module_name, _, class_name = spec.partition(":")
    if not module_name or not class_name:
        raise EnvironmentSpecError(f"environment spec {spec!r} must be one of {sorted(environment_names())} "
                         "or 'module:Class'")
    module = _import_environment_module(module_name)
    try:
        cls = getattr(module, class_name)
    except AttributeError as exc:
        raise EnvironmentSpecError(f"environment spec {spec!r}: module {module_name} has no {class_name}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise TypeError(f"environment spec {spec!r} is not a flashreinforce.envs.Environment subclass")
    return cls


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def import_failure(what: str, err: BaseException) -> str:
    """One line for an exception raised while importing the environment's module or file ``what``.

    A syntax error: ``FILE:LINE: SyntaxError: MESSAGE (the line's text)``. Any other exception:
    ``importing WHAT raised TYPE: MESSAGE (at FILE:LINE in FUNCTION)``, where that place is the
    innermost frame of the traceback (the raise), followed by the frame in the module's own file that
    led there when that is another one.
    """
    if isinstance(err, SyntaxError):
        where = f"{err.filename or what}:{err.lineno}" if err.lineno else f"{err.filename or what}"
        text = f" ({err.text.strip()})" if err.text and err.text.strip() else ""
        return f"importing {what}: {where}: {type(err).__name__}: {err.msg}{text}"
    frames = traceback.extract_tb(err.__traceback__)
    frames = [f for f in frames if not f.filename.startswith("<frozen importlib")]
    place = ""
    if frames:
        last = frames[-1]
        place = f" (at {last.filename}:{last.lineno} in {last.name}"
        own = [f for f in frames if f.name == "<module>" and f is not last]
        if own and own[-1].filename != last.filename:
            place += f", from {own[-1].filename}:{own[-1].lineno}"
        place += ")"
    message = _one_line(err)
    return f"importing {what} raised {type(err).__name__}{': ' + message if message else ''}{place}"


_task_cache: dict[tuple, list[Task]] = {}
_object_task_cache: dict[tuple, tuple[Any, list[Task]]] = {}


def _cached_tasks(source: Any, input_key: str, label_key: str | None, max_samples: int | None,
                  flag: str) -> list[Task]:
    """:func:`load_tasks`, once per process for each file version (path, modification time, size)
    or in-memory dataset object (the object itself is kept with its tasks, so its id stays its own)."""
    options = (input_key, label_key, max_samples)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        try:
            stat = os.stat(path)
        except OSError:  # load_tasks names the flag and the problem
            return load_tasks(path, input_key=input_key, label_key=label_key, max_samples=max_samples, flag=flag)
        key = (os.path.abspath(path), stat.st_mtime_ns, stat.st_size) + options
        if key not in _task_cache:
            _task_cache[key] = load_tasks(path, input_key=input_key, label_key=label_key, max_samples=max_samples,
                                          flag=flag)
        return _task_cache[key]
    key = (id(source),) + options
    cached = _object_task_cache.get(key)
    if cached is None or cached[0] is not source:
        cached = (source, load_tasks(source, input_key=input_key, label_key=label_key, max_samples=max_samples,
                                     flag=flag))
        _object_task_cache[key] = cached
    return cached[1]


def _dataset_flag(eval_dataset: Any, dataset: Any) -> str:
    """The flag that named ``dataset`` for messages: ``eval.dataset`` for the evaluation split (the
    environments then read it as their prompt dataset), both when they name the same file."""
    if eval_dataset is None:
        return "data.prompt_dataset"
    if isinstance(eval_dataset, (str, os.PathLike)) and isinstance(dataset, (str, os.PathLike)):
        same = os.fspath(eval_dataset) == os.fspath(dataset)
    else:
        same = eval_dataset is dataset
    return "eval.dataset" if same else "data.prompt_dataset"


@dataclass(frozen=True)
class EnvConfig:
    """What the environments read of a run's configuration: a small typed view, frozen.

    prompt_dataset: the prompt rows (a path, a list of dicts or a ``datasets.Dataset``; ``None``: the
    environment makes its own prompts). input_key / label_key: the row's keys (``label_key`` ``None``:
    the environment's own, ``reward_model`` or ALFWorld's ``game_file``). max_samples: the first rows
    only. dataset_flag: the flag that named the dataset, for messages. max_turns: the turn limit handed
    to the constructor (``None``: the environment's own).
    """

    prompt_dataset: Any = None
    input_key: str = "prompt"
    label_key: str | None = None
    max_samples: int | None = None
    dataset_flag: str = "data.prompt_dataset"
    max_turns: int | None = None

    @classmethod
    def of_run(cls, cfg: Any, *, eval_split: bool = False) -> "EnvConfig":
        """The view of a resolved :class:`~flashreinforce.config.TrainerConfig` (read by attribute); the
        evaluation split reads ``eval.dataset`` when one is given."""
        dataset = cfg.data.prompt_dataset if not eval_split or cfg.eval.dataset is None else cfg.eval.dataset
        return cls(dataset, cfg.data.input_key, cfg.data.label_key, cfg.data.max_samples,
                   _dataset_flag(cfg.eval.dataset, dataset))

    @classmethod
    def of(cls, config: "EnvConfig | Mapping[str, Any] | None") -> "EnvConfig":
        """``config`` as the view: a view as it is; a mapping of the trainer's flags, flat with dotted
        keys (``{"data.max_samples": 10}``) or nested, read once here (other keys are ignored)."""
        if isinstance(config, EnvConfig):
            return config
        flat = _flatten(config or {})
        dataset = flat.get("data.prompt_dataset")
        return cls(dataset, flat.get("data.input_key", "prompt"), flat.get("data.label_key"),
                   flat.get("data.max_samples"), _dataset_flag(flat.get("eval.dataset"), dataset),
                   flat.get("max_turns"))


def make_environment(spec: str, config: EnvConfig | Mapping[str, Any] | None = None, *,
                     apply_chat_template: ChatTemplate | None = None, **env_kwargs: Any) -> Environment:
    """Build one environment from a name or ``module:Class`` and the trainer's configuration.

    spec: ``"math"``, ``"python_tool"``, ``"alfworld"``, or ``"module:Class"`` naming any
        :class:`Environment` subclass.
    config: an :class:`EnvConfig` (what the trainer passes), or the trainer's flags, flat with dotted
        keys (``{"data.max_samples": 10}``) or nested (``{"data": {"max_samples": 10}}``). Read keys
        (others are ignored):
        ``data.prompt_dataset`` (required for the shipped task environments: a path, a list of
        dicts or a ``datasets.Dataset``; see :func:`~flashreinforce.envs.tasks.load_tasks`),
        ``eval.dataset`` (only to name the flag in messages when it is the dataset given),
        ``data.input_key`` (default ``prompt``), ``data.label_key`` (default ``reward_model``),
        ``data.max_samples`` (default all rows), ``max_turns`` (default: the environment's own).
    apply_chat_template: callable rendering chat messages (see :func:`render_prompt`).
    env_kwargs: passed to the environment's constructor (e.g. ``timeout_s=10``).

    With ``data.prompt_dataset`` set, the environment must accept tasks (``set_task``); it is
    wrapped in a :class:`DatasetEnvironment`, so ``reset(seed=i)`` plays row ``i % len``. A
    ``module:Class`` environment gets ``max_turns`` and ``apply_chat_template`` only when set.
    Call once per rollout worker: each call returns a new environment (the dataset is read once
    per process and shared). A dataset that cannot be read raises
    :class:`~flashreinforce.envs.tasks.DatasetError` naming the flag, the file and the problem.
    """
    if not isinstance(spec, str):
        raise TypeError(f"spec must be str, got {type(spec).__name__}")
    view = EnvConfig.of(config)
    builtin = spec in SHIPPED_ENVIRONMENTS
    cls = environment_class(spec)
    kwargs = dict(env_kwargs)
    library = library_environment(spec)
    if library is not None:  # the library makes the prompt set (reasoning-gym's generator, a verifiers taskset)
        prefix, (_, argument) = library
        kwargs[argument] = spec[len(prefix):]
        if view.prompt_dataset is not None:
            raise ValueError(f"environment {spec!r} makes its own prompt set (its settings in env.kwargs); it takes "
                             "no data.prompt_dataset or eval.dataset")
    if view.max_turns is not None:
        kwargs.setdefault("max_turns", view.max_turns)
    if apply_chat_template is not None:
        kwargs.setdefault("apply_chat_template", apply_chat_template)
    dataset = view.prompt_dataset
    # textworld generates its own games; an agent without a dataset gets the seed as its row
    if dataset is None and builtin and issubclass(cls, TaskEnvironment) and getattr(cls, "needs_dataset", True):
        raise ValueError(f"environment {spec!r} needs data.prompt_dataset (a JSONL/JSON/Parquet file, a datasets "
                         "save_to_disk folder, a list of dicts or a datasets.Dataset)")
    if dataset is None:
        return cls(**kwargs)
    tasks = dataset_tasks(spec, view)  # before the environment: a bad dataset builds nothing
    env = cls(**kwargs)
    try:
        return DatasetEnvironment(env, tasks)
    except TypeError:
        env.close()
        raise


def dataset_tasks(spec: str, config: EnvConfig | Mapping[str, Any] | None) -> list | None:
    """The tasks of the prompt dataset ``config`` (see :func:`make_environment`) gives environment
    ``spec`` (``data.prompt_dataset`` with ``data.input_key`` / ``data.label_key`` /
    ``data.max_samples``; read once per process), or None without one. Raises
    :class:`~flashreinforce.envs.tasks.DatasetError` naming the flag."""
    view = EnvConfig.of(config)
    dataset = view.prompt_dataset
    if dataset is None:
        return None
    label_key = view.label_key
    if label_key is None:
        label_key = "game_file" if spec == "alfworld" else "reward_model"
    if not getattr(environment_class(spec), "uses_label", True):  # one more field of the row (reward functions)
        label_key = None
    return _cached_tasks(dataset, view.input_key, label_key, view.max_samples, view.dataset_flag)


class ImportFileError(ImportError):
    """A Python file given on the command line raised while it was imported (the message is one line)."""


def import_file(path: str | Path, prefix: str):
    """Import the Python file ``path`` once per process, as the module ``PREFIX<hash of its location>``.

    Raises ``FileNotFoundError`` when there is no such file and :class:`ImportFileError` (one line,
    :func:`import_failure`) when executing it raises; a failed import leaves nothing in ``sys.modules``.
    """
    file = Path(path).resolve()
    if not file.is_file():
        raise FileNotFoundError(str(path))
    name = prefix + hashlib.sha1(str(file).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as err:
        del sys.modules[name]
        raise ImportFileError(import_failure(str(path), err)) from None
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _load_file(path: str, class_name: str) -> str:
    """Import ``path`` once per process under a name derived from its location; ``module:Class`` of its
    environment (``class_name``, or its only concrete :class:`Environment` subclass)."""
    try:
        module = import_file(path, "flashreinforce_agent_")
    except FileNotFoundError:
        raise EnvironmentSpecError(f"environment file {path} does not exist") from None
    except ImportFileError as err:
        raise EnvironmentSpecError(str(err)) from None
    name = module.__name__
    if not class_name:
        found = [obj.__name__ for obj in vars(module).values()
                 if isinstance(obj, type) and issubclass(obj, Environment) and obj.__module__ == name
                 and not inspect.isabstract(obj)]
        if len(found) != 1:
            raise EnvironmentSpecError(f"{path} defines {len(found)} Environment classes ({found}); "
                                       "name one as FILE.py:CLASS")
        class_name = found[0]
    return f"{name}:{class_name}"


#: ``--env reasoning_gym:TASK``: a task of the reasoning-gym library (the task's name goes to the environment).
REASONING_GYM_PREFIX = "reasoning_gym:"
#: ``--env PREFIX:NAME``: an environment of another library, registered under ``PREFIX:``; prefix -> (the
#: module whose import registers it, the constructor argument that gets NAME). reasoning-gym's tasks,
#: verifiers' tasksets (played through the agent endpoint), OpenEnv's environments (a class the run serves,
#: or a server's URL).
LIBRARY_ENVIRONMENTS = {
    REASONING_GYM_PREFIX: ("flashreinforce.envs.reasoning_gym_env", "task"),
    "verifiers:": ("flashreinforce.envs.standards.verifiers_env", "taskset"),
    "openenv:": ("flashreinforce.envs.standards.openenv_env", "target"),
}


def library_environment(spec: str) -> tuple[str, tuple[str, str]] | None:
    """``(prefix, (module, argument))`` when ``spec`` names another library's environment."""
    for prefix, entry in LIBRARY_ENVIRONMENTS.items():
        if isinstance(spec, str) and spec.startswith(prefix):
            return prefix, entry
    return None


def environment_names() -> tuple[str, ...]:
    """Every ``--env`` name: the shipped ones first, then those registered from Python (nothing is imported)."""
    return tuple(dict.fromkeys(n for n in [*SHIPPED_ENVIRONMENTS, *ENV_REGISTRY] if n not in LIBRARY_ENVIRONMENTS))


def environment_class(spec: str) -> type:
    """The :class:`Environment` subclass ``spec`` names (see the module docstring)."""
    if spec in SHIPPED_ENVIRONMENTS or (spec in ENV_REGISTRY and spec not in LIBRARY_ENVIRONMENTS):
        return _registered(spec, SHIPPED_ENVIRONMENTS.get(spec))
    library = library_environment(spec)
    if library is not None:
        prefix, (module, _) = library
        return _registered(prefix, module)
    if spec.endswith(".py"):
        return _import_class(_load_file(spec, ""))
    if ".py:" in spec:
        file, _, cls = spec.partition(".py:")
        return _import_class(_load_file(file + ".py", cls))
    return _import_class(spec)


def accepts_chat_template(spec: str) -> bool:
    """Whether the environment renders its prompt itself (its constructor takes ``apply_chat_template``)."""
    try:
        cls = environment_class(spec)
        return "apply_chat_template" in inspect.signature(cls).parameters
    except Exception:
        return False


def num_prompts(env: Environment) -> int | None:
    """Size of the environment's finite prompt set (dataset rows), or ``None`` for endless seeds."""
    tasks = getattr(env, "tasks", None)
    if tasks is not None:
        return len(tasks)
    if hasattr(env, "__len__"):
        return len(env)
    return None


@dataclass(frozen=True)
class EnvSpec:
    """How to build a run's environments anywhere (picklable: Ray workers rebuild them from it).

    spec: the ``--env`` value. config: what the environments read of the run's configuration (an
    :class:`EnvConfig`; a mapping of flags is read into one).
    kwargs: constructor arguments (``--env.kwargs``). chat_template: the environment renders its
    prompt itself with the tokenizer's chat template (it takes ``apply_chat_template``).
    """

    spec: str
    config: EnvConfig | Mapping[str, Any]
    kwargs: dict[str, Any]
    chat_template: bool = False

    def factory(self, tokenizer=None) -> Callable[[], Environment]:
        """A zero-argument callable building one environment; ``tokenizer`` (a
        :class:`~flashreinforce.models.tokenizers.HFTokenizer`) supplies the chat template."""
        chat = chat_template_from_tokenizer(tokenizer.tok) if self.chat_template else None
        spec = self.spec
        environment_class(spec)  # fail early, in the caller, on a bad spec
        config, kwargs = EnvConfig.of(self.config), dict(self.kwargs)

        def build() -> Environment:
            if chat is not None:
                return make_environment(spec, config, apply_chat_template=chat, **kwargs)
            return make_environment(spec, config, **kwargs)

        build.env_spec = self  # what the trainer reads to choose the rollout worker (agents)
        return build
