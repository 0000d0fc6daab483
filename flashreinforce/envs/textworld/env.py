"""The TextWorld environment: one game played per episode, a command per turn.

:class:`TextWorldEnv` plays the games of :mod:`.games` with the policy: the prompt holds the goal,
the opening room and the admissible commands; each turn the policy answers with one command
(matched by :mod:`.commands`), the game answers, and the episode ends at a win, a loss, or after
``max_turns`` turns. A reply that names no admissible command costs a turn: the game does not
move, and the next observation says the command was invalid and lists the admissible commands
again.

Rewards (``reward``). ``"sparse"``: 1.0 on the winning step, else 0.0. ``"dense"``: progress along
TextWorld's shortest winning command sequence: a step that shortens it from ``L`` to ``L'``
commands earns ``(L - L') / L0`` (``L0`` at the start; a step that lengthens it earns a negative
amount), so a won episode sums to exactly 1.0 and an unfinished one to the fraction of the way
done. A lost game sums to 0.0 in both modes.

``failed`` is ``True`` on every step until the game is won (so an episode the trainer cuts at its
own turn limit counts as failed), ``False`` on the winning step. The final ``info`` has ``won``,
``lost``, ``turns``, ``moves`` (commands the game executed), ``invalid_commands``, ``progress``
(fraction of the winning sequence done, 0..1), ``heldout``, ``turn_limit``, and for a failed
episode ``failure_kind``: ``lost`` (the game's losing condition), ``invalid_command`` (out of
turns without a single admissible command), or ``out_of_steps`` (out of turns otherwise).

TextWorld itself is not thread-safe, so the environments of one process take turns calling into it
(one lock; the calls are short).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

from flashreinforce.envs.base import Environment, StepResult, resolve_max_turns
from flashreinforce.envs.textworld.commands import format_commands, match_command
from flashreinforce.envs.textworld.games import (HELDOUT_SEED_OFFSET, GameDistribution, ensure_game_pool, game_paths,
                                                 positive_int, require_textworld)
from flashreinforce.envs.registry import register_environment

__all__ = ["DEFAULT_COMMAND_PROMPT", "DEFAULT_INSTRUCTION", "TextWorldEnv"]

DEFAULT_INSTRUCTION = "You are playing a text adventure game."
DEFAULT_COMMAND_PROMPT = "Which command do you choose? Reply with the command only."

# TextWorld is not thread-safe: loading a game parses its logic with one module-global TatSu parser,
# and two threads loading at once corrupt each other (TypeError, IndexError, parse errors). Rollout
# workers and the evaluator run environments in several threads, so every call into TextWorld holds
# this lock. The calls are short (tens of milliseconds); the model's generation dominates a turn.
_textworld_lock = threading.RLock()


def _clip(text: str, limit: int) -> str:
    text = re.sub(r"\n{3,}", "\n\n", text).strip()  # TextWorld pads descriptions with blank lines
    return text if len(text) <= limit else text[:limit].rstrip() + " [...]"


def _clean_feedback(text: str) -> str:
    """The game's answer without the input prompt and status line TextWorld appends (``>  -= Room =-0/1``)."""
    lines = (text or "").splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].lstrip().startswith(">"):
            lines = lines[:i]
            break
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


@register_environment("textworld")
class TextWorldEnv(Environment):
    """TextWorld games (the docstrings of this module, :mod:`.games` and :mod:`.commands` describe games,
    splits, actions, rewards and ``info``).

    Args:
        train_games, heldout_games: pool sizes (defaults 64 and 32).
        world_size, nb_objects, quest_length, theme, problem_seed: the game distribution
            (:class:`GameDistribution`; defaults 1 room, 3 objects, quests of 1 to 2 commands).
        reward: ``"dense"`` (progress along the winning sequence) or ``"sparse"`` (1.0 at a win).
        max_turns: policy turns per episode; default ``MAX_AGENT_TURNS`` if set, else 16
            (:func:`~flashreinforce.envs.base.resolve_max_turns`; the trainer passes ``rollout.max_turns``).
        max_observation_chars: the room description, the inventory and each game answer are cut to
            this many characters (the goal and the command list are never cut).
        cache_dir: where generated games are kept (default ``~/.cache/flashreinforce/textworld``).
        generation_timeout_s: limit of the first-use generation (default 60 s + 30 s per missing game).
        game_files, heldout_game_files: play these TextWorld games (``.z8`` or ``.ulx`` with TextWorld's
            ``.json`` beside each) as the training / held-out pools instead of generated ones.
        instruction: the first paragraph of the prompt.
        command_prompt: the line after every list of admissible commands (the prompt's and each
            observation's last line: a small model follows the request it read last).
        max_open_games: started games kept per object (switching to a kept game is a cheap reset).
    """

    #: TextWorld's game interpreters are not known to be thread-safe: a worker calls its instances one
    #: after another.
    parallel_calls = False

    def __init__(self, *, train_games: int = 64, heldout_games: int = 32, world_size: int = 1, nb_objects: int = 3,
                 quest_length: int | Sequence[int] = (1, 2), theme: str = "house", problem_seed: int = 0,
                 reward: str = "dense", max_turns: int | None = None, max_observation_chars: int = 400,
                 cache_dir: str | None = None, generation_timeout_s: float | None = None,
                 game_files: Sequence[str] | None = None, heldout_game_files: Sequence[str] | None = None,
                 instruction: str = DEFAULT_INSTRUCTION, command_prompt: str = DEFAULT_COMMAND_PROMPT,
                 max_open_games: int = 4) -> None:
        require_textworld()
        if reward not in ("dense", "sparse"):
            raise ValueError(f"reward must be 'dense' or 'sparse', got {reward!r}")
        self.max_turns = resolve_max_turns(self.default_max_turns, max_turns)
        self.max_observation_chars = positive_int("max_observation_chars", max_observation_chars, minimum=20)
        self.max_open_games = positive_int("max_open_games", max_open_games)
        if generation_timeout_s is not None and not (isinstance(generation_timeout_s, (int, float))
                                                     and generation_timeout_s > 0):
            raise ValueError(f"generation_timeout_s must be a positive number of seconds, got {generation_timeout_s!r}")
        for name, value in (("instruction", instruction), ("command_prompt", command_prompt)):
            if not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {type(value).__name__}")
        self.reward_mode = reward
        self.instruction = instruction.strip()
        self.command_prompt = command_prompt.strip()
        if (game_files is None) != (heldout_game_files is None):
            raise ValueError("give both game_files and heldout_game_files (the training and the held-out games), "
                             "or neither to generate them")
        if game_files is not None:
            self.train_files = self._check_files("game_files", game_files)
            self.heldout_files = self._check_files("heldout_game_files", heldout_game_files)
            self.distribution = None
            self.pool_dir = None
        else:
            self.distribution = GameDistribution(
                world_size=world_size, nb_objects=nb_objects,
                quest_length=tuple(quest_length) if isinstance(quest_length, list) else quest_length, theme=theme,
                problem_seed=problem_seed, heldout_games=heldout_games)
            positive_int("train_games", train_games)
            self.pool_dir = ensure_game_pool(self.distribution, train_games, cache_dir, generation_timeout_s)
            self.train_files = [str(game_paths(self.pool_dir, "train", k)[0]) for k in range(train_games)]
            self.heldout_files = [str(game_paths(self.pool_dir, "heldout", k)[0]) for k in range(heldout_games)]
        self._open: OrderedDict[str, Any] = OrderedDict()
        self._game: Any = None
        self._state: Any = None
        self._done = True

    @staticmethod
    def _check_files(name: str, files: Sequence[str]) -> list[str]:
        if isinstance(files, str) or not files:
            raise ValueError(f"{name} must be a non-empty list of game files")
        out = []
        for f in files:
            path = Path(os.path.expanduser(os.fspath(f)))
            if not path.is_file():
                raise FileNotFoundError(f"{name}: game file {str(path)!r} does not exist")
            if not path.with_suffix(".json").is_file():
                raise FileNotFoundError(f"{name}: {str(path)!r} has no {path.with_suffix('.json').name} beside it "
                                        "(TextWorld's game description, needed for the admissible commands)")
            out.append(str(path))
        return out

    # ------------------------------------------------------------------ games
    def game_for_seed(self, seed: int) -> tuple[str, bool]:
        """The game file an episode seed plays, and whether it is a held-out game."""
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        if seed < HELDOUT_SEED_OFFSET:
            return self.train_files[seed % len(self.train_files)], False
        index = seed - HELDOUT_SEED_OFFSET
        if index >= len(self.heldout_files):
            raise ValueError(f"held-out game {index} requested, but the held-out pool has {len(self.heldout_files)} "
                             "games; lower eval.num_prompts or raise env.kwargs heldout_games")
        return self.heldout_files[index], True

    def _start(self, path: str) -> Any:
        game = self._open.pop(path, None)
        if game is None:
            import textworld

            infos = textworld.EnvInfos(admissible_commands=True, won=True, lost=True, objective=True,
                                       description=True, inventory=True, policy_commands=True, moves=True)
            with _textworld_lock:
                game = textworld.start(path, request_infos=infos)
        self._open[path] = game
        while len(self._open) > self.max_open_games:
            _, old = self._open.popitem(last=False)
            with _textworld_lock:
                old.close()
        return game

    def solution(self) -> list[str]:
        """TextWorld's shortest command sequence that wins from the current state (empty once it is over)."""
        if self._state is None:
            raise RuntimeError("solution() before reset()")
        return list(self._state["policy_commands"] or [])

    def admissible_commands(self) -> list[str]:
        """The commands the game accepts in the current state, in TextWorld's (sorted) order."""
        if self._state is None:
            raise RuntimeError("admissible_commands() before reset()")
        return list(self._state["admissible_commands"] or [])

    # ------------------------------------------------------------------ episode
    def reset(self, *, seed: int) -> str:
        path, heldout = self.game_for_seed(seed)
        self._game = self._start(path)
        with _textworld_lock:
            self._state = self._game.reset()
        self._heldout = heldout
        self._turn = 0
        self._moves = 0
        self._invalid = 0
        self._earned = 0.0
        self._start_length = max(1, len(self.solution()))
        self._length = len(self.solution())
        self._done = False
        clip = self.max_observation_chars
        parts = [self.instruction, f"Goal: {(self._state['objective'] or '').strip()}",
                 _clip(self._state["description"] or "", clip), _clip(self._state["inventory"] or "", clip),
                 format_commands(self.admissible_commands(), self.command_prompt)]
        return "\n\n".join(p for p in parts if p)

    def _finish(self, reward: float, *, won: bool, lost: bool, turn_limit: bool) -> StepResult:
        self._done = True
        progress = 1.0 if won else (0.0 if lost else 1.0 - min(self._length, self._start_length) / self._start_length)
        info: dict[str, Any] = {"won": won, "lost": lost, "turns": self._turn, "moves": self._moves,
                                "invalid_commands": self._invalid, "progress": progress, "heldout": self._heldout,
                                "turn_limit": turn_limit}
        if not won:
            info["failure_kind"] = ("lost" if lost else
                                    "invalid_command" if self._invalid == self._turn else "out_of_steps")
        return StepResult(observation="", reward=reward, done=True, failed=not won, info=info)

    def step(self, action: str) -> StepResult:
        if self._done:
            raise RuntimeError("step() before reset() or after the episode ended")
        if not isinstance(action, str):
            raise TypeError(f"action must be str, got {type(action).__name__}")
        self._turn += 1
        out_of_turns = self._turn >= self.max_turns
        command = match_command(action, self.admissible_commands())
        if command is None:
            self._invalid += 1
            if out_of_turns:
                return self._finish(0.0, won=False, lost=False, turn_limit=True)
            shown = _clip(" ".join(action.split()), 60) or "(empty)"
            text = (f'Invalid command "{shown}": it is not one of the admissible commands, so nothing happened.\n\n'
                    + format_commands(self.admissible_commands(), self.command_prompt))
            return StepResult(observation=text, reward=0.0, done=False, failed=True)
        with _textworld_lock:
            self._state, _score, _game_over = self._game.step(command)
        self._moves += 1
        won, lost = bool(self._state["won"]), bool(self._state["lost"])
        if won:
            reward = 1.0 - self._earned if self.reward_mode == "dense" else 1.0
        elif lost:
            reward = -self._earned  # a lost game is worth nothing, whatever progress came before
        else:
            length = len(self.solution())
            reward = (self._length - length) / self._start_length if self.reward_mode == "dense" else 0.0
            self._length = length
        self._earned += reward
        if won or lost or out_of_turns:
            return self._finish(reward, won=won, lost=lost, turn_limit=not (won or lost))
        text = (_clip(_clean_feedback(self._state["feedback"]), self.max_observation_chars) + "\n\n"
                + format_commands(self.admissible_commands(), self.command_prompt))
        return StepResult(observation=text, reward=reward, done=False, failed=True)

    def close(self) -> None:
        while self._open:
            _, game = self._open.popitem()
            with contextlib.suppress(Exception), _textworld_lock:  # closing must not hide the run's own outcome
                game.close()
        self._game = None
