#!/usr/bin/env python
"""Decode throughput of the hf rollout engine against its memory roofline.

    python benchmarks/bench_engine_decode.py --device cuda --shape qwen2.5-0.5b --dtype bf16 --batch 256
    python benchmarks/bench_engine_decode.py --device cpu --shape smollm2-135m --batch 32 --new-tokens 32

:class:`flashreinforce.engines.HFEngine` generates ``--new-tokens`` tokens for each of ``--batch``
requests with distinct random prompts of ``--prompt-len`` tokens (the first ``--shared-prefix`` of
them, default 0, the same in every prompt; each prompt up to ``--prompt-spread`` tokens shorter, so
that the batch is padded and attention gets a mask, as in rollouts; no stop token: every request
runs to the limit), on a model of the given shape with random weights (from a config,
nothing downloaded), cast to ``--dtype``. Timed, over ``--repeats`` calls after one warm-up: the
whole ``generate`` call, the prefill (from the call's start to its first one-token forward), and
every decode step (the time between the starts of two successive one-token forwards: the forward,
the sampling and the engine's bookkeeping); medians. The decode rate is ``batch`` tokens per
median step. ``--kv-cache`` takes one or
both of the engine's caches (``preallocated``, the default, and transformers' ``dynamic`` one): a row
each, measured side by side in one process; ``--decode-attention on off`` does the same for the engine's
grouped decode attention against transformers' SDPA attention (rows: every combination).
``--rounds`` repeats the whole set of variants, interleaved, so that drifts of a shared machine fall
on every variant alike; the table gives the range of the rounds' medians beside the overall median.

The roofline: a decode step must read every weight once and each request's keys and values so far,
so at the device's copy bandwidth (measured here: a large device-to-device copy, bytes read plus
bytes written over the time) the fastest decode is ``batch`` tokens per
``(weight bytes + mean KV bytes) / bandwidth``. The table gives both and their ratio; the
compute bound (2 FLOPs per parameter per token) is far above it at these batch sizes.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import SHAPES, copy_bandwidth, print_table, sync  # noqa: E402
from flashreinforce.engines.hf.decode_attention import ATTENTION_NAME  # noqa: E402
from flashreinforce.engines.hf import KV_CACHES  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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


def timed_generate(engine, requests, params, device: torch.device, repeats: int,
                   warm_up: bool = True) -> tuple[list[float], list[float], list[float]]:
    """Seconds of each whole call, of each prefill, and of every decode step (module docstring)."""
    starts: list[tuple[float, int]] = []  # (time, query length) of every forward of the model

    def record(module, args, kwargs):
        starts.append((time.perf_counter(), kwargs["input_ids"].shape[1]))

    handle = engine.model.register_forward_pre_hook(record, with_kwargs=True)
    calls, prefills, steps = [], [], []
    try:
        if warm_up:
            engine.generate(requests, params)
        for _ in range(repeats):
            starts.clear()
            sync(device)
            t0 = time.perf_counter()
            engine.generate(requests, params)
            sync(device)
            calls.append(time.perf_counter() - t0)
            decode = [t for t, q_len in starts if q_len == 1]
            if decode:
                prefills.append(decode[0] - t0)
                steps.extend(b - a for a, b in zip(decode, decode[1:]))
    finally:
        handle.remove()
    return calls, prefills, steps


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


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
    p.add_argument("--repeats", type=int, default=3, help="timed generate calls per variant and round")
    p.add_argument("--rounds", type=int, default=1, help="rounds of every variant, interleaved (the table gives "
                   "the range of the rounds' medians)")
    p.add_argument("--prompt-spread", type=int, default=0, help="prompts are up to this many tokens shorter than "
                   "--prompt-len (uniform): left padding, so the engine passes an attention mask, as in rollouts")
    p.add_argument("--shared-prefix", type=int, default=0, help="tokens at the start of every prompt that are the "
                   "same (the engine prefills them once; a long context at a small prefill cost)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--kv-cache", nargs="+", choices=KV_CACHES, default=list(KV_CACHES),
                   help="the engine's KV cache(s), a row each (default: both)")
    p.add_argument("--decode-attention", nargs="+", choices=("on", "off"), default=["on"],
                   help="the engine's grouped decode attention (on) or transformers' SDPA attention (off), a row each")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--copy-mib", type=int, default=None, help="size of the bandwidth probe (default 1024 on CUDA, "
                   "256 on a CPU)")
    args = p.parse_args(argv)
    if not 0 <= args.shared_prefix < args.prompt_len:
        p.error(f"--shared-prefix must lie in [0, --prompt-len), got {args.shared_prefix}")
    if not 0 <= args.prompt_spread < args.prompt_len - args.shared_prefix:
        p.error(f"--prompt-spread must lie in [0, --prompt-len - --shared-prefix), got {args.prompt_spread}")
    for name in ("prompt_len", "new_tokens", "repeats", "rounds"):
        if getattr(args, name) < (2 if name == "new_tokens" else 1):
            p.error(f"--{name.replace('_', '-')} must be at least {2 if name == 'new_tokens' else 1}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    from flashreinforce.engines import GenerationRequest, SamplingParams

    import transformers

    engine, config = build_engine(args.shape, args.layers, dtype, device, args.prompt_len + args.new_tokens + 8)
    weight_bytes = sum(t.numel() * t.element_size() for t in engine.model.parameters())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    bandwidth = copy_bandwidth(device, args.copy_mib or (1024 if device.type == "cuda" else 256))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"# bench_engine_decode: {where}, torch {torch.__version__}; shape {args.shape} "
          f"({config.num_hidden_layers} layers), {str(dtype).replace('torch.', '')} weights "
          f"({weight_bytes / 2**20:,.0f} MiB), prompts of {args.prompt_len} tokens (up to {args.prompt_spread} fewer; {args.shared_prefix} shared), "
          f"{args.new_tokens} new tokens; transformers {transformers.__version__}; "
          f"copy bandwidth {bandwidth / 1e9:,.1f} GB/s")
    params = SamplingParams(temperature=args.temperature, top_p=1.0)
    rows = []
    variants = list(itertools.product(args.kv_cache, args.decode_attention))
    for batch in args.batch:
        gen = torch.Generator().manual_seed(batch)
        shared = torch.randint(3, config.vocab_size, (args.shared_prefix,), generator=gen).tolist()
        cut = torch.randint(0, args.prompt_spread + 1, (batch,), generator=gen).tolist()
        prompts = [shared + torch.randint(3, config.vocab_size, (args.prompt_len - args.shared_prefix - c,),
                                          generator=gen).tolist() for c in cut]
        full = [GenerationRequest(pr, args.new_tokens, seed=i) for i, pr in enumerate(prompts)]
        samples = {v: ([], [], [], []) for v in variants}  # calls, prefills, steps, per-round step medians
        caches_used = {}  # the cache each variant really ran (the engine falls back to the dynamic one)
        for round_index in range(args.rounds):  # the variants interleaved, round after round
            for kv_cache, attention in variants:
                engine.kv_cache = kv_cache
                engine.model.set_attn_implementation(ATTENTION_NAME if attention == "on" else "sdpa")
                calls, prefills, steps = timed_generate(engine, full, params, device, args.repeats,
                                                        warm_up=round_index == 0)
                caches_used[(kv_cache, attention)] = engine.kv_cache_in_use
                got = samples[(kv_cache, attention)]
                got[0].extend(calls)
                got[1].extend(prefills)
                got[2].extend(steps)
                got[3].append(median(steps))
        mean_context = args.prompt_len - args.prompt_spread / 2 + args.new_tokens / 2
        step_bytes = weight_bytes + batch * mean_context * kv_per_token
        roofline = batch * bandwidth / step_bytes
        for (kv_cache, attention), (calls, prefills, steps, per_round) in samples.items():
            t_step = median(steps)
            rate = batch / t_step
            spread = f"{min(per_round) * 1e3:,.1f}-{max(per_round) * 1e3:,.1f}" if len(per_round) > 1 else "-"
            rows.append([str(batch), caches_used[(kv_cache, attention)], ATTENTION_NAME if attention == "on" else "sdpa",
                         f"{median(prefills) * 1e3:,.1f}", f"{median(calls):,.2f}", f"{t_step * 1e3:,.2f}", spread,
                         f"{rate:,.0f}", f"{roofline:,.0f}", f"{rate / roofline:.1%}"])
        del full
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_table(f"hf engine decode (medians of {args.rounds} round(s) x {args.repeats} call(s))",
                ["batch", "kv cache", "attention", "prefill ms", "generate s", "ms per decode step",
                 "rounds' step medians ms", "decode tokens/s", "roofline tokens/s", "of roofline"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
