"""FlashREINFORCE: critic-free, single-rollout, asynchronous REINFORCE for LLM agents.

``flashreinforce.loss`` holds the pure-PyTorch reference of the objective.
"""

__version__ = "0.1.0"
