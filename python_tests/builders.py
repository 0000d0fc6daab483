"""Builders shared by the tests: tiny causal LMs and random trajectories (no download, CPU).

Tests that need a model build one here instead of repeating a ``Qwen2Config``; the kernel tests'
packed-batch builder lives next to them (``python_tests/ops/fused_cases.py``).
"""

from __future__ import annotations

import random

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from flashreinforce.trainer.rollout.trajectory import Trajectory

__all__ = ["random_trajectory", "tiny_causal_lm"]


def tiny_causal_lm(vocab_size: int, *, seed: int = 0, layers: int = 2, tied: bool = True,
                   max_positions: int = 128) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2-architecture causal LM (hidden 32, 4 heads, 2 KV heads),
    float32 on the CPU; the same ``seed`` gives the same weights."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      tie_word_embeddings=tied)
    return Qwen2ForCausalLM(cfg)


def random_trajectory(rng: random.Random, vocab_size: int, *, min_len: int = 4, max_len: int = 14,
                      action_fraction: float = 0.7, reward: float | None = None) -> Trajectory:
    """A trajectory of random tokens ``[3, vocab_size)`` whose first token is a prompt token, with at
    least one action token, random behavior log-probs in (-5, 0] on action tokens, and a reward in
    [0, 1) (``failed`` when below 0.5) unless ``reward`` is given."""
    length = rng.randint(min_len, max_len)
    tokens = [rng.randrange(3, vocab_size) for _ in range(length)]
    mask = [False] + [rng.random() < action_fraction for _ in range(length - 1)]
    mask[rng.randrange(1, length)] = True
    logp = [-rng.random() * 5 if m else 0.0 for m in mask]
    r = rng.random() if reward is None else float(reward)
    return Trajectory(tokens, mask, logp, reward=r, failed=r < 0.5)
