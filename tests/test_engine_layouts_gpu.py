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
