"""One definition each: the fused op and the reference share their signatures, defaults, output
names and argument rules (flashreinforce/ops/contract.py); ``flashreinforce.ops`` stays free of
trainer and transformers imports."""

from __future__ import annotations

import inspect
import math
import subprocess
import sys
import textwrap

import pytest
import torch

from flashreinforce.objective import LossOptions
from flashreinforce.ops import contract, fused, reference


@pytest.mark.parametrize("name", ["flashreinforce_loss_packed", "flashreinforce_loss"])
def test_fused_and_reference_signatures_agree_exactly(name):
    fused_sig = inspect.signature(getattr(fused, name))
    reference_sig = inspect.signature(getattr(reference, name))
    described = [[(p.name, p.kind, p.default, p.annotation) for p in sig.parameters.values()]
                 for sig in (fused_sig, reference_sig)]
    assert described[0] == described[1]
    assert fused_sig.return_annotation == reference_sig.return_annotation
    # The keyword-only parameters are the contract's, in its order, with its defaults.
    keywords = [p for p in fused_sig.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert tuple(p.name for p in keywords) == contract.KEYWORDS
    assert all(p.default == getattr(contract.DEFAULTS, p.name) for p in keywords)


def test_capturable_variant_takes_exactly_the_contract_keywords():
    lp = torch.full((4,), -0.5)
    args = (lp, lp - 0.01, torch.tensor([1.0, 0.0]), torch.tensor([0, 2, 4]))
    with pytest.raises(TypeError, match="unexpected keyword"):
        fused.fused_loss_capturable(*args, dleta=0.1)
    loss, stats, error = fused.fused_loss_capturable(*args, **{k: getattr(contract.DEFAULTS, k)
                                                              for k in contract.KEYWORDS})
    assert error.tolist() == [0, -1]
    assert tuple(stats) == contract.STAT_NAMES


def test_outputs_follow_the_contract_in_order(generator):
    """The registered op returns OUTPUTS (shapes and dtypes as specified), then the error record."""
    lp = -torch.rand(2, 5, generator=generator, dtype=torch.float16)
    mask = torch.ones(2, 5, dtype=torch.bool)
    out = torch.ops.flashreinforce.fused_loss(lp, lp, torch.tensor([1.0, 0.0]), None, mask, None, None,
                                              contract.op_options(LossOptions(delta=0.1)), True)
    assert len(out) == len(contract.OUTPUTS) + 1
    for spec, tensor in zip(contract.OUTPUTS, out):
        shape = {(): (), "N": (2, 5), "B": (2,)}[spec.shape]
        dtype = {"compute": torch.float32, "log_probs": torch.float16}.get(spec.dtype, spec.dtype)
        assert (tuple(tensor.shape), tensor.dtype) == (shape, dtype), spec.name
    assert out[-1].dtype == torch.int64 and out[-1].tolist() == [0, -1]


def test_statistics_have_the_contract_names_in_both_implementations(generator):
    lp = -torch.rand(6, generator=generator)
    args = (lp, lp - 0.01, torch.tensor([1.0, 0.0]), torch.tensor([0, 3, 6]))
    assert tuple(fused.flashreinforce_loss_packed(*args)[1]) == contract.STAT_NAMES
    assert tuple(reference.flashreinforce_loss_packed(*args)[1]) == contract.STAT_NAMES
    with pytest.raises(TypeError, match="statistics"):
        contract.make_stats(advantages=lp)


def test_ops_import_neither_the_trainer_nor_transformers():
    """Importing the objective (both implementations and the contract) in a fresh interpreter
    loads no trainer module and no transformers."""
    script = textwrap.dedent("""
        import sys
        import flashreinforce.ops, flashreinforce.ops.contract, flashreinforce.ops.reference, flashreinforce.loss
        bad = sorted(m for m in sys.modules if m.startswith(("flashreinforce.trainer", "transformers")))
        print("loaded:", bad)
        raise SystemExit(1 if bad else 0)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("keyword", ["num_trajectories", "num_policy_tokens"])
def test_counts_past_64_bits_are_refused_alike_and_the_largest_agrees(keyword):
    # The op's counts are 64-bit: both implementations take 2**63 - 1 (and give the same loss)
    # and refuse 2**63 with the same ValueError, where the compiled op's cast used to fail.
    lp = torch.tensor([-0.5, -0.7, -0.2, -0.4], dtype=torch.float64)
    args = (lp, lp, torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([0, 2, 4]))
    extra = {"loss_agg": "token-mean"} if keyword == "num_policy_tokens" else {}
    losses = [impl.flashreinforce_loss_packed(*args, **extra, **{keyword: 2**63 - 1})[0] for impl in (fused, reference)]
    assert losses[0].item() == pytest.approx(losses[1].item(), rel=1e-12) and losses[0].item() != 0
    messages = []
    for impl in (fused, reference):
        with pytest.raises(ValueError, match=rf"{keyword} must be at most 2\*\*63 - 1") as caught:
            impl.flashreinforce_loss_packed(*args, **extra, **{keyword: 2**63})
        messages.append(str(caught.value))
    assert messages[0] == messages[1]
