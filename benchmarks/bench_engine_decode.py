#!/usr/bin/env python
"""Decode throughput of the hf rollout engine against its memory roofline.

    python benchmarks/bench_engine_decode.py --device cuda --shape qwen2.5-0.5b --dtype bf16 --batch 256
    python benchmarks/bench_engine_decode.py --device cpu --shape smollm2-135m --batch 32 --new-tokens 32

:class:`flashreinforce.engines.HFEngine` generates ``--new-tokens`` tokens for each of ``--batch``
requests with distinct random prompts of ``--prompt-len`` tokens (no shared prefix, no stop token:
every request runs to the limit), on a model of the given shape with random weights (from a config,
nothing downloaded), cast to ``--dtype``. Timed: the whole ``generate`` call (median of
``--repeats`` after one warm-up), and the same call with one new token (the prefill and one step);
the decode rate is ``batch * (new_tokens - 1)`` tokens over the difference.

The roofline: a decode step must read every weight once and each request's keys and values so far,
so at the device's copy bandwidth (measured here: a large device-to-device copy, bytes read plus
bytes written over the time) the fastest decode is ``batch`` tokens per
``(weight bytes + mean KV bytes) / bandwidth``. The table gives both and their ratio; the
compute bound (2 FLOPs per parameter per token) is far above it at these batch sizes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_loss_cpu import print_table  # noqa: E402
from bench_packed_forward import SHAPES  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, mib: int) -> float:
    """Bytes per second of a device-to-device copy of ``mib`` MiB (read + write counted), best of 5."""
    src = torch.empty(mib * 2**20 // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best


def build_engine(shape: str, layers: int | None, dtype: torch.dtype, device: torch.device, max_positions: int):
    import transformers

    from flashreinforce.engines import HFEngine

    cfg = dict(SHAPES[shape])
    if layers:
        cfg["num_hidden_layers"] = layers
    model_type = cfg.pop("model_type")
    cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"], max_positions)
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **cfg)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(dtype).to(device)
    return HFEngine(model, pad_token_id=0), config


def timed_generate(engine, requests, params, device: torch.device, repeats: int) -> float:
    engine.generate(requests, params)  # warm-up
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        engine.generate(requests, params)
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    p.add_argument("--layers", type=int, default=None, help="layers (default: the shape's)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="engine weights (default bf16 on CUDA, "
                   "fp32 on a CPU)")
    p.add_argument("--batch", type=int, nargs="+", default=[256], help="requests per generate call (several: one "
                   "row each)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--copy-mib", type=int, default=None, help="size of the bandwidth probe (default 1024 on CUDA, "
                   "256 on a CPU)")
    args = p.parse_args(argv)
    for name in ("prompt_len", "new_tokens", "repeats"):
        if getattr(args, name) < (2 if name == "new_tokens" else 1):
            p.error(f"--{name.replace('_', '-')} must be at least {2 if name == 'new_tokens' else 1}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    from flashreinforce.engines import GenerationRequest, SamplingParams

    engine, config = build_engine(args.shape, args.layers, dtype, device, args.prompt_len + args.new_tokens + 8)
    weight_bytes = sum(t.numel() * t.element_size() for t in engine.model.parameters())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    bandwidth = copy_bandwidth(device, args.copy_mib or (1024 if device.type == "cuda" else 256))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"# bench_engine_decode: {where}, torch {torch.__version__}; shape {args.shape} "
          f"({config.num_hidden_layers} layers), {str(dtype).replace('torch.', '')} weights "
          f"({weight_bytes / 2**20:,.0f} MiB), prompts of {args.prompt_len} tokens, {args.new_tokens} new tokens; "
          f"copy bandwidth {bandwidth / 1e9:,.1f} GB/s")
    params = SamplingParams(temperature=args.temperature, top_p=1.0)
    rows = []
    for batch in args.batch:
        gen = torch.Generator().manual_seed(batch)
        prompts = [torch.randint(3, config.vocab_size, (args.prompt_len,), generator=gen).tolist() for _ in range(batch)]
        full = [GenerationRequest(pr, args.new_tokens, seed=i) for i, pr in enumerate(prompts)]
        one = [GenerationRequest(pr, 1, seed=i) for i, pr in enumerate(prompts)]
        t_full = timed_generate(engine, full, params, device, args.repeats)
        t_one = timed_generate(engine, one, params, device, args.repeats)
        decode_s = max(1e-9, t_full - t_one)
        rate = batch * (args.new_tokens - 1) / decode_s
        mean_context = args.prompt_len + args.new_tokens / 2
        step_bytes = weight_bytes + batch * mean_context * kv_per_token
        roofline = batch * bandwidth / step_bytes
        rows.append([str(batch), f"{t_one * 1e3:,.1f}", f"{t_full:,.2f}", f"{rate:,.0f}", f"{roofline:,.0f}",
                     f"{rate / roofline:.1%}", f"{decode_s / (args.new_tokens - 1) * 1e3:,.2f}"])
        del full, one
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_table("hf engine decode (median of repeats)",
                ["batch", "prefill + 1 step ms", "generate s", "decode tokens/s", "roofline tokens/s",
                 "of roofline", "ms per step"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
