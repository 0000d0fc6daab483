#!/usr/bin/env python
"""Where an update's time goes with a real model on the CPU, and what the engine/learner options save.

    python benchmarks/bench_real_model_cpu.py                       # SmolLM2-135M-Instruct, arith prompts
    python benchmarks/bench_real_model_cpu.py --batch 16 --repeats 3

One update of the ``arith`` preset is: sampling ``--batch`` episodes (prefill of the chat-template
prompts, then up to ``max_new_tokens`` decode steps) and one learner step on them. This times,
interleaved round by round so machine load hits every entry alike:

* generation with the shared-prefix prefill (the engine's default) and without it
  (``min_shared_prefix=0``);
* the learner step (log-probabilities, fused loss, backward, AdamW) in float32 and with bfloat16
  autocast (``--fsdp.param_dtype bf16``; float32 master weights).

It prints a table of medians and the CPU, its bf16 support and the load average; the machine
is shared, so compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

from flashreinforce.cli import set_openmp_spin_default

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def main() -> int:
    set_openmp_spin_default()  # as the flashreinforce console script does
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.7)
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    import arith_curve

    from flashreinforce.config.presets import PRESETS
    from flashreinforce.engines import GenerationRequest, HFEngine, SamplingParams
    from flashreinforce.envs.arith import ArithEnv
    from flashreinforce.models.loading import build_model
    from flashreinforce.models.tokenizers import HFTokenizer, load_tokenizer
    from flashreinforce.objective import LossOptions
    from flashreinforce.trainer.learning.learner import Learner, LearnerSettings
    from flashreinforce.trainer.rollout.trajectory import Trajectory

    preset = PRESETS["arith"]
    flags_note = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    bf16 = "avx512_bf16" in flags_note or "amx_bf16" in flags_note
    print(f"CPU {arith_curve.cpu_name()} ({os.cpu_count()} CPUs, AVX512-BF16: {bf16}), torch threads "
          f"{args.threads}, load average {arith_curve.load_average()}", flush=True)
    model, tok_spec = build_model(args.model, device=torch.device("cpu"))
    tok = HFTokenizer(load_tokenizer(tok_spec).tok, chat_prompt=True)
    env = ArithEnv(**preset["env.kwargs"])
    max_new = preset["rollout.max_new_tokens"]
    prompts = [tok.encode_prompt(env.reset(seed=i)) for i in range(args.batch)]
    reqs = [GenerationRequest(ids, max_new, i) for i, ids in enumerate(prompts)]
    params = SamplingParams(args.temperature, stop_token_ids=tok.eos_token_ids)
    engines = {"generation, shared-prefix prefill": HFEngine(copy.deepcopy(model), pad_token_id=tok.pad_token_id),
               "generation, plain left padding": HFEngine(copy.deepcopy(model), pad_token_id=tok.pad_token_id,
                                                          min_shared_prefix=0)}
    shared = engines["generation, shared-prefix prefill"]._shared_prefix(prompts)
    gens = engines["generation, shared-prefix prefill"].generate(reqs, params)
    trajs = []
    for i, (ids, g) in enumerate(zip(prompts, gens)):
        env.reset(seed=i)
        reward = env.step(tok.decode(g.token_ids)).reward
        trajs.append(Trajectory(token_ids=ids + g.token_ids, action_mask=[False] * len(ids) + [True] * len(g.token_ids),
                                behavior_log_probs=[0.0] * len(ids) + g.log_probs, reward=reward, failed=reward <= 0,
                                policy_version_min=0, policy_version_max=0, prompt_id=i, seed=i))
    tokens = sum(len(t.token_ids) for t in trajs)

    def learner(dtype: str) -> Learner:
        settings = LearnerSettings(loss=LossOptions(delta=float("inf")), lr=1e-7, weight_decay=0.0, scheduler="constant",
                                   warmup_ratio=0.0, total_steps=10**6, temperature=args.temperature,
                                   micro_batch_trajectories=0, param_dtype=dtype)
        return Learner(copy.deepcopy(model), settings, pad_token_id=tok.pad_token_id)

    learners = {"learner step, float32": learner("fp32"), "learner step, bf16 autocast": learner("bf16")}
    times: dict[str, list[float]] = {k: [] for k in (*engines, *learners)}
    for r in range(args.repeats):
        for name, engine in engines.items():
            t0 = time.perf_counter()
            engine.generate(reqs, params)
            times[name].append(time.perf_counter() - t0)
        for name, lrn in learners.items():
            t0 = time.perf_counter()
            lrn.step(trajs, None)
            times[name].append(time.perf_counter() - t0)
        print(f"round {r + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in times.items()), flush=True)
    prompt_tokens = sum(len(x) for x in prompts)
    new_tokens = sum(len(g.token_ids) for g in gens)
    print(f"\n{args.batch} episodes: {prompt_tokens} prompt tokens ({shared} shared by all), {new_tokens} sampled "
          f"tokens, {tokens} learner tokens; load average at the end {arith_curve.load_average()}")
    print("| what | median s | per token |\n| --- | --- | --- |")
    for name, v in times.items():
        n = new_tokens if name.startswith("generation") else tokens
        print(f"| {name} | {statistics.median(v):.2f} | {1000 * statistics.median(v) / n:.1f} ms |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
