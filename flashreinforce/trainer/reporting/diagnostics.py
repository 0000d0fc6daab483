"""Warnings about a run that trains but cannot learn.

:class:`ZeroSignalWatch`: when each of the first ``n`` updates of a run had no reward variance where
the advantage is taken (the whole batch for FlashREINFORCE, each prompt's group of samples for
GRPO), every advantage was 0 and those updates changed nothing. The run goes on; the console gets
one warning with the batch's most common failure kind and one decoded sample, which usually shows
at once what is wrong (no answer in the expected format, answers cut at ``rollout.max_new_tokens``,
a reward function that never pays).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Sequence

from flashreinforce.trainer.reporting.outcomes import failure_kind
from flashreinforce.trainer.reporting.samples import clip_text, decode_turns
from flashreinforce.trainer.rollout.trajectory import Trajectory

__all__ = ["ZeroSignalWatch", "has_reward_signal"]


def has_reward_signal(trajectories: Sequence[Trajectory]) -> bool:
    """Whether some advantage of the batch is non-zero: rewards differ within some prompt group
    (trajectories of one ``prompt_id``), or, when every group has one trajectory, within the batch."""
    groups: dict[int, list[float]] = defaultdict(list)
    for t in trajectories:
        groups[t.prompt_id].append(float(t.reward))
    if all(len(g) == 1 for g in groups.values()):
        rewards = [float(t.reward) for t in trajectories]
        return len(set(rewards)) > 1
    return any(len(set(g)) > 1 for g in groups.values())


class ZeroSignalWatch:
    """Watches the first ``n`` updates of a run (``n`` = ``logger.warn_zero_variance_steps``; 0: off).

    ``initial_step``: a resumed run starts past its first updates and is not watched.
    """

    def __init__(self, n: int, tokenizer, *, initial_step: int = 0, max_chars: int = 200) -> None:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self.n = n
        self.tokenizer = tokenizer
        self.max_chars = max_chars
        self.active = n > 0 and initial_step == 0
        self.kinds: Counter[str] = Counter()
        self.rewards: set[float] = set()
        self.fired = False

    def observe(self, step: int, trajectories: Sequence[Trajectory]) -> str | None:
        """Feed update ``step``'s batch; returns the warning text once, at update ``n``, when all of
        the first ``n`` updates lacked a reward signal; None otherwise."""
        if not self.active:
            return None
        trajs = list(trajectories)
        if has_reward_signal(trajs):
            self.active = False  # something was learned from: nothing to say
            return None
        self.kinds.update(k for k in map(failure_kind, trajs) if k is not None)
        self.rewards.update(float(t.reward) for t in trajs)
        if step < self.n:
            return None
        self.active = False
        self.fired = True
        return self._message(trajs)

    def _message(self, trajs: list[Trajectory]) -> str:
        rewards = sorted(self.rewards)
        what = f"every reward was {rewards[0]:g}" if len(rewards) == 1 else \
            f"rewards were equal within each prompt's group (values {', '.join(f'{r:g}' for r in rewards[:5])})"
        lines = [f"warning: the first {self.n} updates had no reward variance ({what}): every advantage was 0, "
                 "so nothing was learned from them. The run goes on."]
        if self.kinds:
            kind, count = self.kinds.most_common(1)[0]
            total = sum(self.kinds.values())
            lines.append(f"  most common failure kind: {kind} ({count} of {total} failed trajectories)")
        example = next((t for t in trajs if t.failed), trajs[0])
        prompt, turns = decode_turns(example, self.tokenizer)
        answer = " | ".join(x["action"] for x in turns)
        lines.append(f"  a sample: prompt {clip_text(' '.join(prompt.split()), self.max_chars)!r}")
        lines.append(f"            answer {clip_text(' '.join(answer.split()), self.max_chars)!r} "
                     f"(reward {example.reward:g}{', truncated' if example.truncated else ''})")
        lines.append("  check the reward and the answer format the environment expects, rollout.max_new_tokens "
                     "and data.max_len (OUTPUT/samples.jsonl has more samples)")
        return "\n".join(lines)
