"""FlashREINFORCE: critic-free, single-rollout, asynchronous REINFORCE for LLM agents.

``flashreinforce.loss`` holds the pure-PyTorch reference of the objective.
"""

__version__ = "0.1.0"

# The fused kernel's entry points (flashreinforce.ops, backed by the compiled flashreinforce._C).
# Imported lazily so that `import flashreinforce` works even where the extension is not built.
_FUSED_EXPORTS = ("flashreinforce_loss_packed", "flashreinforce_loss")


def __getattr__(name):
    if name in _FUSED_EXPORTS:
        from flashreinforce import ops

        return getattr(ops, name)
    raise AttributeError(f"module 'flashreinforce' has no attribute {name!r}")
