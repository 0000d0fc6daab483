#!/usr/bin/env python
"""Rollout throughput of the rollout engines side by side, against this machine's decode floor.

    python benchmarks/bench_rollout_engines.py                                  # hf and vLLM, SmolLM2, CPU
    python benchmarks/bench_rollout_engines.py --engines hf --requests 32 --new-tokens 128
    python benchmarks/bench_rollout_engines.py --engines hf --hf-kernels default torch   # fast decode vs forward
    python benchmarks/bench_rollout_engines.py --device cuda --model /path/to/Qwen2.5-0.5B --dtype bf16

For each engine (``--engines``, run one after the other in this process; vLLM's own processes
start inside it), on the policy ``--model`` (default SmolLM2-135M-Instruct, real weights):

* **start**: seconds to build the engine (vLLM: its processes, model and KV cache);
* **weight sync**: seconds and bytes of :meth:`load_weights` of a full version that differs from
  the engine's (every tensor changed), the way the trainer publishes one after each update: the
  first load and the median of ``--sync-repeats`` more; for vLLM also split into the shared-memory
  write in this process and the engine's side (its workers' load and prefix-cache reset); with
  ``--vllm-weight-load direct reload`` the loads alternate between vLLM's CPU kernels built straight
  from the buffer and vLLM's own reload, side by side on one engine, each with its median;
* **tokens/s** for every ``--requests`` x ``--new-tokens`` pair: each call samples ``new tokens``
  for each of ``requests`` distinct chat-templated prompts (temperature 1, no stop token, so every
  request runs to the limit); the median of ``--repeats`` calls after a warm-up call.

Beside each rate: this machine's **floor** for that batch, the fastest a decode step could be, and
the rate as a fraction of it. A step must read every weight once and each request's keys and values
so far (at the measured copy bandwidth) and compute 2 FLOPs per weight per request (at the measured
GEMM peak of the engine's dtype); the floor is the larger of the two times, and the rate at the
floor is ``requests`` tokens per floor step. Two fractions are printed:

* **call**: the whole call's tokens/s (prefill included) against the floor rate, which leaves the
  prefill out: it can only understate;
* **decode step**: the mean decode step, ``(call - prefill) / (new tokens - 1)``, against the floor
  step, where *prefill* is the median time of the same requests with one new token each (the
  prompts' forward and one sampling step), timed beside the call. This is the step-time comparison
  the floor is defined for.

The copy bandwidth and GEMM peak (``benchmarks/common.py``) are measured right before and right
after each row, and each row uses the higher of the two readings: on a machine shared with other
tenants the yardsticks move from minute to minute, and the higher reading gives the lower, safer
fraction. The readings are printed with the row.

``--breakdown`` adds, for each hf engine that decodes with its fast step, one more call per row in
which the step's parts are timed by wrappers around them (no profiler: its per-operation overhead
would dwarf the small operations): the packed products, attention, RMS norms (with the residual
update, in the compiled step), the compiled rotary embedding and SwiGLU activation, the processed
log-probabilities, sampling, and the rest of the step, in milliseconds per decode step (the products
include the prefill's one output projection, spread over the steps).

``--hf-kernels`` runs the hf engine once per choice, one after the other in this process: ``default``
(its defaults: on a CPU, the fast decode step of ``engines/hf/fast_decode.py`` where the model has one,
with the compiled decode attention and the compiled operations between the products),
``torch-glue`` (the same step with PyTorch's operations between the products), ``onednn-products`` (the
same step with oneDNN's products instead of the compiled core's skinny product), ``sdpa`` (the same
step with PyTorch's SDPA attention and operations),
``packed`` (the model's forward with packed linear weights) and ``torch`` (the model's forward with
``F.linear``, the engine before either existed).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import SHAPES, copy_bandwidth, gemm_peak, machine_line, print_table  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

QUESTIONS = ["What is {a} plus {b}? Answer with just the number.",
             "Compute {a} times {b} and give only the result.",
             "If you have {a} apples and eat {b}, how many are left?"]


def build_prompts(tokenizer, n: int) -> list[list[int]]:
    """``n`` distinct chat-templated prompts (token ids)."""
    out = []
    for i in range(n):
        text = QUESTIONS[i % len(QUESTIONS)].format(a=17 + 7 * i, b=3 + i)
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        out.append([int(t) for t in ids])
    return out


def decode_floor(num_params: int, weight_bytes: int, kv_per_token: int, requests: int, mean_context: float,
                 bandwidth: float, peak: float) -> float:
    """Seconds of the fastest decode step for ``requests`` requests (see the module docstring)."""
    memory = (weight_bytes + requests * mean_context * kv_per_token) / bandwidth
    compute = requests * 2 * num_params / peak
    return max(memory, compute)


@contextlib.contextmanager
def timed_decode_parts(acc: dict[str, float]):
    """Within the block, adds the seconds spent in each part of the hf engine's fast decode step and
    sampling to ``acc`` (keys: ``products``, ``attention``, ``rms_norm``, ``log_probs``, ``sampling``,
    ``step``: the whole fast step, products, attention and norms included)."""
    import types

    import torch.nn.functional as F

    import flashreinforce.engines.hf.fast_decode as fast_decode
    import flashreinforce.engines.hf.engine as hf

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[name] = acc.get(name, 0.0) + time.perf_counter() - t0
        return wrapper

    functional = types.ModuleType("timed_functional")
    functional.__dict__.update(F.__dict__)
    functional.scaled_dot_product_attention = timed("attention", F.scaled_dot_product_attention)
    functional.rms_norm = timed("rms_norm", F.rms_norm)
    saved = [(fast_decode, "F", F), (fast_decode, "packed_matmul", fast_decode.packed_matmul),
             (fast_decode, "_norm", fast_decode._norm), (fast_decode, "_rotary", fast_decode._rotary),
             (fast_decode, "_silu_mul", fast_decode._silu_mul),
             (fast_decode, "fused_decode_attention", fast_decode.fused_decode_attention),
             (hf, "sample_tokens", hf.sample_tokens), (hf, "sampling_log_probs", hf.sampling_log_probs),
             (fast_decode.FastDecoder, "step", fast_decode.FastDecoder.step)]
    fast_decode.F = functional
    fast_decode._norm = timed("rms_norm", fast_decode._norm)
    fast_decode._rotary = timed("rotary", fast_decode._rotary)
    fast_decode._silu_mul = timed("activation", fast_decode._silu_mul)
    fast_decode.packed_matmul = timed("products", fast_decode.packed_matmul)
    fast_decode.fused_decode_attention = timed("attention", fast_decode.fused_decode_attention)
    hf.sample_tokens = timed("sampling", hf.sample_tokens)
    hf.sampling_log_probs = timed("log_probs", hf.sampling_log_probs)
    fast_decode.FastDecoder.step = timed("step", fast_decode.FastDecoder.step)
    try:
        yield acc
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def perturbed(state: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """A new version of every tensor (as an optimizer step makes one)."""
    g = torch.Generator().manual_seed(step)
    return {k: v + 1e-4 * torch.randn(v.shape, generator=g, dtype=torch.float32).to(v.dtype) for k, v in state.items()}


#: ``--hf-kernels`` choices: the hf engine's options for each.
HF_KERNELS = {"default": {},
              "torch-glue": {"decode_glue": False},
              "onednn-products": {"product_kernel": "onednn"},
              "sdpa": {"attention_kernel": "sdpa"},
              "packed": {"fast_decode": False, "linear_kernel": "packed"},
              "torch": {"fast_decode": False, "linear_kernel": "torch"}}


def make_engine(kind: str, args, model, checkpoint: Path, max_requests: int, max_len: int, device,
                hf_kernels: str = "default"):
    from flashreinforce.engines import create_engine

    if kind == "hf":
        return create_engine("hf", model, pad_token_id=0, version=0,
                             options={"dtype": args.dtype_name, **HF_KERNELS[hf_kernels]})
    options = dict(dtype=args.dtype_name, max_model_len=max_len, max_num_seqs=max_requests,
                   enforce_eager=args.enforce_eager)
    if device.type == "cuda":
        options["gpu_memory_utilization"] = args.gpu_memory_utilization
    source = checkpoint if not isinstance(checkpoint, Path) else str(checkpoint)  # a config: dummy weights
    return create_engine("vllm", source, pad_token_id=0, version=-1, options=options)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", nargs="+", default=["hf", "vllm"])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="a model shape with random weights instead of --model (random prompts; nothing to read)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--requests", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--new-tokens", type=int, nargs="+", default=[128, 512])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--sync-repeats", type=int, default=3)
    p.add_argument("--vllm-weight-load", nargs="+", default=["direct"], choices=("direct", "reload"),
                   help="vLLM on a CPU: how its worker takes a version; several alternate over the weight syncs of "
                        "one engine (the first sync uses the first), each with its own median")
    p.add_argument("--enforce-eager", action="store_true", help="vLLM: no compilation (faster start)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--threads", type=int, default=None, help="torch threads of this process")
    p.add_argument("--breakdown", action="store_true",
                   help="hf engine with its fast decode step: one more call per row with the step's parts timed")
    p.add_argument("--hf-kernels", nargs="+", default=["default"], choices=sorted(HF_KERNELS),
                   help="run the hf engine once per choice, one after the other: default (its defaults), packed "
                        "(the model's forward with packed linear weights), torch (the model's forward, F.linear)")
    args = p.parse_args()
    args.dtype_name = {"fp32": "float32", "bf16": "bfloat16"}[args.dtype]
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    import transformers

    from flashreinforce.models.loading import build_model, checkpoint_directory

    if args.shape:  # random weights from a config, random prompts: no file needed (a GPU machine)
        cfg = dict(SHAPES[args.shape])
        model_type = cfg.pop("model_type")
        config = transformers.AutoConfig.for_model(model_type, **cfg)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).to(device=device, dtype=torch.float32).eval()
        checkpoint, tokenizer = config, None
    else:
        checkpoint = checkpoint_directory(args.model)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
        model, _ = build_model(str(checkpoint), device=device)
    num_params = sum(p.numel() for p in model.parameters())  # tied weights counted once
    weight_bytes = num_params * DTYPES[args.dtype].itemsize
    from flashreinforce.engines.vllm import kv_bytes_per_token

    kv_per_token = kv_bytes_per_token(model.config, DTYPES[args.dtype])
    bandwidth = copy_bandwidth(device)
    peak = gemm_peak(device, DTYPES[args.dtype])
    print(f"machine: {machine_line(device)}")
    print(f"model: {args.model} ({num_params / 1e6:.1f}M parameters, {weight_bytes / 2**20:.0f} MiB in {args.dtype}); "
          f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; {args.dtype} GEMM peak {peak / 1e9:.0f} GFLOP/s (measured)")
    if tokenizer is None:
        g = torch.Generator().manual_seed(1)
        prompts_all = [torch.randint(100, model.config.vocab_size, (40 + i % 20,), generator=g).tolist()
                       for i in range(max(args.requests))]
    else:
        prompts_all = build_prompts(tokenizer, max(args.requests))
    max_len = max(len(x) for x in prompts_all) + max(args.new_tokens) + 8
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    from flashreinforce.engines import GenerationRequest, SamplingParams

    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, stop_token_ids=())
    starts, syncs, rows, breakdowns = [], [], [], []
    from flashreinforce.engines import engine_kind

    runs = [(kind, k) for kind in args.engines for k in (args.hf_kernels if kind == "hf" else [None])]
    for kind, hf_kernels in runs:
        try:
            engine_kind(kind).check_installed()
        except ImportError as err:
            print(f"  {kind}: skipped ({err})")
            continue
        t0 = time.perf_counter()
        engine = make_engine(kind, args, model if kind != "hf" else type(model)(model.config).to(device).eval(),
                             checkpoint, max(args.requests), max_len, device, hf_kernels or "default")
        start = time.perf_counter() - t0
        if kind == "hf":
            glue = "compiled" if getattr(engine, "decode_glue_in_use", False) else "PyTorch"
            decode = (f"fast decode, {engine.product_kernel_in_use} products, {engine.attention_kernel_in_use} attention, "
                      f"{glue} glue" if engine.fast_decode_in_use
                      else f"model forward, {engine.linear_kernel_in_use} linear")
            kind = f"hf ({decode})"
        try:
            t_sync, parts = [], []
            paths = args.vllm_weight_load if kind == "vllm" else [None]
            for r in range(1 + args.sync_repeats * len(paths)):
                new = perturbed(state, r)
                if paths[0] is not None:
                    engine.cpu_weight_load = paths[r % len(paths)]
                t1 = time.perf_counter()
                engine.load_weights(new, r + 1)
                t_sync.append(time.perf_counter() - t1)
                parts.append(dict(getattr(engine, "last_load_parts", {}), asked=paths[r % len(paths)]))
            sync_bytes = engine.last_load[1] or sum(v.numel() * DTYPES[args.dtype].itemsize for v in state.values())
            if paths[0] is not None:
                engine.cpu_weight_load = paths[0]
            engine.load_weights(state, 10_000)  # the real weights for sampling
            starts.append([kind, f"{start:.1f}" + (f" (buffer {engine.prepare_s:.2f})" if kind == "vllm" else "")])
            for path in paths:
                mine = [k for k in range(1, len(t_sync)) if parts[k]["asked"] == path]
                split = "-"
                if all(parts[k].get("write_s") is not None for k in mine):  # vLLM: this process's write, the engine's
                    split = (f"{statistics.median(parts[k]['write_s'] for k in mine):.3f} / "
                             f"{statistics.median(parts[k]['engine_s'] for k in mine):.3f}")
                used = sorted({str(parts[k].get("path")) for k in mine}) if path else []
                syncs.append([kind + (f", {path} load (ran: {'/'.join(used)})" if path else ""),
                              f"{t_sync[0]:.3f}" if parts[0]["asked"] == path else "-",
                              f"{statistics.median(t_sync[k] for k in mine):.3f}", split,
                              f"{sync_bytes / 2**20:.0f}"])
            for n in args.requests:
                for new_tokens in args.new_tokens:
                    reqs = [GenerationRequest(prompts_all[i], new_tokens, seed=i) for i in range(n)]
                    firsts = [GenerationRequest(prompts_all[i], 1, seed=i) for i in range(n)]
                    engine.generate(reqs[: min(n, 4)], params)  # warm-up
                    before = (copy_bandwidth(device), gemm_peak(device, DTYPES[args.dtype]))
                    times, prefills = [], []
                    for _ in range(args.repeats):
                        t1 = time.perf_counter()
                        engine.generate(firsts, params)
                        prefills.append(time.perf_counter() - t1)
                        t1 = time.perf_counter()
                        gens = engine.generate(reqs, params)
                        times.append(time.perf_counter() - t1)
                        made = sum(len(g.token_ids) for g in gens)
                    after = (copy_bandwidth(device), gemm_peak(device, DTYPES[args.dtype]))
                    bw, pk = max(before[0], after[0]), max(before[1], after[1])
                    call, prefill = statistics.median(times), statistics.median(prefills)
                    rate = made / call
                    ctx = statistics.mean(len(x) for x in prompts_all[:n]) + new_tokens / 2
                    floor_step = decode_floor(num_params, weight_bytes, kv_per_token, n, ctx, bw, pk)
                    floor = n / floor_step
                    step = (call - prefill) / max(new_tokens - 1, 1)
                    rows.append([kind, str(n), str(new_tokens), f"{rate:.0f}", f"{floor:.0f}", f"{rate / floor:.2f}",
                                 f"{prefill:.2f}", f"{step * 1e3:.1f}", f"{floor_step * 1e3:.1f}",
                                 f"{floor_step / step:.2f}", f"{bw / 1e9:.1f} / {pk / 1e9:.0f}"])
                    if args.breakdown and getattr(engine, "fast_decode_in_use", False):
                        acc: dict[str, float] = {}
                        with timed_decode_parts(acc):
                            t1 = time.perf_counter()
                            engine.generate(reqs, params)
                            timed_call = time.perf_counter() - t1
                        steps = max(new_tokens - 1, 1)
                        ms = {k: v / steps * 1e3 for k, v in acc.items()}
                        glue = ms.get("rotary", 0.0) + ms.get("activation", 0.0)
                        other = ms["step"] - ms["products"] - ms["attention"] - ms.get("rms_norm", 0.0) - glue
                        breakdowns.append([kind, str(n), str(new_tokens), f"{(timed_call - prefill) / steps * 1e3:.1f}",
                                           f"{ms['products']:.1f}", f"{ms['attention']:.1f}",
                                           f"{ms.get('rms_norm', 0.0):.1f}", f"{glue:.1f}", f"{other:.1f}",
                                           f"{ms['log_probs']:.1f}", f"{ms['sampling']:.1f}"])
                    print(f"  {kind}: {n} requests x {new_tokens} tokens: {rate:.0f} tokens/s "
                          f"(floor {floor:.0f}, {rate / floor:.2f}); prefill {prefill:.2f} s, decode step "
                          f"{step * 1e3:.1f} ms against a floor of {floor_step * 1e3:.1f} ms "
                          f"({floor_step / step:.2f}); "
                          f"copy {bw / 1e9:.1f} GB/s, peak {pk / 1e9:.0f} GFLOP/s", flush=True)
        finally:
            engine.close()
    print_table("Engine start", ["engine", "start s"], starts)
    print_table("Weight sync (a full version, every tensor changed)",
                ["engine", "first s", "median s", "median write s / engine s", "MiB sent"], syncs)
    print_table(f"Rollout throughput ({args.dtype}, temperature 1, no stop token)",
                ["engine", "requests", "new tokens", "tokens/s", "floor tokens/s", "call, of floor", "prefill s",
                 "decode step ms", "floor step ms", "step, of floor", "GB/s / GFLOP/s"], rows)
    if breakdowns:
        print_table("Where a decode step goes (ms per step; the timed call's step, then its parts)",
                    ["engine", "requests", "new tokens", "decode step", "products", "attention", "RMS norms",
                     "compiled rotary + SwiGLU", "rest of the fast step", "log-probs", "sampling"], breakdowns)


if __name__ == "__main__":
    main()
