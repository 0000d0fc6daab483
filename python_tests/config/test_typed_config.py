"""The typed configuration: one declaration per flag (field, flag and config key share name, help and
bounds), the loss options and the names defined once, and the command line's small frictions."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from flashreinforce.config import FLAGS, ConfigError, TrainerConfig, build_parser, parse_train_args, validate
from flashreinforce.config.presets import PRESETS
from flashreinforce.config.trainer_config import FLAG_BY_NAME as FLAGS_BY_NAME
from flashreinforce.config.schema import KINDS, get_path

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "flashreinforce.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_every_flag_is_a_field_with_its_default_and_its_help():
    cfg = TrainerConfig()
    helps = {a.dest: a.help for a in build_parser()._actions}
    for f in FLAGS:
        assert f.type in KINDS
        assert get_path(cfg, f.attribute) == f.default, f.name
        assert f.help in helps[f.name], f.name
    assert cfg.flags == {f.name: f.default for f in FLAGS}
    assert len(FLAGS) == len({f.name for f in FLAGS}) > 90


def test_a_field_set_from_python_is_checked_like_its_flag():
    cfg = TrainerConfig.from_preset("toy", output="x")
    assert cfg.train.max_steps == PRESETS["toy"]["train.max_steps"] and cfg.output == "x"
    cfg.train.max_steps = 10**12
    with pytest.raises(ConfigError, match=r"--train\.max_steps must be in \[0, 1e\+09\]"):
        validate(cfg)
    cfg.train.max_steps = 5
    cfg.actor.flash_neg_topq = 1.5
    with pytest.raises(ConfigError, match=r"actor\.flash_neg_topq must be a number in \[0, 1\]"):
        validate(cfg)
    with pytest.raises(ConfigError, match="unknown run option 'max_steps'"):
        TrainerConfig.from_preset("toy", max_steps=3)


@pytest.mark.parametrize("argv,needle", [
    (["--train.max_steps", str(10**14)], r"--train\.max_steps must be in \[0, 1e\+09\], got 1e\+14"),
    (["--rollout.batch_size", "0"], "--rollout.batch_size must be positive, got 0"),
    (["--actor.lr_warmup_ratio", "1.5"], r"--actor\.lr_warmup_ratio must be in \[0, 1\]"),  # as LearnerSettings
    (["--eval.top_p", "0"], r"--eval\.top_p must be in \(0, 1\]"),
    (["--ray.max_restarts", "-2"], "--ray.max_restarts must be >= -1"),
])
def test_bounds_are_the_flags_own(argv, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_train_args(["--preset", "toy", "--output", "x", *argv], PRESETS)


def test_scaling_the_step_by_the_gate_s_acceptance_needs_a_gate():
    argv = ["--preset", "toy", "--output", "x", "--actor.scale_step_by_acceptance", "true"]
    assert parse_train_args(argv, PRESETS).actor.scale_step_by_acceptance is True
    with pytest.raises(ConfigError, match=r"--actor\.scale_step_by_acceptance needs a loss mode with a trust gate "
                                          r"\(flash_reinforce\); actor\.loss_mode ppo has none"):
        parse_train_args([*argv, "--actor.loss_mode", "ppo", "--algo.advantage.estimator", "grpo"], PRESETS)


def test_one_loss_options_type_from_the_flags_to_the_op():
    import torch

    from flashreinforce import objective
    from flashreinforce.ops import contract, loss_modes
    from flashreinforce.trainer.run.components import learner_settings

    cfg = parse_train_args(["--preset", "toy", "--output", "x", "--actor.flash_neg_topq", "0.25",
                            "--actor.flash_gate_delta", "0.02"], PRESETS)
    options = cfg.loss_options()
    assert options == objective.LossOptions(delta=0.02, negative_token_fraction=0.25)
    assert learner_settings(cfg, 10).loss == options
    assert loss_modes.LossOptions is objective.LossOptions
    assert contract.LOSS_AGGREGATIONS is objective.LOSS_AGGREGATIONS
    assert contract.DEFAULTS.delta == objective.LossOptions().delta
    # the op's argument check is LossOptions' check: the same message from both
    lp = torch.tensor([-1.0, -0.5])
    with pytest.raises(ValueError) as op_err:
        contract.check_arguments(lp, lp, torch.tensor([1.0]), torch.tensor([0, 2]), None, padded=False, delta=-1.0,
                                 negative_token_fraction=1.0, entropies=None, failures=None, reward_baseline=None,
                                 num_trajectories=None, loss_agg="token-mean", loss_scale_factor=None,
                                 num_policy_tokens=None, no_is=False)
    with pytest.raises(ValueError) as options_err:
        objective.LossOptions(delta=-1.0)
    assert str(op_err.value) == str(options_err.value)
    with pytest.raises(ConfigError, match=r"^actor\.flash_gate_delta must be a non-negative number"):
        parse_train_args(["--preset", "toy", "--output", "x", "--actor.flash_gate_delta", "-1"], PRESETS)


def test_a_flag_keeps_its_published_spelling_and_its_field_says_what_it_is():
    from flashreinforce.config.schema import FLAG_SPELLINGS

    cfg = parse_train_args(["--preset", "toy", "--output", "x", "--rollout.batch_size", "8",
                            "--train.micro_batch_size", "2", "--rollout.vllm_generate_batch_size", "4",
                            "--fsdp.packing_samples", "false"], PRESETS)
    assert (cfg.rollout.batch_size, cfg.train.micro_batch_trajectories, cfg.rollout.episodes_per_call,
            cfg.fsdp.packed_forward) == (8, 2, 4, False)
    assert cfg["train.micro_batch_size"] == 2 and cfg.flags["fsdp.packing_samples"] is False
    assert cfg.to_file()["train"]["micro_batch_size"] == 2 and "micro_batch_trajectories" not in cfg.to_file()["train"]
    for flag, field in FLAG_SPELLINGS.items():
        assert FLAGS_BY_NAME[flag].attribute == field and field not in FLAGS_BY_NAME
    # the published spelling set as a Python field would be ignored: refused, naming the field
    cfg.train.micro_batch_size = 4
    with pytest.raises(ConfigError, match=r"config\.train\.micro_batch_size is not a field: the flag "
                                          r"--train\.micro_batch_size is config\.train\.micro_batch_trajectories"):
        validate(cfg)


def test_train_batch_size_is_derived_from_the_rollout_batch_unless_given():
    """``--rollout.batch_size`` alone sets the batch; ``train.batch_size`` (trajectories per update) is
    derived from it, recorded as the run uses it; one given unequal to the product is refused naming
    both flags."""
    cfg = parse_train_args(["--preset", "toy", "--output", "x", "--rollout.batch_size", "8"], PRESETS)
    assert cfg.train.batch_size is None and cfg.value("train.batch_size") == 8
    assert cfg.to_json()["flags"]["train.batch_size"] == 8 and cfg.to_file()["train"]["batch_size"] is None
    grouped = parse_train_args(["--preset", "toy", "--output", "x", "--actor.loss_mode", "ppo",
                                "--algo.advantage.estimator", "grpo", "--rollout.batch_size", "4",
                                "--rollout.n_samples_per_prompt", "3"], PRESETS)
    assert grouped.value("train.batch_size") == 12
    given = parse_train_args(["--preset", "toy", "--output", "x", "--rollout.batch_size", "8", "--train.batch_size",
                              "8"], PRESETS)  # a published launcher's form: accepted when it agrees
    assert given.train.batch_size == 8 and given.value("train.batch_size") == 8
    with pytest.raises(ConfigError, match=r"train\.batch_size \(16\) must equal rollout\.batch_size \(8\) \* "
                                          r"rollout\.n_samples_per_prompt \(1\): leave --train\.batch_size out"):
        parse_train_args(["--preset", "toy", "--output", "x", "--rollout.batch_size", "8", "--train.batch_size", "16"],
                         PRESETS)
    # from Python: changing the rollout batch of a validated configuration carries the derived value along
    copy = cfg.copy()
    copy.rollout.batch_size = 4
    validate(copy)
    assert copy.value("train.batch_size") == 4


def test_each_loss_option_has_one_default_from_the_flag_to_the_kernel():
    """The trust threshold (and every other loss option) defaults alike on the command line, in the
    Python loss functions and in the C++ core's options struct."""
    import re

    from flashreinforce import objective
    from flashreinforce.ops import contract

    cfg = TrainerConfig()
    defaults = objective.LossOptions()
    for option, flag in objective.OPTION_FLAGS.items():
        expected = getattr(defaults, option)
        if option == "whiten":  # the flag is its negation, algo.advantage.no_whiten
            expected = not expected
        assert cfg[flag] == expected, flag
    for name in contract.KEYWORDS:
        if hasattr(defaults, name):
            assert getattr(contract.DEFAULTS, name) == getattr(defaults, name), name
    core = (ROOT / "csrc" / "flashreinforce" / "core.h").read_text()
    for name in ("delta", "negative_token_fraction"):
        found = re.search(rf"^\s*double {name} = ([0-9.eE+-]+);", core, re.M)
        assert found is not None and float(found.group(1)) == getattr(defaults, name), name
    assert defaults.is_truncation == math.inf and re.search(r"^\s*double is_truncation = kNoTruncation;", core, re.M)
    assert re.search(r"kNoTruncation = std::numeric_limits<double>::infinity\(\);", core)
    assert defaults.gate_metric == "binary_kl" == objective.GATE_METRICS[0]
    assert re.search(r"^\s*GateMetric gate_metric = GateMetric::kBinaryKl;", core, re.M)
    names = re.findall(r"case GateMetric::k\w+: return \"(\w+)\";", (ROOT / "csrc" / "core_common.cpp").read_text())
    assert tuple(names) == objective.GATE_METRICS  # the binding reads the names the options carry
    assert defaults.delta == 3e-3


def test_loss_mode_names_are_asked_of_the_registry():
    from flashreinforce import objective
    from flashreinforce.ops.loss_modes import LOSS_MODES, FlashReinforceLoss, register_loss_mode

    flag = next(f for f in FLAGS if f.name == "actor.loss_mode")
    assert flag.allowed() == objective.loss_mode_names() == ("flash_reinforce", "ppo", *flag.allowed()[2:])

    @register_loss_mode
    class ConfigTestMode(FlashReinforceLoss):
        name = "config_test_mode"

    try:
        assert "config_test_mode" in flag.allowed()
        cfg = parse_train_args(["--preset", "toy", "--output", "x", "--actor.loss_mode", "config_test_mode"], PRESETS)
        assert cfg.actor.loss_mode == "config_test_mode"
        # a subclass of the FlashREINFORCE mode owns its flags and rules: the same estimator, its options checked
        config = objective.LOSS_MODE_REGISTRY["config_test_mode"]
        assert type(LOSS_MODES["config_test_mode"]) is ConfigTestMode and config.flags == objective.LOSS_MODE_REGISTRY[
            "flash_reinforce"].flags
        assert "actor.flash_gate_delta" not in cfg.inactive and "actor.eps_clip_low_high" in cfg.inactive
        with pytest.raises(ConfigError, match="actor.loss_mode config_test_mode needs algo.advantage.estimator"):
            parse_train_args(["--preset", "toy", "--output", "x", "--actor.loss_mode", "config_test_mode",
                              "--algo.advantage.estimator", "grpo"], PRESETS)
    finally:
        del objective.LOSS_MODE_REGISTRY["config_test_mode"]
        del LOSS_MODES["config_test_mode"]


def test_a_mistyped_flag_is_one_line_with_the_closest_names():
    proc = _cli("train", "--preset", "toy", "--output", "x", "--train.max_stepz", "5")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "unknown flag --train.max_stepz; did you mean --train.max_steps" in lines[0]


def test_help_names_the_presets_and_groups_the_flags_without_effect():
    out = _cli("train", "--help").stdout
    preset_help = out[out.index("  --preset PRESET"):out.index("  --env ENV")]
    assert all(name in " ".join(preset_help.split()) for name in PRESETS)
    no_effect = out[out.index("accepted for Molt compatibility, no effect here"):]
    assert "--train.force_on_policy" in no_effect and "--ref.num_nodes" in no_effect


def test_eval_help_lists_the_evaluation_flags_and_accepts_the_training_ones():
    out = _cli("eval", "--help").stdout
    assert "--eval.num_prompts" in out and "--model" in out and "--rollout.max_new_tokens" in out
    assert "--actor.adam.lr" not in out and "--train.async_queue_size" not in out and "--resume" not in out
    from flashreinforce.cli.eval import _parser

    args = vars(_parser().parse_args(["--preset", "toy", "--actor.adam.lr", "0.5", "--no_sampled"]))
    assert args["actor.adam.lr"] == 0.5 and args["no_sampled"] is True


def test_an_environment_module_in_the_current_folder_is_found(tmp_path):
    (tmp_path / "my_env_module.py").write_text(
        "from flashreinforce.envs import Environment, StepResult\n"
        "class SayA(Environment):\n"
        "    def reset(self, *, seed):\n        return 'say a:'\n"
        "    def step(self, action):\n        return StepResult(reward=float(action[:1] == 'a'), done=True)\n")
    proc = _cli("train", "--preset", "toy", "--env", "my_env_module:SayA", "--train.max_steps", "1",
                "--rollout.batch_size", "8", "--train.batch_size", "8", "--eval.eval_at_start", "false",
                "--output", str(tmp_path / "run"), "--no_progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
