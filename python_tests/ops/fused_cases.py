"""Test helpers for the fused loss: random packed batches and an independent float64 computation.

``expected_loss`` is written from docs/semantics.md directly, one trajectory at a time in float64, and
shares no code with the kernel or with ``flashreinforce.loss`` (the reference), so agreement is
evidence for both.
"""

from __future__ import annotations

import decimal
import math
from dataclasses import dataclass, field

import torch

PROB_CLAMP = 1e-6


@dataclass
class Batch:
    log_probs: torch.Tensor
    behavior_log_probs: torch.Tensor
    rewards: torch.Tensor
    cu_seqlens: torch.Tensor
    action_mask: torch.Tensor
    entropies: torch.Tensor
    failures: torch.Tensor
    options: dict = field(default_factory=dict)

    @property
    def batch(self) -> int:
        return self.rewards.shape[0]


def random_lengths(gen: torch.Generator, batch: int, long_every: int = 7, max_long: int = 3000) -> list[int]:
    """Odd lengths: mostly 1..12 tokens, some medium, every ``long_every``-th up to ``max_long``."""
    lengths = []
    for i in range(batch):
        u = torch.rand((), generator=gen).item()
        if i % long_every == long_every - 1:
            lengths.append(int(200 + u * (max_long - 200)))
        elif u < 0.3:
            lengths.append(1 + int(u * 10))
        else:
            lengths.append(int(5 + u * 120))
    return lengths


def random_batch(gen: torch.Generator, dtype=torch.float32, batch: int = 23, lengths=None, cu_dtype=torch.int64,
                 spread: float = 0.05, filter_q: float | None = None, entropy_ties: bool = False,
                 behavior_dtype=None, entropy_dtype=None, garbage: bool = True, long_every: int = 7,
                 max_long: int = 3000) -> Batch:
    """A packed batch with prompt / observation slots (mask False) holding NaN, inf and positive
    garbage; behavior log-probs are current ones perturbed by ``spread`` (some trajectories more)."""
    lengths = lengths if lengths is not None else random_lengths(gen, batch, long_every, max_long)
    batch = len(lengths)
    cu = torch.zeros(batch + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    n = int(cu[-1])
    mask = torch.rand(n, generator=gen) < 0.75
    for i in range(batch):
        a, b = int(cu[i]), int(cu[i + 1])
        if b - a > 1:
            mask[a] = False  # the first token is a prompt token
            if not mask[a + 1:b].any():
                mask[a + 1] = True
        else:
            mask[a] = True
    current = -(torch.rand(n, generator=gen, dtype=torch.float64) ** 2) * 6.0
    scale = torch.empty(batch, dtype=torch.float64)
    for i in range(batch):
        scale[i] = spread * (4.0 if torch.rand((), generator=gen) < 0.2 else 1.0)
    noise = torch.randn(n, generator=gen, dtype=torch.float64) * scale.repeat_interleave(torch.tensor(lengths))
    behavior = (current + noise).clamp(max=0.0)
    if entropy_ties:
        entropies = torch.randint(0, 4, (n,), generator=gen).to(torch.float64) * 0.5
    else:
        entropies = torch.rand(n, generator=gen, dtype=torch.float64) * 5.0
    log_probs = current.to(dtype)
    behavior_log_probs = behavior.to(behavior_dtype or dtype)
    entropies = entropies.to(entropy_dtype or dtype)
    if garbage:
        slots = (~mask).nonzero().flatten()
        junk = torch.tensor([math.nan, math.inf, -math.inf, 3.0, 1e30])
        pick = torch.randint(0, len(junk), (len(slots),), generator=gen)
        log_probs[slots] = junk[pick].to(log_probs.dtype)
        pick = torch.randint(0, len(junk), (len(slots),), generator=gen)
        behavior_log_probs[slots] = junk[pick].to(behavior_log_probs.dtype)
        pick = torch.randint(0, len(junk), (len(slots),), generator=gen)
        entropies[slots] = junk[pick].to(entropies.dtype)
    rewards = (torch.rand(batch, generator=gen) < 0.5).to(torch.float32) + 0.1 * torch.rand(batch, generator=gen)
    failures = torch.rand(batch, generator=gen) < 0.5
    options = {}
    if filter_q is not None:
        options.update(negative_token_fraction=filter_q, entropies=entropies, failures=failures)
    return Batch(log_probs, behavior_log_probs, rewards, cu.to(cu_dtype), mask, entropies, failures, options)


_CTX = decimal.Context(prec=40)
# The clamp bounds in the compute dtype: float64, or float32 for every other input dtype (where
# 1 - 1e-6 rounds to 1 - 1.0133e-6, which matters for p or q at the upper bound).
BOUNDS64 = (PROB_CLAMP, 1.0 - PROB_CLAMP)
BOUNDS32 = (float(torch.tensor(PROB_CLAMP, dtype=torch.float32)),
            float(1 - torch.tensor(PROB_CLAMP, dtype=torch.float32)))


def bernoulli_kl_float64(behavior: float, current: float, bounds=BOUNDS64) -> float:
    """The clamped Bernoulli KL in plain float64 (accurate enough for float32 tolerances)."""
    lo, hi = bounds
    p = min(max(math.exp(behavior), lo), hi)
    q = min(max(math.exp(current), lo), hi)
    return p * (math.log(p) - math.log(q)) + (1.0 - p) * (math.log1p(-p) - math.log1p(-q))


def bernoulli_kl_exact(behavior: float, current: float, bounds=BOUNDS64) -> float:
    """The clamped Bernoulli KL in 40-digit decimal arithmetic, rounded to float64 once.

    The textbook formula cancels when p ~ q, so evaluating it in float64 would itself carry errors
    near the 1e-10 tolerance; 40 digits make the expected value exact to float64 rounding.
    """
    with decimal.localcontext(_CTX):
        lo, hi = decimal.Decimal(bounds[0]), decimal.Decimal(bounds[1])
        p = min(max(decimal.Decimal(behavior).exp(), lo), hi)
        q = min(max(decimal.Decimal(current).exp(), lo), hi)
        d = p * (p.ln() - q.ln()) + (1 - p) * ((1 - p).ln() - (1 - q).ln())
    return float(d)


def k3_exact(behavior: float, current: float) -> float:
    """``e^d - 1 - d`` with ``d = current - behavior``, in 40-digit decimals (no cancellation near 0)."""
    with decimal.localcontext(_CTX):
        d = decimal.Decimal(current) - decimal.Decimal(behavior)
        value = d.exp() - 1 - d
    return float(value)


def gate_term(metric: str, behavior: float, current: float, kl_fn, bounds) -> float:
    """The gate metric's per-token term (docs/semantics.md, "Gate metrics"), from its definition."""
    if metric == "binary_kl":
        return kl_fn(behavior, current, bounds)
    if metric == "kpop":
        return max(kl_fn(behavior, current, bounds), kl_fn(current, behavior, bounds))
    if metric == "k3":
        return k3_exact(behavior, current)
    if metric == "log_ratio":
        return abs(current - behavior)
    raise ValueError(metric)


@dataclass
class Expected:
    loss: float
    grad: torch.Tensor  # float64 [N]
    advantages: torch.Tensor
    sequence_kl: torch.Tensor
    admitted: torch.Tensor
    policy_tokens: torch.Tensor
    retained_tokens: torch.Tensor
    terms: torch.Tensor  # per-trajectory loss terms (float64)


def expected_loss(log_probs, behavior_log_probs, rewards, cu_seqlens, action_mask=None, *, delta=3e-3,
                  negative_token_fraction=1.0, entropies=None, failures=None, reward_baseline=None,
                  num_trajectories=None, loss_agg="seq-mean-token-mean", loss_scale_factor=None,
                  num_policy_tokens=None, no_is=False, gate_metric="binary_kl", is_truncation=math.inf,
                  exact_kl=None) -> Expected:
    """Float64 computation of docs/semantics.md, trajectory by trajectory (packed inputs).

    ``exact_kl`` (default: for float64 inputs) evaluates the KL in 40-digit decimals.
    """
    if exact_kl is None:
        exact_kl = log_probs.dtype == torch.float64
    kl_fn = bernoulli_kl_exact if exact_kl else bernoulli_kl_float64
    bounds = BOUNDS64 if log_probs.dtype == torch.float64 else BOUNDS32
    lp = log_probs.detach().double().tolist()
    blp = behavior_log_probs.detach().double().tolist()
    n = len(lp)
    mask = [True] * n if action_mask is None else action_mask.tolist()
    cu = [int(c) for c in cu_seqlens.tolist()]
    rw = rewards.double().tolist()
    b = len(rw)
    baseline = sum(rw) / b if reward_baseline is None else float(reward_baseline)
    ntraj = b if num_trajectories is None else num_trajectories
    counts = [sum(mask[cu[i]:cu[i + 1]]) for i in range(b)]
    total_policy = sum(counts) if num_policy_tokens is None else num_policy_tokens
    ent = None if entropies is None else entropies.double().tolist()
    grad = [0.0] * n
    adv, kls, adm, ret, terms = [], [], [], [], []
    for i in range(b):
        pos = [t for t in range(cu[i], cu[i + 1]) if mask[t]]
        count = len(pos)
        a = rw[i] - baseline
        if no_is:
            kl = 0.0
        else:
            kl = max(0.0, sum(gate_term(gate_metric, blp[t], lp[t], kl_fn, bounds) for t in pos) / count)
        ok = no_is or kl <= delta
        kept = pos
        if negative_token_fraction < 1.0 and bool(failures[i]):
            k = math.ceil(negative_token_fraction * count)
            kept = sorted(sorted(pos, key=lambda t: (-ent[t], t))[:k])
        if loss_agg == "seq-mean-token-mean":
            s = 1.0 / (count * ntraj)
        elif loss_agg == "token-mean":
            s = 1.0 / total_policy
        else:
            s = 1.0 / (loss_scale_factor * ntraj)
        term = 0.0
        if ok:
            for t in kept:
                rho = 1.0 if no_is else min(math.exp(min(lp[t] - blp[t], 700.0)), is_truncation)
                g = -rho * a * s
                grad[t] = g
                term += g * lp[t]
        adv.append(a)
        kls.append(kl)
        adm.append(ok)
        ret.append(len(kept) if ok else 0)
        terms.append(term)
    return Expected(
        loss=sum(terms),
        grad=torch.tensor(grad, dtype=torch.float64),
        advantages=torch.tensor(adv, dtype=torch.float64),
        sequence_kl=torch.tensor(kls, dtype=torch.float64),
        admitted=torch.tensor(adm),
        policy_tokens=torch.tensor(counts, dtype=torch.int64),
        retained_tokens=torch.tensor(ret, dtype=torch.int64),
        terms=torch.tensor(terms, dtype=torch.float64),
    )


def check_against_expected(loss, grad, stats, exp: Expected, dtype, delta, where=""):
    """Asserts the per-dtype tolerances of docs/semantics.md, section 5 (see the module docstring of the tests)."""
    grad = grad.detach().double()
    scale = max(float(exp.grad.abs().max()), 1e-300)
    term_scale = max(float(exp.terms.abs().sum()), 1e-300)
    assert torch.equal(stats["policy_tokens"].cpu(), exp.policy_tokens), where
    if dtype == torch.float64:
        kl_ok = torch.allclose(stats["sequence_kl"].cpu().double(), exp.sequence_kl, rtol=1e-10, atol=1e-300)
        assert kl_ok, f"{where} sequence_kl {stats['sequence_kl']} vs {exp.sequence_kl}"
        assert torch.equal(stats["admitted"].cpu(), exp.admitted), where
        assert abs(float(loss) - exp.loss) <= 1e-10 * term_scale, f"{where} loss {float(loss)} vs {exp.loss}"
        err = float((grad.cpu() - exp.grad).abs().max())
        assert err <= 1e-10 * scale, f"{where} grad error {err} vs scale {scale}"
        assert torch.allclose(stats["advantages"].cpu().double(), exp.advantages, rtol=1e-12, atol=1e-12), where
        assert torch.equal(stats["retained_tokens"].cpu(), exp.retained_tokens), where
        return
    kl = stats["sequence_kl"].cpu().double()
    assert torch.allclose(kl, exp.sequence_kl, rtol=5e-3, atol=1e-9), f"{where} sequence_kl {kl} vs {exp.sequence_kl}"
    # Admission: the same decisions away from the threshold.
    far = (exp.sequence_kl - delta).abs() > 1e-2 * max(delta, 1e-12) if math.isfinite(delta) else torch.ones_like(kl, dtype=torch.bool)
    assert torch.equal(stats["admitted"].cpu()[far], exp.admitted[far]), where
    if not torch.equal(stats["admitted"].cpu(), exp.admitted):
        return  # a decision flipped at the threshold: gradients legitimately differ there
    assert torch.equal(stats["retained_tokens"].cpu(), exp.retained_tokens), where
    assert abs(float(loss) - exp.loss) <= 1e-5 * term_scale, f"{where} loss {float(loss)} vs {exp.loss}"
    assert torch.allclose(stats["advantages"].cpu().double(), exp.advantages, rtol=1e-6, atol=1e-6), where
    g = grad.cpu()
    if dtype == torch.float32:
        err = float((g - exp.grad).abs().max())
        assert err <= 1e-5 * scale, f"{where} grad error {err} vs scale {scale}"
    else:
        # 16-bit gradients: the float32 result rounded once (half an ulp: 2^-8 / 2^-11 relative,
        # and at most half the subnormal spacing below the normal range: 2^-134 / 2^-25),
        # plus the float32 computation's own 1e-5 of the largest magnitude.
        ulp, subnormal = (2.0 ** -8, 2.0 ** -134) if dtype == torch.bfloat16 else (2.0 ** -11, 2.0 ** -25)
        bound = ulp * exp.grad.abs() + subnormal + 1e-5 * scale
        assert bool(((g - exp.grad).abs() <= bound).all()), f"{where} 16-bit grad outside rounding"
