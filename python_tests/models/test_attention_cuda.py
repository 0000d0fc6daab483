"""Per-document attention on CUDA (skipped visibly without a GPU): the varlen flash backend against
the SDPA backend and against a float64 computation, and the packed learner forward against the
padded one. Run on a GPU machine by scripts/gpu_check.sh."""

from __future__ import annotations

import pytest
import torch

from flashreinforce.models import attention
from flashreinforce.models.attention import DocumentLayout, attend
from python_tests.conftest import requires_cuda

pytestmark = [pytest.mark.cuda, requires_cuda]


def _reference(layout: DocumentLayout, q, k, v):
    """Float64 attention from the layout's definition: segment j sees its ancestors' keys and its own causally."""
    out = torch.zeros(q.shape[1], q.shape[0], q.shape[2], dtype=torch.float64, device=q.device)
    rep = q.shape[0] // k.shape[0]
    for j in range(layout.num_segments):
        keys = torch.cat([torch.arange(a, b) for a, b in layout.key_spans[j]]).to(q.device)
        s, e = layout.starts[j], layout.ends[j]
        qq = q[:, s:e].double()
        kk, vv = k[:, keys].double().repeat_interleave(rep, 0), v[:, keys].double().repeat_interleave(rep, 0)
        scores = qq @ kk.transpose(1, 2) / q.shape[-1] ** 0.5
        lq, lk = e - s, len(keys)
        allowed = torch.arange(lk, device=q.device)[None, :] <= torch.arange(lq, device=q.device)[:, None] + lk - lq
        out[s:e] = (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ vv).transpose(0, 1)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_and_sdpa_backends_agree_with_float64(dtype):
    if attention._varlen() is None:
        pytest.skip("torch.nn.attention.varlen is not in this PyTorch")
    layout = DocumentLayout([0, 40, 90, 97, 150, 400], [40, 90, 97, 150, 400, 520], [-1, 0, 0, -1, -1, 4])
    torch.manual_seed(0)
    q = torch.randn(14, 520, 64, device="cuda", dtype=dtype)
    k = torch.randn(2, 520, 64, device="cuda", dtype=dtype)
    v = torch.randn(2, 520, 64, device="cuda", dtype=dtype)
    want = _reference(layout, q, k, v)
    for backend in ("varlen", "sdpa"):
        got = attend(DocumentLayout(layout.starts, layout.ends, layout.parents, backend=backend), q, k, v)
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2, msg=backend)
    assert attention.varlen_available(q, max_keys=520)


def test_packed_and_padded_learner_forwards_agree_on_cuda():
    import transformers

    from flashreinforce.trainer.learning.packing import pack
    from flashreinforce.trainer.learning.scoring import token_log_probs
    from python_tests.models.test_attention import _agentic_batch, _config

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config("qwen2")).cuda()
    batch = pack(_agentic_batch(3))
    for autocast, tol in ((None, 1e-5), (torch.bfloat16, 3e-2)):
        got = token_log_probs(model, batch, packed_forward=True, autocast_dtype=autocast)[0]
        want = token_log_probs(model, batch, packed_forward=False, autocast_dtype=autocast)[0]
        torch.testing.assert_close(got, want, atol=tol, rtol=0)
