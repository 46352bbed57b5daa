"""Records round-trip through their files, old files (no schema version) still read, and the config a run
writes rebuilds the same specs."""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kvlab.config.schema import Config, Setup, build, compose, schema
from kvlab.results import records
from kvlab.results.records import PartFile, Peak, RankPart, RequestRow, Summary, TimelineRow

ROOT = Path(__file__).resolve().parents[1]


def test_a_run_directory_round_trips(tmp_path):
    part = PartFile(rank=2, side="gen", side_rank=0,
                    parts=[RankPart(request=7, isl=100, side="gen", rank=0, start=1.0, end=1.5, bytes=10,
                                    wire=[(1.0, 1.2)], layer_done={3: 1.4}, errors=["x"])],
                    failures={7: "why"}, peak=Peak(staging=64, extra=64))
    records.write_part(tmp_path, part)
    back = records.read_part(tmp_path, 2)
    assert back == part  # integer keys and tuples survive JSON
    assert isinstance(next(iter(back.failures)), int) and back.parts[0].wire == [(1.0, 1.2)]
    rows = [RequestRow(request=0, isl=4, bytes=8, verified=True), RequestRow(request=1, error="lost")]
    timeline = [TimelineRow(request=0, rank=0, layer=1, prefill_done_s=0.1, transfer_done_s=0.2)]
    summary = Summary(total_bytes=8, requests=2, failed_requests=[1], ctx={"tp": 2})
    records.write_run(tmp_path, rows, timeline, summary)
    assert records.read_rows(tmp_path) == rows
    assert records.read_timeline(tmp_path) == timeline
    assert records.read_summary(tmp_path) == summary
    assert json.loads((tmp_path / records.SUMMARY).read_text())["schema"] == records.SCHEMA


def test_files_without_a_version_read_as_version_0(tmp_path):
    (tmp_path / records.SUMMARY).write_text(json.dumps({"total_bytes": 5, "verified": True, "gone_field": 1}))
    s = records.read_summary(tmp_path)
    assert (s.schema, s.total_bytes, s.verified, s.silent_ranks) == (0, 5, True, [])


@pytest.mark.parametrize("name", ["bench_h200x2.json", "bench_h200x2_earlier_kernels.json", "mismatched_h200x2.json"])
def test_committed_bench_results_read_and_render(name):
    path = ROOT / "results" / name
    rep = records.read_bench(path)
    raw = json.loads(path.read_text())
    assert len(rep.transfers) == len(raw["transfers"]) > 0
    for t, r in zip(rep.transfers, raw["transfers"], strict=True):
        assert t.summary.schema == 0 and t.summary.total_bytes == r["summary"]["total_bytes"]
        assert len(t.requests) == len(r.get("requests", []))
        assert all(a.bytes == b["bytes"] for a, b in zip(t.requests, r.get("requests", []), strict=True))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "results_table.py"), str(path)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    first = rep.transfers[0]
    assert f"| {first.name.replace('transfer.', '')} | {first.summary.total_bytes / 2**30:.2f} |" in out


def test_schema_is_derived_from_the_specs():
    for f in dataclasses.fields(Setup):
        assert f.name in {g.name for g in dataclasses.fields(Config)}, f.name
    ctx_schema = {f.name for f in dataclasses.fields(schema(type(build(compose()).ctx)))}
    assert "name" not in ctx_schema and {"tp", "pp", "dp", "layer_split"} <= ctx_schema  # the side is its key
    setup = build(compose(["ctx.pp=2", "ctx.layer_split=[3,1]", "workload.isl_list=[5,6]", "cost=cpu"]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        setup.workload.isl = 1  # type: ignore[misc]
    # what a run records as its configuration builds the same specs again
    assert build(OmegaConf.merge(OmegaConf.structured(Config), setup.to_dict())) == setup


def test_a_bench_report_round_trips(tmp_path):
    rep = records.BenchReport(date="2026-12-01T00:00:00+00:00", device="H200", gpus=2, raw_nccl={"8": {"gbps": 1.0}},
                              transfers=[records.BenchTransfer(name="x", summary=Summary(total_bytes=8),
                                                               requests=[RequestRow(request=0, bytes=8)],
                                                               ratio_to_raw=0.5)])
    records.write_bench(tmp_path / "b.json", rep)
    assert records.read_bench(tmp_path / "b.json") == rep


def test_a_summary_says_where_and_from_what_it_was_measured():
    import socket
    import subprocess

    import torch

    from kvlab.core.paths import provenance

    p = provenance()
    assert p["host"] == socket.gethostname() and len(p["load_avg"]) == 3
    assert p["versions"]["torch"] == torch.__version__ and p["versions"]["python"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent).stdout.strip()
    assert head and p["commit"].split("+")[0] == head


def test_a_summary_says_how_its_ranks_shared_their_gpus(tmp_path, monkeypatch):
    import io

    from rich.console import Console

    from kvlab.config import devices
    from kvlab.results import metrics

    setup = build(compose(["device=cpu"]))
    assert devices.gpu_sharing(setup) == {"ranks_per_gpu": 0, "mps": None}
    # the MPS daemon's pipe, where CUDA_MPS_PIPE_DIRECTORY says, and only while a process reads it: a daemon that
    # ended uncleanly leaves the pipe, and CUDA processes then run without MPS
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    control = tmp_path / "control"
    assert devices.mps_control() is None
    os.mkfifo(control)
    assert devices.mps_control() is None
    hold = "import os, sys; os.open(sys.argv[1], os.O_RDONLY | os.O_NONBLOCK); print(flush=True); sys.stdin.read()"
    reader = subprocess.Popen([sys.executable, "-c", hold, str(control)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        reader.stdout.readline()  # it holds the pipe open
        assert devices.mps_control() == str(control)
        assert devices.mps_control() == str(control)  # the probe leaves the reader as it was
    finally:
        reader.communicate(timeout=60)
    assert devices.mps_control() is None
    # a socket endpoint: live while something listens on it
    control.unlink()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(control))
        server.listen(1)
        assert devices.mps_control() == str(control)
    assert devices.mps_control() is None
    # a live daemon whose socket is of another type than a stream, or whose queue of connections is full, is live:
    # only a refusal means the daemon is gone
    for kind in (socket.SOCK_SEQPACKET, socket.SOCK_DGRAM):
        control.unlink()
        with socket.socket(socket.AF_UNIX, kind) as server:
            server.bind(str(control))
            if kind != socket.SOCK_DGRAM:
                server.listen(1)
            assert devices.mps_control() == str(control), kind
        assert devices.mps_control() is None, kind
    control.unlink()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(control))
        server.listen(0)
        queued = []
        try:
            for _ in range(4096):  # fill the queue: the next connection would wait
                client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                client.setblocking(False)
                queued.append(client)
                client.connect(str(control))
            raise AssertionError("4,096 connections queued on a listen(0) socket")
        except BlockingIOError:
            assert devices.mps_control() == str(control)
        finally:
            for client in queued:
                client.close()

    def printed(sharing: dict) -> str:
        out = io.StringIO()
        metrics.print_table([], Summary(gpu_sharing=sharing), Console(file=out, width=200))
        return out.getvalue()

    assert "took turns" in printed({"ranks_per_gpu": 3, "mps": False})
    # side by side under MPS, alone on a GPU, on CPUs, or a summary written before the field: no line
    for sharing in ({"ranks_per_gpu": 3, "mps": True}, {"ranks_per_gpu": 1, "mps": False},
                    {"ranks_per_gpu": 0, "mps": None}, {}):
        assert "took turns" not in printed(sharing), sharing
    # the field round-trips through the run's files
    summary = Summary(gpu_sharing={"ranks_per_gpu": 3, "mps": False})
    records.write_run(tmp_path, [], [], summary)
    assert records.read_summary(tmp_path).gpu_sharing == {"ranks_per_gpu": 3, "mps": False}
