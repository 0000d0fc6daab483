#!/usr/bin/env python
r"""TRL's side of the ``arith_tool`` race: GRPOTrainer on the multi-turn Python-tool task, on a CPU.

    python benchmarks/trl_tool_side.py --output runs/trl_tool --budget-min 30
    python benchmarks/trl_tool_side.py --output runs/trl_tool_check --budget-min 1 --eval-prompts 16   # a check

The episodes are :class:`flashreinforce.envs.arith_python_tool.ArithToolEnv`'s: the system prompt, the worked
demonstration and the problem in the model's chat template; the policy may write one ```` ```python ````
block (the turn ends at its closing fence), the sandbox's output comes back as the next user turn, and a
``\boxed{}`` answer ends the episode, graded with math-verify; at most 3 policy turns.

Why ``rollout_func`` and not TRL's own tool loop (``tools=`` / ``environment_factory=``): that loop
parses each completion with the tokenizer's ``parse_response`` into JSON function calls
(``{"name": ..., "arguments": {...}}``), answers them as ``role: "tool"`` messages, and at construction
requires a chat template that renders ``tool_calls`` and tool messages (``supports_tool_calling``) and a
response template TRL knows for that template (``add_response_schema``: Qwen, Llama 3.1/3.2, GLM, GPT-OSS,
...). SmolLM2-135M-Instruct's template renders only ``role`` and ``content``, so TRL refuses it ("The
provided chat template does not support tool calling"), and the task's tool is a ```` ```python ```` block
in plain text anyway, with its output as a user turn. TRL's loop also bounds the whole multi-turn
completion by ``max_completion_length``, not each turn. GRPOTrainer's ``rollout_func`` is the documented
way to play such an environment: it returns each trajectory's prompt ids, completion ids and an
``env_mask`` (1 for sampled tokens, 0 for the tool's), and TRL does the rest (group-normalized advantages,
its loss on the masked tokens, the optimizer step).

What the rollout does, the same as ``flashreinforce train --preset arith_tool``: the same train prompts
(the environment's train seeds 0, 1, 2, ..., in that order: ``shuffle_dataset=False``), the same token
layout (the prompt as our trainer encodes it, each turn cut where the environment ends it and closed
with the end-of-turn token, the observation in the chat template's next user turn), 48 new tokens per
turn at most, 512 tokens per trajectory, the same sandbox and grading (the environment's reward). Each
turn of all live episodes is one ``generate`` call on TRL's model, set up as TRL's own generation path
without vLLM (left-padded batch, ``unwrap_model_for_generation``, TRL's ``GenerationConfig``: the
preset's temperature and top-p), with one addition: a stopping criterion that ends a row where the
environment ends its turn (what our engine does), so a batch does not sample on past every row's code.
The tool calls run one after the other, as in our rollout worker.

TRL is configured as in ``benchmarks/bench_vs_trl.py``: ``use_cpu=True``, ``use_vllm=False``, bf16 autocast
when the preset uses it, ``num_generations`` = ``group_size`` (8), ``per_device_train_batch_size`` =
``trajectories_per_update`` (one generation call and one optimizer step per batch), ``num_iterations=1``,
``beta=0``, the preset's learning rate, Adam betas, weight decay and ``max_norm``, a constant schedule.
The held-out evaluation is our :class:`~flashreinforce.trainer.reporting.evaluation.Evaluator` over ArithToolEnv
(greedy, 3 turns, the same prompts as our side), run every ``eval_every_min`` training minutes and at the
end; its time is excluded from the budget. Results: ``OUTPUT/trl_tool.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import heldout_evaluator, preset_flags, train_trl_on_budget  # noqa: E402  (shared with the arith race)
from flashreinforce.cli import set_openmp_spin_default  # noqa: E402

PRESET = "arith_tool"
RESULT_FILE = "trl_tool.json"


def env_kwargs(flags: dict) -> dict:
    """The preset's environment arguments with its turn limit (what our trainer hands the environment)."""
    return {**flags["env.kwargs"], "max_turns": flags["rollout.max_turns"]}


def tool_tokenizer(hf_tok):
    """Our trainer's tokenizer for this preset: the environment renders the prompt, observations are
    wrapped as the chat template's next user turn."""
    from flashreinforce.models.tokenizers import HFTokenizer

    return HFTokenizer(hf_tok, chat_prompt=False, chat_observations=True)


def heldout_tool_evaluator(model, tokenizer, flags: dict, num_prompts: int, seed: int):
    """An Evaluator over ArithToolEnv's held-out problems with its own copy of ``model`` (greedy, 3 turns)."""
    # the environment renders the chat template
    return heldout_evaluator(model, tokenizer, flags, num_prompts, seed, env_kwargs=env_kwargs(flags),
                             chat_template=True, max_turns=flags["rollout.max_turns"],
                             env_timeout_s=flags["rollout.env_timeout_s"])


# ---------------------------------------------------------------------------- the rollout TRL calls
@dataclass
class _Episode:
    env: Any
    prompt: list[int]
    tokens: list[int]
    mask: list[int] = field(default_factory=list)  # over tokens after the prompt: 1 sampled, 0 tool/template
    turns: int = 0
    turn_ended: bool = False  # the last turn was cut where the environment ends it (no end-of-turn token)
    reward: float = 0.0
    info: dict = field(default_factory=dict)
    done: bool = False


def turn_end_criteria(start: int, decode, turn_ends: list):
    """A ``transformers`` stopping criterion: row ``i`` stops once ``turn_ends[i]`` finds the end of
    its turn in the text sampled after column ``start``."""
    import torch
    from transformers import StoppingCriteria

    class TurnEnd(StoppingCriteria):
        def __init__(self) -> None:
            self.done = [False] * len(turn_ends)

        def __call__(self, input_ids, scores, **kwargs):
            for i, turn_end in enumerate(turn_ends):
                if not self.done[i] and turn_end(decode(input_ids[i, start:].tolist())) is not None:
                    self.done[i] = True
            return torch.tensor(self.done, dtype=torch.bool, device=input_ids.device)

    return TurnEnd()


class ArithToolRollout:
    """GRPOTrainer's ``rollout_func``: plays one ArithToolEnv episode per prompt TRL hands it.

    ``prompts`` are the dataset's ``prompt`` column (the rendered conversation of a train seed), each
    repeated ``num_generations`` times by TRL's sampler; ``seed_of_prompt`` maps them back to seeds.
    """

    def __init__(self, env_factory, tokenizer, seed_of_prompt: dict[str, int], *, max_new_tokens: int,
                 max_len: int, max_turns: int) -> None:
        self.env_factory = env_factory
        self.tokenizer = tokenizer
        self.seed_of_prompt = seed_of_prompt
        self.max_new_tokens, self.max_len, self.max_turns = max_new_tokens, max_len, max_turns
        self.eos = set(tokenizer.eos_token_ids)
        self._envs: list = []
        self.stats = {"calls": 0, "trajectories": 0, "generate_s": 0.0, "tool_s": 0.0, "reward": 0.0,
                      "tool_calls": 0.0, "answer_from_tool": 0.0, "turns": 0.0, "sampled_tokens": 0}

    def _env(self, k: int):
        while len(self._envs) <= k:
            self._envs.append(self.env_factory())
        return self._envs[k]

    def close(self) -> None:
        for env in self._envs:
            env.close()
        self._envs = []

    def _generate(self, trainer, live: list[_Episode]) -> list[list[int]]:
        """One turn of each live episode: one left-padded ``generate`` call, TRL's generation set-up."""
        import torch
        from transformers import StoppingCriteriaList
        from trl.models.utils import unwrap_model_for_generation

        limits = [min(self.max_new_tokens, self.max_len - len(e.tokens)) for e in live]
        width = max(len(e.tokens) for e in live)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((len(live), width), pad, dtype=torch.long)
        attention = torch.zeros((len(live), width), dtype=torch.long)
        for i, e in enumerate(live):
            input_ids[i, width - len(e.tokens):] = torch.tensor(e.tokens)
            attention[i, width - len(e.tokens):] = 1
        device = trainer.accelerator.device
        stop = turn_end_criteria(width, self.tokenizer.decode, [e.env.turn_end for e in live])
        generation_config = copy.deepcopy(trainer.generation_config)  # TRL's, with this turn's token limit
        generation_config.max_new_tokens = max(limits)
        with (unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator,
                                          gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
                                          generation_kwargs=trainer.generation_kwargs,
                                          gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs)
              as model, torch.no_grad()):
            out = model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                                 generation_config=generation_config, stopping_criteria=StoppingCriteriaList([stop]))
        rows = []
        for i, limit in enumerate(limits):
            ids = out[i, width:].tolist()[:limit]
            first_eos = next((j for j, t in enumerate(ids) if t in self.eos), None)
            rows.append(ids if first_eos is None else ids[:first_eos + 1])  # the end-of-turn token is kept
        return rows

    def _record(self, e: _Episode, ids: list[int]) -> str:
        from flashreinforce.trainer.rollout.episode import turn_cut

        cut = turn_cut(e.env, self.tokenizer, ids)
        e.turn_ended = cut is not None and ids[cut - 1] not in self.eos
        if cut is not None:
            ids = ids[:cut]
        e.tokens.extend(ids)
        e.mask.extend([1] * len(ids))
        e.turns += 1
        self.stats["sampled_tokens"] += len(ids)
        return self.tokenizer.decode(ids)

    def _after_step(self, e: _Episode, result) -> None:
        e.reward += float(result.reward)
        e.info.update(result.info or {})
        if result.done or e.turns >= self.max_turns:
            e.done = True
            return
        close = [self.tokenizer.eos_token_ids[0]] if e.turn_ended else []
        obs = close + (self.tokenizer.encode_observation(result.observation) if result.observation else [])
        if len(e.tokens) + len(obs) >= self.max_len:
            e.done = True  # no room for the observation: the episode ends truncated, as in our rollout
            return
        e.tokens.extend(obs)
        e.mask.extend([0] * len(obs))

    def __call__(self, prompts: list, trainer) -> dict[str, Any]:
        episodes = []
        for k, prompt in enumerate(prompts):
            if prompt not in self.seed_of_prompt:
                raise ValueError(f"rollout: prompt {str(prompt)[-80:]!r} is not one of the train prompts")
            env = self._env(k)
            ids = self.tokenizer.encode_prompt(env.reset(seed=self.seed_of_prompt[prompt]))
            episodes.append(_Episode(env, ids, list(ids)))
        while True:
            live = [e for e in episodes if not e.done and len(e.tokens) < self.max_len]
            if not live:
                break
            t0 = time.perf_counter()
            rows = self._generate(trainer, live)
            t1 = time.perf_counter()
            for e, ids in zip(live, rows):
                self._after_step(e, e.env.step(self._record(e, ids)))
            self.stats["generate_s"] += t1 - t0
            self.stats["tool_s"] += time.perf_counter() - t1
        s = self.stats
        s["calls"] += 1
        s["trajectories"] += len(episodes)
        for e in episodes:
            s["reward"] += e.reward
            s["tool_calls"] += float(e.info.get("tool_calls", 0))
            s["answer_from_tool"] += float(bool(e.info.get("answer_from_tool", False)))
            s["turns"] += e.turns
        return {"prompt_ids": [e.prompt for e in episodes],
                "completion_ids": [e.tokens[len(e.prompt):] for e in episodes],
                "logprobs": None,  # TRL uses sampling log-probs only for vLLM's importance-sampling correction
                "env_mask": [e.mask for e in episodes],
                "env_reward": [e.reward for e in episodes]}


def arith_tool_reward(prompts, completions, env_reward, **_):
    """The environment's reward of each trajectory (computed in the rollout, where the episode was played)."""
    return [float(r) for r in env_reward]


# ---------------------------------------------------------------------------- the run
def check_arguments(*, budget_min: float, eval_every_min: float, eval_prompts: int, threads: int, group_size: int,
                    trajectories_per_update: int, train_prompts: int) -> None:
    for name, value in (("budget_min", budget_min), ("eval_every_min", eval_every_min)):
        if not (isinstance(value, (int, float)) and value > 0):
            raise ValueError(f"{name} must be a positive number of minutes, got {value!r}")
    for name, value in (("eval_prompts", eval_prompts), ("threads", threads), ("train_prompts", train_prompts)):
        if not (isinstance(value, int) and value > 0):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not (isinstance(group_size, int) and group_size >= 2):
        raise ValueError(f"group_size must be an integer >= 2 (GRPO normalizes within a group), got {group_size!r}")
    if not (isinstance(trajectories_per_update, int) and trajectories_per_update > 0
            and trajectories_per_update % group_size == 0):
        raise ValueError(f"trajectories_per_update must be a positive multiple of group_size {group_size}, "
                         f"got {trajectories_per_update!r}")
    if trajectories_per_update // group_size > train_prompts:
        raise ValueError(f"train_prompts {train_prompts} is fewer than the prompts of one update "
                         f"({trajectories_per_update // group_size})")


def run_trl_tool(*, model: str, seed: int, budget_min: float, eval_every_min: float, eval_prompts: int, out: Path,
                 threads: int = 2, group_size: int = 8, trajectories_per_update: int = 32, train_prompts: int = 4096,
                 fp32: bool = False) -> dict:
    """Train TRL's GRPOTrainer on arith_tool for ``budget_min`` training minutes (evaluations excluded).

    Evaluates the held-out split greedily before training, every ``eval_every_min`` training minutes
    and at the end. ``fp32``: no bf16 autocast even though the preset uses it. Returns the result
    (see the module docstring; ``curve`` has the evaluations' accuracy and tool statistics).
    """
    check_arguments(budget_min=budget_min, eval_every_min=eval_every_min, eval_prompts=eval_prompts,
                    threads=threads, group_size=group_size, trajectories_per_update=trajectories_per_update,
                    train_prompts=train_prompts)
    import torch

    torch.set_num_threads(threads)
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    from flashreinforce.envs.registry import EnvSpec
    from flashreinforce.models.loading import build_model
    from flashreinforce.models.tokenizers import load_tokenizer

    flags = preset_flags(PRESET, {})
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t_setup = time.perf_counter()
    policy, tok_spec = build_model(model, device=torch.device("cpu"), seed=seed)
    hf_tok = load_tokenizer(tok_spec).tok
    tokenizer = tool_tokenizer(hf_tok)
    env_factory = EnvSpec(flags["env"], {}, env_kwargs(flags), True).factory(tokenizer)
    # The train split in the order our trainer hands it out (seeds 0, 1, 2, ...), rendered by the environment.
    renderer = env_factory()
    rows, seed_of_prompt = [], {}
    for s in range(train_prompts):
        prompt = renderer.reset(seed=s)
        rows.append({"prompt": prompt, "seed": s})
        seed_of_prompt.setdefault(prompt, s)  # the same text is the same problem, graded the same
    renderer.close()
    dataset = datasets.Dataset.from_list(rows)
    rollout = ArithToolRollout(env_factory, tokenizer, seed_of_prompt, max_new_tokens=flags["rollout.max_new_tokens"],
                               max_len=flags["data.max_len"], max_turns=flags["rollout.max_turns"])

    bf16 = flags["fsdp.param_dtype"] in ("bf16", "bfloat16") and not fp32
    config = GRPOConfig(
        output_dir=str(out / "trl_tool_run"), use_cpu=True, bf16=bf16, fp16=False, use_vllm=False,
        num_generations=group_size, per_device_train_batch_size=trajectories_per_update,
        gradient_accumulation_steps=1, num_iterations=1, shuffle_dataset=False,
        max_completion_length=flags["rollout.max_new_tokens"],  # per turn: the rollout's generate calls
        temperature=flags["rollout.temperature"], top_p=flags["rollout.top_p"],
        learning_rate=flags["actor.adam.lr"], weight_decay=flags["actor.adam.weight_decay"],
        adam_beta1=flags["actor.adam.betas"][0], adam_beta2=flags["actor.adam.betas"][1],
        max_grad_norm=flags["actor.max_norm"], lr_scheduler_type="constant", warmup_steps=0,
        max_steps=100_000, logging_steps=1, save_strategy="no", report_to="none", seed=seed,
        dataloader_num_workers=0, disable_dropout=True, beta=0.0)
    trainer = GRPOTrainer(model=policy, reward_funcs=arith_tool_reward, args=config, train_dataset=dataset,
                          processing_class=hf_tok, rollout_func=rollout)

    evaluator, store = heldout_tool_evaluator(policy, tokenizer, flags, eval_prompts, seed)
    curve, last = [], {}

    def evaluate(step: int, train_s: float) -> None:
        store.publish(trainer.model.state_dict(), step + 1)
        result = evaluator.evaluate(step)
        last.clear()
        last.update(result)
        # With the tool statistics (tool_calls, answer_from_tool, turns, ... as in our side's curve): an
        # accuracy reached without the tool shows there.
        curve.append({"step": step, "train_min": train_s / 60, "accuracy": result["eval_success_rate"],
                      **{k[len("eval_env/"):]: v for k, v in result.items() if k.startswith("eval_env/")}})
        print(f"[trl-tool] update {step}: {train_s / 60:.2f} training min, held-out greedy accuracy "
              f"{result['eval_success_rate']:.3f}, tool calls per episode {result.get('eval_env/tool_calls', 0):.2f}",
              flush=True)

    setup_s = time.perf_counter() - t_setup
    try:
        # TRL plays the episodes (sampling and the tool) and scores them in _generate_and_score_completions:
        # that is the generation share; the rest of a step is learning.
        run = train_trl_on_budget(trainer, evaluate, budget_s=budget_min * 60, eval_every_s=eval_every_min * 60)
    finally:
        evaluator.close()
        rollout.close()
    train_s, updates = run["train_s"], run["updates"]
    trajectories = updates * trajectories_per_update
    rs = rollout.stats
    n = max(1, rs["trajectories"])
    return {
        "side": "trl", "task": PRESET, "trl_version": __import__("trl").__version__, "setup_s": setup_s,
        "train_s": train_s, "updates": updates, "trajectories": trajectories,
        "trajectories_per_s": trajectories / train_s, "updates_per_s": updates / train_s,
        "prompts_per_update": trajectories_per_update // group_size,
        "generation_share": run["generation_s"] / train_s,
        "learning_share": max(0.0, 1 - run["generation_s"] / train_s), "idle_share": 0.0,
        # Within the generation share: sampling turns and running the tool (environment steps).
        "sampling_share": rs["generate_s"] / train_s, "tool_share": rs["tool_s"] / train_s,
        "curve": curve, "rewards": run["rewards"],
        "eval_env/tool_calls": last.get("eval_env/tool_calls"),
        "eval_env/answer_from_tool": last.get("eval_env/answer_from_tool"), "final_eval": last,
        "train_episodes": {"trajectories": rs["trajectories"], "reward_mean": rs["reward"] / n,
                           "tool_calls_mean": rs["tool_calls"] / n, "answer_from_tool": rs["answer_from_tool"] / n,
                           "turns_mean": rs["turns"] / n, "sampled_tokens_mean": rs["sampled_tokens"] / n},
        "settings": {"num_generations": group_size, "per_device_train_batch_size": trajectories_per_update,
                     "gradient_accumulation_steps": 1, "loss_type": config.loss_type,
                     "scale_rewards": config.scale_rewards, "beta": config.beta, "num_iterations": 1,
                     "max_new_tokens_per_turn": flags["rollout.max_new_tokens"], "max_turns": flags["rollout.max_turns"],
                     "max_len": flags["data.max_len"], "temperature": config.temperature, "top_p": config.top_p,
                     "learning_rate": config.learning_rate, "adam_betas": [config.adam_beta1, config.adam_beta2],
                     "max_grad_norm": config.max_grad_norm, "train_prompts": train_prompts,
                     "shuffle_dataset": False, "use_cpu": True, "bf16": bf16, "use_vllm": False,
                     "rollout": "rollout_func (ArithToolEnv; transformers generate per turn)",
                     "torch_threads": torch.get_num_threads()},
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--budget-min", type=float, default=30.0, help="training minutes (evaluations excluded)")
    p.add_argument("--eval-every-min", type=float, default=5.0, help="evaluate every this many training minutes")
    p.add_argument("--eval-prompts", type=int, default=128, help="held-out prompts per evaluation")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--group-size", type=int, default=8, help="TRL num_generations")
    p.add_argument("--trajectories-per-update", type=int, default=32)
    p.add_argument("--train-prompts", type=int, default=4096, help="train prompts in TRL's dataset")
    p.add_argument("--fp32", action="store_true", help="no bf16 autocast (the preset uses it)")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    set_openmp_spin_default()  # as the flashreinforce console script does
    out = Path(args.output).resolve()
    try:
        result = run_trl_tool(model=args.model, seed=args.seed, budget_min=args.budget_min,
                              eval_every_min=args.eval_every_min, eval_prompts=args.eval_prompts, out=out,
                              threads=args.threads, group_size=args.group_size,
                              trajectories_per_update=args.trajectories_per_update, train_prompts=args.train_prompts,
                              fp32=args.fp32)
    except ValueError as err:
        print(f"trl_tool_side: {err}", file=sys.stderr)
        return 2
    (out / RESULT_FILE).write_text(json.dumps(result, indent=1))
    pts = ", ".join(f"{p['train_min']:.1f} min: {p['accuracy']:.3f}" for p in result["curve"])
    print(f"[trl-tool] {result['updates']} updates in {result['train_s'] / 60:.2f} min, "
          f"{result['trajectories_per_s']:.3f} trajectories/s; held-out greedy accuracy {pts}; {out / RESULT_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
