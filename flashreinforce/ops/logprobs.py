"""Log-probabilities and entropies of sampled tokens without materializing ``[N, V]`` logits.

The learner needs, at every packed token t, the current policy's log-probability of the token
that was sampled there (and, for the entropy filter, the entropy of the whole categorical
distribution). Written naively this is ``log_softmax(hidden @ weight.T)`` gathered at the
targets: with 8k tokens and a 152k vocabulary the float32 logits alone take 5 GB, and autograd
keeps the log-softmax (and builds two more ``[N, V]`` buffers in backward).

:func:`sampled_token_logprobs` computes the same numbers tile by tile: a tile is a block of token
rows times a block of vocabulary columns, and a running (online) log-sum-exp combines the
vocabulary blocks of a row. Only per-row scalars survive the forward pass (the log-sum-exp and,
with entropy, the entropy); backward recomputes each tile's logits with one extra GEMM, turns them
into the gradient with respect to the logits in place, and feeds that to the two gradient GEMMs.
Peak memory is the inputs, their gradients (accumulated in float32 for low-precision inputs)
and two or three tile-sized work buffers. On CPU the default tile is :data:`CPU_TILE`; on GPUs a
tile spans the whole vocabulary and holds as many rows as fit in :data:`DEFAULT_CHUNK_BYTES`.

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

from flashreinforce.ops.contract import compute_dtype_for

__all__ = ["CPU_TILE", "DEFAULT_CHUNK_BYTES", "chunk_rows", "sampled_token_logprobs", "wide_gemm_available"]

#: Default budget, in bytes, for the tile-sized work buffers that exist at any one time (forward
#: or backward). On GPUs a tile spans the whole vocabulary, so 256 MiB is 441 rows at
#: V = 151,936 in float32 (220 with entropy): enough rows for the GEMMs to run near peak.
DEFAULT_CHUNK_BYTES = 256 * 2**20

#: Largest ``(rows, vocabulary columns)`` of a tile on CPU (rows are further limited by the
#: budget: 2048 x 32768 float32 is 256 MiB, 1024 rows with entropy). Measured on a 2-core machine
#: (docs/performance.md, "Learner memory"): on a free core, tile shapes from 512 x 8192 to whole
#: vocabulary rows cost within 4% of each other; when other processes compete for the cores,
#: every parallel region (one per elementwise op per tile) can wait a scheduler slice for its
#: second thread, and 2048 x 32768 tiles took ~10% less CPU time than 1024 x 16384 ones.
CPU_TILE = (2048, 32768)

_LOW_PRECISION = (torch.float16, torch.bfloat16)

# Device type -> which float32-result GEMMs of low-precision operands torch runs there:
# {"mm": torch.mm(..., out_dtype), "mm_out": the same into out=, "addmm_out": torch.addmm(acc, ..., out_dtype, out=acc)}.
_WIDE_GEMM: dict[str, dict[str, bool]] = {}


def _wide_gemm_support(device: torch.device) -> dict[str, bool]:
    """Tried once per device type on 2 x 2 bfloat16 matrices, values checked."""
    if device.type not in _WIDE_GEMM:
        a = torch.full((2, 2), 1.5, dtype=torch.bfloat16, device=device)
        support = {}
        for name in ("mm", "mm_out", "addmm_out"):
            try:
                out = torch.full((2, 2), 1.0, dtype=torch.float32, device=device)
                if name == "mm":
                    out = torch.mm(a, a, out_dtype=torch.float32)
                    want = 4.5
                elif name == "mm_out":
                    torch.mm(a, a, out_dtype=torch.float32, out=out)
                    want = 4.5
                else:
                    torch.addmm(out, a, a, out_dtype=torch.float32, out=out)
                    want = 5.5
                support[name] = out.dtype == torch.float32 and bool((out == want).all())
            except (RuntimeError, NotImplementedError, TypeError):
                support[name] = False
        _WIDE_GEMM[device.type] = support
    return _WIDE_GEMM[device.type]


def wide_gemm_available(device: torch.device | str) -> bool:
    """Whether ``torch.mm`` takes bfloat16 / float16 operands with ``out_dtype=torch.float32``
    (float32 accumulation and result) on this device type. PyTorch has that GEMM on CUDA (recent
    releases); where it is missing, low-precision operands are emulated by float32 GEMMs."""
    return _wide_gemm_support(torch.device(device))["mm"]


def _element_bytes(dtype: torch.dtype, with_entropy: bool) -> int:
    """Bytes of work buffers per tile element: one compute-dtype tile (two with entropy), plus
    one in the input dtype for low-precision inputs (the GEMM result before the upcast, and the
    gradient after the downcast)."""
    per = (2 if with_entropy else 1) * torch.empty((), dtype=compute_dtype_for(dtype)).element_size()
    if dtype in _LOW_PRECISION:
        per += torch.empty((), dtype=dtype).element_size()
    return per


def chunk_rows(vocab_size: int, dtype: torch.dtype = torch.float32,
               budget_bytes: int = DEFAULT_CHUNK_BYTES, *, with_entropy: bool = False) -> int:
    """Number of token rows per tile so that tiles spanning ``vocab_size`` columns fit their
    work buffers in ``budget_bytes`` (at least one row). ``dtype``: dtype of ``hidden`` (the
    ``operand_dtype`` when float32 inputs have low-precision operands);
    ``with_entropy``: entropies are computed (one more buffer)."""
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    if not isinstance(budget_bytes, int) or budget_bytes < 1:
        raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
    return max(1, budget_bytes // (vocab_size * _element_bytes(dtype, bool(with_entropy))))


def _tile_logits(tiles, h, weight, bias, temperature, out, low_out):
    """Write the tile's logits ``(h W^T + b) / temperature`` into ``out`` (compute dtype).

    The GEMM runs in the input dtype, as the model's own lm_head would; low-precision results
    land in ``low_out`` first and are upcast, so everything after the GEMM is float32. With
    low-precision operands of float32 inputs (``tiles.wide``) the GEMM's result is float32 itself.
    """
    if tiles.wide:
        tiles.accumulate(out, h, weight.t(), first=True)
        if bias is not None:
            out.add_(bias)
    else:
        target = out if low_out is None else low_out
        if bias is None:
            torch.mm(h, weight.t(), out=target)
        else:
            torch.addmm(bias, h, weight.t(), out=target)
        if low_out is not None:
            out.copy_(low_out)
    if temperature != 1.0:
        out.div_(temperature)
    return out


class _Tiles:
    """Tile geometry, the GEMM precision and the reusable flat work buffers of one forward or
    backward call.

    Three GEMM precisions: the inputs' own dtype (float32 / float64: ``low`` and ``wide`` false);
    low-precision inputs (``low``: products in their dtype, upcast after); float32 inputs with
    low-precision operands (``wide``: operands rounded to ``operand_dtype``, products and sums in
    float32). ``cast_grad``: the logit gradient is cast to the operand dtype for the gradient GEMMs
    (into ``low_buf``; backward only for ``wide``).
    """

    def __init__(self, hidden, vocab, rows, cols, n_buffers, operand_dtype=None, backward=False):
        self.rows, self.cols, self.vocab = rows, cols, vocab
        self.cdt = compute_dtype_for(hidden.dtype)
        self.low = hidden.dtype in _LOW_PRECISION
        self.operand_dtype = operand_dtype
        self.wide = operand_dtype is not None
        self.native_wide = self.wide and wide_gemm_available(hidden.device)
        self.cast_grad = self.low or self.wide
        size = rows * cols
        dev = hidden.device
        self.bufs = [torch.empty(size, dtype=self.cdt, device=dev) for _ in range(n_buffers)]
        low_dtype = hidden.dtype if self.low else (operand_dtype if self.wide and backward else None)
        self.low_buf = None if low_dtype is None else torch.empty(size, dtype=low_dtype, device=dev)

    def operands(self, hidden, weight):
        """``hidden`` and ``weight`` as GEMM operands: rounded to the operand dtype when ``wide``
        (and, where the emulation runs, widened back to float32 once per call, not per tile)."""
        if not self.wide:
            return hidden, weight
        ops = hidden.to(self.operand_dtype), weight.to(self.operand_dtype)
        return ops if self.native_wide else tuple(t.to(self.cdt) for t in ops)

    def accumulate(self, acc, a, b, *, first):
        """``acc (=|+=) a @ b``; ``acc`` in the compute dtype, ``a`` / ``b`` operands.

        Low-precision inputs: the product is computed in their dtype, then added in the compute
        dtype. Wide: a float32-result GEMM of the low-precision operands where the device has one
        (:func:`wide_gemm_available`), else the same math in float32 (every low-precision value is
        exact in float32; :meth:`operands` has widened the rounded inputs already, the logit
        gradient is widened here): same numbers up to summation order, slower than plain float32.
        """
        if self.wide:
            if self.native_wide:
                support = _wide_gemm_support(acc.device)
                if first and support["mm_out"]:
                    torch.mm(a, b, out_dtype=acc.dtype, out=acc)
                elif not first and support["addmm_out"]:
                    torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
                elif first:
                    acc.copy_(torch.mm(a, b, out_dtype=acc.dtype))
                else:
                    acc.add_(torch.mm(a, b, out_dtype=acc.dtype))
                return
            a, b = a.to(acc.dtype), b.to(acc.dtype)
        if self.low:
            prod = torch.mm(a, b)
            if first:
                acc.copy_(prod)
            else:
                acc.add_(prod)
        elif first:
            torch.mm(a, b, out=acc)
        else:
            acc.addmm_(a, b)

    def view(self, buf, n, vb):
        """A contiguous ``[n, vb]`` view of a flat buffer (slicing a 2-D buffer would leave a
        row stride of ``cols``, which GEMM ``out=`` and the reductions handle less well)."""
        return buf[: n * vb].view(n, vb)

    def blocks(self, n_tokens):
        """Row blocks ``(r0, r1)``."""
        return [(r0, min(r0 + self.rows, n_tokens)) for r0 in range(0, n_tokens, self.rows)]

    def vocab_blocks(self):
        """Vocabulary blocks ``(index, v0, v1)``."""
        return [(i, v0, min(v0 + self.cols, self.vocab)) for i, v0 in enumerate(range(0, self.vocab, self.cols))]


def _target_slots(targets, cols):
    """Per target: its vocabulary block index and its column inside that block, ``[n, 1]``."""
    return targets // cols, (targets % cols)[:, None]


class _SampledTokenLogprobs(torch.autograd.Function):
    """Tiled forward with an online log-sum-exp; backward recomputes each tile's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, rows, cols, with_entropy, operand_dtype):
        n_tokens, vocab = hidden.shape[0], weight.shape[0]
        rows, cols = max(1, min(rows, n_tokens)), min(cols, vocab)
        tiles = _Tiles(hidden, vocab, rows, cols, 2 if with_entropy else 1, operand_dtype)
        cdt, dev = tiles.cdt, hidden.device
        hidden_op, weight_op = tiles.operands(hidden, weight)
        logp = torch.empty(n_tokens, dtype=cdt, device=dev)
        lse = torch.empty(n_tokens, dtype=cdt, device=dev)
        entropy = torch.empty(n_tokens if with_entropy else 0, dtype=cdt, device=dev)

        for r0, r1 in tiles.blocks(n_tokens):
            n = r1 - r0
            h = hidden_op[r0:r1]
            y_block, y_col = _target_slots(targets[r0:r1], cols)
            # Running per-row statistics relative to the running max m: s = sum exp(z - m),
            # a = sum exp(z - m) (z - m) (entropy only), and the target logit z_y.
            m = s = a = z_y = None
            for b, v0, v1 in tiles.vocab_blocks():
                vb = v1 - v0
                z = _tile_logits(tiles, h, weight_op[v0:v1], None if bias is None else bias[v0:v1], temperature,
                                 tiles.view(tiles.bufs[0], n, vb),
                                 None if tiles.low_buf is None else tiles.view(tiles.low_buf, n, vb))
                zy_here = z.gather(1, y_col.clamp(max=vb - 1)).squeeze(1)
                z_y = zy_here if z_y is None else torch.where(y_block == b, zy_here, z_y)
                m_tile = z.amax(1)
                m_new = m_tile if m is None else torch.maximum(m, m_tile)
                z.sub_(m_new[:, None])
                if with_entropy:
                    ez = torch.exp(z, out=tiles.view(tiles.bufs[1], n, vb))
                    s_tile = ez.sum(1)
                    a_tile = ez.mul_(z).sum(1)
                else:
                    s_tile = z.exp_().sum(1)
                if m is None:
                    s, a = s_tile, (a_tile if with_entropy else None)
                else:
                    # Rescale the old sums from the old max to the new one (factor <= 1).
                    shift = m - m_new
                    scale = shift.exp()
                    if with_entropy:
                        a = (a + shift * s).mul_(scale).add_(a_tile)
                    s = s.mul_(scale).add_(s_tile)
                m = m_new
            log_s = s.log()
            # lse >= m >= z_y exactly (s >= 1), so logp <= 0 in floating point too.
            torch.add(m, log_s, out=lse[r0:r1])
            torch.sub(z_y, lse[r0:r1], out=logp[r0:r1])
            if with_entropy:
                # H = lse - sum p z = log s - a / s.
                torch.sub(log_s, a / s, out=entropy[r0:r1])

        if with_entropy:
            ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        else:
            ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.rows, ctx.cols, ctx.with_entropy = temperature, rows, cols, with_entropy
        ctx.operand_dtype = operand_dtype
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
        nothing = (None,) * 9
        if (grad_logp is None and grad_entropy is None) or not (need_h or need_w or need_b):
            return nothing

        n_tokens, vocab = hidden.shape[0], weight.shape[0]
        temperature, cols = ctx.temperature, ctx.cols
        use_entropy = grad_entropy is not None
        tiles = _Tiles(hidden, vocab, ctx.rows, cols, 2 if use_entropy else 1, ctx.operand_dtype, backward=True)
        cdt, cast_grad, dev = tiles.cdt, tiles.cast_grad, hidden.device
        hidden_op, weight_op = tiles.operands(hidden, weight)

        # The 1/temperature of the chain rule is folded into the per-row upstream gradients,
        # since the logit gradient is linear in them.
        g = None if grad_logp is None else grad_logp.to(cdt) / temperature
        e = grad_entropy.to(cdt) / temperature if use_entropy else None
        # mu = sum p z = lse - H; only the entropy gradient needs it.
        mu = lse - entropy if use_entropy else None

        # Gradients accumulate over tiles in the compute dtype (for low-precision inputs: one
        # rounding at the end, as a single un-tiled GEMM would have).
        # No zero fill: the first tile that touches a slice writes it (GEMM with beta = 0).
        # (With no tokens no tile runs, and the weight gradient is zero.)
        grad_h = torch.empty(hidden.shape, dtype=cdt, device=dev) if need_h else None
        alloc_w = torch.empty if n_tokens > 0 else torch.zeros
        grad_w = alloc_w(weight.shape, dtype=cdt, device=dev) if need_w else None
        grad_b = torch.zeros(vocab, dtype=cdt, device=dev) if need_b else None

        for r0, r1 in tiles.blocks(n_tokens):
            n = r1 - r0
            h = hidden_op[r0:r1]
            y_block, y_col = _target_slots(targets[r0:r1], cols)
            lse_r = lse[r0:r1, None]
            if use_entropy:
                # Logit gradient = -p (g + e (z - mu)) + g onehot: not a row scaling of one tile.
                row_scale = None
                h_op = h
                e_r, mu_r = -e[r0:r1, None], mu[r0:r1, None]
                g_r = None if g is None else g[r0:r1, None]
            else:
                # logp only: logit gradient = -g (p - onehot). The per-row factor -g is applied
                # to the small [n, H] operands, not to the tile: one pass over each tile saved.
                row_scale = -g[r0:r1, None]
                h_op = h if cast_grad else h * row_scale
            for b, v0, v1 in tiles.vocab_blocks():
                vb = v1 - v0
                w_b = weight_op[v0:v1]
                z = _tile_logits(tiles, h, w_b, None if bias is None else bias[v0:v1], temperature,
                                 tiles.view(tiles.bufs[0], n, vb),
                                 None if tiles.low_buf is None else tiles.view(tiles.low_buf, n, vb))
                col = y_col.clamp(max=vb - 1)
                here = (y_block == b)[:, None]
                if use_entropy:
                    p = torch.sub(z, lse_r, out=tiles.view(tiles.bufs[1], n, vb)).exp_()
                    grad_z = z.sub_(mu_r).mul_(e_r)
                    if g_r is not None:
                        grad_z.sub_(g_r)
                    grad_z.mul_(p)
                    if g_r is not None:
                        # + g at the target. gather/scatter rather than scatter_add_: it is
                        # deterministic on every backend (one target per row).
                        at_col = grad_z.gather(1, col)
                        grad_z.scatter_(1, col, torch.where(here, at_col + g_r, at_col))
                    gz = tiles.view(tiles.low_buf, n, vb).copy_(grad_z) if cast_grad else grad_z
                else:
                    d = z.sub_(lse_r).exp_()  # p
                    d.scatter_(1, col, d.gather(1, col) - here.to(cdt))  # p - onehot
                    grad_z = d
                    # The cast to the GEMM dtype is a pass anyway: scale while casting.
                    gz = torch.mul(d, row_scale, out=tiles.view(tiles.low_buf, n, vb)) if cast_grad else d
                if need_h:
                    tiles.accumulate(grad_h[r0:r1], gz, w_b, first=b == 0)
                if need_w:
                    tiles.accumulate(grad_w[v0:v1], gz.t(), h_op, first=r0 == 0)
                if need_b:
                    # From the compute-dtype values, not the low-precision GEMM operand.
                    if row_scale is None:
                        grad_b[v0:v1].add_(grad_z.sum(0))
                    else:
                        grad_b[v0:v1].addmv_(grad_z.t(), row_scale.squeeze(1))
            if need_h and row_scale is not None and not cast_grad:
                grad_h[r0:r1].mul_(row_scale)

        return (None if grad_h is None else grad_h.to(hidden.dtype),
                None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype),
                None, None, None, None, None, None)


def sampled_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                           bias: torch.Tensor | None = None, temperature: float = 1.0,
                           chunk_size: int | None = None, with_entropy: bool = False,
                           vocab_chunk_size: int | None = None,
                           chunk_budget_bytes: int = DEFAULT_CHUNK_BYTES, check_targets: bool = True,
                           operand_dtype: torch.dtype | None = None):
    """Log-probability of each target token, and optionally the full entropy, from hidden states.

    Computes ``log_softmax((hidden @ weight.T + bias) / temperature)[i, targets[i]]`` and
    ``-sum_j p_ij log p_ij`` tile by tile (``chunk_size`` tokens x ``vocab_chunk_size`` vocabulary
    entries, with a running log-sum-exp over the vocabulary tiles), never holding the ``[N, V]``
    logits; backward recomputes each tile's logits (one extra GEMM).

    Args:
        hidden: ``[N, H]`` float64/float32/bfloat16/float16, the last hidden states (the rows that
            predict ``targets``); may require grad.
        weight: ``[V, H]``, same dtype and device as ``hidden``: the output projection (lm_head);
            may require grad.
        targets: ``[N]`` integer token ids in ``[0, V)`` (int64 or int32).
        bias: optional ``[V]`` output bias, same dtype and device as ``weight``.
        temperature: positive finite float dividing the logits (the sampling temperature).
        chunk_size: tokens per tile; default: as many as fit in ``chunk_budget_bytes``, and at
            most ``CPU_TILE[0]`` on CPU.
        with_entropy: also return the entropy of each row's distribution.
        vocab_chunk_size: vocabulary entries per tile; default: ``CPU_TILE[1]`` on CPU (vocabulary
            blocking), the whole vocabulary on other devices.
        chunk_budget_bytes: byte budget of the tile work buffers when ``chunk_size`` is None
            (see :func:`chunk_rows`).
        check_targets: check that every target lies in ``[0, V)`` (a read back from the device);
            ``False`` when the caller has checked them already (the learner does, on the host copy).
        operand_dtype: ``None`` (GEMMs in the inputs' dtype), or ``torch.bfloat16`` /
            ``torch.float16`` with float32 inputs: the GEMM operands (hidden states, weight, and in
            backward the logit gradient) are rounded to it while products, sums, logits and
            gradients stay float32, as a tensor-core GEMM with float32 accumulation and output
            computes them (:func:`wide_gemm_available`; elsewhere the same numbers are computed by
            float32 GEMMs of the rounded operands, without a speed-up). Unlike a GEMM in bfloat16,
            the logits themselves are never rounded to 8 bits.

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
    if operand_dtype is not None:
        if operand_dtype not in _LOW_PRECISION:
            raise ValueError(f"operand_dtype must be None, torch.bfloat16 or torch.float16, got {operand_dtype!r}")
        if hidden.dtype != torch.float32:
            raise ValueError(f"operand_dtype applies to float32 hidden and weight, got {hidden.dtype} "
                             "(low-precision inputs are GEMM operands already)")
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
    if isinstance(chunk_budget_bytes, bool) or not isinstance(chunk_budget_bytes, int) or chunk_budget_bytes < 1:
        raise ValueError(f"chunk_budget_bytes must be a positive int, got {chunk_budget_bytes!r}")
    on_cpu = hidden.device.type == "cpu"
    if vocab_chunk_size is None:
        cols = min(vocab, CPU_TILE[1]) if on_cpu else vocab
    elif isinstance(vocab_chunk_size, bool) or not isinstance(vocab_chunk_size, int) or vocab_chunk_size < 1:
        raise ValueError(f"vocab_chunk_size must be a positive int or None, got {vocab_chunk_size!r}")
    else:
        cols = min(vocab, vocab_chunk_size)
    if chunk_size is None:
        rows = chunk_rows(cols, operand_dtype or hidden.dtype, chunk_budget_bytes, with_entropy=with_entropy)
        if on_cpu:
            rows = min(rows, CPU_TILE[0])
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    else:
        rows = chunk_size
    if check_targets and n_tokens > 0:
        lo, hi = torch.aminmax(targets)
        if int(lo) < 0 or int(hi) >= vocab:
            raise ValueError(f"targets must lie in [0, V) = [0, {vocab}), got values in "
                             f"[{int(lo)}, {int(hi)}]")
    targets = targets.to(torch.int64)

    logp, entropy = _SampledTokenLogprobs.apply(hidden, weight, bias, targets, temperature, rows, cols,
                                                bool(with_entropy), operand_dtype)
    return logp, (entropy if with_entropy else None)
