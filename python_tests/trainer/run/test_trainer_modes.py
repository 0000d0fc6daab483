"""Every loss mode and learner option runs through the whole trainer (in-process, a few updates)."""

import json

import pytest

from flashreinforce.config import parse_train_args
from flashreinforce.config.presets import PRESETS
from flashreinforce.trainer import Trainer

BASE = ["--preset", "toy", "--rollout.batch_size", "8", "--train.max_steps", "3",
        "--rollout.num_workers", "1", "--no_progress", "--eval.steps", "0", "--eval.eval_at_start", "false",
        "--ckpt.save_steps", "0"]

MODES = {
    "grpo": ["--actor.loss_mode", "ppo", "--algo.advantage.estimator", "grpo", "--algo.advantage.no_whiten",
             "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "4", "--actor.eps_clip_low_high", "0.2", "0.2"],
    "grpo_whiten": ["--actor.loss_mode", "ppo", "--algo.advantage.estimator", "grpo",
                    "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "4"],
    # four-token answers: a failed one keeps ceil(0.5 T) < T of its tokens (one token would keep it all)
    "neg_topq": ["--actor.flash_neg_topq", "0.5", "--rollout.max_new_tokens", "4"],
    "token_mean": ["--actor.flash_loss_agg", "token-mean", "--train.micro_batch_size", "3"],
    "sum_norm": ["--actor.flash_loss_agg", "seq-mean-token-sum-norm", "--actor.loss_scale_factor", "4"],
    "no_is": ["--actor.flash_no_is", "--actor.flash_gate_delta", "0.001"],
    "entropy_bonus": ["--actor.entropy_coef", "0.01"],
    "packed_bf16_ckpt": ["--fsdp.packing_samples", "--fsdp.param_dtype", "bf16", "--actor.gradient_checkpoint", "full",
                         "--actor.lr_scheduler", "cosine_with_min_lr"],
    "multiturn_topp": ["--preset", "toy_multiturn", "--rollout.top_p", "0.9", "--rollout.temperature", "0.8",
                       "--train.micro_batch_tokens", "64"],
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_mode_runs_end_to_end(mode, tmp_path):
    cfg = parse_train_args(BASE + MODES[mode] + ["--output", str(tmp_path)], PRESETS)
    if mode.startswith("grpo"):
        assert cfg.value("train.batch_size") == 8  # derived: 2 prompts * 4 samples
    summary = Trainer(cfg).run()
    assert summary["status"] == "completed" and summary["step"] == 3
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["trajectories"] == 8 and r["grad_norm"] == r["grad_norm"]  # not NaN
    if mode == "neg_topq":
        # Failed trajectories keep ceil(q T) >= q T of their T tokens, the others all of theirs: the
        # fraction lies in [q, 1), below 1 whenever a failed answer has more than one token.
        assert any(r["success_rate"] < 1.0 for r in rows) and "entropy_mean" in rows[0]
        for r in rows:
            assert 0.5 <= r["retained_token_fraction"] < 1.0, r
    if mode.startswith("grpo"):
        assert "clip_fraction" in rows[0]
