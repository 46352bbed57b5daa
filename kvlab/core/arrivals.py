"""When requests arrive, and how long their prompts are when a trace says so.

``workload.arrival``: ``burst`` (every request at t = 0), ``poisson`` (exponential gaps at
``workload.rate`` requests per second, drawn from ``workload.seed``; ``workload.burstiness`` other than 1 draws
gamma gaps of that shape and the same mean, as vLLM's serving benchmark does: below 1 burstier, above 1 more
even) or ``trace`` (the times
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
from kvlab.core.bounds import Bound
from kvlab.core.errors import ConfigError, require

KINDS = ("burst", "poisson", "trace")
# workload.burstiness: from gaps nearly all 0 with a rare long one, to gaps within 0.1% of 1/rate
BURSTINESS = Bound(lo=1e-3, hi=1e6, why="1 a Poisson process, below 1 burstier, above 1 more even")
LONG_PROMPTS = ("clip", "refuse")
# the latest a request may arrive: a run waits for its arrivals in real time, and a wait past what the
# clock and the thread primitives can hold (about 292 years) dies of OverflowError in the ranks
MAX_ARRIVAL_S = 30 * 24 * 3600.0
_LATE = f"more than {MAX_ARRIVAL_S / 86400:g} days"


def _late(t: float) -> str:
    return f"{t:.3g} s" if math.isfinite(t) else "never"


def check(w) -> None:
    """The arrival fields of a workload spec (kvlab.model.spec.WorkloadSpec), one line per problem."""
    require(w.arrival in KINDS, "workload.arrival", w.arrival, "use burst, poisson or trace")
    require(isinstance(w.rate, (int, float)) and math.isfinite(w.rate) and w.rate > 0,
            "workload.rate", w.rate, "must be > 0 requests per second")
    require(isinstance(w.time_scale, (int, float)) and math.isfinite(w.time_scale) and w.time_scale > 0,
            "workload.time_scale", w.time_scale, "must be > 0 (1: real time, 0.1: ten times faster)")
    require(w.long_prompts in LONG_PROMPTS, "workload.long_prompts", w.long_prompts, "use clip or refuse")
    # the field's bound, for a spec built without the composed config's walk (kvlab.core.bounds.check_tree)
    require(isinstance(w.burstiness, (int, float)) and not isinstance(w.burstiness, bool)
            and math.isfinite(w.burstiness) and BURSTINESS.problem(w.burstiness) is None, "workload.burstiness",
            w.burstiness, BURSTINESS.hint())
    require(w.burstiness == 1.0 or w.arrival == "poisson", "workload.burstiness", w.burstiness,
            f"shapes the gaps of workload.arrival=poisson only (now {w.arrival}); set workload.arrival=poisson or "
            "leave it at 1")
    if w.arrival == "poisson":  # the mean gap alone: the drawn times are checked again where they are drawn
        span = (w.requests - 1) / w.rate * w.time_scale
        if not span <= MAX_ARRIVAL_S:
            field, value = ("workload.time_scale", w.time_scale) if (w.requests - 1) / w.rate <= MAX_ARRIVAL_S \
                else ("workload.rate", w.rate)
            raise ConfigError(field, value, f"{w.requests} requests at workload.rate={w.rate:g} a second (x "
                              f"workload.time_scale={w.time_scale:g}) arrive over {_late(span)}, {_LATE}; raise "
                              "workload.rate, lower workload.time_scale or workload.requests")
    if w.arrival == "trace":
        require(bool(w.trace), "workload.trace", w.trace,
                f"workload.arrival=trace needs a trace file; shipped: {', '.join(traces.shipped())}")
    else:
        require(w.trace is None, "workload.trace", w.trace,
                f"is read only with workload.arrival=trace (now {w.arrival}); set both or neither")


def times(w, n: int) -> list[float]:
    """Arrival times in seconds of ``n`` requests drawn by a distribution (burst, poisson with its burstiness) of
    workload ``w``."""
    if w.arrival == "burst":
        return [0.0] * n
    if w.arrival != "poisson":
        raise ValueError(f"{w.arrival} arrivals come from the trace: use from_trace")
    rng = random.Random(w.seed * 7919 + 1)  # apart from the prompt-length stream of the same seed
    # shape 1 is the exponential: its own draw keeps a Poisson run's times what they were before burstiness
    gap = (lambda: rng.expovariate(w.rate)) if w.burstiness == 1.0 else \
        (lambda: rng.gammavariate(w.burstiness, 1.0 / (w.rate * w.burstiness)))
    t, out = 0.0, []
    for _ in range(n):
        out.append(t * w.time_scale)
        t += gap()
    bursty = f", workload.burstiness={w.burstiness:g}" if w.burstiness != 1.0 else ""
    require(not out or out[-1] <= MAX_ARRIVAL_S, "workload.rate", w.rate,
            f"request {n - 1} would arrive after {_late(out[-1] if out else 0.0)} (x workload.time_scale="
            f"{w.time_scale:g}{bursty}), {_LATE}; raise workload.rate{' or workload.burstiness' if bursty else ''} "
            "or lower workload.time_scale")
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
        at = r.arrival_s * w.time_scale
        if not at <= MAX_ARRIVAL_S:
            field, value = ("workload.time_scale", w.time_scale) if r.arrival_s <= MAX_ARRIVAL_S else \
                ("workload.trace", w.trace)
            where = f"line {r.line}" if field == "workload.trace" else f"{w.trace} line {r.line}"
            raise ConfigError(field, value, f"{where}: arrives {_late(r.arrival_s)} after the first request (x "
                              f"workload.time_scale={w.time_scale:g}: {_late(at)}), {_LATE}; cap "
                              "workload.requests, lower workload.time_scale, or fix the trace's timestamps")
        out.append((at, min(r.input_tokens, limit)))
    return out
