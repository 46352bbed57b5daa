"""``kvlab link``: the link curve of a setup's own ranks and transport over message sizes (kvlab.rank.linkcurve).

The setup is the one ``kvlab run`` would start with the same overrides (model, sides, transport);
its ranks are started the same way and stop after the transport's start-up, each size moved as the
in-run reference moves the run's chunks. The staging slots are sized to the largest message (a slot
holds one message), the workload is one small request (its cache is all the ranks allocate), and no
logger runs.
"""
from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from kvlab.cli.launch import launch_local
from kvlab.cli.run_cmd import announce, prepare, sweep
from kvlab.config import devices
from kvlab.config.schema import CONF_DIR, build
from kvlab.core import interrupt
from kvlab.core.errors import ConfigError
from kvlab.rank import linkcurve
from kvlab.results import records


def for_link(cfg: DictConfig) -> DictConfig:
    """The config of the ranks: slots as large as the largest message, one small request, no logger."""
    setup = build(cfg)
    kind = "cuda" if devices.uses_cuda(setup) else "cpu"
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.transfer.slot_mib = max(setup.link.sizes(kind)) / 2**20
        cfg.transfer.baseline = False
        cfg.workload.requests, cfg.workload.isl, cfg.workload.arrival = 1, 1024, "burst"
        cfg.workload.trace, cfg.workload.isl_list, cfg.workload.distribution = None, None, "fixed"
        cfg.logger.wandb.mode, cfg.logger.progress = "disabled", False
    return cfg


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def hydra_main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        cfg = for_link(cfg)
        setup = build(cfg)
        setup.check_installed()
        devices.check_placement(setup)
        announce(setup)
        text = prepare(cfg, run_dir, setup)
        records.start_link(run_dir)  # the ranks add each size as they measure it
        out = launch_local(run_dir, setup.world_size, grace_s=setup.transfer.timeout_s + 10.0,
                           extra_env={linkcurve.ENV: "1"}, config_yaml=text)
        rc = out.code
        sweep(setup)
        if out.interrupted:  # what was measured before the signal stays in link.jsonl
            done = len(records.read_link(run_dir)) if (run_dir / records.LINK).exists() else 0
            sizes = len(setup.link.sizes("cuda" if devices.uses_cuda(setup) else "cpu"))
            print(f"kvlab: interrupted by {interrupt.name(out.interrupted)}: {done} of {sizes} message sizes "
                  f"measured{f', in {run_dir / records.LINK}' if done else ''}", file=sys.stderr)
    except ConfigError as e:
        print(f"kvlab: error: {e}", file=sys.stderr)
        rc = 2
    if rc:
        sys.exit(rc)
