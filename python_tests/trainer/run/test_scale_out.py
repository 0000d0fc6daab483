"""The trainer gets Ray rollout workers and the torchrun learner from its caller (a ``ScaleOut``):
without one it refuses, as a configuration error, the settings that need them; the entry points
(``flashreinforce train``, ``flashreinforce.train``) pass the distributed layer's."""

import pytest

from flashreinforce.config import ConfigError, parse_train_args
from flashreinforce.config.presets import PRESETS
from flashreinforce.distributed.scale_out import DistributedScaleOut
from flashreinforce.trainer import Trainer
from flashreinforce.trainer.run.scale_out import ScaleOut


def _cfg(tmp_path, *flags):
    return parse_train_args(["--preset", "toy", "--output", str(tmp_path / "run"), *flags], PRESETS)


def test_the_ray_backend_without_a_scale_out_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"--rollout.backend ray needs the scale-out layer.*DistributedScaleOut"):
        Trainer(_cfg(tmp_path, "--rollout.backend", "ray"))
    assert not (tmp_path / "run").exists()


def test_torchrun_without_a_scale_out_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"torchrun \(WORLD_SIZE > 1\) needs the scale-out layer"):
        Trainer(_cfg(tmp_path)).run()


def test_the_distributed_layer_is_a_scale_out_and_kept_by_the_trainer(tmp_path):
    scale_out = DistributedScaleOut()
    assert isinstance(scale_out, ScaleOut)
    assert Trainer(_cfg(tmp_path, "--rollout.backend", "ray"), scale_out=scale_out).scale_out is scale_out


def test_the_entry_points_pass_the_distributed_scale_out(tmp_path, monkeypatch):
    """``flashreinforce train`` and ``flashreinforce.train`` each build their trainer with a
    DistributedScaleOut (a short real run; the trainers they build are recorded)."""
    import flashreinforce
    import flashreinforce.trainer
    from flashreinforce.cli.train import train as cli_train

    built = []

    class RecordedTrainer(Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(flashreinforce.trainer, "Trainer", RecordedTrainer)
    quick = ["--rollout.batch_size", "8", "--train.batch_size", "8", "--train.max_steps", "1",
             "--rollout.num_workers", "1", "--eval.eval_at_start", "false", "--no_progress"]
    assert cli_train(["--preset", "toy", "--output", str(tmp_path / "cli"), *quick]) == 0
    config = _cfg(tmp_path, *quick)
    config.output = str(tmp_path / "api")
    assert flashreinforce.train(config)["status"] == "completed"
    assert [type(t.scale_out) for t in built] == [DistributedScaleOut, DistributedScaleOut]
