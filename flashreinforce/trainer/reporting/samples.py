"""Readable samples of the trajectories a run trains on: ``OUTPUT/samples.jsonl``.

Every ``logger.log_samples_steps`` updates (0: never) :class:`SampleLog` decodes a few trajectories
of the batch (``logger.log_samples_num``) and appends one JSON line per trajectory: the prompt,
every turn's action and observation text, reward, ``failed`` and its ``failure_kind``, truncation,
policy versions and lag, and the learner's per-trajectory statistics (``sequence_kl``, whether the
trust gate ``admitted`` it, ``retained`` tokens). Text is decoded only for those trajectories and
only on those updates, so the update path pays nothing otherwise. The file stays bounded: each text
is cut to ``max_chars`` characters (head and tail kept), and one update writes at most
``max_bytes`` bytes.

Which trajectories: the interesting ones first (one the trust gate dropped, one that failed, one
that succeeded), then the batch in order, so a few lines show both sides of the reward.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from flashreinforce.trainer.reporting.outcomes import failure_kind
from flashreinforce.trainer.rollout.trajectory import Trajectory

__all__ = ["SampleLog", "clip_text", "decode_turns", "pick_rows", "read_samples", "sample_record", "short_sample"]


def clip_text(text: str, max_chars: int) -> str:
    """``text`` cut to about ``max_chars`` characters: its head and tail around a marker that says
    how many characters were cut (both ends matter: the question and the final answer)."""
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    cut = len(text) - max_chars
    head = max_chars - max_chars // 2
    return f"{text[:head]}[... {cut} chars cut ...]{text[len(text) - max_chars // 2:]}"


def decode_turns(t: Trajectory, tokenizer) -> tuple[str, list[dict[str, str]]]:
    """``(prompt, turns)`` of trajectory ``t``: the text before the first action token, then per
    policy turn its ``action`` text and the ``observation`` text that followed (``""`` after the last).

    A turn is a maximal run of action tokens; the observation is the run of non-action tokens after it.
    """
    mask = t.action_mask
    n = len(t.token_ids)
    first = next((i for i, m in enumerate(mask) if m), n)
    prompt = tokenizer.decode(t.token_ids[:first])
    turns: list[dict[str, str]] = []
    i = first
    while i < n:
        j = i
        while j < n and mask[j]:
            j += 1
        k = j
        while k < n and not mask[k]:
            k += 1
        turns.append({"action": tokenizer.decode(t.token_ids[i:j]), "observation": tokenizer.decode(t.token_ids[j:k])})
        i = k
    return prompt, turns


def pick_rows(trajectories: Sequence[Trajectory], per_trajectory: Mapping[str, Sequence[float]], k: int) -> list[int]:
    """Up to ``k`` batch rows to show, in this order: one the trust gate dropped, one failed, one
    succeeded (when there are such), then the others in batch order."""
    n = len(trajectories)
    admitted = per_trajectory.get("admitted")
    chosen: list[int] = []

    def take(pred) -> None:
        if len(chosen) < k:
            row = next((i for i in range(n) if i not in chosen and pred(i)), None)
            if row is not None:
                chosen.append(row)

    if admitted is not None:
        take(lambda i: admitted[i] <= 0.5)
    take(lambda i: trajectories[i].failed)
    take(lambda i: not trajectories[i].failed)
    rest = [i for i in range(n) if i not in chosen][:max(0, k - len(chosen))]
    return chosen + rest  # in this order, so the byte cap leaves out the least interesting ones


def _plain_info(info: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON-friendly scalar entries of a trajectory's ``info``."""
    return {k: v for k, v in info.items() if isinstance(v, (str, int, float, bool)) or v is None}


def sample_record(t: Trajectory, tokenizer, *, step: int, row: int, learner_version: int,
                  stats: Mapping[str, float] | None = None, max_chars: int = 1000,
                  decoded: tuple[str, list[dict[str, str]]] | None = None) -> dict[str, Any]:
    """One ``samples.jsonl`` line for trajectory ``t`` (batch row ``row``) of update ``step``.

    ``learner_version``: the policy version the batch was trained against (for the lag);
    ``stats``: the learner's per-trajectory statistics of this row (``admitted`` becomes a bool);
    ``decoded``: :func:`decode_turns` of ``t`` when already done.
    """
    prompt, turns = decoded if decoded is not None else decode_turns(t, tokenizer)
    record: dict[str, Any] = {
        "step": step, "row": row, "prompt_id": t.prompt_id, "seed": t.seed, "sample_index": t.sample_index,
        "prompt": clip_text(prompt, max_chars),
        "turns": [{"action": clip_text(x["action"], max_chars), "observation": clip_text(x["observation"], max_chars)}
                  for x in turns],
        "reward": t.reward, "failed": t.failed, "failure_kind": failure_kind(t), "truncated": t.truncated,
        "policy_version_min": t.policy_version_min, "policy_version_max": t.policy_version_max,
        "policy_lag": t.policy_lag(learner_version), "num_tokens": t.num_tokens,
        "action_tokens": t.num_action_tokens, "worker_id": t.worker_id,
    }
    for name, value in (stats or {}).items():
        record[name] = bool(value > 0.5) if name == "admitted" else float(value)
    record["info"] = _plain_info(t.info)
    return record


def short_sample(record: Mapping[str, Any], width: int = 160) -> str:
    """One console line for a sample: prompt, the actions (observations elided), reward.

    When it must be cut, the prompt keeps its end (a chat template puts the system text first and the
    user's question last, right before the answer) and the actions keep their head and tail; the
    reward and the failure kind are always shown."""
    def flat(text: str) -> str:
        return " ".join(text.split())

    actions = " | ".join(flat(x["action"]) for x in record["turns"])
    kind = f", {record['failure_kind']}" if record.get("failure_kind") else ""
    gate = "" if "admitted" not in record else (", admitted" if record["admitted"] else ", dropped by the trust gate")
    outcome = f" (reward {record['reward']:.3g}{kind}{gate})"
    prompt = flat(record["prompt"])
    room = max(40, width - len(outcome) - 10)  # the quotes and the arrow
    budget = max(room // 3, room - len(prompt))
    if len(actions) > budget:
        actions = clip_text(actions, max(8, budget - 24))  # the marker clip_text adds is about 24 characters
    keep = room - len(actions)
    if len(prompt) > keep:
        marker = f"[{len(prompt) - keep} chars cut] "
        prompt = marker + prompt[len(prompt) - max(0, keep - len(marker)):]
    return f"{prompt!r} -> {actions!r}{outcome}"


class SampleLog:
    """Writes sampled trajectories to ``OUTPUT/samples.jsonl`` every ``every`` updates.

    Args:
        out: the run directory.
        tokenizer: the run's tokenizer (``decode``).
        every: updates between sample steps (0: never; nothing is decoded).
        per_update: trajectories written per sample step.
        max_chars: characters kept of each text (prompt, action, observation).
        max_bytes: bytes written per sample step at most (a record that does not fit is written
            with shorter texts, or left out).
        initial_step: the step a resumed run continues from: lines of later steps (written after
            the checkpoint) are dropped, as ``metrics.jsonl`` is trimmed.
    """

    def __init__(self, out: str | Path, tokenizer, *, every: int, per_update: int = 4, max_chars: int = 1000,
                 max_bytes: int = 32768, initial_step: int = 0) -> None:
        if every < 0 or per_update <= 0 or max_bytes <= 0:
            raise ValueError(f"SampleLog: every must be >= 0, per_update and max_bytes positive "
                             f"(got {every}, {per_update}, {max_bytes})")
        self.path = Path(out) / "samples.jsonl"
        self.tokenizer = tokenizer
        self.every = every
        self.per_update = per_update
        self.max_chars = max_chars
        self.max_bytes = max_bytes
        self.bytes_written = 0
        if initial_step and self.path.is_file():
            _trim(self.path, initial_step)

    def due(self, step: int) -> bool:
        """Whether update ``step`` writes samples."""
        return self.every > 0 and step % self.every == 0

    def write(self, step: int, trajectories: Sequence[Trajectory], per_trajectory: Mapping[str, Sequence[float]],
              learner_version: int) -> list[dict[str, Any]]:
        """Append the samples of update ``step`` (call only when :meth:`due`); returns the records written.

        ``per_trajectory``: the learner's statistics by batch row (may be empty).
        """
        trajs = list(trajectories)
        records: list[dict[str, Any]] = []
        lines: list[str] = []
        budget = self.max_bytes
        for row in pick_rows(trajs, per_trajectory, self.per_update):
            stats = {name: values[row] for name, values in per_trajectory.items() if row < len(values)}
            line = None
            decoded = decode_turns(trajs[row], self.tokenizer)
            # Long multi-turn episodes: try shorter texts before leaving the sample out.
            for chars in (self.max_chars, min(self.max_chars, 200), 40):
                record = sample_record(trajs[row], self.tokenizer, step=step, row=row, learner_version=learner_version,
                                       stats=stats, max_chars=chars, decoded=decoded)
                text = _json_line(record)
                if len(text.encode()) <= budget:
                    line = text
                    break
            if line is None:
                break
            budget -= len(line.encode())
            records.append(record)
            lines.append(line)
        if lines:
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.writelines(lines)
            self.bytes_written += self.max_bytes - budget
        return records


def _json_line(record: Mapping[str, Any]) -> str:
    """``record`` as one JSON line of UTF-8 text: a lone surrogate (text no UTF-8 encoder takes,
    which an environment or a tokenizer may hand over) is written as its JSON escape."""
    text = json.dumps(record, ensure_ascii=False)
    return text.encode("utf-8", "backslashreplace").decode("utf-8") + "\n"


def _trim(path: Path, step: int) -> None:
    """Keep the lines of ``path`` whose ``step`` is at most ``step``."""
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if int(json.loads(line)["step"]) <= step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by a crash
    path.write_text("".join(kept), encoding="utf-8")


def read_samples(run_dir: str | Path, *, step: int | None = None, failed: bool | None = None) -> list[dict[str, Any]]:
    """The records of ``RUN_DIR/samples.jsonl`` (empty when there is none), optionally only those of
    update ``step`` and/or with ``failed`` equal to the given value."""
    path = Path(run_dir) / "samples.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        if step is not None and record.get("step") != step:
            continue
        if failed is not None and record.get("failed") != failed:
            continue
        out.append(record)
    return out
