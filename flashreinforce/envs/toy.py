"""Toy environments a tiny model learns on a CPU in minutes (no data, no download).

:class:`ToyCopyEnv` (single turn): the prompt ``"say k:"`` names a letter; the policy's answer
earns 1 when its first character is that letter. A freshly initialized model over a 100-token
character vocabulary answers correctly about 1% of the time; the skill to learn (copy the letter
after ``say``) is what a small transformer picks up fast.

:class:`ToyCopyChainEnv` (multi-turn): the same game over ``turns`` turns. After each answer the
environment replies with feedback and the next letter (``" ok. say d:"`` / ``" no. say d:"``);
those observation tokens enter the trajectory as non-action tokens, so the policy must read them
but is never trained on them. The reward is the fraction of turns answered correctly.

A failed episode's final ``info`` says why (``failure_kind``): ``invalid_answer`` when some turn's
answer did not start with a letter of the alphabet at all, else ``wrong_answer``.
"""

from __future__ import annotations

import random
from flashreinforce.envs.base import Environment, StepResult

__all__ = ["ToyCopyChainEnv", "ToyCopyEnv"]

DEFAULT_ALPHABET = "abcdefgh"


class ToyCopyEnv(Environment):
    """Say the letter named in the prompt; reward 1 for a correct first character, else 0.

    Args:
        alphabet: letters the target is drawn from (uniformly, by the episode seed).
        turns: number of letters per episode (1 = single turn).
    """

    def __init__(self, alphabet: str = DEFAULT_ALPHABET, turns: int = 1) -> None:
        if not alphabet or len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet must be non-empty with distinct characters, got {alphabet!r}")
        if any(not (32 < ord(c) < 127) for c in alphabet):
            raise ValueError(f"alphabet must hold printable non-space ASCII characters, got {alphabet!r}")
        if turns < 1:
            raise ValueError(f"turns must be >= 1, got {turns}")
        self.alphabet = alphabet
        self.turns = int(turns)
        self._targets: list[str] = []
        self._turn = 0
        self._correct = 0
        self._invalid = 0

    def reset(self, *, seed: int) -> str:
        rng = random.Random(seed)
        self._targets = [rng.choice(self.alphabet) for _ in range(self.turns)]
        self._turn = 0
        self._correct = 0
        self._invalid = 0
        return f"say {self._targets[0]}:"

    def step(self, action: str) -> StepResult:
        if not self._targets or self._turn >= self.turns:
            raise RuntimeError("step() called before reset() or after the episode ended")
        ok = action[:1] == self._targets[self._turn]
        self._correct += int(ok)
        self._invalid += int(action[:1] not in self.alphabet or not action)
        self._turn += 1
        done = self._turn >= self.turns
        info = {"correct_turns": self._correct} if done else {}
        if done and self._correct < self.turns:
            info["failure_kind"] = "invalid_answer" if self._invalid else "wrong_answer"
        if done:
            return StepResult(observation="", reward=float(ok) / self.turns, done=True,
                              failed=self._correct < self.turns, info=info)
        feedback = "ok" if ok else "no"
        return StepResult(observation=f" {feedback}. say {self._targets[self._turn]}:",
                          reward=float(ok) / self.turns, done=False)


class ToyCopyChainEnv(ToyCopyEnv):
    """Multi-turn :class:`ToyCopyEnv` (default 3 turns) with feedback observations between turns."""

    def __init__(self, alphabet: str = DEFAULT_ALPHABET, turns: int = 3) -> None:
        super().__init__(alphabet=alphabet, turns=turns)
