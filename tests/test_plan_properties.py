"""Plan and schedule invariants over random models, parallel layouts, prompts and strategies.

Expectations come from an oracle written from the design's definitions (stage layers,
head split/duplication, sliding windows, bytes per element, context-parallel chunks and
DCP interleave runs), not from the code under test. Elements are tracked as
(kind, layer, head) -> token intervals, so prompts of hundreds of thousands of tokens
cost no more than short ones; on a DCP gen rank the intervals count its local positions
(the n-th token it holds), and the source's chunk is checked at the global tokens of
their ends (the map from local positions to global tokens is increasing).
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from kvlab.model.parallel import Layout, SideSpec
from kvlab.model.plan import Request, plan
from kvlab.model.schedule import Strategy, preset_names, schedule
from kvlab.model.schedule import preset as strategy_preset
from kvlab.model.spec import ModelSpec
from kvlab.model.state import CacheState

CONF = Path(__file__).resolve().parent.parent / "conf" / "model"
ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
INDEXER_TOKEN_BYTES = 128 + 4  # 128 fp8 values and one fp32 scale


STRATEGY = {name: strategy_preset(name) for name in preset_names()}  # the presets of conf/transfer/


def preset(name: str) -> ModelSpec:
    d = OmegaConf.to_container(OmegaConf.load(CONF / f"{name}.yaml"))
    d.pop("defaults", None)
    return ModelSpec(**d)


PRESETS = [preset(n) for n in ("tiny_gqa", "tiny_mla", "tiny_dsa", "tiny_swa")]


# ---------------------------------------------------------------- oracle

def stages(num_layers: int, side: SideSpec) -> list[range]:
    counts = side.layer_split or [num_layers // side.pp + (s < num_layers % side.pp) for s in range(side.pp)]
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def coords(side: SideSpec, rank: int) -> tuple[int, int, int]:
    """(dp, pp, tp) of a side-local rank: TensorRT-LLM's order, TP innermost, then CP, then PP, then DP; a TP
    group of tp * dcp ranks (vLLM's DCP group: dcp consecutive TP ranks)."""
    t = side.tp * side.dcp
    return rank // (side.pp * side.cp * t), rank // (side.cp * t) % side.pp, rank % t


def cp_rank(side: SideSpec, rank: int) -> int:
    return rank // (side.tp * side.dcp) % side.cp


def cp_chunks(side: SideSpec, rank: int, isl: int) -> list[tuple[int, int]]:
    """The global token intervals a ctx CP rank holds: 2*cp (load-balanced) or cp chunks of whole blocks, as
    even as they go, earlier chunks the larger; load-balanced rank r holds chunks r and 2*cp-1-r."""
    n = side.cp * (2 if side.cp_scheme == "load_balanced" else 1)
    blocks = -(-isl // side.tokens_per_block)
    sizes = [blocks // n + (i < blocks % n) for i in range(n)]
    starts = [sum(sizes[:i]) * side.tokens_per_block for i in range(n + 1)]
    r = cp_rank(side, rank)
    own = {r, n - 1 - r} if side.cp_scheme == "load_balanced" else {r}
    return [(min(starts[i], isl), min(starts[i + 1], isl)) for i in sorted(own) if starts[i] < isl]


def dcp_position(gen: SideSpec, rank: int, t: int) -> int:
    """How many tokens before global token ``t`` DCP rank ``rank % dcp``'s interleave runs hold."""
    i, d = gen.dcp_interleave, rank % gen.dcp
    return sum(1 for x in range(t % (i * gen.dcp)) if x // i == d) + t // (i * gen.dcp) * i


def dcp_token(gen: SideSpec, rank: int, u: int) -> int:
    """The global token at local position ``u`` of a DCP rank."""
    i, d = gen.dcp_interleave, rank % gen.dcp
    return u // i * i * gen.dcp + d * i + u % i


def held_heads(n_heads: int, tp: int, t: int, dcp: int = 1) -> set[int]:
    t = t // dcp  # TP rank t is in head group t // dcp: a DCP group's ranks hold the same heads
    if n_heads == 1:
        return {0}
    if tp <= n_heads:
        per = n_heads // tp
        return set(range(t * per, (t + 1) * per))
    return {t // (tp // n_heads)}


def window_of(model: ModelSpec, layer: int) -> int:
    if not model.window:
        return 0
    if not model.local_per_global:
        return model.window
    return model.window if layer % (model.local_per_global + 1) != model.local_per_global else 0


def kinds(model: ModelSpec) -> list[str]:
    if model.attention.value == "gqa":
        return ["kv"]
    return ["mla", "indexer"] if model.indexer else ["mla"]


def kind_heads(model: ModelSpec, kind: str) -> int:
    return model.kv_heads if kind == "kv" else 1


def head_token_bytes(model: ModelSpec, kind: str, dtype: str) -> int:
    """Bytes of one token of one layer of one head."""
    if kind == "kv":
        return 2 * model.head_dim * ELEM_BYTES[dtype]
    if kind == "mla":
        return model.mla_dim * ELEM_BYTES[dtype]
    return INDEXER_TOKEN_BYTES


def first_token(window: int, isl: int, align: int) -> int:
    return max(0, isl - window) // align * align if window else 0


def required(model: ModelSpec, gen: SideSpec, rank: int, isl: int, tile: int) -> dict:
    """(kind, layer, head) -> (first, last) tokens the gen rank must receive."""
    _, pp, tp = coords(gen, rank)
    out = {}
    pos = (lambda t: dcp_position(gen, rank, t)) if gen.dcp > 1 else (lambda t: t)
    for layer in stages(model.num_layers, gen)[pp]:
        for kind in kinds(model):
            for h in held_heads(kind_heads(model, kind), gen.tp, tp, gen.dcp):
                a, b = pos(first_token(window_of(model, layer), isl, tile)), pos(isl)
                if a < b:
                    out[(kind, layer, h)] = (a, b)
    return out


def required_bytes(model: ModelSpec, need: dict, dtype: str) -> int:
    return sum((b - a) * head_token_bytes(model, k, dtype) for (k, _, _), (a, b) in need.items())


# ---------------------------------------------------------------- generation

@dataclass(frozen=True)
class Case:
    model: ModelSpec
    ctx: SideSpec
    gen: SideSpec
    req: Request
    strategy: Strategy
    slot_bytes: int

    @property
    def tile(self) -> int:
        run = self.gen.dcp_interleave if self.gen.dcp > 1 else 0  # gcd(x, 0) = x: no DCP, no run to stay in
        return math.gcd(self.ctx.tokens_per_block, self.gen.tokens_per_block, run)


@st.composite
def models(draw):
    which = draw(st.sampled_from(["gqa", "mla", "preset"]))
    if which == "preset":
        return draw(st.sampled_from(PRESETS))
    layers = draw(st.integers(1, 12))
    window = draw(st.sampled_from([0, 0, 1, 7, 16, 64, 100, 300]))
    lpg = draw(st.integers(0, 3)) if window else 0
    if which == "gqa":
        return ModelSpec("g", layers, "gqa", kv_heads=draw(st.sampled_from([1, 2, 3, 4, 6, 8])),
                         head_dim=draw(st.sampled_from([1, 4, 16, 64])), window=window, local_per_global=lpg)
    return ModelSpec("m", layers, "mla", mla_dim=draw(st.sampled_from([1, 64, 576])), indexer=draw(st.booleans()),
                     window=window, local_per_global=lpg)


@st.composite
def sides(draw, name: str, model: ModelSpec, dtype: str):
    h = model.tp_heads
    tps = [d for d in range(1, h + 1) if h % d == 0] + [2 * h, 3 * h] if h > 1 else [1, 2, 3, 4]
    pp = draw(st.integers(1, min(4, model.num_layers)))
    split = None
    if pp > 1 and draw(st.booleans()):
        cuts = sorted(draw(st.lists(st.integers(1, model.num_layers - 1), min_size=pp - 1, max_size=pp - 1,
                                    unique=True)))
        bounds = [0, *cuts, model.num_layers]
        split = tuple(b - a for a, b in pairwise(bounds))
    tpb = draw(st.sampled_from([8, 16, 32, 64]))
    cp, dcp, more = 1, 1, {}
    if name == "ctx" and draw(st.booleans()):  # context parallelism: more ranks, chunks of the prompt
        cp = draw(st.integers(2, 4))
        more = {"cp": cp, "cp_scheme": draw(st.sampled_from(["contiguous", "load_balanced"]))}
    if name == "gen" and draw(st.booleans()):  # DCP: TP ranks, interleave runs dividing the block
        dcp = draw(st.sampled_from([2, 3, 4]))
        more = {"dcp": dcp, "dcp_interleave": draw(st.sampled_from([i for i in (1, 2, 4, 8, 16, 64) if tpb % i == 0]))}
    return SideSpec(name, tp=draw(st.sampled_from(tps)), pp=pp, dp=draw(st.integers(1, 3)),
                    tokens_per_block=tpb, layout=draw(st.sampled_from(list(Layout))), dtype=dtype, layer_split=split,
                    **more)


def min_slot(model: ModelSpec, ctx: SideSpec, gen: SideSpec) -> int:
    """One token of one layer of the widest segment: the smallest slot a schedule can use."""
    out = 0
    for kind in kinds(model):
        n = kind_heads(model, kind)
        seg_heads = max(1, n // max(ctx.tp, gen.tp)) if n > 1 else 1
        out = max(out, seg_heads * head_token_bytes(model, kind, ctx.dtype))
    return out


@st.composite
def cases(draw, strategies=None):
    model = draw(models())
    dtype = draw(st.sampled_from(["bf16", "fp8", "fp32"]))
    ctx = draw(sides("ctx", model, dtype))
    gen = draw(sides("gen", model, dtype))
    isl = draw(st.one_of(st.integers(1, 700), st.integers(1, 200_000)))
    req = Request(draw(st.integers(0, 1000)), isl, draw(st.integers(0, ctx.dp - 1)), draw(st.integers(0, gen.dp - 1)))
    strategy = draw(st.sampled_from(strategies or tuple(STRATEGY.values())))
    lo = min_slot(model, ctx, gen)
    slot = lo * draw(st.sampled_from([1, 2, 3, 7, 40, 1000, 10**6]))
    # keep the chunk count bounded: zero-copy decisions cost a few runs() calls per chunk
    moved = model.bytes_per_token(dtype) * isl * max(gen.tp, 1)
    slot = max(slot, moved // (100 if strategy == STRATEGY["zerocopy"] else 1500))
    return Case(model, ctx, gen, req, strategy, slot)


SCALE = settings.default.max_examples / 100  # 0.1 under `pytest -m "not slow"` (tests/conftest.py)
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---------------------------------------------------------------- checks

def pools_by_name(case: Case) -> dict:
    return {p.name: p for p in case.model.pools(case.ctx.dtype)}


def elements(case: Case, rect) -> tuple[str, list[int], range]:
    p = pools_by_name(case)[rect.pool]
    return p.kind, [p.layers[i] for i in range(rect.l0, rect.l1)], range(rect.h0, rect.h1)


def rect_bytes(case: Case, rect) -> int:
    kind, layers, heads = elements(case, rect)
    return len(layers) * len(heads) * (rect.t1 - rect.t0) * head_token_bytes(case.model, kind, case.ctx.dtype)


def global_span(case: Case, dst: int, rect) -> tuple[int, int]:
    """The first and one past the last global token of ``rect`` as gen rank ``dst`` counts it."""
    if rect.local is None:
        return rect.t0, rect.t1
    return dcp_token(case.gen, dst, rect.t0), dcp_token(case.gen, dst, rect.t1 - 1) + 1


def gen_group(case: Case) -> list[int]:
    n = case.gen.pp * case.gen.tp * case.gen.dcp
    return list(range(case.req.gen_dp * n, (case.req.gen_dp + 1) * n))


def check_pools_partition_layers(model: ModelSpec, dtype: str) -> None:
    seen = defaultdict(int)
    for p in model.pools(dtype):
        assert list(p.layers) == sorted(p.layers)
        for layer in p.layers:
            assert window_of(model, layer) == p.window
            seen[(p.kind, layer)] += 1
    assert seen == {(k, layer): 1 for k in kinds(model) for layer in range(model.num_layers)}


def check_plan(case: Case, segs) -> None:
    model, ctx, gen, req = case.model, case.ctx, case.gen, case.req
    check_pools_partition_layers(model, ctx.dtype)
    got: dict[int, dict] = defaultdict(lambda: defaultdict(list))
    group = set(gen_group(case))
    for s in segs:
        r = s.rect
        assert s.request == req.id
        assert r.tile == case.tile and ctx.tokens_per_block % r.tile == 0 and gen.tokens_per_block % r.tile == 0
        assert gen.dcp == 1 or gen.dcp_interleave % r.tile == 0
        assert 0 <= r.t0 < r.t1 <= req.isl and r.l0 < r.l1 and r.h0 < r.h1
        assert s.dst in group
        g0, g1 = global_span(case, s.dst, r)
        # the tokens of one CP chunk of the source
        assert any(a <= g0 and g1 <= b for a, b in cp_chunks(ctx, s.src, req.isl)), (s, cp_chunks(ctx, s.src, req.isl))
        assert s.nbytes == rect_bytes(case, r) == r.nbytes(pools_by_name(case)[r.pool].comp_row_bytes())
        kind, layers, heads = elements(case, r)
        # the source really holds what it sends
        dp, pp, tp = coords(ctx, s.src)
        assert 0 <= s.src < ctx.size and dp == req.ctx_dp
        assert set(layers) <= set(stages(model.num_layers, ctx)[pp])
        assert set(heads) <= held_heads(kind_heads(model, kind), ctx.tp, tp)
        for layer in layers:
            assert g0 >= first_token(window_of(model, layer), req.isl, ctx.tokens_per_block)
            for h in heads:
                got[s.dst][(kind, layer, h)].append((r.t0, r.t1))
    for dst in group:
        need = required(model, gen, dst, req.isl, case.tile)
        assert set(got[dst]) == set(need), f"gen rank {dst}: wrong (kind, layer, head) set"
        for key, (a, b) in need.items():
            ivs = sorted(got[dst][key])
            # exactly once: intervals abut with no gap or overlap and span [a, b)
            assert ivs[0][0] == a and ivs[-1][1] == b, (key, ivs, a, b)
            assert all(x[1] == y[0] for x, y in pairwise(ivs)), (key, ivs)
        assert sum(s.nbytes for s in segs if s.dst == dst) == required_bytes(model, need, ctx.dtype)
    assert set(got) <= group


def check_schedule(case: Case, segs, chunks) -> None:
    by_key = defaultdict(list)
    for s in segs:
        by_key[(s.src, s.dst, s.rect.pool)].append(s)
    # two segments for one (src, dst, pool) only from the two chunks of a load-balanced CP rank
    assert all(len(v) <= (2 if case.ctx.cp_scheme == "load_balanced" else 1) for v in by_key.values())
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    parts: dict = defaultdict(lambda: defaultdict(list))
    for c in chunks:
        (seg,) = [s for s in by_key[(c.src, c.dst, c.rect.pool)] if s.rect.t0 <= c.rect.t0 < s.rect.t1]
        r, sr = c.rect, seg.rect
        assert c.request == seg.request
        assert (r.h0, r.h1, r.tile) == (sr.h0, sr.h1, sr.tile)
        assert sr.l0 <= r.l0 < r.l1 <= sr.l1 and sr.t0 <= r.t0 < r.t1 <= sr.t1
        assert c.nbytes == rect_bytes(case, r) == r.nbytes(pools_by_name(case)[r.pool].comp_row_bytes())
        _, layers, _ = elements(case, r)
        if case.strategy == STRATEGY["layerwise"]:
            assert r.l1 - r.l0 == 1 and c.ready_layer == layers[0]
        else:
            assert c.ready_layer == max(layers)
        if case.strategy != STRATEGY["naive"]:
            assert c.nbytes <= case.slot_bytes, (c, case.slot_bytes)
        for layer in range(r.l0, r.l1):
            parts[id(seg)][layer].append((r.t0, r.t1))
    for seg in segs:
        layers = parts[id(seg)]
        assert set(layers) == set(range(seg.rect.l0, seg.rect.l1))
        for ivs in layers.values():
            ivs.sort()
            assert ivs[0][0] == seg.rect.t0 and ivs[-1][1] == seg.rect.t1
            assert all(x[1] == y[0] for x, y in pairwise(ivs))
    if case.strategy == STRATEGY["naive"]:
        assert [(c.src, c.dst, c.rect, c.nbytes) for c in chunks] == [(s.src, s.dst, s.rect, s.nbytes) for s in segs]
    if case.strategy == STRATEGY["layerwise"]:
        ready = [c.ready_layer for c in chunks]
        assert ready == sorted(ready)
    if case.strategy in (STRATEGY["chunked"], STRATEGY["zerocopy"]):
        # round-robin: every segment's first chunk goes before any segment's second
        seen, first_round = set(), True
        for c in chunks:
            key = next(i for i, s in enumerate(segs) if (s.src, s.dst, s.rect.pool) == (c.src, c.dst, c.rect.pool)
                       and s.rect.t0 <= c.rect.t0 < s.rect.t1)
            if key in seen:
                first_round = False
            else:
                assert first_round, "a segment's first chunk waited behind another's second"
                seen.add(key)
    for dst in gen_group(case):
        need = required(case.model, case.gen, dst, case.req.isl, case.tile)
        assert sum(c.nbytes for c in chunks if c.dst == dst) == required_bytes(case.model, need, case.ctx.dtype)


def check_zerocopy_flags(case: Case, segs, chunks) -> None:
    """Conditions on in-place flags that follow from the layout alone, on each side."""
    T = case.tile
    for c in chunks:
        r = c.rect
        kind, layers, heads = elements(case, r)
        pool = pools_by_name(case)[r.pool]
        end = next(s.rect.t1 for s in segs if (s.src, s.dst, s.rect.pool) == (c.src, c.dst, r.pool)
                   and s.rect.t0 <= r.t0 < s.rect.t1)
        assert not (end % T and r.t0 < end // T * T < r.t1), "a chunk straddles the partial last tile"
        for side, rank, flag in ((case.ctx, c.src, c.ctx_in_place), (case.gen, c.dst, c.gen_in_place)):
            tpb = side.tokens_per_block
            _, pp, tp = coords(side, rank)
            stage = stages(case.model.num_layers, side)[pp]
            rank_layers = [g for g in pool.layers if g in stage]
            full_heads = set(heads) == held_heads(pool.heads, side.tp, tp, side.dcp)
            groups = len(layers) * len(pool.comp_elems) * len(heads)
            tiles_short = any(min((a // T + 1) * T, r.t1) - a < tpb
                              for a in [r.t0, *range((r.t0 // T + 1) * T, r.t1, T)])
            if groups > 1 and tiles_short:
                assert not flag, (side.name, c)
            if len(pool.comp_elems) > 1 and not full_heads:
                assert not flag, (side.name, c)
            blocks = (r.t1 - r.t0) // tpb
            # a rectangle in a DCP rank's positions is strided on the ctx side: its flag there says nothing here
            whole = T == tpb and r.t0 % tpb == 0 and r.t1 % tpb == 0 and full_heads and \
                (r.local is None or side.name == "gen")
            if whole and side.layout == Layout.block_major and (layers == rank_layers or blocks == 1):
                assert flag, (side.name, c)
            if whole and side.layout == Layout.layer_major and len(layers) == 1:
                assert flag, (side.name, c)


def rebuilt(state: CacheState) -> tuple[ModelSpec, SideSpec]:
    """What a peer reconstructs from the handshake dict: fresh objects, equal values."""
    d = state.to_dict()
    return ModelSpec(**d["model"]), SideSpec(**d["side"])


# ---------------------------------------------------------------- tests

@settings(max_examples=int(1500 * SCALE), **SETTINGS)
@given(cases(strategies=(STRATEGY["naive"],)))
def test_plan_exact_cover_from_holders(case):
    check_plan(case, plan(case.model, case.ctx, case.gen, case.req))


@settings(max_examples=int(700 * SCALE), **SETTINGS)
@given(cases(strategies=(STRATEGY["naive"], STRATEGY["chunked"], STRATEGY["layerwise"])))
def test_schedule_partitions_segments_within_slots(case):
    segs = plan(case.model, case.ctx, case.gen, case.req)
    chunks = schedule(case.model, case.ctx, case.gen, segs, case.strategy, case.slot_bytes)
    check_schedule(case, segs, chunks)


@settings(max_examples=int(250 * SCALE), **SETTINGS)
@given(cases(strategies=(STRATEGY["zerocopy"],)))
def test_zerocopy_schedule(case):
    segs = plan(case.model, case.ctx, case.gen, case.req)
    chunks = schedule(case.model, case.ctx, case.gen, segs, case.strategy, case.slot_bytes)
    check_schedule(case, segs, chunks)
    check_zerocopy_flags(case, segs, chunks)


@settings(max_examples=int(150 * SCALE), **SETTINGS)
@given(cases())
def test_both_sides_derive_the_same_schedule(case):
    # the ctx side knows its own specs and the gen side's handshake dict, and vice versa
    src = plan(case.model, case.ctx, case.gen, case.req)[0].src
    dst = gen_group(case)[0]
    gen_model, gen_spec = rebuilt(CacheState(case.model, case.gen, dst))
    ctx_model, ctx_spec = rebuilt(CacheState(case.model, case.ctx, src))
    assert gen_model is not case.model and gen_model == case.model
    ModelSpec.pools.cache_clear()
    on_ctx = plan(case.model, case.ctx, gen_spec, case.req)
    sched_ctx = schedule(case.model, case.ctx, gen_spec, on_ctx, case.strategy, case.slot_bytes)
    ModelSpec.pools.cache_clear()
    on_gen = plan(gen_model, ctx_spec, case.gen, Request(case.req.id, case.req.isl, case.req.ctx_dp, case.req.gen_dp))
    sched_gen = schedule(gen_model, ctx_spec, case.gen, on_gen, case.strategy, case.slot_bytes)
    assert on_ctx == on_gen
    assert sched_ctx == sched_gen
    # and computing again on the same objects changes nothing
    assert schedule(case.model, case.ctx, case.gen, on_ctx, case.strategy, case.slot_bytes) == sched_ctx


@pytest.mark.parametrize("isl", [1, 2, 63, 64, 65, 131072, 131073])
@pytest.mark.parametrize("strategy", list(STRATEGY.values()))
def test_presets_at_edges(isl, strategy):
    for model in PRESETS:
        ctx = SideSpec("ctx", tp=2, pp=min(3, model.num_layers), tokens_per_block=16)
        gen = SideSpec("gen", tp=1, pp=2, tokens_per_block=64, layout=Layout.layer_major)
        case = Case(model, ctx, gen, Request(0, isl), strategy, max(1 << 16, model.bytes_per_token() * isl // 200))
        segs = plan(model, ctx, gen, case.req)
        check_plan(case, segs)
        check_schedule(case, segs, schedule(model, ctx, gen, segs, strategy, case.slot_bytes))
