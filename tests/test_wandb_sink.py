import dataclasses
import functools
import json
import sys
import warnings

import pytest

from kvlab.config import build, compose
from kvlab.records import RankPart, RequestRow, Summary, to_dict
from kvlab.spec import WandbSpec
from kvlab.wandb_sink import WandbSink, _row, group_name


@functools.cache
def _setup():
    return build(compose(["logger.wandb.mode=offline", "logger.wandb.project=kvlab-test"]))  # ctx0, ctx1 -> gen0


def _with(**wandb):
    s = _setup()
    return dataclasses.replace(s, logger=dataclasses.replace(s.logger, wandb=dataclasses.replace(s.logger.wandb,
                                                                                                 **wandb)))


RECORDS = [
    RequestRow(request=0, isl=1024, bytes=4096, seconds=0.01, gbps=0.4, verified=True, error=None),
    RequestRow(request=1, isl=2048, bytes=8192, seconds=0.02, gbps=0.4, verified=True, error=None),
]


@pytest.fixture(autouse=True)
def _no_env_mode(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_offline_writes_one_run_per_rank(tmp_path):
    wandb = pytest.importorskip("wandb")
    run_dir = tmp_path / "exp1"
    setup = _with(group="grp-abc")
    sinks = [WandbSink.create(setup, run_dir, 0), WandbSink.create(setup, run_dir, 2)]  # world ranks: ctx0, gen0
    assert all(s.active for s in sinks)
    for rec in RECORDS:
        for s in sinks:
            s.log_request(rec)
    sinks[0].log_summary(Summary(total_bytes=12288, gbps=0.4, ctx={"tp": 2}, predicted_s=None))
    for s in sinks:
        s.finish()
    wandb.teardown()  # the service writes the run files; a worker process does this at exit
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2
    # offline runs keep everything in one protobuf record log; its strings are stored as they are
    logs = {}
    for r in runs:
        (log,) = r.glob("*.wandb")
        data = log.read_bytes()
        name = b"ctx0" if b"ctx0" in data else b"gen0"
        logs[name] = data
    assert set(logs) == {b"ctx0", b"gen0"}
    for data in logs.values():
        for s in (b"grp-abc", b"kvlab-test", b"tiny_gqa", b"request/gbps"):  # group, project, config, metrics
            assert s in data, s
    assert b"total_bytes" in logs[b"ctx0"] and b"total_bytes" not in logs[b"gen0"]
    assert list((run_dir / "wandb").glob("offline-run-*/files/media/table/requests_*.table.json"))

def test_summary_table_holds_the_merged_results(tmp_path):
    wandb = pytest.importorskip("wandb")
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(to_dict(r)) + "\n" for r in RECORDS))
    sink = WandbSink.create(_setup(), tmp_path, 0)
    sink.log_request(RankPart(request=0, isl=1024, side="ctx", rank=0, bytes=1))  # this rank's part only
    sink.log_summary(Summary(total_bytes=1))
    sink.finish()
    wandb.teardown()
    tables = list(tmp_path.glob("wandb/offline-run-*/files/media/table/requests_*.table.json"))
    assert len(tables) == 1
    table = json.loads(tables[0].read_text())
    assert len(table["data"]) == 2 and "gbps" in table["columns"]


def test_disabled_writes_nothing(tmp_path):
    sink = WandbSink.create(_with(mode="disabled"), tmp_path, 0)
    assert not sink.active
    sink.log_request(RECORDS[0])
    sink.log_summary(Summary(total_bytes=1))
    sink.finish()
    assert list(tmp_path.iterdir()) == []


def test_env_switch_disables(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert not WandbSink.create(_setup(), tmp_path, 2).active
    assert list(tmp_path.iterdir()) == []


def test_without_wandb_installed_is_a_noop(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError (wandb is an extra)
    with pytest.warns(UserWarning, match=r"wandb is not installed.*kvlab\[wandb\]"):
        assert not WandbSink.create(_setup(), tmp_path, 0).active  # rank 0 says it once for the run
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sink = WandbSink.create(_setup(), tmp_path, 2)
    assert not sink.active
    sink.log_request(RECORDS[0])
    sink.finish()
    assert list(tmp_path.iterdir()) == []


def test_rank_parts_get_their_rate():
    part = RankPart(request=3, isl=10, side="gen", rank=0, start=10.0, end=10.5, bytes=10**9, wire=[(10.0, 10.5)])
    assert _row(part)["seconds"] == 0.5 and _row(part)["gbps"] == 2.0
    assert _row(RECORDS[0])["gbps"] == 0.4  # merged rows already have both
    assert "gbps" not in _row(RankPart(request=3, isl=10, side="gen", rank=0, start=10.0, bytes=10**9))


def test_group_is_shared_by_ranks_and_sweep_jobs_stay_apart(tmp_path):
    assert group_name(WandbSpec(), tmp_path / "outputs" / "abc") == "abc"
    assert group_name(WandbSpec(), tmp_path / "multirun" / "2025-01-01_10-00-00" / "3") == "2025-01-01_10-00-00-3"
    assert group_name(WandbSpec(group="mine"), tmp_path / "x") == "mine"


def test_summary_logs_serving_histograms(tmp_path):
    wandb = pytest.importorskip("wandb")
    rows = [dataclasses.replace(r, ttft_s=0.1 * (i + 1), exposed_s=0.01) for i, r in enumerate(RECORDS)]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(to_dict(r)) + "\n" for r in rows))
    sink = WandbSink.create(_setup(), tmp_path, 0)
    sink.log_summary(Summary(total_bytes=1, serving={"ttft_s": {"p50": 0.15}}))
    sink.finish()
    wandb.teardown()
    (log,) = tmp_path.glob("wandb/offline-run-*/*.wandb")
    data = log.read_bytes()
    assert b"serving/ttft_s" in data and b"serving/exposed_s" in data and b"serving/queue_s" not in data
    assert b"serving.ttft_s.p50" in data
