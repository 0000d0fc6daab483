"""Reward functions as plain callables over a prompt dataset: a single-turn task needs no Environment.

A reward function is ``reward(prompt, completion, **row) -> float``: ``prompt`` is the row's prompt
as the dataset holds it (a string, or a list of chat messages), ``completion`` the policy's answer
as text, and ``row`` every other field of the dataset row (its label included). Several functions
are summed with their weights. From the command line::

    flashreinforce train --model M --data.prompt_dataset rows.jsonl \\
        --reward my_rewards.py:correct --reward my_rewards.py:short=0.2 --output runs/r

and from Python (:func:`flashreinforce.train`): ``rewards=[correct, (short, 0.2)]``.

A spec is ``MODULE:FUNC`` or ``FILE.py:FUNC``, optionally followed by ``=WEIGHT``; a module in the
current folder is found. :class:`RewardFunctionEnv` is the environment these become (shipped as
``--env reward_functions``, chosen by ``--reward``): one episode is one dataset row, one policy turn,
and the reward is the weighted sum; each function's own value goes to the episode's ``info`` as
``reward/NAME``. A function returns a real number: a Python ``int`` or ``float``, a NumPy scalar
of any width (``np.float32``, ``np.int64``, ...) or a 0-d array or tensor of one, or a ``bool``
(``True`` counts 1.0, ``False`` 0.0, as in ``return answer == label``). A function that raises, or
returns anything else or a value that is not finite, fails its episode (counted by kind, the run
goes on) with a message naming the function and what it returned. Each call gets its own deep copy
of the row and of the prompt's messages, so a function that changes them changes nothing that a
later call (another function, or a later episode of the same row) sees.
"""

from __future__ import annotations

import copy
import math
import reprlib
from dataclasses import dataclass
from numbers import Real
from typing import Any, Callable, Sequence

from flashreinforce.envs.base import StepResult
from flashreinforce.envs.registry import (ImportFileError, import_failure, import_file, import_module,
                                          register_environment)
from flashreinforce.envs.tasks import ChatTemplate, Task, TaskEnvironment

__all__ = ["RewardFunction", "RewardFunctionEnv", "RewardSpecError", "load_reward", "parse_reward_spec", "reward_value"]


class RewardSpecError(ValueError):
    """A reward spec that names nothing usable (the message says what and why)."""


@dataclass(frozen=True)
class RewardFunction:
    """One reward term: ``weight * func(prompt, completion, **row)``; ``name`` labels it in metrics."""

    func: Callable[..., float]
    weight: float = 1.0
    name: str = ""

    def __post_init__(self) -> None:
        if not callable(self.func):
            raise RewardSpecError(f"a reward function must be callable, got {type(self.func).__name__}")
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) or not math.isfinite(self.weight):
            raise RewardSpecError(f"the weight of reward {self.name or self.func!r} must be a finite number, "
                                  f"got {self.weight!r}")
        if not self.name:
            object.__setattr__(self, "name", getattr(self.func, "__name__", type(self.func).__name__))


def parse_reward_spec(spec: str) -> tuple[str, str, float]:
    """``MODULE:FUNC[=WEIGHT]`` or ``FILE.py:FUNC[=WEIGHT]`` -> ``(where, function name, weight)``."""
    if not isinstance(spec, str) or ":" not in spec:
        raise RewardSpecError(f"--reward {spec!r}: expected MODULE:FUNC or FILE.py:FUNC, optionally =WEIGHT")
    target, _, weight_text = spec.partition("=")
    where, _, func = target.rpartition(":")
    if not where or not func.isidentifier():
        raise RewardSpecError(f"--reward {spec!r}: expected MODULE:FUNC or FILE.py:FUNC, optionally =WEIGHT")
    weight = 1.0
    if weight_text:
        try:
            weight = float(weight_text)
        except ValueError:
            raise RewardSpecError(f"--reward {spec!r}: the weight {weight_text!r} is not a number") from None
        if not math.isfinite(weight):
            raise RewardSpecError(f"--reward {spec!r}: the weight must be finite")
    return where, func, weight


def _import(where: str, spec: str):
    if where.endswith(".py"):
        try:
            return import_file(where, "flashreinforce_reward_")
        except FileNotFoundError:
            raise RewardSpecError(f"--reward {spec}: {where} does not exist") from None
        except ImportFileError as err:
            raise RewardSpecError(f"--reward {spec}: {err}") from None
    try:
        return import_module(where)  # a module in the current folder is found too
    except ModuleNotFoundError as err:
        raise RewardSpecError(f"--reward {spec}: cannot import {where} ({err})") from None
    except (Exception, SystemExit) as err:
        raise RewardSpecError(f"--reward {spec}: {import_failure(where, err)}") from None


def load_reward(spec: str | Callable | tuple | RewardFunction) -> RewardFunction:
    """A :class:`RewardFunction` from a spec string, a callable, a ``(callable, weight)`` pair or itself."""
    if isinstance(spec, RewardFunction):
        return spec
    if isinstance(spec, tuple):
        if len(spec) != 2:
            raise RewardSpecError(f"a reward given as a tuple is (function, weight), got {spec!r}")
        return RewardFunction(load_reward(spec[0]).func, spec[1])
    if callable(spec):
        return RewardFunction(spec)
    where, func, weight = parse_reward_spec(spec)
    module = _import(where, spec)
    fn = getattr(module, func, None)
    if fn is None:
        raise RewardSpecError(f"--reward {spec}: {where} has no {func}")
    if not callable(fn):
        raise RewardSpecError(f"--reward {spec}: {where}.{func} is not callable")
    return RewardFunction(fn, weight, func)


_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 80


def reward_value(value: Any) -> float | str:
    """A reward function's return value as a float, or why it is not one (a short phrase).

    Real numbers of any kind count (NumPy scalars of any width, 0-d arrays and tensors by their
    ``item()``), ``bool`` as 1.0 / 0.0; the value must be finite.
    """
    if getattr(value, "shape", None) == () and callable(getattr(value, "item", None)):
        value = value.item()  # a NumPy scalar (np.bool_ included), a 0-d array or tensor
    if not isinstance(value, (bool, Real)):
        return f"a {type(value).__name__}, not a number"
    try:
        number = float(value)
    except (OverflowError, ValueError):
        number = math.inf
    return number if math.isfinite(number) else "not a finite number"


@register_environment("reward_functions")
class RewardFunctionEnv(TaskEnvironment):
    """One dataset row per episode, one policy turn, reward = the weighted sum of the reward functions.

    rewards: reward specs (strings, callables, ``(callable, weight)`` pairs); at least one. The rows
    come from ``data.prompt_dataset`` (:func:`flashreinforce.envs.registry.make_environment`); the
    label is not interpreted here, it reaches the functions as a field of the row.
    """

    default_max_turns = 1
    #: The dataset's label is one more field of the row for the reward functions (not a ground truth).
    uses_label = False

    def __init__(self, rewards: Sequence[Any] = (), tasks: Sequence[Task] | None = None, *,
                 apply_chat_template: ChatTemplate | None = None, max_turns: int = 1) -> None:
        super().__init__(tasks, apply_chat_template=apply_chat_template)
        if isinstance(rewards, (str, RewardFunction)) or callable(rewards):
            rewards = [rewards]
        self.rewards = [load_reward(r) for r in rewards]
        if not self.rewards:
            raise RewardSpecError("no reward function: give --reward MODULE:FUNC (or rewards=[...])")
        if max_turns != 1:
            raise ValueError(f"reward functions score one policy turn; max_turns must be 1, got {max_turns}")

    def step(self, action: str) -> StepResult:
        self._begin_step(action)
        task = self.task
        total, info = 0.0, {}
        for r in self.rewards:
            # Each call gets copies of its own: what a function changes in them reaches no other call.
            prompt = task.prompt if isinstance(task.prompt, str) else copy.deepcopy([dict(m) for m in task.prompt])
            row = copy.deepcopy(dict(task.extra))
            try:
                value = r.func(prompt, action, **row)
            except Exception as err:
                raise RuntimeError(f"reward function {r.name} raised {type(err).__name__}: {err}") from err
            number = reward_value(value)
            if isinstance(number, str):
                raise ValueError(f"reward function {r.name} returned {_SHOWN.repr(value)}: {number}")
            info[f"reward/{r.name}"] = number
            total += r.weight * number
        return StepResult(reward=total, done=True, info=info)
