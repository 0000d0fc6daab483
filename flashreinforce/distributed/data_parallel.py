"""The data-parallel learner: one batch, split by tokens over ``torch.distributed`` ranks, one update.

Launch with ``torchrun`` (gloo on CPU, NCCL on GPU; :func:`distributed_context` reads
``WORLD_SIZE`` / ``RANK`` / ``LOCAL_RANK``). Rank 0 *leads*: it owns the rollout side (buffer,
workers, evaluation, checkpoints, metrics) and, for each batch, sends every rank its share;
the other ranks *follow* (:meth:`DataParallelLearner.serve`) and only compute gradients.

One update on a batch of B trajectories:

1. rank 0 computes the batch totals once (:func:`~flashreinforce.trainer.learning.learner.batch_totals`: B, the
   float64 mean reward used as the baseline, the policy-token count, GRPO group advantages) and
   partitions the trajectories over the ranks balanced by tokens (:func:`partition_by_tokens`);
   one ``scatter_object_list`` hands each rank its trajectories, their batch rows and the totals;
2. each rank packs its share into micro-batches and runs forward/backward with the fused loss
   given the *global* baseline and B, so the per-rank losses (and gradients) are summands of the
   whole batch's (docs/semantics.md: any partition of a batch adds up to the batch);
3. gradients are **summed** over ranks (all-reduce; FSDP2: reduce-scatter with divide factor 1), which
   is the gradient of the whole batch's loss, not an average: the loss already divides by B;
4. every rank clips by the global norm and makes the same optimizer step; parameters stay equal
   (``replicate``) or each rank updates its shard (``fully_shard``);
5. rank 0 gathers the per-trajectory statistics for the metrics.

An error on any rank (a non-finite importance ratio, invalid input) is agreed on by all ranks
before the gradient reduction, so every rank skips the update together instead of deadlocking.

Strategies:

* ``replicate`` (default): each rank holds the whole model and optimizer; gradients are summed
  with bucketed all-reduces after the last micro-batch (no overlap with the backward pass).
* ``fully_shard``: FSDP2 (``torch.distributed.fsdp.fully_shard``) on every decoder layer and on the
  :class:`~flashreinforce.trainer.learning.scoring.PolicyLogProbs` root, for models that do not fit one device.
  Parameters, gradients and optimizer moments are sharded; every rank runs the same number of
  forward passes (ranks with fewer micro-batches run zero-gradient placeholder passes), since each
  forward gathers parameters collectively. Full weights for publication and checkpoints are
  gathered to rank 0 on request (:meth:`DataParallelLearner.policy_state`).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from flashreinforce.models.lora import frozen_state_names
from flashreinforce.ops.loss_modes import admitted_mask
from flashreinforce.trainer.learning.flops import utilization
from flashreinforce.trainer.learning.learner import (GradientParts, Learner, LearnerSettings, batch_totals,
                                                     summarize_parts)
from flashreinforce.trainer.learning.scoring import PolicyLogProbs
from flashreinforce.trainer.rollout.trajectory import Trajectory

__all__ = ["STRATEGIES", "DataParallelLearner", "DistContext", "distributed_context", "partition_by_tokens"]

log = logging.getLogger(__name__)

STRATEGIES = ("replicate", "fully_shard")

#: Elements per all-reduce bucket (float32: 128 MiB), so the flat copy never holds all gradients at once.
BUCKET_ELEMENTS = 2**25


@dataclass
class DistContext:
    """This process's place in the ``torch.distributed`` job.

    rank / world_size / local_rank: from torchrun's environment. device: this rank's device
    (``cuda:LOCAL_RANK`` on GPUs). backend: ``nccl`` on CUDA, ``gloo`` otherwise.
    started: this process called ``init_process_group`` (and so destroys it in :meth:`close`).
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    started: bool

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        """Leave the job: wait for every rank, then destroy the process group if this process made it."""
        if self.started and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def distributed_context(device: str = "auto") -> DistContext | None:
    """Join the ``torch.distributed`` job torchrun started, or ``None`` when running alone.

    ``device``: ``auto`` (``cuda:LOCAL_RANK`` when CUDA is available, else ``cpu``), ``cpu``, or
    ``cuda`` (this rank's ``cuda:LOCAL_RANK``). An explicit ``cuda:N`` is refused with several ranks
    per node, since ranks would share a device.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        dev = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    else:
        dev = torch.device(device)
        if dev.type == "cuda":
            if dev.index is not None and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
                raise ValueError(f"--device {device}: under torchrun each rank uses cuda:LOCAL_RANK; give --device cuda")
            dev = torch.device(f"cuda:{local_rank}")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    started = False
    if not dist.is_initialized():
        dist.init_process_group(backend, device_id=dev if dev.type == "cuda" else None)
        started = True
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                       device=dev, backend=dist.get_backend(), started=started)


def partition_by_tokens(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Split indices ``0..len(lengths)-1`` into ``parts`` lists with balanced token sums.

    Longest first, each to the part with the fewest tokens so far (ties: the lower part); each
    part's indices in ascending order. Deterministic, so every rank could recompute it. Parts may
    be empty when there are fewer items than parts.
    """
    if parts <= 0:
        raise ValueError(f"parts must be positive, got {parts}")
    load = [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda k: (-int(lengths[k]), k)):
        p = min(range(parts), key=lambda r: (load[r], r))
        out[p].append(i)
        load[p] += int(lengths[i])
    return [sorted(p) for p in out]


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a ``transformers`` causal LM (``model.<body>.layers``)."""
    body = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    layers = getattr(body, "layers", None) or getattr(body, "h", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find its decoder layers to shard (expected .layers or .h)")
    return list(layers)


def _fully_shard(scorer: PolicyLogProbs) -> torch.nn.Module:
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for layer in _decoder_layers(scorer.model):
        fully_shard(layer)
    fully_shard(scorer)
    for m in scorer.modules():
        if isinstance(m, FSDPModule):
            # The per-rank losses are summands of the batch loss: sum the gradients, never average.
            # Plain SUM reductions (no NCCL PreMulSum), which gloo supports too.
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return scorer


def _broadcast_module(module: torch.nn.Module, src: int = 0) -> None:
    """Make every rank's parameters and buffers equal to rank ``src``'s (DDP does the same at start)."""
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=src)


def _all_reduce_gradients(params: Sequence[torch.nn.Parameter]) -> None:
    """Sum every parameter's gradient over the ranks (a missing gradient counts as zeros)."""
    bucket: list[torch.nn.Parameter] = []
    size = 0

    def flush() -> None:
        nonlocal bucket, size
        if not bucket:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket])
        dist.all_reduce(flat)
        offset = 0
        for p in bucket:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n
        bucket, size = [], 0

    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    for group in by_dtype.values():
        for p in group:
            if size + p.numel() > BUCKET_ELEMENTS:
                flush()
            bucket.append(p)
            size += p.numel()
        flush()


class DataParallelLearner:
    """A :class:`~flashreinforce.trainer.learning.learner.Learner` across the ranks of ``ctx`` (see the
    module docstring); implements :class:`~flashreinforce.trainer.learning.learner.PolicyLearner` on rank 0.

    Every rank builds it the same way, with the same model (rank 0's parameters are broadcast).
    Rank 0 calls :meth:`step`, :meth:`policy_state`, :meth:`state_dict` and finally :meth:`stop`;
    the other ranks call :meth:`serve`, which answers those calls until :meth:`stop`.

    Args:
        model: the policy on ``ctx.device`` (float32 master weights).
        settings: the learner settings (identical on every rank).
        ctx: :func:`distributed_context`'s result.
        pad_token_id: padding id of the padded forward.
        strategy: ``replicate`` or ``fully_shard``.
    """

    def __init__(self, model: torch.nn.Module, settings: LearnerSettings, ctx: DistContext, *,
                 pad_token_id: int = 0, strategy: str = "replicate") -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.ctx = ctx
        self.strategy = strategy
        _broadcast_module(model)
        parallelize = _fully_shard if strategy == "fully_shard" else None
        self.learner = Learner(model, settings, pad_token_id=pad_token_id, parallelize=parallelize)
        self.settings = settings
        self.model = model
        self.loss_impl = self.learner.loss_impl

    # ------------------------------------------------------------------ shared state
    @property
    def version(self) -> int:
        return self.learner.version

    @version.setter
    def version(self, value: int) -> None:
        self.learner.version = value

    @property
    def optimizer(self):
        return self.learner.optimizer

    @property
    def scheduler(self):
        return self.learner.scheduler

    @property
    def sharded(self) -> bool:
        return self.strategy == "fully_shard"

    # ------------------------------------------------------------------ leader side
    def _send(self, command: str, per_rank: Sequence[Any] | None = None) -> Any:
        """Rank 0: hand ``(command, per_rank[r])`` to every rank r; returns rank 0's own payload."""
        if not self.ctx.is_leader:
            raise RuntimeError("only rank 0 sends commands; other ranks call serve()")
        payloads = [(command, None if per_rank is None else per_rank[r]) for r in range(self.ctx.world_size)]
        out: list[Any] = [None]
        dist.scatter_object_list(out, payloads, src=0)
        return out[0][1]

    def step(self, trajectories: Sequence[Trajectory], group_ids: Sequence[int] | None = None) -> dict[str, float]:
        """Rank 0: one update on the whole batch ``trajectories``; returns the batch's metrics, plus
        ``rank_tokens_max`` / ``rank_tokens_min`` (tokens of the most and least loaded rank).

        Same contract as :meth:`Learner.step`: ``FloatingPointError`` (on every rank) when the update
        is skipped, with weights and version unchanged.
        """
        t0 = time.perf_counter()
        trajectories = list(trajectories)
        totals = batch_totals(trajectories, group_ids, self.settings)
        shards = partition_by_tokens([t.num_tokens for t in trajectories], self.ctx.world_size)
        rank_tokens = [sum(trajectories[i].num_tokens for i in s) for s in shards]
        per_rank = [{"trajectories": [trajectories[i] for i in s], "rows": s, "totals": totals} for s in shards]
        mine = self._send("step", per_rank)
        metrics = self._step(mine)
        metrics.update(learner_compute_s=time.perf_counter() - t0, rank_tokens_max=max(rank_tokens),
                       rank_tokens_min=min(rank_tokens))
        metrics.update(utilization(metrics["model_flops"], metrics["learner_compute_s"], self.learner.peak_flops,
                                   self.ctx.world_size))
        return metrics

    def policy_state(self) -> dict[str, Tensor]:
        """Rank 0: the full current weights (Hugging Face names). Gathered from the shards under
        ``fully_shard`` (a collective: every rank takes part through :meth:`serve`)."""
        if not self.sharded:
            return self.learner.policy_state()
        self._send("policy_state")
        return self._policy_state()

    def frozen_names(self) -> set[str]:
        """Names of :meth:`policy_state` that never change (the parameters that do not train)."""
        return frozen_state_names(self.model)

    def full_model(self, device: torch.device | str = "cpu") -> torch.nn.Module:
        """Rank 0: an unsharded copy of the current policy (float32 on ``device``). Under
        ``fully_shard`` the weights are gathered from every rank first (a collective)."""
        if not self.sharded:
            return self.learner.full_model(device)
        import transformers

        state = self.policy_state()
        # A config of its own: from_config keeps the object it is given, and an engine may switch its
        # copy's attention implementation, which must not switch the learner's.
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(self.model.config)).to(dtype=torch.float32)
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
        if [k for k in missing if k not in tied] or unexpected:
            raise RuntimeError(f"gathered weights do not match the model: missing {missing[:5]}, unexpected "
                               f"{unexpected[:5]}")
        return self.learner.with_engine_attention(model.to(device))

    def state_dict(self) -> dict:
        """Rank 0: optimizer, scheduler and version for a checkpoint. Under ``fully_shard`` the
        optimizer state is gathered in full (keyed by parameter name) to rank 0."""
        if not self.sharded:
            return self.learner.state_dict()
        self._send("optimizer_state")
        return self._optimizer_state()

    def stop(self) -> None:
        """Rank 0: release the other ranks from :meth:`serve`."""
        self._send("stop")

    # ------------------------------------------------------------------ every rank
    def load_state_dict(self, state: dict) -> None:
        """Every rank (collective under ``fully_shard``): restore optimizer, scheduler and version."""
        if not self.sharded:
            self.learner.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        if state.get("optimizer_format") != "fsdp_full":
            from flashreinforce.config import ConfigError

            raise ConfigError("--resume: this checkpoint's optimizer state was not written by a fully_shard "
                              "learner; resume it with --fsdp.strategy replicate (or in one process)")
        set_optimizer_state_dict(self.learner.scorer, self.learner.optimizer, state["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
        self.learner.scheduler.load_state_dict(state["scheduler"])
        from flashreinforce.trainer.learning.schedule import apply_settings

        apply_settings(self.learner.optimizer, self.learner.scheduler, self.learner.settings)
        self.learner.version = int(state["version"])
        self.learner.optimizer_steps_skipped = int(state.get("optimizer_steps_skipped", 0))

    def serve(self) -> int:
        """Ranks > 0: answer rank 0's commands until :meth:`stop`; returns the number of updates made."""
        if self.ctx.is_leader:
            raise RuntimeError("rank 0 leads; serve() is for the other ranks")
        updates = 0
        while True:
            out: list[Any] = [None]
            dist.scatter_object_list(out, None, src=0)
            command, payload = out[0]
            if command == "stop":
                return updates
            if command == "step":
                try:
                    self._step(payload)
                    updates += 1
                except FloatingPointError as err:  # skipped on every rank alike
                    log.warning("rank %d: update skipped: %s", self.ctx.rank, err)
            elif command == "policy_state":
                self._policy_state()
            elif command == "optimizer_state":
                self._optimizer_state()
            else:
                raise RuntimeError(f"rank {self.ctx.rank}: unknown command {command!r} from rank 0")

    # ------------------------------------------------------------------ collective pieces
    def _step(self, payload: dict) -> dict[str, float]:
        learner = self.learner
        trajs, rows, totals = payload["trajectories"], payload["rows"], payload["totals"]
        learner.optimizer.zero_grad(set_to_none=True)
        num_mb = None
        if self.sharded:
            n = torch.tensor([learner.num_micro_batches(trajs)], dtype=torch.int64, device=self._comm_device)
            dist.all_reduce(n, op=dist.ReduceOp.MAX)
            num_mb = int(n)
        error: BaseException | None = None
        parts = GradientParts(rows=list(rows))
        try:
            parts = learner.accumulate_gradient_parts(trajs, totals, rows=rows, num_micro_batches=num_mb,
                                                      collective_forwards=self.sharded)
        except (FloatingPointError, ValueError, RuntimeError) as err:
            error = err
        if parts.error is not None:
            error = parts.error
        # Agree on failure before any gradient collective, so no rank waits for one that gave up.
        kind = 0 if error is None else (1 if isinstance(error, FloatingPointError) else 2)
        flag = torch.tensor([kind], dtype=torch.int64, device=self._comm_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag) != 0:
            learner.optimizer.zero_grad(set_to_none=True)
            messages: list[Any] = [None] * self.ctx.world_size
            dist.all_gather_object(messages, None if error is None else f"rank {self.ctx.rank}: {error!r}")
            text = "; ".join(m for m in messages if m)
            if int(flag) == 1:
                raise FloatingPointError(f"update skipped on every rank: {text}")
            raise RuntimeError(f"learner step failed: {text}")
        if not self.sharded:
            _all_reduce_gradients([p for p in learner.scorer.parameters() if p.requires_grad])
        scale = 1.0
        if learner.settings.scale_step_by_acceptance:  # the whole batch's acceptance, before the step
            count = torch.tensor([float(admitted_mask(parts.per_trajectory).sum())], dtype=torch.float64,
                                 device=self._comm_device)
            dist.all_reduce(count)
            scale = float(count) / max(1, totals.num_trajectories)
        applied = learner.apply_gradients(lr_scale=scale)
        gathered: list[Any] = [None] * self.ctx.world_size if self.ctx.is_leader else None
        dist.gather_object(parts, gathered, dst=0)
        if not self.ctx.is_leader:
            return applied
        metrics = summarize_parts(gathered, totals, self.settings)
        metrics.update(applied)
        return metrics

    @property
    def _comm_device(self) -> torch.device:
        return self.ctx.device if self.ctx.backend == "nccl" else torch.device("cpu")

    def _policy_state(self) -> dict[str, Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.learner.scorer, options=StateDictOptions(full_state_dict=True,
                                                                                  cpu_offload=True))
        prefix = "model."
        return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in full.items()}

    def _optimizer_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        full = get_optimizer_state_dict(self.learner.scorer, self.learner.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {"optimizer": full, "optimizer_format": "fsdp_full", "scheduler": self.learner.scheduler.state_dict(),
                "version": self.learner.version, "optimizer_steps_skipped": self.learner.optimizer_steps_skipped}
