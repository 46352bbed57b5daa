"""kvlab from Python (a notebook, a test, a benchmark): the same run as ``kvlab run``."""
from __future__ import annotations

from pathlib import Path

from kvlab.cli.commands import hydra_message
from kvlab.cli.run_cmd import launch, prepare, with_depth
from kvlab.config.schema import build, compose
from kvlab.core.errors import ConfigError
from kvlab.results import records, rundir
from kvlab.sizing import budget
from kvlab.sizing.preflight import preflight


def run_transfer(overrides: list[str] | tuple[str, ...] = (), run_dir: str | Path = "outputs/api") -> dict:
    """Run a transfer: composes the config from Hydra overrides, starts the ranks on this machine, and
    returns the run's summary (``summary.json`` as plain values; kvlab.results.records.Summary has its fields)."""
    overrides = checked_overrides("overrides", overrides)
    if not isinstance(run_dir, (str, Path)):
        raise ConfigError("run_dir", repr(run_dir), "a directory path (str or pathlib.Path)")
    try:
        cfg = compose(overrides)
    except Exception as e:  # Hydra's own composition errors: a ConfigError in the words kvlab run prints
        if isinstance(e, ConfigError):
            raise
        field, _, rest = hydra_message(e, overrides).partition("=")
        value, _, hint = rest.partition(": ")
        raise ConfigError(field, value, hint) from None
    cfg, setup = with_depth(cfg, build(cfg))
    budget.check_host(setup)
    run_dir = Path(run_dir)
    budget.check_run_dir(setup, rundir.ensure_writable(run_dir, "run_dir"), "run_dir")
    if setup.needs_preflight:
        preflight(setup)
    with rundir.hold(run_dir, "run_dir"):
        rc = launch(setup, run_dir, prepare(cfg, run_dir))
    summary = records.read_summary(run_dir)
    if rc == 2 or summary is None:
        raise RuntimeError(f"kvlab run failed with exit code {rc}; see the output above")
    return records.to_dict(summary)


def profile_transfer(overrides: list[str] | tuple[str, ...] = ()) -> dict[str, str]:
    """One more run with every rank under cProfile (``KVLAB_PROFILE=1``, kvlab.cli.worker), for a benchmark that
    looks for per-chunk host costs: rank (``rank0``, ...) -> its 40 functions of most own time."""
    import os
    import tempfile

    os.environ["KVLAB_PROFILE"] = "1"
    try:
        with tempfile.TemporaryDirectory() as d:
            run_transfer(overrides, d)
            return {f.stem.removeprefix("profile_"): f.read_text() for f in sorted(Path(d).glob("profile_rank*.txt"))}
    finally:
        del os.environ["KVLAB_PROFILE"]


def checked_overrides(field: str, overrides) -> list[str]:
    """``overrides`` as a list of strings; ConfigError for a bare string (a list of its characters) or anything
    else that is not a sequence of ``key=value`` strings."""
    if isinstance(overrides, (str, bytes)):
        raise ConfigError(field, repr(overrides), f"a list of Hydra overrides, not one string: use [{overrides!r}]"
                          if "=" in str(overrides) else "a list of Hydra overrides (key=value strings)")
    try:
        out = list(overrides)
    except TypeError:
        out = None
    if out is None or not all(isinstance(x, str) for x in out):
        raise ConfigError(field, repr(overrides), "a list of Hydra overrides (key=value strings), e.g. "
                          "['transfer=layerwise', 'workload.isl=8192']")
    return out
