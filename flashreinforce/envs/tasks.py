"""Prompt datasets and task-driven environments: one episode plays one dataset row.

Data format (the one of the published settings): a JSONL file (one JSON object per line), a
JSON file holding a list of objects, a Parquet file (needs ``pyarrow``), or a folder written by
Hugging Face ``datasets``' ``save_to_disk`` (needs ``datasets``); from Python also a list of dicts or
a ``datasets.Dataset``. Each row has

- ``data.input_key`` (default ``prompt``): a string, or a list of chat messages
  ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``;
- ``data.label_key`` (default ``reward_model``): a dict holding ``ground_truth`` (a string, a
  number, or a list of acceptable answers), or the ground truth itself (string or number);
- optionally ``datasource`` (kept on the :class:`Task`, e.g. to split evaluation metrics).

:func:`flashreinforce.envs.registry.make_environment` builds an environment over such a file.
A dataset that cannot be read (no such file, a missing key, a bad row, a format whose package is
not installed) is a :class:`DatasetError`: one line naming the flag, the file and the problem,
which ``flashreinforce train`` / ``eval`` print as their usual configuration error (exit status 2).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from flashreinforce.config import ConfigError
from flashreinforce.config.schema import MAX_DEPTH, shown, value_problem
from flashreinforce.envs.base import Environment, StepResult

__all__ = [
    "DatasetError", "DatasetNotFound", "Task", "TaskEnvironment", "DatasetEnvironment", "describe_source", "load_tasks",
    "render_prompt", "chat_template_from_tokenizer",
]

Messages = Sequence[Mapping[str, str]]
ChatTemplate = Callable[[list], str]


@dataclass(frozen=True)
class Task:
    """One row of a prompt dataset.

    prompt: the problem, as text or as chat messages (``[{"role", "content"}, ...]``).
    ground_truth: the reference answer (a string or a list of acceptable strings), or None for
        environments that need none.
    datasource: the row's ``datasource`` field, if any.
    index: the row's position in the (truncated) dataset.
    extra: the row's other fields, for custom environments.
    """

    prompt: str | tuple
    ground_truth: str | tuple | None = None
    datasource: str | None = None
    index: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict, repr=False)


def _check_messages(messages: Any, where: str) -> tuple:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"{where}: the prompt must be a string or a non-empty list of chat messages, "
                         f"got {type(messages).__name__}")
    checked = []
    for k, message in enumerate(messages):
        if not (isinstance(message, Mapping) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise ValueError(f"{where}: chat message {k} must be a dict with string 'role' and 'content', "
                             f"got {shown(message)}")
        checked.append({"role": message["role"], "content": message["content"]})
    return tuple(checked)


def render_prompt(prompt: str | Messages, apply_chat_template: ChatTemplate | None = None) -> str:
    """Turn a prompt (text or chat messages) into the text the policy continues.

    With ``apply_chat_template`` (a callable from a list of message dicts to text, e.g. from
    :func:`chat_template_from_tokenizer`), messages are rendered by it, and a text prompt is
    rendered as one user message. Without it a text prompt is returned unchanged and messages
    are joined plainly: ``"System: ...\\n\\nUser: ...\\n\\nAssistant:"``.
    """
    if isinstance(prompt, str):
        if apply_chat_template is None:
            return prompt
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = [dict(m) for m in _check_messages(prompt, "render_prompt")]
    if apply_chat_template is not None:
        text = apply_chat_template(messages)
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template must return str, got {type(text).__name__}")
        return text
    parts = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    if messages[-1]["role"] != "assistant":
        parts.append("Assistant:")
    return "\n\n".join(parts)


def chat_template_from_tokenizer(tokenizer: Any) -> ChatTemplate:
    """A chat-template callable from a Hugging Face tokenizer (adds the generation prompt)."""
    if not hasattr(tokenizer, "apply_chat_template"):
        raise TypeError(f"tokenizer {type(tokenizer).__name__} has no apply_chat_template")

    def apply(messages: list) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    return apply


class DatasetError(ConfigError):
    """A prompt dataset that cannot be used; the message names the flag, the file and the problem.

    A :class:`~flashreinforce.config.ConfigError` (so a ``ValueError``): the command line prints it as
    one line with exit status 2.
    """


class DatasetNotFound(DatasetError, FileNotFoundError):
    """The dataset path names nothing."""


#: Files a ``datasets`` ``save_to_disk`` folder holds: one Dataset, or a DatasetDict of splits.
_HF_DATASET_FILES = ("state.json", "dataset_info.json")
_HF_DATASET_DICT_FILE = "dataset_dict.json"


def _is_hf_dataset(source: Any) -> bool:
    """A ``datasets.Dataset`` object (recognized without importing ``datasets``)."""
    return type(source).__module__.split(".")[0] == "datasets" and hasattr(source, "column_names")


def describe_source(source: Any, flag: str = "data.prompt_dataset") -> str:
    """How error messages name a dataset: ``--FLAG PATH`` for a path, else what the object is."""
    if isinstance(source, (str, os.PathLike)):
        return f"--{flag} {os.fspath(source)}"
    if _is_hf_dataset(source):
        return f"{flag} (a datasets.Dataset of {len(source)} rows)"
    if isinstance(source, (list, tuple)):
        return f"{flag} (a list of {len(source)} rows)"
    return f"{flag} ({type(source).__name__})"


def _read_hf_folder(path: str, where: str) -> list:
    if os.path.isfile(os.path.join(path, _HF_DATASET_DICT_FILE)):
        splits = sorted(e.name for e in os.scandir(path) if e.is_dir())
        raise DatasetError(f"{where}: a datasets folder with several splits ({', '.join(splits)}); give one "
                           f"split's folder, e.g. {os.path.join(path, splits[0] if splits else 'train')}")
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"{where}: a Hugging Face datasets folder (save_to_disk); reading it needs the datasets "
                           "package: pip install datasets") from None
    try:
        dataset = datasets.load_from_disk(path)
    except Exception as err:
        raise DatasetError(f"{where}: datasets.load_from_disk failed: {type(err).__name__}: {err}") from None
    if not _is_hf_dataset(dataset):
        raise DatasetError(f"{where}: datasets.load_from_disk gave a {type(dataset).__name__}, not a Dataset")
    return _hf_rows(dataset)


def _hf_rows(dataset: Any) -> list:
    return dataset.to_list() if hasattr(dataset, "to_list") else [dict(row) for row in dataset]


def _read_file(path: str, where: str) -> list:
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DatasetError(f"{where}: reading Parquet needs pyarrow (pip install pyarrow), "
                               "or convert it to JSONL") from None
        try:
            return pq.read_table(path).to_pylist()
        except Exception as err:  # pyarrow's own errors: not Parquet, truncated, ...
            raise DatasetError(f"{where}: cannot be read as Parquet ({type(err).__name__}: {err})") from None
    try:
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as err:
        raise DatasetError(f"{where}: not UTF-8 text ({err.reason} at byte {err.start}); a JSONL, JSON or "
                           ".parquet file is expected") from None
    except OSError as err:
        raise DatasetError(f"{where}: cannot be read ({err.strerror or err})") from None
    if path.endswith(".json") or text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: not valid JSON ({exc})") from None
        except RecursionError:
            raise DatasetError(f"{where}: nested too deeply to read (rows may nest {MAX_DEPTH} levels)") from None
        if not isinstance(rows, list):
            raise DatasetError(f"{where}: a .json dataset must hold a list of objects, got {type(rows).__name__}")
        return rows
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}:{lineno}: not valid JSON ({exc})") from None
        except RecursionError:
            raise DatasetError(f"{where}:{lineno}: nested too deeply to read (rows may nest {MAX_DEPTH} "
                               "levels)") from None
    return rows


def _read_rows(source: Any, where: str) -> list:
    """The rows of a path (file or ``save_to_disk`` folder), a list of rows or a ``datasets.Dataset``."""
    if _is_hf_dataset(source):
        return _hf_rows(source)
    if isinstance(source, (list, tuple)):
        return list(source)
    if not isinstance(source, (str, os.PathLike)):
        raise DatasetError(f"{where}: expected a path, a list of dicts or a datasets.Dataset, "
                           f"got {type(source).__name__}")
    path = os.fspath(source)
    if os.path.isdir(path):
        if any(os.path.isfile(os.path.join(path, n)) for n in _HF_DATASET_FILES + (_HF_DATASET_DICT_FILE,)):
            return _read_hf_folder(path, where)
        raise DatasetError(f"{where}: is a folder, but not one written by datasets' save_to_disk (no "
                           f"{_HF_DATASET_FILES[0]}); give a JSONL, JSON or Parquet file")
    if not os.path.isfile(path):
        raise DatasetNotFound(f"{where}: does not exist")
    return _read_file(path, where)


def _ground_truth(label: Any, where: str) -> str | tuple:
    if isinstance(label, Mapping):
        if "ground_truth" not in label:
            raise DatasetError(f"{where}: the label dict has no 'ground_truth' key (keys: {sorted(label)})")
        label = label["ground_truth"]
    if isinstance(label, bool) or label is None:
        raise DatasetError(f"{where}: ground truth must be a string, a number or a list of them, got {shown(label)}")
    if isinstance(label, (int, float, str)):
        return str(label)
    if isinstance(label, (list, tuple)) and label and all(
            isinstance(x, (int, float, str)) and not isinstance(x, bool) for x in label):
        return tuple(str(x) for x in label)
    raise DatasetError(f"{where}: ground truth must be a string, a number or a list of them, got {shown(label)}")


def load_tasks(source: str | os.PathLike | Sequence[Mapping[str, Any]] | Any, *, input_key: str | None = "prompt",
               label_key: str | None = "reward_model", max_samples: int | None = None,
               flag: str = "data.prompt_dataset") -> list[Task]:
    """Read a prompt dataset into :class:`Task` objects.

    source: a path to a JSONL file, a JSON file holding a list of objects, a Parquet file (needs
        ``pyarrow``) or a folder written by ``datasets.Dataset.save_to_disk`` (needs ``datasets``:
        loaded with ``datasets.load_from_disk``, its rows used as a JSONL's); or the rows
        themselves: a list of dicts, or a ``datasets.Dataset``.
    max_samples: keep the first ``max_samples`` rows (None: all).
    input_key: None for datasets whose environment makes its own prompt (``Task.prompt`` is
        then ``""``; e.g. ALFWorld games).
    label_key: None for datasets without labels (``Task.ground_truth`` is then None).
    flag: the option that named the dataset (``data.prompt_dataset``, ``eval.dataset``), for messages.

    Raises :class:`DatasetError` (a ``ValueError``; :class:`DatasetNotFound`, also a
    ``FileNotFoundError``, for a path that names nothing), one line naming ``--flag``, the file (and
    row) and the problem: a missing key, a malformed value, a format whose package is missing.
    """
    where_source = describe_source(source, flag)
    if max_samples is not None and (not isinstance(max_samples, int) or isinstance(max_samples, bool)
                                    or max_samples < 1):
        raise DatasetError(f"data.max_samples must be a positive integer or None, got {max_samples!r}")
    rows = _read_rows(source, where_source)
    if max_samples is not None:
        rows = rows[:max_samples]
    if not rows:
        raise DatasetError(f"{where_source}: the dataset is empty")
    tasks = []
    for index, row in enumerate(rows):
        where = f"{where_source} row {index}"
        if not isinstance(row, Mapping):
            raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
        problem = value_problem(row, max_values=2**62)  # rows are as long as they are; their depth is bounded
        if problem:
            raise DatasetError(f"{where}: {problem}")
        if input_key is None:
            prompt = ""
        elif input_key not in row:
            raise DatasetError(f"{where}: no data.input_key {input_key!r} (keys: {shown(sorted(row))})")
        else:
            prompt = row[input_key]
            if not isinstance(prompt, str):
                try:
                    prompt = _check_messages(prompt, where)
                except ValueError as err:
                    raise DatasetError(str(err)) from None
        ground_truth = None
        if label_key is not None:
            if label_key not in row:
                raise DatasetError(f"{where}: no data.label_key {label_key!r} (keys: {shown(sorted(row))})")
            ground_truth = _ground_truth(row[label_key], where)
        datasource = row.get("datasource")
        extra = {k: v for k, v in row.items() if k not in (input_key, label_key)}
        tasks.append(Task(prompt=prompt, ground_truth=ground_truth,
                          datasource=datasource if isinstance(datasource, str) else None,
                          index=index, extra=extra))
    return tasks


class TaskEnvironment(Environment):
    """Base of environments whose episode is one :class:`Task` (prompt plus ground truth).

    The task of an episode is the one given to :meth:`set_task`, or, when the environment was
    built with ``tasks``, ``tasks[seed % len(tasks)]`` at ``reset(seed=...)``. Subclasses
    implement :meth:`start` (called by ``reset`` with the task) and ``step``.

    apply_chat_template: optional callable rendering chat messages to text (see
        :func:`render_prompt`); without it prompts are rendered plainly.
    """

    def __init__(self, tasks: Sequence[Task] | None = None, *,
                 apply_chat_template: ChatTemplate | None = None) -> None:
        if tasks is not None:
            tasks = list(tasks)
            if not tasks or not all(isinstance(t, Task) for t in tasks):
                raise ValueError("tasks must be a non-empty sequence of Task")
        if apply_chat_template is not None and not callable(apply_chat_template):
            raise TypeError("apply_chat_template must be callable (messages -> str)")
        self.tasks = tasks
        self.apply_chat_template = apply_chat_template
        self.task: Task | None = None
        self._next_task: Task | None = None

    def set_task(self, task: Task) -> None:
        """Use ``task`` for the next ``reset`` (overrides the ``tasks`` list for that episode)."""
        if not isinstance(task, Task):
            raise TypeError(f"task must be a Task, got {type(task).__name__}")
        self._next_task = task

    def reset(self, *, seed: int) -> str:
        if self._next_task is not None:
            task, self._next_task = self._next_task, None
        elif self.tasks is not None:
            task = self.tasks[seed % len(self.tasks)]
        else:
            raise RuntimeError(f"{type(self).__name__} has no task: build it with tasks=[...], call "
                               "set_task(), or wrap it in a DatasetEnvironment")
        self.task = task
        return self.start(task)

    def _begin_step(self, action: str) -> None:
        """Checks shared by every ``step``: an episode is running and ``action`` is text."""
        if self.task is None:
            raise RuntimeError("step() before reset()")
        if not isinstance(action, str):
            raise TypeError(f"action must be str, got {type(action).__name__}")

    def start(self, task: Task) -> str:
        """Begin an episode on ``task``; returns the prompt text. Default: the rendered prompt."""
        return render_prompt(task.prompt, self.apply_chat_template)


class DatasetEnvironment(Environment):
    """Serves the rows of a dataset to an environment that accepts tasks.

    ``reset(seed=i)`` hands ``tasks[i % len(tasks)]`` to ``env.set_task`` and returns
    ``env.reset(seed=i)``; ``step`` and ``close`` are forwarded. ``current_task`` is the row of
    the running episode.
    """

    def __init__(self, env: Environment, tasks: Sequence[Task]) -> None:
        if not callable(getattr(env, "set_task", None)):
            raise TypeError(f"{type(env).__name__} has no set_task(task) method, so it cannot take dataset rows")
        tasks = list(tasks)
        if not tasks:
            raise ValueError("tasks must not be empty")
        self.env = env
        self.tasks = tasks
        self.current_task: Task | None = None

    def reset(self, *, seed: int) -> str:
        self.current_task = self.tasks[seed % len(self.tasks)]
        self.env.set_task(self.current_task)
        return self.env.reset(seed=seed)

    def step(self, action: str) -> StepResult:
        return self.env.step(action)

    def turn_end(self, text: str) -> int | None:
        return self.env.turn_end(text)

    @property
    def parallel_calls(self) -> bool:  # the wrapped environment's (ALFWorld over a dataset of games: False)
        return getattr(self.env, "parallel_calls", True)

    def close(self) -> None:
        self.env.close()
