"""TextWorld text games, generated offline from a seed, as a multi-turn environment.

TextWorld (the engine ALFWorld is built on) generates small interactive-fiction games: rooms,
containers, keys, doors and a quest ("take the cloak from the safe, then drop it in the cellar").
:class:`TextWorldEnv` plays such games with the policy, one command per turn.

Modules: ``games`` (the game pools: generation in a child process, the cache, the training and
held-out splits), ``commands`` (which admissible command a reply gives), ``env`` (the
Environment: prompt, turns, rewards, ``info``); ``python -m flashreinforce.envs.textworld`` is the
generation child.

Needs the ``textworld`` package (``pip install -e '.[textworld]'``; it brings spaCy and Jericho),
which is an optional extra: without it the constructor raises an ``ImportError`` that says so.
"""

from flashreinforce.envs.textworld.commands import match_command
from flashreinforce.envs.textworld.env import DEFAULT_COMMAND_PROMPT, DEFAULT_INSTRUCTION, TextWorldEnv
from flashreinforce.envs.textworld.games import (DEFAULT_CACHE_DIR, HELDOUT_SEED_OFFSET, INSTALL_HINT, GameDistribution,
                                                 ensure_game_pool, fill_pools, generation_seed, require_textworld)

__all__ = ["DEFAULT_CACHE_DIR", "DEFAULT_COMMAND_PROMPT", "DEFAULT_INSTRUCTION", "HELDOUT_SEED_OFFSET", "INSTALL_HINT",
           "GameDistribution", "TextWorldEnv", "ensure_game_pool", "fill_pools", "generation_seed", "match_command",
           "require_textworld"]
