"""A multi-turn OpenEnv environment for the tests: guess a number from 1 to 9 with 'higher' / 'lower' hints."""

import random
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    hint: str = ""
    guesses: int = 0


class GuessEnv(Environment):  # one session at a time: the run serves one per environment instance
    def __init__(self, low: int = 1, high: int = 9):
        super().__init__()
        self.low, self.high = low, high
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.secret = low

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self.secret = random.Random(seed).randint(self.low, self.high)
        self._state = State(episode_id=str(uuid4()), step_count=0)
        return GuessObservation(hint=f"Guess my number from {self.low} to {self.high}.", done=False, reward=None)

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        try:
            guess = int(action.message.strip())
        except ValueError:
            return GuessObservation(hint="Say a number.", guesses=self._state.step_count, reward=0.0)
        if guess == self.secret:
            return GuessObservation(hint="Right.", guesses=self._state.step_count, done=True, reward=1.0)
        hint = "Higher." if guess < self.secret else "Lower."
        return GuessObservation(hint=hint, guesses=self._state.step_count, reward=-0.1)

    @property
    def state(self) -> State:
        return self._state
