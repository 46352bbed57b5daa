"""The reference of prefill=gpu's slowdown writes the cache as the run's prefill does (kvlab.rank.prefill_gpu),
checked on CPU tensors: the same layers, each followed by its cache write, on blocks held only meanwhile."""
from __future__ import annotations

import pytest
import torch

from kvlab.config.schema import build, compose
from kvlab.config.workload import make_requests
from kvlab.memory.cache import PagedCache
from kvlab.memory.ops import get_ops
from kvlab.model.plan import Segment
from kvlab.model.state import CacheState
from kvlab.rank.prefill_gpu import GpuPrefill

CPU = torch.device("cpu")


def _ctx(overrides: list[str], rank: int = 0):
    setup = build(compose(["workload.isl=96", "workload.requests=1", *overrides]))
    state = CacheState(setup.model, setup.ctx, rank)
    req = make_requests(setup)[0]
    cache = PagedCache(state, {p.name: 16 for p in state.pools()}, spare_blocks=2, fragmentation=0.0, seed=3,
                       device=CPU)
    return setup, cache, req


@pytest.mark.parametrize("overrides", [["model=tiny_gqa", "ctx.tp=1"], ["model=tiny_gqa", "ctx.tp=1", "ctx.pp=2"]],
                         ids=["all-layers", "pp-stage"])
def test_the_alone_reference_runs_this_ranks_layers_each_with_its_cache_write(overrides):
    setup, cache, req = _ctx(overrides)
    g = GpuPrefill(setup.model, setup.ctx.tp, CPU)
    held = sorted({p.spec.layers[i] for p in cache.state.pools() for i in p.layers})
    assert held != [] and (setup.ctx.pp == 1) == (len(held) == setup.model.num_layers)
    computed, written = [], []
    layer, fill = g.layer, cache.fill
    g.layer = lambda lay, n: (computed.append(lay), layer(lay, n))[1]
    cache.fill = lambda r, ops, lay=None: (written.append(lay), fill(r, ops, lay))[1]
    free = {name: list(s.allocator.free) for name, s in cache.pools.items()}
    assert g.alone_with_cache_s(req, cache, get_ops("torch", "cpu"), repeat=1) > 0
    # a warm-up pass and one timed pass, each layer followed by its write, as the run's prefill does
    assert computed == written == held * 2
    assert req.id not in cache.tables and {n: list(s.allocator.free) for n, s in cache.pools.items()} == free


def test_the_alone_reference_writes_the_requests_contents():
    setup, cache, req = _ctx(["model=tiny_gqa", "ctx.tp=1"])
    g = GpuPrefill(setup.model, setup.ctx.tp, CPU)
    ops = get_ops("torch", "cpu")
    g.alone_with_cache_s(req, cache, ops, repeat=1)
    cache.allocate(req)  # no fragmentation: the same blocks again, still holding what the reference wrote
    held = [Segment(req.id, 0, 0, r, r.nbytes(cache.pools[name].pool.rows))
            for name in cache.pools for r in [cache.held_rect(name, req.isl)]]
    assert cache.verify(req, held, ops) == []
    cache.pools[held[0].rect.pool].storage.zero_()  # as the blocks were before: the check would have failed
    assert cache.verify(req, held, ops) != []


def test_the_plain_alone_reference_still_takes_a_length():
    setup = build(compose(["model=tiny_gqa"]))
    g = GpuPrefill(setup.model, 1, CPU)
    seen = []
    assert g.alone_s(40, repeat=1) > 0
    assert g.alone_s(40, repeat=1, write=seen.append, layers=[2, 0]) > 0
    assert seen == [0, 2, 0, 2]
