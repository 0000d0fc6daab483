"""One real learner step with the fused loss against the same step with the eager PyTorch loss.

The learner step is :meth:`flashreinforce.trainer.learning.learner.Learner.step` as the trainer calls it:
packed micro-batches, the model's forward, the chunked log-probabilities of the sampled tokens,
the loss, backward, gradient clipping and one AdamW step. Two loss implementations are compared
inside it, on the same model weights and the same batch:

* ``fused``: the registered ``flash_reinforce`` loss mode (the compiled op, CPU or CUDA path);
* ``eager``: a loss mode registered by this script only, identical except that it calls the
  package's pure-PyTorch reference (:mod:`flashreinforce.ops.reference`) instead of the op.

For each it prints the median step time, the time of the loss alone (forward + backward on the
step's first micro-batch, outside the step), the loss's share of the step, the model TFLOP/s and
MFU of the step (the learner's ``model_flops`` over the median step time; MFU where the GPU's peak
is known, :mod:`flashreinforce.trainer.learning.flops`), and the first step's loss and gradient norm (the
two implementations must agree: same weights, same batch).

Model shapes (random weights from a config: nothing is downloaded):

* ``tiny``: the toy presets' model size (hidden 32, 2 layers, vocabulary 64);
* ``qwen2.5-0.5b``: Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads / 2 KV heads,
  vocabulary 151,936), bfloat16 autocast, float32 master weights.

    python benchmarks/bench_learner_step.py --device cuda --shape qwen2.5-0.5b
    python benchmarks/bench_learner_step.py --device cpu --shape tiny --batch 32 --mean-len 64
    python benchmarks/bench_learner_step.py --device cuda --shape qwen2.5-0.5b --profile   # where the time goes

``--profile`` runs one more fused step under ``torch.profiler`` (``common.profile_breakdown``) and prints
its device time by category (matrix products, attention, fused loss, elementwise, copies,
optimizer), the share of the step the device was busy, and the heaviest kernels.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from flashreinforce.objective import LossOptions
from flashreinforce.ops.logprobs import wide_gemm_available
from flashreinforce.ops import reference
from flashreinforce.ops.loss_modes import FlashReinforceLoss, get_loss_mode, register_loss_mode
from flashreinforce.trainer.learning.learner import Learner, LearnerSettings
from flashreinforce.trainer.learning.packing import micro_batches
from flashreinforce.trainer.learning.scoring import token_log_probs
from flashreinforce.trainer.rollout.trajectory import Trajectory

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, profile_breakdown, sync  # noqa: E402

SHAPES = {
    "tiny": dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(vocab_size=151_936, hidden_size=896, intermediate_size=4_864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
}


class _Recording(FlashReinforceLoss):
    """The fused mode, remembering the first micro-batch it saw (for the loss-only timing)."""

    name = "bench_fused"
    seen = None

    def loss(self, mb, batch, options):
        if type(self).seen is None:
            type(self).seen = (mb, batch, options)
        return super().loss(mb, batch, options)


class _Eager(_Recording):
    """The same loss mode computed by the pure-PyTorch reference instead of the compiled op."""

    name = "bench_eager"

    def implementation(self):
        return reference.flashreinforce_loss_packed


for _mode in (_Recording, _Eager):
    register_loss_mode(_mode)


def build_model(args, device: torch.device) -> Qwen2ForCausalLM:
    """The benchmark's model: random weights of ``args.shape`` from seed 0 (the same every call)."""
    torch.manual_seed(0)
    cfg = Qwen2Config(max_position_embeddings=4 * args.mean_len + 64, **SHAPES[args.shape])
    return Qwen2ForCausalLM(cfg).to(device)


def make_trajectories(args, device: torch.device, seed: int = 1) -> list[Trajectory]:
    """``args.batch`` trajectories with lognormal lengths around ``args.mean_len``: a prompt of a
    quarter of the length, then sampled tokens (action mask on), 0/1 rewards. The behavior
    log-probabilities are the benchmark model's own, with a little noise, as after one update of
    asynchronous training: most trajectories pass the trust gate, some do not."""
    rng = random.Random(seed)
    vocab = SHAPES[args.shape]["vocab_size"]
    out = []
    for _ in range(args.batch):
        length = max(8, int(args.mean_len * math.exp(rng.gauss(0, 0.5) - 0.125)))
        prompt = max(1, length // 4)
        tokens = [rng.randrange(3, vocab) for _ in range(length)]
        mask = [i >= prompt for i in range(length)]
        reward = float(rng.random() < 0.5)
        out.append(Trajectory(tokens, mask, [0.0] * length, reward=reward, failed=reward < 0.5))
    model = build_model(args, device).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mb in micro_batches(out, max_tokens=args.micro_batch_tokens):
            logp, _ = token_log_probs(model, mb)
            logp = logp.cpu().double()
            noisy = (logp + args.behavior_noise * torch.randn(logp.shape, generator=gen, dtype=torch.float64))
            noisy = noisy.clamp(max=0.0)
            for j, row in enumerate(mb.rows):
                lo, hi = int(mb.cu_seqlens[j]), int(mb.cu_seqlens[j + 1])
                t = out[row]
                t.behavior_log_probs = [float(v) if m else 0.0 for v, m in zip(noisy[lo:hi].tolist(), t.action_mask)]
    del model
    return out


def run(impl: str, args, trajectories, device: torch.device) -> dict:
    model = build_model(args, device)
    settings = LearnerSettings(loss_mode=impl, loss=LossOptions(delta=args.delta), lr=1e-6, temperature=1.0,
                               micro_batch_tokens=args.micro_batch_tokens, total_steps=args.steps + 2,
                               param_dtype=args.param_dtype, head_operand_dtype=args.head_operand_dtype)
    learner = Learner(model, settings)
    mode = type(get_loss_mode(impl))
    mode.seen = None
    first = learner.step(trajectories)  # also the warm-up (allocator, kernels, autotuning)
    learner.step(trajectories)
    times = []
    for _ in range(args.steps):
        sync(device)
        t0 = time.perf_counter()
        learner.step(trajectories)
        sync(device)
        times.append(time.perf_counter() - t0)
    profile = None
    if args.profile and impl == "bench_fused":
        profile = profile_breakdown(lambda: learner.step(trajectories), device)
    mb, batch, options = mode.seen
    loss_mode = get_loss_mode(impl)

    def loss_only():
        lp = mb.log_probs.detach().clone().requires_grad_()
        loss, _, _ = loss_mode.loss(dataclasses.replace(mb, log_probs=lp), batch, options)
        loss.backward()

    for _ in range(3):
        loss_only()
    loss_times = []
    for _ in range(max(5, args.steps)):
        sync(device)
        t0 = time.perf_counter()
        loss_only()
        sync(device)
        loss_times.append(time.perf_counter() - t0)
    result = dict(step_s=statistics.median(times), loss_s=statistics.median(loss_times), loss=first["loss"],
                  grad_norm=first["grad_norm"], acceptance=first["acceptance_rate"], mb_tokens=mb.log_probs.numel(),
                  flops=first["model_flops"], peak=learner.peak_flops, profile=profile)
    del learner, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    p.add_argument("--batch", type=int, default=64, help="trajectories per step (default 64)")
    p.add_argument("--mean-len", type=int, default=1024, help="mean trajectory length in tokens (default 1024)")
    p.add_argument("--micro-batch-tokens", type=int, default=16_384, help="tokens per micro-batch (default 16384)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per implementation (default 5)")
    p.add_argument("--delta", type=float, default=3e-3, help="trust threshold (default 3e-3)")
    p.add_argument("--behavior-noise", type=float, default=0.05,
                   help="std of the noise added to the model's own log-probs to make behavior ones (default 0.05)")
    p.add_argument("--param-dtype", default=None, help="autocast dtype: fp32 or bf16 (default bf16 on CUDA)")
    p.add_argument("--head-operand-dtype", default="float32",
                   help="operands of the output projection's GEMMs: float32 (default), bf16, fp16 or auto "
                        "(train.head_operand_dtype)")
    p.add_argument("--skip-eager", action="store_true", help="time the fused loss only (no eager reference)")
    p.add_argument("--profile", action="store_true",
                   help="also profile one more fused step: device time by category, busy share, heaviest kernels")
    args = p.parse_args()
    device = torch.device(args.device)
    args.param_dtype = args.param_dtype or ("bf16" if device.type == "cuda" else "fp32")
    trajectories = make_trajectories(args, device)
    tokens = sum(t.num_tokens for t in trajectories)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"# bench_learner_step: {where}, torch {torch.__version__}; shape {args.shape}, B = {args.batch}, "
          f"{tokens:,} tokens, micro-batches of <= {args.micro_batch_tokens:,} tokens, {args.param_dtype}, "
          f"output-projection operands {args.head_operand_dtype}"
          + ("" if args.head_operand_dtype in ("float32", "fp32") else
             f" (float32-result low-precision GEMM on this device: {wide_gemm_available(device)})"))
    impls = ("bench_fused",) if args.skip_eager else ("bench_fused", "bench_eager")
    results = {impl: run(impl, args, trajectories, device) for impl in impls}
    fused, eager = results["bench_fused"], results.get("bench_eager")
    rows = []
    for label, r in (("fused op", fused), ("eager PyTorch (reference)", eager)):
        if r is None:
            continue
        rate = r["flops"] / r["step_s"]
        mfu = f"{rate / r['peak']:.1%}" if r["peak"] else "-"
        rows.append([label, f"{r['step_s'] * 1e3:.1f}", f"{r['loss_s'] * 1e3:.3f}", f"{r['loss_s'] / r['step_s']:.2%}",
                     f"{r['step_s'] / fused['step_s']:.3f}x", f"{rate / 1e12:.3g}", mfu, f"{r['loss']:.6g}",
                     f"{r['grad_norm']:.6g}"])
    print_table(f"learner step (median of {args.steps}); loss alone: forward + backward on the first micro-batch "
                f"({fused['mb_tokens']:,} tokens)",
                ["loss", "step ms", "loss ms", "loss share", "step vs fused", "model TFLOP/s", "MFU", "first loss",
                 "first grad norm"], rows)
    if eager is not None:
        print_agreement(fused, eager)
    if fused["profile"]:
        print_profile(fused["profile"], device)


def print_agreement(fused: dict, eager: dict) -> None:
    """The two implementations' first steps (same weights, same batch) and the loss-alone speed-up."""
    rel = abs(fused["grad_norm"] - eager["grad_norm"]) / max(1e-30, abs(eager["grad_norm"]))
    print(f"first step: |loss fused - eager| = {abs(fused['loss'] - eager['loss']):.2e}, grad norm relative "
          f"difference {rel:.2e}, acceptance {fused['acceptance']:.3f} / {eager['acceptance']:.3f}; "
          f"loss alone: fused {eager['loss_s'] / fused['loss_s']:.1f}x faster than eager")


def print_profile(prof: dict, device: torch.device) -> None:
    """The profiled step as two tables: time by category, then the heaviest kernels / operators."""
    what = "kernel time on the GPU" if device.type == "cuda" else "operator self time (CPU threads summed)"
    print_table(f"one fused step profiled: {prof['wall_ms']:.1f} ms wall, {prof['busy_ms']:.1f} ms {what} "
                f"(busy {prof['busy_share']:.1%} of the wall time)",
                ["category", "ms", "share"],
                [[name, f"{ms:.1f}", f"{share:.1%}"] for name, ms, share in prof["categories"]])
    print_table("heaviest " + ("kernels" if device.type == "cuda" else "operators"), ["name", "calls", "ms"],
                [[name if len(name) <= 90 else name[:87] + "...", str(calls), f"{ms:.1f}"]
                 for name, calls, ms in prof["top"]])


if __name__ == "__main__":
    main()
