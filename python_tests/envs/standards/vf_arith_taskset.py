"""A verifiers.v1 taskset for the tests and results: the ``arith`` preset's one-digit problems.

The problems, their splits and the answer extraction are :mod:`flashreinforce.envs.arith`'s
(``split`` ``train`` plays train problems by index, ``heldout`` the held-out ones), so the same task
is played here through verifiers as through ``--env`` ``flashreinforce.envs.arith:ArithEnv``.
"""

import verifiers.v1 as vf

from flashreinforce.envs.arith import HELDOUT_SEED_OFFSET, ArithSpec, final_answer, problem_for_seed

QUESTION = "What is {a} {op} {b}? Answer with just the number."


class ArithConfig(vf.TasksetConfig):
    split: str = "train"
    size: int = 2000
    digits: int = 1
    operations: str = "+-*/"
    negative: bool = True
    heldout_size: int = 128


class ArithData(vf.TaskData):
    answer: int


class ArithTask(vf.Task[ArithData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task, trace) -> float:
        answer = final_answer(trace.last_reply or "")
        try:
            return float(answer is not None and int(answer) == task.answer)
        except ValueError:
            return 0.0

    @vf.metric
    async def has_answer(self, trace) -> float:
        return float(final_answer(trace.last_reply or "") is not None)


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self):
        c = self.config
        spec = ArithSpec(digits=c.digits, operations=c.operations, negative=c.negative, heldout_size=c.heldout_size)
        seeds = [HELDOUT_SEED_OFFSET + i for i in range(c.heldout_size)] if c.split == "heldout" else range(c.size)
        for seed in seeds:
            problem, _ = problem_for_seed(spec, seed)
            text = QUESTION.format(a=problem.a, op=problem.op, b=problem.b)
            yield ArithTask(ArithData(prompt=text, answer=problem.answer), self.config.task)


__all__ = ["ArithTaskset"]
