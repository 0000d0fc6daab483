"""The configuration a run uses is frozen once checked: nothing changes a setting after validation."""

from __future__ import annotations

import pickle

import pytest
import yaml

from flashreinforce.config import TrainerConfig
from flashreinforce.config.schema import FrozenConfigError, FrozenDict, FrozenList


def _frozen() -> TrainerConfig:
    cfg = TrainerConfig.from_preset("toy", output="out", env_kwargs={"turns": 2, "nested": {"xs": [1, 2]}})
    cfg.warnings.append("a warning")
    return cfg.freeze()


def test_a_frozen_configuration_refuses_every_change_and_names_the_field():
    cfg = _frozen()
    assert cfg.frozen and cfg.train.frozen and cfg.actor.adam.frozen
    with pytest.raises(FrozenConfigError, match=r"TrainConfig\.max_steps.*cfg\.copy\(\)"):
        cfg.train.max_steps = 3
    with pytest.raises(FrozenConfigError, match=r"AdamConfig\.lr"):
        cfg.actor.adam.lr = 1.0
    with pytest.raises(FrozenConfigError, match=r"TrainerConfig\.seed"):
        cfg.seed = 4
    with pytest.raises(FrozenConfigError):
        cfg.set("train.max_steps", 3)
    with pytest.raises(FrozenConfigError):
        del cfg.train.max_steps
    for change in (lambda: cfg.warnings.append("x"), lambda: cfg.warnings.remove("a warning"),
                   lambda: cfg.env_kwargs.update(turns=3), lambda: cfg.env_kwargs.__setitem__("turns", 3),
                   lambda: cfg.env_kwargs["nested"]["xs"].append(3), lambda: cfg.inactive.pop("x", None),
                   lambda: cfg.explicit.extend(["y"])):
        with pytest.raises(FrozenConfigError):
            change()
    assert cfg.env_kwargs == {"turns": 2, "nested": {"xs": [1, 2]}} and cfg.warnings == ["a warning"]
    assert isinstance(cfg.env_kwargs, dict) and isinstance(cfg.warnings, list)  # still read as dict and list


def test_a_copy_is_unfrozen_with_plain_containers_and_the_original_stays_frozen():
    cfg = _frozen()
    new = cfg.copy()
    assert not new.frozen and not new.train.frozen
    assert type(new.env_kwargs) is dict and type(new.env_kwargs["nested"]["xs"]) is list and type(new.warnings) is list
    new.train.max_steps = 3
    new.warnings.append("another")
    new.env_kwargs["nested"]["xs"].append(3)
    assert cfg.train.max_steps != 3 and cfg.warnings == ["a warning"] and cfg.env_kwargs["nested"]["xs"] == [1, 2]
    assert new.to_file()["env.kwargs"] == {"turns": 2, "nested": {"xs": [1, 2, 3]}}


def test_frozen_survives_pickling_and_records_are_plain():
    cfg = _frozen()
    back = pickle.loads(pickle.dumps(cfg))  # a Ray worker gets the configuration this way
    assert back.frozen and back.to_json() == cfg.to_json()
    assert type(back.env_kwargs) is FrozenDict and type(back.warnings) is FrozenList
    with pytest.raises(FrozenConfigError):
        back.rollout.temperature = 0.5
    written = yaml.safe_dump(cfg.to_file())  # the safe dumper takes plain dicts and lists only
    assert "nested" in written and "FrozenDict" not in written


def test_the_trainer_freezes_its_own_copy_and_leaves_the_callers_alone(tmp_path, monkeypatch):
    from flashreinforce.trainer import Trainer

    monkeypatch.chdir(tmp_path)
    cfg = TrainerConfig.from_preset("toy", output="run")
    cfg.ckpt.path = "ckpts"
    trainer = Trainer(cfg)
    assert cfg.ckpt.path == "ckpts" and not cfg.frozen  # the caller's object: as given
    assert trainer.cfg is not cfg and trainer.cfg.frozen and trainer.cfg.ckpt.path == str(tmp_path / "ckpts")
    with pytest.raises(FrozenConfigError):
        trainer.cfg.rollout.max_turns = 9
