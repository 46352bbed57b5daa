"""The paged cache's own checks: canary blocks and the byte comparison verification relies on."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.memory.cache import PagedCache, same_bytes
from kvlab.model.parallel import Layout, SideSpec
from kvlab.model.spec import ModelSpec
from kvlab.model.state import CacheState

SCALE = settings.default.max_examples / 100  # a tenth under `pytest -m "not slow"` (tests/conftest.py)


@settings(max_examples=int(200 * SCALE), deadline=None)
@given(st.integers(1, 3), st.integers(1, 40), st.integers(0, 9), st.integers(0, 9), st.data())
def test_same_bytes_is_torch_equal_at_any_shape_offset_and_stride(rows, cols, off_a, off_b, data):
    n = rows * cols
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    a = torch.randint(0, 256, (n + off_a,), dtype=torch.uint8, generator=g)[off_a:]
    b = torch.zeros(n + off_b, dtype=torch.uint8)[off_b:]
    b.copy_(a)
    if rows > 1:  # strided rows, as a canary block's layers in a layer-major pool
        a = a.view(rows, cols)
        wide = torch.zeros(rows, cols + data.draw(st.integers(0, 8)), dtype=torch.uint8)
        wide[:, :cols] = b.view(rows, cols)
        b = wide[:, :cols]
    assert same_bytes(a, b)
    flip = data.draw(st.integers(0, n - 1))
    if rows > 1:
        b[divmod(flip, cols)] ^= 0x01
    else:
        b[flip] ^= 0x01  # in the word prefix or in the tail
    assert not same_bytes(a, b)


@pytest.mark.parametrize("layout", list(Layout))
def test_a_write_into_any_canary_block_is_reported(layout):
    model = ModelSpec("g", 3, "gqa", kv_heads=2, head_dim=6)  # 12-byte rows: the words do not divide a row
    state = CacheState(model, SideSpec("gen", tokens_per_block=4, layout=layout), 0)
    cache = PagedCache(state, {}, spare_blocks=4, fragmentation=0.0, seed=1, device=torch.device("cpu"))
    assert cache.check_canaries() == []
    store = next(iter(cache.pools.values()))
    patterns = {b: cache._canary(store, b) for b in store.canaries}
    assert len({b"".join(v.numpy().tobytes() for v in p) for p in patterns.values()}) == len(patterns)  # a swap shows
    g = torch.Generator().manual_seed(3)
    for b in store.canaries:
        views = cache._block_view(store, b)  # one per component
        view = views[int(torch.randint(len(views), (1,), generator=g))]
        at = tuple(int(torch.randint(n, (1,), generator=g)) for n in view.shape)
        view[at] ^= 0x80
        assert cache.check_canaries() == [f"gen0: canary block {b} of pool {store.pool.name} changed"]
        view[at] ^= 0x80
    assert cache.check_canaries() == []
