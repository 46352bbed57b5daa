"""The highest arrival rate a setup serves within an SLO, from a rate sweep with repeats.

Per run, the SLO attainment is the share of its requests that met the SLO (a request that failed met
none): the ``slo_met`` figure of kvlab.core.figures, recomputed from each request's row for the SLO asked
(``ttft_ms``), or the one each run was run with (``serving.slo.ttft_ms``, in its summary). A setup
meets the SLO at a rate when the attainment there is at least ``target`` (0.9: nine requests in ten
within it, as DistServe and vLLM's goodput count it). Its capacity in one repeat is the highest rate
swept at which it meets the SLO and meets it at every lower rate swept too (a lucky point beyond a
failing one does not count); NaN when even the lowest rate misses. Over the repeats: the median and
range of the repeats that met it somewhere, and each repeat's value (NaN shown as "none").

An answer says its limits: where the highest rate swept still meets the SLO, the capacity is only known to
be at least that (``at_least``, printed ">= 32 req/s"); where no rate does, the lowest rate's attainment and
TTFT p90 say by how much it missed (``lowest_rate``, ``lowest_attainment``, ``lowest_ttft_p90_ms``).
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd

from kvlab.analysis.spread import REPEAT_AXES, point_columns
from kvlab.core import figures, serving

RATE = "workload.rate"


def attainment(results: pd.DataFrame, ttft_ms: float) -> float:
    """The share of one run's requests (its rows of results.jsonl) that met a TTFT SLO of ``ttft_ms``."""
    if results.empty:
        return np.nan
    met = figures.BY_NAME["slo_met"].request
    slo = serving.SloSpec(ttft_ms=float(ttft_ms))
    hits = [met(SimpleNamespace(ttft_s=None if pd.isna(t) else float(t), verified=bool(v), slo=slo))
            for t, v in zip(results["ttft_s"], results["verified"])]
    return sum(hits) / len(hits)


def _slo_of(run: pd.Series, ttft_ms: float | None) -> float:
    if ttft_ms is not None:
        return float(ttft_ms)
    value = run.get("slo.ttft_ms")
    if value is None or pd.isna(value):
        raise ValueError(f"{run.get('run_dir')}: the run had no serving.slo.ttft_ms; pass ttft_ms=")
    return float(value)


def per_run(runs: pd.DataFrame, results: pd.DataFrame, ttft_ms: float | None = None) -> pd.DataFrame:
    """``runs`` with ``slo_ttft_ms`` and ``attainment`` (NaN for a run that left no requests)."""
    out = runs.copy()
    by_dir = dict(tuple(results.groupby("run_dir"))) if not results.empty else {}
    out["slo_ttft_ms"] = [_slo_of(r, ttft_ms) for _, r in runs.iterrows()]
    out["attainment"] = [attainment(by_dir.get(r["run_dir"], pd.DataFrame()), r["slo_ttft_ms"])
                         for _, r in out.iterrows()]
    return out


def capacity(rates: list[float], attained: list[float], target: float) -> float:
    """The highest of ``rates`` meeting ``target`` there and at every lower rate; NaN when the lowest misses."""
    best = np.nan
    for rate, a in sorted(zip(rates, attained)):
        if not (a >= target):  # NaN (nothing served) misses too
            break
        best = rate
    return best


def _ttft_p90_ms(results: pd.DataFrame) -> float:
    t = results["ttft_s"].dropna() if not results.empty else pd.Series(dtype=float)
    return float(t.quantile(0.9) * 1e3) if len(t) else np.nan


def max_rate(runs: pd.DataFrame, results: pd.DataFrame, ttft_ms: float | None = None, target: float = 0.9,
             x: str = RATE, by: list[str] | None = None, repeats=REPEAT_AXES) -> pd.DataFrame:
    """One row per setup (``by``: by default ``strategy`` and every other swept column but ``x``, the
    repeats and ``transfer``, which ``strategy`` names): the highest ``x`` meeting the SLO, its median over
    the repeats (``max_rate``), range (``max_rate_min``, ``max_rate_max``), each repeat's (``per_repeat``),
    how many repeats (``repeats``), the SLO and the target."""
    if not 0 < target <= 1:
        raise ValueError(f"target={target}: an attainment in (0, 1], e.g. 0.9")
    if x not in runs:
        raise KeyError(f"{x}: no such column; sweep the rate (e.g. {RATE}) or pass x=")
    if by is None:
        by = ["strategy", *point_columns(runs, exclude=(x, "transfer"), repeats=repeats)]
    d = per_run(runs, results, ttft_ms)
    reps = [c for c in repeats if c in d]
    by_dir = dict(tuple(results.groupby("run_dir"))) if not results.empty else {}
    rows = []
    for key, g in d.groupby(by, dropna=False, sort=True):
        per = [capacity(list(h[x].astype(float)), list(h["attainment"]), target)
               for _, h in (g.groupby(reps) if reps else [(None, g)])]
        v = pd.Series(per, dtype=float).dropna()
        top, low = float(g[x].astype(float).max()), float(g[x].astype(float).min())
        lowest = g[g[x].astype(float) == low]
        low_rows = [by_dir[r] for r in lowest["run_dir"] if r in by_dir]
        rows.append({**dict(zip(by, key if isinstance(key, tuple) else (key,))),
                     "max_rate": float(v.median()) if len(v) else np.nan,
                     "max_rate_min": float(v.min()) if len(v) else np.nan,
                     "max_rate_max": float(v.max()) if len(v) else np.nan,
                     "per_repeat": per, "repeats": len(per),
                     # the median repeat met the SLO at the highest rate swept: the capacity lies at or above it
                     "at_least": bool(len(v)) and float(v.median()) >= top, "highest_rate": top,
                     "lowest_rate": low, "lowest_attainment": float(lowest["attainment"].mean()),
                     "lowest_ttft_p90_ms": _ttft_p90_ms(pd.concat(low_rows)) if low_rows else np.nan,
                     "slo_ttft_ms": sorted(set(g["slo_ttft_ms"])), "target": target})
    return pd.DataFrame(rows).set_index(by)


def describe(table: pd.DataFrame, x: str = RATE) -> str:
    """``max_rate``'s table as lines: per setup the median highest rate, its range and each repeat's."""
    unit = "req/s" if x == RATE else x
    lines = []
    for key, r in table.iterrows():
        name = ", ".join(map(str, key)) if isinstance(key, tuple) else str(key)
        slo = "/".join(f"{v:g}" for v in r["slo_ttft_ms"])
        per = ", ".join("none" if np.isnan(v) else f"{v:g}" for v in r["per_repeat"])
        if np.isnan(r["max_rate"]):
            p90 = r.get("lowest_ttft_p90_ms", np.nan)
            why = f", TTFT p90 {p90:,.0f} ms" if not np.isnan(p90) else ""
            head = (f"{name}: no rate swept meets TTFT <= {slo} ms for {r['target']:.0%} of requests (at the lowest, "
                    f"{r['lowest_rate']:g} {unit}: {r['lowest_attainment']:.0%} met{why}; sweep lower rates)")
        else:
            bound = ">= " if r.get("at_least") else ""
            head = (f"{name}: {bound}{r['max_rate']:g} {unit} (median of {r['repeats']} repeats, range "
                    f"{r['max_rate_min']:g}-{r['max_rate_max']:g}) within TTFT <= {slo} ms for {r['target']:.0%} "
                    "of requests" + (f"; {r['highest_rate']:g} {unit} is the highest rate swept and meets it: "
                                     "sweep higher to find the limit" if r.get("at_least") else ""))
        lines.append(f"{head}; per repeat: {per}")
    return "\n".join(lines)
