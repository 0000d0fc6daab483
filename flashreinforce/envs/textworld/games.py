"""The TextWorld game pools: generation, caching and the training / held-out split.

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

Generation runs in a child process (one TextWorld import for the whole pool, ``python -m
flashreinforce.envs.textworld``) with a time limit (``generation_timeout_s``); games are written
one at a time (a file lock keeps concurrent workers from generating the same pool twice), so an
interrupted generation resumes where it stopped.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_CACHE_DIR", "HELDOUT_SEED_OFFSET", "INSTALL_HINT", "GameDistribution", "ensure_game_pool",
           "fill_pools", "game_paths", "generate_in_child", "generation_seed", "positive_int", "require_textworld"]

#: Seeds from here on play the held-out pool (equal to the trainer's evaluation seed offset).
HELDOUT_SEED_OFFSET = 1_000_000_000

DEFAULT_CACHE_DIR = "~/.cache/flashreinforce/textworld"
INSTALL_HINT = "pip install -e '.[textworld]' (or pip install textworld)"

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


def positive_int(name: str, value: Any, *, minimum: int = 1) -> int:
    """``value`` when it is an integer of at least ``minimum``; else ``ValueError`` naming ``name``."""
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
        positive_int("world_size", self.world_size)
        positive_int("nb_objects", self.nb_objects, minimum=0)
        object.__setattr__(self, "quest_length", _length_range(
            tuple(self.quest_length) if isinstance(self.quest_length, list) else self.quest_length))
        if not isinstance(self.theme, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", self.theme):
            raise ValueError(f"theme must be a TextWorld grammar name such as 'house', got {self.theme!r}")
        positive_int("problem_seed", self.problem_seed, minimum=0)
        positive_int("heldout_games", self.heldout_games)

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


def game_paths(directory: Path, pool: str, index: int) -> tuple[Path, Path, Path]:
    """The ``.z8`` game, TextWorld's ``.json`` and the ``.meta.json`` of game ``index`` of ``pool``."""
    stem = directory / pool / f"{index:04d}"
    return stem.with_suffix(".z8"), stem.with_suffix(".json"), stem.with_suffix(".meta.json")


def _existing_games(directory: Path, dist: GameDistribution, train_games: int) -> dict[tuple[str, int], str]:
    found = {}
    for pool, count in (("heldout", dist.heldout_games), ("train", train_games)):
        for index in range(count):
            z8, game_json, meta = game_paths(directory, pool, index)
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
        z8, game_json, meta = game_paths(self.directory, pool, index)
        z8.parent.mkdir(parents=True, exist_ok=True)
        os.replace(cand["file"], z8)
        os.replace(Path(cand["file"]).with_suffix(".json"), game_json)
        tmp = meta.with_suffix(".tmp")
        tmp.write_text(json.dumps({"generation_seed": seed, "signature": cand["signature"],
                                   "walkthrough": cand["walkthrough"]}))
        os.replace(tmp, meta)  # the meta file last: a game counts as present only when it is complete
        print(f"textworld: {pool} game {index} (seed {seed})", file=sys.stderr, flush=True)


def generate_in_child(request: dict[str, Any]) -> None:
    """Entry point of the generation child (``python -m flashreinforce.envs.textworld``)."""
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
    positive_int("train_games", train_games)
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
    package_root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = package_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log = directory / "generation.log"
    with open(log, "a") as err_fh:
        proc = subprocess.Popen([sys.executable, "-m", "flashreinforce.envs.textworld"], stdin=subprocess.PIPE,
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

