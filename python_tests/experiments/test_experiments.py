"""Published settings: resolution rules, run_experiment.py launching, and the Molt launcher."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from flashreinforce.experiments import SettingError, check_rules, load_setting, setting_names, variant_names
from flashreinforce.experiments.cli import main as run_experiment
from flashreinforce.experiments.launch import TrainerTarget, flag_arguments, supported_flags, unsupported_flags

ROOT = Path(__file__).resolve().parents[2]
ALL_COMBINATIONS = [(s, ()) for s in setting_names()] + [(s, (v,)) for s in setting_names() for v in variant_names(s)]


def _load_train_molt():
    spec = importlib.util.spec_from_file_location("train_molt", ROOT / "scripts" / "train_molt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_five_published_settings_and_their_variants_exist():
    assert setting_names() == ["alfworld", "qwen3_tool_ablation", "qwen7b_tool", "qwen_math", "r1"]
    assert variant_names("r1") == ["gate_5e3", "no_trust"]
    assert variant_names("qwen_math") == ["gate_1e3", "negative_q09", "negative_q02", "five_benchmark_eval16"]
    assert variant_names("qwen7b_tool") == ["negative_q09", "negative_q02", "negative_q00", "token_mean",
                                            "constant_length", "grpo"]
    assert variant_names("qwen3_tool_ablation") == ["no_trust", "no_is"]
    assert variant_names("alfworld") == ["negative_q02", "no_is", "grpo"]


@pytest.mark.parametrize("setting, variants", ALL_COMBINATIONS)
def test_every_setting_and_variant_resolves_and_obeys_the_rules(setting, variants):
    resolved = load_setting(setting, variants)
    f = resolved.flags
    assert f["rollout.batch_size"] * f["rollout.n_samples_per_prompt"] == f["train.batch_size"]
    assert f["train.max_epochs"] == 1 and f["train.force_on_policy"] is True and f["algo.kl.init_coef"] == 0
    assert f["data.max_len"] > f["rollout.max_new_tokens"]
    if f["actor.loss_mode"] == "flash_reinforce":
        assert f["algo.advantage.is_correction_level"] == "off" and f["rollout.n_samples_per_prompt"] == 1
        assert 0 <= f["actor.flash_neg_topq"] <= 1
    else:
        assert not [k for k in f if k.startswith("actor.flash_")]
        assert f["algo.advantage.estimator"] == "grpo"
        assert all("loss_mode" in reason for reason in resolved.dropped.values()) and resolved.dropped
    json.dumps(resolved.to_json(), allow_nan=False)  # strict JSON: inf is written as "inf"


@pytest.mark.parametrize("setting, variants, expected", [
    ("r1", (), {"actor.flash_gate_delta": 0.003, "train.async_queue_size": 8, "data.max_len": 9216,
                "rollout.max_new_tokens": 8192, "rollout.vllm_generate_batch_size": 512, "train.num_episodes": 350,
                "eval.n_samples_per_prompt": 32, "eval.top_p": 0.95, "actor.adam.lr": 1e-6}),
    ("r1", ("gate_5e3",), {"actor.flash_gate_delta": 0.005}),
    ("r1", ("no_trust",), {"actor.flash_gate_delta": math.inf}),
    ("qwen_math", (), {"train.micro_batch_size": 2, "data.max_samples": 7500, "train.num_episodes": 68,
                       "actor.flash_gate_delta": 0.003, "train.async_queue_size": 1}),
    ("qwen_math", ("negative_q02",), {"actor.flash_gate_delta": 0.001, "actor.flash_neg_topq": 0.2}),
    ("qwen_math", ("five_benchmark_eval16",), {"eval.n_samples_per_prompt": 16}),
    ("qwen7b_tool", (), {"actor.flash_gate_delta": 0.001, "rollout.max_new_tokens": 6144, "data.max_len": 8192}),
    ("qwen7b_tool", ("negative_q00",), {"actor.flash_neg_topq": 0.0}),
    ("qwen7b_tool", ("token_mean",), {"actor.flash_loss_agg": "token-mean"}),
    ("qwen7b_tool", ("constant_length",), {"actor.flash_loss_agg": "seq-mean-token-sum-norm",
                                           "actor.loss_scale_factor": 6144}),
    ("qwen7b_tool", ("grpo",), {"actor.loss_mode": "ppo", "rollout.batch_size": 32, "rollout.n_samples_per_prompt": 4,
                                "train.batch_size": 128, "actor.eps_clip_low_high": [0.2, 0.2],
                                "algo.advantage.no_whiten": True, "train.num_episodes": 17}),
    ("qwen3_tool_ablation", (), {"train.async_queue_size": 4, "data.max_len": 16384, "actor.flash_gate_delta": 0.003}),
    ("qwen3_tool_ablation", ("no_trust",), {"actor.flash_gate_delta": 1e9}),
    ("qwen3_tool_ablation", ("no_is",), {"actor.flash_no_is": True, "actor.flash_gate_delta": 0.001}),
    ("alfworld", (), {"data.label_key": "game_file", "rollout.batch_size": 64, "train.batch_size": 64,
                      "actor.lr_scheduler": "constant", "actor.flash_neg_topq": 0.9, "eval.steps": 40}),
    ("alfworld", ("grpo",), {"rollout.batch_size": 8, "rollout.n_samples_per_prompt": 8, "train.num_episodes": 3}),
])
def test_key_values_of_the_published_settings(setting, variants, expected):
    flags = load_setting(setting, variants).flags
    for key, value in expected.items():
        assert flags[key] == value, key


def test_settings_metadata():
    assert load_setting("r1").model == "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
    assert (load_setting("qwen3_tool_ablation").agent, load_setting("qwen3_tool_ablation").max_agent_turns) == ("python_tool", 20)
    assert (load_setting("alfworld").agent, load_setting("alfworld").max_agent_turns) == ("alfworld", 50)
    assert load_setting("qwen7b_tool").max_agent_turns == 10 and load_setting("qwen_math").max_agent_turns == 1


def test_variants_apply_in_order_last_value_wins():
    assert load_setting("r1", ["no_trust", "gate_5e3"]).flags["actor.flash_gate_delta"] == 0.005
    assert load_setting("r1", ["gate_5e3", "no_trust"]).flags["actor.flash_gate_delta"] == math.inf
    both = load_setting("qwen_math", ["negative_q09", "five_benchmark_eval16"]).flags
    assert (both["actor.flash_neg_topq"], both["eval.n_samples_per_prompt"]) == (0.9, 16)


def test_unknown_variant_and_setting_list_the_valid_ones():
    with pytest.raises(SettingError, match="gate_5e3, no_trust"):
        load_setting("r1", ["bogus"])
    with pytest.raises(SettingError, match="alfworld.*r1"):
        load_setting("r2")


@pytest.mark.parametrize("change, match", [
    ({"train.batch_size": 64}, "train.batch_size"),
    ({"train.max_epochs": 2}, "max_epochs"),
    ({"train.force_on_policy": False}, "force_on_policy"),
    ({"algo.kl.init_coef": 0.01}, "init_coef"),
    ({"data.max_len": 8192}, "max_len"),
    ({"algo.advantage.is_correction_level": "seq"}, "is_correction_level"),
    ({"rollout.n_samples_per_prompt": 2, "rollout.batch_size": 64}, "one sample per prompt"),
    ({"actor.flash_neg_topq": 1.5}, "flash_neg_topq"),
    ({"actor.flash_gate_delta": math.nan}, "flash_gate_delta"),
])
def test_rule_violations_are_rejected(change, match):
    flags = {**load_setting("r1").flags, **change}
    with pytest.raises(SettingError, match=match):
        check_rules(flags)


def test_other_loss_modes_need_grpo_and_no_flash_flags():
    flags = load_setting("qwen7b_tool", ["grpo"]).flags
    with pytest.raises(SettingError, match="actor.flash_"):
        check_rules({**flags, "actor.flash_neg_topq": 0.5})
    with pytest.raises(SettingError, match="grpo"):
        check_rules({**flags, "algo.advantage.estimator": "flash_reinforce"})


def test_flag_arguments_are_molt_style():
    args = flag_arguments({"a.x": True, "a.y": False, "a.z": None, "a.l": [0.2, 0.2], "a.d": math.inf, "a.s": "seq"})
    assert args == ["--a.x", "--a.l", "0.2", "0.2", "--a.d", "inf", "--a.s", "seq"]


# ------------------------------------------------------------------------------------------------
# examples/run_experiment.py


def test_print_config_is_the_resolved_json(capsys):
    assert run_experiment(["--setting", "qwen_math", "--variant", "negative_q09", "--print-config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["setting"] == "qwen_math" and printed["variants"] == ["negative_q09"]
    assert printed["flags"]["actor.flash_neg_topq"] == 0.9


def test_dry_run_prints_command_and_creates_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    code = run_experiment(["--setting", "r1", "--variant", "no_trust", "--train-data", "t.jsonl",
                           "--eval-data", "e.jsonl", "--output", str(out), "--dry-run"])
    text = capsys.readouterr().out
    assert code == 0 and not out.exists()
    assert "Working directory:" in text and "nothing was checked" in text
    assert "MAX_AGENT_TURNS=1 " in text and "--actor.flash_gate_delta inf" in text
    assert "-m flashreinforce.cli train" in text and "--train.agent_path flashreinforce.envs.math_env:MathEnv" in text


@pytest.mark.parametrize("setting", ["qwen7b_tool", "qwen3_tool_ablation", "alfworld"])
def test_tool_and_alfworld_settings_refuse_to_preview_without_an_agent(setting, capsys):
    with pytest.raises(SystemExit):
        run_experiment(["--setting", setting, "--train-data", "t", "--eval-data", "e", "--dry-run"])
    assert "--agent-path" in capsys.readouterr().err


def test_gpu_placement_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        run_experiment(["--setting", "r1", "--train-data", "t", "--eval-data", "e", "--actor-gpus", "0", "--dry-run"])
    assert "--actor-gpus must be positive" in capsys.readouterr().err


FAKE_MOLT = '''
import json, os, sys
from pathlib import Path
here = Path(__file__).resolve().parents[2]
if "--help" in sys.argv:
    print("usage: train_rl_ray [options]")
    for flag in json.loads((here / "flags.json").read_text()):
        print(f"  --{flag} VALUE")
    sys.exit(0)
(here / "launched.json").write_text(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(),
    "env": {k: os.environ.get(k) for k in ("MAX_AGENT_TURNS", "RAY_USAGE_STATS_ENABLED",
                                           "VLLM_WORKER_MULTIPROC_METHOD", "TOKENIZERS_PARALLELISM")}}))
'''


def _fake_molt(tmp_path, flags):
    root = tmp_path / "molt_checkout"
    (root / "molt" / "cli").mkdir(parents=True)
    for package in (root / "molt", root / "molt" / "cli"):
        (package / "__init__.py").write_text("")
    (root / "molt" / "cli" / "train_rl_ray.py").write_text(FAKE_MOLT)
    (root / "flags.json").write_text(json.dumps(sorted(flags)))
    agent = root / "examples" / "python" / "agents" / "math.py"
    agent.parent.mkdir(parents=True)
    agent.write_text("# math agent\n")
    (tmp_path / "train.jsonl").write_text("{}\n")
    (tmp_path / "eval.jsonl").write_text("{}\n")
    return root


def _launch_args(tmp_path, root, setting="qwen_math", *extra):
    return ["--setting", setting, "--trainer-path", str(root), "--train-data", str(tmp_path / "train.jsonl"),
            "--eval-data", str(tmp_path / "eval.jsonl"), "--output", str(tmp_path / "out"), *extra]


def _all_passed_flags(tmp_path, root, setting, variants=()):
    """The flag names run_experiment passes for this setting (read back from a dry run).

    ``root`` None targets the native trainer, else a Molt checkout at ``root``.
    """
    args = ["--setting", setting, "--train-data", "t.jsonl", "--eval-data", "e.jsonl", "--dry-run",
            "--agent-path", str(tmp_path / "agent.py")]
    if root is not None:
        args += ["--trainer-path", str(root)]
    for v in variants:
        args += ["--variant", v]
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "run_experiment.py"), *args],
                          capture_output=True, text=True, check=True)
    command = proc.stdout.splitlines()[1]
    return {tok[2:] for tok in command.split() if tok.startswith("--")}


def test_launch_refuses_unsupported_flags_before_creating_anything(tmp_path, capsys):
    wanted = _all_passed_flags(tmp_path, tmp_path, "qwen_math")
    root = _fake_molt(tmp_path, wanted - {"actor.flash_gate_delta"})
    with pytest.raises(SystemExit):
        run_experiment(_launch_args(tmp_path, root))
    err = capsys.readouterr().err
    assert "--actor.flash_gate_delta" in err and "1 flag(s)" in err
    assert not (tmp_path / "out").exists() and not (root / "launched.json").exists()


def test_launch_with_a_capable_trainer_writes_resolved_settings_and_sets_the_environment(tmp_path):
    wanted = _all_passed_flags(tmp_path, tmp_path, "qwen_math")
    root = _fake_molt(tmp_path, wanted)
    assert run_experiment(_launch_args(tmp_path, root, "qwen_math", "--variant", "negative_q02")) == 0
    launched = json.loads((root / "launched.json").read_text())
    assert launched["env"] == {"MAX_AGENT_TURNS": "1", "RAY_USAGE_STATS_ENABLED": "0",
                               "VLLM_WORKER_MULTIPROC_METHOD": "spawn", "TOKENIZERS_PARALLELISM": "true"}
    assert Path(launched["cwd"]) == root.resolve()
    argv = launched["argv"]
    assert argv[argv.index("--actor.flash_neg_topq") + 1] == "0.2"
    assert argv[argv.index("--train.agent_path") + 1] == str(root / "examples/python/agents/math.py")
    resolved = json.loads((tmp_path / "out" / "resolved_settings.json").read_text())
    assert resolved["setting"] == "qwen_math" and resolved["variants"] == ["negative_q02"]
    assert resolved["flags"]["actor.flash_neg_topq"] == 0.2 and resolved["trainer"] == "molt"


def test_launch_checks_inputs_and_alfworld_data(tmp_path, capsys, monkeypatch):
    root = _fake_molt(tmp_path, _all_passed_flags(tmp_path, tmp_path, "alfworld"))
    agent = tmp_path / "alfworld_agent.py"
    agent.write_text("# agent\n")
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    with pytest.raises(SystemExit):
        run_experiment(_launch_args(tmp_path, root, "alfworld", "--agent-path", str(agent)))
    assert "ALFWORLD_DATA" in capsys.readouterr().err and not (tmp_path / "out").exists()
    (tmp_path / "eval.jsonl").unlink()
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    with pytest.raises(SystemExit):
        run_experiment(_launch_args(tmp_path, root, "alfworld", "--agent-path", str(agent)))
    assert "--eval-data" in capsys.readouterr().err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("setting, variants", ALL_COMBINATIONS)
def test_native_trainer_supports_every_setting_and_variant(setting, variants, tmp_path, native_help_flags):
    flags = _all_passed_flags(tmp_path, None, setting, variants)
    assert "output" in flags and "actor.model_name_or_path" in flags
    assert unsupported_flags({f: 1 for f in flags}, native_help_flags) == []


@pytest.fixture(scope="module")
def native_help_flags():
    target = TrainerTarget.native(ROOT)
    return supported_flags(target, dict(__import__("os").environ))


# ------------------------------------------------------------------------------------------------
# scripts/train_molt.py


SHARED_MOLT_FLAGS = [
    "--data.input_key prompt", "--data.label_key reward_model", "--rollout.batch_size 128",
    "--rollout.vllm_generate_batch_size 512", "--rollout.micro_batch_size 1", "--rollout.n_samples_per_prompt 1",
    "--rollout.temperature 1.0", "--rollout.top_p 1.0", "--train.batch_size 128", "--train.micro_batch_size 1",
    "--train.max_epochs 1", "--train.async_queue_size 8", "--actor.num_nodes 1", "--ref.num_nodes 1",
    "--vllm.tensor_parallel_size 1", "--vllm.sync_backend nccl", "--vllm.gpu_memory_utilization 0.9",
    "--fsdp.param_dtype bf16", "--actor.gradient_checkpoint full", "--actor.optim adam", "--actor.adam.lr 1e-06",
    "--actor.adam.weight_decay 0.1", "--actor.lr_scheduler cosine_with_min_lr", "--actor.lr_warmup_ratio 0.03",
    "--actor.min_lr_ratio 0.1", "--actor.max_norm 1.0", "--actor.loss_agg_mode seq-mean-token-mean",
    "--actor.entropy_coef 0", "--algo.advantage.estimator flash_reinforce", "--algo.advantage.is_correction_level seq",
    "--algo.advantage.is_correction_mode mask", "--algo.advantage.is_correction_gating binary_kl",
    "--algo.kl.init_coef 0", "--ckpt.save_steps 50", "--logger.logging_steps 1", "--data.apply_chat_template",
    "--train.force_on_policy", "--train.colocate_fsdp_models", "--fsdp.packing_samples", "--eval.eval_at_start",
    "--fsdp.attn_implementation flash_attention_2", "--train.num_episodes 1000",
]
RECIPE_MOLT_FLAGS = {
    "r1": ["--data.max_samples 1460", "--data.max_len 9216", "--rollout.max_new_tokens 8192", "--eval.steps 128",
           "--eval.n_samples_per_prompt 32", "--eval.temperature 0.6", "--eval.top_p 0.95",
           "--algo.advantage.is_correction_threshold 0.005"],
    "qwen_math": ["--data.max_samples 7500", "--data.max_len 6144", "--rollout.max_new_tokens 4096",
                  "--eval.steps 100", "--eval.n_samples_per_prompt 16", "--eval.temperature 0.7", "--eval.top_p 0.7",
                  "--algo.advantage.is_correction_threshold 0.003"],
}


@pytest.mark.parametrize("recipe", ["r1", "qwen_math"])
def test_molt_launcher_dry_run_prints_the_documented_flags(recipe, tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_molt.py"), recipe, "--molt-path",
                           str(tmp_path / "molt"), "--model", "m", "--train-data", "t.jsonl", "--eval-data", "e.jsonl",
                           "--output", str(tmp_path / "out"), "--dry-run"], capture_output=True, text=True, check=True)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("Molt revision: 7e796e4e2648f905ae2a44dfc1b2ab98b07b68c3")
    assert lines[1] == f"Working directory: {tmp_path / 'molt'}"
    command = lines[2] + " "
    assert command.startswith("MAX_AGENT_TURNS=1 ") and " -u -m molt.cli.train_rl_ray " in command
    for flag in SHARED_MOLT_FLAGS + RECIPE_MOLT_FLAGS[recipe]:
        assert f" {flag} " in command, flag
    for flag in ("--actor.num_gpus_per_node 1", "--ref.num_gpus_per_node 1", "--vllm.num_engines 7",
                 f"--ckpt.output_dir {tmp_path / 'out' / 'hf'}", f"--ckpt.path {tmp_path / 'out' / 'state'}",
                 f"--train.agent_path {tmp_path / 'molt' / 'examples/python/agents/math.py'}"):
        assert f" {flag} " in command, flag
    assert not (tmp_path / "out").exists()


def test_molt_launcher_options(tmp_path):
    base = [sys.executable, str(ROOT / "scripts" / "train_molt.py"), "r1", "--molt-path", str(tmp_path), "--model", "m",
            "--train-data", "t", "--eval-data", "e", "--dry-run"]
    run = lambda *extra: subprocess.run(base + list(extra), capture_output=True, text=True)  # noqa: E731
    assert "--algo.advantage.is_correction_threshold inf " in run("--delta", "inf").stdout
    assert "--actor.num_gpus_per_node 8 " in run("--actor-gpus", "8", "--rollout-gpus", "24").stdout
    bad = run("--actor-gpus", "3")
    assert bad.returncode != 0 and "divisor of 128" in bad.stderr


def _git_checkout(path):
    path.mkdir()
    git = lambda *a: subprocess.run(["git", "-C", str(path), *a], check=True, capture_output=True, text=True)  # noqa: E731
    git("init", "-q")
    (path / "molt" / "cli").mkdir(parents=True)
    (path / "molt" / "__init__.py").write_text("")
    (path / "molt" / "cli" / "__init__.py").write_text("")
    (path / "molt" / "cli" / "train_rl_ray.py").write_text(FAKE_MOLT)
    (path / "flags.json").write_text("[]")
    agent = path / "examples" / "python" / "agents" / "math.py"
    agent.parent.mkdir(parents=True)
    agent.write_text("# math agent\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "fake molt")
    return git("rev-parse", "HEAD").stdout.strip()


def test_molt_launcher_refuses_other_revisions_and_dirty_trees_and_launches_a_clean_pinned_one(tmp_path, monkeypatch, capsys):
    train_molt = _load_train_molt()
    molt = tmp_path / "molt"
    head = _git_checkout(molt)
    (tmp_path / "t.jsonl").write_text("{}\n")
    (tmp_path / "e.jsonl").write_text("{}\n")
    argv = ["qwen_math", "--molt-path", str(molt), "--model", "m", "--train-data", str(tmp_path / "t.jsonl"),
            "--eval-data", str(tmp_path / "e.jsonl"), "--output", str(tmp_path / "out")]
    with pytest.raises(SystemExit):
        train_molt.main(argv)
    assert "pinned to 7e796e4e2648f905ae2a44dfc1b2ab98b07b68c3" in capsys.readouterr().err

    monkeypatch.setattr(train_molt, "MOLT_REVISION", head)
    (molt / "molt" / "__init__.py").write_text("# local edit\n")
    with pytest.raises(SystemExit):
        train_molt.main(argv)
    assert "modified tracked files" in capsys.readouterr().err
    subprocess.run(["git", "-C", str(molt), "checkout", "--", "."], check=True)

    (tmp_path / "t.jsonl").unlink()
    with pytest.raises(SystemExit):
        train_molt.main(argv)
    assert "--train-data" in capsys.readouterr().err
    (tmp_path / "t.jsonl").write_text("{}\n")

    assert train_molt.main(argv) == 0
    launched = json.loads((molt / "launched.json").read_text())
    assert launched["env"]["MAX_AGENT_TURNS"] == "1"
    assert launched["argv"][launched["argv"].index("--algo.advantage.is_correction_threshold") + 1] == "0.003"
