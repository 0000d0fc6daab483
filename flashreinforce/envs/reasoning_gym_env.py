"""Tasks of the ``reasoning-gym`` library by name: ``--env reasoning_gym:TASK``.

``reasoning-gym`` (an optional extra: ``pip install -e '.[reasoning-gym]'``) generates about a
hundred procedural tasks (arithmetic, logic, puzzles, ...), each with its own configuration and its
own ``score_answer``. :class:`ReasoningGymEnv` turns one task's dataset into a finite prompt set of
single-turn episodes:

* the prompt set: ``reasoning_gym.create_dataset(TASK, **task_config)``, ``task_config`` being
  ``--env.kwargs`` less the environment's own ``system_prompt`` and ``examples``: the task's
  difficulty settings (``min_terms``, ``max_digits``, ...) and the dataset's ``size`` (default
  :data:`DEFAULT_SIZE`) and ``seed`` (default 0: every rollout worker, and ``flashreinforce eval`` later, builds the same
  items). An item whose question repeats an earlier one is dropped, so that a question the run
  holds out is never trained on; ``len(env)`` is the number of distinct questions.
* ``reset(seed=i)`` plays item ``i % len(env)``: the prompt is :data:`SYSTEM_PROMPT` (which asks
  for the answer between ``<answer>`` tags), the worked ``examples`` if any, and the question, as
  chat messages through the model's chat template when there is one.
* the reward is the task's own ``score_answer`` of the last ``<answer>...</answer>`` of the
  completion (0 without one), in [0, 1]; an episode scoring below 1 is failed.

Being a finite prompt set, it is split like a dataset by
:mod:`flashreinforce.trainer.reporting.heldout`: a run that evaluates holds some items out (``OUTPUT/heldout.json``) and never trains on them, and
``flashreinforce eval`` plays those items. ``info``: ``score``, ``answer_extraction`` (``tags``, or
``none``: counted in the ``no_answer_fraction`` metric), ``task``; ``failure_kind`` ``no_answer``.
"""

from __future__ import annotations

import difflib
from typing import Any, Callable

from flashreinforce.config import ConfigError
from flashreinforce.envs.base import Environment, StepResult
from flashreinforce.envs.registry import register_environment

__all__ = ["DEFAULT_SIZE", "SYSTEM_PROMPT", "TASK_PREFIX", "ReasoningGymEnv", "check_task", "task_names"]

#: ``--env`` values ``reasoning_gym:TASK`` name a task of the library.
TASK_PREFIX = "reasoning_gym:"
#: Items generated when ``--env.kwargs`` sets no ``size``.
DEFAULT_SIZE = 1000
SYSTEM_PROMPT = ("Answer the question. Give the final answer between <answer> and </answer> tags, with nothing "
                 "else inside them.")
_INSTALL = "pip install -e '.[reasoning-gym]' (or pip install reasoning-gym)"


def _import_reasoning_gym():
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(f"--env reasoning_gym:TASK needs the reasoning-gym package, which is not installed: "
                          f"{_INSTALL}") from None
    return reasoning_gym


def task_names() -> list[str]:
    """The tasks reasoning-gym has (``ConfigError`` naming the extra when it is not installed)."""
    return sorted(_import_reasoning_gym().factory.DATASETS)


def check_task(task: str) -> None:
    """``ConfigError`` (one line naming ``--env``) when reasoning-gym is not installed or has no task
    ``task``; the message lists close names."""
    known = task_names()
    if task in known:
        return
    close = difflib.get_close_matches(task, known, n=5, cutoff=0.5) or known[:5]
    raise ConfigError(f"--env reasoning_gym:{task}: reasoning-gym has no task {task!r}; close names: "
                      f"{', '.join(close)} ({len(known)} tasks: python -c \"import reasoning_gym; "
                      "print(sorted(reasoning_gym.factory.DATASETS))\")")


def _examples(value: Any) -> list[tuple[str, str]]:
    """``examples`` as ``(question, answer)`` pairs of strings (``ConfigError`` naming the setting)."""
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"--env.kwargs examples: a list of [question, answer] pairs, got {type(value).__name__}")
    out = []
    for i, pair in enumerate(value):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], str) and pair[0]
                and isinstance(pair[1], (str, int, float)) and not isinstance(pair[1], bool)):
            raise ConfigError(f"--env.kwargs examples[{i}]: a [question, answer] pair (a question string and an "
                              f"answer string or number), got {pair!r}")
        out.append((pair[0], str(pair[1])))
    return out


@register_environment("reasoning_gym:")
class ReasoningGymEnv(Environment):
    """One reasoning-gym task as a finite prompt set of single-turn episodes (see the module docstring).

    Args:
        task: the task's name (``basic_arithmetic``, ``leg_counting``, ...).
        system_prompt: the instruction before each question (``None``: the question alone).
        examples: worked examples shown before each question, as ``[question, answer]`` pairs: a user
            turn with the question and an assistant turn with ``<answer>ANSWER</answer>`` each (without a
            chat template, the same as text). A small model may ignore the tags when only told to use
            them (SmolLM2-135M-Instruct wrote none in 128 answers; with one example, 38 of 40); an
            example that repeats a prompt-set question is refused, so none leaks an answer.
        apply_chat_template: the trainer's chat template (the system prompt and the question as messages).
        task_config: the task's configuration, ``size`` and ``seed`` included.
    """

    default_max_turns = 1

    def __init__(self, task: str, *, system_prompt: str | None = SYSTEM_PROMPT, examples: Any = (),
                 apply_chat_template: Callable[[list[dict[str, str]]], str] | None = None, **task_config: Any) -> None:
        check_task(task)
        rg = _import_reasoning_gym()
        from reasoning_gym.utils import extract_answer

        if system_prompt is not None and not isinstance(system_prompt, str):
            raise ConfigError(f"--env.kwargs system_prompt: a string or null, got {type(system_prompt).__name__}")
        task_config.setdefault("size", DEFAULT_SIZE)
        task_config.setdefault("seed", 0)
        size = task_config["size"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ConfigError(f"--env.kwargs size: the number of items of reasoning-gym task {task}, a positive "
                              f"integer, got {size!r}")
        try:
            self.dataset = rg.create_dataset(task, **task_config)
            items, seen = [], set()
            for i in range(size):
                entry = self.dataset[i]
                if entry["question"] not in seen:
                    seen.add(entry["question"])
                    items.append(entry)
        except (TypeError, ValueError, AssertionError, KeyError) as err:
            detail = str(err).splitlines()[0] if str(err) else ""
            raise ConfigError(f"--env.kwargs: reasoning-gym task {task} rejects the configuration {task_config}: "
                              f"{type(err).__name__}: {detail}") from None
        self.examples = _examples(examples)
        repeated = sorted({q for q, _ in self.examples} & seen)
        if repeated:
            raise ConfigError(f"--env.kwargs examples: {repeated[0]!r} is a question of the prompt set; an example "
                              "must not give away an item's answer")
        self.task_name = task
        self.items: list[dict[str, Any]] = items
        self.system_prompt, self.apply_chat_template = system_prompt, apply_chat_template
        self._extract = extract_answer
        self.entry: dict[str, Any] | None = None

    def __len__(self) -> int:
        return len(self.items)

    def prompt(self, question: str) -> str:
        """The text the policy continues for ``question``."""
        shown = [(q, f"<answer>{a}</answer>") for q, a in self.examples]
        if self.apply_chat_template is not None:
            messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            for q, a in shown:
                messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            return self.apply_chat_template(messages + [{"role": "user", "content": question}])
        parts = ([self.system_prompt] if self.system_prompt else []) + [f"{q}\n{a}" for q, a in shown] + [question]
        return "\n\n".join(parts)

    def reset(self, *, seed: int) -> str:
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        self.entry = self.items[seed % len(self.items)]
        return self.prompt(self.entry["question"])

    def score(self, completion: str) -> tuple[float, bool]:
        """The task's ``score_answer`` of the completion's last tagged answer (0 without one), and
        whether there was one."""
        if self.entry is None:
            raise RuntimeError("score() before reset()")
        answer = self._extract(completion)
        if answer is None:
            return 0.0, False
        return float(self.dataset.score_answer(answer=answer, entry=self.entry)), True

    def step(self, action: str) -> StepResult:
        score, answered = self.score(action)
        info: dict[str, Any] = {"score": score, "answer_extraction": "tags" if answered else "none",
                                "task": self.task_name}
        if not answered:
            info["failure_kind"] = "no_answer"
        return StepResult(reward=score, done=True, failed=score < 1.0, info=info)
