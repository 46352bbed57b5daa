"""``python -m kvlab.worker RUN_DIR``: one rank of a run whose resolved config is RUN_DIR/config.yaml."""
from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import OmegaConf

from kvlab.config import Config


def load_config(run_dir: Path):
    return OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(run_dir / "config.yaml"))


if __name__ == "__main__":
    from kvlab.runner import worker_main

    run_dir = Path(sys.argv[1])
    sys.exit(worker_main(load_config(run_dir), run_dir))
