"""Environments written against the interfaces other RL stacks share, played unchanged.

* :mod:`.verifiers_env`: ``--env verifiers:MODULE`` / ``--env verifiers:FILE.py``, a taskset of the
  ``verifiers`` package (its ``verifiers.v1`` stack), run by verifiers' own environment against the
  rollout worker's OpenAI-compatible endpoint (an agent run);
* :mod:`.openenv_env`: ``--env openenv:MODULE:CLASS`` / ``--env openenv:FILE.py:CLASS`` /
  ``--env openenv:URL``, an OpenEnv environment (``reset`` / ``step`` over its HTTP server), started
  by the run when given a class.

Both libraries are optional extras (``verifiers``, ``openenv``), imported when such an environment
is built.
"""
