"""A sweep's closing table: after ``kvlab run -m``, one row per job of what its sweep varied against the figures a
reader compares first, printed once and written as ``sweep.csv`` in the sweep directory.

The keys are the jobs' overrides (Hydra's ``.hydra/rank0/overrides.yaml``) whose values differ between jobs (every
override where only one job ran); the figures come from each job's ``summary.json`` (kvlab.results.records.Summary),
named and shown as kvlab.core.figures does. A job that left no summary (it failed before its merge) keeps its row,
with its figures empty and its status saying so. kvlab.analysis.sweeps reads the same directories into a DataFrame
for plots; this is the terminal's view, with no dependency beyond the run's records.
"""
from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvlab.core.paths import write_whole
from kvlab.results import records

CSV = "sweep.csv"


@dataclass(frozen=True)
class Column:
    name: str  # the CSV column (the summary's field, or its percentile's path)
    label: str
    unit: str
    get: Callable[[records.Summary], object]
    fmt: str = "{:,.2f}"

    @property
    def head(self) -> str:
        return f"{self.label} {self.unit}".strip()


def _pct(figure: str, p: str) -> Callable[[records.Summary], float | None]:
    def get(s: records.Summary) -> float | None:
        v = (s.serving.get(figure) or {}).get(p)
        return None if v is None else v * 1e3  # the serving percentiles are seconds; the table shows ms

    return get


COLUMNS: tuple[Column, ...] = (
    Column("gbps", "", "GB/s", lambda s: s.gbps),
    Column("link_ratio", "link_ratio", "", lambda s: s.link_ratio, "{:.3f}"),
    Column("ttft_ms.p50", "TTFT p50", "ms", _pct("ttft_s", "p50"), "{:,.1f}"),
    Column("ttft_ms.p90", "TTFT p90", "ms", _pct("ttft_s", "p90"), "{:,.1f}"),
    Column("exposed_ms.p90", "exposed p90", "ms", _pct("exposed_s", "p90"), "{:,.1f}"),
    Column("goodput", "goodput", "req/s", lambda s: s.goodput, "{:,.3f}"),
    Column("verified", "verified", "", lambda s: s.verified, "{}"),
)


def job_dirs(sweep_dir: Path) -> list[Path]:
    """The jobs' run directories (Hydra's ``hydra.sweep.subdir``: the job number), in job order."""
    dirs = [d for d in Path(sweep_dir).iterdir() if d.is_dir() and (d / ".hydra").is_dir()]
    return sorted(dirs, key=lambda d: (not d.name.isdigit(), int(d.name) if d.name.isdigit() else 0, d.name))


def _overrides(run_dir: Path) -> dict[str, str]:
    for d in (run_dir / ".hydra" / "rank0", run_dir / ".hydra"):
        if (d / "overrides.yaml").exists():
            given = yaml.safe_load((d / "overrides.yaml").read_text()) or []
            pairs = (str(o).partition("=") for o in given)
            return {k.lstrip("+~"): v for k, _, v in pairs if not k.lstrip("+~").startswith("hydra.")}
    return {}


def collect(sweep_dir: Path) -> tuple[list[str], list[dict]]:
    """(the varied keys, one row per job: ``job``, the keys, every column's value, ``status``)."""
    jobs = job_dirs(sweep_dir)
    given = [_overrides(d) for d in jobs]
    keys = list(dict.fromkeys(k for g in given for k in g))
    varied = [k for k in keys if len({g.get(k) for g in given}) > 1] or keys
    rows = []
    for d, g in zip(jobs, given):
        row: dict = {"job": d.name, **{k: g.get(k, "") for k in varied}}
        try:
            summary = records.read_summary(d)
        except ValueError as e:
            summary, row["status"] = None, f"corrupt summary ({e})"
        if summary is None:
            row.setdefault("status", "no summary")  # the job failed before its merge
            row.update({c.name: None for c in COLUMNS})
        else:
            row.update({c.name: c.get(summary) for c in COLUMNS})
            row["status"] = ("interrupted" if summary.interrupted else
                             f"{len(summary.failed_requests)} failed requests" if summary.failed_requests else "ok")
        rows.append(row)
    return varied, rows


def write_csv(sweep_dir: Path, varied: list[str], rows: list[dict]) -> Path:
    path = Path(sweep_dir) / CSV
    text = io.StringIO(newline="")
    w = csv.DictWriter(text, fieldnames=["job", *varied, *(c.name for c in COLUMNS), "status"])
    w.writeheader()
    for r in rows:
        w.writerow({k: "" if v is None else v for k, v in r.items()})
    write_whole(path, text.getvalue(), "hydra.sweep.dir")
    return path


def _show(c: Column, v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if c.name == "verified":
        return "yes" if v else "NO"
    return c.fmt.format(v)


def render(varied: list[str], rows: list[dict], title: str):
    """The rich table: the varied keys, then the figures any job has (a column empty in every row is left out)."""
    from rich.table import Table

    cols = [c for c in COLUMNS if any(r.get(c.name) is not None for r in rows)]
    t = Table(title=title)
    for h in ("job", *varied):
        t.add_column(h, overflow="fold")
    for c in cols:
        t.add_column(c.head, justify="right", overflow="fold")
    problems = any(r["status"] != "ok" for r in rows)
    if problems:
        t.add_column("status", overflow="fold")
    for r in rows:
        t.add_row(r["job"], *(str(r[k]) for k in varied), *(_show(c, r[c.name]) for c in cols),
                  *([r["status"]] if problems else []))
    return t


def close(sweep_dir: Path, console=None) -> list[dict] | None:
    """Print the sweep's table and write ``sweep.csv``; returns the rows (their ``status``: ``ok`` or what went
    wrong); None, and nothing printed, for a directory without jobs."""
    from kvlab.results.metrics import console_for

    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        return None
    varied, rows = collect(sweep_dir)
    if not rows:
        return None
    path = write_csv(sweep_dir, varied, rows)
    console = console or console_for()
    console.print(render(varied, rows, f"kvlab sweep: {len(rows)} jobs"))
    console.print(f"sweep table in {path}", markup=False, highlight=False)
    return rows


def job_line(summary: records.Summary) -> str:
    """A sweep job's own output, one line of the columns of the closing table (the full tables of a run of its
    own, once per job, would bury the sweep's)."""
    got = [(c, c.get(summary)) for c in COLUMNS]
    shown = ", ".join(" ".join(x for x in (c.label, _show(c, v), c.unit) if x) for c, v in got if v is not None)
    failed = f", {len(summary.failed_requests)} failed" if summary.failed_requests else ""
    return f"{summary.total_bytes / 2**20:,.2f} MiB in {summary.requests} requests{failed}: {shown}"
