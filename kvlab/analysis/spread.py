"""Medians and spread over repeats: what a figure of a sweep is once each point ran several times.

A run's ``repeat`` (``Setup.repeat``; swept with ``kvlab run -m repeat=0,1,2``) says which repeat of
its config it is, and changes nothing else. ``over_repeats`` groups a sweep's runs (kvlab.analysis.sweeps
.load_sweep's rows) by the columns that name a point and reduces each figure over the repeats to its
median and range (min, max) and the count of runs behind it: with three or five repeats a range says
more than a standard deviation, and the median does not move with one slow run. The plots of
kvlab.analysis.sweeps draw the median with the range as error bars.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

REPEAT_AXES = ("repeat",)  # columns whose values are repeats of one point, not points of their own


def point_columns(df: pd.DataFrame, exclude=(), repeats=REPEAT_AXES) -> list[str]:
    """The swept columns (``df.attrs["swept"]``) that name a point: neither a repeat axis nor ``exclude``."""
    return [c for c in df.attrs.get("swept", []) if c not in repeats and c not in exclude and c in df]


def over_repeats(df: pd.DataFrame, y: str | list[str], by: list[str]) -> pd.DataFrame:
    """One row per value of ``by``: per column of ``y`` its median over the runs of that point, ``<y>_min`` and
    ``<y>_max`` (the range), and ``n`` (runs with a value; a run without the figure is left out, not zero)."""
    ys = [y] if isinstance(y, str) else list(y)
    missing = [c for c in [*ys, *by] if c not in df]
    if missing:
        raise KeyError(f"{', '.join(missing)}: no such column; the sweep has {', '.join(map(str, df.columns))}")
    frames = []
    for key, g in df.groupby(by, dropna=False, sort=True):
        row = dict(zip(by, key if isinstance(key, tuple) else (key,)))
        for c in ys:
            v = pd.to_numeric(g[c], errors="coerce").dropna()
            row[c] = float(v.median()) if len(v) else np.nan
            row[f"{c}_min"] = float(v.min()) if len(v) else np.nan
            row[f"{c}_max"] = float(v.max()) if len(v) else np.nan
            row["n" if len(ys) == 1 else f"{c}_n"] = len(v)
        frames.append(row)
    return pd.DataFrame(frames)


def errorbars(d: pd.DataFrame, y: str, scale: float = 1.0) -> np.ndarray:
    """matplotlib's ``yerr`` of ``over_repeats``' rows: the distance from the median down to the min and up to
    the max."""
    mid = d[y].to_numpy(dtype=float)
    return np.vstack([mid - d[f"{y}_min"].to_numpy(dtype=float), d[f"{y}_max"].to_numpy(dtype=float) - mid]) * scale
