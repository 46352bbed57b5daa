"""A sweep's end (kvlab.results.sweep_table, kvlab.cli.sweep_end): one table of what the sweep varied against the
figures, also as sweep.csv; each job's own output one line; a warning every job would give, given once."""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
import yaml

from kvlab.results import sweep_table
from kvlab.results.records import Summary, to_dict

ROOT = Path(__file__).resolve().parents[1]


def _job(sweep: Path, n: int, overrides: list[str], summary: Summary | None) -> None:
    d = sweep / str(n)
    (d / ".hydra" / "rank0").mkdir(parents=True)
    (d / ".hydra" / "rank0" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if summary is not None:
        (d / "summary.json").write_text(json.dumps(to_dict(summary)))


def test_the_table_keeps_the_varied_keys_and_the_figures_any_job_has(tmp_path):
    (tmp_path / "multirun.yaml").write_text("{}")
    serving = {"ttft_s": {"p50": 0.1, "p90": 0.2}, "exposed_s": {"p90": 0.05}}
    _job(tmp_path, 0, ["transfer=chunked", "workload.requests=2"],
         Summary(verified=True, requests=2, total_bytes=2**20, gbps=1.5, link_ratio=0.5, serving=serving))
    _job(tmp_path, 1, ["transfer=layerwise", "workload.requests=2"], None)  # died before its merge
    varied, rows = sweep_table.collect(tmp_path)
    assert varied == ["transfer"]  # workload.requests is the same in every job
    assert rows[0]["ttft_ms.p90"] == pytest.approx(200.0) and rows[0]["status"] == "ok"
    assert rows[1]["gbps"] is None and rows[1]["status"].startswith("no summary")
    path = sweep_table.write_csv(tmp_path, varied, rows)
    got = list(csv.DictReader(path.open()))
    assert [r["transfer"] for r in got] == ["chunked", "layerwise"] and got[1]["gbps"] == ""
    from rich.console import Console

    texts = {}
    for width in (160, 70):
        console = Console(width=width, record=True)
        console.print(sweep_table.render(varied, rows, "t"))
        texts[width] = console.export_text()
        assert "goodput" not in texts[width]  # no job had an SLO: the empty column is left out
        assert max(len(line) for line in texts[width].splitlines()) <= width  # it fits, folding cells
    assert "status" in texts[160] and "no summary" in texts[160]


@pytest.mark.slow
def test_a_sweep_ends_with_its_table_and_warns_once(tmp_path, kvlab_cli):
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "wandb.py").write_text("raise ImportError('not installed')\n")  # a machine without the wandb extra
    env = {"PYTHONPATH": os.pathsep.join([str(blocked), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    sweep = tmp_path / "sweep"
    p = kvlab_cli("run", "-m", "transfer=chunked,layerwise", "workload.requests=2", "logger.wandb.mode=offline",
                  "logger.progress=false", f"hydra.sweep.dir={sweep}", env=env, timeout=400)
    assert p.returncode == 0, p.stderr
    # asked for by name and missing: said once for the sweep, not once per job
    assert p.stderr.count("logger.wandb.mode=offline: wandb is not installed") == 1, p.stderr
    rows = list(csv.DictReader((sweep / "sweep.csv").open()))
    assert [(r["job"], r["transfer"], r["verified"]) for r in rows] == [("0", "chunked", "True"),
                                                                       ("1", "layerwise", "True")]
    for r in rows:
        assert float(r["gbps"]) > 0 and float(r["ttft_ms.p90"]) >= float(r["ttft_ms.p50"]) > 0
    out = p.stdout
    assert "kvlab sweep: 2 jobs" in out and f"sweep table in {sweep / 'sweep.csv'}" in out
    assert out.count("MiB in 2 requests: ") == 2  # each job one line, not its tables
    assert "serving figures" not in out


@pytest.mark.slow
def test_a_sweep_through_submitits_launcher(tmp_path, kvlab_cli):
    """hydra/launcher=submitit_local: each job one kvlab run in a process submitit starts (on a cluster,
    submitit_slurm: one per allocation), the sweep's table once they all ended."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the cluster extra is not installed")
    sweep = tmp_path / "sweep"
    p = kvlab_cli("run", "-m", "hydra/launcher=submitit_local", "transfer=chunked,layerwise", "workload.requests=2",
                  "logger=quiet", f"hydra.sweep.dir={sweep}", timeout=500)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Submitit 'local' sweep output dir" in p.stdout + p.stderr
    logs = sorted((sweep / ".submitit").rglob("*_log.out"))
    assert len(logs) == 2  # one submitit job per sweep job, each with its own output
    assert all("MiB in 2 requests: " in log.read_text() for log in logs)
    rows = list(csv.DictReader((sweep / "sweep.csv").open()))
    assert sorted((r["transfer"], r["verified"], r["status"]) for r in rows) == [("chunked", "True", "ok"),
                                                                                ("layerwise", "True", "ok")]
    assert "kvlab sweep: 2 jobs" in p.stdout
