"""When requests arrive, and how long their prompts are when a trace says so.

``workload.arrival``: ``burst`` (every request at t = 0), ``poisson`` (exponential gaps at
``workload.rate`` requests per second, drawn from ``workload.seed``) or ``trace`` (the times
and prompt lengths of ``workload.trace``, kvlab.core.traces). ``workload.time_scale`` multiplies
every arrival time: 0.1 replays a trace ten times faster. ``workload.requests`` caps the count.
A trace prompt longer than ``workload.isl_max`` (or than ``cache.capacity_tokens`` when set) is
clipped to it or refused, as ``workload.long_prompts`` says. Everything here is a pure function
of the config, so every rank derives the same timeline. The fields live in kvlab.model.spec.WorkloadSpec.
"""
from __future__ import annotations

import math
import random

from kvlab.core import traces
from kvlab.core.errors import ConfigError, require

KINDS = ("burst", "poisson", "trace")
LONG_PROMPTS = ("clip", "refuse")


def check(w) -> None:
    """The arrival fields of a workload spec (kvlab.model.spec.WorkloadSpec), one line per problem."""
    require(w.arrival in KINDS, "workload.arrival", w.arrival, "use burst, poisson or trace")
    require(isinstance(w.rate, (int, float)) and math.isfinite(w.rate) and w.rate > 0,
            "workload.rate", w.rate, "must be > 0 requests per second")
    require(isinstance(w.time_scale, (int, float)) and math.isfinite(w.time_scale) and w.time_scale > 0,
            "workload.time_scale", w.time_scale, "must be > 0 (1: real time, 0.1: ten times faster)")
    require(w.long_prompts in LONG_PROMPTS, "workload.long_prompts", w.long_prompts, "use clip or refuse")
    if w.arrival == "trace":
        require(bool(w.trace), "workload.trace", w.trace,
                f"workload.arrival=trace needs a trace file; shipped: {', '.join(traces.shipped())}")
    else:
        require(w.trace is None, "workload.trace", w.trace,
                f"is read only with workload.arrival=trace (now {w.arrival}); set both or neither")


def times(w, n: int) -> list[float]:
    """Arrival times in seconds of ``n`` requests drawn by a distribution (burst, poisson) of workload ``w``."""
    if w.arrival == "burst":
        return [0.0] * n
    if w.arrival != "poisson":
        raise ValueError(f"{w.arrival} arrivals come from the trace: use from_trace")
    rng = random.Random(w.seed * 7919 + 1)  # apart from the prompt-length stream of the same seed
    t, out = 0.0, []
    for _ in range(n):
        out.append(t * w.time_scale)
        t += rng.expovariate(w.rate)
    return out


def from_trace(w, limit: int, limit_field: str) -> list[tuple[float, int]]:
    """(arrival s, prompt tokens) of the first ``w.requests`` requests of ``w.trace``; prompts above
    ``limit`` are clipped or refused (``limit_field`` names the setting that sets the limit)."""
    out = []
    for r in traces.read(w.trace)[:w.requests]:
        require(r.input_tokens > 0, "workload.trace", w.trace, f"line {r.line}: a prompt of 0 tokens")
        if r.input_tokens > limit and w.long_prompts == "refuse":
            raise ConfigError("workload.trace", w.trace,
                              f"line {r.line}: a {r.input_tokens}-token prompt is longer than {limit_field}={limit}; "
                              f"raise {limit_field}, cap workload.requests, or set workload.long_prompts=clip")
        out.append((r.arrival_s * w.time_scale, min(r.input_tokens, limit)))
    return out
