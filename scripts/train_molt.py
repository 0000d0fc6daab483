#!/usr/bin/env python
"""Launch the published single-turn math recipes (r1, qwen_math) on the pinned public Molt revision.

Molt (NVIDIA-NeMo/labs-molt) at the pinned revision has no native FlashREINFORCE loss: these recipes
express the method through Molt's own knobs (flash_reinforce advantage estimator, seq-level binary-KL
importance-correction gate in mask mode with threshold delta, seq-mean-token-mean aggregation).

    python scripts/train_molt.py --recipe r1 --molt-path ~/labs-molt --model /ckpt/r1-1.5b \\
        --train-data train.jsonl --eval-data eval.jsonl --output runs/r1 --dry-run

The recipe is ``--recipe {r1,qwen_math}`` (the published launcher's spelling; default ``r1``) or, as
before, the first positional argument (``train_molt.py qwen_math ...``); giving both with different
values is an error.

Without ``--dry-run`` the launcher refuses a checkout at another revision or with modified tracked
files, a missing math agent or dataset; it never starts or stops a Ray cluster (start one yourself).
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

from flashreinforce.experiments.launch import MOLT_MODULE, flag_arguments, format_command, launch_env

MOLT_REPOSITORY = "NVIDIA-NeMo/labs-molt"
MOLT_REVISION = "7e796e4e2648f905ae2a44dfc1b2ab98b07b68c3"
MATH_AGENT = Path("examples/python/agents/math.py")
TRAIN_BATCH = 128

#: Values that differ between the two recipes.
RECIPES: dict[str, dict[str, Any]] = {
    "r1": {
        "delta": 5e-3, "data.max_samples": 1460, "data.max_len": 9216, "rollout.max_new_tokens": 8192,
        "eval.steps": 128, "eval.n_samples_per_prompt": 32, "eval.temperature": 0.6, "eval.top_p": 0.95,
    },
    "qwen_math": {
        "delta": 3e-3, "data.max_samples": 7500, "data.max_len": 6144, "rollout.max_new_tokens": 4096,
        "eval.steps": 100, "eval.n_samples_per_prompt": 16, "eval.temperature": 0.7, "eval.top_p": 0.7,
    },
}


def recipe_flags(recipe: str, *, molt_path: Path, model: str, train_data: Path, eval_data: Path, output: Path,
                 actor_gpus: int, rollout_gpus: int, episodes: int, delta: float, attention: str) -> dict[str, Any]:
    """The Molt flags of ``recipe`` in command order (``True`` = switch)."""
    r = RECIPES[recipe]
    return {
        "actor.model_name_or_path": model,
        "data.prompt_dataset": str(train_data),
        "data.input_key": "prompt",
        "data.label_key": "reward_model",
        "data.apply_chat_template": True,
        "data.max_samples": r["data.max_samples"],
        "data.max_len": r["data.max_len"],
        "rollout.batch_size": TRAIN_BATCH,
        "rollout.vllm_generate_batch_size": 512,
        "rollout.micro_batch_size": 1,
        "rollout.n_samples_per_prompt": 1,
        "rollout.max_new_tokens": r["rollout.max_new_tokens"],
        "rollout.temperature": 1.0,
        "rollout.top_p": 1.0,
        "train.batch_size": TRAIN_BATCH,
        "train.micro_batch_size": 1,
        "train.max_epochs": 1,
        "train.num_episodes": episodes,
        "train.async_queue_size": 8,
        "train.force_on_policy": True,
        "train.colocate_fsdp_models": True,
        "train.agent_path": str(molt_path / MATH_AGENT),
        "actor.num_nodes": 1,
        "actor.num_gpus_per_node": actor_gpus,
        "ref.num_nodes": 1,
        "ref.num_gpus_per_node": actor_gpus,
        "vllm.num_engines": rollout_gpus,
        "vllm.tensor_parallel_size": 1,
        "vllm.sync_backend": "nccl",
        "vllm.gpu_memory_utilization": 0.9,
        "fsdp.param_dtype": "bf16",
        "fsdp.attn_implementation": attention,
        "fsdp.packing_samples": True,
        "actor.gradient_checkpoint": "full",
        "actor.optim": "adam",
        "actor.adam.lr": 1e-6,
        "actor.adam.weight_decay": 0.1,
        "actor.lr_scheduler": "cosine_with_min_lr",
        "actor.lr_warmup_ratio": 0.03,
        "actor.min_lr_ratio": 0.1,
        "actor.max_norm": 1.0,
        "actor.loss_agg_mode": "seq-mean-token-mean",
        "actor.entropy_coef": 0,
        "algo.advantage.estimator": "flash_reinforce",
        "algo.advantage.is_correction_level": "seq",
        "algo.advantage.is_correction_mode": "mask",
        "algo.advantage.is_correction_gating": "binary_kl",
        "algo.advantage.is_correction_threshold": delta,
        "algo.kl.init_coef": 0,
        "eval.dataset": str(eval_data),
        "eval.steps": r["eval.steps"],
        "eval.n_samples_per_prompt": r["eval.n_samples_per_prompt"],
        "eval.temperature": r["eval.temperature"],
        "eval.top_p": r["eval.top_p"],
        "eval.eval_at_start": True,
        "ckpt.output_dir": str(output / "hf"),
        "ckpt.path": str(output / "state"),
        "ckpt.save_steps": 50,
        "logger.logging_steps": 1,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="train_molt.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", nargs="?", choices=sorted(RECIPES), default=None,
                        help="published recipe (same as --recipe)")
    parser.add_argument("--recipe", dest="recipe_flag", choices=sorted(RECIPES), default=None,
                        help="published recipe (default r1)")
    parser.add_argument("--molt-path", type=Path, required=True, help=f"checkout of {MOLT_REPOSITORY} at {MOLT_REVISION}")
    parser.add_argument("--model", required=True, help="model checkpoint (local path or hub id)")
    parser.add_argument("--train-data", type=Path, required=True, help="training prompts (JSONL)")
    parser.add_argument("--eval-data", type=Path, required=True, help="evaluation data (JSONL)")
    parser.add_argument("--output", type=Path, default=None, help="output directory (default: outputs/molt_<recipe>)")
    parser.add_argument("--actor-gpus", type=int, default=1, help=f"learner GPUs; must divide {TRAIN_BATCH} (default 1)")
    parser.add_argument("--rollout-gpus", type=int, default=7, help="vLLM engines, one GPU each (default 7)")
    parser.add_argument("--episodes", type=int, default=1000,
                        help="train.num_episodes: passes over the dataset, not optimizer steps (default 1000)")
    parser.add_argument("--delta", type=float, default=None,
                        help="binary-KL trust threshold; default 5e-3 (r1) or 3e-3 (qwen_math); inf = no trust region")
    parser.add_argument("--attention", choices=["flash_attention_2", "te"], default="flash_attention_2")
    parser.add_argument("--dry-run", action="store_true", help="print revision, working directory and command; check nothing")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.recipe and args.recipe_flag and args.recipe != args.recipe_flag:
        parser.error(f"--recipe {args.recipe_flag} and the positional recipe {args.recipe} disagree; give one of them")
    args.recipe = args.recipe_flag or args.recipe or "r1"
    if args.actor_gpus < 1 or TRAIN_BATCH % args.actor_gpus:
        parser.error(f"--actor-gpus must be a positive divisor of {TRAIN_BATCH}, got {args.actor_gpus}")
    if args.rollout_gpus < 1:
        parser.error(f"--rollout-gpus must be positive, got {args.rollout_gpus}")
    if args.episodes < 1:
        parser.error(f"--episodes must be positive, got {args.episodes}")
    delta = RECIPES[args.recipe]["delta"] if args.delta is None else args.delta
    if math.isnan(delta) or delta < 0:
        parser.error(f"--delta must be >= 0 (or inf), got {args.delta}")

    molt = args.molt_path.expanduser().resolve()
    output = (args.output or Path("outputs") / f"molt_{args.recipe}").expanduser().resolve()
    flags = recipe_flags(args.recipe, molt_path=molt, model=args.model, train_data=args.train_data.expanduser().resolve(),
                         eval_data=args.eval_data.expanduser().resolve(), output=output, actor_gpus=args.actor_gpus,
                         rollout_gpus=args.rollout_gpus, episodes=args.episodes, delta=delta, attention=args.attention)
    command = [sys.executable, "-u", "-m", MOLT_MODULE] + flag_arguments(flags)

    print(f"Molt revision: {MOLT_REVISION} ({MOLT_REPOSITORY})", flush=True)
    print(f"Working directory: {molt}", flush=True)
    print(format_command(command, 1), flush=True)
    if args.dry_run:
        print("Dry run: the Molt revision, its working tree, the agent and the datasets were not checked.")
        return 0

    problem = check_checkout(molt) or _missing_inputs(molt, args)
    if problem:
        parser.error(problem)
    return subprocess.run(command, cwd=molt, env=launch_env(1)).returncode


def check_checkout(molt: Path) -> str | None:
    """A message if ``molt`` is not a clean checkout of the pinned revision, else None."""
    def git(*arguments: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(molt), *arguments], capture_output=True, text=True)

    head = git("rev-parse", "HEAD")
    if head.returncode != 0:
        return f"--molt-path {molt} is not a git checkout of {MOLT_REPOSITORY}: {head.stderr.strip()}"
    if head.stdout.strip() != MOLT_REVISION:
        return (f"--molt-path {molt} is at revision {head.stdout.strip()}, but these recipes are pinned to "
                f"{MOLT_REVISION}; run `git -C {molt} checkout {MOLT_REVISION}`")
    dirty = git("status", "--porcelain", "--untracked-files=no")
    if dirty.returncode != 0 or dirty.stdout.strip():
        return f"--molt-path {molt} has modified tracked files:\n{dirty.stdout.rstrip()}\nCommit or revert them first"
    return None


def _missing_inputs(molt: Path, args: argparse.Namespace) -> str | None:
    if not (molt / MATH_AGENT).is_file():
        return f"the Molt math agent is missing: {molt / MATH_AGENT}"
    for flag, path in (("--train-data", args.train_data), ("--eval-data", args.eval_data)):
        if not path.expanduser().exists():
            return f"{flag}: dataset not found: {path}"
    return None


if __name__ == "__main__":
    sys.exit(main())
