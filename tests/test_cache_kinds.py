"""A cache kind is data (kvlab.model.spec.KINDS): one defined here, in the test, goes through plan, fill, copy
and verification like the built-in ones, split over TP heads or replicated as its entry says, with no
other change anywhere."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.memory.cache import PagedCache, blocks_for
from kvlab.memory.ops import get_ops
from kvlab.model.parallel import Layout, SideSpec
from kvlab.model.plan import Request, plan
from kvlab.model.spec import KINDS, KindDef, ModelSpec
from kvlab.model.state import CacheState

SCALE = settings.default.max_examples / 100  # a tenth under `pytest -m "not slow"` (tests/conftest.py)


def _register(kind: KindDef) -> None:
    KINDS[kind.name] = kind
    ModelSpec.pools.cache_clear()  # a model's pools are cached per spec: an equal spec must see the new table


def _toy(replicated: bool) -> KindDef:
    # say, a compressed cache: per token and head 12 bf16 values and 2 fp32 scales, beside the model's K and V
    return KindDef("toy", replicated, 9, lambda m, dtype: ((1 if replicated else m.kv_heads), (12, 2),
                                                           (dtype, "fp32")) if m.name == "toy" else None)


@settings(max_examples=int(40 * SCALE), deadline=None)
@given(replicated=st.booleans(), ctx_tp=st.sampled_from([1, 2]), gen_tp=st.sampled_from([1, 2, 4]),
       ctx_tpb=st.sampled_from([4, 16]), gen_tpb=st.sampled_from([4, 8]),
       gen_layout=st.sampled_from(list(Layout)), isl=st.integers(1, 70))
def test_a_kind_defined_in_a_test_moves_verified(replicated, ctx_tp, gen_tp, ctx_tpb, gen_tpb, gen_layout, isl):
    _register(_toy(replicated))
    try:
        model = ModelSpec("toy", 3, "gqa", kv_heads=4, head_dim=6)
        assert [p.name for p in model.pools()] == ["kv", "toy"]
        ctx = SideSpec("ctx", tp=ctx_tp, tokens_per_block=ctx_tpb)
        gen = SideSpec("gen", tp=gen_tp, tokens_per_block=gen_tpb, layout=gen_layout)
        req = Request(0, isl)
        ops = get_ops("torch", "cpu")
        caches = {}
        for side in (ctx, gen):
            for r in range(side.size):
                state = CacheState(model, side, r)
                need = {p.name: blocks_for(p, isl) for p in state.pools()}
                cache = PagedCache(state, need, spare_blocks=2, fragmentation=0.5, seed=r, device=torch.device("cpu"))
                cache.allocate(req)
                caches[(side.name, r)] = cache
        for r in range(ctx.size):
            caches[("ctx", r)].fill(req, ops)
        segments = plan(model, ctx, gen, req)
        toy = [s for s in segments if s.rect.pool == "toy"]
        for g in range(gen.size):  # replicated: one ctx rank sends a gen rank all of it; split: each its heads
            senders = {s.src for s in toy if s.dst == g}
            assert len(senders) == 1 if replicated else len(senders) == ctx.size // math.gcd(ctx.size, gen.size)
        for s in segments:
            src, dst = caches[("ctx", s.src)], caches[("gen", s.dst)]
            sp, dp = src.pools[s.rect.pool], dst.pools[s.rect.pool]
            st_, dt_ = src.tables[0][s.rect.pool], dst.tables[0][s.rect.pool]
            ops.copy_rect(sp.storage, sp.pool, sp.num_blocks, st_.ids, st_.base,
                          dp.storage, dp.pool, dp.num_blocks, dt_.ids, dt_.base, s.rect)
        for g in range(gen.size):
            mine = [s for s in segments if s.dst == g]
            heads = sum(s.rect.h1 - s.rect.h0 for s in mine if s.rect.pool == "toy" and s.rect.t0 == 0
                        and s.rect.l0 == 0)
            assert heads == (1 if replicated else 4 // gen_tp)
            assert caches[("gen", g)].verify(req, mine, ops) == []
    finally:
        del KINDS["toy"]
        ModelSpec.pools.cache_clear()


def test_bytes_landed_in_another_kinds_pool_are_caught():
    """The kind's tag is in the fill hash: a kind shaped exactly like K and V still holds other bytes at the
    same coordinates, so bytes delivered into the wrong kind's pool fail verification."""
    from kvlab.memory.fill import expected
    from kvlab.model.layout import Rect

    _register(KindDef("toy", False, 9, lambda m, dtype: (m.kv_heads, (m.head_dim, m.head_dim), (dtype, dtype))
                      if m.name == "toy" else None))
    try:
        model = ModelSpec("toy", 2, "gqa", kv_heads=2, head_dim=6)
        state = CacheState(model, SideSpec("gen", tokens_per_block=4), 0)
        kv, toy = state.pool("kv"), state.pool("toy")
        assert kv.rows == toy.rows
        a = expected(0, toy, Rect("toy", 0, 2, 0, 2, 0, 8, 4))
        b = expected(0, kv, Rect("kv", 0, 2, 0, 2, 0, 8, 4))
        assert a.shape == b.shape and not torch.equal(a, b)
    finally:
        del KINDS["toy"]
        ModelSpec.pools.cache_clear()


def test_an_unknown_kind_is_named():
    with pytest.raises(KeyError, match="nope"):
        KINDS["nope"]
