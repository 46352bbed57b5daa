"""Percentiles of the serving figures and the terminal's summary line.

The figures themselves (arrival, queue, prefill, first and last chunk, slot wait, transfer,
exposed transfer, TTFT, prefill slowdown) are entries of kvlab.figures.TABLE, which says what
each means and how a request's parts make it; those with a ``line`` get p50/p90/p99 here, in
``Summary.serving`` and in the summary line, in table order. A figure absent from every verified
request (``slot_wait_s`` without staging slots, ``prefill_slowdown`` without ``prefill=gpu``) is
left out, not shown as zero.
"""
from __future__ import annotations

import math

from kvlab import figures

QUANTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def percentiles(rows: list) -> dict:
    """p50/p90/p99, mean and count of each summary-line figure over the verified requests that have it."""
    out = {}
    for f in figures.line_figures():
        xs = [getattr(r, f.name) for r in rows if r.verified and getattr(r, f.name, None) is not None]
        if xs:
            out[f.name] = {f"p{q}": percentile(xs, q) for q in QUANTILES} | {"mean": sum(xs) / len(xs), "n": len(xs)}
    return out


def summary_line(stats: dict) -> str:
    """One line for the terminal: p50 / p90 / p99 of each figure present, durations in ms."""
    parts = [f.line + " " + " / ".join(f.show(stats[f.name][f"p{q}"]) for q in QUANTILES)
             for f in figures.line_figures() if f.name in stats]
    return "ms p50 / p90 / p99: " + "; ".join(parts) if parts else ""
