"""``kvlab run``: resolve the config once, check it, write it to the run directory and start the ranks.

Outside torchrun the Hydra app starts the ranks itself (kvlab.cli.launch) and, when rank 0 died
before writing the summary, merges the part files the others left (kvlab.rank.report); under
torchrun every process composes the same config and is one rank (kvlab.rank.runner). The run
directory is named by TORCHELASTIC_RUN_ID, which all ranks of a job share (conf/config.yaml),
so they never race on it.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from kvlab.cli.launch import launch_local, under_torchrun
from kvlab.config import devices
from kvlab.config.schema import AUTO_DEFAULT, AUTO_TRANSPORT, CONF_DIR, build
from kvlab.config.workload import plan_run
from kvlab.core import interrupt
from kvlab.core.errors import ConfigError
from kvlab.core.paths import write_whole
from kvlab.rank import report
from kvlab.rank.runner import worker_main
from kvlab.results import records, rundir
from kvlab.sizing import budget, depth
from kvlab.sizing.cost import predict_run
from kvlab.sizing.preflight import preflight


def grace_s(setup) -> float:
    """How long the local launcher lets the other ranks report after one failed: a timeout to notice,
    the silence rank 0 waits out, and a margin."""
    return setup.transfer.timeout_s + report.stale_s(setup) + 10.0


def announce(setup) -> None:
    """One line when ``transport=auto`` chose other than its default: the run is not what the user expects."""
    if setup.transport.auto and setup.transport.name != AUTO_DEFAULT:
        print(f"kvlab: {setup.transport.auto}", flush=True)


def with_depth(cfg: DictConfig, setup):
    """(config, setup) with prefill=model's depth cut to what fits this host's GPUs where ``model.run_layers`` is
    left at 0 and the whole model does not fit (kvlab.sizing.depth), and the line that says so printed."""
    def layers(n: int) -> DictConfig:
        out = cfg.copy()
        with open_dict(out):
            out.model.run_layers = n
        return out

    cut = depth.auto(setup, lambda n: build(layers(n)), int(OmegaConf.select(cfg, "model.num_layers")))
    if cut is None:
        return cfg, setup
    print(f"kvlab: {cut.line}", flush=True)
    cfg = layers(cut.layers)
    return cfg, build(cfg)


def launch(setup, run_dir: Path, config_yaml: str | None = None) -> int:
    """Start the ranks and wait for them; returns the run's exit code. After an interruption (SIGINT,
    SIGTERM) the part files are merged here into a summary that says so, and one line on stderr.
    A transport that cannot be placed on this host's GPUs raises ConfigError before any rank starts."""
    devices.check_placement(setup)
    names = [report.rank_name(setup, w) for w in range(setup.world_size)]
    # after a death, a rank gets its own transfer timeout to notice and report, but not a minute
    out = launch_local(run_dir, setup.world_size, grace_s=grace_s(setup), names=names, config_yaml=config_yaml,
                       death_grace_s=min(setup.transfer.timeout_s + 1.0, 8.0), frozen_s=setup.transfer.timeout_s)
    sweep(setup)
    for message in records.refusals_unsaid(run_dir, setup.world_size):
        print(f"kvlab: error: {message}", file=sys.stderr)
    if out.interrupted or (out.code not in (0, 2) and not (run_dir / records.SUMMARY).exists()):
        plan = plan_run(setup)  # only now: the launcher does not hold a plan while the ranks run
        sig = interrupt.name(out.interrupted) if out.interrupted else None
        summary = report.finalize_from_files(setup, run_dir, plan, predict_run(setup, plan.requests), sig)
        if sig:
            done = summary.completed_requests
            shown = ", ".join(map(str, done[:20])) + (", ..." if len(done) > 20 else "")
            print(f"kvlab: interrupted by {sig}: {len(done)} of {summary.requests} requests completed and verified"
                  f"{f' ({shown})' if done else ''}; summary in {run_dir / records.SUMMARY}", file=sys.stderr)
    return out.code


def sweep(setup) -> None:
    """What ranks that died left outside the run directory (ipc's pool files in /dev/shm), removed once they
    have all ended, not by some later run."""
    gone = setup.transport.cls().sweep_after(setup)
    if gone:
        print(f"kvlab: removed {len(gone)} file{'s' * (len(gone) > 1)} a dead rank left: {', '.join(gone)}",
              file=sys.stderr)


def prepare(cfg: DictConfig, run_dir: Path, setup=None, resolve: bool = True) -> str:
    """Write the run's resolved config for the record; returns it (the launcher hands it to the ranks).
    ``transport=auto`` is written as the transport it resolved to here (``setup``'s, else built), so that
    the ranks, and whoever rebuilds the run later on another machine, get that one."""
    if resolve and OmegaConf.select(cfg, "transport.name") == AUTO_TRANSPORT:
        cfg = cfg.copy()
        with open_dict(cfg):
            cfg.transport = (setup or build(cfg)).to_dict()["transport"]
    text = OmegaConf.to_yaml(cfg, resolve=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_whole(run_dir / "config.yaml", text)
    return text


_worst = [0]  # the worst exit code of the jobs of a multirun, for the CLI's own exit code


def worst_exit() -> int:
    return _worst[0]


def note_exit(rc: int) -> None:
    _worst[0] = max(_worst[0], rc)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def hydra_main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if under_torchrun():
        if int(os.environ["RANK"]) == 0:
            try:
                setup = build(cfg)
                announce(setup)
                prepare(cfg, run_dir, setup)
            except ConfigError:  # every rank reports it (kvlab.rank.runner); the record keeps the config as given
                prepare(cfg, run_dir, resolve=False)
        rc = worker_main(cfg, run_dir)
    else:
        try:  # multirun skips the CLI's checks of each job's config; Hydra would print a traceback
            setup = build(cfg)
            setup.check_installed()
            devices.check_placement(setup)
            cfg, setup = with_depth(cfg, setup)
            announce(setup)
            budget.check_host(setup)
            budget.check_run_dir(setup, rundir.ensure_writable(run_dir))
            if setup.needs_preflight:
                preflight(setup)
            with rundir.hold(run_dir):  # the CLI holds it already, except for a multirun's jobs
                rc = launch(setup, run_dir, prepare(cfg, run_dir, setup))
        except ConfigError as e:
            print(f"kvlab: error: {e}", file=sys.stderr)
            rc = 2
    _worst[0] = max(_worst[0], rc)
    if rc and (HydraConfig.get().mode.name != "MULTIRUN" or rc > 128):  # an interrupted job ends the sweep
        sys.exit(rc)
