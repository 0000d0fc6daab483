"""``auto`` dtypes are chosen by the machine: bf16 only where it is native and measurably faster."""

from __future__ import annotations

import pytest

from flashreinforce import dtypes
from flashreinforce.config import TrainerConfig
from flashreinforce.trainer.run import components


@pytest.fixture(autouse=True)
def _fresh_choice(monkeypatch):
    monkeypatch.setattr(dtypes, "_AUTO_CHOICE", {})


def test_a_cpu_without_native_bf16_gets_float32_without_a_probe(monkeypatch):
    monkeypatch.setattr(dtypes, "cpu_computes_bf16", lambda: False)
    monkeypatch.setattr(dtypes, "_bf16_probe_speedup", lambda: pytest.fail("no probe without native bf16"))
    name, why = dtypes.resolve_auto_dtype("cpu")
    assert name == "float32" and "no native bf16" in why


@pytest.mark.parametrize("speedup, want", [(3.0, "bfloat16"), (1.02, "float32")])
def test_a_cpu_with_native_bf16_follows_the_probe(monkeypatch, speedup, want):
    monkeypatch.setattr(dtypes, "cpu_computes_bf16", lambda: True)
    calls = []
    monkeypatch.setattr(dtypes, "_bf16_probe_speedup", lambda: calls.append(1) or speedup)
    assert dtypes.resolve_auto_dtype("cpu")[0] == want
    assert dtypes.resolve_auto_dtype("cpu")[0] == want and len(calls) == 1  # decided once per process


def test_the_probe_times_the_same_gemm_in_float32_and_under_bf16_autocast():
    """The probe's ratio is float32 time over bf16 time of one learner-sized product: it must run that
    product both ways (a warm-up and five timed runs each), not only return a positive number."""
    import math

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class MatrixProducts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.mm.default:
                self.seen.append(tuple((a.dtype, tuple(a.shape)) for a in args))
            return func(*args, **(kwargs or {}))

    with MatrixProducts() as products:
        speedup = dtypes._bf16_probe_speedup()
    assert math.isfinite(speedup) and speedup > 0
    shapes = ((512, 1024), (1024, 2048))
    # one first call of each, then 15 of each interleaved
    assert products.seen.count(tuple((torch.float32, s) for s in shapes)) == 16
    assert products.seen.count(tuple((torch.bfloat16, s) for s in shapes)) == 16
    assert len(products.seen) == 32
    kinds = [dtype for (dtype, _), _ in products.seen]
    assert kinds[2:] == [torch.float32, torch.bfloat16] * 15


def test_explicit_names_pass_through_and_auto_follows_the_learner_for_the_engines(monkeypatch):
    monkeypatch.setattr(dtypes, "cpu_computes_bf16", lambda: False)
    assert dtypes.resolve_dtype("bf16", "cpu") == "bfloat16"
    cfg = TrainerConfig.from_preset("arith")
    assert cfg.fsdp.param_dtype == "auto" and cfg.rollout.engine_dtype == "auto"
    assert components.engine_dtype(cfg, "cpu") == "float32"
    assert components.learner_settings(cfg, 10, "cpu").param_dtype == "float32"
    notes = components.dtype_notes(cfg, "cpu")
    assert len(notes) == 1 and "fsdp.param_dtype and rollout.engine_dtype auto: float32" in notes[0]
    cfg.rollout.engine_dtype = "bf16"
    assert components.engine_dtype(cfg, "cpu") == "bfloat16"
