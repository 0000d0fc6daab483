"""Helpers the benchmarks share; a benchmark script imports no other benchmark script, only this module.

It owns:

* the report: Markdown tables (:func:`print_table`), the mean and spread over seeds (:func:`spread`,
  :func:`fmt_spread`);
* the yardsticks a benchmark reports beside its numbers, measured on the machine at hand so that a
  result says how far it is from what this machine can do (:func:`copy_bandwidth`, :func:`gemm_peak`,
  :func:`machine_line`), and the model shapes built from a config (:data:`SHAPES`);
* where a step's time and memory go: :func:`profile_breakdown` (``torch.profiler``), :func:`status_mib`
  and :func:`reset_peak_rss` (the process's resident memory);
* the loss benchmarks' batch and eager baseline (:func:`loss_batch`, :func:`eager_loss`, :func:`fused_step`,
  :func:`eager_step`);
* the slow-tools schedules of ``arith_tool`` (:data:`TOOL_ASYNC_SCHEDULES`, :func:`tool_async_env_kwargs`,
  :func:`tool_async_train_args`, :func:`add_tool_async_arguments`),
  which ``bench_tool_async.py`` measures and ``profile_tool_engine.py`` profiles;
* the races against TRL: the preset's flags, the held-out evaluator both sides use
  (:func:`heldout_evaluator`, the one place it is built), TRL's training-time budget
  (:func:`train_trl_on_budget`) and our trainer's run on the same budget (:func:`run_ours`).

Nothing here is timed against a target.
"""

from __future__ import annotations

import math
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Sequence

import torch

__all__ = ["CATEGORIES", "ROOT", "SHAPES", "budget_done", "copy_bandwidth", "cpu_name", "eager_loss",
           "eager_step", "fmt_spread", "fused_step", "gemm_peak", "heldout_evaluator", "load_arith_curve",
           "loss_batch", "machine_line", "median_time", "preset_flags", "print_table", "profile_breakdown",
           "reset_peak_rss", "run_ours", "spread", "status_mib", "sync", "train_trl_on_budget"]

#: The repository's root (benchmarks/ and scripts/ are below it).
ROOT = Path(__file__).resolve().parents[1]

#: Model shapes the benchmarks build from a config (random weights, nothing downloaded): the
#: ``transformers`` config keyword arguments, ``model_type`` included.
SHAPES = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                         num_key_value_heads=3, num_hidden_layers=30, rope_theta=100000.0, tie_word_embeddings=True,
                         max_position_embeddings=8192, model_type="llama"),
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                         num_key_value_heads=2, num_hidden_layers=24, rope_theta=1000000.0, tie_word_embeddings=True,
                         max_position_embeddings=32768, model_type="qwen2"),
}



def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A Markdown table (cells already formatted) under ``title``."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")


def spread(values: Sequence[float | None]) -> dict:
    """``{"mean", "min", "max", "n"}`` over the values that are not None (None throughout when none is)."""
    values = [v for v in values if v is not None]
    if not values:
        return {"mean": None, "min": None, "max": None, "n": 0}
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values), "n": len(values)}


def fmt_spread(stat: dict, fmt: str) -> str:
    """A :func:`spread` as a table cell: ``mean (min-max)``, the mean alone for one value, ``-`` for none."""
    if stat["mean"] is None:
        return "-"
    if stat["n"] == 1:
        return fmt.format(stat["mean"])
    return f"{fmt.format(stat['mean'])} ({fmt.format(stat['min'])}-{fmt.format(stat['max'])})"


def cpu_name() -> str:
    """The CPU model (``/proc/cpuinfo``'s model name) and the instruction set PyTorch dispatches to."""
    name = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    capability = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", lambda: "?")()
    return f"{name}, {torch.get_num_threads()} threads, PyTorch CPU capability {capability}"


def machine_line(device: torch.device) -> str:
    """One line naming the device a benchmark ran on."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__})"
    return f"{cpu_name()} (torch {torch.__version__})"


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def call_times(fn: Callable[[], object], repeats: int = 5, warmup: int = 1,
               device: torch.device | None = None) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn()`` after ``warmup`` untimed calls (the device's
    queued work waited for around each call)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device is not None:
            sync(device)
        t0 = time.perf_counter()
        fn()
        if device is not None:
            sync(device)
        samples.append(time.perf_counter() - t0)
    return samples


def median_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1,
                device: torch.device | None = None) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after ``warmup`` calls."""
    return statistics.median(call_times(fn, repeats, warmup, device))


def best_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1,
              device: torch.device | None = None) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``fn()`` after ``warmup`` calls: a kernel's own
    speed, where the slower calls add only the machine's noise."""
    return min(call_times(fn, repeats, warmup, device))


def copy_bandwidth(device: torch.device, mib: int = 256, repeats: int = 5) -> float:
    """Bytes per second of a copy of ``mib`` MiB on ``device`` (bytes read plus bytes written), best
    of ``repeats``: the memory-bound yardstick (a decode step must read every weight once)."""
    src = torch.empty(mib * 2**20 // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    best = best_time(lambda: dst.copy_(src), repeats, device=device)
    return 2 * src.numel() * 4 / best


def gemm_peak(device: torch.device, dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a ``size`` x ``size`` by ``size`` x ``size`` matrix product in ``dtype`` (best of
    ``repeats``): the compute-bound yardstick, measured, not a data-sheet figure."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    best = best_time(lambda: a @ b, repeats, device=device)
    return 2 * size**3 / best


# ---------------------------------------------------------------------------- resident memory (Linux)
def status_mib(field: str) -> float | None:
    """``field`` of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...) in MiB; None where it cannot be read."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0  # kB -> MiB
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset the process's resident-memory peak (``VmHWM``) to its current size; whether that worked."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------------------- where a step's time goes
# profile_breakdown runs a callable once under torch.profiler and returns a breakdown by category
# (matrix products, attention, the fused loss, elementwise and reductions, copies and casts,
# optimizer, other) of the *device* time: on CUDA the kernels' own durations, on the CPU the self
# time of the operators (each counted once); the busy share (that time over the call's wall-clock
# time; on CUDA what is left is the time the GPU waited for the host: launches, synchronizations,
# Python); and the heaviest kernels or operators by self time. Categories come from the names
# (regular expressions below, first match wins): a reading aid, not an exact attribution (a cuBLAS
# kernel fused with an epilogue is a matrix product; the fused loss's kernels live in the
# ``flashreinforce`` namespace).

#: (category, pattern over the lower-cased kernel or operator name), first match wins.
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("fused loss", r"flashreinforce|flash_reinforce"),
    ("attention", r"flash_fwd|flash_bwd|fmha|attention|sdpa|scaled_dot|flex"),
    ("matrix products", r"gemm|xmma|cutlass|cublas|sm\d+_|aten::(mm|addmm|bmm|baddbmm|linear|matmul)\b"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("copies and casts", r"memcpy|memset|copy|aten::to\b|_to_copy|aten::cat|index|gather|scatter|contiguous"),
    ("elementwise and reductions", r"elementwise|vectorized|reduce|softmax|exp|log|mul|add|sub|div|sum|max|norm|silu|rsqrt|pow|where|clamp|fill"),
)


def _category(name: str) -> str:
    low = name.lower()
    for label, pattern in CATEGORIES:
        if re.search(pattern, low):
            return label
    return "other"


def profile_breakdown(fn: Callable[[], object], device: torch.device, *, top: int = 12) -> dict:
    """Run ``fn()`` once under the profiler on ``device`` (CPU or CUDA).

    Returns ``{"wall_ms", "busy_ms", "busy_share", "categories": [(name, ms, share of busy)],
    "top": [(name, calls, ms)]}``: times in milliseconds, ``busy`` = device time on CUDA, operator
    self time on the CPU (it can exceed the wall time there, with several threads)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    per_name: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for evt in prof.events():
        on_device = evt.device_type == torch.autograd.DeviceType.CUDA
        if on_device != cuda:
            continue
        us = evt.device_time_total if cuda else evt.self_cpu_time_total
        if us <= 0:
            continue
        per_name[evt.name][0] += 1
        per_name[evt.name][1] += us / 1e3
    busy = sum(ms for _, ms in per_name.values())
    by_category: dict[str, float] = defaultdict(float)
    for name, (_, ms) in per_name.items():
        by_category[_category(name)] += ms
    categories = sorted(((k, v, v / busy if busy else 0.0) for k, v in by_category.items()), key=lambda r: -r[1])
    heaviest = sorted(((name, calls, ms) for name, (calls, ms) in per_name.items()), key=lambda r: -r[2])[:top]
    return dict(wall_ms=wall * 1e3, busy_ms=busy, busy_share=busy / (wall * 1e3) if wall > 0 else 0.0,
                categories=categories, top=heaviest)


# ---------------------------------------------------------------------------- the loss benchmarks' batch
def loss_batch(num_tokens: int, batch: int, seed: int = 0, dtype=torch.float32):
    """Uneven lengths (lognormal), 90% policy tokens, behavior close to current (most admitted)."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.exp(torch.randn(batch, generator=gen, dtype=torch.float64) * 1.0)
    lengths = torch.clamp((weights / weights.sum() * num_tokens).long(), min=2)
    lengths[-1] += num_tokens - int(lengths.sum())
    while int(lengths[-1]) < 2:  # keep every trajectory >= 2 tokens
        j = int(lengths.argmax())
        lengths[j] -= 10
        lengths[-1] += 10
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    mask = torch.rand(num_tokens, generator=gen) < 0.9
    mask[cu[:-1].long()] = False  # first token of each trajectory: prompt
    mask[cu[1:].long() - 1] = True
    current = -(torch.rand(num_tokens, generator=gen) ** 2) * 4.0
    behavior = (current + 0.02 * torch.randn(num_tokens, generator=gen)).clamp(max=0.0)
    rewards = (torch.rand(batch, generator=gen) < 0.5).float()
    entropies = torch.rand(num_tokens, generator=gen) * 5.0
    failures = torch.zeros(batch, dtype=torch.bool)
    failures[torch.randperm(batch, generator=gen)[: batch // 2]] = True
    return dict(log_probs=current.to(dtype), behavior_log_probs=behavior.to(dtype), rewards=rewards,
                cu_seqlens=cu, action_mask=mask, entropies=entropies.to(dtype), failures=failures)


def eager_loss(log_probs, behavior_log_probs, rewards, cu_seqlens, action_mask, delta: float = 3e-3):
    """The straightforward eager PyTorch packed objective (any device; CUDA benchmark too)."""
    batch = rewards.shape[0]
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    segment = torch.repeat_interleave(torch.arange(batch, device=log_probs.device), lengths,
                                      output_size=log_probs.shape[0])
    mask = action_mask.to(log_probs.dtype)
    counts = torch.zeros(batch, dtype=log_probs.dtype, device=log_probs.device).index_add_(0, segment, mask)
    advantages = rewards - rewards.mean()
    with torch.no_grad():
        p = behavior_log_probs.exp().clamp(1e-6, 1 - 1e-6)
        q = log_probs.exp().clamp(1e-6, 1 - 1e-6)
        d = p * (p.log() - q.log()) + (1 - p) * (torch.log1p(-p) - torch.log1p(-q))
        kl = torch.zeros_like(counts).index_add_(0, segment, d * mask) / counts
        admitted = kl.clamp_min(0) <= delta
        active = mask * admitted[segment].to(mask.dtype)
        weight = torch.exp(log_probs - behavior_log_probs) * advantages[segment] * active
    per_traj = torch.zeros_like(counts).index_add(0, segment, weight * log_probs)
    return -(per_traj / counts).sum() / batch


def fused_step(data: dict, **opts) -> Callable[[], None]:
    """One forward + backward of the fused loss over ``data`` (a :func:`loss_batch`), delta = 3e-3."""
    import flashreinforce as fr

    def run():
        lp = data["log_probs"].requires_grad_()
        loss, _ = fr.flashreinforce_loss_packed(lp, data["behavior_log_probs"], data["rewards"], data["cu_seqlens"],
                                                data["action_mask"], delta=3e-3, **opts)
        loss.backward()
        lp.grad = None
    return run


def eager_step(data: dict, fn=eager_loss) -> Callable[[], None]:
    """One forward + backward of ``fn`` (:func:`eager_loss` or one with its signature) over ``data``."""
    def run():
        lp = data["log_probs"].requires_grad_()
        loss = fn(lp, data["behavior_log_probs"], data["rewards"], data["cu_seqlens"], data["action_mask"])
        loss.backward()
        lp.grad = None
    return run


# ---------------------------------------------------------------------------- the races against TRL
def load_arith_curve():
    """``scripts/arith_curve.py`` (jsonl reading, training-time accounting, the ``flashreinforce`` command
    line), imported from scripts/."""
    scripts = str(ROOT / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    import arith_curve as module

    return module


def preset_flags(preset: str, extra: dict) -> dict:
    """The flat flags of ``preset``, with ``extra`` over them."""
    from flashreinforce.config.presets import PRESETS

    flags = dict(PRESETS[preset])
    flags.update(extra)
    return flags


def heldout_evaluator(model, tokenizer, flags: dict, num_prompts: int, seed: int, *, env_kwargs: dict | None = None,
                      chat_template: bool = False, max_turns: int = 1, env_timeout_s: float | None = None):
    """An Evaluator over the preset's held-out prompts with its own copy of ``model`` (greedy), and the
    weight store it reads; every race builds its evaluation here, both sides alike.

    ``flags``: the preset's (:func:`preset_flags`); ``env_kwargs``: the environment's arguments (default
    ``flags["env.kwargs"]``); ``chat_template``: the environment renders its prompt with the tokenizer's
    chat template; ``max_turns``: policy turns per episode; ``env_timeout_s``: the limit of one
    environment call (default: the rollout's)."""
    import copy

    from flashreinforce.engines import LocalWeightStore, SamplingParams
    from flashreinforce.envs.registry import EnvSpec
    from flashreinforce.trainer.reporting.evaluation import Evaluator, eval_seeds
    from flashreinforce.trainer.rollout.settings import RolloutSettings

    kwargs = dict(flags["env.kwargs"]) if env_kwargs is None else env_kwargs
    env_spec = EnvSpec(flags["env"], {}, kwargs, chat_template)
    timeout = {} if env_timeout_s is None else {"env_timeout_s": env_timeout_s}
    settings = RolloutSettings(max_new_tokens=flags["rollout.max_new_tokens"], max_len=flags["data.max_len"],
                               max_turns=max_turns, episodes_per_call=flags["rollout.vllm_generate_batch_size"],
                               seed=seed, **timeout)
    store = LocalWeightStore()
    evaluator = Evaluator(env_factory=env_spec.factory(tokenizer), seeds=eval_seeds(None, num_prompts),
                          model=copy.deepcopy(model), tokenizer=tokenizer, weights=store, rollout_settings=settings,
                          sampling=SamplingParams(0.0, 1.0, 0, tokenizer.eos_token_ids), n_samples=1,
                          episodes_per_call=flags["rollout.vllm_generate_batch_size"], seed=seed + 1)
    return evaluator, store


def train_trl_on_budget(trainer, evaluate, *, budget_s: float, eval_every_s: float) -> dict:
    """Run ``trainer.train()`` (a TRL GRPOTrainer) for ``budget_s`` seconds of training time.

    ``evaluate(step, train_s)`` is called for the base model before training, then after the first
    optimizer step at or past each multiple of ``eval_every_s`` training seconds (one evaluation
    however many multiples a long step passed) and at the end of the budget. Its time is not
    training time. The time TRL spends in ``_generate_and_score_completions`` (sampling, the
    rollout and scoring) is recorded apart; the rest of a step is learning (TRL is synchronous, so
    there is no overlap and no idle time). Returns ``train_s``, ``updates``, ``generation_s``,
    ``generations`` and ``rewards`` (the mean training reward TRL logs per step).
    """
    import transformers

    timing = {"generation_s": 0.0, "generations": 0}
    inner = trainer._generate_and_score_completions

    def timed_generate(*a, **k):
        t0 = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            timing["generation_s"] += time.perf_counter() - t0
            timing["generations"] += 1

    trainer._generate_and_score_completions = timed_generate
    state = {"t0": None, "eval_s": 0.0, "next_eval": eval_every_s, "rewards": []}

    def timed_evaluate(step: int, train_s: float) -> None:
        t0 = time.perf_counter()
        evaluate(step, train_s)
        state["eval_s"] += time.perf_counter() - t0

    class Clock(transformers.TrainerCallback):
        def on_train_begin(self, *_, **__):
            state["t0"] = time.perf_counter()

        def on_log(self, _args, st, control, logs=None, **__):
            if logs and "reward" in logs:
                state["rewards"].append({"step": st.global_step, "reward": float(logs["reward"])})

        def on_step_end(self, _args, st, control, **__):
            train_s = time.perf_counter() - state["t0"] - state["eval_s"]
            if train_s >= state["next_eval"] or train_s >= budget_s:
                timed_evaluate(st.global_step, train_s)
                while state["next_eval"] <= train_s:
                    state["next_eval"] += eval_every_s
            if train_s >= budget_s:
                state["train_s"], state["updates"] = train_s, st.global_step
                control.should_training_stop = True

    trainer.add_callback(Clock())
    evaluate(0, 0.0)  # the base model, before the clock starts
    trainer.train()
    train_s = state.get("train_s", time.perf_counter() - state["t0"] - state["eval_s"])
    return {"train_s": train_s, "updates": state.get("updates", trainer.state.global_step),
            "generation_s": timing["generation_s"], "generations": timing["generations"],
            "rewards": state["rewards"]}


def run_ours(args, flags: dict, out: Path, extra: list[str], seed: int, name: str = "ours") -> dict:
    """One run of our trainer (``--preset args.preset``, ``extra`` flags) for ``args.budget_min`` training
    minutes in ``OUTPUT/NAME_seedS``, evaluated every ``args.eval_every_min`` training minutes; its result.
    ``args``: the race's ``preset``, ``model``, ``budget_min``, ``eval_every_min``, ``eval_prompts`` and
    ``ours_threads``."""
    arith_curve = load_arith_curve()
    run_dir = out / f"{name}_seed{seed}"
    log = out / f"{name}_seed{seed}_log.txt"
    budget = args.budget_min * 60
    metrics_path, eval_path = run_dir / "metrics.jsonl", run_dir / "eval.jsonl"
    done = arith_curve.training_times(arith_curve.read_jsonl(metrics_path), arith_curve.read_jsonl(eval_path))
    if not (done and max(done.values()) >= budget):
        resume = ["--resume"] if (run_dir / "checkpoints" / "latest").is_file() else []
        # The evaluation schedule of the TRL side (training minutes, rollouts paused), and no checkpoint
        # during the budget (the run saves once, after SIGINT).
        cmd = arith_curve.cli("train", "--preset", args.preset, "--model", args.model, "--output", str(run_dir),
                              "--eval.steps", "0", "--eval.every_min", str(args.eval_every_min),
                              "--eval.num_prompts", str(args.eval_prompts), "--eval.eval_at_start", "true",
                              "--eval.eval_at_stop", "false",
                              "--ckpt.save_steps", "0", "--seed", str(seed), "--no_progress", *resume,
                              *(["--torch_threads", str(args.ours_threads)] if args.ours_threads else []), *extra)
        print(f"[{name} seed {seed}] {' '.join(cmd[2:])}", flush=True)
        with open(log, "a") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
            stopped = False
            while proc.poll() is None:
                time.sleep(1.0)
                if not stopped and budget_done(arith_curve.read_jsonl(metrics_path), arith_curve.read_jsonl(eval_path),
                                               budget, args.eval_every_min * 60):
                    proc.send_signal(signal.SIGINT)
                    stopped = True
        if proc.returncode not in (0, 130):
            raise SystemExit(f"[{name} seed {seed}] training failed with exit status {proc.returncode}; see {log}")
    metrics = arith_curve.read_jsonl(metrics_path)
    evals = arith_curve.read_jsonl(eval_path)
    times = arith_curve.training_times(metrics, evals)
    # As on TRL's side: the updates up to the first one at or past the budget, and the evaluations
    # up to the one after that update.
    last = next((i for i, m in enumerate(metrics) if times[int(m["step"])] >= budget - 1e-9), len(metrics) - 1)
    kept = metrics[:last + 1]
    train_s = times[int(kept[-1]["step"])]
    curve = []
    for e in evals:
        at = 0.0 if int(e["step"]) == 0 else float(e.get("train_time_s", times.get(int(e["step"]), math.inf)))
        if at <= train_s + 1e-9:
            curve.append({"step": int(e["step"]), "train_min": at / 60, "accuracy": e["eval_success_rate"],
                          **{k[len("eval_env/"):]: v for k, v in e.items() if k.startswith("eval_env/")}})
    learner_s = sum(float(m["learner_compute_s"]) for m in kept)
    idle_s = sum(float(m["learner_idle_s"]) for m in kept)
    worker_busy = [1 - float(m.get("worker_idle_fraction", 0.0)) for m in kept]
    trajectories = sum(int(m["trajectories"]) for m in kept)
    from flashreinforce.config import read_config_file

    settings = read_config_file(run_dir / "config.yaml")
    return {
        "side": name, "seed": seed, "train_s": train_s, "updates": len(kept), "trajectories": trajectories,
        "prompts_per_update": settings["rollout.batch_size"],
        "trajectories_per_prompt": settings["rollout.n_samples_per_prompt"],
        "policy_lag_mean": arith_curve.mean(float(m.get("policy_lag_mean", 0.0)) for m in kept),
        "trajectories_per_s": trajectories / train_s, "updates_per_s": len(kept) / train_s,
        # The learner's own time split; generation runs in the rollout worker at the same time.
        "learning_share": learner_s / train_s, "idle_share": idle_s / train_s,
        "generation_share": arith_curve.mean(worker_busy),
        "curve": curve, "rewards": [{"step": int(m["step"]), "reward": float(m["reward_mean"])} for m in kept],
        "settings": {k: settings[k] for k in ("rollout.batch_size", "rollout.n_samples_per_prompt",
                                              "rollout.max_new_tokens", "rollout.temperature", "actor.adam.lr",
                                              "actor.loss_mode", "rollout.num_workers", "train.async_queue_size",
                                              "train.max_policy_lag", "actor.flash_gate_delta")},
    }


def budget_done(metrics: list[dict], evals: list[dict], budget_s: float, eval_every_s: float) -> bool:
    """Whether our run may be stopped: its training time has reached the budget and, when an
    evaluation falls due at the budget (the budget is a multiple of the evaluation period), that
    evaluation has been recorded, so that both sides end with an evaluation after the update that
    passes the budget. Two evaluation periods past the budget it stops regardless."""
    arith_curve = load_arith_curve()
    times = arith_curve.training_times(metrics, evals)
    if not times or max(times.values()) < budget_s:
        return False
    due = eval_every_s > 0 and abs(budget_s / eval_every_s - round(budget_s / eval_every_s)) < 1e-9
    evaluated = any(int(e["step"]) > 0 and times.get(int(e["step"]), 0.0) >= budget_s - 1e-9 for e in evals)
    return not due or evaluated or max(times.values()) >= budget_s + 2 * eval_every_s


# The slow-tools schedules (bench_tool_async.py's docstring says what each is): flags on top of the
# arith_tool preset.
_STREAM2 = ["--rollout.episodes_in_flight", "96", "--train.async_queue_size", "2", "--train.max_policy_lag", "3"]
_NO_STATS = ["--actor.statistics_without_gradient", "false"]
_STEADY = ["--actor.step_on_zero_gradient", "false", "--actor.scale_step_by_acceptance", "true"]
_SYNC2 = ["--train.async_queue_size", "0", "--torch_threads", "2"]
_STREAM2_STEADY2 = [*_STREAM2, *_STEADY, "--torch_threads", "2"]
TOOL_ASYNC_SCHEDULES = {
    "async": [],
    "sync": ["--train.async_queue_size", "0"],
    "stream": ["--rollout.episodes_in_flight", "64"],
    "stream2": _STREAM2,
    "stream2_steady": [*_STREAM2, *_STEADY],
    "sync_threads2": _SYNC2,
    "stream2_steady_threads2": _STREAM2_STEADY2,
    "sync_threads2_nostats": [*_SYNC2, *_NO_STATS],
    "stream2_steady_threads2_nostats": [*_STREAM2_STEADY2, *_NO_STATS],
    "stream2_steady_threads2_gather": [*_STREAM2_STEADY2, "--rollout.stream_call_min_episodes", "16",
                                       "--rollout.stream_call_gather_s", "0.3"],
    "sync_warmup": ["--train.async_queue_size", "0"],  # + the warm-up bench_tool_async.py adds
    "stream2_warmup": _STREAM2,  # + the warm-up bench_tool_async.py adds
    "grpo": ["--actor.loss_mode", "ppo", "--algo.advantage.estimator", "grpo", "--rollout.n_samples_per_prompt", "8",
             "--rollout.batch_size", "4"],
}


def tool_async_train_args(model: str, output: Path, env_kwargs: dict, updates: int, seed: int, flags: Sequence[str],
                          *, evaluate_at_stop: bool) -> list[str]:
    """``flashreinforce train`` arguments of one slow-tools run: the arith_tool preset from ``model``,
    ``updates`` updates, ``flags`` (a schedule's) on top; the held-out evaluation at the stop only with
    ``evaluate_at_stop``; no checkpoints during the run."""
    import json

    return ["--preset", "arith_tool", "--model", str(model), "--output", str(output), "--overwrite",
            "--env.kwargs", json.dumps(env_kwargs), "--train.max_steps", str(updates),
            "--eval.steps", str(updates if evaluate_at_stop else 0), "--eval.eval_at_start", "false",
            "--ckpt.save_steps", "0", "--no_progress", "--seed", str(seed), *flags]


def add_tool_async_arguments(parser, *, updates: int) -> None:
    """The options every slow-tools script takes, read by :func:`tool_async_train_args` and
    :func:`tool_async_env_kwargs`: ``--output``, ``--model``, ``--updates`` (default ``updates``),
    ``--median-s`` and ``--sigma``."""
    parser.add_argument("--output", required=True)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--updates", type=int, default=updates, help="updates measured per schedule (after a first one)")
    parser.add_argument("--median-s", type=float, default=0.5, help="median added delay per tool call")
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the added delay")


def tool_async_env_kwargs(median_s: float, sigma: float) -> dict:
    """The arith_tool preset's environment arguments with each tool call delayed by a lognormal draw
    (``median_s`` seconds, ``sigma``; deterministic per task, turn and call)."""
    from flashreinforce.config.presets import PRESETS

    return dict(PRESETS["arith_tool"]["env.kwargs"], tool_latency={"median_s": median_s, "sigma": sigma})
