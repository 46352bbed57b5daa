"""The transfer's own failure classes (``fault.transfer``, kvlab.config.faults), the ones that break disaggregated
serving in the field: a dropped notification or acknowledgement, a transfer stuck in progress, a block reused
before its transfer completed, a chunk half written by a sender that dies, a notification for the wrong
request. Each transport injects the classes it can show through its hooks and says why the others do not arise
there; end to end, through real rank processes, a run with one of them ends, names the request it hit with the
cause, keeps the requests before it verified and reports nothing verified that was not; a reused block is
caught by verification, which names the request, the block and the byte."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from conftest import check_figures
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_faults import FAULTY, HANG_S, TIMEOUT_S

from kvlab.config.faults import CLASSES, RankFaults, check
from kvlab.config.schema import build, compose
from kvlab.config.workload import plan_run
from kvlab.core.errors import ConfigError
from kvlab.model.layout import Rect
from kvlab.model.schedule import Chunk
from kvlab.model.spec import FaultSpec
from kvlab.transports.ipc import Ipc
from kvlab.transports.mooncake import Mooncake
from kvlab.transports.nixl import Nixl
from kvlab.transports.p2p import P2P

QUIET = ["logger=quiet"]
TRANSPORTS = {"p2p": P2P, "ipc": Ipc, "nixl": Nixl, "mooncake": Mooncake}
# the default pipeline (ctx0 + ctx1 -> gen0) cut as test_faults cuts it: 7 chunks per request per ctx rank, two
# requests at a time; a class acts at these chunks of its rank, after requests 0 and 1 are through on it
AT = {"ctx": 16, "gen": 32}
RANK = {"ctx": 1, "gen": 2}
SCALE = settings.default.max_examples / 100  # a tenth under `pytest -m "not slow"` (tests/conftest.py)


def _available(transport: str) -> bool:
    try:
        if transport == "nixl":
            import nixl_cu13  # noqa: F401
        if transport == "mooncake":
            from kvlab.transports import mooncake_engine as mooncake

            mooncake.api()
    except Exception:  # noqa: BLE001 - not installed, or its libraries missing: leave it out here
        return False
    return True


# (transport, mode, class, side): every class each transport here shows, on every side it arises
CASES = [(t, mode, k, side) for t, cls in TRANSPORTS.items() if _available(t)
         for mode in (["staged", "direct"] if t in ("nixl", "mooncake") else [None])
         for k, sides in sorted(cls.injects.items()) for side in sorted(sides)]


# -- what each transport declares, and the one-line refusals -------------------------------------------
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_class_is_shown_or_explained_by_every_transport(transport):
    cls = TRANSPORTS[transport]
    assert set(cls.injects) | set(cls.cannot) == set(CLASSES), transport
    assert not set(cls.injects) & set(cls.cannot), transport
    assert all(sides and sides <= {"ctx", "gen"} for sides in cls.injects.values()), cls.injects
    assert all(why.strip() for why in cls.cannot.values()), cls.cannot


@pytest.mark.parametrize("transport", ["p2p", "ipc"])
def test_check_refuses_what_the_transport_cannot_show_in_one_line(transport):
    setup = build(compose([*QUIET, f"transport={transport}"]))
    plan = plan_run(setup)
    cls = TRANSPORTS[transport]
    for klass in CLASSES:
        for side, rank in RANK.items():
            faulty = dataclasses.replace(setup, fault=FaultSpec(transfer=klass, transfer_rank=rank,
                                                                transfer_at_chunk=0))
            if side in cls.injects.get(klass, ()):
                check(faulty, plan)
                continue
            with pytest.raises(ConfigError) as e:
                check(faulty, plan)
            line = str(e.value)
            assert "\n" not in line
            if klass in cls.cannot:
                assert line == f"fault.transfer={klass}: transport={transport} cannot show it: {cls.cannot[klass]}"
            else:
                assert line.startswith(f"fault.transfer_rank={rank}: with transport={transport}, {klass} arises "
                                       "on a "), line


@pytest.mark.parametrize(("fields", "name"), [
    ({"transfer": "lost"}, "fault.transfer"),
    ({"transfer": "stuck"}, "fault.transfer_rank"),
    ({"transfer_rank": 1, "transfer_at_chunk": 0}, "fault.transfer_rank"),
    ({"transfer": "stuck", "transfer_rank": 1}, "fault.transfer_at_chunk"),
    ({"transfer_at_chunk": 3}, "fault.transfer_at_chunk"),
])
def test_bad_fault_transfer_fields_are_named(fields, name):
    with pytest.raises(ConfigError, match=f"^{re.escape(name)}="):
        FaultSpec(**fields)


# -- the hooks themselves ----------------------------------------------------------------------------------
def _chunks(pairs_and_requests: list[tuple[int, int, int]]) -> list[Chunk]:
    rect = Rect("kv", 0, 1, 0, 1, 0, 16, 16)
    return [Chunk(r, k, s, d, rect, 64, 0) for k, (s, d, r) in enumerate(pairs_and_requests)]


@settings(max_examples=int(100 * SCALE), deadline=None)
@given(lengths=st.lists(st.integers(1, 1 << 20), min_size=1, max_size=40), data=st.data())
def test_half_is_the_first_half_of_the_runs(lengths, data):
    src = [data.draw(st.integers(0, 1 << 40)) for _ in lengths]
    dst = [data.draw(st.integers(0, 1 << 40)) for _ in lengths]
    s, d, n = RankFaults.half(src, dst, lengths)
    assert int(n.sum()) == max(1, sum(lengths) // 2)
    assert list(s) == src[:len(n)] and list(d) == dst[:len(n)]  # the same runs, from their starts
    assert list(n[:-1]) == lengths[:len(n) - 1] and 0 < n[-1] <= lengths[len(n) - 1]


@settings(max_examples=int(100 * SCALE), deadline=None)
@given(chunks=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 1), st.integers(0, 3)), min_size=1, max_size=12),
       klass=st.sampled_from(["drop_notice", "wrong_request", "stuck"]), data=st.data())
def test_a_class_acts_once_at_its_first_chance(chunks, klass, data):
    mine = _chunks(chunks)
    at = data.draw(st.integers(0, len(mine) - 1))
    f = RankFaults(transfer=klass, transfer_at=at, mine=mine, name="rank 1")
    asks = sorted(data.draw(st.sets(st.integers(0, len(mine) - 1), min_size=1)))
    acted = []
    for i in asks:
        c = mine[i]
        if klass == "stuck":
            if f.stuck(i, c):
                acted.append(i)
            continue
        n = f.notice(i, c)
        if n is not c:
            acted.append(i)
            if klass == "wrong_request":  # another request's notice, between the same two ranks
                assert n.request != c.request and (n.src, n.dst) == (c.src, c.dst)
            else:
                assert n is None
    first = next((i for i in asks if i >= at), None)
    if klass == "stuck":  # the first chance, then every later chunk between those two ranks
        assert acted == ([] if first is None else [i for i in asks if i >= first
                                                   and (mine[i].src, mine[i].dst) == (mine[first].src,
                                                                                      mine[first].dst)])
    else:
        assert acted == ([] if first is None else [first])


# -- end to end ---------------------------------------------------------------------------------------------
def _rows(run_dir: Path) -> dict[int, dict]:
    check_figures(run_dir)  # what did arrive obeys the figures' identities
    return {r["request"]: r for r in map(json.loads, (run_dir / "results.jsonl").read_text().splitlines())}


WRONG_BYTES = (r"request (\d+): \d+ wrong bytes from ctx\d, first at pool (\w+) layer \d+ component \d+ head \d+ "
               r"token (\d+) byte \d+ \(block (\d+)\)")


@pytest.mark.slow
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(case=("p2p", None, "reused_block", "ctx"))
@given(case=st.sampled_from(CASES))
def test_an_injected_class_ends_the_run_with_its_request_named(case, tmp_path_factory, kvlab_cli):
    transport, mode, klass, side = case
    run_dir = tmp_path_factory.mktemp("run")
    rank = RANK[side]
    p = kvlab_cli("run", f"hydra.run.dir={run_dir}", *QUIET, *FAULTY, f"transport={transport}",
                  *([f"transport.mode={mode}"] if mode else []), f"fault.transfer={klass}",
                  f"fault.transfer_rank={rank}", f"fault.transfer_at_chunk={AT[side]}", timeout=HANG_S)
    notes = re.findall(r"^rank (\d+): fault\.transfer=(\w+): (.*)$", p.stderr, re.M)
    assert [n[:2] for n in notes] == [(str(rank), klass)], p.stderr  # it acted, once
    hit = int(re.search(r"request (\d+)", notes[0][2]).group(1))
    assert p.returncode == (3 if klass == "torn_chunk" else 1), p.stderr  # 3: the sender died of it
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = _rows(run_dir)
    assert sorted(rows) == list(range(6))
    assert not summary["verified"] and hit in summary["failed_requests"], summary
    assert rows[0]["verified"] and rows[1]["verified"], (rows[0]["error"], rows[1]["error"])  # before it
    for r in rows.values():  # every request either verified or failed with a reason
        assert r["verified"] == (r["error"] is None), r
    assert summary["completed_requests"] == [r for r in rows if rows[r]["verified"]]
    error = rows[hit]["error"]
    if klass == "reused_block":  # nothing failed but the check, which names the request, the block and the byte
        assert summary["errors"] == [] and summary["failed_requests"] == [hit], summary
        block, first, last = map(int, re.search(r"block (\d+) of pool \w+ \(request \d+, tokens (\d+)-(\d+)\)",
                                                notes[0][2]).groups())
        m = re.fullmatch(WRONG_BYTES, error)
        assert m and int(m.group(1)) == hit, error
        assert first <= int(m.group(3)) <= last, (error, notes)  # a byte of the reused block's tokens
        if side == "gen":  # caught where it happened: the gen rank's own block
            assert int(m.group(4)) == block, (error, notes)
    else:  # failed by a rank that waited for it until its deadline, or saw its peer gone
        assert re.search(rf"within {TIMEOUT_S} s|gone|sent no report", error), error
    if klass == "torn_chunk":  # half a chunk landed and the sender died (writes of its in flight with it)
        assert summary["silent_ranks"] == [rank] and f"rank {rank} (ctx{rank}) died: exit code 3" in p.stderr, p.stderr
    if klass in ("drop_notice", "wrong_request"):  # named by the rank that waited for that notice
        assert f"request {hit}" in error, error
    # stuck, torn_chunk: the first chunk the receiver misses may be another of the same endpoint, posted after
    # the one the class hit (nixl and mooncake write chunks as their room arrives, not in order)
