"""TextWorld text games, generated offline from a seed, as a multi-turn environment.

TextWorld (the engine ALFWorld is built on) generates small interactive-fiction games: rooms,
containers, keys, doors and a quest ("take the cloak from the safe, then drop it in the cellar").
:class:`TextWorldEnv` plays such games with the policy: the prompt holds the goal, the opening
room and the admissible commands; each turn the policy answers with one command, the game
answers, and the episode ends at a win, a loss, or after ``max_turns`` turns.

Games and splits. The games are generated on first use (when the first environment object is
built) into ``cache_dir`` (default ``~/.cache/flashreinforce/textworld``), one subdirectory per
game distribution, and reused afterwards. There are two fixed pools: ``heldout_games`` held-out
games and ``train_games`` training games. ``reset(seed=s)`` with ``s < HELDOUT_SEED_OFFSET`` plays
training game ``s % train_games``; ``reset(seed=HELDOUT_SEED_OFFSET + i)`` plays held-out game
``i``. The trainer evaluates on seeds from that offset, so evaluation never plays a training game.
Game ``k`` of a pool is generated with a TextWorld seed derived from ``(problem_seed, pool, k)``
(the same game on every machine with the same TextWorld version); a candidate whose content
(world, quest, entity names and goal text) equals a held-out game is rejected and the next seed
tried, so the pools are disjoint by content, not just by seed.

Generation runs in a child process (one TextWorld import for the whole pool) with a time limit
(``generation_timeout_s``); games are written one at a time (a file lock keeps concurrent workers
from generating the same pool twice), so an interrupted generation resumes where it stopped.

Actions. The policy's text is matched against the admissible commands, ignoring case, spacing,
surrounding punctuation and articles (:func:`match_command`): the whole reply, else its first line
that is a command, else the command mentioned earliest in the reply ("I take the key." is
``take key``). A reply that names no admissible command costs a turn: the game does not move, and
the next observation says the command was invalid and lists the admissible commands again.

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
(one lock; the calls are short). Needs the ``textworld`` package (``pip install -e '.[textworld]'``;
it brings spaCy and Jericho), which is an optional extra: without it the constructor raises an
``ImportError`` that says so.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from flashreinforce.envs.base import Environment, StepResult, resolve_max_turns

__all__ = ["DEFAULT_CACHE_DIR", "DEFAULT_COMMAND_PROMPT", "DEFAULT_INSTRUCTION", "HELDOUT_SEED_OFFSET", "INSTALL_HINT",
           "GameDistribution", "TextWorldEnv", "ensure_game_pool", "fill_pools", "generation_seed", "match_command",
           "require_textworld"]

#: Seeds from here on play the held-out pool (equal to the trainer's evaluation seed offset).
HELDOUT_SEED_OFFSET = 1_000_000_000

DEFAULT_CACHE_DIR = "~/.cache/flashreinforce/textworld"
INSTALL_HINT = "pip install -e '.[textworld]' (or pip install textworld)"

DEFAULT_INSTRUCTION = "You are playing a text adventure game."
DEFAULT_COMMAND_PROMPT = "Which command do you choose? Reply with the command only."

log = logging.getLogger(__name__)

# Bumped when the layout of the cache or the way games are drawn changes, so old pools are not reused.
_POOL_FORMAT = 1
# Candidate seeds tried for one pool slot before giving up (a rejected candidate: no quest could be
# generated, or the game equals a held-out one).
_MAX_ATTEMPTS = 50


def require_textworld() -> None:
    """Raise ``ImportError`` naming the extra to install when ``textworld`` is not importable."""
    if importlib.util.find_spec("textworld") is None:
        raise ImportError(f"the textworld environment needs the 'textworld' package: {INSTALL_HINT}")


# ---------------------------------------------------------------------------------------------- games
def _length_range(value: Any) -> tuple[int, int]:
    if isinstance(value, int) and not isinstance(value, bool):
        lo = hi = value
    elif (isinstance(value, (list, tuple)) and len(value) == 2
          and all(isinstance(x, int) and not isinstance(x, bool) for x in value)):
        lo, hi = value
    else:
        raise ValueError(f"quest_length must be an integer or a [min, max] pair of integers, got {value!r}")
    if not 1 <= lo <= hi <= 20:
        raise ValueError(f"quest_length must lie within 1..20 with min <= max, got {value!r}")
    return int(lo), int(hi)


def _positive_int(name: str, value: Any, *, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class GameDistribution:
    """What the generated games look like (TextWorld's ``tw-make custom`` settings).

    world_size: rooms per game. nb_objects: objects at least (TextWorld adds those the quest needs).
    quest_length: commands the quest needs, ``n`` or ``(min, max)``. theme: TextWorld text grammar
    (``house``). problem_seed: seeds both pools (the run's ``--seed`` does not change the games).
    heldout_games: size of the held-out pool (part of the distribution: the training games are
    drawn to avoid it).
    """

    world_size: int = 1
    nb_objects: int = 3
    quest_length: tuple[int, int] = (1, 2)
    theme: str = "house"
    problem_seed: int = 0
    heldout_games: int = 32

    def __post_init__(self) -> None:
        _positive_int("world_size", self.world_size)
        _positive_int("nb_objects", self.nb_objects, minimum=0)
        object.__setattr__(self, "quest_length", _length_range(
            tuple(self.quest_length) if isinstance(self.quest_length, list) else self.quest_length))
        if not isinstance(self.theme, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", self.theme):
            raise ValueError(f"theme must be a TextWorld grammar name such as 'house', got {self.theme!r}")
        _positive_int("problem_seed", self.problem_seed, minimum=0)
        _positive_int("heldout_games", self.heldout_games)

    def key(self, textworld_version: str) -> str:
        """Name of this distribution's cache subdirectory (readable settings plus a hash of all of them)."""
        blob = json.dumps({**asdict(self), "textworld": textworld_version, "format": _POOL_FORMAT}, sort_keys=True)
        lo, hi = self.quest_length
        return (f"r{self.world_size}-o{self.nb_objects}-q{lo}-{hi}-{self.theme}-s{self.problem_seed}-"
                f"h{self.heldout_games}-{hashlib.sha256(blob.encode()).hexdigest()[:10]}")


def generation_seed(pool: str, problem_seed: int, index: int, attempt: int) -> int:
    """TextWorld seed of candidate ``attempt`` for game ``index`` of ``pool`` (``train``/``heldout``)."""
    digest = hashlib.sha256(f"textworld:{pool}:{problem_seed}:{index}:{attempt}".encode()).digest()
    return int.from_bytes(digest[:4], "little") % 2**31


def fill_pools(dist: GameDistribution, train_games: int, existing: dict[tuple[str, int], str], generate) -> None:
    """Generate the missing games of both pools, held-out first, in slot order.

    existing: ``{(pool, index): content signature}`` of the games already on disk.
    generate: ``generate(pool, index, seed) -> signature or None`` builds one candidate (None: no
    quest could be made with ``seed``); ``generate.keep(pool, index, seed)`` is then called for the
    candidate that fills the slot. A held-out candidate must differ from the earlier held-out games,
    a training candidate from every held-out game.
    """
    heldout: set[str] = set()
    for pool, count in (("heldout", dist.heldout_games), ("train", train_games)):
        for index in range(count):
            signature = existing.get((pool, index))
            if signature is None:
                for attempt in range(_MAX_ATTEMPTS):
                    seed = generation_seed(pool, dist.problem_seed, index, attempt)
                    candidate = generate(pool, index, seed)
                    if candidate is not None and candidate not in heldout:
                        generate.keep(pool, index, seed)
                        signature = candidate
                        break
                else:
                    raise RuntimeError(f"no {pool} game {index} after {_MAX_ATTEMPTS} candidate seeds (every one "
                                       f"failed to make a quest or repeated a held-out game): relax the settings "
                                       f"{asdict(dist)}")
            if pool == "heldout":
                heldout.add(signature)


def _game_paths(directory: Path, pool: str, index: int) -> tuple[Path, Path, Path]:
    stem = directory / pool / f"{index:04d}"
    return stem.with_suffix(".z8"), stem.with_suffix(".json"), stem.with_suffix(".meta.json")


def _existing_games(directory: Path, dist: GameDistribution, train_games: int) -> dict[tuple[str, int], str]:
    found = {}
    for pool, count in (("heldout", dist.heldout_games), ("train", train_games)):
        for index in range(count):
            z8, game_json, meta = _game_paths(directory, pool, index)
            if meta.is_file() and z8.is_file() and game_json.is_file():
                found[(pool, index)] = json.loads(meta.read_text())["signature"]
    return found


class _Generator:
    """Builds candidates with TextWorld in this (child) process and moves the kept ones into place."""

    def __init__(self, directory: Path, dist: GameDistribution, scratch: Path) -> None:
        import textworld
        from textworld.generator import QuestGenerationError

        self.textworld, self.QuestGenerationError = textworld, QuestGenerationError
        self.directory, self.dist, self.scratch = directory, dist, scratch
        self.candidate: dict[str, Any] | None = None

    def __call__(self, pool: str, index: int, seed: int) -> str | None:
        tw = self.textworld
        options = tw.GameOptions()
        options.seeds = seed
        options.nb_rooms = self.dist.world_size
        options.nb_objects = self.dist.nb_objects
        lo, hi = self.dist.quest_length
        options.chaining.min_length, options.chaining.max_length, options.chaining.max_depth = lo, hi, hi
        options.grammar.theme = self.dist.theme
        options.path = str(self.scratch / "game.z8")
        options.force_recompile = True
        try:
            game_file, game = tw.make(options)
        except self.QuestGenerationError:
            return None
        data = json.loads(Path(game_file).with_suffix(".json").read_text())
        # The content of the game, not its name: two seeds giving the same world, quest and text are one game.
        content = json.dumps({k: data.get(k) for k in ("world", "quests", "infos", "objective")}, sort_keys=True)
        signature = hashlib.sha256(content.encode()).hexdigest()
        self.candidate = {"file": game_file, "seed": seed, "signature": signature,
                          "walkthrough": list(game.metadata.get("walkthrough") or [])}
        return signature

    def keep(self, pool: str, index: int, seed: int) -> None:
        cand = self.candidate
        assert cand is not None and cand["seed"] == seed
        z8, game_json, meta = _game_paths(self.directory, pool, index)
        z8.parent.mkdir(parents=True, exist_ok=True)
        os.replace(cand["file"], z8)
        os.replace(Path(cand["file"]).with_suffix(".json"), game_json)
        tmp = meta.with_suffix(".tmp")
        tmp.write_text(json.dumps({"generation_seed": seed, "signature": cand["signature"],
                                   "walkthrough": cand["walkthrough"]}))
        os.replace(tmp, meta)  # the meta file last: a game counts as present only when it is complete
        print(f"textworld: {pool} game {index} (seed {seed})", file=sys.stderr, flush=True)


def _generate_in_child(request: dict[str, Any]) -> None:
    """Entry point of the generation child (``python -m flashreinforce.envs.textworld_env``)."""
    directory = Path(request["directory"])
    spec = request["distribution"]
    dist = GameDistribution(**{**spec, "quest_length": tuple(spec["quest_length"])})
    with tempfile.TemporaryDirectory(prefix="tw-gen-", dir=directory) as scratch:
        generator = _Generator(directory, dist, Path(scratch))
        fill_pools(dist, request["train_games"], _existing_games(directory, dist, request["train_games"]), generator)


def _textworld_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("textworld")
    except PackageNotFoundError:
        return "unknown"


_pool_lock = threading.Lock()
_ready_pools: set[tuple[str, int]] = set()

# TextWorld is not thread-safe: loading a game parses its logic with one module-global TatSu parser,
# and two threads loading at once corrupt each other (TypeError, IndexError, parse errors). Rollout
# workers and the evaluator run environments in several threads, so every call into TextWorld holds
# this lock. The calls are short (tens of milliseconds); the model's generation dominates a turn.
_textworld_lock = threading.RLock()


@contextlib.contextmanager
def _file_lock(path: Path):
    import fcntl

    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_game_pool(dist: GameDistribution, train_games: int, cache_dir: str | os.PathLike | None = None,
                     timeout_s: float | None = None) -> Path:
    """The directory holding both pools of ``dist`` (``heldout/NNNN.z8``, ``train/NNNN.z8``, each with
    TextWorld's ``.json`` and a ``.meta.json``), generating the missing games first.

    timeout_s: limit of the generation child (default 60 s plus 30 s per missing game); on timeout the
    child is killed and ``TimeoutError`` names ``generation_timeout_s``. The games finished before
    stay, so a second call continues.
    """
    require_textworld()
    _positive_int("train_games", train_games)
    root = Path(os.path.expanduser(os.fspath(cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR)))
    directory = (root / dist.key(_textworld_version())).resolve()
    memo = (str(directory), train_games)
    with _pool_lock:
        if memo in _ready_pools:
            return directory
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise OSError(f"cache_dir {str(root)!r}: cannot create the game directory {directory}: {err}") from None
        with _file_lock(directory / ".lock"):
            missing = dist.heldout_games + train_games - len(_existing_games(directory, dist, train_games))
            if missing:
                log.warning("generating %d TextWorld games into %s (first use; about 3 s a game on a quiet CPU, "
                            "progress in generation.log there)", missing, directory)
                _run_generation_child(directory, dist, train_games, missing, timeout_s)
                missing = dist.heldout_games + train_games - len(_existing_games(directory, dist, train_games))
                if missing:
                    raise RuntimeError(f"TextWorld game generation into {directory} finished with {missing} games "
                                       "still missing")
        _ready_pools.add(memo)
    return directory


def _run_generation_child(directory: Path, dist: GameDistribution, train_games: int, missing: int,
                          timeout_s: float | None) -> None:
    if timeout_s is None:
        timeout_s = 60.0 + 30.0 * missing
    request = {"directory": str(directory), "distribution": asdict(dist), "train_games": train_games}
    env = dict(os.environ)
    # The child imports this module from the same source tree as the parent.
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = package_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log = directory / "generation.log"
    with open(log, "a") as err_fh:
        proc = subprocess.Popen([sys.executable, "-m", "flashreinforce.envs.textworld_env"], stdin=subprocess.PIPE,
                                stdout=err_fh, stderr=err_fh, env=env, start_new_session=True, text=True)
        try:
            proc.communicate(json.dumps(request), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise TimeoutError(f"TextWorld generated fewer than the {missing} missing games of {directory} within "
                               f"{timeout_s:.0f} s (generation_timeout_s); the games done so far are kept, so "
                               f"running again continues; log: {log}") from None
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-15:]
        raise RuntimeError(f"TextWorld game generation into {directory} failed (exit {proc.returncode}):\n"
                           + "\n".join(tail))


# -------------------------------------------------------------------------------------------- actions
_EDGE = " \t\r\n.,;:!?\"'`*()[]<>"
_PREFIX = re.compile(r"^(?:[-*>•]+|\d+[.)]|(?:command|action|answer)\s*:)\s*", re.IGNORECASE)


_ARTICLES = frozenset({"a", "an", "the"})


def _normalize(text: str) -> str:
    # Articles are dropped on both sides: "examine the board" is "examine board" (TextWorld's parser agrees).
    words = " ".join(text.lower().split()).strip(_EDGE).split(" ")
    return " ".join(w for w in words if w not in _ARTICLES)


def match_command(text: str, admissible: Sequence[str]) -> str | None:
    """The admissible command ``text`` gives, or None. Case, runs of spaces, surrounding punctuation and
    the articles ``a``, ``an``, ``the`` are ignored. Tried in order: the whole text; its first line that
    is a command (after a leading bullet, number, ``>`` or ``command:``); the command whose mention
    starts earliest in the text (whole words; the longest one when several start there). Returns the
    command as the game spells it."""
    by_norm = {}
    for command in admissible:
        by_norm.setdefault(_normalize(command), command)
    by_norm.pop("", None)
    whole = _normalize(text)
    if whole in by_norm:
        return by_norm[whole]
    for line in text.splitlines():
        line = _normalize(_PREFIX.sub("", line.strip()))
        if line in by_norm:
            return by_norm[line]
    best: tuple[int, int, str] | None = None
    for norm, command in by_norm.items():
        found = re.search(r"(?<![\w])" + re.escape(norm) + r"(?![\w])", whole)
        if found and (best is None or (found.start(), -len(norm)) < best[:2]):
            best = (found.start(), -len(norm), command)
    return best[2] if best else None


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


def _format_commands(commands: Sequence[str], command_prompt: str = "") -> str:
    text = "Admissible commands: " + (", ".join(commands) if commands else "(none)")
    return f"{text}\n\n{command_prompt}" if command_prompt else text


# -------------------------------------------------------------------------------------------- the env
class TextWorldEnv(Environment):
    """TextWorld games (see the module docstring for games, splits, actions, rewards and ``info``).

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
        self.max_observation_chars = _positive_int("max_observation_chars", max_observation_chars, minimum=20)
        self.max_open_games = _positive_int("max_open_games", max_open_games)
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
            _positive_int("train_games", train_games)
            self.pool_dir = ensure_game_pool(self.distribution, train_games, cache_dir, generation_timeout_s)
            self.train_files = [str(_game_paths(self.pool_dir, "train", k)[0]) for k in range(train_games)]
            self.heldout_files = [str(_game_paths(self.pool_dir, "heldout", k)[0]) for k in range(heldout_games)]
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
                 _format_commands(self.admissible_commands(), self.command_prompt)]
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
                    + _format_commands(self.admissible_commands(), self.command_prompt))
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
                + _format_commands(self.admissible_commands(), self.command_prompt))
        return StepResult(observation=text, reward=reward, done=False, failed=True)

    def close(self) -> None:
        while self._open:
            _, game = self._open.popitem()
            with contextlib.suppress(Exception), _textworld_lock:  # closing must not hide the run's own outcome
                game.close()
        self._game = None


if __name__ == "__main__":  # the generation child (see _run_generation_child)
    _generate_in_child(json.loads(sys.stdin.read()))
