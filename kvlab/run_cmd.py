"""``kvlab run``: resolve the config once, check it, write it to the run directory and start the ranks.

Outside torchrun the Hydra app starts the ranks itself (kvlab.launch) and, when rank 0 died
before writing the summary, merges the part files the others left (kvlab.report); under
torchrun every process composes the same config and is one rank (kvlab.runner). The run
directory is named by TORCHELASTIC_RUN_ID, which all ranks of a job share (conf/config.yaml),
so they never race on it.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from kvlab import records, report
from kvlab.config import CONF_DIR, build
from kvlab.cost import predict_run
from kvlab.errors import ConfigError
from kvlab.launch import launch_local, under_torchrun
from kvlab.preflight import preflight
from kvlab.runner import worker_main
from kvlab.workload import plan_run


def grace_s(setup) -> float:
    """How long the local launcher lets the other ranks report after one failed: a timeout to notice,
    the silence rank 0 waits out, and a margin."""
    return setup.transfer.timeout_s + report.stale_s(setup) + 10.0


def launch(setup, run_dir: Path) -> int:
    names = [report.rank_name(setup, w) for w in range(setup.world_size)]
    rc = launch_local(run_dir, setup.world_size, grace_s=grace_s(setup), names=names)
    if rc not in (0, 2) and not (run_dir / records.SUMMARY).exists():
        requests, _, order = plan_run(setup)
        report.finalize_from_files(setup, run_dir, requests, order, predict_run(setup, requests))
    return rc


def prepare(cfg: DictConfig, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def hydra_main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if under_torchrun():
        if int(os.environ["RANK"]) == 0:
            prepare(cfg, run_dir)
        rc = worker_main(cfg, run_dir)
    else:
        setup = build(cfg)
        try:
            if setup.needs_preflight:
                preflight(setup)
        except ConfigError as e:  # multirun skips the CLI's checks; Hydra would print a traceback
            print(f"kvlab: error: {e}", file=sys.stderr)
            rc = 2
        else:
            prepare(cfg, run_dir)
            rc = launch(setup, run_dir)
    if rc and not HydraConfig.get().mode.name == "MULTIRUN":
        sys.exit(rc)
