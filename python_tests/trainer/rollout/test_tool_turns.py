"""Multi-turn tool episodes, token in and token out: a turn the environment ends (a code block) is cut
where it ends and closed with the end-of-turn token, the tool's output is appended exactly as the
engine sees it next turn, observation tokens are never actions, every action token keeps the
log-probability the engine sampled it with, and the turn limit ends the episode as documented."""

from __future__ import annotations

import pytest

from flashreinforce.engines import LocalWeightStore, SamplingParams
from flashreinforce.engines.base import Generation, GenerationRequest, RolloutEngine
from flashreinforce.envs.arith_python_tool import ArithToolEnv
from flashreinforce.envs.tasks import Task
from flashreinforce.models.tokenizers import CharTokenizer
from flashreinforce.trainer.rollout.buffer import RolloutBuffer, Ticket
from flashreinforce.trainer.rollout.settings import RolloutSettings
from flashreinforce.trainer.rollout.worker import RolloutWorker
from python_tests.builders import tiny_causal_lm

TOK = CharTokenizer()
EOS = TOK.eos_token_ids[0]


class ScriptedEngine(RolloutEngine):
    """Answers turn k of the episode with ``turns[k]`` (as tokens, log-prob -0.01 * (i + 1) for token i),
    recording every request; ``honor_stop``: stop early at the request's predicate, as the hf engine
    does (else the rollout must cut the turn afterwards, as for vLLM)."""

    def __init__(self, turns, honor_stop):
        self.turns, self.honor_stop, self.requests, self.version = list(turns), honor_stop, [], 0

    def generate(self, requests, params):
        out = []
        for r in requests:
            self.requests.append(list(r.token_ids))
            ids = TOK.encode(self.turns[len(self.requests) - 1])[:r.max_new_tokens]
            reason = "length"
            if self.honor_stop and r.stop is not None:
                for k in range(1, len(ids) + 1):
                    if r.stop(ids[:k]):
                        ids, reason = ids[:k], "stop"
                        break
            out.append(Generation(ids, [-0.01 * (i + 1) for i in range(len(ids))], reason, self.version))
        return out

    def load_weights(self, state, version):
        self.version = version


def _episode(turns, *, honor_stop, max_turns=3, task=("What is 2 + 3?", "5")):
    env = ArithToolEnv(max_turns=max_turns)
    env.set_task(Task(prompt=task[0], ground_truth=task[1], index=0))
    engine = ScriptedEngine(turns, honor_stop)
    buffer = RolloutBuffer(batch_groups=1, async_queue_size=0, vocab_size=TOK.vocab_size)
    settings = RolloutSettings(max_new_tokens=60, max_len=4000, max_turns=max_turns, episodes_per_call=1,
                               sampling=SamplingParams(stop_token_ids=TOK.eos_token_ids))
    worker = RolloutWorker(0, engine, lambda: env, TOK, buffer, LocalWeightStore(), settings)
    (trajectory,), = worker.run_tickets([Ticket(0, 0, 1)])
    return trajectory, engine, env


@pytest.mark.parametrize("honor_stop", [True, False])
def test_a_tool_turn_is_cut_closed_and_followed_by_the_tool_output(honor_stop):
    code = "```python\nprint(2 + 3)\n```"
    t, engine, env = _episode([code + " and then 6 is the answer \\boxed{6}", "\\boxed{5} yes"], honor_stop=honor_stop)
    assert t.reward == 1.0 and not t.failed and t.num_turns == 2
    assert t.info["tool_calls"] == 1 and t.info["answer_from_tool"] and t.info["tool_errors"] == 0
    ids, mask, logp = t.token_ids, t.action_mask, t.behavior_log_probs
    prompt = engine.requests[0]
    assert ids[:len(prompt)] == prompt and not any(mask[:len(prompt)])
    # turn 1: the action up to the end of the code block, with the engine's own log-probabilities
    first = TOK.encode(code)
    end1 = len(prompt) + len(first)
    assert ids[len(prompt):end1] == first and all(mask[len(prompt):end1])
    assert logp[len(prompt):end1] == pytest.approx([-0.01 * (i + 1) for i in range(len(first))])
    # then the end-of-turn token and the tool's output, as context, exactly what the engine saw next
    observation = TOK.encode_observation("<output>\n5\n</output>")
    context = engine.requests[1]
    assert context == ids[:len(context)] == ids[:end1] + [EOS] + observation
    assert not any(mask[end1:len(context)]) and all(x == 0.0 for x in logp[end1:len(context)])
    # turn 2: cut at the box, its log-probabilities as sampled
    answer = TOK.encode("\\boxed{5}")
    assert ids[len(context):] == answer and all(mask[len(context):])
    assert logp[len(context):] == pytest.approx([-0.01 * (i + 1) for i in range(len(answer))])
    assert t.problem(TOK.vocab_size) is None


def test_a_turn_without_an_end_is_kept_whole_and_mental_arithmetic_is_not_rewarded():
    t, engine, _ = _episode(["it is 6, so 6"], honor_stop=True)
    assert t.num_turns == 1 and t.reward == 0.0 and t.failed and t.info["failure_kind"] == "no_answer"
    assert t.token_ids[len(engine.requests[0]):] == TOK.encode("it is 6, so 6")
    assert t.info["tool_calls"] == 0 and not t.info["answer_from_tool"]


def test_the_turn_limit_ends_the_episode_without_running_its_code():
    code = "```python\nprint(2 + 3)\n```"
    t, engine, env = _episode([code, code], honor_stop=True, max_turns=2)
    assert t.num_turns == 2 and len(engine.requests) == 2
    assert t.info["tool_calls"] == 1 and t.info["turn_limit"] and t.info["failure_kind"] == "turn_limit"
    assert t.reward == 0.0 and t.failed and not t.truncated  # the environment ended it, at its own limit
    assert t.token_ids[-len(TOK.encode(code)):] == TOK.encode(code) and t.action_mask[-1]  # no output after it


def test_the_hf_engine_stops_at_the_predicate():
    from flashreinforce.engines import HFEngine

    model = tiny_causal_lm(TOK.vocab_size, layers=1, max_positions=64)
    engine = HFEngine(model, pad_token_id=TOK.pad_token_id)
    prompt = TOK.encode_prompt("hi")
    (free,) = engine.generate([GenerationRequest(prompt, 8, 1)], SamplingParams())
    (cut,) = engine.generate([GenerationRequest(prompt, 8, 1, stop=lambda ids: len(ids) >= 3)], SamplingParams())
    assert len(free.token_ids) == 8 and cut.token_ids == free.token_ids[:3] and cut.finish_reason == "stop"
    assert cut.log_probs == free.log_probs[:3]
