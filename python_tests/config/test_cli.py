"""`flashreinforce train`: flag registry and parsing, capability for every published setting,
refusals that name the flag, and the environment factory (.py agent file, dataset-driven env)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flashreinforce.config import FLAGS, ConfigError, parse_train_args
from flashreinforce.config.presets import PRESETS

ROOT = Path(__file__).resolve().parents[2]

REQUIRED = """actor.adam.lr actor.adam.weight_decay actor.entropy_coef actor.eps_clip_low_high actor.flash_gate_delta
actor.flash_gate_level actor.flash_loss_agg actor.flash_neg_topq actor.flash_no_is actor.gradient_checkpoint
actor.loss_mode actor.loss_scale_factor actor.lr_scheduler actor.lr_warmup_ratio actor.max_norm
actor.min_lr_ratio actor.optim actor.model_name_or_path actor.num_nodes actor.num_gpus_per_node
ref.num_nodes ref.num_gpus_per_node algo.advantage.estimator algo.advantage.is_correction_level
algo.advantage.no_whiten algo.kl.init_coef ckpt.output_dir ckpt.path ckpt.save_steps
data.apply_chat_template data.input_key data.label_key data.max_len data.max_samples data.prompt_dataset
eval.dataset eval.eval_at_start eval.n_samples_per_prompt eval.steps eval.temperature eval.top_p
fsdp.attn_implementation fsdp.packing_samples fsdp.param_dtype fsdp.tp_size fsdp.ep_size fsdp.cp_size
logger.logging_steps rollout.batch_size rollout.max_new_tokens rollout.micro_batch_size
rollout.n_samples_per_prompt rollout.temperature rollout.top_p rollout.vllm_generate_batch_size
train.agent_path train.async_queue_size train.batch_size train.colocate_fsdp_models train.force_on_policy
train.max_epochs train.micro_batch_size train.num_episodes train.max_steps train.max_policy_lag
vllm.gpu_memory_utilization vllm.num_engines vllm.sync_backend vllm.tensor_parallel_size
preset env model output resume""".split()


def parse(*argv):
    return parse_train_args(list(argv), PRESETS)


def test_help_lists_every_molt_flag():
    out = subprocess.run([sys.executable, "-m", "flashreinforce.cli", "train", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    listed = set(re.findall(r"--([A-Za-z0-9_][A-Za-z0-9_.\-]*)", out.stdout))
    assert [f for f in REQUIRED if f not in listed] == []
    assert {f.name for f in FLAGS} <= listed


def test_types_switches_pairs_and_inf():
    cfg = parse("--preset", "toy", "--output", "x", "--actor.flash_no_is", "--eval.eval_at_start", "false",
                "--actor.eps_clip_low_high", "0.1", "0.3", "--actor.flash_gate_delta", "inf",
                "--train.max_policy_lag", "none", "--data.max_samples", "5")
    f = cfg.flags
    assert f["actor.flash_no_is"] is True and f["eval.eval_at_start"] is False
    assert f["actor.eps_clip_low_high"] == (0.1, 0.3) and f["actor.flash_gate_delta"] == float("inf")
    assert f["train.max_policy_lag"] is None and f["data.max_samples"] == 5
    # the preset's values, then the command line's
    assert f["rollout.batch_size"] == PRESETS["toy"]["rollout.batch_size"]
    assert parse("--preset", "toy", "--rollout.batch_size", "8").flags["rollout.batch_size"] == 8
    assert cfg.explicit == sorted(["actor.flash_no_is", "eval.eval_at_start", "actor.eps_clip_low_high",
                                   "actor.flash_gate_delta", "train.max_policy_lag", "data.max_samples"])


def test_flags_without_effect_are_recorded_as_inactive_with_reasons():
    cfg = parse("--preset", "toy", "--vllm.sync_backend", "nccl", "--ref.num_nodes", "2",
                "--actor.num_gpus_per_node", "8", "--train.force_on_policy")
    assert "no vllm engine" in cfg.inactive["vllm.sync_backend"]
    assert "reference" in cfg.inactive["ref.num_nodes"]
    assert "one optimizer step" in cfg.inactive["train.force_on_policy"]
    assert any("actor.num_gpus_per_node 8" in w for w in cfg.warnings)
    ppo = parse("--preset", "toy", "--actor.loss_mode", "ppo", "--algo.advantage.estimator", "grpo",
                "--rollout.batch_size", "16", "--rollout.n_samples_per_prompt", "4")
    assert "dropped" in ppo.inactive["actor.flash_gate_delta"]


def test_a_retired_molt_flag_is_accepted_with_a_warning_that_says_what_to_use_instead(tmp_path, capsys):
    """``--rollout.micro_batch_size`` (Molt's rollout forward micro-batch) has no setting here: a published
    command line or an older run's config file that gives it still resolves, warned, and nothing keeps it."""
    from flashreinforce.config import read_config_file
    from flashreinforce.experiments.cli import main as run_experiment

    cfg = parse("--preset", "toy", "--rollout.micro_batch_size", "2")
    assert any("--rollout.micro_batch_size is ignored" in w and "--train.micro_batch_size" in w for w in cfg.warnings)
    assert "rollout.micro_batch_size" in cfg.inactive and "rollout.micro_batch_size" not in cfg.flags
    assert "micro_batch_size" not in cfg.to_file()["rollout"] and not hasattr(cfg.rollout, "micro_batch_size")
    old = tmp_path / "old.yaml"
    old.write_text("preset: toy\nrollout: {micro_batch_size: 1, batch_size: 8}\n")
    assert any("rollout.micro_batch_size" in w for w in parse("--config", str(old)).warnings)
    assert read_config_file(old)["rollout.micro_batch_size"] == 1
    # the published launcher does not pass it to this trainer (a Molt checkout's command keeps it)
    assert run_experiment(["--setting", "r1", "--train-data", "t", "--eval-data", "e", "--dry-run"]) == 0
    command = capsys.readouterr().out
    assert "flashreinforce.cli train" in command and "--train.micro_batch_size 1" in command
    assert "--rollout.micro_batch_size" not in command
    assert "--rollout.batch_size 128" in command and "--train.batch_size" not in command  # derived by this trainer


def test_a_lora_run_at_a_full_fine_tuning_learning_rate_is_warned():
    slow = parse("--preset", "toy", "--lora.rank", "16", "--actor.adam.lr", "1e-5")
    assert any("--lora.rank 16 with --actor.adam.lr 1e-05" in w and "2e-4" in w for w in slow.warnings)
    for argv in (("--lora.rank", "16", "--actor.adam.lr", "2e-4"), ("--actor.adam.lr", "1e-5")):
        assert not any("lora" in w for w in parse("--preset", "toy", *argv).warnings), argv


@pytest.mark.parametrize("argv,needle", [
    (["--fsdp.tp_size", "4"], "fsdp.tp_size"),
    (["--train.max_epochs", "2"], "train.max_epochs"),
    (["--algo.kl.init_coef", "0.1"], "algo.kl.init_coef"),
    (["--algo.advantage.is_correction_level", "seq"], "is_correction_level"),
    (["--train.batch_size", "7"], "train.batch_size"),
    (["--rollout.n_samples_per_prompt", "4", "--train.batch_size", "256"], "n_samples_per_prompt"),
    (["--actor.flash_neg_topq", "1.5"], "flash_neg_topq"),
    (["--actor.flash_loss_agg", "seq-mean-token-sum-norm"], "loss_scale_factor"),
    (["--actor.loss_mode", "ppo"], "grpo"),
    (["--rollout.backend", "ray", "--ray.num_cpus_per_worker", "-1"], "ray.num_cpus_per_worker"),
    (["--rollout.backend", "ray", "--ray.max_restarts", "-2"], "ray.max_restarts"),
    (["--rollout.engine", "vllm", "--rollout.num_workers", "3", "--vllm.num_engines", "2"], "vllm.num_engines"),
    (["--vllm.gpu_memory_utilization", "1.5"], "vllm.gpu_memory_utilization"),
    (["--data.max_len", "1"], "data.max_len"),
])
def test_values_this_runtime_cannot_honour_are_errors_naming_the_flag(argv, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        parse("--preset", "toy", *argv)


def test_argparse_level_refusals():
    with pytest.raises(SystemExit):
        parse("--actor.flash_gate_level", "token")
    with pytest.raises(ConfigError, match="unknown --preset"):
        parse("--preset", "nope")
    with pytest.raises(SystemExit):
        parse("--actor.no_such_flag", "1")


def test_every_published_setting_and_variant_parses_and_resolves():
    from flashreinforce.config.schema import RETIRED_FLAGS
    from flashreinforce.experiments.launch import flag_arguments
    from flashreinforce.experiments.resolve import load_setting, setting_names, variant_names

    count = 0
    for name in setting_names():
        for variant in [None] + variant_names(name):
            setting = load_setting(name, [variant] if variant else [])
            cfg = parse(*flag_arguments(setting.flags), "--output", "x")
            for key, value in setting.flags.items():
                if key in RETIRED_FLAGS:  # accepted, warned, not kept
                    assert key in cfg.inactive, (name, variant, key)
                    continue
                got = cfg.flags[key]
                want = tuple(value) if isinstance(value, list) else value
                assert got == want or (value is None and got is None), (name, variant, key, got, want)
            count += 1
    assert count >= 20


AGENT = '''
from flashreinforce.envs.tasks import TaskEnvironment
from flashreinforce.envs.base import StepResult

class EchoLabel(TaskEnvironment):
    """Rewards an answer whose first character is the label's first character."""
    def step(self, action):
        ok = action[:1] == str(self.task.ground_truth)[:1]
        return StepResult(reward=float(ok), done=True)
'''


def test_agent_file_and_dataset_environment_run(tmp_path):
    (tmp_path / "agent.py").write_text(AGENT)
    rows = [{"prompt": f"say {c}:", "reward_model": {"ground_truth": c}} for c in "abcdefghij"]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "flashreinforce.cli", "train", "--model", "tiny-qwen2", "--tokenizer", "char",
         "--train.agent_path", str(tmp_path / "agent.py"), "--data.prompt_dataset", str(tmp_path / "data.jsonl"),
         "--data.max_samples", "8", "--train.num_episodes", "2", "--rollout.batch_size", "4", "--train.batch_size", "4",
         "--rollout.max_new_tokens", "1", "--data.max_len", "16", "--rollout.num_workers", "1",
         "--output", str(out), "--no_progress", "--data.apply_chat_template"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_prompts"] == 8 and cfg["max_steps"] == 4  # 2 passes over 8 rows, 4 prompts per batch
    assert "character tokenizer" in cfg["inactive"]["data.apply_chat_template"]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert (out / "hf" / "config.json").is_file() and (out / "checkpoints" / "latest").is_file()


def test_missing_output_and_environment_are_clear_errors(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "flashreinforce.cli", "train", "--model", "tiny-qwen2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--output" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "flashreinforce.cli", "train", "--model", "tiny-qwen2",
                           "--output", str(tmp_path / "o"), "--train.max_steps", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--env" in proc.stderr


@pytest.mark.parametrize("preset,torch_first,expected", [
    ({}, False, "policy=None spin=10000"),  # a short spin, then sleep
    ({"OMP_WAIT_POLICY": "ACTIVE"}, False, "policy=ACTIVE spin=None"),  # the user's wait policy is kept
    ({"OMP_WAIT_POLICY": "PASSIVE"}, False, "policy=PASSIVE spin=None"),
    ({"GOMP_SPINCOUNT": "500"}, False, "policy=None spin=500"),  # and the user's spin count
    ({}, True, "policy=None spin=None"),  # too late once torch is imported: nothing set
])
def test_console_script_shortens_openmp_spinning_unless_told_otherwise(preset, torch_first, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(preset)
    code = ("import os, sys\n" + ("import torch\n" if torch_first else "") +
            "from flashreinforce.cli import main\nmain(['--help'])\n"
            "print('policy=' + str(os.environ.get('OMP_WAIT_POLICY')) + ' spin=' + str(os.environ.get('GOMP_SPINCOUNT')))\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert expected in out
