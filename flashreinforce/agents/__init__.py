"""Agents written against the OpenAI chat API, trained as they are: the whole feature.

The endpoint and what it speaks (no torch; FastAPI, uvicorn and openai are imported when a server
starts, the ``agents`` extra):

* :mod:`.server`: each rollout worker's OpenAI-compatible endpoint (FastAPI under uvicorn);
* :mod:`.serving`: the same app over a trained run (``flashreinforce serve``);
* :mod:`.protocol`: the wire format (request checks, responses, errors);
* :mod:`.chat`: messages and tools to exact token ids, and an episode's conversations;
* :mod:`.toolcalls`: tool-call parsers by name (``hermes``) and the Hermes rendering of tools;
* :mod:`.templates`: a chat template with the endpoint's tool rendering (an agent run's export);
* :mod:`.environment`: what an agent function is and returns, as ``--env agent`` (no torch either).

The training side, built on :mod:`flashreinforce.trainer.rollout`:

* :mod:`.worker`: :class:`~flashreinforce.agents.worker.AgentRolloutWorker`, the rollout worker that runs
  agent functions (the worker kind ``"agent"`` of :mod:`flashreinforce.trainer.rollout.worker_kinds`, which
  the trainer asks; it never imports this package's worker);
* :mod:`.episode`: one episode of it, and how a call is sampled.

The preset's agent: :mod:`.arith_calculator`, the ``arith_tool`` task as an agent with a calculator
tool (``--preset arith_tool_agent``; :mod:`.arith_tool` is its former name).
"""
