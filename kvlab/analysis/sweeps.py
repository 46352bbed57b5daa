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
- ``figures()``: the table of every figure (kvlab.core.figures): name, unit, meaning, how it is
  computed per request and for the run, where it is shown;
- ``over_repeats(df, y, by)``: a figure's median, range and count over the repeats of each point
  (kvlab.analysis.spread; runs swept with ``repeat=0,1,2``);
- ``max_rate_under_slo(dir, ttft_ms=)``: from a rate sweep with repeats, the highest rate each setup
  serves within a TTFT SLO, median and range over the repeats, printed and returned (kvlab.analysis.capacity;
  ``kvlab run -m +experiment=rate_sweep`` runs such a sweep).

Every file is read through kvlab.results.records, so runs written by older versions have the current
column names (``makespan_s`` for the old summaries' ``seconds``, ``busy_s`` for the old rows'
``wire_s``); ``schema`` says what their values meant (kvlab.core.figures, each figure's ``before``:
before schema 2, ``gbps`` and ``link_ratio`` were over the run's span, not its time in flight).

Plots return a ``matplotlib.figure.Figure`` (no pyplot state: safe in tests, shown once in
notebooks): ``plot_bandwidth``, ``plot_link_ratio``, ``plot_memory``, ``plot_timeline``,
``plot_parallel_heatmap``, ``plot_plan``, ``plot_prediction``, ``plot_load`` (serving figures against load).
Where several runs share a point (repeats), a line is their median and its error bars their range.
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
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

from kvlab.analysis import capacity
from kvlab.analysis.labels import label as axis_label
from kvlab.analysis.labels import scaled
from kvlab.analysis.spread import errorbars, over_repeats, point_columns
from kvlab.core import figures as _figures
from kvlab.results import records
from kvlab.results.metrics import flatten
from kvlab.sizing.cost import Prediction, predict

__all__ = ["over_repeats", "point_columns"]  # kvlab.analysis.spread's, for sweeps with repeats

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
    try:
        summary = records.read_summary(run_dir)
    except ValueError as e:  # one corrupt run (a truncated file, another program's JSON) does not hide the rest
        summary = None
        row["status"] = f"corrupt summary: {e}"
        warnings.warn(str(e), stacklevel=2)
    if summary is not None:
        row.update(flatten(records.to_dict(summary)))
        row["status"] = "ok" if not summary.failed_requests else "failed requests"
    elif "status" not in row:
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
    """The rows ``read`` gives of every run below ``root``; a run with a corrupt file is left out, named in a
    warning and in ``attrs["corrupt"]`` (run directory -> what is wrong, the file named), so one bad file
    does not hide the rest."""
    frames, corrupt = [], {}
    for d in run_dirs(root):
        try:
            rows = read(d)
            summary = records.read_summary(d) if rows else None
        except ValueError as e:
            corrupt[str(d)] = str(e)
            warnings.warn(str(e), stacklevel=3)
            continue
        if not rows:
            continue
        f = pd.DataFrame([records.to_dict(r) for r in rows])
        for k, v in overrides(d).items():
            if k not in f:
                f[k] = v
        if summary is not None and "strategy" not in f:
            f["strategy"] = summary.strategy
        f["run_dir"] = str(d)
        frames.append(f)
    out = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    out.attrs["corrupt"] = corrupt
    return out


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

    from kvlab.api import checked_overrides, run_transfer

    base = checked_overrides("base", base)
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
    """Every figure a run reports, one row each (kvlab.core.figures.TABLE): its row field (``request``: per
    request) and summary field (``run``), unit, meaning, how it is computed, where it is shown."""
    rows = []
    for f in _figures.TABLE:
        run = f.run if isinstance(f.run, str) or f.run is None else "see how"
        rows.append({"name": f.name, "request": f.request is not None, "run": f.summary_name, "reduction": run,
                     "unit": f.unit, "meaning": f.meaning, "how": f.how, "column": f.column,
                     "percentiles": bool(f.line), "needs": f.needs, "was": f.was, "before": f.before})
    return pd.DataFrame(rows).set_index("name")


def max_rate_under_slo(root: str | Path | Iterable[str | Path], ttft_ms: float | None = None, target: float = 0.9,
                       x: str = capacity.RATE, by: list[str] | None = None, show: bool = True) -> pd.DataFrame:
    """The highest arrival rate each setup of a rate sweep serves within a TTFT SLO, over its repeats
    (kvlab.analysis.capacity.max_rate: the median, range and each repeat's; ``target`` the share of requests that must
    meet the SLO). ``ttft_ms``: the SLO to hold them to (by default the ``serving.slo.ttft_ms`` each run was
    run with). ``show`` prints one line per setup."""
    runs, results = load_sweep(root), load_results(root) if isinstance(root, (str, Path)) else \
        pd.concat([load_results(r) for r in root], ignore_index=True)
    table = capacity.max_rate(runs, results, ttft_ms, target, x, by)
    if show:
        print(capacity.describe(table, x))
    return table


def load_wandb(root: str | Path) -> pd.DataFrame:
    """Every wandb offline run below ``root`` (a sweep: one per job) as one row: ``group``, ``name``, ``tags``,
    the run's config and summary flattened to the columns ``load_sweep`` has (``strategy``, ``workload.rate``,
    ``serving.ttft_s.p90``, ...), so that the same plots draw them; ``attrs["swept"]`` names what the
    sweep varied (kvlab.analysis.wandb_read reads the files; no server, no key)."""
    from kvlab.analysis import wandb_read

    rows = []
    for path in wandb_read.run_files(Path(root)):
        try:
            run = wandb_read.read_run(path)
        except Exception as e:  # noqa: BLE001 - a truncated or foreign file (protobuf's DecodeError and others)
            warnings.warn(f"{path}: not a readable wandb run ({type(e).__name__}: {e})", stacklevel=2)
            rows.append({"status": f"corrupt wandb file: {type(e).__name__}: {e}", "wandb_file": str(path)})
            continue
        cfg = flatten({k: v for k, v in run["config"].items() if not k.startswith("_")})
        summary = {k: v for k, v in run["summary"].items() if not k.startswith("_") and not isinstance(v, dict)}
        rows.append({**cfg, **summary, "group": run["group"], "name": run["name"], "tags": run["tags"],
                     "wandb_file": str(path)})
    if not rows:
        raise FileNotFoundError(f"{root}: no wandb offline runs below it (logger.wandb.mode=offline writes them)")
    df = pd.DataFrame(rows)
    for key in ("workload.rate", "repeat", "workload.isl"):
        if key in df:
            df[key] = pd.to_numeric(df[key], errors="coerce")
    df.attrs["swept"] = list(dict.fromkeys(c.removeprefix("varied.") for c in df if c.startswith("varied.")))
    return df


def plot_wandb_panels(df: pd.DataFrame) -> Figure:
    """The standard panels of a rate sweep's wandb runs (``load_wandb``): TTFT p90, exposed transfer p90 and
    goodput against the arrival rate, per strategy, medians over the repeats with their range; no filtering by
    hand (every run of the group is one job of the sweep)."""
    fig = Figure(figsize=(15, 4), layout="constrained")
    axes = fig.subplots(1, 3)
    plot_load(df, "serving.ttft_s", by="none", ax=axes[0])
    plot_load(df, "serving.exposed_s", by="none", ax=axes[1])
    ax = axes[2]
    for s in _strategies(df):
        if "goodput" in df and df["goodput"].notna().any():
            _repeats_line(ax, df[df["strategy"] == s], "workload.rate", "goodput", label=s,
                          **STRATEGY_STYLE.get(s, {}))
    ax.set_xlabel("arrival rate (requests/s)")
    ax.set_ylabel("goodput (req/s)")
    ax.set_title("goodput against load")
    ax.grid(True, alpha=0.3)
    if ax.containers:
        ax.legend(fontsize=8)
    groups = sorted(df["group"].dropna().unique()) if "group" in df else []
    fig.suptitle(f"wandb group {', '.join(groups)}", fontsize=11)
    return fig


# ---------------------------------------------------------------- predictions

def predict_dir(run_dir: str | Path) -> Prediction:
    """The cost model for one finished run: its resolved config, its backend and its own requests."""
    from omegaconf import OmegaConf

    from kvlab.config.schema import Config, build
    from kvlab.config.workload import request

    run_dir = Path(run_dir)
    # over the current schema's defaults, so that runs written before a key existed still build;
    # not struct, so that keys appended on the command line (+key=value) survive
    schema = OmegaConf.structured(Config)
    OmegaConf.set_struct(schema, False)
    cfg = OmegaConf.merge(schema, OmegaConf.load(run_dir / "config.yaml"))
    setup = build(cfg)
    summary = records.read_summary(run_dir)
    reqs = [request(setup, r.request, r.isl) for r in sorted(records.read_rows(run_dir), key=lambda r: r.request)]
    return predict(setup, reqs or None, backend=summary.backend if summary else None, with_prefill=True)


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


def _repeats_line(ax, d: pd.DataFrame, x: str, y: str, scale: float = 1.0, **style):
    """A median line over the runs of each x with their range as error bars (kvlab.analysis.spread)."""
    m = over_repeats(d, y, [x]).sort_values(x)
    m = m[(m["n"] > 0) & m[y].notna()]
    if m.empty:  # nothing to draw: no line, and no legend entry for one
        return None
    spread = (m["n"] > 1).any()
    return ax.errorbar(m[x], m[y] * scale, yerr=errorbars(m, y, scale) if spread else None, capsize=3 if spread else 0,
                       **style)


def plot_bandwidth(df: pd.DataFrame, x: str | None = None, ax=None) -> Figure:
    """Delivered GB/s against prompt length, one line per strategy (the median of its runs at a length, their
    range as error bars), and dashed in the same colour the link those same runs measured before their
    transfers (``link_gbps``: raw messages of the run's own chunk size between its own ranks, kvlab.rank.linkrate),
    median and range alike."""
    x = _xcol(df, x)
    fig, ax = _fig_ax(ax)
    for s in _strategies(df):
        d = df[df["strategy"] == s]
        style = STRATEGY_STYLE.get(s, {})
        _repeats_line(ax, d, x, "gbps", label=s, **style)
        if "link_gbps" in d and d["link_gbps"].notna().any():
            _repeats_line(ax, d, x, "link_gbps", label=f"{s}: its runs' link", color=style.get("color"), ls="--",
                          lw=1, marker=None)
    _token_axis(ax)
    ax.set_ylabel(axis_label("gbps"))
    ax.set_title("delivered bandwidth by strategy, and the link each run measured")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def plot_link_ratio(df: pd.DataFrame, x: str | None = None, ax=None) -> Figure:
    """``link_ratio`` against prompt length, one line per strategy (median over its runs at a length, their
    range as error bars): delivered GB/s as a share of raw messages of the run's own chunk size between the
    same ranks, measured in the same run (kvlab.rank.linkrate). 1.0 is the link itself, whatever this machine's
    link is."""
    x = _xcol(df, x)
    fig, ax = _fig_ax(ax)
    for s in _strategies(df):
        _repeats_line(ax, df[df["strategy"] == s], x, "link_ratio", label=s, **STRATEGY_STYLE.get(s, {}))
    ax.axhline(1.0, color="k", ls="--", lw=1, label="raw link, same messages")
    above = df[df["link_ratio"] > 1.0]
    if not above.empty:  # the reference was no ceiling for these runs' bytes: a share of the link says less there
        ax.scatter(above[x], above["link_ratio"], marker="x", color="red", s=60, zorder=5,
                   label=f"above the raw link ({len(above)} runs: the reference was no ceiling)")
    _token_axis(ax)
    ax.set_ylim(0, max(1.05, float(df["link_ratio"].max()) * 1.05))
    ax.set_ylabel(axis_label("link_ratio"))
    ax.set_title("share of the link each strategy delivers")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig


def plot_memory(df: pd.DataFrame, x: str | None = None, column: str = "peak_extra_device_bytes", ax=None) -> Figure:
    """Extra device memory (MiB, largest rank) against prompt length, one line per strategy. Strategies with
    the same figure at a length (the staging pool: chunked, layerwise, zerocopy) are drawn side by side, a
    little apart along the length axis, each labelled with its value, so that none hides another."""
    x = _xcol(df, x)
    fig, ax = _fig_ax(ax)
    names = _strategies(df)
    per = {s: df[df["strategy"] == s].groupby(x, as_index=False)[column].max().sort_values(x) for s in names}
    shared = pd.concat([d.assign(strategy=s) for s, d in per.items()]).groupby([x, column])["strategy"].agg(list)
    for s in names:
        d = per[s]
        # the k-th of n strategies sharing a value at a length: shifted by a fraction of a power of two
        shift = [2 ** (0.08 * (lst.index(s) - (len(lst) - 1) / 2)) for lst in (shared[(a, b)] for a, b in
                                                                               zip(d[x], d[column]))]
        ax.plot(d[x] * np.array(shift), d[column] / MiB, label=s, **STRATEGY_STYLE.get(s, {}))
    for (xv, value), lst in shared.items():
        if len(lst) > 1:
            ax.annotate(f"{', '.join(lst)}: {value / MiB:g} MiB", (xv, value / MiB), textcoords="offset points",
                        xytext=(0, 8), ha="center", fontsize=7)
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


def plot_timeline(timeline: pd.DataFrame, request: int | None = None, rank: int | None = None, ax=None) -> Figure:
    """One layerwise request: when the prefill finished each layer and when its transfer did, one panel per
    ctx rank that sent it (``rank``: that one only; with ``ax``, the lowest rank unless ``rank`` is given).

    Grey bars are each layer's prefill compute, coloured bars the time a layer's cache was
    still in flight after its compute; the gap after the last layer is the exposed transfer.
    A rank of a later pipeline stage holds only its own layers.
    """
    if timeline.empty:
        raise ValueError("empty timeline: only layerwise runs write timeline.jsonl")
    if request is None:
        request = int(timeline["request"].min())
    t = timeline[timeline["request"] == request]
    if t.empty:
        raise ValueError(f"request={request}: not in the timeline; it has {sorted(timeline['request'].unique())}")
    if "run_dir" in t and t["run_dir"].nunique() > 1:
        t = t[t["run_dir"] == t["run_dir"].iloc[0]]
    ranks = sorted(t["rank"].dropna().unique()) if "rank" in t and t["rank"].notna().any() else [None]
    if rank is not None:
        if rank not in ranks:
            raise ValueError(f"rank={rank}: request {request} has ctx ranks {ranks}")
        ranks = [rank]
    elif ax is not None:
        ranks = ranks[:1]
    n_layers = t["layer"].nunique()
    if ax is None:
        fig = Figure(figsize=(4 + 3 * len(ranks), 0.3 * n_layers + 1.8), layout="constrained")
        axes = list(np.atleast_1d(fig.subplots(1, len(ranks), sharey=True, squeeze=False)[0]))
    else:
        fig, axes = ax.figure, [ax]
    ms = 1e3
    for a, r in zip(axes, ranks):
        d = (t if r is None else t[t["rank"] == r]).sort_values("layer")
        start = np.concatenate([[0.0], d["prefill_done_s"].to_numpy()[:-1]])
        done = d["prefill_done_s"].to_numpy()
        sent = d["transfer_done_s"].to_numpy()
        layers = d["layer"].to_numpy()
        a.barh(layers, (done - start) * ms, left=start * ms, color="0.75", label="prefill compute")
        a.barh(layers, np.maximum(sent - done, 0) * ms, left=done * ms, color="tab:green", alpha=0.8,
               label="transfer after compute")
        a.axvline(done[-1] * ms, color="k", lw=0.8, ls=":")
        exposed = max(0.0, sent.max() - done[-1])
        who = "" if r is None else f"ctx{int(r)}: "
        a.set_title(f"{who}{exposed * ms:.2f} ms exposed", fontsize=10)
        a.set_xlabel("ms since the prefill started")
        a.yaxis.set_major_locator(MaxNLocator(integer=True))  # a tick per layer, none between layers
    axes[0].set_ylabel("layer")
    axes[0].invert_yaxis()
    axes[0].legend(loc="upper right", fontsize=8)
    if len(axes) > 1 or ax is None:
        fig.suptitle(f"layerwise request {request}: prefill and transfer per layer", fontsize=11)
    return fig


def plot_parallel_heatmap(df: pd.DataFrame, value: str = "gbps", rows: str = "ctx.tp", cols: str = "gen.tp",
                          ax=None, title: str | None = None) -> Figure:
    """A value (GB/s by default) for every ctx x gen parallel combination of a sweep."""
    fig, ax = _fig_ax(ax, figsize=(5, 4))
    grid = df.pivot_table(index=rows, columns=cols, values=value, aggfunc="median").sort_index().sort_index(axis=1)
    im = ax.imshow(grid.to_numpy(dtype=float), cmap="viridis", origin="upper")
    ax.set_xticks(range(len(grid.columns)), [str(c) for c in grid.columns])
    ax.set_yticks(range(len(grid.index)), [str(i) for i in grid.index])
    ax.set_xlabel(axis_label(cols))
    ax.set_ylabel(axis_label(rows))
    vals = grid.to_numpy(dtype=float)
    finite = vals[np.isfinite(vals)]
    mid = (finite.min() + finite.max()) / 2 if finite.size else 0
    for (i, j), v in np.ndenumerate(vals):
        if np.isfinite(v):
            ax.text(j, i, f"{v:.3g}", ha="center", va="center", color="k" if v > mid else "w")
    fig.colorbar(im, ax=ax, label=axis_label(value))
    ax.set_title(title or f"{axis_label(value)} by {axis_label(rows)} x {axis_label(cols)}")
    return fig


def _plan_summary(plan: Any) -> dict:
    if isinstance(plan, dict):
        return plan
    if isinstance(plan, (str, Path)):
        p = Path(plan)
        return json.loads((p / "plan.json" if p.is_dir() else p).read_text())
    from kvlab.cli.plan_cmd import summarize  # a Setup

    return summarize(plan)


def plot_plan(plan: Any, ax=None) -> Figure:
    """Which ctx rank sends how many bytes to which gen rank.

    ``plan``: a ``kvlab.cli.plan_cmd.summarize`` dict, a ``plan.json`` (or the run dir holding it),
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
    The cost model predicts the whole workload on its prefill timeline, first chunk free to go to last byte
    unpacked: the run's ``makespan_s``."""
    if predicted not in df or df[predicted].isna().any():
        df = add_predictions(df)
    fig, ax = _fig_ax(ax, figsize=(5, 5))
    said, scale = scaled(measured)  # both in the measured figure's unit
    df = df.assign(**{measured: df[measured] * scale, predicted: df[predicted] * scale})
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
    ax.set_xlabel(f"measured {said}")
    ax.set_ylabel(f"predicted {said}")
    ratio = (df[predicted] / df[measured]).astype(float)
    ax.set_title(f"cost model vs measurement (median ratio {ratio.median():.2f})")
    ax.grid(True, alpha=0.3, which="both")
    ax.legend()
    return fig


def plot_load(df: pd.DataFrame, y: str = "serving.ttft_s", x: str = "workload.rate", by: str = "transfer.slots",
              q: str = "p90", ax=None) -> Figure:
    """A serving figure (``y``: ``serving.<figure>``, one with percentiles in kvlab.core.figures, its ``q``
    percentile, in the unit the terminal shows it in) against load (``x``: requests per second), one line
    per strategy and value of ``by`` (e.g. the staging budget): the median over the repeats at each rate,
    their range as error bars (kvlab.analysis.spread), and how many runs stand behind each point in the legend."""
    col = f"{y}.{q}"
    if col not in df:
        raise KeyError(f"{col}: no such column; runs need the serving timeline (kvlab.core.figures), and the "
                       f"percentile in serving.percentiles")
    shown = _figures.BY_NAME[y.split(".")[-1]]
    scale, _, unit = _figures.DISPLAY[shown.unit]
    name = shown.line or shown.name
    fig, ax = _fig_ax(ax)
    groups = [None] if by not in df else sorted(df[by].dropna().unique())
    for s in _strategies(df):
        for g in groups:
            d = df[(df["strategy"] == s) & ((df[by] == g) if g is not None else True)]
            if d.empty:
                continue
            style = dict(STRATEGY_STYLE.get(s, {}))
            if len(groups) > 1 and g != groups[-1]:
                style["linestyle"] = ":"
            runs = over_repeats(d, col, [x])["n"]
            label = (s if g is None else f"{s}, {by.split('.')[-1]}={g}") + \
                (f" (median of {runs.min()}-{runs.max()} runs)" if runs.min() != runs.max()
                 else f" (median of {runs.max()} runs)" if runs.max() > 1 else "")
            _repeats_line(ax, d, x, col, scale, label=label, **style)
    slo = "slo.ttft_ms"
    if shown.name == "ttft_s" and unit == "ms" and slo in df and df[slo].notna().any():
        for v in sorted(df[slo].dropna().unique()):  # the SLO the runs were held to, on the figure it bounds
            ax.axhline(float(v), color="k", ls="--", lw=1, label=f"TTFT SLO ({float(v):g} ms)")
    ax.set_xlabel(axis_label(x))
    ax.set_ylabel(f"{name} {q} ({unit})")
    ax.set_title(f"{name} {q} against load")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
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
