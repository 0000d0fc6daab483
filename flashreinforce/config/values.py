"""Bounds on the values a configuration holds, and how a message shows a value.

A config file of a few lines can stand for billions of values (YAML aliases of aliases), nest
deeper than the interpreter recurses, or refer to itself; a value given from Python can do the
same. :func:`value_problem` finds each of these without expanding anything (it stops at the
bound), so that the file is refused with one line before anything copies, prints or writes the
value. :func:`shown` is a value as messages print it: one line of at most a few hundred
characters, whatever the value.
"""

from __future__ import annotations

import reprlib
from typing import Any

__all__ = ["MAX_DEPTH", "MAX_VALUES", "shown", "value_problem"]

#: The deepest nesting of lists and mappings a setting may have.
MAX_DEPTH = 32
#: The most values (every list item, mapping key and value, counted once per place it appears) a
#: configuration may hold.
MAX_VALUES = 100_000

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxtuple, _REPR.maxset = 3, 8, 8, 8, 8
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 200, 80, 40  # a path in a message stays whole


def shown(value: Any, limit: int = 240) -> str:
    """``repr(value)`` for a message: one line, long strings, deep and long containers shortened."""
    try:
        text = _REPR.repr(value)
    except Exception:  # a broken __repr__ of a user's object
        text = f"<{type(value).__name__}>"
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def value_problem(value: Any, *, max_depth: int = MAX_DEPTH, max_values: int = MAX_VALUES) -> str | None:
    """What puts ``value`` (plain data: mappings, lists, tuples, scalars) out of bounds, or None.

    Counts the values as a reader would see them expanded (a list that appears twice counts twice)
    but stops at ``max_values``; a container inside itself is refused (it has no expansion).
    """
    count = 0
    # (container, depth, the ids of the containers above it and itself)
    stack: list[tuple[Any, int, frozenset]] = [(value, 0, frozenset())]
    while stack:
        item, depth, above = stack.pop()
        count += 1
        if count > max_values:
            return f"more than {max_values} values once YAML aliases are expanded (an alias counts what it repeats)"
        if isinstance(item, dict):
            children = [x for pair in item.items() for x in pair]
        elif isinstance(item, (list, tuple)):
            children = list(item)
        else:
            continue
        if id(item) in above:
            return "a value that contains itself (a YAML alias inside its own anchor)"
        if depth + 1 > max_depth:
            return f"values nested deeper than {max_depth} levels"
        inner = above | {id(item)}
        stack.extend((child, depth + 1, inner) for child in children)
    return None
