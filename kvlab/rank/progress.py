"""The terminal's progress bar over one rank's bytes (rank 0 shows it under ``logger.progress``)."""
from __future__ import annotations

import sys
import time


class Progress:
    """A progress bar over this rank's bytes, shown only once the run has lasted a few seconds."""

    def __init__(self, total: int, enabled: bool):
        # a pipe or a file gets no bar: its redraws would be noise in a log
        self.total, self.enabled, self.done = total, enabled and sys.stdout.isatty(), 0
        self.t0, self.bar, self.task = time.time(), None, None

    def __call__(self, nbytes: int) -> None:
        self.done += nbytes
        if not self.enabled:
            return
        if self.bar is None and time.time() - self.t0 > 3:
            from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn
            self.bar = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                                TransferSpeedColumn(), TimeRemainingColumn(), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("transfer (rank 0)", total=self.total)
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
