"""The rollout record: one trajectory, every turn of one episode in one token sequence.

Layout (Molt-style): ``token_ids`` holds the prompt, then each policy turn's sampled tokens and
the environment's observation tokens in order. ``action_mask[t]`` is True only on tokens the policy
sampled; ``behavior_log_probs[t]`` is the natural-log probability the engine sampled token t with,
under the distribution it really sampled from (after temperature / top-k / top-p), and 0.0 on every
non-action token. Token t's log-probability is conditioned on ``token_ids[:t]``, so the first token
(a prompt token) is never an action.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FLOAT32_OVERFLOW", "Trajectory"]

#: The smallest magnitude that rounds to infinity in float32: halfway between the largest float32,
#: (2 - 2**-23) * 2**127, and 2**128 (a tie rounds to the even significand, i.e. up).
FLOAT32_OVERFLOW = (2 - 2**-24) * 2**127


@dataclass
class Trajectory:
    """One finished episode.

    token_ids: ``[L]`` ints, the whole episode.
    action_mask: ``[L]`` bools, True on sampled (policy) tokens.
    behavior_log_probs: ``[L]`` floats (nats), the sampler's log-probability on action tokens, 0.0 elsewhere.
    reward: scalar episode reward (sum of the environment's step rewards).
    failed: explicit failure label (the environment's, or ``reward <= 0`` when it gave none).
    truncated: the episode hit the turn or context limit before the environment said ``done``.
    policy_version_min / policy_version_max: oldest and newest weight version that sampled any of
        its tokens (they differ when weights changed between turns, or within a turn with in-flight
        weight updates).
    prompt_id: index of the prompt in the trainer's prompt stream; seed: the environment seed.
    sample_index: which of the ``n_samples_per_prompt`` samples of that prompt this is.
    info: per-trajectory metrics (numbers) from the environment and the worker.
    token_versions: ``[L]`` ints or ``None``: the weight version that sampled each action token (-1
        elsewhere); ``None`` (a record made without them): every action token counts as sampled by
        ``policy_version_min``.
    """

    token_ids: list[int]
    action_mask: list[bool]
    behavior_log_probs: list[float]
    reward: float
    failed: bool
    truncated: bool = False
    policy_version_min: int = 0
    policy_version_max: int = 0
    prompt_id: int = 0
    seed: int = 0
    sample_index: int = 0
    num_turns: int = 1
    worker_id: int = -1
    info: dict[str, Any] = field(default_factory=dict)
    token_versions: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_action_tokens(self) -> int:
        return sum(1 for m in self.action_mask if m)

    def policy_lag(self, learner_version: int) -> int:
        """Learner version at the update minus the oldest version that generated this trajectory."""
        return int(learner_version) - int(self.policy_version_min)

    def action_versions(self) -> list[int]:
        """The version that sampled each action token, in order (see ``token_versions``)."""
        if self.token_versions is None:
            return [int(self.policy_version_min)] * self.num_action_tokens
        return [int(v) for v, m in zip(self.token_versions, self.action_mask) if m]

    def problem(self, vocab_size: int | None = None) -> str | None:
        """Why this trajectory cannot be trained on, or ``None`` when it is valid (see :meth:`diagnose`)."""
        found = self.diagnose(vocab_size)
        return None if found is None else found[1]

    def diagnose(self, vocab_size: int | None = None) -> tuple[str, str] | None:
        """``(kind, message)`` of the first reason this trajectory cannot be trained on, or ``None``.

        Checks: equal lengths; at least one action token; the first token is not an action; token ids
        are ints in ``[0, vocab_size)``; action log-probabilities finite and <= 0; a reward that is
        finite in float32 (the learner's compute dtype: a finite float64 beyond ``3.4e38`` would
        become inf there); ``policy_version_min <= policy_version_max``; bool labels. ``kind`` names
        the check (the key of the once-per-kind log and counters), ``message`` adds the values.
        """
        n = len(self.token_ids)
        if n == 0:
            return "empty trajectory", "token_ids is empty"
        if len(self.action_mask) != n or len(self.behavior_log_probs) != n:
            return "lengths disagree", (f"lengths disagree: token_ids {n}, action_mask {len(self.action_mask)}, "
                                        f"behavior_log_probs {len(self.behavior_log_probs)}")
        if self.action_mask[0]:
            return "first token is an action", "action_mask[0] is True: the first token must be a prompt token"
        if not any(self.action_mask):
            return "no action token", "no action token (action_mask is all False)"
        for t, tok in enumerate(self.token_ids):
            if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0 or (vocab_size is not None and tok >= vocab_size):
                return "token id outside the vocabulary", (f"token_ids[{t}] = {tok!r} is not a token id in "
                                                           f"[0, {vocab_size})")
        for t, (m, lp) in enumerate(zip(self.action_mask, self.behavior_log_probs)):
            if m and not (isinstance(lp, (int, float)) and math.isfinite(lp) and lp <= 0.0):
                return "bad behavior log-prob", (f"behavior_log_probs[{t}] = {lp!r} on an action token is not a "
                                                 "finite value <= 0")
        if not (isinstance(self.reward, (int, float)) and math.isfinite(self.reward)):
            return "reward not finite", f"reward {self.reward!r} is not finite"
        if abs(self.reward) >= FLOAT32_OVERFLOW:
            return "reward overflows float32", f"reward {self.reward!r} is not finite in float32 (|reward| >= 3.4e38)"
        if not isinstance(self.failed, bool) or not isinstance(self.truncated, bool):
            return "labels not bools", f"failed ({self.failed!r}) and truncated ({self.truncated!r}) must be bools"
        if self.policy_version_min > self.policy_version_max:
            return "policy versions out of order", (f"policy_version_min {self.policy_version_min} > "
                                                    f"policy_version_max {self.policy_version_max}")
        if self.token_versions is not None:
            if len(self.token_versions) != n:
                return "lengths disagree", f"lengths disagree: token_ids {n}, token_versions {len(self.token_versions)}"
            for t, (m, v) in enumerate(zip(self.action_mask, self.token_versions)):
                if m and not (isinstance(v, int) and self.policy_version_min <= v <= self.policy_version_max):
                    return "policy versions out of order", (f"token_versions[{t}] = {v!r} on an action token is not "
                                                            f"in [policy_version_min, policy_version_max]")
        return None
