"""Inspect or launch a published FlashREINFORCE experiment (``examples/run_experiment.py``).

Targets: this project's own trainer (default) or a Molt-style checkout (``--trainer-path``).
``--print-config`` prints the resolved settings; ``--dry-run`` prints the working directory and the
full command and checks nothing; a real launch first asks the trainer's ``--help`` for every flag,
checks the files it needs, and only then writes ``resolved_settings.json`` and starts the trainer.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from flashreinforce.config.schema import RETIRED_FLAGS
from flashreinforce.experiments.launch import (
    LaunchError,
    TrainerTarget,
    check_capabilities,
    flag_arguments,
    format_command,
    launch_env,
    write_resolved_settings,
)
from flashreinforce.experiments.resolve import (
    ResolvedSetting,
    SettingError,
    json_value,
    load_setting,
    setting_names,
)

#: The environment the native trainer uses for the math agent kind when no --agent-path is given.
NATIVE_MATH_AGENT = "flashreinforce.envs.math_env:MathEnv"
#: Where a Molt checkout keeps its math agent.
MOLT_MATH_AGENT = Path("examples/python/agents/math.py")

_PLACEMENT = ("actor_nodes", "actor_gpus", "rollout_engines", "rollout_tp", "actor_tp", "actor_ep", "actor_cp")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="run_experiment.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", required=True, choices=setting_names(), help="published setting to run")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME",
                        help="variant of the setting; repeat to apply several, in order (last value wins)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved settings as JSON and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the working directory and the full command; check nothing, create nothing")
    paths = parser.add_argument_group("paths")
    paths.add_argument("--trainer-path", type=Path,
                       help="a Molt-style trainer checkout to launch; default: this project's own trainer")
    paths.add_argument("--agent-path",
                       help="the agent/environment: a .py file, or MODULE:CLASS for the native trainer; "
                            "required for the python_tool and alfworld settings")
    paths.add_argument("--model", help="a local checkpoint (or hub id) replacing the setting's model")
    paths.add_argument("--train-data", type=Path, help="training prompt dataset (JSONL)")
    paths.add_argument("--eval-data", type=Path, help="evaluation dataset (JSONL)")
    paths.add_argument("--output", type=Path, help="output directory (default: outputs/<setting>)")
    again = parser.add_argument_group("an output directory that already holds a run (this project's trainer only)")
    again.add_argument("--resume", action="store_true", help="continue the run in --output from its newest checkpoint")
    again.add_argument("--overwrite", action="store_true",
                       help="delete the run in --output (records and checkpoints) and start over")
    gpus = parser.add_argument_group("GPU placement (all must be positive)")
    gpus.add_argument("--actor-nodes", type=int, default=1, help="learner nodes")
    gpus.add_argument("--actor-gpus", type=int, default=1, help="learner GPUs per node")
    gpus.add_argument("--actor-tp", type=int, default=1, help="learner tensor-parallel size")
    gpus.add_argument("--actor-ep", type=int, default=1, help="learner expert-parallel size")
    gpus.add_argument("--actor-cp", type=int, default=1, help="learner context-parallel size")
    gpus.add_argument("--rollout-engines", type=int, default=1, help="rollout (vLLM) engines")
    gpus.add_argument("--rollout-tp", type=int, default=1, help="tensor-parallel size of each rollout engine")
    gpus.add_argument("--attention", choices=["flash_attention_2", "te"], default="flash_attention_2",
                      help="learner attention implementation (fsdp.attn_implementation)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        setting = load_setting(args.setting, args.variant)
    except SettingError as error:
        parser.error(str(error))
    if args.print_config:
        print(json.dumps(setting.to_json(), indent=2))
        return 0

    for name in _PLACEMENT:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("train_data", "eval_data"):
        if getattr(args, name) is None:
            parser.error(f"--{name.replace('_', '-')} is required to build the trainer command")
    if args.resume and args.overwrite:
        parser.error("--resume and --overwrite contradict each other; give one of them")
    if (args.resume or args.overwrite) and args.trainer_path:
        parser.error(f"--{'resume' if args.resume else 'overwrite'} is an option of this project's trainer; a Molt "
                     "checkout (--trainer-path) resumes through its own ckpt.* flags")
    if setting.agent != "math" and not args.agent_path:
        parser.error(f"setting {setting.name!r} needs an explicit {setting.agent} agent: pass --agent-path "
                     "(a math agent cannot stand in)")

    target = TrainerTarget.molt(args.trainer_path.expanduser().resolve()) if args.trainer_path else TrainerTarget.native()
    output = (args.output or Path("outputs") / setting.name).expanduser().resolve()
    agent = _agent_spec(args.agent_path, target)
    flags = _launch_flags(setting, args, target, agent, output)
    command = list(target.command) + flag_arguments(flags)

    print(f"Working directory: {target.cwd}", flush=True)
    print(format_command(command, setting.max_agent_turns), flush=True)
    if args.dry_run:
        print("Dry run: nothing was checked (trainer capabilities, files, ALFWORLD_DATA) and nothing was created.")
        return 0

    env = launch_env(setting.max_agent_turns)
    try:
        check_capabilities(target, flags, env)
        _check_inputs(setting, target, args, agent)
    except LaunchError as error:
        parser.error(str(error))
    record = {**setting.to_json(), "trainer": target.name, "working_directory": str(target.cwd),
              "command": command, "flags": {key: json_value(value) for key, value in flags.items()}}
    path = write_resolved_settings(output, record)
    print(f"Wrote {path}", flush=True)
    return subprocess.run(command, cwd=target.cwd, env=env).returncode


def _agent_spec(agent_path: str | None, target: TrainerTarget) -> str:
    """The agent as the target understands it: an absolute file path, or MODULE:CLASS (native only)."""
    if agent_path is None:
        return NATIVE_MATH_AGENT if target.name == "native" else str(target.cwd / MOLT_MATH_AGENT)
    path = Path(agent_path).expanduser()
    if target.name == "native" and ":" in agent_path and not path.exists():
        return agent_path
    return str(path.resolve())


def _launch_flags(setting: ResolvedSetting, args: argparse.Namespace, target: TrainerTarget, agent: str,
                  output: Path) -> dict[str, Any]:
    flags = dict(setting.flags)
    flags.update({
        "actor.model_name_or_path": args.model or setting.model,
        "train.agent_path": agent,
        "data.prompt_dataset": str(args.train_data.expanduser().resolve()),
        "eval.dataset": str(args.eval_data.expanduser().resolve()),
        "actor.num_nodes": args.actor_nodes,
        "actor.num_gpus_per_node": args.actor_gpus,
        "ref.num_nodes": args.actor_nodes,
        "ref.num_gpus_per_node": args.actor_gpus,
        "fsdp.tp_size": args.actor_tp,
        "fsdp.ep_size": args.actor_ep,
        "fsdp.cp_size": args.actor_cp,
        "vllm.num_engines": args.rollout_engines,
        "vllm.tensor_parallel_size": args.rollout_tp,
        "fsdp.attn_implementation": args.attention,
        "ckpt.output_dir": str(output / "hf"),
        "ckpt.path": str(output / "state"),
    })
    if target.name == "native":
        # Molt's flags that this trainer has no setting for, and train.batch_size, which it derives from
        # rollout.batch_size * rollout.n_samples_per_prompt (the setting's rules hold it equal)
        for name in (*RETIRED_FLAGS, "train.batch_size"):
            flags.pop(name, None)
        flags["output"] = str(output)
        if args.resume:
            flags["resume"] = True
        if args.overwrite:
            flags["overwrite"] = True
    return flags


def _check_inputs(setting: ResolvedSetting, target: TrainerTarget, args: argparse.Namespace, agent: str) -> None:
    """Raise LaunchError for the first missing input: trainer entry point, agent, datasets, ALFWORLD_DATA."""
    if target.name == "molt" and not (target.cwd / "molt" / "cli" / "train_rl_ray.py").is_file():
        raise LaunchError(f"{target.cwd} is not a Molt checkout: molt/cli/train_rl_ray.py not found")
    if ":" in agent and not Path(agent).exists():
        module = agent.split(":", 1)[0]
        if importlib.util.find_spec(module) is None:
            raise LaunchError(f"agent module {module!r} (from --agent-path {agent}) cannot be imported")
    elif not Path(agent).is_file():
        raise LaunchError(f"agent file not found: {agent}")
    for flag, path in (("--train-data", args.train_data), ("--eval-data", args.eval_data)):
        if not path.expanduser().exists():
            raise LaunchError(f"{flag}: dataset not found: {path}")
    if setting.agent == "alfworld":
        data = os.environ.get("ALFWORLD_DATA")
        if not data or not Path(data).is_dir():
            raise LaunchError("set ALFWORLD_DATA to the ALFWorld game-data directory (visible to every worker)"
                              + (f"; {data!r} is not a directory" if data else ""))


if __name__ == "__main__":
    sys.exit(main())
