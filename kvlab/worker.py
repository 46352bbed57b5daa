"""``python -m kvlab.worker RUN_DIR``: one rank of a run whose resolved config is RUN_DIR/config.yaml."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

from kvlab.config import Config


def load_config(run_dir: Path):
    return OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(run_dir / "config.yaml"))


if __name__ == "__main__":
    from kvlab.runner import worker_main

    run_dir = Path(sys.argv[1])
    if os.environ.get("KVLAB_PROFILE"):  # host-side profile of one rank, for finding per-chunk overheads
        import cProfile
        import pstats

        prof = cProfile.Profile()
        rc = prof.runcall(worker_main, load_config(run_dir), run_dir)
        with open(run_dir / f"profile_rank{os.environ['RANK']}.txt", "w") as f:
            pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(40)
        sys.exit(rc)
    sys.exit(worker_main(load_config(run_dir), run_dir))
