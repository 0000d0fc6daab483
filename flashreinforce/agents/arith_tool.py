"""The former name of :mod:`flashreinforce.agents.arith_calculator` (the ``arith_tool_agent`` preset's agent),
kept because earlier docs showed ``from flashreinforce.agents.arith_tool import calculate`` and runs recorded
``--agent flashreinforce.agents.arith_tool:agent``. New code imports :mod:`flashreinforce.agents.arith_calculator`."""

from flashreinforce.agents.arith_calculator import MAX_CALLS, SYSTEM_PROMPT, TOOLS, agent, calculate, problem

__all__ = ["MAX_CALLS", "SYSTEM_PROMPT", "TOOLS", "agent", "calculate", "problem"]
