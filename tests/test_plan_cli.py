"""``kvlab plan`` for every preset and for mismatched sides.

In-process through ``summarize(build(compose(...)))`` for the many combinations; two real
subprocesses check the printed table and ``plan.json``. Expected bytes come from the model
constants: what each gen rank must hold (its stage's layers, its heads, the window's tiles).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvlab.cli.plan_cmd import summarize
from kvlab.config.schema import CONF_DIR, build, compose

PRESETS = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}


def stage_counts(num_layers: int, side) -> list[int]:
    return list(side.layer_split or [num_layers // side.pp + (s < num_layers % side.pp) for s in range(side.pp)])


def held_heads(n: int, tp: int) -> int:
    """Heads one rank holds: a share when split, one when duplicated or replicated."""
    return max(1, n // tp)


def window_of(m, layer: int) -> int:
    if not m.window:
        return 0
    if not m.local_per_global:
        return m.window
    return m.window if layer % (m.local_per_global + 1) != m.local_per_global else 0


def gen_rank_bytes(setup, rank: int, isl: int) -> int:
    """Bytes one gen rank must receive, from the model constants alone."""
    m, gen, ctx = setup.model, setup.gen, setup.ctx
    tile = math.gcd(ctx.tokens_per_block, gen.tokens_per_block)
    pp = rank // gen.tp % gen.pp
    counts = stage_counts(m.num_layers, gen)
    layers = range(sum(counts[:pp]), sum(counts[:pp + 1]))
    e = ELEM_BYTES[gen.dtype]
    if m.attention.value == "gqa":
        per_token = held_heads(m.kv_heads, gen.tp) * 2 * m.head_dim * e
    else:
        per_token = m.mla_dim * e + (132 if m.indexer else 0)
    total = 0
    for layer in layers:
        kind = m.layer_pattern[layer % len(m.layer_pattern)] if m.layer_pattern else "*"
        if kind == "M":  # a recurrent state once: its groups' conv channels of K - 1 inputs, and their state
            conv = (2 * m.state_groups * m.state_dim + m.state_heads * m.state_head_dim if m.state == "gdn"
                    else m.state_heads * m.state_head_dim + 2 * m.state_groups * m.state_dim)
            total += (conv * (m.conv_kernel - 1) * e + m.state_heads * m.state_head_dim * m.state_dim
                      * ELEM_BYTES[m.state_dtype]) // gen.tp
            continue
        if kind == "-":
            continue
        w = window_of(m, layer)
        first = max(0, isl - w) // tile * tile if w else 0
        total += (isl - first) * per_token
    return total


def combos(heads: int, layers: int, groups: int = 0) -> list[list[str]]:
    """``groups``: a hybrid's state groups, which every TP size must divide."""
    small = max(d for d in range(1, 5) if heads % d == 0) if heads > 1 else 4
    dup = 2 * heads if heads > 1 else 3
    if groups and groups % dup:
        dup = heads
    return [
        ["parallel=same"],
        [f"ctx.tp={small}", "gen.tp=1", "gen.pp=2", "ctx.tokens_per_block=16", "gen.tokens_per_block=64",
         "transfer=naive"],
        ["ctx.tp=1", "ctx.pp=3", f"ctx.layer_split=[1,{layers - 2},1]", f"gen.tp={dup}", "gen.dp=2",
         "gen.layout=layer_major", "transfer=layerwise", "workload.isl=3000"],
        [f"ctx.tp={heads if heads > 1 else 2}", "ctx.dp=2", f"gen.tp={small}", "transfer=zerocopy",
         "workload.isl=1000", "transfer.slot_mib=4"],
    ]


@pytest.mark.parametrize("name", PRESETS)
def test_plan_summary_for_every_preset(name):
    m = build(compose([f"model={name}", "parallel=same"])).model
    for combo in combos(m.tp_heads, m.num_layers, m.state_groups if m.has_state else 0):
        overrides = [f"model={name}", *combo]
        setup = build(compose(overrides))
        s = summarize(setup)
        isl = setup.workload.isl
        assert (s["model"], s["isl"], s["requests"]) == (name, isl, setup.gen.dp)
        assert s["strategy"] == setup.transfer.strategy.name
        per_dst: dict[int, int] = {}
        for p in s["pairs"]:
            assert 0 <= p["src"] < setup.ctx.size and 0 <= p["dst"] < setup.gen.size
            assert p["src_world"] == p["src"] and p["dst_world"] == setup.ctx.size + p["dst"]
            assert p["bytes"] > 0 and p["segments"] >= 1 and p["chunks"] >= p["segments"]
            assert p["in_place_chunks"] <= p["chunks"]
            if s["strategy"] != "naive":
                assert p["max_chunk_bytes"] <= s["slot_bytes"]
            per_dst[p["dst"]] = per_dst.get(p["dst"], 0) + p["bytes"]
        # one request per gen DP group: every gen rank receives exactly what it must hold
        assert per_dst == {r: gen_rank_bytes(setup, r, isl) for r in range(setup.gen.size)}, overrides
        assert s["total_bytes"] == sum(per_dst.values())
        assert s["total_chunks"] == sum(p["chunks"] for p in s["pairs"])
        if setup.ctx.size == setup.gen.size == 1 and not setup.model.window:
            assert s["total_bytes"] == setup.model.request_bytes(isl)


def test_mismatched_sides_spread_over_ctx_ranks():
    # MLA ctx TP4 -> gen TP2 PP2: replicated latents come from more than one ctx rank, never twice to one gen rank
    s = summarize(build(compose(["model=deepseek_v3", "ctx.tp=4", "gen.tp=2", "gen.pp=2", "workload.isl=512"])))
    per_dst = {}
    for p in s["pairs"]:
        per_dst.setdefault(p["dst"], []).append(p["src"])
    assert sorted(per_dst) == [0, 1, 2, 3]
    assert all(len(srcs) == 1 for srcs in per_dst.values())
    assert len({p["src"] for p in s["pairs"]}) == 2
    # gen stages hold 31 and 30 layers of 576 bf16 elements per token
    assert {p["dst"]: p["bytes"] for p in s["pairs"]} == {0: 31 * 512 * 1152, 1: 31 * 512 * 1152,
                                                        2: 30 * 512 * 1152, 3: 30 * 512 * 1152}


def run_plan(kvlab_cli, tmp_path: Path, overrides: list[str]) -> tuple[str, dict]:
    out = tmp_path / "run"
    p = kvlab_cli("plan", *overrides, f"hydra.run.dir={out}", cwd=tmp_path, timeout=180)
    assert p.returncode == 0, p.stderr
    return p.stdout, json.loads((out / "plan.json").read_text())


def test_cli_tp1_to_tp1_moves_the_whole_request(tmp_path, kvlab_cli):
    stdout, data = run_plan(kvlab_cli, tmp_path, ["model=llama3_8b", "parallel=same", "workload.isl=1000"])
    assert "llama3_8b" in stdout and "ctx0" in stdout and "gen0" in stdout and "total" in stdout
    assert [set(p) >= {"src", "dst", "bytes"} for p in data["pairs"]] == [True]
    assert (data["pairs"][0]["src"], data["pairs"][0]["dst"]) == (0, 0)
    # 32 layers x 8 kv heads x 128 x (K, V) x bf16 = 128 KiB per token
    assert data["total_bytes"] == data["pairs"][0]["bytes"] == 1000 * 131072
    assert "MiB" in stdout and f"{1000 * 131072 / 2**20:,.2f}" in stdout


def test_cli_mismatched_sides_matches_in_process(tmp_path, kvlab_cli):
    overrides = ["model=tiny_swa", "ctx.tp=2", "ctx.pp=2", "gen.tp=4", "gen.pp=3", "gen.dp=2", "transfer=zerocopy",
                 "workload.isl=300", "gen.tokens_per_block=16"]
    stdout, data = run_plan(kvlab_cli, tmp_path, overrides)
    expect = summarize(build(compose(overrides)))
    assert [(p["src"], p["dst"], p["bytes"]) for p in data["pairs"]] == \
           [(p["src"], p["dst"], p["bytes"]) for p in expect["pairs"]]
    assert data["total_bytes"] == expect["total_bytes"]
    for p in data["pairs"]:
        assert f"ctx{p['src']}" in stdout and f"gen{p['dst']}" in stdout
