"""The TextWorld environment under its registered name: the names of :mod:`flashreinforce.envs.textworld`.

The environment registry, the ``textworld`` preset and scripts name this module; the code is in
the ``textworld`` package (``games``, ``commands``, ``env``).
"""

from flashreinforce.envs.textworld import (DEFAULT_CACHE_DIR, DEFAULT_COMMAND_PROMPT, DEFAULT_INSTRUCTION,
                                           HELDOUT_SEED_OFFSET, INSTALL_HINT, GameDistribution, TextWorldEnv,
                                           ensure_game_pool, fill_pools, generation_seed, match_command,
                                           require_textworld)

__all__ = ["DEFAULT_CACHE_DIR", "DEFAULT_COMMAND_PROMPT", "DEFAULT_INSTRUCTION", "HELDOUT_SEED_OFFSET", "INSTALL_HINT",
           "GameDistribution", "TextWorldEnv", "ensure_game_pool", "fill_pools", "generation_seed", "match_command",
           "require_textworld"]
