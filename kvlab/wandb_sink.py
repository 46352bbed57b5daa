"""wandb sink: one wandb run per rank, grouped per experiment.

The runner calls, on every rank::

    sink = WandbSink.create(setup, run_dir, rank)       # rank: world rank
    sink.log_request(part)                               # a kvlab.records.RankPart (or RequestRow)
    sink.log_summary(summary)                            # a kvlab.records.Summary, rank 0 only
    sink.finish()

Every rank of one experiment lands in one wandb ``group`` (``logger.wandb.group``, else the
run directory's name), with ``job_type`` ctx or gen and the name ``ctx0``, ``gen1``, ... (the
side-local rank: world ranks are ctx ranks first, then gen ranks).
``logger.wandb.mode`` is ``offline`` by default: runs are written under ``<run_dir>/wandb``
with no network and no key, to be uploaded later with ``wandb sync``. ``disabled`` (tests,
``logger=quiet``), a machine without wandb, or any failure inside wandb give a sink that does
nothing: metrics always reach ``results.jsonl`` and ``summary.json`` anyway, and a logger
must never be the reason a transfer run fails.

wandb is an optional dependency (the ``wandb`` extra): it is large, and a GPU machine that
only runs transfers and benchmarks has no use for it. Without it rank 0 says so in one
warning and the run goes on.
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvlab import figures
from kvlab.metrics import flatten
from kvlab.records import RankPart, RequestRow, Summary, read_rows, to_dict
from kvlab.spec import WandbSpec

if TYPE_CHECKING:
    from kvlab.config import Setup

def group_name(wandb: WandbSpec, run_dir: Path) -> str:
    """The experiment's wandb group: all ranks of one run dir share it."""
    if wandb.group:
        return str(wandb.group)
    run_dir = Path(run_dir).resolve()
    # multirun job dirs are numbered 0, 1, ... under the sweep's dated dir: a bare number would
    # merge the same job of every sweep into one group
    if run_dir.name.isdigit() and run_dir.parent.name:
        return f"{run_dir.parent.name}-{run_dir.name}"
    return run_dir.name


def _scalars(record: dict) -> dict:
    """Numbers only: wandb charts cannot plot strings, and None would turn a column into objects."""
    return {k: v for k, v in record.items() if isinstance(v, (int, float))}


def _row(record: RankPart | RequestRow) -> dict:
    """A record's values; a rank's own part of a request gets its span and its GB/s (over its own wire
    intervals: kvlab.records.RankPart.gbps), which a chart wants."""
    row = {k: v for k, v in to_dict(record).items() if k != "schema"}
    if isinstance(record, RankPart) and record.seconds:
        row.update(seconds=record.seconds, gbps=record.gbps)
    return row


def _cell(v: Any) -> Any:
    if v is None or isinstance(v, (int, float, str, bool)):
        return v
    return json.dumps(v)


class WandbSink:
    """No-op base; ``create`` returns a live sink only when wandb is importable and enabled."""

    active = False

    @classmethod
    def create(cls, setup: Setup, run_dir: Path | str, rank: int) -> WandbSink:
        """The sink of world rank ``rank``; ``setup.logger.wandb`` says whether and where to log."""
        mode = setup.logger.wandb.mode
        if os.environ.get("WANDB_MODE") == "disabled":  # a global switch, as for any wandb program
            mode = "disabled"
        if mode == "disabled":
            return cls()
        try:
            import wandb
        except ImportError:
            if rank == 0:
                warnings.warn(f"logger.wandb.mode={mode}: wandb is not installed, so no wandb runs are written; "
                              "pip install 'kvlab[wandb]', or logger=quiet", stacklevel=2)
            return cls()
        try:
            return _LiveSink(wandb, setup, Path(run_dir), rank, mode)
        except Exception as e:  # a broken wandb install or service must not stop the transfer
            warnings.warn(f"wandb disabled on rank {rank}: {type(e).__name__}: {e}", stacklevel=2)
            return cls()

    def log_request(self, record: RankPart | RequestRow) -> None:
        pass

    def log_summary(self, summary: Summary) -> None:
        pass

    def finish(self) -> None:
        pass


class _LiveSink(WandbSink):
    active = True

    def __init__(self, wandb, setup: Setup, run_dir: Path, rank: int, mode: str):
        self._wandb = wandb
        self.run_dir = run_dir
        self.rows: list[dict] = []
        run_dir.mkdir(parents=True, exist_ok=True)
        side, side_rank = setup.side_of(rank)
        kwargs = dict(project=setup.logger.wandb.project, group=group_name(setup.logger.wandb, run_dir),
                      job_type=side.name, name=f"{side.name}{side_rank}", config=setup.to_dict(), dir=str(run_dir),
                      mode=mode, tags=[setup.transfer.strategy.name, setup.model.name],
                      settings=wandb.Settings(x_disable_stats=True, console="off", silent=True))
        try:
            # several ranks' runs may live in one process (tests, notebooks): keep them all open
            self.run = wandb.init(reinit="create_new", **kwargs)
        except (TypeError, ValueError):  # wandb < 0.19.10 knows only booleans
            self.run = wandb.init(reinit=True, **kwargs)
        self.run.define_metric("request")
        self.run.define_metric("request/*", step_metric="request")
        self._failed = False

    def _guard(self, what: str, fn) -> None:
        if self._failed:
            return
        try:
            fn()
        except Exception as e:
            self._failed = True
            warnings.warn(f"wandb {what} failed, further logging skipped: {type(e).__name__}: {e}", stacklevel=3)

    def log_request(self, record: RankPart | RequestRow) -> None:
        row = _row(record)
        self.rows.append(row)
        metrics = {f"request/{k}": v for k, v in _scalars(row).items() if k != "request"}
        metrics["request"] = record.request
        self._guard("log_request", lambda: self.run.log(metrics))

    def _table(self, rows: list[dict]):
        columns = list(dict.fromkeys(k for r in rows for k in r))
        return self._wandb.Table(columns=columns, data=[[_cell(r.get(c)) for c in columns] for r in rows])

    def log_summary(self, summary: Summary) -> None:
        # rank 0 holds only its own part of each request; the merged rows are in results.jsonl
        rows = [_row(r) for r in read_rows(self.run_dir)] or self.rows

        def do():
            values = flatten({k: v for k, v in to_dict(summary).items() if k != "schema"})
            self.run.summary.update({k: v for k, v in values.items() if v is not None})
            if rows:
                # the distributions of the figures with percentiles (kvlab.figures: TTFT, exposed transfer,
                # queue, ...); a figure absent from every row (no slots: no slot wait) gets none
                hists = {f"serving/{f.name}": self._wandb.Histogram(xs) for f in figures.line_figures()
                         if (xs := [r[f.name] for r in rows if r.get(f.name) is not None])}
                self.run.log({"requests": self._table(rows), **hists})

        self._guard("log_summary", do)

    def finish(self) -> None:
        self._guard("finish", self.run.finish)

