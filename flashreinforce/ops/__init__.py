"""The objective and everything the learner's loss computes, with no trainer or transformers imports.

``contract``   the argument contract shared by the two implementations: option defaults, output
               names, validation rules and the data errors' messages (docs/semantics.md)
``fused``      the fused FlashREINFORCE loss over packed sequences (custom op over ``flashreinforce._C``)
``reference``  the same objective in plain PyTorch: the readable definition
``logprobs``   log-probabilities of sampled tokens without ``[tokens, vocab]`` logits
``ppo``        group advantages and the clipped PPO loss of the GRPO comparison
``loss_modes`` how a learner batch becomes a loss, by ``actor.loss_mode`` name

``import flashreinforce.ops`` loads the compiled extension (for the fused entry points below).
"""

from flashreinforce.ops.fused import (PendingErrors, fused_loss_capturable, fused_loss_deferred, flashreinforce_loss,
                                      flashreinforce_loss_packed, has_cuda, raise_for_error)

__all__ = ["flashreinforce_loss_packed", "flashreinforce_loss", "fused_loss_capturable", "fused_loss_deferred",
           "PendingErrors", "raise_for_error", "has_cuda"]
