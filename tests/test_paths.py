"""Which kernel moves each pair of pools (kvlab.memory.ops.paths): what ``kvlab plan`` prints and the CUDA ops take."""
from __future__ import annotations

from kvlab.memory.ops import paths
from kvlab.model.engine_layouts import EngineLayout, Layout
from kvlab.model.spec import Kind, PoolSpec
from kvlab.model.state import RankPool


def kv_pool(layout, tpb: int, elems: int = 128, fmt: str = "") -> RankPool:
    spec = PoolSpec("kv", Kind.kv, tuple(range(4)), 0, 8, (elems, elems), ("bf16", "bf16"), fmt)
    return RankPool(spec, range(4), range(8), tpb, layout)


def test_a_transpose_of_aligned_rows_takes_the_span_kernel():
    path, why = paths.copy_path(kv_pool(EngineLayout.vllm_lbnhc, 16), kv_pool(EngineLayout.trtllm, 32))
    assert path == "span" and "transpose" in why and "16 tokens" in why
    path, why = paths.rect_path(kv_pool(Layout.block_major, 16), kv_pool(Layout.layer_major, 64))
    assert path == "span" and "runs of 16 tokens of one head, 4096 bytes" in why


def test_long_runs_take_the_run_kernel():
    path, why = paths.rect_path(kv_pool(Layout.block_major, 32), kv_pool(Layout.layer_major, 64))
    assert path == "runs" and "a warp per run" in why


def test_unaligned_rows_take_the_run_kernel():
    path, why = paths.copy_path(kv_pool(EngineLayout.vllm_lbnhc, 16, 4), kv_pool(EngineLayout.trtllm, 32, 4))
    assert path == "runs" and "8 bytes" in why


def test_the_kv_dtype_converts_in_one_pass_where_the_kernel_takes_the_rows():
    assert paths.rect_path(kv_pool(EngineLayout.vllm_lbnhc, 16), kv_pool(EngineLayout.trtllm, 32, fmt="fp8"))[0] \
        == "convert"
    assert paths.rect_path(kv_pool(EngineLayout.vllm_lbnhc, 16, 12), kv_pool(EngineLayout.trtllm, 32, 12, "fp8"))[0] \
        == "staged"
    assert paths.convert_shape("kv", 128, "bf16", "bf16", "fp8").lanes == 16
    assert paths.convert_shape("mla", 576, "bf16", "fp8", "bf16").group == 128
    assert paths.convert_shape("kv", 128, "bf16", "bf16", "fp16") is None


def test_a_recurrent_state_takes_the_span_kernel_a_launch_per_component():
    """A hybrid model's state pool holds four components (three conv parts and the state): kv_copy_rect addresses
    two (its strides come in pairs), the span kernel one per launch, so an aligned state pool takes the span kernel,
    and kvlab plan says why; an unaligned one would take torch's runs (not kv_copy_rect, which would leave parts
    unmoved)."""
    from kvlab.config.schema import build, compose
    from kvlab.model.state import CacheState

    setup = build(compose(["model=qwen3_next_80b", "ctx.tp=2", "gen.tp=1"]))
    ctx = {p.name: p for p in CacheState(setup.model, setup.ctx, 0).pools()}
    gen = {p.name: p for p in CacheState(setup.model, setup.gen, 0).pools()}
    state = [n for n, p in ctx.items() if len(p.rows) > paths.KERNEL_COMPONENTS]
    assert state, "the preset has a state pool of more than two components"
    for name in state:
        path, why = paths.copy_path(ctx[name], gen[name])
        assert path == "span" and f"{len(ctx[name].rows)} components" in why
    for name in set(ctx) - set(state):  # its attention layers keep the kernels
        assert paths.copy_path(ctx[name], gen[name])[0] in ("span", "runs")
    odd = RankPool(PoolSpec("s", Kind.state, (0,), 0, 2, (12, 12, 20, 64), ("bf16",) * 4), range(1), range(2), 1,
                   Layout.block_major)
    path, why = paths.copy_path(odd, odd)
    assert path == "reference" and "4 components" in why and "not a multiple of 16" in why
