"""The wandb sink as a team reads its dashboard: one run per job (rank 0's), grouped per experiment or sweep,
named for what the sweep varied, tagged, with the merged summary, requests and percentiles and no raw
wall-clock stamps; warnings are one kvlab line; the offline files read back (kvlab.analysis.wandb_read) into the
table kvlab.analysis.sweeps plots, and a real sweep's jobs form one group."""
import dataclasses
import functools
import json
import sys

import pytest
import yaml

from kvlab.analysis import sweeps as analysis
from kvlab.analysis import wandb_read
from kvlab.config.schema import build, compose
from kvlab.model.spec import WandbSpec
from kvlab.rank.wandb_sink import EPOCH, WandbSink, group_name, job_name
from kvlab.results.records import RequestRow, Summary, to_dict


@functools.cache
def _setup():
    return build(compose(["logger.wandb.mode=offline", "logger.wandb.project=kvlab-test"]))


def _with(**wandb):
    s = _setup()
    return dataclasses.replace(s, logger=dataclasses.replace(s.logger, wandb=dataclasses.replace(s.logger.wandb,
                                                                                                 **wandb)))


def _rows(n):
    return [RequestRow(request=i, isl=1024, bytes=4096, seconds=0.01, gbps=0.4, verified=True, start=1.8e9 + i,
                       end=1.8e9 + i + 0.01, ttft_s=0.1 * (i + 1), exposed_s=0.01) for i in range(n)]


@pytest.fixture(autouse=True)
def _no_env_mode(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")


def _sweep_job(root, job, overrides, task, params=None):
    d = root / str(job)
    (d / ".hydra" / "rank0").mkdir(parents=True)
    (d / ".hydra" / "rank0" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (root / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"overrides": {"task": task},
                                                                  "sweeper": {"params": params or {}}}}))
    return d


def test_groups_and_names_say_what_the_sweep_was(tmp_path):
    assert group_name(WandbSpec(), tmp_path / "outputs" / "abc") == "abc"
    assert group_name(WandbSpec(group="mine"), tmp_path / "x") == "mine"
    root = tmp_path / "multirun" / "2026-01-01_10-00-00"
    task = ["+experiment=rate_sweep", "logger=quiet"]
    params = {"transfer": "chunked,layerwise", "workload.rate": "8.0,16.0", "repeat": "0,1"}
    d = _sweep_job(root, 3, ["transfer=layerwise", "workload.rate=16.0", "repeat=1", *task], task, params)
    assert group_name(WandbSpec(), d) == "rate_sweep-2026-01-01_10-00-00"  # every job of the sweep, not per job
    assert job_name(d) == "transfer=layerwise workload.rate=16.0 repeat=1"  # what was varied, not logger=quiet
    plain = tmp_path / "multirun" / "2026-01-02_10-00-00"
    d = _sweep_job(plain, 0, ["ctx.tp=2", "logger=quiet"], ["ctx.tp=1,2", "logger=quiet"])
    assert group_name(WandbSpec(), d) == "2026-01-02_10-00-00" and job_name(d) == "ctx.tp=2"


def test_one_run_per_job_with_the_merged_results_and_no_stamps(tmp_path):
    wandb = pytest.importorskip("wandb")
    rows = _rows(25)
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(to_dict(r)) + "\n" for r in rows))
    assert not WandbSink.create(_setup(), tmp_path, 2).active  # only rank 0 logs
    sink = WandbSink.create(_setup(), tmp_path, 0)
    sink.log_summary(Summary(total_bytes=1, serving={"ttft_s": {"p90": 0.15}}, goodput=2.0))
    sink.finish()
    wandb.teardown()
    (path,) = wandb_read.run_files(tmp_path)
    run = wandb_read.read_run(path)
    assert run["group"] == tmp_path.name and "tiny_gqa" in run["tags"] and "chunked" in run["tags"]
    assert run["summary"]["serving.ttft_s.p90"] == 0.15 and run["summary"]["goodput"] == 2.0
    logged = {k.split("/_")[0] for k in run["summary"]}  # a table's and a histogram's parts under their key
    assert "requests" in logged and "serving/ttft_s" in logged  # 25 requests: a histogram
    keys = set(run["summary"])
    assert "request/ttft_s" in keys and not any(k.removeprefix("request/") in EPOCH for k in keys)


def test_disabled_writes_nothing(tmp_path):
    sink = WandbSink.create(_with(mode="disabled"), tmp_path, 0)
    assert not sink.active
    sink.log_summary(Summary(total_bytes=1))
    sink.finish()
    assert list(tmp_path.iterdir()) == []


def test_without_wandb_or_a_key_one_kvlab_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError (wandb is an extra)
    assert not WandbSink.create(_setup(), tmp_path, 0).active
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ['kvlab: logger.wandb.mode=offline: wandb is not installed; pip install -e ".[wandb]" (the wandb '
                   'extra); no wandb run is written (logger=quiet turns it off)']
    assert not WandbSink.create(_with(mode="auto"), tmp_path, 0).active  # the default: not asked, so no word
    assert capsys.readouterr().err == ""
    monkeypatch.delitem(sys.modules, "wandb")
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    monkeypatch.setenv("HOME", str(tmp_path))
    sink = WandbSink.create(_with(mode="online"), tmp_path / "run", 0)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvlab: logger.wandb.mode=online: no wandb API key")
    sink.finish()


@pytest.mark.slow
def test_a_sweeps_offline_runs_form_one_group(tmp_path, kvlab_cli):
    pytest.importorskip("wandb")
    sweep, scratch = tmp_path / "sweep", tmp_path / "tmp"
    scratch.mkdir()
    p = kvlab_cli("run", "-m", "parallel=same", "workload.requests=2", "workload.isl=1024", "workload.arrival=poisson",
                  "serving.slo.ttft_ms=1000", "transfer=chunked,layerwise", "repeat=0,1", f"hydra.sweep.dir={sweep}",
                  cwd=tmp_path, timeout=900, env={"TMPDIR": str(scratch)})
    assert p.returncode == 0, p.stderr
    # the ranks end with os._exit, past wandb's own clean-up: what it staged went with each job's ranks
    assert not list(scratch.iterdir())
    df = analysis.load_wandb(sweep)
    assert len(df) == 4 and df["group"].nunique() == 1 and df["group"].iloc[0] == "sweep"  # one run per job
    assert sorted(df["name"]) == sorted(f"transfer={s} repeat={r}" for s in ("chunked", "layerwise") for r in (0, 1))
    assert set(df.attrs["swept"]) == {"transfer", "repeat"}
    assert (df["strategy"].str.cat() and set(df["strategy"]) == {"chunked", "layerwise"})
    assert df["serving.ttft_s.p90"].notna().all() and df["goodput"].notna().all()
    fig = analysis.plot_wandb_panels(df)  # the standard panels straight from the files, no filtering by hand
    assert len(fig.axes) == 3 and all(ax.containers for ax in fig.axes)


@pytest.mark.slow
def test_the_first_run_without_the_wandb_extra_warns_about_nothing(tmp_path, kvlab_cli):
    """The default logger (logger.wandb.mode=auto) on an install that did not bring wandb: not a word of it."""
    import os
    from pathlib import Path

    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "wandb.py").write_text("raise ImportError('not installed')\n")
    root = Path(__file__).resolve().parents[1]
    env = {"PYTHONPATH": os.pathsep.join([str(blocked), str(root), os.environ.get("PYTHONPATH", "")])}
    p = kvlab_cli("run", f"hydra.run.dir={tmp_path / 'run'}", "workload.requests=1", env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stderr == "" and "wandb" not in p.stdout, p.stderr
    assert not (tmp_path / "run" / "wandb").exists()
