"""The TextWorld environment. Command matching, pool planning and the install error are tested
everywhere; the games need the optional ``textworld`` package (``pip install -e '.[textworld]'``):
those tests generate a pool of three tiny games once per module (about 15 s) and are skipped,
with the reason shown, when the package is missing."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from flashreinforce.envs import textworld as tw_env
from flashreinforce.envs.textworld import (HELDOUT_SEED_OFFSET, GameDistribution, TextWorldEnv, fill_pools,
                                           match_command)

HAS_TEXTWORLD = importlib.util.find_spec("textworld") is not None
needs_textworld = pytest.mark.skipif(not HAS_TEXTWORLD, reason="textworld is not installed (optional extra: "
                                     "pip install -e '.[textworld]')")

# One room, two objects, quests of exactly two commands: the smallest games with an intermediate step.
POOL = dict(train_games=2, heldout_games=1, world_size=1, nb_objects=2, quest_length=2)


# ------------------------------------------------------------------ without textworld
def test_match_command_ignores_case_spacing_and_punctuation():
    cmds = ["go east", "take type K keycard", "take key", "take key from box", "look"]
    assert match_command("go east", cmds) == "go east"
    assert match_command("  GO    East. ", cmds) == "go east"
    assert match_command("take TYPE k KEYCARD", cmds) == "take type K keycard"  # spelled as the game wants it
    assert match_command('"look"', cmds) == "look"
    assert match_command("I think so.\n- take key\nbecause", cmds) == "take key"  # a line that is a command
    assert match_command("Command: look", cmds) == "look"
    assert match_command("I will take key from box now, then go east", cmds) == "take key from box"  # longest
    assert match_command("First go east, then look", cmds) == "go east"  # earliest mention
    assert match_command("You choose to take the key.", cmds) == "take key"  # articles do not matter
    assert match_command("the look", cmds) == "look"
    assert match_command("lookout", cmds) is None  # whole words only
    assert match_command("dance wildly", cmds) is None
    assert match_command("", cmds) is None


class _FakeGenerator:
    """Signatures from a table (``None``: no quest for that seed); records what was kept."""

    def __init__(self, signature_of):
        self.signature_of = signature_of
        self.kept = {}

    def __call__(self, pool, index, seed):
        return self.signature_of(pool, index, seed)

    def keep(self, pool, index, seed):
        self.kept[(pool, index)] = (seed, self.signature_of(pool, index, seed))


def test_training_games_that_repeat_a_heldout_game_are_rejected():
    dist = GameDistribution(heldout_games=2)
    seed = tw_env.generation_seed
    clash = {seed("train", 0, 1, 0), seed("train", 0, 1, 1)}  # train slot 1: first two candidates clash
    no_quest = {seed("heldout", 0, 0, 0)}

    def signature(pool, index, s):
        if s in no_quest:
            return None
        if s in clash:
            return "H1"  # same content as held-out game 1
        return f"{pool}{index}"

    gen = _FakeGenerator(signature)
    fill_pools(dist, 3, {("heldout", 1): "H1"}, gen)  # held-out game 1 already on disk
    assert ("heldout", 1) not in gen.kept
    assert gen.kept[("heldout", 0)] == (seed("heldout", 0, 0, 1), "heldout0")  # the no-quest seed was skipped
    assert gen.kept[("train", 1)] == (seed("train", 0, 1, 2), "train1")
    assert {sig for _, sig in gen.kept.values()} == {"heldout0", "train0", "train1", "train2"}

    always_clash = _FakeGenerator(lambda pool, index, s: "H1" if pool == "train" else f"H{index}")
    with pytest.raises(RuntimeError, match="relax the settings"):
        fill_pools(dist, 1, {}, always_clash)


def test_generation_seeds_are_fixed_and_distinct_per_pool():
    assert tw_env.generation_seed("train", 0, 5, 0) == tw_env.generation_seed("train", 0, 5, 0)
    seeds = {tw_env.generation_seed(p, 0, i, a) for p in ("train", "heldout") for i in range(20) for a in range(3)}
    assert len(seeds) == 120
    assert tw_env.generation_seed("train", 1, 5, 0) != tw_env.generation_seed("train", 0, 5, 0)


def test_the_trainer_evaluates_on_the_heldout_pool():
    from flashreinforce.trainer.reporting.evaluation import eval_seeds

    # TextWorldEnv has no finite prompt set: the evaluation seeds start at the held-out offset, and
    # training seeds count up from 0, far below it.
    assert eval_seeds(None, 3) == [HELDOUT_SEED_OFFSET + i for i in range(3)]


def test_missing_textworld_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "textworld" else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install -e '\.\[textworld\]'"):
        TextWorldEnv(**POOL)


def test_bad_arguments_are_named():
    if not HAS_TEXTWORLD:
        pytest.skip("textworld is not installed (optional extra: pip install -e '.[textworld]')")
    for kwargs, name in (({"reward": "shaped"}, "reward"), ({"max_turns": 0}, "max_turns"),
                         ({"quest_length": [3, 1]}, "quest_length"), ({"world_size": 0}, "world_size"),
                         ({"max_observation_chars": 5}, "max_observation_chars"),
                         ({"game_files": ["a.z8"]}, "heldout_game_files"),
                         ({"generation_timeout_s": -1}, "generation_timeout_s")):
        with pytest.raises(ValueError, match=name):
            TextWorldEnv(**{**POOL, **kwargs})


# ------------------------------------------------------------------ with games
@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    if not HAS_TEXTWORLD:
        pytest.skip("textworld is not installed (optional extra: pip install -e '.[textworld]')")
    root = tmp_path_factory.mktemp("textworld_cache")
    TextWorldEnv(**POOL, cache_dir=str(root)).close()  # generates the pool once for the module
    return root


def make_env(cache, **kwargs):
    return TextWorldEnv(**{**POOL, "cache_dir": str(cache), **kwargs})


def signatures(pool_dir: Path, pool: str) -> list[str]:
    return [json.loads(p.read_text())["signature"] for p in sorted((pool_dir / pool).glob("*.meta.json"))]


@needs_textworld
def test_generation_is_deterministic_per_seed(cache, tmp_path):
    env = make_env(cache)
    other = TextWorldEnv(**{**POOL, "train_games": 1}, cache_dir=str(tmp_path))  # a fresh cache, another process
    try:
        assert other.pool_dir != env.pool_dir
        assert signatures(other.pool_dir, "heldout") == signatures(env.pool_dir, "heldout")
        assert signatures(other.pool_dir, "train") == signatures(env.pool_dir, "train")[:1]
        for seed in (0, HELDOUT_SEED_OFFSET):
            assert other.reset(seed=seed) == env.reset(seed=seed)
    finally:
        env.close()
        other.close()


@needs_textworld
def test_pools_are_disjoint_and_seeds_map_to_them(cache):
    env = make_env(cache)
    try:
        train, heldout = signatures(env.pool_dir, "train"), signatures(env.pool_dir, "heldout")
        assert len(train) == 2 and len(heldout) == 1 and not set(train) & set(heldout)
        assert env.game_for_seed(0) == (env.train_files[0], False)
        assert env.game_for_seed(3) == (env.train_files[1], False)  # seed % train_games
        assert env.game_for_seed(HELDOUT_SEED_OFFSET) == (env.heldout_files[0], True)
        assert env.reset(seed=2) == env.reset(seed=0)
        assert env.reset(seed=HELDOUT_SEED_OFFSET) != env.reset(seed=0)
        with pytest.raises(ValueError, match="eval.num_prompts"):
            env.reset(seed=HELDOUT_SEED_OFFSET + 1)
    finally:
        env.close()


@needs_textworld
def test_prompt_shows_goal_room_and_admissible_commands(cache):
    env = make_env(cache)
    try:
        prompt = env.reset(seed=0)
        state = env._state
        assert prompt.startswith(tw_env.DEFAULT_INSTRUCTION)
        assert f"Goal: {state['objective'].strip()}" in prompt
        assert state["description"].strip().splitlines()[0] in prompt  # the room's name line, -= Room =-
        commands = env.admissible_commands()
        assert commands and f"Admissible commands: {', '.join(commands)}" in prompt
        short = make_env(cache, max_observation_chars=30).reset(seed=0)
        assert "[...]" in short and len(short) < len(prompt)
        assert f"Goal: {state['objective'].strip()}" in short  # the goal is never cut
    finally:
        env.close()


def _play(env, commands):
    return [env.step(c) for c in commands]


@needs_textworld
@pytest.mark.parametrize("reward", ["dense", "sparse"])
def test_winning_by_the_solution(cache, reward):
    env = make_env(cache, reward=reward)
    try:
        env.reset(seed=1)
        solution = env.solution()
        assert len(solution) >= 2
        # spelled loosely: the commands still match
        results = _play(env, [f"  {c.upper()} ." for c in solution])
        *steps, last = results
        for r in steps:
            assert not r.done and r.failed is True and r.info == {}
            assert "Admissible commands:" in r.observation
            assert not re.search(r"=-\d+/\d+", r.observation)  # TextWorld's status line is cut off
        if reward == "dense":
            assert steps[0].reward == pytest.approx(1 / len(solution))
        else:
            assert all(r.reward == 0.0 for r in steps) and last.reward == 1.0
        assert sum(r.reward for r in results) == pytest.approx(1.0)
        assert last.done and last.failed is False
        assert last.info["won"] is True and "failure_kind" not in last.info
        assert last.info["moves"] == len(solution) and last.info["progress"] == 1.0
        with pytest.raises(RuntimeError, match="after the episode ended"):
            env.step("look")
    finally:
        env.close()


@needs_textworld
def test_out_of_steps(cache):
    env = make_env(cache, max_turns=2)
    try:
        env.reset(seed=1)
        first = env.solution()[0]
        results = _play(env, [first, "look"])
        assert not results[0].done and results[1].done and results[1].failed is True
        info = results[1].info
        assert info["failure_kind"] == "out_of_steps" and info["turn_limit"] is True and info["won"] is False
        assert info["turns"] == 2 and info["moves"] == 2 and 0 < info["progress"] < 1
        assert sum(r.reward for r in results) == pytest.approx(info["progress"])  # dense: the progress made
    finally:
        env.close()


@needs_textworld
def test_invalid_command_costs_a_turn_and_says_so(cache):
    env = make_env(cache, max_turns=3)
    try:
        env.reset(seed=1)
        before = env.solution()
        r = env.step("dance wildly around the room")
        assert not r.done and r.failed is True and r.reward == 0.0
        assert 'Invalid command "dance wildly around the room"' in r.observation
        assert f"Admissible commands: {', '.join(env.admissible_commands())}" in r.observation
        assert env.solution() == before  # the game did not move
        results = _play(env, ["", "fly to the moon"])
        assert results[-1].done
        info = results[-1].info
        assert info["failure_kind"] == "invalid_command" and info["invalid_commands"] == 3 and info["moves"] == 0
        env.reset(seed=1)
        results = _play(env, ["xyzzy", "look", "xyzzy"])  # one valid command: out of steps, not invalid
        assert results[-1].info["failure_kind"] == "out_of_steps" and results[-1].info["invalid_commands"] == 2
    finally:
        env.close()


@needs_textworld
@pytest.mark.parametrize("reward", ["dense", "sparse"])
def test_a_lost_game(tmp_path, reward):
    import textworld
    from textworld.testing import build_and_compile_game

    options = textworld.GameOptions()
    options.path = str(tmp_path / "carrot.z8")
    _, game_file = build_and_compile_game(options)  # losing condition: eating the carrot
    env = TextWorldEnv(game_files=[game_file], heldout_game_files=[game_file], reward=reward, max_turns=5)
    try:
        env.reset(seed=0)
        results = _play(env, ["go east", "eat carrot"])
        assert not results[0].done
        last = results[-1]
        assert last.done and last.failed is True
        assert last.info["lost"] is True and last.info["failure_kind"] == "lost" and last.info["progress"] == 0.0
        assert sum(r.reward for r in results) == pytest.approx(0.0)
        if reward == "dense":
            assert results[0].reward > 0  # progress, taken back by the loss
    finally:
        env.close()


@needs_textworld
def test_game_files_must_exist_with_their_json(tmp_path):
    z8 = tmp_path / "g.z8"
    z8.write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="g.json"):
        TextWorldEnv(game_files=[str(z8)], heldout_game_files=[str(z8)])
    (tmp_path / "g.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="heldout_game_files"):
        TextWorldEnv(game_files=[str(z8)], heldout_game_files=[str(tmp_path / "nope.z8")])


@needs_textworld
def test_generation_is_bounded_in_time(tmp_path):
    with pytest.raises(TimeoutError, match="generation_timeout_s"):
        TextWorldEnv(**POOL, cache_dir=str(tmp_path), generation_timeout_s=0.5)


@needs_textworld
def test_registry_builds_it_by_name_without_a_dataset(cache):
    from flashreinforce.envs.registry import accepts_chat_template, make_environment

    env = make_environment("textworld", {"rollout.batch_size": 4}, **POOL, cache_dir=str(cache))
    try:
        assert isinstance(env, TextWorldEnv) and "Admissible commands:" in env.reset(seed=0)
    finally:
        env.close()
    assert not accepts_chat_template("textworld")  # the trainer's tokenizer applies the chat template


def test_preset_turn_limits_agree():
    from flashreinforce.config.presets import PRESETS

    preset = PRESETS["textworld"]
    assert preset["env"] == "textworld"
    assert preset["env.kwargs"]["max_turns"] == preset["rollout.max_turns"]
    assert preset["eval.num_prompts"] <= preset["env.kwargs"]["heldout_games"]
    # The learner works through a batch in token-bounded micro-batches: the whole batch in one pass
    # (16 trajectories of ~500 tokens through SmolLM2's 30 layers) ran a 23 GB machine out of memory.
    assert 0 < preset["train.micro_batch_tokens"] <= 2 * preset["data.max_len"]


@needs_textworld
def test_rollout_with_a_tiny_model(cache):
    from flashreinforce.engines import HFEngine, LocalWeightStore, SamplingParams
    from flashreinforce.models.tokenizers import CharTokenizer
    from flashreinforce.trainer.rollout.buffer import RolloutBuffer, Ticket
    from flashreinforce.trainer.rollout.settings import RolloutSettings
    from flashreinforce.trainer.rollout.worker import RolloutWorker
    from python_tests.builders import tiny_causal_lm

    tok = CharTokenizer()
    model = tiny_causal_lm(tok.vocab_size, seed=0, layers=1, max_positions=4096)
    engine = HFEngine(model, pad_token_id=tok.pad_token_id, version=0)
    store = LocalWeightStore()
    store.publish(model.state_dict(), 0)
    buffer = RolloutBuffer(batch_groups=2, async_queue_size=1, vocab_size=tok.vocab_size)
    settings = RolloutSettings(max_new_tokens=6, max_len=4096, max_turns=3,
                               sampling=SamplingParams(stop_token_ids=tok.eos_token_ids), episodes_per_call=2, seed=3)
    worker = RolloutWorker(0, engine, lambda: make_env(cache, max_turns=3), tok, buffer, store, settings)
    try:
        groups = worker.run_tickets([Ticket(0, 0, 1), Ticket(1, HELDOUT_SEED_OFFSET, 1)])
    finally:
        worker.close()
    env = make_env(cache, max_turns=3)
    try:
        for (traj,), seed in zip(groups, (0, HELDOUT_SEED_OFFSET)):
            assert traj.problem(tok.vocab_size) is None
            prompt = tok.encode_prompt(env.reset(seed=seed))
            assert traj.token_ids[:len(prompt)] == prompt and not any(traj.action_mask[:len(prompt)])
            assert traj.num_turns == traj.info["turns"] == 3  # a random model does not win in 3 turns
            assert traj.failed and traj.info["failure_kind"] in ("invalid_command", "out_of_steps")
            assert traj.info["heldout"] is (seed >= HELDOUT_SEED_OFFSET)
            # the game's answers are there, as non-action tokens
            observed = tok.decode([t for t, m in zip(traj.token_ids[len(prompt):], traj.action_mask[len(prompt):])
                                   if not m])
            assert observed.count("Admissible commands:") == 2
    finally:
        env.close()


@needs_textworld
def test_environments_in_several_threads(cache):
    # Rollout workers and the evaluator step their environments from different threads; TextWorld's game
    # loading parses with one module-global parser, which broke (TypeError, IndexError, parse errors)
    # when two threads loaded games at once.
    import threading

    errors, wins = [], []

    def play(k):
        env = make_env(cache, max_open_games=1)  # every reset of another game loads (parses) it again
        try:
            for i in range(8):
                env.reset(seed=(k + i) % 2)
                for command in env.solution():
                    result = env.step(command)
                wins.append(result.info["won"])
        except Exception as err:  # collected: an assert in a thread would not fail the test
            errors.append(repr(err))
        finally:
            env.close()

    threads = [threading.Thread(target=play, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert wins == [True] * 32
