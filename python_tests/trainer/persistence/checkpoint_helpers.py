"""Small real checkpoints for the checkpoint tests: a one-layer model, a learner state made by real
optimizer steps (so its step counts agree with the policy version), and a save with the buffer and
trainer state the training loop writes."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from flashreinforce.trainer.persistence.checkpoints import save_checkpoint
from python_tests.builders import tiny_causal_lm

VOCAB = 40

_LEARNER_STATES: dict[tuple[int, int], dict] = {}


def tiny_model(seed: int = 0, vocab: int = VOCAB) -> torch.nn.Module:
    return tiny_causal_lm(vocab, seed=seed, layers=1)


def learner_state(version: int, vocab: int = VOCAB) -> dict:
    """The AdamW and LambdaLR states after ``version`` real updates of a model like :func:`tiny_model`
    (built once per version; a deep copy is returned, so a test may edit it)."""
    key = (version, vocab)
    if key not in _LEARNER_STATES:
        model = tiny_model(11, vocab)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        for _ in range(version):
            opt.zero_grad(set_to_none=True)
            model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
            opt.step()
            sched.step()
        _LEARNER_STATES[key] = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}
    return {**copy.deepcopy(_LEARNER_STATES[key]), "version": version}


def run_state(step: int, skipped: int = 0) -> dict:
    """``state.json``'s fields besides step and version, as the loop writes them after ``step`` updates."""
    return {"buffer": {"updates_done": step + skipped, "counters": {"taken_groups": 4 * step},
                       "prompts": {"next_id": 4 * step + 2, "requeued": [[4 * step, 7]]}, "prompt_attempts": {}},
            "trainer": {"skipped_updates": skipped, "wall_time_s": 1.5}, "max_steps": 10}


def save(ckpt_dir: Path, step: int, model: torch.nn.Module, **kw) -> Path:
    vocab = model.config.vocab_size
    return save_checkpoint(ckpt_dir, step, model=model, learner_state=learner_state(step, vocab),
                           state=run_state(step), **kw)


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)
