"""Injected faults over gloo: a rank that dies or stalls mid-transfer ends the run cleanly and in
bounded time, with the failed requests named; bytes flipped in flight are caught by verification,
which names the element (request, pool, layer, component, head, token, byte)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import E2E, GEN0_NAMES_DEAD_CTX1, LOST_TO_CTX1, check_figures
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.api import run_transfer
from kvlab.config.schema import build, compose
from kvlab.config.workload import plan_run
from kvlab.memory.fill import locate
from kvlab.model.state import CacheState

QUIET = ["logger=quiet"]
TIMEOUT_S = 4
# default pipeline (tiny_gqa, ctx0 + ctx1 -> gen0) cut into 0.5 MiB chunks: every request is 7 chunks
# per ctx rank, and two requests are in flight at a time
FAULTY = ["transfer.slot_mib=0.5", "workload.requests=6", f"transfer.timeout_s={TIMEOUT_S}"]
# A run that hangs is stopped here and fails the test. How fast a run ends is checked on the ranks'
# own clocks instead (_gave_up_in_time): the wall time of a run on shared cores is mostly the start
# of its processes, which took 15 s alone and 60 s on a busy machine.
HANG_S = 240
STALL_S = 300


def _rows(run_dir: Path) -> dict[int, dict]:
    check_figures(run_dir)  # what did arrive obeys the figures' identities
    return {r["request"]: r for r in map(json.loads, (run_dir / "results.jsonl").read_text().splitlines())}


def _gave_up_in_time(run_dir: Path, ranks: list[int]) -> None:
    """Each surviving rank gave up within twice ``transfer.timeout_s`` of its last completed chunk:
    it waited for the peer as long as it was told to, not for the whole run."""
    for r in ranks:
        part = json.loads((run_dir / "parts" / f"rank{r}.json").read_text())
        last = max(done for p in part["parts"] for _, done in p["wire"] if done is not None)
        assert part["error_at"] is not None and part["error_at"] - last < 2 * TIMEOUT_S, (r, part["error_at"] - last)


@pytest.mark.slow
def test_killed_rank_fails_its_requests_and_the_run_ends(tmp_path, kvlab_cli):
    run_dir = tmp_path / "run"
    # ctx1 dies as it is about to post its 25th chunk: requests 0 and 1 (its chunks 0-13) are through,
    # 2 and 3 are in flight, 4 and 5 at most just started on ctx0
    p = kvlab_cli("run", f"hydra.run.dir={run_dir}", *QUIET, *FAULTY, "fault.kill_rank=1", "fault.kill_at_chunk=24",
                  timeout=HANG_S)
    assert p.returncode == 3, p.stderr  # the dead rank's code: killed by fault injection
    assert "rank 1 (ctx1) died: exit code 3" in p.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert not summary["verified"] and summary["silent_ranks"] == [1]
    assert summary["errors"][0].startswith("ctx1 (rank 1) sent no report")
    rows = _rows(run_dir)
    assert sorted(rows) == list(range(6))
    assert summary["failed_requests"] == [2, 3, 4, 5]
    for rid in (0, 1):
        assert rows[rid]["verified"] and rows[rid]["error"] is None
    for rid in (2, 3, 4, 5):  # named with the rank that gave up on them and why, or as never delivered
        assert re.match(LOST_TO_CTX1, rows[rid]["error"]), rows[rid]["error"]
    # the survivors wrote what they knew before any exchange
    parts = {f.name for f in (run_dir / "parts").iterdir()}
    assert parts == {"rank0.json", "rank2.json"}
    gen = json.loads((run_dir / "parts" / "rank2.json").read_text())
    first = gen["errors"][0] if gen["errors"] else ""
    assert "with ctx1" in first or re.fullmatch(GEN0_NAMES_DEAD_CTX1, first), gen["errors"]
    assert {int(k) for k in gen["failures"]} <= {2, 3}
    _gave_up_in_time(run_dir, [0, 2])
    for r in (0, 2):  # the failed requests' blocks went back to the allocator
        assert json.loads((run_dir / "parts" / f"rank{r}.json").read_text())["held_blocks"] == 0


# In each rank of the run (the launcher gives them KVLAB_PARENT): the gen rank's check of the requests that landed
# waits until the launcher's stop after ctx1's death has reached it, and notes that it did (CHECKED_AFTER)
_CHECK_AFTER_THE_STOP = """
import os, signal, time

def _hook():
    from kvlab.core import interrupt
    from kvlab.rank import executor

    check = executor.Executor.verify_finished

    def came():
        h = signal.getsignal(signal.SIGTERM)  # the rank's stop, put off (deferred) or taken (handlers quiet)
        return h is interrupt.ignore or getattr(h, "deferred", None) is not None

    def after_the_stop(self):
        if self.side == "gen" and self.unverified:
            until = time.monotonic() + 30
            while time.monotonic() < until and not came():
                time.sleep(0.05)
            if came():
                open(os.environ["CHECKED_AFTER"], "w").write(",".join(str(r.id) for r, *_ in self.unverified))
        check(self)

    executor.Executor.verify_finished = after_the_stop

if os.environ.get("KVLAB_PARENT") is not None:
    _hook()
"""


@pytest.mark.slow
def test_the_stop_after_a_death_leaves_what_landed_to_be_checked(tmp_path, kvlab_cli):
    """The launcher stops a survivor some seconds after a death, to end its waits on the dead peer. A gen rank that
    was checking the requests that had landed whole (work that waits on nobody) failed them "before verification";
    on a loaded machine, where that check comes late, the run lost requests that had arrived. Here the check is held
    until the stop has come: requests 0 and 1 are verified all the same."""
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(_CHECK_AFTER_THE_STOP)
    path = os.pathsep.join([str(tmp_path / "hook"), *filter(None, [os.environ.get("PYTHONPATH")])])
    run_dir, noted = tmp_path / "run", tmp_path / "checked_after"
    p = kvlab_cli("run", f"hydra.run.dir={run_dir}", *QUIET, *FAULTY, "fault.kill_rank=1", "fault.kill_at_chunk=24",
                  env={"PYTHONPATH": path, "CHECKED_AFTER": str(noted)}, timeout=HANG_S)
    assert p.returncode == 3, p.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["failed_requests"] == [2, 3, 4, 5], summary["failed_requests"]
    assert noted.exists(), "the gen rank's check never overlapped the launcher's stop"
    rows = _rows(run_dir)
    for rid in (0, 1):
        assert rows[rid]["verified"] and rows[rid]["error"] is None, rows[rid]
    gen = json.loads((run_dir / "parts" / "rank2.json").read_text())
    assert {int(k) for k in gen["failures"]} <= {2, 3} and gen["held_blocks"] == 0, gen["failures"]


@pytest.mark.parametrize("case", ["put-off", "twice", "ctrl-c", "taken-in-the-wait", "nobody-dead"])
def test_which_stop_waits_for_the_check_of_what_landed(case, tmp_path):
    """The rank's stop handler, with real signals to this process: the launcher's SIGTERM after a death waits for
    the check of the requests that landed (``local_work``) once; a second signal, a SIGINT, or a SIGTERM with no
    peer dead stops the check at once, as does one that comes after the stop was taken during the wait."""
    from kvlab.rank.executor import Stopped
    from kvlab.rank.runner import STOP_SIGNALS, _Stop

    stop = _Stop(tmp_path)
    stop.died = (lambda: "") if case == "nobody-dead" else (lambda: "ctx1 (rank 1)")
    before = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    seen = []

    def check(*signals):
        with stop.local_work():
            for s in signals:
                os.kill(os.getpid(), s)
                time.sleep(0.01)  # the handler runs here, between bytecodes
                seen.append(s)

    try:
        if case == "taken-in-the-wait":
            with pytest.raises(Stopped) as waited:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)
            assert waited.value.after_death
        with pytest.raises(Stopped) as ended:
            check(*{"put-off": [signal.SIGTERM], "twice": [signal.SIGTERM] * 2, "ctrl-c": [signal.SIGINT],
                    "taken-in-the-wait": [signal.SIGTERM], "nobody-dead": [signal.SIGTERM]}[case])
        assert len(seen) == (1 if case in ("put-off", "twice") else 0), seen
        assert ended.value.after_death == (case in ("put-off", "twice", "taken-in-the-wait")), case
        assert str(ended.value).startswith("stopped by SIG")
        assert all(signal.getsignal(s) is not stop for s in STOP_SIGNALS)  # quiet after the stop it acts on
    finally:
        for s, h in before.items():
            signal.signal(s, h)


@pytest.mark.slow
def test_killed_rank_under_torchrun_is_still_reported(tmp_path, kvlab_cli):
    """torchrun's agent stops every rank as soon as one dies: the survivors write their part files on
    SIGTERM and rank 0 merges the ones that land in the (shared) run dir."""
    p = kvlab_cli("run", *QUIET, *FAULTY, "fault.kill_rank=1", "fault.kill_at_chunk=24",
                  torchrun=["--standalone", "--nproc-per-node=3"], cwd=tmp_path, timeout=HANG_S)
    assert p.returncode != 0 and "exitcode  : 3" in p.stderr  # the agent names the dead rank's code
    (run_dir,) = (tmp_path / "outputs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["silent_ranks"] == [1] and {2, 3, 4, 5} <= set(summary["failed_requests"])
    assert summary["errors"][0].startswith("ctx1 (rank 1) sent no report")
    rows = _rows(run_dir)
    # delivered before the kill: checked, or named as stopped before its check (the agent's SIGTERM is handled
    # once the gen rank's blocked wait returns, which may be during the check)
    for rid in (0, 1):
        assert rows[rid]["verified"] or "before verification" in rows[rid]["error"], rows[rid]["error"]
    gen = json.loads((run_dir / "parts" / "rank2.json").read_text())
    assert gen["side"] == "gen" and {p["request"] for p in gen["parts"]} >= {0, 1}  # the gen rank's records kept
    _gave_up_in_time(run_dir, [0, 2])


@pytest.mark.slow
def test_stalled_rank_is_left_behind_and_the_run_ends(tmp_path, kvlab_cli):
    # the run does not wait for the stalled rank: the launcher stops it (said below), and its part says so
    p = kvlab_cli("run", f"hydra.run.dir={tmp_path}", *QUIET, *FAULTY, "fault.stall_rank=1", "fault.stall_at_chunk=24",
                  f"fault.stall_s={STALL_S}", timeout=HANG_S)
    assert p.returncode == 1, p.stderr
    assert "rank 1 (ctx1) was still running after rank" in p.stderr and "stopped it" in p.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert not summary["verified"] and summary["silent_ranks"] == [1]
    assert "silent for more than" in summary["errors"][0]
    rows = _rows(tmp_path)
    assert summary["failed_requests"] == [2, 3, 4, 5]
    assert rows[0]["verified"] and rows[1]["verified"]
    timeouts = [e for e in summary["errors"] if "not done within 4 s" in e]
    assert timeouts, summary["errors"]  # the peers gave up after transfer.timeout_s
    assert all(rows[r]["error"] for r in (2, 3, 4, 5))
    _gave_up_in_time(tmp_path, [0, 2])
    # stopped by the launcher once rank 0 had reported, the stalled rank still wrote what it knew
    stalled = json.loads((tmp_path / "parts" / "rank1.json").read_text())
    assert stalled["errors"] == ["ctx1: stopped by SIGTERM"]
    assert set(stalled["failures"].values()) == {"ctx1: stopped by SIGTERM"}


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 2], ids=["ctx0-hosting-the-store", "gen0"])
def test_a_frozen_rank_ends_the_run(rank, tmp_path, kvlab_cli):
    """A rank stopped by SIGSTOP mid-transfer is alive with its connections open: nobody sees it die, and
    rank 0 also hosts the store every rank's bookkeeping goes through. The others give up on it within
    their deadlines, the launcher kills it (it cannot report), and the run ends with the requests named."""
    p = kvlab_cli("run", f"hydra.run.dir={tmp_path}", *QUIET, *FAULTY, f"fault.freeze_rank={rank}",
                  "fault.freeze_at_chunk=24", timeout=HANG_S)
    assert p.returncode == 1, p.stderr
    name = {0: "ctx0", 2: "gen0"}[rank]
    assert f"rank {rank} ({name}) was frozen" in p.stderr and "killed it" in p.stderr, p.stderr
    _named_once(p.stderr, rank, name)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert not summary["verified"] and summary["failed_requests"], summary
    assert any(re.search(r"request \d+", e) for e in summary["errors"]), summary["errors"]
    frozen = json.loads((tmp_path / "parts" / f"rank{rank}.json").read_text())
    assert frozen["errors"] == [f"rank {rank}: frozen (stopped by a signal); killed by the launcher"]


def _named_once(err: str, rank: int, name: str) -> None:
    """The launcher's line is the only one naming the frozen rank: its peers' deadlines run out on it, its part
    and rank 0's "sent no report" said it again on 2-3 lines (they stay in summary.json)."""
    naming = [ln for ln in err.splitlines() if re.search(rf"\b({name}|rank {rank})\b", ln)]
    assert len(naming) == 1 and "was frozen" in naming[0], err


def _rank_pids(parent: int) -> dict[int, int]:
    """World rank -> pid of the rank processes the launcher ``parent`` started (their environment names it)."""
    out = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            env = dict(e.split(b"=", 1) for e in (d / "environ").read_bytes().split(b"\0") if b"=" in e)
        except OSError:
            continue
        if env.get(b"KVLAB_PARENT") == str(parent).encode() and b"RANK" in env:
            out[int(env[b"RANK"])] = int(d.name)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 2], ids=["ctx0-hosting-the-store", "gen0"])
def test_a_rank_frozen_while_the_ranks_start_ends_the_run(rank, tmp_path, kvlab_cli):
    """Frozen before any transfer (its peers wait on it in calls of torch.distributed without a deadline of
    kvlab's: joining the others, or on the store rank 0 hosts): the launcher kills it once it has been frozen
    ``transfer.timeout_s``, stops every other rank as after a death, and names the frozen rank as the cause."""
    p = subprocess.Popen(kvlab_cli.argv("run", f"hydra.run.dir={tmp_path}", *QUIET, *FAULTY), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        while rank not in (pids := _rank_pids(p.pid)) and p.poll() is None:
            time.sleep(0.01)
        os.kill(pids[rank], signal.SIGSTOP)  # still starting: importing torch, or joining the others
        _, err = p.communicate(timeout=HANG_S)
    finally:
        p.kill()
    assert p.returncode == 1, err
    name = {0: "ctx0", 2: "gen0"}[rank]
    assert [ln for ln in err.splitlines() if "was frozen" in ln] == [
        f"kvlab: rank {rank} ({name}) was frozen (stopped by a signal, its connections open) for {TIMEOUT_S} s; "
        "killed it"], err
    _named_once(err, rank, name)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["failed_requests"] == list(range(6)) and not summary["verified"], summary
    assert json.loads((tmp_path / "parts" / f"rank{rank}.json").read_text())["errors"] == [
        f"rank {rank}: frozen (stopped by a signal); killed by the launcher"]
    for r in {0, 1, 2} - {rank}:  # stopped because of it, and saying so (or gone by themselves with the store)
        (why,) = json.loads((tmp_path / "parts" / f"rank{r}.json").read_text())["errors"]
        assert why == f"rank {r}: stopped by SIGTERM after {name} (rank {rank}) died before its transfers" or \
            re.fullmatch(rf"rank {r}: lost the others \(Dist\w*Error(: [^\n]+)?\) before its transfers", why), why
    assert not any(Path(f"/proc/{q}").exists() for q in pids.values())  # no rank outlived the run


# -- corruption ----------------------------------------------------------------------------------
def _coords(pool_spec, rect, j: int) -> dict:
    """Logical coordinates of byte ``j`` of a chunk's message, from the wire order (kvlab.model.layout):
    for each tile of tokens, each layer, each component, each head: the tile's rows."""
    rows = pool_spec.comp_row_bytes()
    bpl = rect.n_heads * sum(rows)
    t = rect.t0
    while True:
        te = min(rect.t1, (t // rect.tile + 1) * rect.tile)
        if j < (te - t) * rect.n_layers * bpl:
            break
        j -= (te - t) * rect.n_layers * bpl
        t = te
    n = te - t
    layer, j = divmod(j, n * bpl)
    for comp, row in enumerate(rows):
        if j < n * rect.n_heads * row:
            head, j = divmod(j, n * row)
            tok, byte = divmod(j, row)
            return {"pool": pool_spec.name, "layer": pool_spec.layers[rect.l0 + layer], "component": comp,
                    "head": rect.h0 + head, "token": t + tok, "byte": byte}
        j -= n * rect.n_heads * row
    raise AssertionError("byte outside the chunk")


def _picks(chunks, want):
    """(index, chunk, byte) for each (predicate, where-in-chunk) in ``want``, each in a request of its own."""
    out, used = [], set()
    for pred, where in want:
        i, c = next((i, c) for i, c in enumerate(chunks) if c.request not in used and pred(c))
        used.add(c.request)
        out.append((i, c, {"first": 0, "middle": c.nbytes // 2 + 3, "last": c.nbytes - 1}[where]))
    return out


CORRUPTION = [
    # MLA latent, ctx tp1 -> gen tp2: ctx0 sends the same latent to both gen ranks, mostly in place;
    # flipped after pack (a copy of an in-place chunk), caught only by the gen rank it was meant for
    ("mla-zerocopy-ctx", ["model=tiny_mla", "ctx.tp=1", "gen.tp=2", "transfer=zerocopy", "transfer.slot_mib=0.25",
                          "workload.isl=1000"], 0,
     [(lambda c: c.ctx_in_place and c.dst == 0, "first"), (lambda c: c.ctx_in_place and c.dst == 1, "middle"),
      (lambda c: not c.ctx_in_place, "last")]),
    # DeepSeek-V3.2 latent + indexer (fp8 values first, fp32 scales last), ctx tp1 -> gen tp2: flipped
    # on gen1 after the receive, in its pool for chunks received in place, in a slot otherwise
    ("dsa-zerocopy-gen", ["model=tiny_dsa", "ctx.tp=1", "gen.tp=2", "transfer=zerocopy", "transfer.slot_mib=0.1",
                          "workload.isl=1000"], 2,
     [(lambda c: c.rect.pool == "mla" and c.gen_in_place, "middle"),
      (lambda c: c.rect.pool == "indexer" and c.gen_in_place, "first"),
      (lambda c: c.rect.pool == "indexer" and not c.gen_in_place, "last")]),
    # GQA with sliding-window layers, ctx tp2 -> gen tp1, layerwise: flipped after pack on ctx1
    ("swa-layerwise-ctx", ["model=tiny_swa", "ctx.tp=2", "gen.tp=1", "transfer=layerwise", "transfer.slot_mib=0.02",
                           "workload.isl=1000", "cache.fragmentation=0.5"], 1,
     [(lambda c: c.rect.pool == "kv_w64", "last"), (lambda c: c.rect.pool == "kv", "middle"),
      (lambda c: c.rect.pool == "kv_w64", "middle")]),
]


@pytest.mark.slow
@settings(max_examples=2, **E2E)
@given(case=st.sampled_from(CORRUPTION))
def test_flipped_bytes_are_caught_and_located(case, tmp_path_factory):
    _, overrides, flip_rank, want = case
    flips_caught(overrides, flip_rank, want, tmp_path_factory.mktemp("flips"))


def flips_caught(overrides: list[str], flip_rank: int, want, tmp_path: Path) -> None:
    """Flips at the chunks ``want`` picks on world rank ``flip_rank`` are caught by the gen rank they were
    meant for, once each, and located at the element the bytes belong to."""
    setup = build(compose(overrides + QUIET))
    order = plan_run(setup).order
    side, rank = setup.side_of(flip_rank)
    mine = [c for c in order if (c.src if side.name == "ctx" else c.dst) == rank]
    starts = [sum(c.nbytes for c in mine[:i]) for i in range(len(mine))]
    picks = _picks(mine, want)
    flips = [starts[i] + j for i, _, j in picks]
    summary = run_transfer(overrides + QUIET + [f"fault.flip_rank={flip_rank}", f"fault.flip_at={flips}"], tmp_path)
    assert not summary["verified"]
    assert summary["errors"] == []  # no rank failed: corruption is the verifier's business
    assert summary["failed_requests"] == sorted(c.request for _, c, _ in picks)
    rows = _rows(tmp_path)
    hit = set()
    for _, c, j in picks:
        spec = next(p for p in setup.model.pools(setup.ctx.dtype) if p.name == c.rect.pool)
        want_at = _coords(spec, c.rect, j)
        assert want_at == locate(CacheState(setup.model, setup.gen, c.dst).pool(c.rect.pool), c.rect, j)
        lines = rows[c.request]["error"].split("; ")
        assert len(lines) == 1, lines  # caught once, by the gen rank the message was for
        m = re.fullmatch(r"request (\d+): (\d+) wrong bytes from ctx(\d+), first at pool (\w+) layer (\d+) "
                         r"component (\d+) head (\d+) token (\d+) byte (\d+) \(block \d+\)", lines[0])
        assert m, lines[0]
        got = dict(zip(("pool", "layer", "component", "head", "token", "byte"),
                       [m.group(4)] + [int(x) for x in m.groups()[4:]]))
        assert (int(m.group(1)), int(m.group(2)), int(m.group(3))) == (c.request, 1, c.src)
        assert got == want_at, (got, want_at)
        hit.add((want_at["pool"], want_at["component"]))
    if "model=tiny_dsa" in overrides:  # the latent, the indexer's fp8 values and its fp32 scales
        assert hit == {("mla", 0), ("indexer", 0), ("indexer", 1)}
    if "model=tiny_swa" in overrides:  # full and sliding-window layers
        assert {pool for pool, _ in hit} == {"kv", "kv_w64"}
