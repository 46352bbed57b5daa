"""The places that cannot be written, the arguments Hydra would refuse too late, one command per directory,
and analysis on corrupt files: each ends as one line naming the place (or marks the run), nothing left behind."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kvlab.cli.commands import check_arguments, check_overrides
from kvlab.core.errors import ConfigError
from kvlab.results import records, rundir

UNWRITABLE = "/proc/1/kvlab"  # no mkdir there, whoever runs the tests (root ignores a read-only mode)


def test_a_value_split_by_the_shell_is_one_line_before_any_directory():
    line = check_arguments(["model=tiny_gqa", "hydra.run.dir=/tmp/a", "b"])
    assert line.startswith("b: not an override") and "\"hydra.run.dir='/tmp/a b'\"" in line


def test_non_ascii_unquoted_is_one_line_with_the_quoted_form():
    line = check_arguments(["hydra.run.dir=/tmp/ünï(x)"])
    assert line is not None and line.startswith("hydra.run.dir=/tmp/ünï(x): ") and "'/tmp/ünï(x)'" in line
    assert check_arguments(["hydra.run.dir='/tmp/ünï(x)'", "ctx.tp=1,2"]) is None


@pytest.mark.parametrize("name,words", [("n" * 300, "300-byte name"), ("/".join(["d" * 200] * 25), "4096 bytes")])
def test_run_directory_names_too_long(tmp_path, name, words):
    with pytest.raises(ConfigError, match=rf"^hydra.run.dir=.*characters\): .*{words}"):
        rundir.ensure_writable(tmp_path / name)


@pytest.mark.parametrize("place", ["file", UNWRITABLE])
def test_run_directory_that_cannot_be_made(tmp_path, place):
    where = tmp_path / "f" if place == "file" else Path(place)
    if place == "file":
        where.write_text("x")
    with pytest.raises(ConfigError, match=r"^hydra.run.dir=.*cannot create or write the run directory"):
        rundir.ensure_writable(where / "run" if place == "file" else where)


def test_unknown_transport_option_gets_the_transports_own_words():
    line = check_overrides(["transport=ipc", "transport.mode=direct"])
    assert line == "transport.mode=direct: transport=ipc has no such option; it takes shm_dir"


@pytest.mark.parametrize("place", ["file", UNWRITABLE])
def test_decode_cache_that_cannot_be_written(tmp_path, monkeypatch, place):
    where = tmp_path / "afile" if place == "file" else Path(place)
    if place == "file":
        where.write_text("x")
    monkeypatch.setenv("KVLAB_DECODE_CACHE", str(where))
    line = check_overrides(["check=decode", "model=tiny_gqa"])
    assert line.startswith(f"KVLAB_DECODE_CACHE={where}: cannot hold check=decode's reference caches"), line


@pytest.mark.slow
def test_decode_cache_refused_before_any_rank(kvlab_cli, tmp_path):
    (tmp_path / "afile").write_text("x")
    start = time.monotonic()
    out = kvlab_cli("run", "check=decode", "model=tiny_gqa", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path,
                    env={"KVLAB_DECODE_CACHE": str(tmp_path / "afile")}, timeout=120)
    print(f"KVLAB_DECODE_CACHE at a file: ended in {time.monotonic() - start:.1f} s")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "KVLAB_DECODE_CACHE" in out.stderr, out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("args", [["hydra.run.dir={d}/a", "b"], ["hydra.run.dir={d}/ünï"],
                                  ["hydra.run.dir={d}/" + "n" * 300]])
def test_cli_bad_places_leave_no_directory(kvlab_cli, tmp_path, args):
    start = time.monotonic()
    out = kvlab_cli("run", *[a.format(d=tmp_path) for a in args], cwd=tmp_path, timeout=120)
    print(f"{args}: ended in {time.monotonic() - start:.1f} s")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and out.stderr.startswith("kvlab: "), out.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_sim_refuses_a_directory_another_command_holds(kvlab_cli, tmp_path):
    run = tmp_path / "run"
    rundir.acquire(run)
    try:
        start = time.monotonic()
        out = kvlab_cli("sim", f"hydra.run.dir={run}", "workload.requests=8", cwd=tmp_path, timeout=120)
        print(f"kvlab sim into a held directory: ended in {time.monotonic() - start:.1f} s")
    finally:
        rundir.release(run)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "run.lock" in out.stderr + " run.lock", out.stderr
    assert not (run / "summary.json").exists()


def _run_dir(root: Path, name: str, rows: str, summary: dict | None = None) -> Path:
    d = root / name
    d.mkdir()
    (d / records.RESULTS).write_text(rows)
    if summary is not None:
        (d / records.SUMMARY).write_text(json.dumps(summary))
    return d


def test_load_results_names_a_corrupt_file_and_marks_its_run(tmp_path):
    from kvlab.analysis.sweeps import load_results

    good = json.dumps({"request": 0, "bytes": 10, "verified": True})
    _run_dir(tmp_path, "0", good + "\n")
    bad = _run_dir(tmp_path, "1", good + "\n{\"request\": 1, \"bytes\n")
    with pytest.warns(UserWarning, match=r"1/results.jsonl: line 2 is not a kvlab RequestRow"):
        df = load_results(tmp_path)
    assert len(df) == 1 and list(df.attrs["corrupt"]) == [str(bad)]


def test_a_summary_whose_figures_are_strings_is_corrupt(tmp_path):
    from kvlab.analysis.sweeps import load_run

    d = _run_dir(tmp_path, "0", "", {"transport": "p2p", "requests": "four", "ttft_s_p50": "fast"})
    with pytest.warns(UserWarning, match="summary.json: not a kvlab summary"):
        row = load_run(d)
    assert row["status"].startswith("corrupt summary")


def test_load_wandb_names_a_corrupt_file(tmp_path):
    from kvlab.analysis import wandb_read
    from kvlab.analysis.sweeps import load_wandb

    f = tmp_path / "wandb" / "offline-run-20260101_000000-abc" / "run-abc.wandb"
    f.parent.mkdir(parents=True)
    f.write_bytes(b"\x00garbage" * 50)
    if f not in list(wandb_read.run_files(tmp_path)):
        pytest.skip("wandb_read looks for run files elsewhere")
    with pytest.warns(UserWarning, match="run-abc.wandb: not a readable wandb run"):
        df = load_wandb(tmp_path)
    assert df["status"].iloc[0].startswith("corrupt wandb file")


@pytest.mark.slow
@pytest.mark.parametrize("redirect", [">/dev/full", ">&-"])
def test_a_verified_run_with_stdout_full_or_closed_is_no_failed_run(kvlab_cli, tmp_path, redirect):
    import shlex
    import subprocess

    argv = kvlab_cli.argv("run", "model=tiny_gqa", "workload.requests=2", "workload.isl=256",
                          f"hydra.run.dir={tmp_path / 'run'}")
    start = time.monotonic()
    out = subprocess.run(["bash", "-c", f"{shlex.join(argv)} {redirect}"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=180)
    print(f"kvlab run {redirect}: ended in {time.monotonic() - start:.1f} s")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert records.read_summary(tmp_path / "run").verified


def test_guarded_stream_drops_what_cannot_be_written():
    from kvlab.core.streams import Guarded

    with open("/dev/full", "w") as full:
        g = Guarded(full)
        assert g.write("x" * 100_000) == 100_000
        g.flush()
        assert g.dropped >= 1


@pytest.mark.slow
def test_ipc_rank0_dying_mid_transfer_leaves_ctx1_its_records(kvlab_cli, tmp_path, own_shm):
    """The store's host is rank 0: once it is gone a store call fails its request (kvlab.transports.ipc.RequestStore)
    instead of throwing away what ctx1 did."""
    run = tmp_path / "run"
    start = time.monotonic()
    out = kvlab_cli("run", "transport=ipc", f"transport.shm_dir={own_shm}", "model=tiny_gqa", "ctx.tp=2",
                    "workload.requests=8", "workload.isl=2048", "fault.kill_rank=0", "fault.kill_at_chunk=6",
                    "transfer.timeout_s=10", "logger=quiet", f"hydra.run.dir={run}", cwd=tmp_path, timeout=240)
    print(f"ipc, rank 0 killed mid-transfer: ended in {time.monotonic() - start:.1f} s")
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    part = records.read_part(run, 1)
    assert part is not None and part.parts, out.stderr[-2000:]  # ctx1's records, not an empty part
    assert not any("before its transfers" in e for e in part.errors), part.errors
    assert list(own_shm.iterdir()) == []  # the dead rank 0's pools too: unlinked at the handshake


def test_ipc_pool_of_a_killed_rank_is_swept_by_the_launcher(tmp_path):
    """A ctx rank killed right after creating its pool file: the launcher's sweep_after removes it at the end."""
    import signal
    import subprocess
    import sys

    from kvlab.config.schema import build, compose
    from kvlab.transports import ipc

    code = ("import sys, time; from kvlab.transports.ipc import create_locked, POOL_PREFIX; "
            f"create_locked({str(tmp_path)!r} + '/' + POOL_PREFIX + 'test-ctx0-kv', 4096); "
            "print('made', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "made"
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    setup = build(compose(["transport=ipc", f"transport.shm_dir={tmp_path}", "model=tiny_gqa"]))
    assert ipc.Ipc.sweep_after(setup) == [f"{ipc.POOL_PREFIX}test-ctx0-kv"]
    assert list(tmp_path.iterdir()) == []


def test_pair_runs_cuts_writes_where_either_side_does():
    import numpy as np

    from kvlab.transports.direct import pair_runs

    # source runs of 8 and 8 bytes, destination runs of 4, 8 and 4: writes of 4, 4, 4, 4 within both
    src, dst, length = pair_runs(np.array([100, 300]), np.array([0, 8]), np.array([1000, 2000, 3000]),
                                 np.array([0, 4, 12]), np.array([4, 8, 4]))
    assert length.tolist() == [4, 4, 4, 4]
    assert src.tolist() == [100, 104, 300, 304] and dst.tolist() == [1000, 2000, 2004, 3000]
