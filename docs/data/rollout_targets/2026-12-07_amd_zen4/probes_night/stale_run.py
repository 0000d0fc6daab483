"""Experiment: the hf engine's turn cache kept across weight versions (not cleared at a weight change)."""
import os, sys
from flashreinforce.engines.hf import turn_cache as TC
def check_weights(self, key):
    if key != self._weights:
        self._weights = key
        self.version_changes = getattr(self, "version_changes", 0) + 1
TC.TurnCache.check_weights = check_weights
from flashreinforce.cli import console
sys.argv[0] = "flashreinforce"
console()
