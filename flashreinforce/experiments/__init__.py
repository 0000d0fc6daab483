"""The published FlashREINFORCE experiments: settings as data, resolution rules and launching.

``load_setting("r1", ["no_trust"])`` gives the resolved Molt flags of a setting with its variants;
``examples/run_experiment.py`` and ``scripts/train_molt.py`` are the command-line front ends.
"""

from flashreinforce.experiments.resolve import (
    ResolvedSetting,
    SettingError,
    check_rules,
    load_setting,
    setting_names,
    variant_names,
)

__all__ = ["ResolvedSetting", "SettingError", "check_rules", "load_setting", "setting_names", "variant_names"]
