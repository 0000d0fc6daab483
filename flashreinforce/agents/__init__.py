"""Agents written against the OpenAI chat API, trained as they are.

* :mod:`.server`: each rollout worker's OpenAI-compatible endpoint (FastAPI under uvicorn);
* :mod:`.protocol`: the wire format (request checks, responses, errors);
* :mod:`.chat`: messages and tools to exact token ids, and an episode's conversations;
* :mod:`.toolcalls`: tool-call parsers by name (``hermes``) and the Hermes rendering of tools;
* :mod:`.arith_tool`: the ``arith_tool`` task as an agent with a calculator tool.

The worker that runs agent functions is :class:`flashreinforce.trainer.rollout.agent_worker.AgentRolloutWorker`;
what an agent function is and returns: :mod:`flashreinforce.envs.agent_env`. Nothing here imports
torch; FastAPI, uvicorn and openai are imported when a server starts (the ``agents`` extra).
"""
