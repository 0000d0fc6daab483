"""Evaluator: per-call sampling and sample counts (as ``flashreinforce eval`` uses them), restored after."""

from __future__ import annotations


from flashreinforce.engines import LocalWeightStore, SamplingParams
from flashreinforce.envs.toy import ToyCopyEnv
from flashreinforce.models.tokenizers import CharTokenizer
from flashreinforce.trainer.reporting.evaluation import EVAL_SEED_OFFSET, Evaluator, eval_seeds
from flashreinforce.trainer.rollout.settings import RolloutSettings
from python_tests.builders import tiny_causal_lm


def make_evaluator(seeds):
    tok = CharTokenizer()
    model = tiny_causal_lm(tok.vocab_size, seed=3, tied=False).eval()
    settings = RolloutSettings(max_new_tokens=2, max_len=32, max_turns=1)
    return Evaluator(env_factory=lambda: ToyCopyEnv(alphabet="abcdefgh"), seeds=seeds, model=model, tokenizer=tok,
                     weights=LocalWeightStore(), rollout_settings=settings,
                     sampling=SamplingParams(0.0, stop_token_ids=tok.eos_token_ids), n_samples=1,
                     episodes_per_call=8, seed=5)


def test_per_call_sampling_and_samples_apply_to_that_call_only():
    seeds = eval_seeds(None, 6)
    assert seeds == [EVAL_SEED_OFFSET + i for i in range(6)]
    ev = make_evaluator(seeds)
    greedy_runs, sampled = [], []
    first = ev.evaluate(0, trajectories=greedy_runs)
    assert first["eval_trajectories"] == 6 and [t.seed for t in greedy_runs] == seeds
    hot = SamplingParams(5.0, stop_token_ids=(2,))
    second = ev.evaluate(0, sampling=hot, n_samples=4, trajectories=sampled)
    assert second["eval_trajectories"] == 24
    assert [t.sample_index for t in sampled[:4]] == [0, 1, 2, 3]
    # At temperature 5 the samples of one prompt differ; greedy ones never do.
    assert len({tuple(t.token_ids) for t in sampled}) > len(seeds)
    again = []
    third = ev.evaluate(0, trajectories=again)
    assert ev.worker.settings.sampling.temperature == 0.0 and third["eval_trajectories"] == 6
    assert [t.token_ids for t in again] == [t.token_ids for t in greedy_runs]
    assert 0.0 <= first["eval_truncated_fraction"] <= 1.0 and first["eval_response_tokens_mean"] > 0
    ev.close()


def test_truncated_fraction_counts_turns_cut_at_max_new_tokens():
    ev = make_evaluator(eval_seeds(None, 4))
    # A stop token the tiny model never samples first: every turn runs to max_new_tokens (2).
    never = SamplingParams(0.0, stop_token_ids=(99,))
    result = ev.evaluate(0, sampling=never)
    assert result["eval_truncated_fraction"] == 1.0 and result["eval_response_tokens_mean"] == 2.0
    ev.close()
