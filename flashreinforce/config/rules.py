"""The rules every FlashREINFORCE run obeys, written once for the trainer's flags and the published settings.

:func:`rule_violations` checks a flat dict of dotted flags (Molt's names) and returns one message per
broken rule, naming the flags; both the native trainer's configuration
(:func:`flashreinforce.config.resolve`) and the published experiment settings
(:func:`flashreinforce.experiments.check_rules`) call it.

The rules: one full-batch update per collected batch (``rollout.batch_size *
rollout.n_samples_per_prompt == train.batch_size``, which the native trainer derives when it is not
given and Molt needs given; ``train.max_epochs == 1``; Molt also needs ``train.force_on_policy``,
which the native trainer is by construction), no reference-model KL,
room for the prompt (``data.max_len > rollout.max_new_tokens``); and the rules of the selected loss
mode, which the mode owns (:class:`flashreinforce.objective.LossModeConfig`: its advantage estimator,
its options as :class:`flashreinforce.objective.LossOptions` accepts them, one sample per prompt and
no external importance correction where it needs them; a published setting carries no flag another
mode owns).

This module and :mod:`flashreinforce.config.trainer_config` are the boundary that reads settings by
their flat flag names (the published launchers' form); everything past it reads typed attributes.
"""

from __future__ import annotations

from typing import Any, Mapping

from flashreinforce.objective import loss_mode_config, owned_flags

__all__ = ["rule_violations"]


def rule_violations(flags: Mapping[str, Any], *, native: bool) -> list[str]:
    """One message per broken rule (empty when all hold).

    ``native``: the flags of this project's trainer (every flag present, the flags another loss mode
    owns are inactive rather than refused, ``train.force_on_policy`` is implied). Without it, the
    flags of a published setting launched on Molt.
    """
    v = flags
    errors: list[str] = []

    def need(condition: bool, message: str) -> None:
        if not condition:
            errors.append(message)

    batch = v.get("train.batch_size")
    if batch is not None or not native:  # the native trainer derives it when not given; Molt needs it
        need(v["rollout.batch_size"] * v["rollout.n_samples_per_prompt"] == batch,
             f"train.batch_size ({batch}) must equal rollout.batch_size ({v['rollout.batch_size']}) * "
             f"rollout.n_samples_per_prompt ({v['rollout.n_samples_per_prompt']})"
             + (": leave --train.batch_size out and it is derived from them" if native else ""))
    need(v["train.max_epochs"] == 1,
         f"train.max_epochs must be 1 (one optimizer step per collected batch), got {v['train.max_epochs']}")
    if not native:
        need(v.get("train.force_on_policy") is True, "train.force_on_policy must be true")
    need(v["algo.kl.init_coef"] == 0, f"algo.kl.init_coef must be 0 (no reference model), got {v['algo.kl.init_coef']}")
    need(v["data.max_len"] > v["rollout.max_new_tokens"],
         f"data.max_len ({v['data.max_len']}) must exceed rollout.max_new_tokens ({v['rollout.max_new_tokens']})")

    try:
        mode = loss_mode_config(v["actor.loss_mode"])
    except ValueError as err:
        return errors + [str(err)]
    errors.extend(mode.rule_violations(v))
    if not native:
        foreign = sorted(flag for flag, owner in owned_flags().items() if flag in v and flag not in mode.flags)
        need(not foreign, f"{', '.join(foreign)} have no meaning with actor.loss_mode {mode.name!r}")
    return errors
