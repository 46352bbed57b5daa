"""The serving timeline of each request, from every rank's part, and its percentiles.

Times are seconds from the run's start (the clock epoch every rank shares, kvlab.clock):

- ``arrival_s``; ``queue_s``: waiting for its ctx DP group (arrival to prefill start);
- ``prefill_start_s``, ``prefill_end_s``, ``prefill_s``: the prefill on the ctx ranks (to the last
  layer written); with ``prefill=gpu`` also ``prefill_alone_s``, the same prefill with nothing else
  on the GPU (measured before the run), and ``prefill_slowdown``, their ratio;
- ``first_chunk_s``: its first chunk posted by a ctx rank; ``last_chunk_s``: its last chunk
  landed on the last gen rank that needs it (before that rank verifies it: decode would start here);
- ``slot_wait_s``: host time its chunks waited for a free staging slot, summed over its ranks;
- ``transfer_s``: first chunk to last chunk; ``exposed_s``: transfer left after the prefill's end;
- ``ttft_s``: arrival to the cache complete on every gen rank that needs it, the part of the
  time to first token that prefill and transfer make (the first decode step is not run).
"""
from __future__ import annotations

import math

FIELDS = ("ttft_s", "exposed_s", "queue_s", "transfer_s", "slot_wait_s", "prefill_slowdown")
QUANTILES = (50, 90, 99)


def request_timeline(ctx: list[dict], gen: list[dict]) -> dict:
    """One request's row fields from its ctx and gen parts (kvlab.metrics.resolve)."""
    out = dict.fromkeys(("arrival_s", "queue_s", "prefill_start_s", "prefill_end_s", "prefill_s", "first_chunk_s",
                         "last_chunk_s", "slot_wait_s", "transfer_s", "exposed_s", "ttft_s"))
    ctx = [p for p in ctx if p.arrival is not None]
    if not ctx:
        return out
    epoch = min(p.epoch for p in ctx)
    arrival = min(p.arrival for p in ctx)
    start = min(p.prefill_start for p in ctx)
    ends = [p.prefill_end for p in ctx if p.prefill_end is not None]
    posts = [p.first_post for p in ctx if p.first_post is not None]
    out.update(arrival_s=arrival - epoch, queue_s=start - arrival, prefill_start_s=start - epoch,
               slot_wait_s=sum(p.slot_wait for p in ctx + gen))
    done = len(ends) == len(ctx)
    if done:
        out["prefill_end_s"] = max(ends) - epoch
        out["prefill_s"] = max(ends) - start
        alone = [p.prefill_alone_s for p in ctx if p.prefill_alone_s]
        if alone:  # prefill=gpu: the same prefill with nothing else on the GPU, measured before the run
            out["prefill_alone_s"] = max(alone)
            out["prefill_slowdown"] = out["prefill_s"] / max(alone)
    if posts:
        out["first_chunk_s"] = min(posts) - epoch
    landed = [p.end for p in gen]
    if gen and all(x is not None for x in landed) and all(p.chunks == p.chunks_total for p in gen):
        last = max(landed)
        out.update(last_chunk_s=last - epoch, ttft_s=last - arrival)
        if posts:
            out["transfer_s"] = last - min(posts)
        if done:
            out["exposed_s"] = max(0.0, last - max(ends))
    return out


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def percentiles(rows: list[dict]) -> dict:
    """p50/p90/p99 of each timeline field over the verified requests that have it."""
    out = {}
    for f in FIELDS:
        xs = [getattr(r, f) for r in rows if r.verified and getattr(r, f) is not None]
        if xs:
            out[f] = {f"p{q}": percentile(xs, q) for q in QUANTILES} | {"mean": sum(xs) / len(xs), "n": len(xs)}
    return out


def summary_line(stats: dict) -> str:
    """One line for the terminal: p50 / p90 / p99, in ms (the slowdown as a ratio)."""
    names = {"ttft_s": "TTFT", "exposed_s": "exposed transfer", "queue_s": "prefill queue",
             "transfer_s": "transfer", "slot_wait_s": "slot wait", "prefill_slowdown": "prefill slowdown x"}
    parts = []
    for f in FIELDS:
        if f in stats:
            scale, fmt = (1.0, "{:.3f}") if f == "prefill_slowdown" else (1e3, "{:,.1f}")
            parts.append(names[f] + " " + " / ".join(fmt.format(stats[f][f"p{q}"] * scale) for q in QUANTILES))
    return "ms p50 / p90 / p99: " + "; ".join(parts) if parts else ""
