#!/usr/bin/env python
"""A real ``flashreinforce train`` run on a model of a published shape, for its throughput.

    python benchmarks/bench_train_throughput.py --output build/train_qwen05 --device cuda --shape qwen2.5-0.5b
    python benchmarks/bench_train_throughput.py --output /tmp/train_check --device cpu --layers 2 --updates 3 \\
        --batch 8 --new-tokens 8     # a check on a CPU

The model has the shape's configuration with random weights (nothing is downloaded). Its tokenizer
is a word-level one with a word per id of the model's vocabulary (``t0``, ``t1``, ...), written
next to the run, so any token the random model samples decodes. The environment is the toy copy
task (``--preset toy``); the random policy almost never ends a turn, so every trajectory runs to
``--new-tokens``: a batch has about ``batch * new_tokens`` tokens. The rewards carry no signal to
speak of; the run is for speed: the trainer as users run it, asynchronous rollouts on the same
device as the learner, one update per batch.

Reported from ``metrics.jsonl`` over the updates after the first (start-up excluded): tokens per
second, the learner's model TFLOP/s and MFU (``learner_tflops``, ``mfu``), the learner's share of
the wall clock (computing, and idle waiting for a batch), the rollout workers' idle share and the
policy lag.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))

from arith_curve import cli, read_jsonl  # noqa: E402
from common import SHAPES, print_table  # noqa: E402


def write_model_and_tokenizer(out: Path, shape: str, layers: int | None) -> tuple[Path, Path]:
    """``out/model.json`` (the shape's config) and ``out/tokenizer/`` (one word per vocabulary id)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    cfg = dict(SHAPES[shape])
    if layers:
        cfg["num_hidden_layers"] = layers
    out.mkdir(parents=True, exist_ok=True)
    model_path = out / "model.json"
    model_path.write_text(json.dumps(cfg, indent=1))
    tok_dir = out / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        vocab = {f"t{i}": i for i in range(cfg["vocab_size"])}
        core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t3"))
        core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="t3", pad_token="t0", eos_token="t1",
                                      bos_token="t2")
        tok.save_pretrained(str(tok_dir))
    return model_path, tok_dir


def summarize(metrics: list[dict]) -> dict:
    kept = metrics[1:] or metrics
    wall = sum(float(m["step_time_s"]) for m in kept)

    def avg(key):
        values = [float(m[key]) for m in kept if key in m]
        return statistics.mean(values) if values else None

    return {
        "updates": len(metrics), "updates_counted": len(kept),
        "tokens_per_update": avg("tokens"), "tokens_per_s": sum(float(m["tokens"]) for m in kept) / wall,
        "learner_tflops": avg("learner_tflops"), "mfu": avg("mfu"),
        "learner_compute_share": sum(float(m["learner_compute_s"]) for m in kept) / wall,
        "learner_idle_share": sum(float(m["learner_idle_s"]) for m in kept) / wall,
        "worker_idle_share": avg("worker_idle_fraction"), "policy_lag_mean": avg("policy_lag_mean"),
        "step_s_median": statistics.median(float(m["step_time_s"]) for m in kept),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True, help="run directory (replaced)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    p.add_argument("--layers", type=int, default=None, help="layers (default: the shape's)")
    p.add_argument("--updates", type=int, default=50)
    p.add_argument("--batch", type=int, default=128, help="trajectories per update")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens sampled per trajectory")
    p.add_argument("--workers", type=int, default=2, help="rollout workers (threads sharing the device)")
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--param-dtype", default=None, help="learner autocast dtype (default bf16 on CUDA, fp32 on a CPU)")
    args, extra = p.parse_known_args(argv)
    out = Path(args.output).resolve()
    model, tokenizer = write_model_and_tokenizer(out.parent / f"{out.name}_model", args.shape, args.layers)
    dtype = args.param_dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    cmd = cli("train", "--preset", "toy", "--model", str(model), "--tokenizer", str(tokenizer), "--device",
              args.device, "--output", str(out), "--overwrite", "--no_progress",
              "--train.max_steps", str(args.updates), "--rollout.batch_size", str(args.batch),
              "--rollout.max_new_tokens", str(args.new_tokens),
              "--data.max_len", str(args.new_tokens + 64), "--rollout.num_workers", str(args.workers),
              "--rollout.vllm_generate_batch_size", str(max(1, args.batch // args.workers)),
              "--train.micro_batch_tokens", str(args.micro_batch_tokens), "--fsdp.param_dtype", dtype,
              "--eval.steps", "0", "--eval.eval_at_start", "false", "--ckpt.save_steps", "0",
              "--logger.logging_steps", "10", *extra)
    print("$ " + " ".join(cmd[2:]), flush=True)
    code = subprocess.run(cmd, cwd=ROOT).returncode
    metrics = read_jsonl(out / "metrics.jsonl")
    if code or not metrics:
        print(f"bench_train_throughput: the run failed (exit {code}, {len(metrics)} updates)", file=sys.stderr)
        return code or 1
    s = summarize(metrics)
    (out / "throughput.json").write_text(json.dumps(s, indent=1))

    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    print_table(f"train on {args.device}: {args.shape} ({args.layers or 'all'} layers), {s['updates']} updates "
                f"(the first excluded), {fmt(s['tokens_per_update'], ',.0f')} tokens per update",
                ["tokens/s", "learner TFLOP/s", "MFU", "learner computing", "learner idle", "workers idle",
                 "policy lag", "median update s"],
                [[fmt(s["tokens_per_s"], ",.0f"), fmt(s["learner_tflops"], ".3g"), fmt(s["mfu"], ".1%"),
                  fmt(s["learner_compute_share"], ".0%"), fmt(s["learner_idle_share"], ".0%"),
                  fmt(s["worker_idle_share"], ".0%"), fmt(s["policy_lag_mean"], ".2f"),
                  fmt(s["step_s_median"], ".2f")]])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
