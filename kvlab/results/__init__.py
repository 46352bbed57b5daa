"""What a run records: the typed records and the files they are written to (``records``), the
per-request metrics a rank measures (``metrics``), and the run directory and its lock (``rundir``).
Beside kvlab.memory (neither imports the other); imports kvlab.config, kvlab.model and kvlab.core."""
