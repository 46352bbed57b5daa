"""What ``kvlab sim`` reports: one table of figures (``TABLE``, entries of ``kvlab.core.figures.Figure`` as the run's
table has them), the summary they make and the terminal's view of it.

A per-request figure (``request`` set: its value from an ``Outcome`` for every request at once) is reduced
to ``sim.percentiles`` with mean and count, over the requests that have it; a fleet figure (``run``) is one
number. Units and display as in kvlab.core.figures.DISPLAY.
"""
from __future__ import annotations

import math

import numpy as np

from kvlab.core.figures import DISPLAY, Figure
from kvlab.sim.cluster import SloSpec
from kvlab.sim.engine import Outcome


def _met(o: Outcome, slo: SloSpec) -> np.ndarray:
    ok = np.ones(len(o.ttft), dtype=bool)
    if slo.ttft_ms is not None:
        ok &= o.ttft * 1e3 <= slo.ttft_ms
    if slo.tpot_ms is not None:
        ok &= ~(o.tpot * 1e3 > slo.tpot_ms)  # nan (no output token) meets it
    return ok


def _span(o: Outcome) -> float:
    return float(np.nanmax(o.finish) - np.min(o.arrival)) if len(o.arrival) else 0.0


def _util(o: Outcome, kind: str) -> float | None:
    if kind not in o.link_busy or not o.link_gpus.get(kind):
        return None
    return o.link_busy[kind] / (o.link_gpus[kind] * _span(o)) if _span(o) else None


TABLE: tuple[Figure, ...] = (
    Figure("ttft_s", "s", "Arrival to the cache complete on the request's gen GPUs.", "queue + prefill + exposed",
           request=lambda o: o.ttft, line="TTFT"),
    Figure("tpot_s", "s", "Time per output token: the request's decode span over its output tokens.",
           "(last token - transfer end) / osl", request=lambda o: o.tpot, line="TPOT"),
    Figure("exposed_s", "s", "Transfer left after the prefill's end: what the transfer adds to TTFT (admission and "
           "link waits included).", "transfer end - prefill end", request=lambda o: o.exposed, line="exposed transfer"),
    Figure("queue_s", "s", "Wait for a prefill server.", "prefill start - arrival", request=lambda o: o.queue,
           line="prefill queue"),
    Figure("prefill_s", "s", "The prefill, calibrated (kvlab.core.sim_terms.PrefillTerms).", "scale * model + bytes * "
           "byte_ns + fixed", request=lambda o: o.prefill, line="prefill"),
    Figure("admit_wait_s", "s", "Wait for room on a gen DP group (KV tokens, batch) once the cache could move.",
           "admitted - ready", request=lambda o: o.admit_wait, line="admission wait"),
    Figure("transfer_s", "s", "The transfer: its links all free to its last byte landed.", "end - start",
           request=lambda o: o.transfer, line="transfer"),
    Figure("requests", "count", "Requests simulated.", "count", run=lambda o, slo: len(o.ttft)),
    Figure("duration_s", "s", "First arrival to the last token.", "max finish - min arrival",
           run=lambda o, slo: _span(o)),
    Figure("request_throughput", "req/s", "Requests per second of the span.", "requests / duration_s",
           run=lambda o, slo: len(o.ttft) / _span(o) if _span(o) else None),
    Figure("good_requests", "count", "Requests meeting every SLO set (sim.slo).", "count",
           run=lambda o, slo: int(_met(o, slo).sum())),
    Figure("goodput", "req/s", "Requests meeting every SLO per second of the span.", "good_requests / duration_s",
           run=lambda o, slo: float(_met(o, slo).sum()) / _span(o) if _span(o) else None),
    Figure("slo_attainment", "x", "Share of requests meeting every SLO.", "good_requests / requests",
           run=lambda o, slo: float(_met(o, slo).mean()) if len(o.ttft) else None),
    Figure("nic_util", "x", "Share of the span the GPUs' NICs carried bytes.", "NIC busy GPU-s / (GPUs * span)",
           run=lambda o, slo: _util(o, "nic")),
    Figure("nvlink_util", "x", "Share of the span the GPUs' NVLink ports carried bytes.", "as nic_util",
           run=lambda o, slo: _util(o, "nvlink")),
    Figure("prefill_util", "x", "Share of the span the prefill servers computed.", "prefill s / (servers * span)",
           run=lambda o, slo: o.prefill_busy / (o.servers[0] * _span(o)) if _span(o) else None),
    Figure("decode_util", "x", "Share of the span the decode groups had a batch.", "busy s / (groups * span)",
           run=lambda o, slo: o.decode_busy / (o.servers[1] * _span(o)) if _span(o) else None),
    Figure("total_bytes", "B", "Cache bytes moved.", "sum over requests", run=lambda o, slo: float(o.bytes.sum())),
    Figure("events", "count", "Events the loop handled.", "count", run=lambda o, slo: o.events),
    Figure("events_per_s", "count", "Events per second of wall time, the loop alone.", "events / wall_s",
           run=lambda o, slo: int(o.events / o.wall_s) if o.wall_s else None),
    Figure("wall_s", "s", "Wall time of the event loop and its precomputation (the plan table apart).", "measured",
           run=lambda o, slo: o.wall_s),
)
BY_NAME = {f.name: f for f in TABLE}


def stats(x: np.ndarray, qs) -> dict:
    x = np.asarray(x, dtype=float)
    x = x[np.isfinite(x)]
    if not len(x):
        return {"n": 0}
    out = {f"p{q:g}": float(np.percentile(x, q)) for q in qs}
    return {**out, "mean": float(x.mean()), "n": int(len(x))}


def summarize(o: Outcome, slo: SloSpec, qs) -> dict:
    out = {}
    for f in TABLE:
        if f.request is not None:
            out[f.name] = stats(f.request(o), qs)
        else:
            v = f.run(o, slo)
            out[f.name] = None if v is None or isinstance(v, float) and not math.isfinite(v) else v
    return out


def rows(o: Outcome, slo: SloSpec) -> list[dict]:
    met = _met(o, slo)
    cols = {f.name: f.request(o) for f in TABLE if f.request is not None}
    out = []
    for i in range(len(o.ttft)):
        r = {"request": i, "arrival_s": float(o.arrival[i]), "isl": int(o.isl[i]), "osl": int(o.osl[i]),
             "bytes": float(o.bytes[i]), "slo_met": bool(met[i])}
        r.update({k: (None if not math.isfinite(v[i]) else float(v[i])) for k, v in cols.items()})
        out.append(r)
    return out


def lines(summary: dict, qs) -> list[str]:
    """The terminal's view: one line per request figure (ms), then the fleet's."""
    head = "figure".ljust(18) + "".join(f"{'p' + format(q, 'g'):>10}" for q in qs) + f"{'mean':>10}"
    out = [head + "   (ms)"]
    for f in TABLE:
        if f.request is None:
            continue
        s = summary[f.name]
        if not s.get("n"):
            continue
        out.append((f.line or f.name).ljust(18) + "".join(f"{s[f'p{q:g}'] * 1e3:>10,.1f}" for q in qs)
                   + f"{s['mean'] * 1e3:>10,.1f}")
    fleet = []
    for f in TABLE:
        if f.request is None and summary.get(f.name) is not None:
            unit = DISPLAY[f.unit][2]
            # a figure in seconds shows in ms: its name loses the _s that would say otherwise (duration 7.7 ms)
            name = f.name.removesuffix("_s") if unit == "ms" else f.name
            fleet.append(f"{name} {f.show(summary[f.name])}" + (f" {unit}" if unit and unit != "x" else ""))
    out.append("; ".join(fleet))
    return out
