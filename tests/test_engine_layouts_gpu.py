"""The engines' layouts and the KV dtype converted in flight, on the GPU: the same moves as
tests/test_engine_layouts.py and tests/test_kv_dtype.py with the pools in device memory and the NVRTC
kernels doing every pack, unpack and copy_rect (per-component strides, single-row runs), every byte,
value and canary checked as on the CPU."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_engine_layouts import DSA, GQA, MATRIX, STRATEGIES, move
from test_kv_dtype import check_bf16_to_fp8

from kvlab.model.parallel import SideSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(pair=st.sampled_from(MATRIX), strategy=st.sampled_from(STRATEGIES), pull=st.booleans(),
       fragmentation=st.sampled_from([0.0, 0.5]))
def test_engine_layout_pairs_move_verified_through_the_kernels(pair, strategy, pull, fragmentation):
    model_name, ctx_layout, gen_layout = pair
    model = GQA if model_name == "tiny_gqa" else DSA
    ctx = SideSpec("ctx", tp=2 if model is GQA else 1, layout=ctx_layout).resolved(model)
    gen = SideSpec("gen", tp=1 if model is GQA else 2, layout=gen_layout).resolved(model)
    errors, chunks, _ = move(model, ctx, gen, 150 if model is DSA else 70, strategy, pull=pull,
                             fragmentation=fragmentation, device="cuda")
    assert errors == [] and chunks


@pytest.mark.parametrize("model_name", ["tiny_gqa", "tiny_dsa"])
@pytest.mark.parametrize("strategy, pull", [("chunked", False), ("layerwise", False), ("chunked", True)])
def test_bf16_to_fp8_on_the_gpu_lands_the_expected_values(model_name, strategy, pull):
    check_bf16_to_fp8(model_name, strategy, pull, "cuda")


@pytest.mark.parametrize("kind, elems, base", [("kv", 128, "bf16"), ("kv", 16, "bf16"), ("kv", 200, "bf16"),
                                               ("kv", 128, "fp16"), ("mla", 576, "bf16")])
def test_the_fp8_rows_kernel_is_the_rule(kind, elems, base):
    """kernels/fp8_rows.cu against the test's own e4m3 rounding and against kvlab's torch form of the rule, bit
    for bit: values over forty binades, zero rows and zero values, and a row whose scale is 1 holding exact ties
    between codes, normal and subnormal."""
    from test_kv_dtype import reference_row

    from kvlab.memory.ops import cuda as cuda_ops
    from kvlab.model import kv_dtype

    g = torch.Generator().manual_seed(elems)
    n = 4096
    x = torch.randn(n, elems, generator=g) * torch.exp2(torch.randint(-30, 10, (n, 1), generator=g).float())
    x[0] = 0
    x[1, ::2] = 0
    ties = torch.tensor([448, 1.0625, 1.1875, -1.0625, 2.0 ** -10, 3 * 2.0 ** -10, -(2.0 ** -10), 0.0])
    x[2] = ties.repeat(elems // 8 + 1)[:elems]
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[base]
    vals = x.to(dt)
    rows = vals.view(torch.uint8).reshape(n, -1)
    got = cuda_ops.quantize_rows(rows.cuda(), kind, elems, base).cpu()
    assert torch.equal(got, reference_row(vals.float(), kind, base))
    assert torch.equal(got, kv_dtype.convert_rows(rows.cuda(), kind, elems, base, base, "fp8").cpu())
