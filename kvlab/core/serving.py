"""The serving report: SLOs, the percentiles a user asks for, and how the terminal shows them.

The figures themselves (arrival, queue, prefill, first and last chunk, slot wait, transfer,
exposed transfer, TTFT, prefill slowdown; and for the run: duration, completed and failed
requests, request throughput, goodput, SLO attainment) are entries of kvlab.core.figures.TABLE, which
says what each means and how a request's parts and the run make it. Here: the ``serving`` config
group's spec (``ServingSpec``: ``serving.slo.ttft_ms``, ``serving.percentiles``), the percentiles,
mean and standard deviation of every figure with a ``line`` (``Summary.serving``), and the
report the terminal prints. A figure absent from every verified request (``slot_wait_s`` without
staging slots, ``prefill_slowdown`` without ``prefill=gpu``) is left out, not shown as zero.

No decode step runs (the gen ranks verify the cache in its place), so kvlab has no time per
output token: ``serving.slo.tpot_ms`` is refused, naming why, rather than read as met.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvlab.core import figures
from kvlab.core.errors import ConfigError, require

QUANTILES = (50.0, 90.0, 99.0)  # serving.percentiles' default: what vLLM's benchmark reports


@dataclass(frozen=True)
class SloSpec:
    """Service-level objectives a request must meet to count towards goodput (vLLM's ``--goodput``)."""

    ttft_ms: float | None = None  # TTFT at most this (ms): arrival to the cache complete on its gen ranks
    tpot_ms: float | None = None  # refused: no decode step runs, so there is no time per output token

    def __post_init__(self):
        if self.ttft_ms is not None:
            require(isinstance(self.ttft_ms, (int, float)) and math.isfinite(self.ttft_ms) and self.ttft_ms > 0,
                    "serving.slo.ttft_ms", self.ttft_ms, "must be a time > 0 in ms, or null for no TTFT SLO")
        if self.tpot_ms is not None:
            raise ConfigError("serving.slo.tpot_ms", self.tpot_ms,
                              "kvlab runs no decode step (the gen ranks verify the cache in its place), so there is "
                              "no time per output token to hold to an SLO; use serving.slo.ttft_ms")

    @property
    def active(self) -> bool:
        return self.ttft_ms is not None

    def met(self, ttft_s: float | None, verified: bool) -> bool | None:
        """Whether one request met every SLO set (None: no SLO set). A failed request meets none."""
        if not self.active:
            return None
        return bool(verified) and ttft_s is not None and ttft_s * 1e3 <= self.ttft_ms

    def describe(self) -> str:
        return f"TTFT <= {self.ttft_ms:g} ms" if self.active else "no SLO"


@dataclass(frozen=True)
class ServingSpec:
    """The ``serving`` group: which SLOs a request must meet and which percentiles the report gives."""

    slo: SloSpec = field(default_factory=SloSpec)
    percentiles: tuple[float, ...] = QUANTILES  # of every serving figure, in the summary and the terminal

    def __post_init__(self):
        qs = tuple(self.percentiles)
        require(len(qs) > 0 and all(isinstance(q, (int, float)) and not isinstance(q, bool) and 0 <= q <= 100
                                    for q in qs), "serving.percentiles", list(qs),
                "must be a non-empty list of percentiles in [0, 100], e.g. [50,90,99]")
        object.__setattr__(self, "percentiles", tuple(float(q) for q in qs))


def key(q: float) -> str:
    """The key of percentile ``q`` in ``Summary.serving``: p50, p99.9."""
    return f"p{q:g}"


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats(xs: list[float], quantiles=QUANTILES) -> dict:
    """The requested percentiles, mean, standard deviation (over the values themselves, numpy's default, as
    vLLM's benchmark reports it) and count of ``xs``."""
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
    return {key(q): percentile(xs, q) for q in quantiles} | {"mean": mean, "std": std, "n": len(xs)}


def percentiles(rows: list, quantiles=QUANTILES) -> dict:
    """Percentiles, mean, std and count of each summary-line figure over the verified requests that have it."""
    out = {}
    for f in figures.line_figures():
        xs = [getattr(r, f.name) for r in rows if r.verified and getattr(r, f.name, None) is not None]
        if xs:
            out[f.name] = stats(xs, quantiles)
    return out


def _quantiles(stats: dict) -> list[str]:
    """The percentile keys present in ``Summary.serving`` (p50, p90, ...), in ascending order."""
    keys = {k for s in stats.values() for k in s if k.startswith("p")}
    return sorted(keys, key=lambda k: float(k[1:]))


def summary_line(stats: dict) -> str:
    """One line for the terminal: the percentiles of each figure present, durations in ms."""
    qs = _quantiles(stats)
    parts = [f.line + " " + " / ".join(f.show(stats[f.name][q]) for q in qs)
             for f in figures.line_figures() if f.name in stats]
    return f"ms {' / '.join(qs)}: " + "; ".join(parts) if parts else ""


def report_lines(summary) -> list[str]:
    """The run-level serving figures as vLLM's benchmark prints them, one per line: requests completed and
    failed, duration, request throughput and, with an SLO set, goodput and attainment (a Summary's fields:
    kvlab.core.figures)."""
    def show(name: str) -> str:
        f = figures.BY_NAME[name]
        return f.show(getattr(summary, f.summary_name, None)) or "-"

    out = [f"requests: {summary.completed} completed, {summary.failed} failed; duration {show('duration_s')} ms; "
           f"request throughput {show('request_throughput')} req/s"]
    slo = getattr(summary, "slo", None) or {}
    if slo.get("ttft_ms") is not None:
        out.append(f"goodput {show('goodput')} req/s under TTFT <= {slo['ttft_ms']:g} ms: {summary.good_requests} "
                   f"of {summary.requests} requests met it (attainment {show('slo_attainment')})")
    return out


def table(stats: dict):
    """A rich table of every serving figure present: mean, std and the percentiles, in the terminal's units."""
    from rich.table import Table

    qs = _quantiles(stats)
    t = Table(title="serving figures over the verified requests")
    for col in ("figure", "unit", "n", "mean", "std", *qs):
        t.add_column(col, justify="left" if col == "figure" else "right")
    for f in figures.line_figures():
        if f.name not in stats:
            continue
        s = stats[f.name]
        unit = figures.DISPLAY[f.unit][2]
        t.add_row(f.line, unit, str(s.get("n", "")), f.show(s.get("mean")),
                  f.show(s["std"]) if "std" in s else "", *(f.show(s.get(q)) for q in qs))
    return t
