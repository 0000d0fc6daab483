"""One rule set for the trainer's flags and the published settings: both report the same message."""

import math

import pytest

from flashreinforce.config import ConfigError, resolve
from flashreinforce.experiments import SettingError, check_rules, load_setting
from flashreinforce.experiments.resolve import rule_violations


@pytest.mark.parametrize("change", [
    {"train.batch_size": 64},
    {"train.max_epochs": 2},
    {"algo.kl.init_coef": 0.01},
    {"data.max_len": 100, "rollout.max_new_tokens": 100},
    {"algo.advantage.is_correction_level": "seq"},
    {"rollout.n_samples_per_prompt": 2, "rollout.batch_size": 64},
    {"actor.flash_neg_topq": 1.5},
    {"actor.flash_gate_delta": math.nan},
    {"actor.flash_loss_agg": "seq-mean-token-sum-norm", "actor.loss_scale_factor": None},
])
def test_trainer_and_published_settings_report_the_same_broken_rule(change):
    published = {**load_setting("qwen_math").flags, **change}
    expected = rule_violations(published)
    assert len(expected) == 1, expected
    with pytest.raises(SettingError) as setting_err:
        check_rules(published)
    assert expected[0] in str(setting_err.value)
    native = {k: v for k, v in published.items() if k != "train.force_on_policy" and k != "data.apply_chat_template"}
    with pytest.raises(ConfigError) as config_err:
        resolve({"model": "tiny-qwen2", "env": "math", **{k: v for k, v in native.items() if not k.startswith("eval.")
                                                        and k.split(".")[0] not in ("vllm", "ckpt", "logger")}})
    assert expected[0] in str(config_err.value)


def test_the_published_settings_pass_the_trainer_rules():
    from flashreinforce.experiments import setting_names, variant_names

    for name in setting_names():
        for variants in [[]] + [[v] for v in variant_names(name)]:
            flags = load_setting(name, variants).flags
            assert rule_violations(flags) == [], (name, variants)
