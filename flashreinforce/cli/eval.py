"""``flashreinforce eval``: score a base model or a run's newest checkpoint on the held-out prompts.

``flashreinforce eval [--preset NAME] [--env SPEC | --agent FILE.py:FUNC] --model PATH_OR_ALIAS_OR_RUN_DIR
[--eval.num_prompts N] [--eval.temperature T] [--eval.n_samples_per_prompt K] [--output FILE] [--samples FILE]
[--FLAG VALUE ...]``

It takes the training flags (the same preset, environment and lengths as training, so the
prompts, chat template and limits are the ones the training loop evaluates with) and plays the
evaluation seeds of the environment (for :mod:`flashreinforce.envs.arith`: its held-out split)
twice with :class:`~flashreinforce.trainer.reporting.evaluation.Evaluator`:

* greedy (temperature 0, one sample per prompt): ``accuracy`` is its success rate, ``reward_mean``
  its mean reward and ``greedy_episode_means`` what the environment reported per episode (tool
  calls, turns, ...);
* sampled at ``eval.temperature`` (or, when that is 0, at ``rollout.temperature``, the training
  temperature) with ``eval.n_samples_per_prompt`` samples per prompt: ``pass@1`` is the mean
  success over all samples, ``sampled_reward_mean`` and ``sampled_episode_means`` the same as above
  (skipped with ``--no_sampled``).

Success is what the environment counts as solved (an episode not ``failed``); the reward can differ
from it under partial credit (a reward between 0 and 1, a format bonus), so ``accuracy`` and
``reward_mean`` agree only for 0/1 rewards. The output's ``legend`` says this in one line per key.

A preset's ``torch_threads`` (a training run's split of the cores) is not applied: evaluation
runs in one thread with torch's default thread count unless ``--torch_threads`` is given.

With a finite prompt set and no ``eval.dataset``, the prompts are the held-out rows of that set
(:mod:`flashreinforce.trainer.reporting.heldout`): for a run's model, the rows the run recorded in its
``heldout.json`` and never trained on; for any other model, the rows a run with the same ``--seed``
and prompt set holds out, so that a base model and the trained one are scored on the same rows (a
set of fewer than 5 rows, which no run can split, is played whole). ``--eval.dataset FILE`` plays
every row of FILE instead.

Progress goes to stderr (the model's loading, then a line every 10 s of each evaluation). It prints
one JSON object on stdout (``accuracy``, ``pass@1``, ``num_prompts``, ``model``, the checkpoint's
step when the model is a run directory or a checkpoint, timings) and writes it to ``--output FILE``
when given. When the model is a run's (the run directory or one of its checkpoints), the result is
also appended to that run's ``eval_command.jsonl``, which ``flashreinforce plot`` draws. ``--samples
FILE`` writes one JSON line per greedy episode (prompt, response, reward). Every path and setting that
does not need the model is checked before it loads. Exit status: 0, or 2 for a bad configuration
(the message names the flag).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Sequence

__all__ = ["EVAL_COMMAND_FILE", "eval_command", "evaluate_model"]

#: In a run directory: one line per ``flashreinforce eval`` of that run's model (step, accuracy, pass@1).
EVAL_COMMAND_FILE = "eval_command.jsonl"


#: What ``flashreinforce eval --help`` lists: the model, the environment and its data, the lengths and
#: the sampling of an episode, the evaluation's own flags. Every training flag is still accepted
#: (a training command line with ``eval`` in place of ``train`` evaluates what it trains), just not listed.
_EVAL_FLAGS = ("actor.model_name_or_path", "train.agent_path", "fsdp.attn_implementation", "rollout.max_new_tokens",
               "rollout.max_turns", "rollout.temperature", "rollout.top_p", "rollout.top_k",
               "rollout.vllm_generate_batch_size", "rollout.env_timeout_s", "rollout.env_parallel_calls")
_EVAL_OPTIONS = ("config", "preset", "env", "env.kwargs", "agent", "model", "reward", "tokenizer", "output", "seed",
                 "device", "torch_threads")

#: The output's ``legend``: what the numbers are.
LEGEND = {
    "accuracy": "greedy pass (temperature 0, one episode per prompt): share of episodes the environment counted "
                "as solved (not failed)",
    "reward_mean": "greedy pass: mean reward; equals accuracy only when rewards are 0 or 1 (partial credit or a "
                   "format bonus makes them differ)",
    "greedy_episode_means": "greedy pass: per-episode means of what the environment or agent reported",
    "pass@1": "sampled pass (pass@1_temperature, pass@1_samples_per_prompt per prompt): share of solved episodes",
    "sampled_reward_mean": "sampled pass: mean reward",
    "sampled_episode_means": "sampled pass: per-episode means of what the environment or agent reported",
}


def _shown(name: str) -> bool:
    return name in _EVAL_FLAGS or name in _EVAL_OPTIONS or name.split(".")[0] in ("eval", "data")


def _parser() -> argparse.ArgumentParser:
    from flashreinforce.config.command_line import build_parser

    p = build_parser(prog="flashreinforce eval", shown=_shown, usage=(
        "flashreinforce eval [--preset NAME | --config FILE] --model M [--env SPEC | --agent FILE.py:FUNC |\n"
        "         --reward FILE.py:FUNC --data.prompt_dataset PATH] [--output FILE] [--samples FILE] [--no_sampled]\n"
        "         [--FLAG VALUE ...]"),
        description=(
        "Score a model (a Hugging Face folder, a .gguf file, an alias, a run directory or a checkpoint) on the "
        "evaluation prompts: greedy accuracy and sampled pass@1; prints one JSON object. --output FILE also "
        "writes it there. Training flags are accepted too (not listed)."))
    for action in p._actions:  # the train parser's --output is a run directory; here it is a file
        if action.dest == "output":
            action.help = "also write the result JSON to this file"
    g = p.add_argument_group("eval command")
    g.add_argument("--samples", help="write one JSON line per greedy episode (prompt, response, reward) to this file")
    g.add_argument("--no_sampled", action="store_true", help="greedy accuracy only (no sampled pass@1)")
    return p


def _say(text: str) -> None:
    """A progress line on stderr (stdout holds the result's JSON alone)."""
    print(f"flashreinforce eval: {text}", file=sys.stderr, flush=True)


def _run_directory(spec: str, resolved: str) -> Path | None:
    """The run directory the evaluated model belongs to (``--model RUN`` or one of its checkpoints),
    or None for a model that is not a run's."""
    for candidate in (Path(spec), Path(resolved).parent.parent):
        if (candidate / "config.json").is_file() and (candidate / "metrics.jsonl").is_file():
            return candidate
    return None


def _checkpoint_step(path: Path) -> int | None:
    state = path / "state.json"
    if state.is_file():
        return int(json.loads(state.read_text())["step"])
    return None


def _episode_means(metrics: dict[str, Any]) -> dict[str, float]:
    return {k[len("eval_env/"):]: v for k, v in metrics.items() if k.startswith("eval_env/")}


def evaluate_model(cfg, *, sampled: bool = True, samples_path: str | None = None) -> dict[str, Any]:
    """Build the model, tokenizer and evaluation environments of ``cfg`` (a resolved configuration)
    and score them; returns the result object :func:`eval_command` prints."""
    import torch

    from flashreinforce.config import ConfigError
    from flashreinforce.engines import LocalWeightStore, SamplingParams
    from flashreinforce.models.loading import resolve_model_spec
    from flashreinforce.trainer.run import components
    from flashreinforce.trainer.reporting.evaluation import Evaluator, eval_seeds, progress_lines
    from flashreinforce.trainer.reporting.heldout import HELDOUT_FILE, MAX_HELDOUT_SHARE, run_split
    from flashreinforce.trainer.run.prechecks import check_before_model

    if cfg.torch_threads:
        torch.set_num_threads(int(cfg.torch_threads))
    spec = cfg.actor.model_name_or_path
    if spec is None:
        raise ConfigError("no model: give --model (a folder, a .gguf file, an alias or a run directory)")
    env_name = cfg.train.agent_path
    device = components.device_of(cfg.device)
    check_before_model(cfg)  # a bad environment, reward, dataset or path before the model loads
    t0 = time.perf_counter()
    resolved = resolve_model_spec(spec)
    _say(f"loading the model {spec} ...")
    policy = components.load_policy(cfg, device)
    model, tokenizer = policy.model, policy.tokenizer
    load_s = time.perf_counter() - t0
    _say(f"model loaded in {load_s:.1f} s; building the environments ...")
    eval_split = bool(cfg.eval.dataset)
    train_envs = components.load_environments(cfg, policy)
    cfg = components.settled_config(cfg, policy, train_envs)
    envs = components.eval_environments(cfg, train_envs, tokenizer)
    factory, rows = envs.factory, envs.num_prompts
    # The training loop's evaluation seeds: every row of eval.dataset; else the held-out rows of a finite
    # prompt set (the run's own split when the model is a run's); else eval.num_prompts seeds.
    run_dir = _run_directory(spec, resolved)
    too_small = rows is not None and rows < MAX_HELDOUT_SHARE and run_dir is None  # nothing to hold out: every row
    split = None if too_small else run_split(cfg, rows, run_dir)
    if split is not None:
        seeds = list(split.rows)
    else:
        seeds = eval_seeds(rows, rows if eval_split and rows is not None else cfg.eval.num_prompts)
    probe = factory()
    try:
        probe.reset(seed=seeds[-1])  # an environment with fewer evaluation prompts refuses here
    except ValueError as err:
        raise ConfigError(f"--eval.num_prompts {cfg.eval.num_prompts}: {err}") from None
    finally:
        probe.close()
    settings = components.rollout_settings(cfg, tokenizer, cfg.seed)
    stop = tokenizer.eos_token_ids
    greedy = SamplingParams(0.0, 1.0, 0, stop)
    temperature = cfg.eval.temperature if cfg.eval.temperature > 0 else cfg.rollout.temperature
    top_p = cfg.eval.top_p if cfg.eval.temperature > 0 else cfg.rollout.top_p
    sampled_params = SamplingParams(temperature, top_p, cfg.rollout.top_k, stop)
    evaluator = Evaluator(env_factory=factory, seeds=seeds, model=model, tokenizer=tokenizer,
                          weights=LocalWeightStore(), rollout_settings=settings, sampling=greedy, n_samples=1,
                          episodes_per_call=cfg.rollout.episodes_per_call, seed=cfg.seed + 1)
    try:
        trajectories: list = []
        what = "held-out rows of the prompt set" if split is not None else "evaluation prompts"
        _say(f"greedy accuracy on {len(seeds)} {what} ...")
        g = evaluator.evaluate(-1, trajectories=trajectories, progress=progress_lines(_say, "  greedy"))
        result: dict[str, Any] = {
            "model": spec, "resolved_model": resolved, "checkpoint_step": _checkpoint_step(Path(resolved)),
            "run_dir": None if run_dir is None else str(run_dir),
            "env": env_name, "env_kwargs": dict(cfg.env_kwargs), "num_prompts": len(seeds),
            "seeds": [seeds[0], seeds[-1]] if seeds else [],
            "heldout": None if split is None else {"rows": len(split.rows), "of": split.num_prompts,
                                                   "recorded_by_run": run_dir is not None and
                                                   (run_dir / HELDOUT_FILE).is_file()},
            "accuracy": g["eval_success_rate"], "reward_mean": g["eval_reward_mean"],
            "response_tokens_mean": g["eval_response_tokens_mean"],
            "truncated_fraction": g["eval_truncated_fraction"], "greedy_s": g["eval_time_s"],
            "max_new_tokens": cfg.rollout.max_new_tokens, "load_s": load_s, "device": str(device),
            "torch_threads": torch.get_num_threads(),
            # What the environment reported per episode, averaged (for the Python tool: tool calls per
            # trajectory, tool errors, answers taken from the tool's output, turns).
            "greedy_episode_means": _episode_means(g),
            "turns_mean": sum(t.num_turns for t in trajectories) / max(1, len(trajectories)),
        }
        if sampled:
            _say(f"sampled pass@1 ({cfg.eval.n_samples_per_prompt} per prompt, temperature {temperature:g}) ...")
            s = evaluator.evaluate(-1, sampling=sampled_params, n_samples=cfg.eval.n_samples_per_prompt,
                                   progress=progress_lines(_say, "  sampled"))
            result.update({"pass@1": s["eval_success_rate"], "pass@1_temperature": temperature,
                           "pass@1_top_p": top_p, "pass@1_samples_per_prompt": cfg.eval.n_samples_per_prompt,
                           "sampled_reward_mean": s["eval_reward_mean"], "sampled_episode_means": _episode_means(s),
                           "sampled_s": s["eval_time_s"]})
        else:
            result["pass@1"] = None
        result["legend"] = {k: v for k, v in LEGEND.items() if k in result}
        if samples_path:
            with open(samples_path, "w") as fh:
                for t in trajectories:
                    first = t.action_mask.index(True) if True in t.action_mask else len(t.token_ids)
                    fh.write(json.dumps({"seed": t.seed, "prompt": tokenizer.decode(t.token_ids[:first]),
                                         "response": tokenizer.decode(t.token_ids[first:]), "reward": t.reward,
                                         "failed": t.failed, "info": t.info}, default=str) + "\n")
    finally:
        evaluator.close()
    return result


def eval_command(argv: Sequence[str]) -> int:
    from flashreinforce.config import ConfigError
    from flashreinforce.config.command_line import resolve_arguments
    from flashreinforce.config.presets import PRESETS

    args = vars(_parser().parse_args(argv))
    samples = args.pop("samples", None)
    no_sampled = bool(args.pop("no_sampled", False))
    output = args.pop("output", None)
    try:
        cfg = resolve_arguments(args, PRESETS)
        if "torch_threads" not in args:
            # A preset's torch_threads splits the cores between a training run's learner and rollout
            # workers; evaluation is one thread, which gets torch's default (every core) unless told.
            cfg.torch_threads = None
    except ConfigError as err:
        print(f"flashreinforce eval: error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        result = evaluate_model(cfg, sampled=not no_sampled, samples_path=samples)
    except ConfigError as err:
        print(f"flashreinforce eval: error: {err}", file=sys.stderr)
        return 2
    text = json.dumps(result, default=str)
    print(text, flush=True)
    if result.get("run_dir"):  # the run's own record of its evaluations by this command (flashreinforce plot reads it)
        record = {"step": result["checkpoint_step"], "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **{
            k: result.get(k) for k in ("accuracy", "pass@1", "reward_mean", "num_prompts", "heldout", "model")}}
        with open(Path(result["run_dir"]) / EVAL_COMMAND_FILE, "a") as fh:
            fh.write(json.dumps(record, default=str) + "\n")
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(text + "\n")
    return 0
