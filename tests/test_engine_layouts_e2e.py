"""The engines' layouts through the real ``kvlab run``: rank processes, every transport, verified byte for byte."""
from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import check_figures

pytestmark = pytest.mark.slow


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


CASES = {
    # vLLM NHD (ctx TP2) into FlashInfer HND pulled pool to pool, zero-copy strategy: single-token runs
    "vllm_nhd-flashinfer_hnd-ipc": ["model=tiny_gqa", "ctx.layout=vllm_lbnhc", "gen.layout=flashinfer_hnd",
                                    "transport=ipc", "transfer=zerocopy"],
    # SGLang's token slots into vLLM's FlashAttention blocks of 32, TP1 -> TP2, layer by layer over p2p
    "sglang-vllm_flash-p2p": ["model=tiny_gqa", "ctx.tp=1", "gen.tp=2", "ctx.layout=sglang", "ctx.tokens_per_block=8",
                              "gen.layout=vllm_flash", "gen.tokens_per_block=32", "transfer=layerwise"],
    # DeepSeek-V3.2 from TensorRT-LLM's block-major pools into vLLM HND, written run by run (mooncake direct)
    "trtllm-vllm_hnd-mooncake": ["model=tiny_dsa", "ctx.layout=trtllm", "gen.layout=vllm_lbhnc", "transport=mooncake",
                                 "transport.mode=direct"],
}
NEEDS = {"trtllm-vllm_hnd-mooncake": "mooncake"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_engine_layouts_run_verified(name, kvlab_cli, tmp_path):
    if name in NEEDS and not _has(NEEDS[name]):
        pytest.skip(f"{NEEDS[name]} is not installed")
    run_dir = tmp_path / "run"
    p = kvlab_cli("run", *CASES[name], "workload.isl=300", "workload.requests=2", "transfer.baseline=false",
                  f"hydra.run.dir={run_dir}", cwd=tmp_path, timeout=240)
    if name in NEEDS and "cannot load" in p.stderr + p.stdout:
        pytest.skip(p.stderr.strip().splitlines()[-1])
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["verified"] and s["requests"] == 2
    check_figures(run_dir)


@pytest.mark.parametrize("kv", [None, "fp8"])
def test_the_issues_example_decodes_from_trtllms_pool(kv, kvlab_cli, tmp_path):
    """DeepSeek-V3.2 prefilled into vLLM's NHD pools, decoded from TensorRT-LLM's, in bf16 or converted to fp8 in
    the pack: every byte (or value) verified, and the decode check says what the dtype costs."""
    run_dir = tmp_path / "run"
    p = kvlab_cli("run", "model=deepseek_v32", "ctx.layout=vllm_lbnhc", "gen.layout=trtllm", "check=decode",
                  *([f"gen.kv_dtype={kv}"] if kv else []), "workload.requests=2", "workload.isl=200",
                  "transfer.baseline=false", f"hydra.run.dir={run_dir}", cwd=tmp_path, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["verified"] and s["requests"] == 2
    rows = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]
    assert [r["decode_tokens"] for r in rows] == [8, 8] and not any(r["byte_check_failures"] for r in rows)
    assert "check=decode:" in p.stdout  # the line with the cost (rich may wrap it)
    if kv is None:
        assert all(r["decode_tokens_equal"] == 8 and r["decode_max_logit_diff"] == 0 for r in rows)
    else:  # lossy: the cost is reported, not failed
        assert all(r["decode_max_logit_diff"] >= 0 for r in rows)
