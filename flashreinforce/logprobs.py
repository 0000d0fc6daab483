"""Log-probabilities and entropies of sampled tokens without materializing ``[N, V]`` logits.

The learner needs, at every packed token t, the current policy's log-probability of the token
that was sampled there (and, for the entropy filter, the entropy of the whole categorical
distribution). Written naively this is ``log_softmax(hidden @ weight.T)`` gathered at the
targets: with 8k tokens and a 152k vocabulary the float32 logits alone take 5 GB, and autograd
keeps the log-softmax (and builds two more ``[N, V]`` buffers in backward).

:func:`sampled_token_logprobs` computes the same numbers chunk by chunk over the tokens. Only
per-row scalars survive the forward pass (the log-sum-exp and, with entropy, the entropy);
backward recomputes each chunk's logits with one extra GEMM and turns them into the gradient
with respect to the logits in place, then feeds it to the two gradient GEMMs. Peak memory is
the inputs, their gradients and a few chunk-sized work buffers (:data:`DEFAULT_CHUNK_BYTES`).

Math, for one row with logits ``z = (h W^T + b) / temperature``, ``p = softmax(z)``,
``lse = logsumexp(z)``, target ``y``:

* ``logp = z_y - lse`` and ``d logp / d z = onehot(y) - p``;
* ``H = -sum_j p_j log p_j = lse - mu`` with ``mu = sum_j p_j z_j``, and
  ``d H / d z_j = -p_j (log p_j + H) = -p_j (z_j - mu)``.

With upstream gradients ``g`` (for logp) and ``e`` (for H), the gradient with respect to the
pre-temperature logits is ``(g onehot(y) - p * (g + e (z - mu))) / temperature``; the rest is
the chain rule through the linear layer.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

__all__ = ["DEFAULT_CHUNK_BYTES", "chunk_rows", "sampled_token_logprobs"]

#: Default budget, in bytes, for the chunk-sized ``[rows, V]`` work buffers that exist at any one
#: time (forward or backward). 256 MiB is ~220 rows at V = 151,936 in float32 with the two
#: buffers the code uses: enough rows for the GEMMs to run near peak on CPU and GPU.
DEFAULT_CHUNK_BYTES = 256 * 2**20

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; float32, float16 and bfloat16 compute in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_bytes(vocab_size: int, dtype: torch.dtype) -> int:
    """Bytes of work buffers per chunk row: two compute-dtype ``[rows, V]`` buffers, plus one
    in the input dtype for low-precision inputs (the GEMM output before the upcast)."""
    compute = _compute_dtype(dtype)
    per_row = 2 * torch.empty((), dtype=compute).element_size()
    if dtype in _LOW_PRECISION:
        per_row += torch.empty((), dtype=dtype).element_size()
    return vocab_size * per_row


def chunk_rows(vocab_size: int, dtype: torch.dtype = torch.float32,
               budget_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Number of token rows per chunk so that the ``[rows, vocab_size]`` work buffers fit in
    ``budget_bytes`` (at least one row). ``dtype`` is the dtype of ``hidden``/``weight``."""
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    if not isinstance(budget_bytes, int) or budget_bytes < 1:
        raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
    return max(1, budget_bytes // _row_bytes(vocab_size, dtype))


def _chunk_logits(h_chunk, weight, bias, temperature, out, low_out):
    """Write the chunk's logits ``(h W^T + b) / temperature`` into ``out`` (compute dtype).

    The GEMM runs in the input dtype, as the model's own lm_head would; low-precision results
    land in ``low_out`` first and are upcast, so everything after the GEMM is float32.
    """
    target = out if low_out is None else low_out
    if bias is None:
        torch.mm(h_chunk, weight.t(), out=target)
    else:
        torch.addmm(bias, h_chunk, weight.t(), out=target)
    if low_out is not None:
        out.copy_(low_out)
    if temperature != 1.0:
        out.div_(temperature)
    return out


class _SampledTokenLogprobs(torch.autograd.Function):
    """Chunked forward; backward recomputes each chunk's logits (see module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, rows, with_entropy):
        n_tokens, vocab = hidden.shape[0], weight.shape[0]
        cdt = _compute_dtype(hidden.dtype)
        low = hidden.dtype in _LOW_PRECISION
        logp = torch.empty(n_tokens, dtype=cdt, device=hidden.device)
        lse = torch.empty(n_tokens, dtype=cdt, device=hidden.device)
        entropy = torch.empty(n_tokens if with_entropy else 0, dtype=cdt, device=hidden.device)

        rows = max(1, min(rows, n_tokens))
        if n_tokens > 0:
            z_buf = torch.empty(rows, vocab, dtype=cdt, device=hidden.device)
            lsm_buf = torch.empty_like(z_buf)
            low_buf = torch.empty(rows, vocab, dtype=hidden.dtype, device=hidden.device) if low else None
        for start in range(0, n_tokens, rows):
            stop = min(start + rows, n_tokens)
            n = stop - start
            y = targets[start:stop, None]
            z = _chunk_logits(hidden[start:stop], weight, bias, temperature, z_buf[:n],
                              None if low_buf is None else low_buf[:n])
            lsm = torch.log_softmax(z, 1, out=lsm_buf[:n])
            lp = lsm.gather(1, y).squeeze(1)
            logp[start:stop] = lp
            # lse = z_y - log p_y: exact to rounding and saves a separate reduction pass.
            torch.sub(z.gather(1, y).squeeze(1), lp, out=lse[start:stop])
            if with_entropy:
                # H = -sum p log p with p = exp(log_softmax); z is no longer needed, so p goes there.
                p = torch.exp(lsm, out=z)
                entropy[start:stop] = -p.mul_(lsm).sum(1)

        if with_entropy:
            ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        else:
            ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature = temperature
        ctx.rows = rows
        ctx.with_entropy = with_entropy
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        if ctx.with_entropy:
            hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        else:
            hidden, weight, bias, targets, lse = ctx.saved_tensors
            entropy, grad_entropy = None, None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if (grad_logp is None and grad_entropy is None) or not (need_h or need_w or need_b):
            return None, None, None, None, None, None, None

        n_tokens, vocab = hidden.shape[0], weight.shape[0]
        cdt = _compute_dtype(hidden.dtype)
        low = hidden.dtype in _LOW_PRECISION
        temperature = ctx.temperature
        rows = max(1, min(ctx.rows, n_tokens))
        dev = hidden.device

        # The 1/temperature of the chain rule is folded into the per-row upstream gradients,
        # since the logit gradient is linear in them.
        g = None if grad_logp is None else grad_logp.to(cdt) / temperature
        e = None if grad_entropy is None else grad_entropy.to(cdt) / temperature
        # mu = sum p z = lse - H; only the entropy gradient needs it.
        mu = None if e is None else lse - entropy

        grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=dev) if need_h else None
        # Low-precision weights accumulate their gradient over chunks in float32 (one rounding
        # at the end, as a single un-chunked GEMM would have); float32/64 accumulate in place.
        grad_w = torch.zeros(weight.shape, dtype=cdt, device=dev) if need_w else None
        grad_b = torch.zeros(vocab, dtype=cdt, device=dev) if need_b else None
        if n_tokens > 0:
            z_buf = torch.empty(rows, vocab, dtype=cdt, device=dev)
            p_buf = torch.empty_like(z_buf)
            low_buf = torch.empty(rows, vocab, dtype=hidden.dtype, device=dev) if low else None
            low_gw = torch.empty(weight.shape, dtype=weight.dtype, device=dev) if (low and need_w) else None

        for start in range(0, n_tokens, rows):
            stop = min(start + rows, n_tokens)
            n = stop - start
            h = hidden[start:stop]
            z = _chunk_logits(h, weight, bias, temperature, z_buf[:n],
                              None if low_buf is None else low_buf[:n])
            p = torch.softmax(z, 1, out=p_buf[:n])
            y = targets[start:stop, None]
            if e is None:
                # logp only: grad_z = -g (p - onehot). Form D = p - onehot in place and apply the
                # per-row factor -g to the small [n, H] operands instead of the [n, V] buffer:
                # one pass over the chunk saved.
                d = p.scatter_(1, y, p.gather(1, y).sub_(1.0))
                row_scale = -g[start:stop, None]
                if low:
                    # The cast to the GEMM dtype is a pass anyway; scale while casting.
                    gz = torch.mul(d, row_scale, out=low_buf[:n])
                    h_scaled = h
                else:
                    gz = d
                    h_scaled = h * row_scale
            else:
                # -p (g + e (z - mu)) + g onehot, built in z's buffer.
                t = z.sub_(mu[start:stop, None]).mul_(-e[start:stop, None])
                if g is not None:
                    t.sub_(g[start:stop, None])
                grad_z = t.mul_(p)
                if g is not None:
                    # gather/scatter rather than scatter_add_: deterministic on every backend
                    # (each row has one target).
                    grad_z.scatter_(1, y, grad_z.gather(1, y).add_(g[start:stop, None]))
                row_scale = None
                gz = low_buf[:n].copy_(grad_z) if low else grad_z
                h_scaled = h

            # Now the logit gradient is diag(row_scale) @ gz (row_scale None: identity), with gz
            # in the GEMM dtype.
            if need_h:
                out_h = torch.mm(gz, weight, out=grad_h[start:stop])
                if row_scale is not None and not low:
                    out_h.mul_(row_scale)
            if need_w:
                if low:
                    grad_w.add_(torch.mm(gz.t(), h_scaled, out=low_gw))
                else:
                    grad_w.addmm_(gz.t(), h_scaled)
            if need_b:
                # From the compute-dtype values, not the low-precision GEMM operand.
                if row_scale is not None:
                    grad_b.addmv_(d.t(), row_scale.squeeze(1))
                else:
                    grad_b.add_(grad_z.sum(0))

        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None


def sampled_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                           bias: torch.Tensor | None = None, temperature: float = 1.0,
                           chunk_size: int | None = None, with_entropy: bool = False,
                           chunk_budget_bytes: int = DEFAULT_CHUNK_BYTES):
    """Log-probability of each target token, and optionally the full entropy, from hidden states.

    Computes ``log_softmax((hidden @ weight.T + bias) / temperature)[i, targets[i]]`` and
    ``-sum_j p_ij log p_ij`` row by row in chunks of ``chunk_size`` tokens, never holding the
    ``[N, V]`` logits; backward recomputes each chunk's logits (one extra GEMM per chunk).

    Args:
        hidden: ``[N, H]`` float64/float32/bfloat16/float16, the last hidden states (the rows that
            predict ``targets``); may require grad.
        weight: ``[V, H]``, same dtype and device as ``hidden``: the output projection (lm_head);
            may require grad.
        targets: ``[N]`` integer token ids in ``[0, V)`` (int64 or int32).
        bias: optional ``[V]`` output bias, same dtype and device as ``weight``.
        temperature: positive finite float dividing the logits (the sampling temperature).
        chunk_size: tokens per chunk; default: as many as fit in ``chunk_budget_bytes``.
        with_entropy: also return the entropy of each row's distribution.
        chunk_budget_bytes: byte budget of the ``[chunk, V]`` work buffers when ``chunk_size``
            is None (see :func:`chunk_rows`).

    Returns:
        ``(logp, entropy)``: ``[N]`` tensors in float32 (float64 for float64 inputs), in nats;
        ``entropy`` is None unless ``with_entropy``. Both carry gradients to ``hidden``,
        ``weight`` and ``bias``; the input gradients have the inputs' dtypes.

    Logits are computed by a GEMM in the input dtype (as the model's lm_head would) and upcast
    to float32 before the softmax. Non-finite hidden states or weights give non-finite results,
    as in the un-chunked computation. Works under ``torch.no_grad()`` (nothing is saved).
    Raises ValueError naming the argument for bad shapes, dtypes, devices or values.
    """
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        raise ValueError(f"hidden must be a 2-D tensor [N, H], got "
                         f"{tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D tensor [V, H], got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    if not isinstance(targets, torch.Tensor) or targets.dim() != 1:
        raise ValueError(f"targets must be a 1-D tensor [N], got "
                         f"{tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets).__name__}")
    if hidden.dtype not in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"hidden must be float64, float32, bfloat16 or float16, got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight dtype {weight.dtype} must match hidden dtype {hidden.dtype}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be int64 or int32 token ids, got {targets.dtype}")
    n_tokens, hidden_size = hidden.shape
    vocab = weight.shape[0]
    if weight.shape[1] != hidden_size:
        raise ValueError(f"weight must be [V, H] with H = hidden.shape[1] = {hidden_size}, "
                         f"got {tuple(weight.shape)}")
    if vocab < 1:
        raise ValueError("weight must have at least one row (vocabulary size V >= 1)")
    if targets.shape[0] != n_tokens:
        raise ValueError(f"targets has {targets.shape[0]} entries but hidden has {n_tokens} rows")
    if weight.device != hidden.device or targets.device != hidden.device:
        raise ValueError(f"hidden ({hidden.device}), weight ({weight.device}) and targets "
                         f"({targets.device}) must be on one device")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (vocab,):
            raise ValueError(f"bias must be a tensor of shape [V] = [{vocab}], got "
                             f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
        if bias.dtype != weight.dtype:
            raise ValueError(f"bias dtype {bias.dtype} must match weight dtype {weight.dtype}")
        if bias.device != weight.device:
            raise ValueError(f"bias ({bias.device}) must be on the device of weight ({weight.device})")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a float, got {type(temperature).__name__}")
    temperature = float(temperature)
    if not (math.isfinite(temperature) and temperature > 0.0):
        raise ValueError(f"temperature must be positive and finite, got {temperature}")
    if chunk_size is None:
        rows = chunk_rows(vocab, hidden.dtype, chunk_budget_bytes)
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    else:
        rows = chunk_size
    if n_tokens > 0:
        lo, hi = torch.aminmax(targets)
        if int(lo) < 0 or int(hi) >= vocab:
            raise ValueError(f"targets must lie in [0, V) = [0, {vocab}), got values in "
                             f"[{int(lo)}, {int(hi)}]")
    targets = targets.to(torch.int64)

    logp, entropy = _SampledTokenLogprobs.apply(hidden, weight, bias, targets, temperature, rows,
                                                bool(with_entropy))
    return logp, (entropy if with_entropy else None)
