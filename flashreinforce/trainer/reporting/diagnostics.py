"""Warnings about a run that trains but cannot learn, or learns without its tools.

:class:`ZeroSignalWatch`: when each of the first ``n`` updates of a run had no reward variance where
the advantage is taken (the whole batch for FlashREINFORCE, each prompt's group of samples for
GRPO), every advantage was 0 and those updates changed nothing. The run goes on; the console gets
one warning with the batch's most common failure kind and one decoded sample, which usually shows
at once what is wrong (no answer in the expected format, answers cut at ``rollout.max_new_tokens``,
a reward function that never pays).

:class:`ToolUseWatch`: when tools were offered in each of ``n`` updates in a row and the policy
called none of them, the rewards it earns come without the tools (a small model that only sees a
tool declared rarely calls it, and its mental arithmetic may still improve, so the reward alone
looks like success). It reads the update records (``env/calls_with_tools``: model calls of an agent
that declared tools; an environment whose episodes report ``tool_calls`` offers a tool in every
episode) and warns once, naming the remedies. :func:`tool_use_warnings` replays it over a run's
``metrics.jsonl`` for ``summary.json``.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Any, Iterable, Mapping, Sequence

from flashreinforce.trainer.reporting.outcomes import failure_kind
from flashreinforce.trainer.reporting.samples import clip_text, decode_turns
from flashreinforce.trainer.rollout.trajectory import Trajectory

__all__ = ["GATE_DROPS_MOST", "NO_TOOL_CALLS", "ToolUseWatch", "TrustGateWatch", "ZeroSignalWatch", "has_reward_signal",
           "tool_use_warnings", "trust_gate_warnings"]


def has_reward_signal(trajectories: Sequence[Trajectory]) -> bool:
    """Whether some advantage of the batch is non-zero: rewards differ within some prompt group
    (trajectories of one ``prompt_id``), or, when every group has one trajectory, within the batch."""
    groups: dict[int, list[float]] = defaultdict(list)
    for t in trajectories:
        groups[t.prompt_id].append(float(t.reward))
    if all(len(g) == 1 for g in groups.values()):
        rewards = [float(t.reward) for t in trajectories]
        return len(set(rewards)) > 1
    return any(len(set(g)) > 1 for g in groups.values())


class ZeroSignalWatch:
    """Watches the first ``n`` updates of a run (``n`` = ``logger.warn_zero_variance_steps``; 0: off).

    ``initial_step``: a resumed run starts past its first updates and is not watched.
    """

    def __init__(self, n: int, tokenizer, *, initial_step: int = 0, max_chars: int = 200) -> None:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self.n = n
        self.tokenizer = tokenizer
        self.max_chars = max_chars
        self.active = n > 0 and initial_step == 0
        self.kinds: Counter[str] = Counter()
        self.rewards: set[float] = set()
        self.fired = False

    def observe(self, step: int, trajectories: Sequence[Trajectory]) -> str | None:
        """Feed update ``step``'s batch; returns the warning text once, at update ``n``, when all of
        the first ``n`` updates lacked a reward signal; None otherwise."""
        if not self.active:
            return None
        trajs = list(trajectories)
        if has_reward_signal(trajs):
            self.active = False  # something was learned from: nothing to say
            return None
        self.kinds.update(k for k in map(failure_kind, trajs) if k is not None)
        self.rewards.update(float(t.reward) for t in trajs)
        if step < self.n:
            return None
        self.active = False
        self.fired = True
        return self._message(trajs)

    def _message(self, trajs: list[Trajectory]) -> str:
        rewards = sorted(self.rewards)
        what = f"every reward was {rewards[0]:g}" if len(rewards) == 1 else \
            f"rewards were equal within each prompt's group (values {', '.join(f'{r:g}' for r in rewards[:5])})"
        lines = [f"warning: the first {self.n} updates had no reward variance ({what}): every advantage was 0, "
                 "so nothing was learned from them. The run goes on."]
        if self.kinds:
            kind, count = self.kinds.most_common(1)[0]
            total = sum(self.kinds.values())
            lines.append(f"  most common failure kind: {kind} ({count} of {total} failed trajectories)")
        example = next((t for t in trajs if t.failed), trajs[0])
        prompt, turns = decode_turns(example, self.tokenizer)
        answer = " | ".join(x["action"] for x in turns)
        lines.append(f"  a sample: prompt {clip_text(' '.join(prompt.split()), self.max_chars)!r}")
        lines.append(f"            answer {clip_text(' '.join(answer.split()), self.max_chars)!r} "
                     f"(reward {example.reward:g}{', truncated' if example.truncated else ''})")
        lines.append("  check the reward and the answer format the environment expects, rollout.max_new_tokens "
                     "and data.max_len (OUTPUT/samples.jsonl has more samples)")
        return "\n".join(lines)


#: The kind of :class:`ToolUseWatch`'s warning in ``summary.json``.
NO_TOOL_CALLS = "no_tool_calls"


def _number(record: Mapping[str, Any], key: str) -> float | None:
    value = record.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _replay(watch, records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Feed ``records`` to a once-only record watch until it fires: ``[]`` or ``[watch.fired]``."""
    for record in records:
        watch.observe(record)
        if watch.fired is not None:
            return [watch.fired]
    return []


class ToolUseWatch:
    """Warns once when tools were offered in each of ``n`` updates in a row and never called (see the
    module docstring); ``n`` = ``logger.warn_no_tool_calls_steps`` (0: off)."""

    def __init__(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self.n = n
        self.run = 0  # updates in a row with tools offered and no call
        self.offered_calls = 0.0
        self.malformed = 0.0
        self.agent = False
        self.fired: dict[str, Any] | None = None

    def observe(self, record: Mapping[str, Any]) -> str | None:
        """Feed one update's ``metrics.jsonl`` record; returns the warning once, at the ``n``-th update in
        a row without a tool call, else None."""
        if self.n <= 0 or self.fired is not None:
            return None
        calls, offered = _number(record, "env/tool_calls"), _number(record, "env/calls_with_tools")
        trajectories = _number(record, "trajectories") or 0.0
        agent = offered is not None
        if calls is None or (agent and offered <= 0) or calls > 0:
            self.run, self.offered_calls, self.malformed = 0, 0.0, 0.0
            return None
        self.run += 1
        self.agent = agent
        self.offered_calls += (offered or 0.0) * trajectories
        self.malformed += (_number(record, "env/malformed_tool_calls") or 0.0) * trajectories
        if self.run < self.n:
            return None
        step = int(record.get("step", 0))
        self.fired = {"kind": NO_TOOL_CALLS, "step": step, "updates": self.run, "message": self._message(step)}
        return self.fired["message"]

    def _message(self, step: int) -> str:
        first = step - self.run + 1
        if self.agent:
            what = (f"the agent offered tools in {self.offered_calls:.0f} model calls of updates {first}-{step} and "
                    "the policy called none")
        else:
            what = f"the environment offers a tool and no episode of updates {first}-{step} called it"
        lines = [f"warning: {what}: the reward comes without the tools (it may still rise, from answers the model "
                 "works out itself). The run goes on."]
        if self.malformed > 0:
            lines.append(f"  {self.malformed:.0f} replies held tool-call markup the parser could not read "
                         "(env/malformed_tool_calls; --env.kwargs tool_parser, OUTPUT/samples.jsonl)")
        lines.append("  remedies: show worked episodes before the task (earlier messages with a tool call, its result "
                     "and the answer: docs/environments.md, \"Tools and small models\"), a model whose chat template "
                     "has tool syntax, or a task the model cannot solve without the tool")
        return "\n".join(lines)


def tool_use_warnings(records: Iterable[Mapping[str, Any]], n: int) -> list[dict[str, Any]]:
    """What :class:`ToolUseWatch` warned over ``records`` (a run's ``metrics.jsonl``): ``[]`` or one
    ``{"kind", "step", "updates", "message"}``."""
    return _replay(ToolUseWatch(n), records)


#: The kind of :class:`TrustGateWatch`'s warning in ``summary.json``.
GATE_DROPS_MOST = "trust_gate_drops_most"

#: The acceptance rate below which an update counts toward :class:`TrustGateWatch`'s warning.
LOW_ACCEPTANCE = 0.5

#: A mean policy lag below this is "on-policy" for the warning's advice (the drift is then numerics).
ON_POLICY_LAG = 0.5


class TrustGateWatch:
    """Warns once when the trust gate admitted less than :data:`LOW_ACCEPTANCE` of the batch in each of
    ``n`` updates in a row (see the module docstring); ``n`` = ``logger.warn_gate_drop_steps`` (0: off).

    ``scaled``: ``actor.scale_step_by_acceptance`` (each step already scaled by the acceptance rate; the
    warning then says that the run learns from a small share of its rollouts, not that its steps are
    too large). Records without ``acceptance_rate`` (or with NaN) are ignored; loss modes without a gate report 1.0.
    """

    def __init__(self, n: int, *, scaled: bool = False) -> None:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self.n = n
        self.scaled = bool(scaled)
        self.run: list[tuple[float, float]] = []  # (acceptance, policy lag) of the low updates in a row
        self.fired: dict[str, Any] | None = None

    def observe(self, record: Mapping[str, Any]) -> str | None:
        """Feed one update's ``metrics.jsonl`` record; returns the warning once, at the ``n``-th update in a
        row with an acceptance rate below :data:`LOW_ACCEPTANCE`, else None."""
        if self.n <= 0 or self.fired is not None:
            return None
        acceptance = _number(record, "acceptance_rate")
        if acceptance is None or math.isnan(acceptance):  # NaN: no pass ran (actor.statistics_without_gradient)
            return None
        if acceptance >= LOW_ACCEPTANCE:
            self.run = []
            return None
        self.run.append((acceptance, _number(record, "policy_lag_mean") or 0.0))
        if len(self.run) < self.n:
            return None
        step = int(record.get("step", 0))
        self.fired = {"kind": GATE_DROPS_MOST, "step": step, "updates": len(self.run), "message": self._message(step)}
        return self.fired["message"]

    def _message(self, step: int) -> str:
        first = step - len(self.run) + 1
        mean_acceptance = sum(a for a, _ in self.run) / len(self.run)
        empty = sum(1 for a, _ in self.run if a <= 0.0)
        lag = sum(g for _, g in self.run) / len(self.run)
        what = (f"the trust gate admitted less than {LOW_ACCEPTANCE:g} of the trajectories in each of updates "
                f"{first}-{step} (mean acceptance {mean_acceptance:.2f}"
                + (f", {empty} of them admitted none" if empty else "") + f"; policy lag {lag:.1f} on average)")
        if self.scaled:
            effect = ("each step is scaled by the acceptance (actor.scale_step_by_acceptance), so the run learns "
                      "little from most of its rollouts")
        else:
            effect = ("each update learns from the few trajectories left while its optimizer step moves the weights "
                      "as far as on a full batch")
        lines = [f"warning: {what}: {effect}. The run goes on."]
        if lag < ON_POLICY_LAG:
            lines.append("  the lag is about 0, so the drift is numerics (a bf16 learner against the engine reaches "
                         "0.06-0.07 in binary_kl on SmolLM2-135M): raise actor.flash_gate_delta above it, or train "
                         "the learner in float32 (fsdp.param_dtype fp32)")
        else:
            if not self.scaled:
                lines.append("  measured (docs/results.md, \"Staleness\"): in this regime the gate collapsed in 2 of 3 "
                             "seeds at a lag of 8; with each step scaled by the acceptance it held in 3 of 3")
            remedies = ([] if self.scaled else ["--actor.scale_step_by_acceptance true"]) + [
                "a shorter lag (train.async_queue_size, train.max_policy_lag)",
                "a lower learning rate (actor.adam.lr)",
                "the token-clip loss (--actor.loss_mode ppo --algo.advantage.estimator grpo, with one sample per "
                "prompt the batch is the group), which keeps every trajectory and bounds each token's ratio"]
            lines.append("  remedies: " + "; ".join(remedies))
        return "\n".join(lines)


def trust_gate_warnings(records: Iterable[Mapping[str, Any]], n: int, *, scaled: bool = False) -> list[dict[str, Any]]:
    """What :class:`TrustGateWatch` warned over ``records`` (a run's ``metrics.jsonl``): ``[]`` or one
    ``{"kind", "step", "updates", "message"}``."""
    return _replay(TrustGateWatch(n, scaled=scaled), records)
