"""What a ``kvlab run -m`` does once every job has ended: a Hydra callback (``hydra.callbacks`` in conf/config.yaml)
that prints the sweep's closing table and writes ``sweep.csv`` (kvlab.results.sweep_table).

Hydra calls ``on_multirun_end`` in the process that launched the sweep, after the launcher has the jobs' returns:
after the last local job with the basic launcher, after the cluster's jobs with submitit's (conf/hydra/launcher).
Only ``kvlab run``'s jobs leave summaries; ``kvlab plan -m`` and ``kvlab link -m`` sweeps end as before.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

RUN_JOB = "run_cmd"  # Hydra's job name of kvlab run (its task function's module, kvlab.cli.run_cmd)


class SweepTable(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.job.name != RUN_JOB:
            return
        from kvlab.cli import run_cmd
        from kvlab.results import sweep_table

        rows = sweep_table.close(Path(config.hydra.sweep.dir)) or []
        if any(r["status"] != "ok" for r in rows):  # jobs run elsewhere (submitit) leave only their records here
            run_cmd.note_exit(1)
