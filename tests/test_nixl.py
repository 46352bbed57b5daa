"""transport=nixl and its reference: raw NIXL WRITEs between processes over UCX (DRAM on CPUs)."""
from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from collections import deque
from pathlib import Path
from types import SimpleNamespace as ns

import numpy as np
import pytest
import torch
from conftest import E2E, GEN0_NAMES_DEAD_CTX1, LOST_TO_CTX1, check_figures
from hypothesis import given, settings
from hypothesis import strategies as st
from test_faults import CORRUPTION, FAULTY, HANG_S, TIMEOUT_S, flips_caught
from test_faults import _gave_up_in_time as gave_up_in_time

pytest.importorskip("nixl_cu13", reason='the nixl extra is not installed (pip install -e ".[nixl]")')

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.parametrize("writers", [1, 2])
def test_raw_write_one_and_many_descriptors_verified(writers, tmp_path):
    """The benchmark's reference itself: the bytes land where the shuffled descriptors say, on the target."""
    out = tmp_path / "raw.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "nixl_raw.py"), "--mib", "1", "--descs", "1", "64",
                    "--writers", str(writers), "--out", str(out)], check=True, timeout=240)
    report = json.loads(out.read_text())
    assert report["nixl"] and report["ucx"]
    rows = report["cases"]
    assert [(r["bytes"], r["descriptors"], r["piece_bytes"]) for r in rows] == [
        (1 << 20, writers, (1 << 20) // writers), (1 << 20, 64, 1 << 14)]
    assert all(r["verified"] and r["seconds"] > 0 for r in rows), rows


# -- transport=nixl end to end ---------------------------------------------------------------------
NIXL = ["logger=quiet", "transport=nixl"]
# (id, overrides): every strategy in both modes, GQA, MLA (mismatched TP), DSA (indexer), sliding
# windows, PP mismatch and fragmented block tables
CASES = [
    ("gqa-tp2-tp1-chunked", ["transfer=chunked", "transfer.slot_mib=0.25"]),
    ("mla-tp2-tp1-layerwise", ["model=tiny_mla", "transfer=layerwise", "workload.isl=2000", "transfer.slot_mib=0.5"]),
    ("dsa-tp1-tp2-zerocopy", ["model=tiny_dsa", "ctx.tp=1", "gen.tp=2", "transfer=zerocopy", "workload.isl=1200",
                              "transfer.slot_mib=0.3"]),
    ("gqa-tp1-tp3-naive", ["parallel=tp1_to_tp2", "gen.tp=3", "transfer=naive", "workload.isl=1000"]),
    ("swa-pp2-tp2-fragmented", ["model=tiny_swa", "parallel=pp2_to_tp2", "cache.fragmentation=0.7",
                                "workload.isl=1500", "transfer.slot_mib=0.1", "workload.concurrency=3"]),
]
MODES = ["staged", "direct"]


def _rows(run_dir: Path) -> list[dict]:
    check_figures(run_dir)
    return [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]


@pytest.mark.slow
@settings(max_examples=3, **E2E)
@given(case=st.sampled_from(CASES), mode=st.sampled_from(MODES))
def test_nixl_end_to_end_verified(case, mode, tmp_path_factory):
    overrides, tmp_path = case[1], tmp_path_factory.mktemp("nixl")
    from kvlab.api import run_transfer
    from kvlab.config.schema import build, compose
    from kvlab.config.workload import make_requests
    from kvlab.model.plan import plan

    summary = run_transfer(overrides + NIXL + [f"transport.mode={mode}"], tmp_path)
    assert summary["verified"], summary
    assert summary["failed_requests"] == [] and summary["errors"] == []
    setup = build(compose(overrides + NIXL))
    rows = _rows(tmp_path)
    assert len(rows) == setup.workload.requests == summary["requests"]
    for req, row in zip(make_requests(setup), rows):
        assert row["bytes"] == sum(s.nbytes for s in plan(setup.model, setup.ctx, setup.gen, req))
        assert row["verified"]
        if mode == "staged":  # one WRITE of one descriptor per chunk
            assert row["descriptors"] == row["chunks"]
        else:  # one descriptor per run (merged where contiguous on both sides), nothing staged on the gen side
            assert row["descriptors"] > row["chunks"] and row["in_place_chunks"] == row["chunks"]
    if mode == "direct":
        assert summary["peak_staging_bytes"] == 0
    assert summary["link"]["reference"] == "nixl" and summary["link_ratio"] > 0  # the run's own raw WRITEs


@pytest.mark.slow
@settings(max_examples=1, **E2E)
@given(mode=st.sampled_from(MODES))
def test_every_nixl_run_reports_raw_nixl_writes_of_its_chunks_as_its_link(mode, tmp_path):
    """The in-run reference: raw WRITEs of the run's largest chunk between its own pairs (3 -> 2: ctx1
    feeds both gen ranks), timed on every rank, the slowest taken."""
    from kvlab.api import run_transfer
    from kvlab.config.schema import build, compose
    from kvlab.config.workload import plan_run
    from kvlab.rank import linkrate

    over = NIXL + [f"transport.mode={mode}", "ctx.tp=3", "gen.tp=2", "workload.isl=700", "transfer.slot_mib=0.05",
                   "workload.requests=2"]
    summary = run_transfer(over, tmp_path)
    assert summary["verified"], summary
    nbytes, n, pairs = linkrate.messages(plan_run(build(compose(over))).order)
    assert len(pairs) == 4
    link = summary["link"]
    assert link["reference"] == "nixl" and link["message_bytes"] == nbytes and link["messages"] == n * len(pairs)
    assert link["seconds"] > 0
    assert summary["link_gbps"] == pytest.approx(n * len(pairs) * nbytes / link["seconds"] / 1e9)
    assert summary["link_ratio"] == pytest.approx(summary["gbps"] / summary["link_gbps"])


class _Event:
    """A CUDA event's host side: not done until told."""

    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done


class _Agent:
    def __init__(self, inbox=None):
        self.sent, self.posted, self.inbox = [], [], inbox or {}

    def send_notif(self, agent, msg):
        self.sent.append((agent, msg))

    def get_new_notifs(self):
        out, self.inbox = self.inbox, {}
        return out

    def get_xfer_descs(self, d, mem):
        return d

    def initialize_xfer(self, op, local, remote, agent):
        return object()

    def transfer(self, x, notif):
        self.posted.append((x, notif))
        return "PROC"


def _bare(side: str):
    """A nixl transport with a fake agent and one peer, as connect leaves it (no processes)."""
    from kvlab.transports.nixl import Nixl, Peer

    t = Nixl.__new__(Nixl)
    t.side, t.mode, t.per_chunk, t.window, t.spin_s = side, "staged", False, 2, 0.0
    t.inbox, t.waiting, t.xfers = {}, [], {}
    t.unannounced = deque()
    t.peers = {0: Peer("peer0")}
    t.agent = _Agent()
    t.ctx = ns(clock=ns(mark=lambda: 0.0))
    return t


def _chunk(seq: int, nbytes: int = 64):
    return ns(request=0, seq=seq, src=0, dst=0, nbytes=nbytes, rect=ns(pool="kv"))


def test_gen_announces_a_slot_only_after_its_last_unpack_has_run_without_waiting_for_it():
    """GPUs: the host does not block on the unpack; the announcement of the slot's next chunk (and of every
    chunk after it: announcements go in order) waits in the transport until the unpack's event has completed."""
    from kvlab.transports.nixl import Landing

    t = _bare("gen")
    ev = _Event()
    first = Landing(0, _chunk(0), None, True, 0.0, notice=b"R0.0 a", after=ev)
    second = Landing(1, _chunk(1), None, True, 0.0, notice=b"R0.1 b")
    t.unannounced.extend([first, second])
    t._announce()
    assert t.agent.sent == []
    ev.done = True
    t._announce()
    assert t.agent.sent == [("peer0", b"R0.0 a"), ("peer0", b"R0.1 b")] and not t.unannounced


def test_ctx_writes_a_chunk_once_packed_and_reposts_the_prepared_slot_write():
    """A packed chunk goes once the gen rank's room has arrived and its pack's event has completed (the
    host polls, it does not wait); a second chunk between the same two slots reuses the prepared WRITE."""
    from kvlab.config.faults import RankFaults
    from kvlab.transports.nixl import Write

    t = _bare("ctx")
    t.ctx.cache = ns(pools={"kv": ns(storage=torch.zeros(8, dtype=torch.uint8))})
    t.ctx.faults = RankFaults()  # none injected: the transfer's hooks do nothing
    slot = torch.zeros(64, dtype=torch.uint8)
    room = struct.pack("<QQ", 4096, 64)
    rec = ns(descriptors=0)
    ev = _Event()
    w = Write(0, _chunk(0), rec, slot, True, event=ev)
    t.waiting.append(w)
    t.agent.inbox = {"peer0": [b"R0.0 " + room]}
    t._pump()
    assert t.agent.posted == [] and t.waiting == [w]  # room is there, the pack is not done
    ev.done = True
    t._pump()
    assert [n for _, n in t.agent.posted] == [b"D0.0"] and w.kept and rec.descriptors == 1
    w2 = Write(4, _chunk(4), rec, slot, True)
    t.waiting.append(w2)
    t.agent.inbox = {"peer0": [b"R0.4 " + room]}
    t._pump()
    assert [n for _, n in t.agent.posted] == [b"D0.0", b"D0.4"] and w2.xfer is w.xfer and len(t.xfers) == 1


@pytest.mark.slow
def test_direct_merges_runs_that_continue_on_both_sides(tmp_path):
    """Identical layouts and consecutive blocks: every chunk's runs continue each other in both pools,
    so each chunk is one descriptor; fragmented block tables break them up."""
    from kvlab.api import run_transfer

    same = NIXL + ["transport.mode=direct", "parallel=same", "transfer=zerocopy", "workload.requests=1",
                   "workload.isl=2048", "transfer.slot_mib=0.5"]
    run_transfer(same, tmp_path / "a")
    (row,) = _rows(tmp_path / "a")
    assert row["verified"] and row["descriptors"] == row["chunks"] > 1
    run_transfer(same + ["cache.fragmentation=1.0"], tmp_path / "b")
    (frag,) = _rows(tmp_path / "b")
    assert frag["verified"] and frag["descriptors"] > frag["chunks"]


def test_coalesce_merges_only_runs_contiguous_on_both_sides():
    from kvlab.transports.direct import coalesce

    src = np.array([0, 10, 20, 100, 110], dtype=np.int64)
    dst = np.array([500, 510, 600, 610, 620], dtype=np.int64)
    length = np.array([10, 10, 10, 10, 10], dtype=np.int64)
    s, d, n = coalesce(src, dst, length)
    # 0-1 continue on both sides; 1-2 only on the ctx side; 2-3 only on the gen side; 3-4 on both
    assert s.tolist() == [0, 20, 100] and d.tolist() == [500, 600, 610] and n.tolist() == [20, 10, 20]


# -- failures --------------------------------------------------------------------------------------
@pytest.mark.slow
@settings(max_examples=1, **E2E)
@given(mode=st.sampled_from(MODES))
def test_killed_rank_ends_the_nixl_run_with_its_requests_named(mode, tmp_path, kvlab_cli):
    run_dir = tmp_path / "run"
    # ctx1 dies as it is about to start its 25th chunk: requests 0 and 1 are written, 2 and 3 in flight
    p = kvlab_cli("run", f"hydra.run.dir={run_dir}", *NIXL, f"transport.mode={mode}", *FAULTY, "fault.kill_rank=1",
                  "fault.kill_at_chunk=24", timeout=HANG_S)
    assert p.returncode == 3, p.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert not summary["verified"] and summary["silent_ranks"] == [1]
    # 0 and 1 are written by then, but a write is through only once ctx1 has seen it complete and said so: on a
    # loaded machine ctx1 may die with their last writes unseen, and then they fail too, named as 2-5 are
    failed = summary["failed_requests"]
    assert {2, 3, 4, 5} <= set(failed) <= set(range(6)), failed
    rows = {r["request"]: r for r in _rows(run_dir)}
    for rid in range(6):
        if rid not in failed:
            assert rows[rid]["verified"] and rows[rid]["error"] is None, rows[rid]
            continue
        assert re.match(LOST_TO_CTX1, rows[rid]["error"]), rows[rid]["error"]
    gen = json.loads((run_dir / "parts" / "rank2.json").read_text())
    # the gen rank gives up on ctx1: UCX reports the disconnect, or the deadline passes (or, waiting on ctx0,
    # it names ctx1 as the rank that died)
    assert re.fullmatch(rf"gen0: request \d+ chunk \d+ with ctx1: (not done within {TIMEOUT_S} s or peer gone|"
                        r"(notification|WRITE) failed: NIXL_ERR_REMOTE_DISCONNECT)", gen["errors"][0]) \
        or re.fullmatch(GEN0_NAMES_DEAD_CTX1, gen["errors"][0]), gen["errors"]
    gave_up_in_time(run_dir, [0, 2])
    for r in (0, 2):  # the survivors freed the failed requests' blocks
        assert json.loads((run_dir / "parts" / f"rank{r}.json").read_text())["held_blocks"] == 0


@pytest.mark.slow
@settings(max_examples=2, **E2E)
@given(case=st.sampled_from([c[0] for c in CORRUPTION]), mode=st.sampled_from(MODES))
def test_flipped_bytes_are_caught_and_located(case, mode, tmp_path_factory):
    """Staged: flipped in the slot (or a copy of an in-place chunk) as over p2p. Direct: a flip on the ctx
    rank goes out of a staging copy (the pool stays intact for the other gen ranks), a flip on the gen
    rank lands in its pool, where the runs put the byte."""
    _, overrides, flip_rank, want = next(c for c in CORRUPTION if c[0] == case)
    flips_caught(overrides + NIXL + [f"transport.mode={mode}"], flip_rank, want, tmp_path_factory.mktemp("flips"))


def test_without_the_extra_transport_nixl_is_one_line_naming_it(tmp_path, kvlab_cli):
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    for mod in ("nixl", "nixl_cu13"):  # shadow the installed package
        (blocked / f"{mod}.py").write_text("raise ImportError('not installed')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(blocked), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = kvlab_cli("run", f"hydra.run.dir={tmp_path / 'run'}", *NIXL, env=env)
    assert p.returncode == 2
    assert p.stderr.strip() == ('kvlab: error: transport=nixl: the NIXL package is not installed; '
                                'pip install -e ".[nixl]" (the nixl extra)'), p.stderr
    assert not (tmp_path / "run").exists()
    # what moves no bytes needs no transport package (kvlab.config.schema Setup.check_installed)
    for args in (["plan", f"hydra.run.dir={tmp_path / 'plan'}", "cost=cpu_fit"], ["run", "--help"],
                 ["run", "--cfg", "job"], ["sim", f"hydra.run.dir={tmp_path / 'sim'}", "workload.requests=8"]):
        p = kvlab_cli(*args, *NIXL, env=env)
        assert p.returncode == 0 and "not installed" not in p.stdout + p.stderr, (args, p.stderr)


def test_a_ucx_setting_the_backend_cannot_start_with_is_one_line_before_any_rank(tmp_path, kvlab_cli):
    p = kvlab_cli("run", f"hydra.run.dir={tmp_path / 'run'}", *NIXL, env={"UCX_TLS": "bogus"})
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("kvlab: error: UCX_TLS=bogus: NIXL's UCX backend does not start with UCX_TLS=bogus ("), \
        p.stderr
    assert "'bogus' is not available" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "run").exists()


def test_unknown_mode_is_one_line():
    from kvlab.config.schema import build, compose
    from kvlab.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^transport.mode=pull: use direct .* or staged"):
        build(compose(NIXL + ["transport.mode=pull"]))


@pytest.mark.parametrize(("override", "want"), [
    ("transport.pack_ctas=0", r"^transport.pack_ctas=0: use a positive number of CTAs, or null for one per SM$"),
    ("transport.progress_thread=3", r"^transport.progress_thread=3: use true .* or false")])
def test_bad_transport_options_are_one_line(override, want):
    from kvlab.config.schema import build, compose
    from kvlab.core.errors import ConfigError

    with pytest.raises(ConfigError, match=want):
        build(compose(NIXL + [override]))


@pytest.mark.slow
def test_nixl_with_its_progress_thread_verified(tmp_path):
    """NIXL's own thread completes the WRITEs and sends their notifications; the ranks still poll theirs."""
    from kvlab.api import run_transfer

    s = run_transfer(NIXL + ["transport.progress_thread=true", "transfer=layerwise", "workload.isl=1500",
                             "transfer.slot_mib=0.25"], tmp_path)
    assert s["verified"] and s["failed_requests"] == [] and s["link"]["reference"] == "nixl", s


# -- one GPU: every rank on it, VRAM registered, UCX between the processes (cuda_ipc) ---------------
GPU = ["logger=quiet", "transport=nixl", "device=cuda", "kernels=cuda", "workload.requests=3",
       "workload.concurrency=2", "workload.isl=3000", "transfer.slot_mib=0.25", "cache.fragmentation=0.3"]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("overrides", [["transfer=chunked", "ctx.tp=2", "gen.tp=1"],
                                       ["model=tiny_dsa", "transfer=layerwise", "ctx.tp=1", "gen.tp=2"]],
                         ids=["gqa-tp2-tp1-chunked", "dsa-tp1-tp2-layerwise"])
def test_nixl_on_one_gpu_verified(overrides, mode, tmp_path):
    from kvlab.api import run_transfer

    s = run_transfer(GPU + overrides + [f"transport.mode={mode}"], tmp_path)
    assert s["verified"] and s["kernels"] == "cuda", s
    if mode == "staged":  # nothing but the slots during transfers
        assert s["peak_extra_device_bytes"] <= s["peak_staging_bytes"] + (1 << 20), s
