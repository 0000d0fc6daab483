"""FlashREINFORCE: critic-free, single-rollout, asynchronous REINFORCE for LLM agents.

* ``train``, ``TrainerConfig``, ``load_config``, ``Trainer``: training from Python
  (:mod:`flashreinforce.api`), the same run as ``flashreinforce train``; ``Callback``: the base
  class of a callback (:mod:`flashreinforce.trainer.run.callbacks`);
* ``flashreinforce_loss_packed``, ``flashreinforce_loss``: the fused loss;
  ``flashreinforce.loss`` holds the pure-PyTorch reference of the objective;
* ``LossOptions``: the objective's options (:mod:`flashreinforce.objective`).
"""

__version__ = "0.1.0"

# Imported lazily, so that `import flashreinforce` needs no PyTorch and works where the extension is
# not built: the fused kernel's entry points (flashreinforce.ops over flashreinforce._C), and the
# training API.
_EXPORTS = {"flashreinforce_loss_packed": "flashreinforce.ops", "flashreinforce_loss": "flashreinforce.ops",
            "train": "flashreinforce.api", "load_config": "flashreinforce.api",
            "TrainerConfig": "flashreinforce.config", "Trainer": "flashreinforce.trainer",
            "LossOptions": "flashreinforce.objective", "Callback": "flashreinforce.trainer.run.callbacks"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is not None:
        import importlib

        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'flashreinforce' has no attribute {name!r}")
