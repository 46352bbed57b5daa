"""transport=mooncake: the Mooncake Transfer Engine between real rank processes (TCP over loopback on CPUs)."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from conftest import E2E, GEN0_NAMES_DEAD_CTX1, LOST_TO_CTX1, check_figures
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_faults import CORRUPTION, FAULTY, HANG_S, flips_caught
from test_faults import _gave_up_in_time as gave_up_in_time

ROOT = Path(__file__).resolve().parent.parent
MOONCAKE = ["logger=quiet", "transport=mooncake"]
MODES = ["staged", "direct"]
STRATEGIES = ["naive", "chunked", "layerwise", "zerocopy"]
# (model, its prompt, both sides' layouts): GQA, MLA, DSA (latent and fp8 indexer) and sliding windows, over
# TP ratios both ways, a PP mismatch, attention-DP, block sizes and layouts that differ
CASES = [
    ("tiny_gqa", 1500, ["ctx.tp=2", "gen.tp=1"]),
    ("tiny_gqa", 1000, ["ctx.tp=1", "gen.tp=3", "gen.tokens_per_block=64", "gen.layout=layer_major"]),
    ("tiny_mla", 2000, ["ctx.tp=2", "gen.tp=1"]),
    ("tiny_dsa", 1200, ["ctx.tp=1", "gen.tp=2"]),
    ("tiny_swa", 1500, ["parallel=pp2_to_tp2"]),
    ("tiny_swa", 1000, ["ctx.tp=1", "gen.tp=2", "gen.dp=2", "gen.tokens_per_block=64"]),
    # 16 MiB direct chunks of 8 KiB runs: thousands of writes in flight to one gen rank, which the engine failed
    ("llama3_8b", 1024, ["ctx.tp=1", "gen.tp=2", "gen.tokens_per_block=64", "gen.layout=layer_major"]),
]


def _loads() -> bool:
    try:
        from kvlab.transports import mooncake_engine as mooncake

        mooncake.api()
    except Exception:  # noqa: BLE001 - not installed, or its system libraries missing: the same skip
        return False
    return True


needs_engine = pytest.mark.skipif(not _loads(), reason='the Mooncake Transfer Engine cannot load here '
                                  '(pip install -e ".[mooncake]"; apt-get install libibverbs1 libnl-3-200 '
                                  'libnl-route-3-200)')


def _rows(run_dir: Path) -> list[dict]:
    check_figures(run_dir)
    return [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]


def _verified(over: list[str], mode: str, run_dir: Path) -> dict:
    """A run that must arrive whole: every request verified, each moving the bytes of its plan, with the
    descriptors its mode posts, and its link a share of raw Mooncake writes."""
    from kvlab.api import run_transfer
    from kvlab.config.schema import build, compose
    from kvlab.config.workload import make_requests
    from kvlab.model.plan import plan

    summary = run_transfer(over + MOONCAKE + [f"transport.mode={mode}"], run_dir)
    assert summary["verified"] and summary["failed_requests"] == [] and summary["errors"] == [], summary
    setup = build(compose(over + MOONCAKE))
    rows = _rows(run_dir)
    assert len(rows) == setup.workload.requests == summary["requests"]
    for req, row in zip(make_requests(setup), rows):
        assert row["verified"]
        assert row["bytes"] == sum(s.nbytes for s in plan(setup.model, setup.ctx, setup.gen, req))
        if mode == "staged":  # one write of the whole chunk
            assert row["descriptors"] == row["chunks"]
        else:  # one write per run, at least one per chunk, nothing staged on the gen side
            assert row["descriptors"] >= row["chunks"] and row["in_place_chunks"] == row["chunks"]
    if mode == "direct":
        assert summary["peak_staging_bytes"] == 0
    assert summary["link"]["reference"] == "mooncake" and summary["link_ratio"] > 0
    return summary


@needs_engine
@pytest.mark.slow
@settings(max_examples=2, **E2E)
@given(strategy=st.sampled_from(STRATEGIES), mode=st.sampled_from(MODES), case=st.sampled_from(CASES),
       slot_mib=st.sampled_from([0.1, 0.25, 1, None]), fragmentation=st.sampled_from([0.0, 0.7]),
       concurrency=st.integers(1, 3))
@example(strategy="chunked", mode="direct", case=CASES[-1], slot_mib=None, fragmentation=0.0, concurrency=2)
def test_every_strategy_arrives_verified(strategy, mode, case, slot_mib, fragmentation, concurrency, tmp_path_factory):
    model, isl, sides = case
    over = [f"model={model}", f"workload.isl={isl}", *sides, f"transfer={strategy}",
            *([f"transfer.slot_mib={slot_mib}"] if slot_mib is not None else []),
            f"cache.fragmentation={fragmentation}", "workload.requests=3", f"workload.concurrency={concurrency}"]
    _verified(over, mode, tmp_path_factory.mktemp("run"))


@needs_engine
@pytest.mark.slow
@settings(max_examples=1, **E2E)
@given(mode=st.sampled_from(MODES))
def test_every_run_reports_raw_mooncake_writes_of_its_chunks_as_its_link(mode, tmp_path):
    """The in-run reference: raw writes of the run's largest chunk between its own pairs (3 -> 2: ctx1 feeds
    both gen ranks), timed on the writing ranks, the slowest taken."""
    from kvlab.config.schema import build, compose
    from kvlab.config.workload import plan_run
    from kvlab.rank import linkrate

    over = ["ctx.tp=3", "gen.tp=2", "workload.isl=700", "transfer.slot_mib=0.05", "workload.requests=2"]
    summary = _verified(over, mode, tmp_path)
    nbytes, n, pairs = linkrate.messages(plan_run(build(compose(over + MOONCAKE))).order)
    assert len(pairs) == 4
    link = summary["link"]
    assert link["message_bytes"] == nbytes and link["messages"] == n * len(pairs) and link["seconds"] > 0
    assert summary["link_gbps"] == pytest.approx(n * len(pairs) * nbytes / link["seconds"] / 1e9)
    assert summary["link_ratio"] == pytest.approx(summary["gbps"] / summary["link_gbps"])


@needs_engine
@pytest.mark.slow
def test_direct_merges_runs_that_continue_on_both_sides(tmp_path):
    """Identical layouts and consecutive blocks: each chunk's runs continue each other in both pools, so each
    chunk is one write; fragmented block tables break them up into more."""
    same = ["parallel=same", "transfer=zerocopy", "workload.requests=1", "workload.isl=2048", "transfer.slot_mib=0.5"]
    _verified(same, "direct", tmp_path / "a")
    (row,) = _rows(tmp_path / "a")
    assert row["descriptors"] == row["chunks"] > 1
    _verified(same + ["cache.fragmentation=1.0"], "direct", tmp_path / "b")
    (frag,) = _rows(tmp_path / "b")
    assert frag["descriptors"] > frag["chunks"]


@needs_engine
@pytest.mark.slow
@settings(max_examples=2, **E2E)
@given(case=st.sampled_from([c[0] for c in CORRUPTION]), mode=st.sampled_from(MODES))
def test_flipped_bytes_are_caught_and_located(case, mode, tmp_path_factory):
    """Staged: flipped in the slot (or a copy of an in-place chunk) as over p2p. Direct: a flip on the ctx rank
    goes out of a staging copy (the pool stays intact for the other gen ranks), one on the gen rank lands in its
    pool, where the runs put the byte."""
    _, overrides, flip_rank, want = next(c for c in CORRUPTION if c[0] == case)
    flips_caught(overrides + MOONCAKE + [f"transport.mode={mode}"], flip_rank, want,
                 tmp_path_factory.mktemp("flips"))


@needs_engine
@pytest.mark.slow
@settings(max_examples=1, **E2E)
@given(mode=st.sampled_from(MODES))
def test_killed_rank_ends_the_run_within_the_deadline(mode, tmp_path, kvlab_cli):
    run_dir = tmp_path / "run"
    # ctx1 dies as it is about to start its 25th chunk: requests 0 and 1 are written, 2 and 3 in flight
    p = kvlab_cli("run", f"hydra.run.dir={run_dir}", *MOONCAKE, f"transport.mode={mode}", *FAULTY,
                  "fault.kill_rank=1", "fault.kill_at_chunk=24", timeout=HANG_S)
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
        # a chunk's failure, or ctx0's prefill of a request it shares with ctx1 (their tensor-parallel barrier)
        assert re.match(LOST_TO_CTX1, rows[rid]["error"]), rows[rid]["error"]
    gen = json.loads((run_dir / "parts" / "rank2.json").read_text())
    # only the ctx rank writes: the gen rank learns that ctx1 is gone from its probe of ctx1's engine when the
    # chunk it waits on is ctx1's; waiting on one of ctx0's it has no one to probe, and names the dead rank
    assert re.fullmatch(r"gen0: request \d+ chunk \d+ with ctx1: peer gone: its engine does not answer \(probe "
                        r"returned -?\d+\)", gen["errors"][0]) \
        or re.fullmatch(GEN0_NAMES_DEAD_CTX1, gen["errors"][0]), gen["errors"]
    gave_up_in_time(run_dir, [0, 2])
    for r in (0, 2):  # the survivors freed the failed requests' blocks
        assert json.loads((run_dir / "parts" / f"rank{r}.json").read_text())["held_blocks"] == 0


@needs_engine
@pytest.mark.slow
def test_killed_gen_rank_ends_the_run_within_the_deadline(tmp_path, kvlab_cli):
    """The other way: gen0 dies; the ctx ranks' writes to it fail (the engine sees the connection break), or
    their wait for its block tables ends at the deadline."""
    run_dir = tmp_path / "run"
    p = kvlab_cli("run", f"hydra.run.dir={run_dir}", *MOONCAKE, "transport.mode=direct", *FAULTY,
                  "fault.kill_rank=2", "fault.kill_at_chunk=20", timeout=HANG_S)
    assert p.returncode == 3, p.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert not summary["verified"] and summary["silent_ranks"] == [2]
    for r in (0, 1):
        part = json.loads((run_dir / "parts" / f"rank{r}.json").read_text())
        assert re.fullmatch(rf"ctx{r}: request \d+ chunk \d+ with gen0: (write failed: the engine reports the write "
                            r"failed|peer gone: its engine does not answer \(probe returned -?\d+\))",
                            part["errors"][0]), part["errors"]
    gave_up_in_time(run_dir, [0, 1])


def _shadowed(tmp_path: Path, error: str) -> dict:
    """An environment where ``import mooncake.engine`` raises ImportError(error)."""
    blocked = tmp_path / "blocked" / "mooncake"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("")
    (blocked / "engine.py").write_text(f"raise ImportError({error!r})\n")
    return {"PYTHONPATH": os.pathsep.join([str(blocked.parent), str(ROOT), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.parametrize(("error", "want"), [
    ("No module named 'mooncake.engine'",
     'transport=mooncake: the Mooncake Transfer Engine is not installed; pip install -e ".[mooncake]" '
     "(the mooncake extra) and apt-get install libibverbs1 libnl-3-200 libnl-route-3-200"),
    ("libibverbs.so.1: cannot open shared object file: No such file or directory",
     "transport=mooncake: the Mooncake Transfer Engine cannot load its system libraries (libibverbs.so.1); "
     "apt-get install libibverbs1 libnl-3-200 libnl-route-3-200")])
def test_without_the_extra_or_its_libraries_transport_mooncake_is_one_line(error, want, tmp_path, kvlab_cli):
    env = _shadowed(tmp_path, error)
    p = kvlab_cli("run", f"hydra.run.dir={tmp_path / 'run'}", *MOONCAKE, env=env)
    assert p.returncode == 2
    assert p.stderr.strip() == f"kvlab: error: {want}", p.stderr
    assert not (tmp_path / "run").exists()  # stopped before anything was allocated
    plan = kvlab_cli("plan", f"hydra.run.dir={tmp_path / 'plan'}", *MOONCAKE, env=env)
    assert plan.returncode == 0 and "Mooncake" not in plan.stderr, plan.stderr  # planning moves no bytes


@needs_engine
@pytest.mark.parametrize(("override", "want"), [
    ("transport.mode=pull", r"^transport.mode=pull: use direct .* or staged"),
    ("transport.protocol=rdma", r"^transport.protocol=rdma: use tcp, nvlink_intra .* or auto"),
    ("transport.pack_ctas=0", r"^transport.pack_ctas=0: use a positive number of CTAs, or null for one per SM$")])
def test_bad_options_are_one_line(override, want):
    from kvlab.config.schema import build, compose
    from kvlab.core.errors import ConfigError

    with pytest.raises(ConfigError, match=want):
        build(compose(MOONCAKE + [override]))


@needs_engine
def test_nvlink_intra_on_cpus_is_one_line():
    from kvlab.config.schema import build, compose
    from kvlab.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^transport.protocol=nvlink_intra: NVLink moves GPU memory; use "
                                          r"transport.protocol=tcp \(or auto\) with device=cpu$"):
        build(compose(MOONCAKE + ["transport.protocol=nvlink_intra", "device=cpu"]))


@needs_engine
def test_auto_is_tcp_on_cpus():
    from kvlab.transports import mooncake_engine as mooncake

    assert mooncake.protocol("auto", "cpu") == "tcp" and mooncake.protocol("tcp", "cuda") == "tcp"
    assert mooncake.protocol("auto", "cuda") == ("nvlink_intra" if mooncake.api().SUPPORT_INTRA_NVLINK else "tcp")


# -- one GPU: every rank on it, device memory registered, nvlink_intra where the wheel has it --------------
GPU = ["device=cuda", "kernels=cuda", "workload.requests=3", "workload.concurrency=2", "workload.isl=3000",
       "transfer.slot_mib=0.25", "cache.fragmentation=0.3"]


@pytest.mark.gpu
@pytest.mark.slow
@needs_engine
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("overrides", [["transfer=chunked", "ctx.tp=2", "gen.tp=1"],
                                       ["model=tiny_dsa", "transfer=layerwise", "ctx.tp=1", "gen.tp=2"]],
                         ids=["gqa-tp2-tp1-chunked", "dsa-tp1-tp2-layerwise"])
def test_mooncake_on_one_gpu_verified(overrides, mode, tmp_path):
    s = _verified(GPU + overrides, mode, tmp_path)
    assert s["kernels"] == "cuda", s


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_a_notice_reaches_its_chunk_whatever_order_the_queue_holds_them_in(data):
    """Per-chunk notices share one store queue per (ctx rank, gen rank): a chunk asking sees its own notice once it
    has been pushed, never another's, whatever came before it in the queue; a request's notices nobody asked for
    go when it is closed."""
    from datetime import timedelta

    import torch.distributed as dist

    from kvlab.model.schedule import Chunk
    from kvlab.transports.mooncake import Mooncake

    m = Mooncake.__new__(Mooncake)  # the control plane alone: no engine, no ranks
    m.store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
    m.heard, m.told, m.tables = {}, set(), {}
    chunks = [Chunk(r, s, 0, 0, None, 0, 0) for r in (0, 1) for s in range(4)]
    order = data.draw(st.permutations(chunks), label="pushed")
    asks = data.draw(st.permutations(chunks), label="asked")
    pushed = 0
    for c in asks:
        more = data.draw(st.integers(0, len(order) - pushed), label="pushed before this ask")
        for n in order[pushed:pushed + more]:
            m.store.queue_push(*m._notice("D", n, f"v{n.request}.{n.seq}"))
        pushed += more
        got = m._heard("D", c)
        assert got == (f"v{c.request}.{c.seq}" if c in order[:pushed] else None), (c, pushed)
        if got is None:  # pushed late: it arrives, and is handed over once
            m.store.queue_push(*m._notice("D", c, f"v{c.request}.{c.seq}"))
            order.remove(c)
            assert m._heard("D", c) == f"v{c.request}.{c.seq}"
    stray = Chunk(0, 99, 0, 0, None, 0, 0)  # a notice no chunk asks for (a fault's)
    m.store.queue_push(*m._notice("D", stray, "x"))
    assert m._heard("D", Chunk(1, 99, 0, 0, None, 0, 0)) is None  # popped and kept meanwhile
    m.closed(0)
    assert all(not k.startswith("0.") for got in m.heard.values() for k in got), m.heard
