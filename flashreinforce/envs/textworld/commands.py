"""What command a policy's reply gives: matching free text against the game's admissible commands.

The policy's text is matched against the admissible commands, ignoring case, spacing, surrounding
punctuation and articles (:func:`match_command`): the whole reply, else its first line that is a
command, else the command mentioned earliest in the reply ("I take the key." is ``take key``).
:func:`format_commands` is the list of admissible commands the policy is shown.
"""

from __future__ import annotations

import re
from typing import Sequence

__all__ = ["format_commands", "match_command"]

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


def format_commands(commands: Sequence[str], command_prompt: str = "") -> str:
    """``Admissible commands: a, b, c``, then ``command_prompt`` after a blank line when there is one."""
    text = "Admissible commands: " + (", ".join(commands) if commands else "(none)")
    return f"{text}\n\n{command_prompt}" if command_prompt else text
