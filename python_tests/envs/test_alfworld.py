"""The ALFWorld adapter. Its protocol helpers are tested everywhere; playing a game needs the
``alfworld`` package (not a dependency of the project): that test builds a tiny one-room game
from the package's own PDDL domain and grammar, and is skipped when the package is missing."""

from __future__ import annotations

import importlib.util
import json

import pytest

from flashreinforce.envs.alfworld import ALFWorldEnv, extract_action, resolve_game_file
from flashreinforce.envs.registry import make_environment

_HAS_ALFWORLD = importlib.util.find_spec("alfworld") is not None and importlib.util.find_spec("textworld") is not None


def test_extract_action():
    assert extract_action("think... <action>Go to  Fridge 1</action>") == "go to fridge 1"
    assert extract_action("<action>look</action> then <ACTION>open drawer 2</ACTION>") == "open drawer 2"
    assert extract_action("go to fridge 1") is None
    assert extract_action("<action>  </action>") is None


def test_resolve_game_file(tmp_path):
    trial = tmp_path / "json_2.1.1" / "train" / "task-1" / "trial_1"
    trial.mkdir(parents=True)
    (trial / "game.tw-pddl").write_text("{}")
    expected = str(trial / "game.tw-pddl")
    assert resolve_game_file("json_2.1.1/train/task-1/trial_1", str(tmp_path)) == expected
    assert resolve_game_file(str(trial), None) == expected
    assert resolve_game_file(expected, None) == expected
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_game_file("json_2.1.1/nope", str(tmp_path))
    with pytest.raises(ValueError, match="ALFWORLD_DATA is not set"):
        resolve_game_file("relative/path", None)


def test_missing_package_or_data_is_a_clear_error(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "alfworld" else real_find_spec(name, *a))
    with pytest.raises(ImportError, match="pip install alfworld"):
        ALFWorldEnv()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    with pytest.raises(ValueError, match="export ALFWORLD_DATA"):
        ALFWorldEnv()
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="is not a directory"):
        ALFWorldEnv()


_PROBLEM = """
(define (problem tiny)
(:domain alfred)
(:objects
  agent1 - agent
  AppleType - otype
  FridgeType - rtype
  CounterTopType - rtype
  Apple_bar__plus_00_dot_10_bar__plus_00_dot_90_bar__minus_01_dot_00 - object
  CounterTop_bar__plus_00_dot_50_bar__plus_00_dot_90_bar__minus_01_dot_00 - receptacle
  Fridge_bar__minus_01_dot_00_bar__plus_00_dot_00_bar__plus_01_dot_00 - receptacle
  loc_start - location
  loc_counter - location
  loc_fridge - location
)
(:init
  (receptacleType CounterTop_bar__plus_00_dot_50_bar__plus_00_dot_90_bar__minus_01_dot_00 CounterTopType)
  (receptacleType Fridge_bar__minus_01_dot_00_bar__plus_00_dot_00_bar__plus_01_dot_00 FridgeType)
  (objectType Apple_bar__plus_00_dot_10_bar__plus_00_dot_90_bar__minus_01_dot_00 AppleType)
  (canContain FridgeType AppleType)
  (canContain CounterTopType AppleType)
  (pickupable Apple_bar__plus_00_dot_10_bar__plus_00_dot_90_bar__minus_01_dot_00)
  (openable Fridge_bar__minus_01_dot_00_bar__plus_00_dot_00_bar__plus_01_dot_00)
  (atLocation agent1 loc_start)
  (receptacleAtLocation CounterTop_bar__plus_00_dot_50_bar__plus_00_dot_90_bar__minus_01_dot_00 loc_counter)
  (receptacleAtLocation Fridge_bar__minus_01_dot_00_bar__plus_00_dot_00_bar__plus_01_dot_00 loc_fridge)
  (inReceptacle Apple_bar__plus_00_dot_10_bar__plus_00_dot_90_bar__minus_01_dot_00 CounterTop_bar__plus_00_dot_50_bar__plus_00_dot_90_bar__minus_01_dot_00)
  (objectAtLocation Apple_bar__plus_00_dot_10_bar__plus_00_dot_90_bar__minus_01_dot_00 loc_counter)
)
(:goal (and (exists (?r - receptacle) (exists (?o - object)
  (and (inReceptacle ?o ?r) (objectType ?o AppleType) (receptacleType ?r FridgeType))))))
)
"""


@pytest.fixture
def tiny_game(tmp_path, monkeypatch):
    from alfworld.agents.utils.misc import add_task_to_grammar
    from alfworld.info import ALFRED_PDDL_PATH, ALFRED_TWL2_PATH

    trial = tmp_path / "json_2.1.1" / "train" / "pick_and_place_simple-Apple-None-Fridge-1" / "trial_1"
    trial.mkdir(parents=True)
    traj = {"task_type": "pick_and_place_simple",
            "pddl_params": {"object_sliced": False, "object_target": "Apple", "parent_target": "Fridge",
                            "toggle_target": "", "mrecep_target": ""}}
    with open(ALFRED_TWL2_PATH) as f:
        grammar = add_task_to_grammar(f.read(), traj)
    with open(ALFRED_PDDL_PATH) as f:
        domain = f.read()
    (trial / "game.tw-pddl").write_text(json.dumps(
        {"pddl_domain": domain, "grammar": grammar, "pddl_problem": _PROBLEM, "solvable": True}))
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    return str(trial.relative_to(tmp_path))


@pytest.mark.skipif(not _HAS_ALFWORLD, reason="the alfworld package is not installed (pip install alfworld)")
def test_plays_a_real_alfworld_game(tiny_game, tmp_path):
    data = tmp_path / "alfworld.jsonl"
    data.write_text(json.dumps({"prompt": "", "game_file": tiny_game}) + "\n")
    env = make_environment("alfworld", {"data.prompt_dataset": str(data), "max_turns": 8})
    try:
        prompt = env.reset(seed=0)
        task_line = prompt.split("Your task is to: ", 1)[1].splitlines()[0]  # the wording is drawn at random
        assert "apple" in task_line and "fridge" in task_line
        assert "Admissible actions: go to countertop 1, go to fridge 1" in prompt
        first = env.step("<action>go to countertop 1</action>")
        assert not first.done and "apple 1" in first.observation and "take apple 1 from countertop 1" in first.observation
        assert "Invalid format" in env.step("I should take it").observation
        assert "Nothing happens" in env.step("<action>fly away</action>").observation
        for action in ["take apple 1 from countertop 1", "go to fridge 1", "open fridge 1"]:
            assert not env.step(f"<action>{action}</action>").done
        final = env.step("<action>move apple 1 to fridge 1</action>")
        assert (final.reward, final.done, final.failed) == (1.0, True, False)
        assert final.info == {"game_steps": 6, "inadmissible_actions": 1, "format_errors": 1, "won": True,
                              "turns": 7, "turn_limit": False}
        env.reset(seed=1)  # the same game again, from its start
        for _ in range(7):
            assert not env.step("<action>look</action>").done
        last = env.step("<action>look</action>")
        assert last.done and last.reward == 0.0 and last.failed and last.info["turn_limit"] is True
    finally:
        env.close()
