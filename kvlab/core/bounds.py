"""Bounds stated on a spec's fields, and the one walk that enforces them on a composed config.

A group's ``__post_init__`` knows what its values mean together; a field's bound says what one value may
be at all, so that no value reaches ``int()``, ``torch.manual_seed``, an allocation or a sleep that it
would break there. Each field of a config dataclass is bounded by its type (an integer fits int64, a
number is finite, a text fits a path and holds no NUL) and may state more in its metadata with
``bounded(default, lo=..., hi=...)``: the range, a zero that means "off", the allowed values, a path that
must be a readable file. ``check_tree`` walks a spec type's fields from the dataclass itself (nested
specs, optional values, lists) against the composed values, so a field added to any group is checked
the moment it exists, and the first value out of bounds raises ``ConfigError`` naming the field, the
value and what would work, before anything is allocated.
"""
from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass
from enum import Enum
from typing import Any

from kvlab.core.errors import ConfigError

INT64 = (-(2**63), 2**63 - 1)  # torch's and numpy's integers: a Python int beyond them overflows deep inside
MAX_TEXT = 4096  # PATH_MAX: a longer text is no path any system call takes
KEY = "kvlab_bound"  # the metadata key of a field's Bound


@dataclass(frozen=True)
class Bound:
    """What one value may be beyond its type: ``lo <= v <= hi``, or exactly 0 with ``zero`` (0: off), or one
    of ``choices``; ``path="file"``: an existing readable file. ``why`` says what the limit protects, and
    ``unit`` names the value's unit in the hint."""

    lo: float | None = None
    hi: float | None = None
    zero: bool = False
    choices: tuple = ()
    path: str = ""
    unit: str = ""
    why: str = ""

    def problem(self, value) -> str | None:
        """What is wrong with ``value`` (a number or text of the right type), or None."""
        if self.choices:
            return None if value in self.choices else f"use one of {', '.join(map(str, self.choices))}"
        if self.path == "file" and isinstance(value, str):
            if not os.path.isfile(value):
                return "must be an existing file" + (" (it is a directory)" if os.path.isdir(value) else "")
            if not os.access(value, os.R_OK):
                return "must be a file this user can read"
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return None
        if self.zero and value == 0:
            return None
        if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            return self.hint()
        return None

    def hint(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        if self.lo is not None and self.hi is not None:
            text = f"must be in [{_num(self.lo)}, {_num(self.hi)}]{unit}"
        elif self.lo is not None:
            text = f"must be >= {_num(self.lo)}{unit}"
        else:
            text = f"must be <= {_num(self.hi)}{unit}"
        return text + (" or 0 (off)" if self.zero else "") + (f" ({self.why})" if self.why else "")


def _num(x) -> str:
    if isinstance(x, int) and abs(x) >= 2**20 and x & (x - 1) == 0:
        return f"{x} (2^{x.bit_length() - 1})"
    return f"{x:g}" if isinstance(x, float) else str(x)


def bounded(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING, **bound) -> Any:
    """A dataclass field with its ``Bound`` in the metadata: ``x: int = bounded(8, lo=1, hi=4096)``."""
    meta = {KEY: Bound(**bound)}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def bound_of(f: dataclasses.Field) -> Bound | None:
    return f.metadata.get(KEY)


def leaf_types(tp) -> tuple[type, bool, bool]:
    """(scalar type, whether None is allowed, whether it is a list of them) of a field's annotation."""
    args = typing.get_args(tp)
    optional = type(None) in args
    if optional:
        rest = [a for a in args if a is not type(None)]
        tp = rest[0] if len(rest) == 1 else Any
        args = typing.get_args(tp)
    if typing.get_origin(tp) in (tuple, list):
        return (args[0] if args else Any), optional, True
    return tp, optional, False


def type_problem(tp, value) -> str | None:
    """What is wrong with ``value`` for a scalar field of type ``tp`` whatever its bound, or None."""
    if value is None or tp is Any or tp is bool:
        return None
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        if not INT64[0] <= value <= INT64[1]:
            return "must fit a 64-bit integer; use one in [-2^63, 2^63-1]"
    elif tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            return "must be a finite number"
    elif tp is str and isinstance(value, str):
        if len(value) > MAX_TEXT:
            return f"is {len(value)} characters long; use at most {MAX_TEXT}"
        if "\x00" in value:
            return "holds a NUL character; no name or path can"
    return None


def _shown(value) -> str:
    text = str(value)
    return text if len(text) <= 80 else f"{text[:40]}...({len(text)} characters)"


def check_value(name: str, f: dataclasses.Field, tp, value) -> None:
    """ConfigError for ``value`` of field ``f`` (annotation ``tp``) out of its type's range or its bound."""
    scalar, _, many = leaf_types(tp)
    if isinstance(scalar, type) and issubclass(scalar, Enum):
        return  # the schema's enum already admits only its members
    values = list(value) if many and isinstance(value, (list, tuple)) else [value]
    bound = bound_of(f)
    for i, v in enumerate(values):
        where = f"{name}[{i}]" if many and isinstance(value, (list, tuple)) else name
        problem = (bound.problem(v) if bound is not None and v is not None else None) or type_problem(scalar, v)
        if problem:
            raise ConfigError(where, _shown(v), problem)


def fields(spec: type, prefix: str = ""):
    """(dotted name, field, annotation) of every leaf of ``spec``, nested specs walked; read from the
    dataclasses, so a field added anywhere is listed without being named here."""
    hints = typing.get_type_hints(spec)
    for f in dataclasses.fields(spec):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from fields(tp, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, tp


def check_tree(spec: type, values, prefix: str = "", skip: tuple[str, ...] = ()) -> None:
    """Every field of ``spec`` (and of the specs it nests) present in ``values`` (plain dicts, as composed)
    within its type's range and its bound; ConfigError for the first that is not."""
    if not isinstance(values, dict):
        return
    hints = typing.get_type_hints(spec)
    for f in dataclasses.fields(spec):
        if f.name not in values or f"{prefix}{f.name}" in skip:
            continue
        tp, v = hints[f.name], values[f.name]
        if dataclasses.is_dataclass(tp):
            check_tree(tp, v, f"{prefix}{f.name}.", skip)
        else:
            check_value(f"{prefix}{f.name}", f, tp, v)
