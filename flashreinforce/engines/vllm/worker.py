"""What runs inside vLLM's worker process: loading a weight version in place.

:class:`WeightUpdateExtension` is given to vLLM as ``worker_extension_cls`` (vLLM's public hook for
methods called on its workers through ``LLM.collective_rpc``). Each method takes plain values only
(vLLM serializes RPC arguments itself; a tensor would not survive it), so weights never travel
through the RPC: the call carries a manifest and the worker reads the tensors from memory both
processes share.

* CPU (:meth:`flashreinforce_load_shared`): a shared-memory file written by the trainer
  (:mod:`flashreinforce.engines.vllm.shared_weights`), mapped once and read as views.
* CUDA (:meth:`flashreinforce_load_cuda_ipc`): one device buffer of the trainer's, opened through a
  CUDA IPC handle (``torch.multiprocessing``'s reduction of a CUDA tensor, keyed by the GPU's UUID so
  that a different ``CUDA_VISIBLE_DEVICES`` numbering in the worker finds the same device), opened
  once and read as views: a device-to-device copy, no host round trip.

Imported in a vLLM process started by a trainer (``FLASHREINFORCE_TRAINER_PID`` set), the module
also starts :func:`watch_trainer`: when that trainer is gone (killed outright, so it could not end
vLLM's processes itself) it removes the trainer's files from shared memory, ends the EngineCore
process that started this one, and ends this process.

Either way the views reach the model one of two ways. On a CPU, by default, straight into vLLM's CPU
kernels (:func:`~flashreinforce.engines.vllm.weights.load_direct`: each layer's packed kernel built by
vLLM's own processing from the shared tensors, no other copy); elsewhere, or for a model that path does
not know, through vLLM's own in-place reload (Hugging Face names; vLLM fuses projections and re-runs
each layer's weight processing itself). This module imports no vLLM and runs in the trainer's process
only for tests.
"""

from __future__ import annotations

import base64
import logging
import os
import pickle
import signal
import threading
import time
from typing import Any

import torch

from flashreinforce.engines.vllm.shared_weights import map_shared, read_manifest, views_of
from flashreinforce.engines.vllm.process import TRAINER_PID_VAR, proc_stat, remove_files_of
from flashreinforce.engines.vllm.weights import load_direct

__all__ = ["WeightUpdateExtension", "load_named", "open_cuda_buffer", "watch_trainer"]

_CUDA_BUFFERS: dict[str, torch.Tensor] = {}


def open_cuda_buffer(key: str, handles_b64: str) -> torch.Tensor:
    """The trainer's CUDA buffer behind ``handles_b64`` (base64 of a pickled ``{gpu uuid: reduction
    args}``), opened once per ``key`` on this process's device with that UUID."""
    buf = _CUDA_BUFFERS.get(key)
    if buf is not None:
        return buf
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    handles = pickle.loads(base64.b64decode(handles_b64))
    for index in range(torch.cuda.device_count()):
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        if uuid in handles:
            args = list(handles[uuid])
            args[6] = index  # the device index of torch's CUDA reduction, renumbered for this process
            _CUDA_BUFFERS.clear()
            buf = rebuild_cuda_tensor(*args)
            _CUDA_BUFFERS[key] = buf
            return buf
    raise RuntimeError(f"CUDA IPC weight buffer: none of the GPUs {sorted(handles)} is visible to this vLLM worker")


def _reset_derived_state(runner: Any) -> None:
    """What vLLM's reload resets after new weights (state computed from the old ones), where it exists."""
    for name in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
        reset = getattr(runner, name, None)
        if callable(reset):
            reset()


def load_named(worker: Any, weights: list[tuple[str, torch.Tensor]], direct: bool = True) -> list:
    """Load ``weights`` (Hugging Face names) into the model of vLLM ``worker``, in place.

    On a CPU with ``direct``: into vLLM's CPU kernels without its reload
    (:func:`~flashreinforce.engines.vllm.weights.load_direct`), where that path knows the model.
    Otherwise through the worker's ``reload_weights`` where it has one: vLLM re-runs each layer's weight
    processing after loading (its CPU build repacks linear weights for its GEMM kernels, so copying
    into the parameters alone would not reach the kernels); else the model's ``load_weights``.
    Returns ``[tensors loaded, "direct" or "reload"]``.
    """
    dev = getattr(worker, "device", None)
    dev = torch.device(dev) if dev is not None else None
    runner = getattr(worker, "model_runner", None)
    if direct and (dev is None or dev.type == "cpu") and runner is not None:
        if load_direct(runner.model, weights):
            _reset_derived_state(runner)
            return [len(weights), "direct"]
    if dev is not None:
        weights = [(n, t if t.device == dev else t.to(dev, non_blocking=True)) for n, t in weights]
    reload = getattr(worker, "reload_weights", None)
    if callable(reload):
        # Its layer-by-layer reload warns once per update about every layer that has no weights of its
        # own to load (rotary embeddings): expected here, so only errors are shown.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        reload(weights_iterator=iter(weights), is_checkpoint_format=True)
    else:
        worker.model_runner.model.load_weights(weights=weights)
    if dev is not None and dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return [len(weights), "reload"]


class WeightUpdateExtension:
    """Methods vLLM mixes into its worker (``worker_extension_cls``); called through ``collective_rpc``.

    ``self.model_runner`` and ``self.device`` are the vLLM worker's own attributes.
    """

    def flashreinforce_load_shared(self, manifest: dict, direct: bool = True) -> list:
        """Load the tensors a shared-memory manifest lists; returns how many were loaded and how (``direct``:
        see :func:`load_named`)."""
        return load_named(self, read_manifest(manifest), direct)

    def flashreinforce_map_shared(self, path: str, size: int) -> int:
        """Map the trainer's weight buffer ahead of its first version and touch every page of it, so that
        the first load reads pages already mapped; returns the bytes mapped."""
        return map_shared(path, size)

    def flashreinforce_load_cuda_ipc(self, key: str, handles_b64: str, entries: list) -> list:
        """Load the tensors ``entries`` lists from the trainer's CUDA buffer (opened once per ``key``)."""
        buf = open_cuda_buffer(key, handles_b64)
        return load_named(self, views_of(buf, entries))

    def flashreinforce_parameter_sum(self) -> float:
        """Sum of every parameter (float64), to check from outside that new weights arrived."""
        return float(sum(p.detach().double().sum() for p in self.model_runner.model.parameters()))


def watch_trainer(poll_s: float = 1.0) -> threading.Thread | None:
    """In a process of vLLM's started by a trainer: a thread that, once that trainer has ended, removes
    its files (:func:`~flashreinforce.engines.vllm.process.remove_files_of`), kills the EngineCore
    process between the two (this process's parent, when that is not the trainer) and exits. ``None``
    in the trainer itself, or where no trainer is named."""
    value = os.environ.get(TRAINER_PID_VAR, "")
    if not value.isdigit() or int(value) == os.getpid():
        return None
    trainer = int(value)
    fields = proc_stat(trainer)
    if fields is None:
        return None
    started = fields[19]  # with the id, what tells the trainer from a later process given its id
    parent = os.getppid()
    engine_core = parent if parent != trainer else None

    def trainer_alive() -> bool:
        now = proc_stat(trainer)
        return now is not None and now[19] == started and now[0] not in ("Z", "X")

    def run() -> None:
        while trainer_alive():
            time.sleep(poll_s)
        try:
            remove_files_of(trainer)
        finally:
            if engine_core is not None:
                try:
                    os.kill(engine_core, signal.SIGKILL)
                except OSError:
                    pass
            os._exit(0)

    thread = threading.Thread(target=run, name="flashreinforce-trainer-watch", daemon=True)
    thread.start()
    return thread


#: The thread watching the trainer that started this vLLM process (None elsewhere).
_TRAINER_WATCH = watch_trainer()
