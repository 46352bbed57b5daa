"""Runs and sweeps as pandas tables, and the standard plots.

A run directory holds ``summary.json``, ``results.jsonl`` (one line per request),
``timeline.jsonl`` (layerwise: one line per request and layer), ``config.yaml`` and Hydra's
``.hydra/rank0/overrides.yaml``; a sweep directory holds numbered run directories.

- ``load_run(dir)``: one run as a Series: summary fields (``ctx.tp``, ... flattened), the
  job's Hydra overrides as columns, ``run_dir`` and ``status``;
- ``load_sweep(dir)``: one row per run below ``dir``; ``df.attrs["swept"]`` names the
  override columns that differ between runs;
- ``load_results(dir)``, ``load_timeline(dir)``: the per-request and per-layer rows of one
  run or of every run of a sweep (with the run's override columns);
- ``add_predictions(df)``: the cost model's estimate for each run from its own config and
  requests, for runs whose summary has no ``predicted_s`` yet;
- ``run_sweep(grid, base, root)``: a small sweep from Python (a notebook), laid out as
  Hydra's multirun lays it out, so that ``load_sweep`` reads both alike;
- ``figures()``: the table of every figure (kvlab.figures): name, unit, meaning, how it is
  computed per request and for the run, where it is shown.

Every file is read through kvlab.records, so runs written by older versions have the current
column names (``makespan_s`` for the old summaries' ``seconds``, ``busy_s`` for the old rows'
``wire_s``); ``schema`` says what their values meant (kvlab.figures, each figure's ``before``:
before schema 2, ``gbps`` and ``link_ratio`` were over the run's span, not its time in flight).

Plots return a ``matplotlib.figure.Figure`` (no pyplot state: safe in tests, shown once in
notebooks): ``plot_bandwidth``, ``plot_link_ratio``, ``plot_memory``, ``plot_timeline``,
``plot_parallel_heatmap``, ``plot_plan``, ``plot_prediction``, ``plot_load`` (serving figures against load).
"""
from __future__ import annotations

import json
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from kvlab import figures as _figures
from kvlab import records
from kvlab.cost import Prediction, predict
from kvlab.metrics import flatten
from kvlab.rates import CostSpec

MiB = 2**20
STRATEGY_ORDER = ("naive", "chunked", "layerwise", "zerocopy")
STRATEGY_STYLE = {  # one look per strategy across every plot
    "naive": dict(color="tab:red", marker="s"),
    "chunked": dict(color="tab:blue", marker="o"),
    "layerwise": dict(color="tab:green", marker="^"),
    "zerocopy": dict(color="tab:purple", marker="D"),
}


# ---------------------------------------------------------------- loading

def _hydra_dir(run_dir: Path) -> Path | None:
    for d in (run_dir / ".hydra" / "rank0", run_dir / ".hydra"):
        if (d / "overrides.yaml").exists():
            return d
    return None


def overrides(run_dir: str | Path) -> dict[str, Any]:
    """The job's command-line overrides, ``key -> value`` (``+``/``~`` prefixes dropped, values typed)."""
    d = _hydra_dir(Path(run_dir))
    if d is None:
        return {}
    out = {}
    for ov in yaml.safe_load((d / "overrides.yaml").read_text()) or []:
        key, _, value = str(ov).partition("=")
        key = key.lstrip("+~")
        if key.startswith("hydra."):
            continue
        try:
            out[key] = yaml.safe_load(value) if value else None
        except yaml.YAMLError:
            out[key] = value
        if isinstance(out[key], (list, dict)):
            out[key] = json.dumps(out[key])  # a hashable cell, so that sweeps can group on it
    return out


def _is_run(d: Path) -> bool:
    return (d / records.SUMMARY).exists() or _hydra_dir(d) is not None or (d / records.RESULTS).exists()


def load_run(run_dir: str | Path) -> pd.Series:
    run_dir = Path(run_dir)
    if not _is_run(run_dir):
        raise FileNotFoundError(f"{run_dir}: not a kvlab run directory (no summary.json, results.jsonl or .hydra)")
    row: dict[str, Any] = {}
    summary = records.read_summary(run_dir)
    if summary is not None:
        row.update(flatten(records.to_dict(summary)))
        row["status"] = "ok" if not summary.failed_requests else "failed requests"
    else:
        row["status"] = "no summary"  # the job died before writing it: keep its overrides visible
    for k, v in overrides(run_dir).items():
        row.setdefault(k, v)  # a summary field that an override also names keeps the measured value
    row["overrides"] = " ".join(f"{k}={v}" for k, v in overrides(run_dir).items())
    row["run_dir"] = str(run_dir)
    return pd.Series(row, name=run_dir.name)


def run_dirs(root: str | Path) -> list[Path]:
    """Run directories at or below ``root``, sweep jobs in job-number order."""
    root = Path(root)
    if _is_run(root) and not any(_is_run(c) for c in root.iterdir() if c.is_dir() and not c.name.startswith(".")):
        return [root]
    found = sorted({p.parent for pat in (records.SUMMARY, records.RESULTS, ".hydra") for p in root.rglob(pat)
                    if ".hydra" not in p.parent.parts and "wandb" not in p.parent.parts})

    def key(p: Path):
        rel = p.relative_to(root).parts
        return tuple((0, int(x), "") if x.isdigit() else (1, 0, x) for x in rel)

    return sorted(found, key=key)


def load_sweep(root: str | Path | Iterable[str | Path]) -> pd.DataFrame:
    if isinstance(root, (str, Path)):
        dirs = run_dirs(root)
    else:
        dirs = [d for r in root for d in run_dirs(r)]
    if not dirs:
        raise FileNotFoundError(f"{root}: no kvlab run directories below it")
    df = pd.DataFrame([load_run(d) for d in dirs]).reset_index(drop=True)
    ov_cols = list(dict.fromkeys(k for d in dirs for k in overrides(d)))
    df.attrs["swept"] = [c for c in ov_cols if c in df and df[c].astype(str).nunique() > 1]
    return df


def _per_run_rows(root: str | Path, read) -> pd.DataFrame:
    frames = []
    for d in run_dirs(root):
        rows = read(d)
        if not rows:
            continue
        f = pd.DataFrame([records.to_dict(r) for r in rows])
        for k, v in overrides(d).items():
            if k not in f:
                f[k] = v
        summary = records.read_summary(d)
        if summary is not None and "strategy" not in f:
            f["strategy"] = summary.strategy
        f["run_dir"] = str(d)
        frames.append(f)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def load_results(root: str | Path) -> pd.DataFrame:
    """Per-request rows of one run or of every run of a sweep."""
    return _per_run_rows(root, records.read_rows)


def load_timeline(root: str | Path) -> pd.DataFrame:
    """Per-(request, layer) rows of the layerwise runs at or below ``root``."""
    return _per_run_rows(root, records.read_timeline)


def run_sweep(grid: dict[str, Iterable[Any]] | list[dict[str, Any]], base: Iterable[str] = (),
              root: str | Path = "multirun/api", progress: bool = True) -> pd.DataFrame:
    """One run per job on top of ``base``: every combination of ``grid`` (key -> values), or the
    jobs of a list of ``{key: value}`` dicts as given.

    Job ``i`` runs in ``root/i`` with ``kvlab.api.run_transfer``; its own overrides are
    written to ``root/i/.hydra/overrides.yaml`` as Hydra would, so the returned table (from
    ``load_sweep``) has one column per swept key.
    """
    import itertools

    from kvlab.api import run_transfer

    if isinstance(grid, dict):
        keys = list(grid)
        jobs = [dict(zip(keys, values, strict=True)) for values in itertools.product(*(list(grid[k]) for k in keys))]
    else:
        jobs = [dict(j) for j in grid]
    root = Path(root)
    for i, job in enumerate(jobs):
        swept = [f"{k}={_override_value(v)}" for k, v in job.items()]
        run_dir = root / str(i)
        (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
        (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(swept))
        if progress:
            print(f"[{i + 1}/{len(jobs)}] {' '.join(swept)}", flush=True)
        run_transfer([*base, *swept], run_dir)
    return load_sweep(root)


def _override_value(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_override_value(x) for x in v) + "]"
    if isinstance(v, bool):
        return str(v).lower()
    return str(v)


def figures() -> pd.DataFrame:
    """Every figure a run reports, one row each (kvlab.figures.TABLE): its row field (``request``: per
    request) and summary field (``run``), unit, meaning, how it is computed, where it is shown."""
    rows = []
    for f in _figures.TABLE:
        run = f.run if isinstance(f.run, str) or f.run is None else "see how"
        rows.append({"name": f.name, "request": f.request is not None, "run": f.summary_name, "reduction": run,
                     "unit": f.unit, "meaning": f.meaning, "how": f.how, "column": f.column,
                     "percentiles": bool(f.line), "needs": f.needs, "was": f.was, "before": f.before})
    return pd.DataFrame(rows).set_index("name")


# ---------------------------------------------------------------- predictions

def predict_dir(run_dir: str | Path) -> Prediction:
    """The cost model for one finished run: its resolved config, its backend and its own requests."""
    from omegaconf import OmegaConf

    from kvlab.config import Config, build
    from kvlab.workload import request

    run_dir = Path(run_dir)
    # over the current schema's defaults, so that runs written before a key existed still build;
    # not struct, so that keys appended on the command line (+key=value) survive
    schema = OmegaConf.structured(Config)
    OmegaConf.set_struct(schema, False)
    cfg = OmegaConf.merge(schema, OmegaConf.load(run_dir / "config.yaml"))
    setup = build(cfg)
    summary = records.read_summary(run_dir)
    reqs = [request(setup, r.request, r.isl) for r in sorted(records.read_rows(run_dir), key=lambda r: r.request)]
    return predict(setup, reqs or None, backend=summary.backend if summary else None)


def add_predictions(df: pd.DataFrame) -> pd.DataFrame:
    """Fill ``predicted_s``, ``predicted_gbps`` and ``predicted_extra_bytes`` from each run's config."""
    df = df.copy()
    for col in ("predicted_s", "predicted_gbps", "predicted_extra_bytes"):
        if col not in df:
            df[col] = np.nan
    for i, row in df.iterrows():
        if not (Path(row["run_dir"]) / "config.yaml").exists():
            continue
        try:
            p = predict_dir(row["run_dir"])
        except Exception as e:  # one unreadable run should not hide the others' estimates
            warnings.warn(f"{row['run_dir']}: no prediction ({type(e).__name__}: {e})", stacklevel=2)
            continue
        if pd.isna(row["predicted_s"]):
            df.at[i, "predicted_s"] = p.seconds
        df.at[i, "predicted_gbps"] = p.gbps
        df.at[i, "predicted_extra_bytes"] = p.extra_bytes
    return df


# ---------------------------------------------------------------- plots

def _strategies(df: pd.DataFrame) -> list[str]:
    present = [s for s in df["strategy"].dropna().unique()]
    return [s for s in STRATEGY_ORDER if s in present] + sorted(s for s in present if s not in STRATEGY_ORDER)


def _xcol(df: pd.DataFrame, x: str | None) -> str:
    if x:
        return x
    for c in ("isl_mean", "isl", "workload.isl"):
        if c in df:
            return c
    raise KeyError("no prompt-length column (isl_mean, isl or workload.isl); pass x=")


def _backend(df: pd.DataFrame) -> str | None:
    if "backend" in df and df["backend"].notna().any():
        return str(df["backend"].dropna().iloc[0])
    return None


def _bytes_per_request(df: pd.DataFrame) -> pd.Series:
    if "bytes" in df:
        return df["bytes"]
    return df["total_bytes"] / df["requests"].clip(lower=1)


def plot_bandwidth(df: pd.DataFrame, x: str | None = None, rates=None, ax=None) -> Figure:
    """GB/s against prompt length, one line per strategy, and the raw link for the same bytes.

    The raw-link line is one message per request of the same size at the cost model's link
    rates (the profile of the runs' backend unless ``rates`` is given): what a transfer with
    no copies, no chunking and no per-message cost above one message would reach.
    """
    x = _xcol(df, x)
    fig, ax = _fig_ax(ax)
    for s in _strategies(df):
        d = df[df["strategy"] == s].groupby(x, as_index=False)["gbps"].median().sort_values(x)
        ax.plot(d[x], d["gbps"], label=s, **STRATEGY_STYLE.get(s, {}))
    rates = rates or CostSpec().rates(_backend(df) or "nccl")
    link = pd.DataFrame({x: df[x], "b": _bytes_per_request(df)}).groupby(x, as_index=False)["b"].median()
    link = link.sort_values(x)
    link_gbps = [b / rates.message_s(b) / 1e9 for b in link["b"]]
    ax.plot(link[x], link_gbps, "k--", lw=1, label=f"raw link ({rates.profile})")
    _token_axis(ax)
    ax.set_ylabel("GB/s")
    ax.set_title("transfer bandwidth by strategy")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig


def plot_link_ratio(df: pd.DataFrame, x: str | None = None, ax=None) -> Figure:
    """``link_ratio`` against prompt length, one line per strategy: delivered GB/s as a share of raw
    messages of the run's own chunk size between the same ranks, measured in the same run
    (kvlab.linkrate). 1.0 is the link itself, whatever this machine's link is."""
    x = _xcol(df, x)
    fig, ax = _fig_ax(ax)
    for s in _strategies(df):
        d = df[df["strategy"] == s].groupby(x, as_index=False)["link_ratio"].median().sort_values(x)
        ax.plot(d[x], d["link_ratio"], label=s, **STRATEGY_STYLE.get(s, {}))
    ax.axhline(1.0, color="k", ls="--", lw=1, label="raw link, same messages")
    _token_axis(ax)
    ax.set_ylim(0, max(1.05, float(df["link_ratio"].max()) * 1.05))
    ax.set_ylabel("delivered / raw link")
    ax.set_title("share of the link each strategy delivers")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig


def plot_memory(df: pd.DataFrame, x: str | None = None, column: str = "peak_extra_device_bytes", ax=None) -> Figure:
    """Extra device memory (MiB, largest rank) against prompt length, one line per strategy."""
    x = _xcol(df, x)
    fig, ax = _fig_ax(ax)
    for s in _strategies(df):
        d = df[df["strategy"] == s].groupby(x, as_index=False)[column].max().sort_values(x)
        ax.plot(d[x], d[column] / MiB, label=s, **STRATEGY_STYLE.get(s, {}))
    _token_axis(ax)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylabel("extra device memory per rank (MiB)")
    ax.set_title("extra memory by strategy")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig


def plot_timeline(timeline: pd.DataFrame, request: int | None = None, ax=None) -> Figure:
    """One layerwise request: when the prefill finished each layer and when its transfer did.

    Grey bars are each layer's prefill compute, coloured bars the time a layer's cache was
    still in flight after its compute; the gap after the last layer is the exposed transfer.
    """
    if timeline.empty:
        raise ValueError("empty timeline: only layerwise runs write timeline.jsonl")
    if request is None:
        request = int(timeline["request"].min())
    t = timeline[timeline["request"] == request].sort_values("layer")
    if "run_dir" in t and t["run_dir"].nunique() > 1:
        t = t[t["run_dir"] == t["run_dir"].iloc[0]]
    fig, ax = _fig_ax(ax, figsize=(7, 0.25 * len(t) + 1.5))
    ms = 1e3
    start = np.concatenate([[0.0], t["prefill_done_s"].to_numpy()[:-1]])
    done = t["prefill_done_s"].to_numpy()
    sent = t["transfer_done_s"].to_numpy()
    layers = t["layer"].to_numpy()
    ax.barh(layers, (done - start) * ms, left=start * ms, color="0.75", label="prefill compute")
    ax.barh(layers, np.maximum(sent - done, 0) * ms, left=done * ms, color="tab:green", alpha=0.8,
            label="transfer after compute")
    ax.axvline(done[-1] * ms, color="k", lw=0.8, ls=":")
    exposed = max(0.0, sent.max() - done[-1])
    ax.set_title(f"layerwise request {request}: {exposed * ms:.2f} ms exposed after the prefill")
    ax.set_xlabel("ms since the prefill started")
    ax.set_ylabel("layer")
    ax.invert_yaxis()
    ax.legend(loc="upper right", fontsize=8)
    return fig


def plot_parallel_heatmap(df: pd.DataFrame, value: str = "gbps", rows: str = "ctx.tp", cols: str = "gen.tp",
                          ax=None, title: str | None = None) -> Figure:
    """A value (GB/s by default) for every ctx x gen parallel combination of a sweep."""
    fig, ax = _fig_ax(ax, figsize=(5, 4))
    grid = df.pivot_table(index=rows, columns=cols, values=value, aggfunc="median").sort_index().sort_index(axis=1)
    im = ax.imshow(grid.to_numpy(dtype=float), cmap="viridis", origin="upper")
    ax.set_xticks(range(len(grid.columns)), [str(c) for c in grid.columns])
    ax.set_yticks(range(len(grid.index)), [str(i) for i in grid.index])
    ax.set_xlabel(cols)
    ax.set_ylabel(rows)
    vals = grid.to_numpy(dtype=float)
    finite = vals[np.isfinite(vals)]
    mid = (finite.min() + finite.max()) / 2 if finite.size else 0
    for (i, j), v in np.ndenumerate(vals):
        if np.isfinite(v):
            ax.text(j, i, f"{v:.3g}", ha="center", va="center", color="k" if v > mid else "w")
    fig.colorbar(im, ax=ax, label=value)
    ax.set_title(title or f"{value} by {rows} x {cols}")
    return fig


def _plan_summary(plan: Any) -> dict:
    if isinstance(plan, dict):
        return plan
    if isinstance(plan, (str, Path)):
        p = Path(plan)
        return json.loads((p / "plan.json" if p.is_dir() else p).read_text())
    from kvlab.plan_cmd import summarize  # a Setup

    return summarize(plan)


def plot_plan(plan: Any, ax=None) -> Figure:
    """Which ctx rank sends how many bytes to which gen rank.

    ``plan``: a ``kvlab.plan_cmd.summarize`` dict, a ``plan.json`` (or the run dir holding it),
    or a ``Setup``. Line width is proportional to the bytes of the pair.
    """
    s = _plan_summary(plan)
    pairs = s["pairs"]
    n_ctx = max((p["src"] for p in pairs), default=-1) + 1
    n_ctx = max(n_ctx, s["ctx"]["tp"] * s["ctx"]["pp"] * s["ctx"]["dp"])
    n_gen = max(max((p["dst"] for p in pairs), default=-1) + 1, s["gen"]["tp"] * s["gen"]["pp"] * s["gen"]["dp"])
    fig, ax = _fig_ax(ax, figsize=(6, 0.6 * max(n_ctx, n_gen) + 1.5))
    y_ctx = np.linspace(0, 1, n_ctx) if n_ctx > 1 else np.array([0.5])
    y_gen = np.linspace(0, 1, n_gen) if n_gen > 1 else np.array([0.5])
    top = max((p["bytes"] for p in pairs), default=1) or 1
    for p in pairs:
        a, b = y_ctx[p["src"]], y_gen[p["dst"]]
        ax.plot([0, 1], [a, b], color="tab:blue", lw=0.5 + 6 * p["bytes"] / top, alpha=0.7, solid_capstyle="butt")
        ax.text(0.5, (a + b) / 2, f"{p['bytes'] / MiB:,.1f} MiB\n{p['chunks']} chunks", ha="center", va="bottom",
                fontsize=8, bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.8))
    ax.scatter(np.zeros(n_ctx), y_ctx, s=500, color="tab:orange", zorder=3)
    ax.scatter(np.ones(n_gen), y_gen, s=500, color="tab:green", zorder=3)
    for r, y in enumerate(y_ctx):
        ax.text(0, y, f"ctx{r}", ha="center", va="center", fontsize=8, zorder=4)
    for r, y in enumerate(y_gen):
        ax.text(1, y, f"gen{r}", ha="center", va="center", fontsize=8, zorder=4)
    c, g = s["ctx"], s["gen"]
    ax.set_title(f"{s['model']}, {s['isl']} tokens: ctx tp{c['tp']} pp{c['pp']} dp{c['dp']} -> "
                 f"gen tp{g['tp']} pp{g['pp']} dp{g['dp']}\n{s['total_bytes'] / MiB:,.1f} MiB, "
                 f"{s['total_chunks']} chunks ({s['strategy']})", fontsize=10)
    ax.set_xlim(-0.25, 1.25)
    ax.set_ylim(-0.2, 1.2)
    ax.invert_yaxis()
    ax.axis("off")
    return fig


def plot_prediction(df: pd.DataFrame, measured: str = "makespan_s", predicted: str = "predicted_s",
                    ax=None) -> Figure:
    """Predicted against measured seconds per run (log-log), one colour per strategy; on the diagonal is exact.
    The cost model predicts the whole workload, first request opened to last byte unpacked: the run's
    ``makespan_s``."""
    if predicted not in df or df[predicted].isna().any():
        df = add_predictions(df)
    fig, ax = _fig_ax(ax, figsize=(5, 5))
    for s in _strategies(df):
        d = df[df["strategy"] == s]
        ax.scatter(d[measured], d[predicted], label=s, **STRATEGY_STYLE.get(s, {}))
    vals = pd.concat([df[measured], df[predicted]]).astype(float)
    vals = vals[vals > 0]
    lo, hi = vals.min() / 1.5, vals.max() * 1.5
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="exact")
    ax.plot([lo, hi], [2 * lo, 2 * hi], "k:", lw=0.7, label="2x")
    ax.plot([lo, hi], [lo / 2, hi / 2], "k:", lw=0.7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel(f"measured ({measured})")
    ax.set_ylabel(f"predicted ({predicted})")
    ratio = (df[predicted] / df[measured]).astype(float)
    ax.set_title(f"cost model vs measurement (median ratio {ratio.median():.2f})")
    ax.grid(True, alpha=0.3, which="both")
    ax.legend()
    return fig


def plot_load(df: pd.DataFrame, y: str = "serving.ttft_s", x: str = "workload.rate", by: str = "transfer.slots",
              q: str = "p90", ax=None) -> Figure:
    """A serving figure (``y``: ``serving.<figure>``, one with percentiles in kvlab.figures, its ``q``
    percentile, in the unit the terminal shows it in) against load (``x``: requests per second), one line
    per strategy and value of ``by`` (e.g. the staging budget)."""
    col = f"{y}.{q}"
    if col not in df:
        raise KeyError(f"{col}: no such column; runs need the serving timeline (kvlab.figures)")
    shown = _figures.BY_NAME[y.split(".")[-1]]
    scale, _, unit = _figures.DISPLAY[shown.unit]
    name = shown.line or shown.name
    fig, ax = _fig_ax(ax)
    groups = [None] if by not in df else sorted(df[by].dropna().unique())
    for s in _strategies(df):
        for g in groups:
            d = df[(df["strategy"] == s) & ((df[by] == g) if g is not None else True)].sort_values(x)
            style = dict(STRATEGY_STYLE.get(s, {}))
            if len(groups) > 1 and g != groups[-1]:
                style["linestyle"] = ":"
            label = s if g is None else f"{s}, {by.split('.')[-1]}={g}"
            ax.plot(d[x], d[col] * scale, label=label, **style)
    ax.set_xlabel("arrival rate (requests/s)" if x == "workload.rate" else x)
    ax.set_ylabel(f"{name} {q} ({unit})")
    ax.set_title(f"{name} {q} against load")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig


def _tokens(v, _pos=None) -> str:
    return f"{v / 1024:g}k" if v >= 1024 else f"{v:g}"


def _token_axis(ax) -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(_tokens))
    ax.set_xlabel("prompt length (tokens)")


def _fig_ax(ax, figsize=(6, 4)):
    if ax is not None:
        return ax.figure, ax
    fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.add_subplot()
