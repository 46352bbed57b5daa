"""What the fuzzer draws: every leaf field of the config, read from the spec dataclasses themselves
(kvlab.core.bounds.fields), and for each a value from its type's edges.

A field added to any group is drawn the moment it exists: nothing here names a field. The values are the ones
that broke kvlab before (0, -1, the smallest and largest floats, NaN, inf, 2^63, empty and 10,000-character
texts, unicode, paths with spaces, a file where a directory is expected), rendered as Hydra overrides.
"""
from __future__ import annotations

import re
import shlex
import sys
from typing import Any

from hypothesis import strategies as st

from kvlab.config.schema import Setup
from kvlab.core import bounds
from kvlab.sim.cluster import ClusterSpec, SimSpec

INTS = [0, -1, 1, 2, 3, 7, 64, 2**31, 2**32, 2**63 - 1, 2**63, -(2**63) - 1, 10**30]
FLOATS = [0.0, -0.0, -1.0, 5e-324, 2.2250738585072014e-308, 1e-300, 1.7976931348623157e308,
          -1.7976931348623157e308, float("nan"), float("inf"), float("-inf"), 0.5, 1e12]
TEXTS = ["", "x" * 10_000, "ünïcödé ☃ 名前", "with spaces/and more", "/dev/null", "/", "..", "-1", "null?",
         "a'quote", 'a"dq']


def run_fields() -> list[tuple[str, Any, Any]]:
    """(dotted key, field, annotation) of every leaf of ``kvlab run``'s config (plan and link read the same)."""
    return [(k, f, tp) for k, f, tp in bounds.fields(Setup) if k not in ("extra",)]


def sim_fields() -> list[tuple[str, Any, Any]]:
    """``kvlab sim``'s: the run's, the cluster's and the sim keys."""
    return run_fields() + list(bounds.fields(ClusterSpec, "cluster.")) + list(bounds.fields(SimSpec, "sim."))


def scalar_edges(tp, paths: list[str]) -> st.SearchStrategy:
    if tp is bool:
        return st.sampled_from([True, False, 0, 2, "maybe"])
    if tp is int:
        return st.one_of(st.sampled_from(INTS), st.integers(-4, 4096))
    if tp is float:
        return st.one_of(st.sampled_from(FLOATS), st.floats(allow_nan=True, allow_infinity=True))
    if tp is str:
        return st.one_of(st.sampled_from(TEXTS + paths), st.text(max_size=40))
    return st.one_of(st.sampled_from([0, -1, "", "x" * 10_000, 5e-324, float("nan")]), st.sampled_from(paths or [""]))


def value_edges(tp, paths: list[str] = ()) -> st.SearchStrategy:
    """A value of annotation ``tp`` from its type's edges (None where the field is optional, lists where a list)."""
    scalar, optional, many = bounds.leaf_types(tp)
    if isinstance(scalar, type) and hasattr(scalar, "__members__"):  # an enum: its members and a stranger
        one = st.sampled_from([*(m.value for m in scalar), "", "x" * 10_000])
    else:
        one = scalar_edges(scalar, list(paths))
    out = st.lists(one, max_size=3) if many else one
    return st.one_of(st.none(), out) if optional or many else out


def render(value) -> str:
    """``value`` as Hydra's override grammar reads it back."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if value != value else ("inf" if value == float("inf") else
                                            "-inf" if value == float("-inf") else repr(value))
    if isinstance(value, int):
        return str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(render(v) for v in value) + "]"
    text = str(value)
    if re.fullmatch(r"[A-Za-z_][\w./-]*", text) and text not in ("null", "true", "false", "nan", "inf"):
        return text  # as a user types it
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def override(key: str, value) -> str:
    return f"{key}={render(value)}"


def command_line(command: str, overrides: list[str]) -> str:
    """The shell command that reproduces a draw."""
    return " ".join(shlex.quote(a) for a in [sys.executable, "-m", "kvlab", *command.split(), *overrides])
