"""What an agent rollout worker keeps per episode, and how it decides the sampling of a model call.

* :class:`AgentEpisode`: one agent episode in progress (its conversations, its token segments, its
  counters, the calls waiting for the engine, the running function);
* :func:`call_sampling`: the sampling settings a model call is served with, by
  ``rollout.agent_sampling``: ``run`` (the default) samples every call with the run's settings, so an
  agent written for OpenAI, which passes a ``temperature`` of its own, trains unchanged; ``agent``
  samples with the client's ``temperature`` / ``top_p``, and the tokens are still actions: the
  learner scores them at the run's temperature against the log-probabilities they were sampled
  with, and the trust gate admits or drops the trajectory (docs/environments.md);
* :func:`refusal_message`: the line that stops a run whose first agent episode was cut short by its
  turn or length limit, naming the flag to change.
"""

from __future__ import annotations

import concurrent.futures
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from flashreinforce.engines.base import GenerationRequest, SamplingParams
from flashreinforce.trainer.rollout.buffer import Ticket
from flashreinforce.trainer.rollout.fault_records import QuarantinedEpisode
from flashreinforce.trainer.rollout.trajectory import Trajectory

if TYPE_CHECKING:
    from flashreinforce.agents.chat import Conversations, Prompt
    from flashreinforce.agents.protocol import CallRequest
    from flashreinforce.agents.server import PendingCall
    from flashreinforce.agents.environment import AgentEnvironment

__all__ = ["AgentEpisode", "Call", "EPISODE_COUNTERS", "Segment", "call_sampling", "no_tokens_reason", "refusal_message",
           "sampling_warning"]

#: Counters of an episode, averaged per update as ``env/KEY``.
EPISODE_COUNTERS = ("agent_calls", "calls_with_tools", "tool_calls", "malformed_tool_calls", "history_rewrites",
                    "mismatched_renderings", "off_policy_calls", "refused_calls", "length_finishes")


@dataclass
class Segment:
    """The tokens of one conversation of an episode (one trajectory)."""

    tokens: list[int]
    mask: list[bool]
    logp: list[float]
    versions: list[int]
    calls: int = 0

    @staticmethod
    def context_only(ids: Sequence[int]) -> "Segment":
        n = len(ids)
        return Segment(list(ids), [False] * n, [0.0] * n, [-1] * n)

    def add(self, ids: Sequence[int], logp: Sequence[float] | None = None, versions: Sequence[int] | None = None) -> None:
        self.tokens.extend(int(t) for t in ids)
        acting = logp is not None
        self.mask.extend([acting] * len(ids))
        self.logp.extend(logp if acting else [0.0] * len(ids))
        self.versions.extend(versions if acting else [-1] * len(ids))


@dataclass
class Call:
    """A call being served: the pending request, its episode, the prompt and what goes to the engine."""

    pending: "PendingCall"
    episode: "AgentEpisode"
    prompt: "Prompt"
    request: GenerationRequest
    params: SamplingParams


class AgentEpisode:
    """One agent episode in progress (its conversations, counters and the running function).

    ``refusals``: the limits its refused calls ran into (``max_turns``, ``max_len``) and the first
    message of each, for the line that stops a run whose first episode was cut short."""

    def __init__(self, ticket: Ticket, sample_index: int, slot: int) -> None:
        self.ticket, self.sample_index, self.slot = ticket, sample_index, slot
        self.id = secrets.token_hex(12)
        self.token = ""  # the API key of its calls (the endpoint's, once the episode runs)
        self.env: AgentEnvironment | None = None
        self.conversations: Conversations | None = None
        self.segments: dict[int, Segment] = {}
        self.pending: list[PendingCall] = []
        self.counts = {k: 0 for k in EPISODE_COUNTERS}
        self.truncated = False
        self.refusals: dict[str, str] = {}
        self.future: concurrent.futures.Future | None = None
        self.last_activity = time.monotonic()
        self.done = False
        self.quarantined: QuarantinedEpisode | None = None
        self.result: list[Trajectory] = []


def call_sampling(request: "CallRequest", run: SamplingParams, mode: str) -> tuple[SamplingParams, bool]:
    """The sampling of one call, and whether the client asked for settings other than the run's.

    ``mode`` ``run``: the run's settings whatever the client asked; ``agent``: the client's
    ``temperature`` and ``top_p`` where it set them (the run's top-k and stop tokens stay)."""
    asked = SamplingParams(run.temperature if request.temperature is None else request.temperature,
                           run.top_p if request.top_p is None else request.top_p, run.top_k, run.stop_token_ids)
    differs = asked != run
    return (asked if mode == "agent" else run), differs


def sampling_warning(agent: str, request: "CallRequest", run: SamplingParams) -> str:
    """The one warning of a ``run``-mode worker the first time a client asks for other sampling settings."""
    asked = [f"{name} {value:g}" for name, value in (("temperature", request.temperature), ("top_p", request.top_p))
             if value is not None]
    return (f"agent {agent} asked for {' and '.join(asked)}; every model call is sampled with the run's "
            f"--rollout.temperature {run.temperature:g} and --rollout.top_p {run.top_p:g} (the values it trains at); "
            "the client's values are ignored (--rollout.agent_sampling agent uses them instead)")


def refusal_message(agent: str, limit: str, detail: str, max_turns: int, max_len: int) -> str:
    """One line for a run whose first agent episode was cut short by ``limit`` (``max_turns``, ``max_len``)."""
    if limit == "max_turns":
        return (f"the first episode of agent {agent} was cut short: it made more than {max_turns} model calls "
                f"(--rollout.max_turns {max_turns}); give a larger --rollout.max_turns")
    return (f"the first episode of agent {agent} was cut short: {detail}; give a larger --data.max_len "
            f"(now {max_len})")


def no_tokens_reason(agent: str, e: AgentEpisode, max_turns: int, max_len: int) -> str:
    """Why an episode that returned has nothing to train on, naming the cause and its flag."""
    if not e.counts["agent_calls"] and not e.refusals:
        return f"agent {agent} made no model call (nothing to train on)"
    if "max_len" in e.refusals:
        return f"every model call of agent {agent} was refused: {e.refusals['max_len']} (--data.max_len {max_len})"
    if "max_turns" in e.refusals:
        return f"every model call of agent {agent} was refused (--rollout.max_turns {max_turns})"
    return f"agent {agent} got no answer to any of its model calls (nothing to train on)"
