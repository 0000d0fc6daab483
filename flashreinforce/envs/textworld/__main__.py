"""The TextWorld generation child: reads its request (JSON) on stdin and fills the pools it names.

Started by :func:`~flashreinforce.envs.textworld.games.ensure_game_pool`, not by hand.
"""

import json
import sys

from flashreinforce.envs.textworld.games import generate_in_child

generate_in_child(json.loads(sys.stdin.read()))
