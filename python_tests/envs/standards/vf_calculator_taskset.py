"""A verifiers.v1 taskset with one tool, for the tests and results: two-digit products and a calculator.

SmolLM2-135M-Instruct cannot multiply two two-digit numbers in its head; the taskset's ``calculate``
tool (a verifiers ``Toolset``: an MCP server that verifiers starts, here in a child process) can.
Run as a module it serves the tool (``python -m vf_calculator_taskset``, what verifiers does).
"""

import verifiers.v1 as vf

from flashreinforce.envs.arith import HELDOUT_SEED_OFFSET, ArithSpec, final_answer, problem_for_seed

SYSTEM = ("You can call the calculate tool to evaluate an arithmetic expression. To multiply two numbers, call it "
          "with the expression, then answer with just the number it returns.")
QUESTION = "What is {a} * {b}?"
TOOL = "calculator_calculate"  # verifiers names a toolset's tools after the toolset: calculator_<method>
# Two worked episodes before the question, outside the task's ranges (a three-digit factor), so that none gives
# away an answer: the question, the tool call, the tool's result, the answer.
DEMONSTRATIONS = [("125", "7", "875"), ("6", "213", "1278")]


def demonstration(a: str, b: str, result: str, k: int) -> list:
    call = vf.ToolCall(id=f"call_demo{k}", name=TOOL, arguments=f'{{"expression": "{a} * {b}"}}')
    return [vf.UserMessage(content=QUESTION.format(a=a, b=b)), vf.AssistantMessage(content=None, tool_calls=[call]),
            vf.ToolMessage(tool_call_id=call.id, content=result), vf.AssistantMessage(content=result)]


class CalculatorConfig(vf.ToolsetConfig):
    pass


class Calculator(vf.Toolset[CalculatorConfig, vf.State]):
    @vf.tool
    async def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression of integers with + - * and parentheses."""
        if not expression or any(ch not in "0123456789+-*() " for ch in expression) or "**" in expression:
            return "error: use integers, + - * and parentheses"
        try:
            return str(eval(expression, {"__builtins__": {}}, {}))  # digits and operators only (checked above)
        except Exception as err:
            return f"error: {type(err).__name__}"


class ProductConfig(vf.TasksetConfig):
    split: str = "train"
    size: int = 2000
    heldout_size: int = 128
    calculator: CalculatorConfig = CalculatorConfig()


class ProductData(vf.TaskData):
    answer: int


class ProductTask(vf.Task[ProductData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task, trace) -> float:
        answer = final_answer(trace.last_reply or "")
        try:
            return float(answer is not None and int(answer) == task.answer)
        except ValueError:
            return 0.0

    @vf.metric
    async def tool_calls(self, trace) -> float:
        return float(sum(len(m.tool_calls or []) for m in trace.assistant_messages))


class ProductTaskset(vf.Taskset[ProductTask, ProductConfig]):
    def load(self):
        c = self.config
        spec = ArithSpec(digits=(2, 2), operations="*", heldout_size=c.heldout_size)
        seeds = [HELDOUT_SEED_OFFSET + i for i in range(c.heldout_size)] if c.split == "heldout" else range(c.size)
        for seed in seeds:
            problem, _ = problem_for_seed(spec, seed)
            messages = [m for k, demo in enumerate(DEMONSTRATIONS) for m in demonstration(*demo, k)]
            messages.append(vf.UserMessage(content=QUESTION.format(a=problem.a, b=problem.b)))
            yield ProductTask(ProductData(prompt=messages, system_prompt=SYSTEM, answer=problem.answer),
                              self.config.task)

    @classmethod
    def toolsets(cls, config):
        return [Calculator(config.calculator)]


__all__ = ["ProductTaskset"]

if __name__ == "__main__":
    Calculator.run()
