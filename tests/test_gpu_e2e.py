"""NCCL end-to-end runs on the GPU machine: every strategy verified, and mismatched sides on 2 GPUs.

With two GPUs and three ranks (ctx TP2 -> gen TP1, or ctx TP1 -> gen TP2) two ranks share a
GPU; kvlab puts the ctx ranks on GPU0 and the gen ranks on GPU1 and gives every ctx/gen pair
its own communicator, which NCCL accepts (it refuses two ranks of one communicator on one GPU).
"""
from __future__ import annotations

import pytest
import torch

from kvlab.api import run_transfer

pytestmark = [pytest.mark.gpu2, pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

BASE = ["logger=quiet", "device=cuda", "kernels=cuda", "workload.requests=3", "workload.concurrency=2"]


@pytest.mark.parametrize("strategy", ["naive", "chunked", "layerwise", "zerocopy"])
@pytest.mark.parametrize("model", ["tiny_gqa", "tiny_dsa", "tiny_swa"])
def test_nccl_strategies_verified(strategy, model, tmp_path):
    s = run_transfer(BASE + [f"model={model}", "parallel=same", f"transfer={strategy}", "workload.isl=5000",
                             "transfer.slot_mib=0.5", "cache.fragmentation=0.3"], tmp_path)
    assert s["verified"] and s["backend"].startswith("cpu:gloo") and s["kernels"] == "cuda", s
    if strategy != "naive":
        # nothing but the slots (and NCCL's own buffers, outside the allocator) during transfers
        assert s["peak_extra_device_bytes"] <= s["peak_staging_bytes"] + (1 << 20), s


@pytest.mark.parametrize("sides", [["ctx.tp=2", "gen.tp=1"], ["ctx.tp=1", "gen.tp=2"],
                                   ["ctx.tp=2", "gen.tp=2", "gen.pp=2", "model.num_layers=4"],
                                   ["model=tiny_dsa", "ctx.tp=2", "gen.tp=1", "gen.dp=2"]])
def test_mismatched_sides_on_two_gpus(sides, tmp_path):
    s = run_transfer(BASE + sides + ["transfer=chunked", "workload.isl=3000", "transfer.slot_mib=0.25"], tmp_path)
    assert s["verified"], s
