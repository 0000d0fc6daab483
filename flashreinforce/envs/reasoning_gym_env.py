"""Tasks of the ``reasoning-gym`` library by name: ``--env reasoning_gym:TASK``.

``reasoning-gym`` (``pip install -e '.[reasoning-gym]'``) makes about a hundred procedural tasks
(arithmetic, logic, puzzles, ...), each with its own generator and its own ``score_answer``.
:class:`ReasoningGymEnv` turns one into single-turn episodes: the prompt is the task's question
(after :data:`SYSTEM_PROMPT`, which asks for the answer in ``<answer>...</answer>``), the reward the
task's ``score_answer`` of the tagged answer (0 without tags). ``--env.kwargs`` go to the task's
configuration (``reasoning_gym.create_dataset(TASK, **kwargs)``: ``min_terms``, ``max_digits``, ...),
except the environment's own ``size``, ``heldout_size``, ``dataset_seed`` and ``system_prompt``.

Splits: ``size`` training items from ``dataset_seed`` and ``heldout_size`` held-out items from
another seed, training items that ask a held-out question skipped; ``reset(seed=i)`` plays training
item ``i % size`` and the trainer's evaluation seeds (from 1 000 000 000) the held-out items, so
``flashreinforce eval`` and the training's evaluations score questions never trained on.
``info``: ``score`` (the task's own, in [0, 1]), ``answered`` (tags found), ``task``.
"""

from __future__ import annotations

from typing import Any

from flashreinforce.config import ConfigError
from flashreinforce.envs.base import Environment, StepResult

__all__ = ["HELDOUT_SEED_OFFSET", "SYSTEM_PROMPT", "ReasoningGymEnv", "TASK_PREFIX"]

#: ``--env`` values ``reasoning_gym:TASK`` name a task of the library.
TASK_PREFIX = "reasoning_gym:"
#: The first evaluation seed (the trainer's evaluation seeds of an environment without a finite prompt set).
HELDOUT_SEED_OFFSET = 1_000_000_000
SYSTEM_PROMPT = ("Answer the question. Give the final answer between <answer> and </answer> tags, with nothing "
                 "else inside them.")


def _import_reasoning_gym():
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError("--env reasoning_gym:TASK needs the reasoning-gym package: pip install -e "
                          "'.[reasoning-gym]' (or pip install reasoning-gym)") from None
    return reasoning_gym


class ReasoningGymEnv(Environment):
    """One reasoning-gym task as single-turn episodes (see the module docstring).

    Args:
        task: the task's name (``basic_arithmetic``, ``leg_counting``, ...).
        size, heldout_size, dataset_seed: the splits. system_prompt: the instruction before each
        question (``None``: none). apply_chat_template: the trainer's chat template (the system
        prompt and the question as messages). task_config: the task's own configuration.
    """

    default_max_turns = 1

    def __init__(self, task: str, *, size: int = 10_000, heldout_size: int = 256, dataset_seed: int = 0,
                 system_prompt: str | None = SYSTEM_PROMPT, apply_chat_template=None, max_turns: int = 1,
                 **task_config: Any) -> None:
        rg = _import_reasoning_gym()
        from reasoning_gym.utils import extract_answer

        if task not in rg.factory.DATASETS:
            known = sorted(rg.factory.DATASETS)
            raise ConfigError(f"--env reasoning_gym:{task}: reasoning-gym has no task {task!r}; {len(known)} tasks, e.g. {', '.join(known[:12])}, ...")
        for name, value in (("size", size), ("heldout_size", heldout_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if max_turns != 1:
            raise ValueError(f"reasoning-gym tasks are answered in one turn; max_turns must be 1, got {max_turns}")
        try:
            self.train = rg.create_dataset(task, size=size, seed=dataset_seed, **task_config)
            self.heldout = rg.create_dataset(task, size=heldout_size, seed=dataset_seed + 1_000_003, **task_config)
        except (TypeError, ValueError, AssertionError) as err:
            raise ConfigError(f"--env.kwargs: reasoning-gym task {task} rejects the configuration {task_config}: "
                             f"{type(err).__name__}: {err}") from None
        self.task_name, self.size, self.heldout_size = task, size, heldout_size
        self.system_prompt, self.apply_chat_template = system_prompt, apply_chat_template
        self._extract = extract_answer
        self._heldout_questions: set[str] | None = None
        self.entry: dict[str, Any] | None = None
        self.split = ""

    def _train_entry(self, seed: int) -> dict[str, Any]:
        if self._heldout_questions is None:
            self._heldout_questions = {self.heldout[i]["question"] for i in range(self.heldout_size)}
        for k in range(self.size):  # the next item whose question is not held out
            entry = self.train[(seed + k) % self.size]
            if entry["question"] not in self._heldout_questions:
                return entry
        raise ValueError(f"every training item of {self.task_name} asks a held-out question; raise size")

    def reset(self, *, seed: int) -> str:
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        if seed >= HELDOUT_SEED_OFFSET:
            index = seed - HELDOUT_SEED_OFFSET
            if index >= self.heldout_size:
                raise ValueError(f"held-out item {index} requested, but the held-out split has {self.heldout_size}; "
                                 "lower eval.num_prompts or raise env.kwargs heldout_size")
            self.entry, self.split = self.heldout[index], "heldout"
        else:
            self.entry, self.split = self._train_entry(seed), "train"
        question = self.entry["question"]
        if self.apply_chat_template is not None:
            messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + \
                [{"role": "user", "content": question}]
            return self.apply_chat_template(messages)
        return f"{self.system_prompt}\n\n{question}" if self.system_prompt else question

    def step(self, action: str) -> StepResult:
        if self.entry is None:
            raise RuntimeError("step() before reset()")
        answer = self._extract(action)
        dataset = self.heldout if self.split == "heldout" else self.train
        score = 0.0 if answer is None else float(dataset.score_answer(answer=answer, entry=self.entry))
        info = {"score": score, "answered": answer is not None, "heldout": self.split == "heldout"}
        if answer is None:
            info["failure_kind"] = "no_answer"
        return StepResult(reward=score, done=True, failed=score < 1.0, info=info)
