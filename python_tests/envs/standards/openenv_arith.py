"""An OpenEnv environment for the tests and results: the ``arith`` preset's one-digit problems.

A server-side ``openenv.core.Environment``: ``reset(seed)`` poses the problem of that seed (held-out
problems from the trainer's evaluation seeds on, as :mod:`flashreinforce.envs.arith` does),
``step(ArithAction(message=...))`` grades the answer: reward 1.0 when right, and the episode ends.
"""

from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

from flashreinforce.envs.arith import ArithSpec, final_answer, problem_for_seed

QUESTION = "What is {a} {op} {b}? Answer with just the number."


class ArithAction(Action):
    message: str


class ArithObservation(Observation):
    question: str = ""
    correct: bool = False


class ArithOpenEnv(Environment[ArithAction, ArithObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, digits: int = 1, operations: str = "+-*/", negative: bool = True, heldout_size: int = 128):
        super().__init__()
        self.spec = ArithSpec(digits=digits, operations=operations, negative=negative, heldout_size=heldout_size)
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.problem = None

    def reset(self, seed=None, episode_id=None, **kwargs) -> ArithObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self.problem, _ = problem_for_seed(self.spec, int(seed or 0))
        p = self.problem
        return ArithObservation(question=QUESTION.format(a=p.a, op=p.op, b=p.b), done=False, reward=None)

    def step(self, action: ArithAction, timeout_s=None, **kwargs) -> ArithObservation:
        self._state.step_count += 1
        answer = final_answer(action.message)
        try:
            right = answer is not None and int(answer) == self.problem.answer
        except ValueError:
            right = False
        return ArithObservation(question="", correct=right, done=True, reward=1.0 if right else 0.0)

    @property
    def state(self) -> State:
        return self._state
