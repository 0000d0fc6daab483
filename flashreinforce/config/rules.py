"""The rules every FlashREINFORCE run obeys, written once for the trainer's flags and the published settings.

:func:`rule_violations` checks a flat dict of dotted flags (Molt's names) and returns one message per
broken rule, naming the flags; both the native trainer's configuration
(:func:`flashreinforce.config.resolve`) and the published experiment settings
(:func:`flashreinforce.experiments.check_rules`) call it.

The rules: one full-batch update per collected batch (``rollout.batch_size *
rollout.n_samples_per_prompt == train.batch_size``, ``train.max_epochs == 1``; Molt also needs
``train.force_on_policy``, which the native trainer is by construction), no reference-model KL,
room for the prompt (``data.max_len > rollout.max_new_tokens``). ``actor.loss_mode
flash_reinforce``: the ``flash_reinforce`` estimator, one sample per prompt, no external importance
correction, and the loss options that :class:`flashreinforce.objective.LossOptions` accepts
(``0 <= actor.flash_neg_topq <= 1``, ``actor.flash_gate_delta >= 0`` with ``inf`` for no gate, a
positive ``actor.loss_scale_factor`` with ``seq-mean-token-sum-norm``). Any other loss mode is the
GRPO comparison: the ``grpo`` estimator and a valid ``actor.eps_clip_low_high``.
"""

from __future__ import annotations

from typing import Any, Mapping

from flashreinforce.objective import LOSS_AGGREGATIONS, OPTION_FLAGS, LossOptions

__all__ = ["is_off", "loss_option_errors", "rule_violations"]


def is_off(value: Any) -> bool:
    """Whether a switch-like value means off (``None``, ``off``, ``none``, ``false``, ``0``, empty)."""
    return value is None or str(value).lower() in ("off", "none", "false", "0", "")


def loss_option_errors(flags: Mapping[str, Any]) -> list[str]:
    """The FlashREINFORCE options among ``flags`` checked by :class:`flashreinforce.objective.LossOptions`
    (the check the loss functions make), the message naming the flag; the PPO options are not read."""
    values = {opt: flags[flag] for opt, flag in OPTION_FLAGS.items()
              if flag in flags and opt not in ("eps_clip", "whiten")}
    if values.get("loss_agg", LOSS_AGGREGATIONS[0]) != "seq-mean-token-sum-norm":
        values.pop("loss_scale_factor", None)  # inactive with another aggregation
    try:
        LossOptions(**values)
    except (TypeError, ValueError) as err:
        text = str(err)
        option = text.split(" ", 1)[0]
        return [OPTION_FLAGS.get(option, option) + text[len(option):]]
    return []


def rule_violations(flags: Mapping[str, Any], *, native: bool) -> list[str]:
    """One message per broken rule (empty when all hold).

    ``native``: the flags of this project's trainer (every flag present, ``actor.flash_*`` flags of
    another loss mode are dropped rather than refused, ``train.force_on_policy`` is implied). Without
    it, the flags of a published setting launched on Molt.
    """
    v = flags
    errors: list[str] = []

    def need(condition: bool, message: str) -> None:
        if not condition:
            errors.append(message)

    need(v["rollout.batch_size"] * v["rollout.n_samples_per_prompt"] == v["train.batch_size"],
         f"train.batch_size ({v['train.batch_size']}) must equal rollout.batch_size ({v['rollout.batch_size']}) * "
         f"rollout.n_samples_per_prompt ({v['rollout.n_samples_per_prompt']})")
    need(v["train.max_epochs"] == 1,
         f"train.max_epochs must be 1 (one optimizer step per collected batch), got {v['train.max_epochs']}")
    if not native:
        need(v.get("train.force_on_policy") is True, "train.force_on_policy must be true")
    need(v["algo.kl.init_coef"] == 0, f"algo.kl.init_coef must be 0 (no reference model), got {v['algo.kl.init_coef']}")
    need(v["data.max_len"] > v["rollout.max_new_tokens"],
         f"data.max_len ({v['data.max_len']}) must exceed rollout.max_new_tokens ({v['rollout.max_new_tokens']})")

    mode = v["actor.loss_mode"]
    if mode == "flash_reinforce":
        need(v["algo.advantage.estimator"] == "flash_reinforce",
             "actor.loss_mode flash_reinforce needs algo.advantage.estimator flash_reinforce, got "
             f"{v['algo.advantage.estimator']!r}")
        need(is_off(v["algo.advantage.is_correction_level"]),
             "algo.advantage.is_correction_level must be off with actor.loss_mode flash_reinforce (the fused loss "
             f"does its own behavior correction), got {v['algo.advantage.is_correction_level']!r}")
        need(v["rollout.n_samples_per_prompt"] == 1, "actor.loss_mode flash_reinforce uses one sample per prompt; got "
             f"rollout.n_samples_per_prompt {v['rollout.n_samples_per_prompt']}")
        errors.extend(loss_option_errors(v))
    else:
        if not native:
            need(not any(k.startswith("actor.flash_") for k in v),
                 f"actor.flash_* flags have no meaning with actor.loss_mode {mode!r}")
        need(v["algo.advantage.estimator"] == "grpo",
             f"actor.loss_mode {mode} is compared with algo.advantage.estimator grpo, got "
             f"{v['algo.advantage.estimator']!r}")
        if "actor.eps_clip_low_high" in v:
            lo, hi = v["actor.eps_clip_low_high"]
            need(0 <= lo < 1 and hi >= 0,
                 f"actor.eps_clip_low_high must have 0 <= low < 1 and high >= 0, got {lo} {hi}")
    return errors
