"""wandb sink: one wandb run per job, grouped per experiment or sweep, as a team reads a dashboard.

The runner calls, on rank 0 only (it holds the merged results; the other ranks log nothing)::

    sink = WandbSink.create(setup, run_dir)             # before the results line: its warnings come first
    sink.log_summary(summary)                            # a kvlab.results.records.Summary, after the merge
    sink.finish()

A job's run is named for what its sweep varied (``transfer=layerwise workload.rate=16.0 repeat=1``,
from the sweep's ``multirun.yaml``), or for its overrides outside a sweep; its ``group`` is
``logger.wandb.group`` when set, else the ``+experiment`` name and the sweep directory (every job of
one sweep in one group; two sweeps of one experiment apart), the sweep alone, or the run directory;
its tags name the model, strategy, transport, both sides' layouts and the experiment; its config is
the run's (``Setup.to_dict``) with ``experiment``, ``sweep`` and ``varied``. It logs the summary's
figures and percentiles (``serving.ttft_s.p90``, ...) as summary values, each request's figures as
``request/<figure>`` against the step ``request`` and all of them as the table ``requests``; no
absolute wall-clock stamps (figures of unit ``epoch s``) as metrics. Histograms only from 20 requests
up. ``kvlab.analysis.wandb_read`` reads the offline files back into the table ``kvlab.analysis.sweeps`` draws.

``logger.wandb.mode`` is ``auto`` by default: ``offline`` where wandb is installed (the ``wandb`` extra), else
off without a word (an install that did not ask for wandb is not warned about it). ``offline`` writes runs under
``<run_dir>/wandb`` with no network and no key, to be uploaded later with ``wandb sync``; ``online`` without an
API key logs offline instead, and says so. ``disabled`` (tests, ``logger=quiet``), a machine without wandb where
a mode was named, or any failure inside wandb give a sink that does nothing, after one ``kvlab:`` line saying
why (once per sweep: kvlab.results.rundir.say_once):
metrics always reach ``results.jsonl`` and ``summary.json``, and a logger is never the reason a
transfer run fails.
"""
from __future__ import annotations

import json
import netrc
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from kvlab.core import figures
from kvlab.core.errors import install_hint
from kvlab.model.parallel import label
from kvlab.model.spec import WandbSpec
from kvlab.results.metrics import flatten
from kvlab.results.records import RequestRow, Summary, read_rows, to_dict
from kvlab.results.rundir import say_once

if TYPE_CHECKING:
    from kvlab.config.schema import Setup

HIST_MIN = 20  # fewer values make no distribution worth a panel
EPOCH = {f.name for f in figures.TABLE if f.unit == "epoch s"}


def say(line: str) -> None:
    print(f"kvlab: {line}", file=sys.stderr, flush=True)


def _overrides(run_dir: Path) -> list[str]:
    for d in (run_dir / ".hydra" / "rank0", run_dir / ".hydra"):
        if (d / "overrides.yaml").exists():
            return [str(o) for o in yaml.safe_load((d / "overrides.yaml").read_text()) or []]
    return []


def experiment(run_dir: Path) -> str | None:
    """The ``+experiment=`` the job was run with, if any."""
    return next((o.partition("=")[2] for o in _overrides(run_dir) if o.lstrip("+").startswith("experiment=")), None)


def sweep_dir(run_dir: Path) -> Path | None:
    """The sweep directory of a multirun job (Hydra writes multirun.yaml there), else None."""
    return run_dir.parent if (run_dir.parent / "multirun.yaml").exists() else None


def varied(run_dir: Path) -> dict[str, str]:
    """What the job's sweep varied, with this job's values: the keys swept by the experiment
    (``hydra.sweeper.params``) or on the command line (a value with ``,`` or a sweep function)."""
    mine = {o.partition("=")[0].lstrip("+~"): o.partition("=")[2] for o in _overrides(run_dir) if "=" in o}
    sweep = sweep_dir(run_dir)
    if sweep is None:
        return {k: v for k, v in mine.items() if k != "experiment" and not k.startswith(("hydra.", "logger"))}
    cfg = yaml.safe_load((sweep / "multirun.yaml").read_text()) or {}
    hydra = cfg.get("hydra", {})
    keys = list((hydra.get("sweeper") or {}).get("params") or {})
    for o in (hydra.get("overrides") or {}).get("task") or []:
        k, _, v = str(o).partition("=")
        if "," in v or "(" in v:
            keys.append(k.lstrip("+~"))
    return {k: v for k, v in mine.items() if k in keys}  # in the job's own order, as Hydra named it


def group_name(wandb: WandbSpec, run_dir: Path) -> str:
    """The job's wandb group: every job of one sweep shares it (see the module's docstring)."""
    if wandb.group:
        return str(wandb.group)
    run_dir = Path(run_dir).resolve()
    exp, sweep = experiment(run_dir), sweep_dir(run_dir)
    if exp and sweep:
        return f"{exp}-{sweep.name}"
    return exp or (sweep.name if sweep else run_dir.name)


def job_name(run_dir: Path) -> str:
    v = varied(Path(run_dir).resolve())
    return " ".join(f"{k}={x}" for k, x in v.items()) or Path(run_dir).name


def tags(setup: Setup, run_dir: Path) -> list[str]:
    side = lambda s: f"{s.name} {label(s)}"  # noqa: E731
    exp = experiment(Path(run_dir).resolve())
    return [setup.model.name, setup.transfer.strategy.name, setup.transport.name, side(setup.ctx), side(setup.gen),
            *([f"experiment={exp}"] if exp else [])]


def has_key() -> bool:
    """Whether wandb online can log in without asking: WANDB_API_KEY or a netrc entry for its host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("//")[-1].split("/")[0]
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _scalars(record: dict) -> dict:
    """Numbers only, and no absolute wall-clock stamps: wandb charts cannot plot strings, None would turn a
    column into objects, and a stamp of about 1.8e9 s is no figure."""
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and k not in EPOCH}


def _row(record: RequestRow) -> dict:
    return {k: v for k, v in to_dict(record).items() if k != "schema" and k not in EPOCH}


def _cell(v: Any) -> Any:
    if v is None or isinstance(v, (int, float, str, bool)):
        return v
    return json.dumps(v)


class WandbSink:
    """No-op base; ``create`` returns a live sink only when wandb is importable and enabled."""

    active = False

    @classmethod
    def create(cls, setup: Setup, run_dir: Path | str, rank: int = 0) -> WandbSink:
        """The job's sink (rank 0's; any other rank gets one that does nothing); ``setup.logger.wandb`` says
        whether and where to log. Anything in the way is one ``kvlab:`` line on stderr, and the run goes on."""
        mode = setup.logger.wandb.mode
        if os.environ.get("WANDB_MODE") == "disabled":  # a global switch, as for any wandb program
            mode = "disabled"
        if mode == "disabled" or rank != 0:
            return cls()
        try:
            import wandb
        except ImportError:
            if mode != "auto":  # asked for by name: say why nothing is written (auto asks only where it is there)
                say_once(run_dir, "wandb-missing", f"logger.wandb.mode={mode}: {install_hint('wandb', 'wandb')}; "
                         "no wandb run is written (logger=quiet turns it off)")
            return cls()
        mode = "offline" if mode == "auto" else mode
        if mode == "online" and not has_key():
            say_once(run_dir, "wandb-key", "logger.wandb.mode=online: no wandb API key (WANDB_API_KEY or "
                     f"`wandb login`), so the run is logged offline under {Path(run_dir) / 'wandb'}; "
                     "`wandb sync` uploads it later")
            mode = "offline"
        try:
            return _LiveSink(wandb, setup, Path(run_dir), mode)
        except Exception as e:  # a broken wandb install or service must not stop the transfer
            why = str(e).strip().splitlines()[0] if str(e).strip() else ""
            say_once(run_dir, "wandb-broken", f"wandb disabled: {type(e).__name__}: {why}")
            return cls()

    def log_summary(self, summary: Summary) -> None:
        pass

    def finish(self) -> None:
        pass


class _LiveSink(WandbSink):
    active = True

    def __init__(self, wandb, setup: Setup, run_dir: Path, mode: str):
        self._wandb = wandb
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        where = run_dir.resolve()
        sweep = sweep_dir(where)
        config = {**setup.to_dict(), "experiment": experiment(where), "sweep": sweep.name if sweep else None,
                  "varied": varied(where)}
        kwargs = dict(project=setup.logger.wandb.project, group=group_name(setup.logger.wandb, run_dir),
                      job_type="run", name=job_name(run_dir), config=config, dir=str(run_dir), mode=mode,
                      tags=tags(setup, run_dir),
                      settings=wandb.Settings(x_disable_stats=True, console="off", silent=True))
        try:
            # several runs may live in one process (tests, notebooks): keep them all open
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
            say(f"wandb {what} failed, further logging skipped: {type(e).__name__}: {e}")

    def _table(self, rows: list[dict]):
        columns = list(dict.fromkeys(k for r in rows for k in r))
        return self._wandb.Table(columns=columns, data=[[_cell(r.get(c)) for c in columns] for r in rows])

    def log_summary(self, summary: Summary) -> None:
        rows = [_row(r) for r in read_rows(self.run_dir)]  # the merged rows, every rank's parts in each

        def do():
            for r in rows:
                self.run.log({"request": r["request"],
                              **{f"request/{k}": v for k, v in _scalars(r).items() if k != "request"}})
            values = flatten({k: v for k, v in to_dict(summary).items() if k != "schema"})
            self.run.summary.update({k: v for k, v in values.items() if v is not None})
            extra = {}
            if rows:
                extra["requests"] = self._table(rows)
                if len(rows) >= HIST_MIN:
                    extra.update({f"serving/{f.name}": self._wandb.Histogram(xs) for f in figures.line_figures()
                                  if (xs := [r[f.name] for r in rows if r.get(f.name) is not None])})
            if extra:
                self.run.log(extra)

        self._guard("log_summary", do)

    def finish(self) -> None:
        self._guard("finish", self.run.finish)
