"""Readers for public request traces: arrival time and prompt length of each request.

Two formats, told apart by the file's suffix: the Mooncake trace (``.jsonl``: one JSON object
a line with ``timestamp`` in ms, ``input_length``, ``output_length``) and the Azure LLM
inference trace (``.csv``: ``TIMESTAMP,ContextTokens,GeneratedTokens`` with wall-clock
timestamps). Arrivals count in seconds from the first request. A relative path is looked up
in the working directory, then among the samples shipped in ``traces/`` (their README names
the sources and licenses). A Mooncake row's ``hash_ids`` (one id per 512-token block of the prompt,
equal ids meaning an equal prefix) are kept for prefix reuse on the decode side (kvlab.model.prefix).
Anything that cannot be read stops with one line naming the file and, for a bad row, its line
number.
"""
from __future__ import annotations

import csv
import datetime
import functools
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from kvlab.core import paths
from kvlab.core.errors import ConfigError

FIELD = "workload.trace"
FORMATS = "a Mooncake .jsonl (timestamp, input_length, output_length) or an Azure .csv " \
          "(TIMESTAMP,ContextTokens,GeneratedTokens)"
AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # seconds after the trace's first request
    input_tokens: int
    output_tokens: int
    line: int  # line of the file it came from, for messages
    hash_ids: tuple[int, ...] | None = None  # Mooncake: one id per 512-token block of the prompt; None: not given


def shipped() -> list[str]:
    return sorted(p.name for p in paths.TRACES_DIR.glob("*") if p.suffix in (".jsonl", ".csv"))


def resolve(path: str) -> Path:
    p = Path(path).expanduser()
    if p.is_file():
        return p
    if not p.is_absolute() and (paths.TRACES_DIR / p).is_file():
        return paths.TRACES_DIR / p
    raise ConfigError(FIELD, path, f"no such file; give a path to {FORMATS}, or a shipped sample: "
                                   f"{', '.join(shipped())}")


def _bad(path: str, line: int, what: str) -> ConfigError:
    return ConfigError(FIELD, path, f"line {line}: {what}; expected {FORMATS}")


def _count(path: str, line: int, name: str, value) -> int:
    # ASCII digits only: str.isdigit() also takes superscripts and other scripts' digits, which int() refuses
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise _bad(path, line, f"{name}={value!r} is not a token count >= 0")


def _mooncake(path: str, text: str) -> list[TraceRequest]:
    out = []
    for n, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except json.JSONDecodeError as e:
            raise _bad(path, n, f"not JSON ({e.msg})") from None
        except RecursionError:  # nesting deeper than the parser's stack
            raise _bad(path, n, "not a trace row (JSON nested too deep)") from None
        if not isinstance(row, dict) or not {"timestamp", "input_length"} <= set(row):
            raise _bad(path, n, "needs the keys timestamp and input_length")
        ts = row["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
            raise _bad(path, n, f"timestamp={ts!r} is not a finite time >= 0 in ms")
        ids = row.get("hash_ids")
        if ids is not None and (not isinstance(ids, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids)):
            raise _bad(path, n, f"hash_ids={ids!r} is not a list of block ids >= 0")
        out.append(TraceRequest(ts / 1e3, _count(path, n, "input_length", row["input_length"]),
                                _count(path, n, "output_length", row.get("output_length", 0)), n,
                                None if ids is None else tuple(ids)))
    return out


def _wall(path: str, line: int, value: str) -> float:
    # seven fractional digits (as Azure writes them) are more than datetime parses: split them off
    head, _, frac = value.strip().partition(".")
    try:
        t = datetime.datetime.strptime(head, "%Y-%m-%d %H:%M:%S").replace(tzinfo=datetime.timezone.utc)
        return t.timestamp() + (float("0." + frac) if frac else 0.0)
    except ValueError:
        raise _bad(path, line, f"TIMESTAMP={value!r} is not 'YYYY-MM-DD HH:MM:SS[.fraction]'") from None


def _azure(path: str, text: str) -> list[TraceRequest]:
    lines = text.splitlines()
    header = tuple(h.strip() for h in next(csv.reader(lines[:1]), []))
    if header[:3] != AZURE_HEADER:
        raise _bad(path, 1, f"header {','.join(header)!r} is not {','.join(AZURE_HEADER)}")
    out = []
    for n, row in enumerate(csv.reader(lines[1:]), start=2):
        if not row or not "".join(row).strip():
            continue
        if len(row) < 3:
            raise _bad(path, n, f"{len(row)} fields, not 3")
        out.append(TraceRequest(_wall(path, n, row[0]), _count(path, n, "ContextTokens", row[1]),
                                _count(path, n, "GeneratedTokens", row[2]), n))
    t0 = min((r.arrival_s for r in out), default=0.0)
    return [replace(r, arrival_s=r.arrival_s - t0) for r in out]


@functools.lru_cache(maxsize=8)
def read(path: str) -> tuple[TraceRequest, ...]:
    """Every request of the trace at ``path``, in arrival order (stable for equal times)."""
    p = resolve(path)
    if p.suffix not in (".jsonl", ".csv"):
        raise ConfigError(FIELD, path, f"unknown format {p.suffix!r}; give {FORMATS}")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(FIELD, path, f"cannot be read ({e}); give {FORMATS}") from None
    rows = _mooncake(path, text) if p.suffix == ".jsonl" else _azure(path, text)
    if not rows:
        raise ConfigError(FIELD, path, f"holds no requests; give {FORMATS}")
    return tuple(sorted(rows, key=lambda r: r.arrival_s))
