"""``python -m kvlab.cli.worker RUN_DIR``: one rank of a run.

Its config is the one its launcher handed it in the environment (kvlab.results.rundir.CONFIG_ENV), or
else RUN_DIR/config.yaml (ranks started by hand)."""
from __future__ import annotations

if __name__ == "__main__":  # before the slow imports: a signal now ends the rank without a traceback
    import os
    import sys

    from kvlab.core.streams import guard

    guard()  # the launcher's stdout closed or full: the rank's prints are dropped, its files written

    from kvlab.core.interrupt import quiet_until_ready

    def _last_words(signal_name: str) -> None:
        from kvlab.results.records import PartFile, read_part, write_part

        rank = int(os.environ.get("RANK", 0))
        if read_part(sys.argv[1], rank) is not None:  # these handlers are back once the rank has ended: its part stands
            return
        write_part(sys.argv[1], PartFile(rank=rank, side="", side_rank=-1,
                                         errors=[f"rank {rank}: stopped by {signal_name} while starting"]))

    quiet_until_ready(_last_words)

import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from omegaconf import OmegaConf  # noqa: E402

from kvlab.config.schema import Config  # noqa: E402
from kvlab.results.rundir import CONFIG_ENV  # noqa: E402


def load_config(run_dir: Path):
    text = os.environ.get(CONFIG_ENV)
    loaded = OmegaConf.create(text) if text is not None else OmegaConf.load(run_dir / "config.yaml")
    return OmegaConf.merge(OmegaConf.structured(Config), loaded)


if __name__ == "__main__":
    from kvlab.core.errors import one_line_warnings
    from kvlab.rank.runner import worker_main

    one_line_warnings()
    run_dir = Path(sys.argv[1])
    if os.environ.get("KVLAB_PROFILE"):  # host-side profile of one rank, for finding per-chunk overheads
        import cProfile
        import pstats

        prof = cProfile.Profile()
        rc = prof.runcall(worker_main, load_config(run_dir), run_dir)
        with open(run_dir / f"profile_rank{os.environ['RANK']}.txt", "w") as f:
            pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(40)
    else:
        rc = worker_main(load_config(run_dir), run_dir)
    # the rank has written and closed everything (part file, wandb run, process group): the interpreter's
    # teardown of torch and gloo took 0.4-1.7 s of every run's wall time, and nothing is left for it to do
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
