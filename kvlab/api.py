"""kvlab from Python (a notebook, a test, a benchmark): the same run as ``kvlab run``."""
from __future__ import annotations

from pathlib import Path

from kvlab.cli.run_cmd import launch, prepare
from kvlab.config.schema import build, compose
from kvlab.results import records, rundir
from kvlab.sizing import budget
from kvlab.sizing.preflight import preflight


def run_transfer(overrides: list[str] | tuple[str, ...] = (), run_dir: str | Path = "outputs/api") -> dict:
    """Run a transfer: composes the config from Hydra overrides, starts the ranks on this machine, and
    returns the run's summary (``summary.json`` as plain values; kvlab.results.records.Summary has its fields)."""
    cfg = compose(list(overrides))
    setup = build(cfg)
    budget.check_host(setup)
    if setup.needs_preflight:
        preflight(setup)
    run_dir = Path(run_dir)
    with rundir.hold(run_dir, "run_dir"):
        rc = launch(setup, run_dir, prepare(cfg, run_dir))
    summary = records.read_summary(run_dir)
    if rc == 2 or summary is None:
        raise RuntimeError(f"kvlab run failed with exit code {rc}; see the output above")
    return records.to_dict(summary)

