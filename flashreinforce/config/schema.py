"""How a configuration field describes its flag: one declaration gives the Python field, the
command-line flag and the config-file key, with one help text, one type and one set of bounds.

A section is a dataclass whose fields are made with :func:`option` (a value) or :func:`section` (a
nested section). The dotted path of a field is its flag's name: ``TrainerConfig.actor.adam.lr`` is
``--actor.adam.lr`` and ``actor: {adam: {lr: ...}}`` (or ``actor.adam.lr: ...``) in a config file.
The one exception is :data:`FLAG_SPELLINGS`: a few flags keep the spelling of the published
launchers (Molt's) while their field, and every name after it, says what the value is
(``--train.micro_batch_size`` is ``TrainerConfig.train.micro_batch_trajectories``). :func:`flag_table` walks the
sections into :class:`Flag` rows (the flag's name and its field's path); :func:`check_value` checks
one value against its row (kind, choices, bounds) and returns it normalized.

A validated configuration is frozen for its run (:func:`freeze`): every section and the config
itself are :class:`Freezable`, so assigning a field raises :class:`FrozenConfigError`, and its lists
and dicts become read-only (:class:`FrozenList`, :class:`FrozenDict`; equal to, and instances of,
``list`` and ``dict``). :func:`thaw` undoes it on a copy that is to be changed and validated again.

Kinds: ``float`` (``inf`` allowed), ``int``, ``str``, ``bool``, ``float2`` (two floats), ``json`` (any
JSON value); ``nullable`` fields also take ``None`` (``none`` on the command line).

Bounds on the values a configuration holds: a config file of a few lines can stand for billions of
values (YAML aliases of aliases), nest deeper than the interpreter recurses, or refer to itself; a
value given from Python can do the same. :func:`value_problem` finds each of these without expanding
anything (it stops at the bound), so that the file is refused with one line before anything copies,
prints or writes the value. :func:`shown` is a value as messages print it: one line of at most a few
hundred characters, whatever the value.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any, Callable

__all__ = ["FIELD_FLAGS", "FLAG_SPELLINGS", "INT_LIMIT", "MAX_DEPTH", "MAX_VALUES", "RETIRED_FLAGS", "KINDS",
           "ConfigError", "Flag", "Freezable", "with_fields", "FrozenConfigError", "FrozenDict", "FrozenList",
           "check_value", "flag_table", "freeze", "get_path", "option", "section", "set_path", "shown", "thaw",
           "thawed", "value_problem"]

#: Kinds of flag values.
KINDS = ("float", "int", "str", "bool", "float2", "json")
#: Integer flags are bounded (a count beyond this is a typo, not a plan).
INT_LIMIT = 2**31 - 1
#: The flags that keep a published launcher's spelling -> the field that holds the value (the only
#: place the two names differ; past the flag, code, settings and records of the field use its name).
FLAG_SPELLINGS = {
    "rollout.vllm_generate_batch_size": "rollout.episodes_per_call",     # episodes sampled together (any engine)
    "train.micro_batch_size": "train.micro_batch_trajectories",          # trajectories per learner micro-batch
    "fsdp.packing_samples": "fsdp.packed_forward",                       # one packed row per micro-batch
}
#: The field path -> its flag's name, for the fields of :data:`FLAG_SPELLINGS`.
FIELD_FLAGS = {attribute: flag for flag, attribute in FLAG_SPELLINGS.items()}
#: Flags of the published launchers that this trainer does not have (no field, no effect) -> what to use
#: instead. A published command line or an older run's config file that gives one is accepted with a
#: warning saying so (recorded under ``inactive``); nothing stores the value.
RETIRED_FLAGS = {
    "rollout.micro_batch_size": "Molt's rollout forward micro-batch; there is no rollout forward pass here (behavior "
                                "log-probs come from the sampler). The learner's micro-batch is "
                                "--train.micro_batch_size (or --train.micro_batch_tokens)",
}


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


class ConfigError(ValueError):
    """A flag value the native trainer refuses (the message names the flag)."""


@dataclass(frozen=True)
class Flag:
    """One flag: its dotted name, kind, default, help, and what values it takes.

    choices: the allowed values (a tuple, or a function giving them, for names that live in a
    registry). minimum/maximum: numeric bounds (``above``: the minimum itself is excluded).
    nullable: ``None`` allowed. no_effect: why the flag never changes anything on this runtime (the
    value is recorded as inactive with this reason). objects: a ``str`` flag that also takes a Python
    object set from Python (a dataset given as rows or a ``datasets.Dataset``). field: the field's
    path when it differs from the flag's name (:data:`FLAG_SPELLINGS`; read :attr:`attribute`).
    """

    name: str
    type: str
    default: Any
    help: str
    choices: tuple | Callable[[], tuple] | None = None
    minimum: float | None = None
    maximum: float | None = None
    above: bool = False
    nullable: bool = False
    no_effect: str | None = None
    objects: bool = False
    field: str = ""

    @property
    def attribute(self) -> str:
        """The dotted path of the field that holds the value (the flag's name but for :data:`FLAG_SPELLINGS`)."""
        return self.field or self.name

    def allowed(self) -> tuple | None:
        """The allowed values, asked of the registry when the choices are a function."""
        return self.choices() if callable(self.choices) else self.choices


def option(kind: str, default: Any, help: str, *, choices: tuple | Callable[[], tuple] | None = None,
           minimum: float | None = None, maximum: float | None = None, above: bool = False,
           nullable: bool | None = None, no_effect: str | None = None, objects: bool = False) -> Any:
    """A configuration field (see :class:`Flag`); ``nullable`` defaults to ``default is None``."""
    if kind not in KINDS:
        raise TypeError(f"option: unknown kind {kind!r}")
    meta = {"flag": dict(type=kind, default=default, help=help, choices=choices, minimum=minimum, maximum=maximum,
                         above=above, nullable=default is None if nullable is None else nullable,
                         no_effect=no_effect, objects=objects)}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def with_fields(rows, *, after: str | None = None) -> Callable[[type], type]:
    """Class decorator (under ``@dataclass``): add an :func:`option` field per row ``(attribute, kind,
    default, help, choices)``, placed after the field ``after`` (default: last). A section whose fields are
    defined elsewhere (the loss options, :func:`flashreinforce.objective.config_fields`) takes them this way."""

    def add(cls: type) -> type:
        own = dict(cls.__dict__.get("__annotations__", {}))
        added = {}
        for attribute, kind, default, help, choices in rows:
            if attribute in own:
                raise TypeError(f"{cls.__name__}.{attribute} is defined twice")
            added[attribute] = "Any"
            setattr(cls, attribute, option(kind, default, help, choices=choices))
        keys = list(own)
        at = keys.index(after) + 1 if after is not None else len(keys)
        cls.__annotations__ = {**{k: own[k] for k in keys[:at]}, **added, **{k: own[k] for k in keys[at:]}}
        return cls

    return add


def section(cls: type, help: str = "") -> Any:
    """A nested section field (its own dataclass)."""
    return field(default_factory=cls, metadata={"section": help})


def flag_table(root: type, prefix: str = "") -> tuple[Flag, ...]:
    """Every option under the dataclass ``root``, as :class:`Flag` rows named by their dotted path
    (the published spelling for the fields of :data:`FLAG_SPELLINGS`)."""
    rows: list[Flag] = []
    for f in dataclasses.fields(root):
        name = f"{prefix}{f.name}"
        if "section" in f.metadata:
            rows.extend(flag_table(f.default_factory, f"{name}."))
        elif "flag" in f.metadata:
            flag = FIELD_FLAGS.get(name)
            rows.append(Flag(name=flag or name, **f.metadata["flag"], field=name if flag else ""))
    return tuple(rows)


def get_path(obj: Any, name: str) -> Any:
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def set_path(obj: Any, name: str, value: Any) -> None:
    *parents, last = name.split(".")
    for part in parents:
        obj = getattr(obj, part)
    setattr(obj, last, value)


def _number(flag: Flag, value: Any, integer: bool) -> int | float:
    what = "an integer" if integer else "a number"
    if isinstance(value, str):  # a config file's "1e-5", "inf"
        try:
            value = int(value) if integer else float(value)
        except ValueError:
            raise ConfigError(f"--{flag.name} must be {what}, got {shown(value)}") from None
    if isinstance(value, bool) or not isinstance(value, Integral if integer else Real):
        if integer and isinstance(value, float) and value.is_integer() and abs(value) <= INT_LIMIT:
            return int(value)
        raise ConfigError(f"--{flag.name} must be {what}, got {shown(value)}")
    return int(value) if integer else float(value)


def _span(low: float | None, high: float | None, above: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if above else '['}{low:g}, {high:g}]"
    if low is not None:
        return f"{'>' if above else '>='} {low:g}"
    return f"<= {high:g}"


def _bounds(flag: Flag, value: float) -> None:
    low, high = flag.minimum, flag.maximum
    if flag.type == "int":  # integers are bounded even where the flag states no bound
        if value > (INT_LIMIT if high is None else high):
            raise ConfigError(f"--{flag.name} must be {_span(low, INT_LIMIT if high is None else high, False)}, "
                              f"got {value:g}")
        if low is None and value < -INT_LIMIT:
            raise ConfigError(f"--{flag.name} must be >= {-INT_LIMIT}, got {value:g}")
    if low is None and high is None:
        return
    if isinstance(value, float) and math.isnan(value):
        raise ConfigError(f"--{flag.name} must be a number, got nan")
    too_low = low is not None and (value <= low if flag.above else value < low)
    if too_low or (high is not None and value > high):
        positive = (low == 1 and flag.type == "int") or (low == 0 and flag.above)
        if positive and high is None:
            raise ConfigError(f"--{flag.name} must be positive, got {value:g}")
        raise ConfigError(f"--{flag.name} must be {_span(low, high, flag.above)}, got {value:g}")


def check_value(flag: Flag, value: Any) -> Any:
    """``value`` checked against ``flag`` and normalized (numbers to int/float, pairs to tuples).

    Raises :class:`ConfigError` naming the flag.
    """
    if value is None:
        if flag.nullable:
            return None
        raise ConfigError(f"--{flag.name} needs a value (it cannot be none)")
    kind = flag.type
    if kind in ("float", "int"):
        value = _number(flag, value, kind == "int")
        _bounds(flag, value)
    elif kind == "bool":
        if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0", "yes", "no", "on", "off"):
            value = value.strip().lower() in ("true", "1", "yes", "on")
        if not isinstance(value, bool):
            raise ConfigError(f"--{flag.name} must be true or false, got {shown(value)}")
    elif kind == "str":
        if flag.objects and not isinstance(value, (str, bytes, int, float, bool)):
            return value  # set from Python: rows or a dataset object, read by the environment
        if not isinstance(value, str):
            raise ConfigError(f"--{flag.name} must be a string, got {shown(value)}")
    elif kind == "float2":
        if isinstance(value, str) or not hasattr(value, "__len__") or len(value) != 2:
            raise ConfigError(f"--{flag.name} takes two numbers, got {shown(value)}")
        value = tuple(_number(flag, x, False) for x in value)
        for x in value:
            _bounds(flag, x)
    allowed = flag.allowed()
    if allowed is not None and value not in allowed:
        raise ConfigError(f"--{flag.name} must be one of {', '.join(map(str, allowed))}; got {shown(value)}")
    return value


# ---------------------------------------------------------------------- freezing
_FROZEN_HINT = ("the configuration was validated and is frozen for its run: change a copy (cfg.copy() is "
                "unfrozen) and validate that")


class FrozenConfigError(AttributeError):
    """A change to a frozen configuration (its message names the field and the way out)."""


class Freezable:
    """Base of the configuration's dataclasses: once :func:`freeze` has run, setting or deleting an
    attribute raises :class:`FrozenConfigError`."""

    _frozen = False

    @property
    def frozen(self) -> bool:
        """Whether :func:`freeze` has run on this object."""
        return self._frozen

    def __setattr__(self, name: str, value: Any) -> None:
        if self._frozen:
            raise FrozenConfigError(f"cannot set {type(self).__name__}.{name}: {_FROZEN_HINT}")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self._frozen:
            raise FrozenConfigError(f"cannot delete {type(self).__name__}.{name}: {_FROZEN_HINT}")
        object.__delattr__(self, name)


def _refuse(self, *args: Any, **kwargs: Any) -> Any:
    raise FrozenConfigError(f"cannot change a {type(self).__name__} of the configuration: {_FROZEN_HINT}")


class FrozenDict(dict):
    """A read-only ``dict`` inside a frozen configuration (pickles and deep-copies as itself)."""

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self) -> tuple:
        return FrozenDict, (dict(self),)


class FrozenList(list):
    """A read-only ``list`` inside a frozen configuration (pickles and deep-copies as itself)."""

    __setitem__ = __delitem__ = __iadd__ = __imul__ = append = clear = extend = insert = pop = remove = _refuse
    reverse = sort = _refuse

    def __reduce__(self) -> tuple:
        return FrozenList, (list(self),)


def _frozen_value(value: Any) -> Any:
    if type(value) is dict:
        return FrozenDict({k: _frozen_value(v) for k, v in value.items()})
    if type(value) is list:
        return FrozenList(_frozen_value(v) for v in value)
    return value


def thawed(value: Any) -> Any:
    """``value`` with every :class:`FrozenDict` and :class:`FrozenList` in it (recursively, through
    plain dicts, lists and tuples) a plain ``dict`` and ``list`` again; other objects as they are."""
    if isinstance(value, dict) and type(value) in (dict, FrozenDict):
        return {k: thawed(v) for k, v in value.items()}
    if isinstance(value, list) and type(value) in (list, FrozenList):
        return [thawed(v) for v in value]
    if type(value) is tuple:
        return tuple(thawed(v) for v in value)
    return value


def _mark(obj: Freezable, frozen: bool) -> None:
    """Set ``obj``'s sections frozen or not, recursively, converting its other values' containers."""
    convert = _frozen_value if frozen else thawed
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, Freezable):
            _mark(value, frozen)
        else:
            object.__setattr__(obj, f.name, convert(value))
    object.__setattr__(obj, "_frozen", frozen)


def freeze(obj: Freezable) -> None:
    """Freeze the dataclass ``obj`` and its nested sections in place (see the module docstring)."""
    _mark(obj, True)


def thaw(obj: Freezable) -> None:
    """Undo :func:`freeze` on ``obj`` in place (use it on a copy: a running trainer relies on its
    configuration staying as validated)."""
    _mark(obj, False)
