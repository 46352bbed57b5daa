"""Prefix reuse on the decode side (kvlab.model.prefix): the LRU against an oracle written from its definition, the
plan's skip over drawn layout pairs, block sizes and strategies, the gen cache's shared blocks (counted
references, verification through the sharer), and end-to-end runs: the Mooncake sample and drawn traces."""
from __future__ import annotations

import functools
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import E2E, check_figures
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf
from test_plan_properties import SCALE, SETTINGS, cases, pools_by_name, rect_bytes

from kvlab.config.schema import Config, build, compose
from kvlab.config.workload import make_requests
from kvlab.memory.cache import PagedCache
from kvlab.memory.fill import PrefixKey, expected, key_of
from kvlab.memory.ops import get_ops
from kvlab.model.layout import Rect, as_stored
from kvlab.model.plan import Request, plan
from kvlab.model.prefix import BLOCK_TOKENS, Prefix, assign, chain_keys
from kvlab.model.schedule import schedule
from kvlab.model.state import CacheState
from kvlab.results import records

B = BLOCK_TOKENS


@st.composite
def prompts(draw, max_requests: int = 24, max_blocks: int = 12):
    """(id, tokens, hash_ids, group) in arrival order: each prompt continues a prefix of an earlier one (or none)
    with ids of its own, as conversations and shared system prompts do; the last block may be partial."""
    n, groups = draw(st.integers(1, max_requests)), draw(st.integers(1, 3))
    out, fresh = [], 0
    for i in range(n):
        head: tuple[int, ...] = ()
        if out and draw(st.booleans()):
            parent = out[draw(st.integers(0, len(out) - 1))][2]
            head = parent[:draw(st.integers(0, len(parent)))]
        blocks = draw(st.integers(max(1, len(head)), max(1, len(head)) + max_blocks))
        ids = head + tuple(range(fresh, fresh + blocks - len(head)))
        fresh += blocks - len(head)
        isl = blocks * B - draw(st.sampled_from([0, 0, 1, 200, B - 1]))
        out.append((i, isl, ids, draw(st.integers(0, groups - 1))))
    return out, groups


def unbounded_hits(reqs) -> dict[int, int]:
    """The oracle: leading full blocks whose whole prefix of ids an earlier prompt of the group held as full blocks."""
    seen: dict[int, set] = {}
    out = {}
    for rid, isl, ids, g in reqs:
        held = seen.setdefault(g, set())
        full = isl // B
        k = 0
        while k < full and ids[:k + 1] in held:
            k += 1
        out[rid] = k
        held.update(ids[:b + 1] for b in range(full))
    return out


@settings(max_examples=max(10, int(200 * SCALE)), deadline=None)
@given(drawn=prompts())
def test_lru_hits_against_the_oracle_and_name_their_sources(drawn):
    reqs, groups = drawn
    total = sum(isl // B for _, isl, _, _ in reqs)
    got = assign(reqs, (total + 1) * B, groups)  # room for every block: nothing is evicted
    want = unbounded_hits(reqs)
    by_id = {r[0]: r for r in reqs}
    for rid, isl, ids, g in reqs:
        p = got[rid]
        assert p.hit == want[rid] and p.full == isl // B and len(p.keys) == len(ids)
        for b, src in enumerate(p.sources):  # an earlier prompt of the group that held the same prefix, full
            s_isl, s_ids, s_g = by_id[src][1:]
            assert src < rid and s_g == g and s_ids[:b + 1] == ids[:b + 1] and s_isl // B > b
            assert got[src].keys[b] == p.keys[b]


@settings(max_examples=max(10, int(200 * SCALE)), deadline=None)
@given(drawn=prompts(), caps=st.lists(st.integers(1, 40), min_size=2, max_size=2))
def test_a_bounded_lru_hits_less_and_never_more_than_it_holds(drawn, caps):
    reqs, groups = drawn
    small, large = sorted(caps)
    a, b = assign(reqs, small * B, groups), assign(reqs, large * B + B - 1, groups)
    want = unbounded_hits(reqs)
    for rid, *_ in reqs:
        # LRU is a stack algorithm: what a smaller cache holds, a larger one holds too
        assert a[rid].hit <= b[rid].hit <= want[rid]
        assert a[rid].hit <= small


def skip_oracle(case, pool: str, hit: int) -> int:
    """Tokens a gen pool already holds: its whole blocks inside the hit, short of the last token; none in a window."""
    if pools_by_name(case)[pool].window:
        return 0
    tpb = case.gen.tokens_per_block
    return min(hit * B, case.req.isl - 1) // tpb * tpb


@settings(max_examples=max(8, int(150 * SCALE)), **SETTINGS)
@given(case=cases(), hit=st.integers(0, 400))
def test_the_plan_skips_the_whole_gen_blocks_of_a_hit(case, hit):
    """Any layout pair, block sizes on either side, window or not, every strategy: each segment starts at the
    first token of the gen pool's first block the hit does not cover, the schedule still covers it exactly, and
    the bytes it saves are the rows it leaves out."""
    req = case.req
    hit = min(hit, req.isl // B)
    blocks = -(-req.isl // B)
    held = replace(req, prefix=Prefix(tuple(range(blocks)), hit, (0,) * hit, req.isl // B))
    assume(case.gen.dcp == 1)  # prefix reuse with DCP is refused (tests/test_bad_input.py)
    base = plan(case.model, case.ctx, case.gen, req)
    got = {(s.src, s.dst, s.rect.pool, s.rect.t1): s for s in plan(case.model, case.ctx, case.gen, held)}
    saved = 0
    for b in base:
        skip = skip_oracle(case, b.rect.pool, hit)
        g = got.pop((b.src, b.dst, b.rect.pool, b.rect.t1), None)
        if g is None:  # a context-parallel chunk the hit covers whole
            assert skip >= b.rect.t1
            saved += b.nbytes
            continue
        assert g.rect == replace(b.rect, t0=max(b.rect.t0, skip)) and g.rect.t0 % g.rect.tile == 0
        assert g.rect.t0 < req.isl
        if g.rect.t0 > b.rect.t0:
            saved += rect_bytes(case, replace(b.rect, t1=g.rect.t0))
    assert not got
    got = plan(case.model, case.ctx, case.gen, held)
    assert sum(s.nbytes for s in base) - sum(s.nbytes for s in got) == saved
    covers(case, got, schedule(case.model, case.ctx, case.gen, got, case.strategy, case.slot_bytes))


def covers(case, segs, chunks) -> None:
    """The chunks of each segment tile it exactly: every layer's tokens [t0, t1) once, no more bytes."""
    spans: dict = {}
    for c in chunks:  # a context-parallel rank owes one gen rank a segment per chunk of its tokens
        (seg,) = [s for s in segs if (s.src, s.dst, s.rect.pool) == (c.src, c.dst, c.rect.pool)
                  and s.rect.t0 <= c.rect.t0 < s.rect.t1]
        assert seg.rect.t0 <= c.rect.t0 < c.rect.t1 <= seg.rect.t1 and c.nbytes == rect_bytes(case, c.rect)
        for layer in range(c.rect.l0, c.rect.l1):
            spans.setdefault((id(seg), layer), []).append((c.rect.t0, c.rect.t1))
    for seg in segs:
        for layer in range(seg.rect.l0, seg.rect.l1):
            ivs = sorted(spans[(id(seg), layer)])
            assert ivs[0][0] == seg.rect.t0 and ivs[-1][1] == seg.rect.t1
            assert all(a[1] == b[0] for a, b in zip(ivs, ivs[1:]))
    assert sum(c.nbytes for c in chunks) == sum(s.nbytes for s in segs)


def test_a_shared_prefix_has_one_content_and_what_follows_stays_distinct():
    """With prefix reuse the fill is keyed by chained block hashes: prompts sharing blocks 0..k-1 have equal
    bytes there and different ones from their first different block on, even where later ids coincide."""
    state = CacheState(tiny_setup(16).model, tiny_setup(16).gen, 0)
    pool = state.pools()[0]
    whole = Rect(pool.name, 0, len(pool.layers), 0, len(pool.heads), 0, 3 * B, pool.tokens_per_block)
    a, b, c = (PrefixKey(chain_keys(ids)) for ids in ((0, 1, 2), (0, 1, 5), (9, 1, 2)))
    for t0, t1 in ((0, 2 * B), (2 * B, 3 * B)):
        rect = replace(whole, t0=t0, t1=t1)
        ea, eb, ec = (expected(k, pool, rect) for k in (a, b, c))
        assert torch.equal(ea, eb) == (t1 <= 2 * B)
        assert (ea != ec).float().mean() > 0.5 and (ea != expected(0, pool, rect)).float().mean() > 0.5
        if t1 > 2 * B:
            assert (ea != eb).float().mean() > 0.5


def land(cache: PagedCache, ops, req: Request, segs) -> None:
    """What a transfer does on the gen rank: the request's segments' bytes into its own blocks."""
    for s in segs:
        store, table = cache.pools[s.rect.pool], cache.tables[req.id][s.rect.pool]
        rect = as_stored(s.rect)
        ops.unpack(expected(key_of(req), store.pool, rect), store.pool, store.num_blocks, rect, table.ids,
                   table.base, store.storage)


@functools.cache
def tiny_setup(tpb: int):
    return build(compose(["model=tiny_gqa", "ctx.tp=1", "gen.tp=1", f"gen.tokens_per_block={tpb}"]))


@settings(max_examples=max(4, int(12 * SCALE)), deadline=None)
@given(drawn=prompts(max_requests=6, max_blocks=3), cap=st.integers(1, 30), tpb=st.sampled_from([16, 48, 512, 1024]),
       seed=st.integers(0, 2**16))
def test_the_gen_cache_shares_blocks_until_their_last_sharer_and_verifies_them(drawn, cap, tpb, seed):
    """Requests open in any order (a source first, as the executor allocates it), land their own segments only,
    verify whole (shared blocks included), and are released in any order: no block is freed while a sharer holds
    it, all come back at the end, and a byte changed in a shared block fails the sharer's check."""
    reqs, _ = drawn
    rng = random.Random(seed)
    setup = tiny_setup(tpb)
    prefixes = assign([(i, isl, ids, 0) for i, isl, ids, _ in reqs], cap * B, 1)
    requests = [Request(i, isl, prefix=prefixes[i]) for i, isl, _, _ in reqs]
    by_id = {r.id: r for r in requests}
    state = CacheState(setup.model, setup.gen, 0)
    need = sum(-(-r.isl // tpb) for r in requests)
    cache = PagedCache(state, {p.name: need for p in state.pools()}, 4, 0.5, seed, torch.device("cpu"))
    cache.share(requests)
    ops = get_ops("torch", "cpu")
    segs = {r.id: plan(setup.model, setup.ctx, setup.gen, r) for r in requests}
    order = list(by_id)
    rng.shuffle(order)

    def open_(r: Request) -> None:
        if r.id in cache.tables:
            return
        for src in sorted(cache.missing(r)):
            open_(by_id[src])
        cache.allocate(r)
        land(cache, ops, r, segs[r.id])

    for rid in order:
        open_(by_id[rid])
    # a sharer's table points at its sources' blocks, and its check reads them as its own
    for r in requests:
        for name, pairs in cache.shared(r).items():
            assert list(cache.tables[r.id][name].host[:len(pairs)]) == [
                cache.tables[src][name].host[n] for src, n in pairs]
        assert cache.verify(r, segs[r.id], ops) == []
    sharer = next((r for r in requests if any(cache.shared(r).values())), None)
    if sharer is not None:
        name, pairs = next((k, v) for k, v in cache.shared(sharer).items() if v)
        store = cache.pools[name]
        block = cache.tables[sharer.id][name].host[0]
        view = store.pool.block_views(store.storage, store.num_blocks, block)[0]
        view[(0,) * view.dim()] ^= 0xFF
        errors = cache.verify(sharer, segs[sharer.id], ops)
        assert errors and f"shared from request {pairs[0][0]}" in " ".join(errors), errors
        view[(0,) * view.dim()] ^= 0xFF
    total = {n: len(s.allocator.free) for n, s in cache.pools.items()}
    rng.shuffle(order)
    for i, rid in enumerate(order):
        cache.release(rid)
        held = {(n, b) for r in order[i + 1:] for n, t in cache.tables[r].items() for b in t.host}
        assert not held & {(n, b) for n, s in cache.pools.items() for b in s.allocator.free}
    assert not cache.refs and not cache.kept
    assert all(len(s.allocator.free) == s.num_blocks - len(s.canaries) for s in cache.pools.values()), total


def unreused_bytes(run_dir: Path) -> dict[int, int]:
    """Each request's bytes in the plan of the run's own config with the prefix cache off."""
    schema = OmegaConf.structured(Config)
    OmegaConf.set_struct(schema, False)
    cfg = OmegaConf.merge(schema, OmegaConf.load(run_dir / "config.yaml"))
    cfg.gen.prefix_cache_tokens = 0
    setup = build(cfg)
    return {r.id: sum(s.nbytes for s in plan(setup.model, setup.ctx, setup.gen, r)) for r in make_requests(setup)}


def check_reuse(run_dir: Path) -> tuple[list, object]:
    """Every request verified; its bytes plus the skipped ones are its plan's without reuse; its hits are the
    LRU's (kvlab.config.workload's requests), and the run's figures sum them."""
    rows, summary = records.read_rows(run_dir), records.read_summary(run_dir)
    assert summary.verified and all(r.verified for r in rows), [r.error for r in rows if not r.verified]
    check_figures(run_dir)
    full = unreused_bytes(run_dir)
    schema = OmegaConf.structured(Config)
    OmegaConf.set_struct(schema, False)
    planned = {r.id: r.prefix for r in make_requests(build(OmegaConf.merge(schema, OmegaConf.load(
        run_dir / "config.yaml"))))}
    for r in rows:
        assert r.bytes + r.skipped_bytes == full[r.request], r.request
        assert (r.prefix_hit_blocks, r.prefix_blocks) == (planned[r.request].hit, planned[r.request].full)
        if planned[r.request].hit == 0:
            assert r.skipped_bytes == 0 and r.ttft_no_reuse_s == r.ttft_s
    assert summary.skipped_bytes == sum(r.skipped_bytes for r in rows)
    assert summary.prefix_hit_blocks == sum(p.hit for p in planned.values())
    return rows, summary


@pytest.mark.slow
def test_mooncake_sample_with_a_prefix_cache(tmp_path, kvlab_cli):
    """workload=mooncake with gen.prefix_cache_tokens: the shared system prompt's block is not moved again."""
    run_dir = tmp_path / "run"
    p = kvlab_cli("run", f"hydra.run.dir={run_dir}", "logger=quiet", "workload=mooncake", "workload.requests=8",
                  "gen.prefix_cache_tokens=16384", "transfer.baseline=false", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    rows, summary = check_reuse(run_dir)
    assert summary.skipped_bytes > 0 and 0 < summary.prefix_hit_rate < 1
    # the terminal says what the feature is for: its hit rate and the bytes it did not move
    said = (f"prefix reuse: hit rate {summary.prefix_hit_rate:.3f} ({summary.prefix_hit_blocks} of "
            f"{summary.prefix_blocks} full blocks found); skipped {summary.skipped_bytes / 2**20:,.2f} MiB")
    assert said in " ".join(p.stdout.split()), p.stdout


@pytest.mark.slow
@settings(max_examples=2, **E2E)
@given(drawn=prompts(max_requests=6, max_blocks=5), cap=st.sampled_from([512, 1536, 65536]),
       side=st.sampled_from([("1", "16", "block_major"), ("2", "48", "layer_major"), ("1", "1024", "block_major"),
                             ("2", "64", "vllm_lbhnc")]),
       how=st.sampled_from([("p2p", "chunked"), ("p2p", "layerwise"), ("ipc", "zerocopy"), ("ipc", "layerwise")]),
       concurrency=st.integers(1, 4), spread_ms=st.sampled_from([0, 40]))
def test_drawn_traces_reuse_verified_end_to_end(tmp_path_factory, drawn, cap, side, how, concurrency, spread_ms):
    """Prompts continuing each other's prefixes, a cache that may evict, gen block sizes that divide the trace's
    block, do not, or exceed it, over both transports and three strategies: every byte, shared ones included,
    checked."""
    from conftest import _run

    reqs, _ = drawn
    tmp = tmp_path_factory.mktemp("prefix")
    trace = tmp / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i * spread_ms, "input_length": isl, "output_length": 8,
                                         "hash_ids": list(ids)}) + "\n" for i, isl, ids, _ in reqs))
    tp, tpb, layout = side
    transport, strategy = how
    run_dir = tmp / "run"
    p = _run("run", f"hydra.run.dir={run_dir}", "logger=quiet", "workload=mooncake", f"workload.trace={trace}",
             f"workload.requests={len(reqs)}", "workload.time_scale=1", f"workload.concurrency={concurrency}",
             f"gen.prefix_cache_tokens={cap}", f"gen.tp={tp}", f"gen.tokens_per_block={tpb}", f"gen.layout={layout}",
             f"transport={transport}", f"transfer={strategy}", "transfer.baseline=false", cwd=tmp)
    assert p.returncode == 0, (p.stderr[-3000:], reqs)
    check_reuse(run_dir)
