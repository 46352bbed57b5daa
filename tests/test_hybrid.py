"""Hybrid models: a recurrent state (Gated DeltaNet, Mamba-2) per request and state layer beside attention.

The state kind (kvlab.model.spec.state_shape) holds, per TP group, the conv state's three parts and the recurrent
state; TP splits whole groups as vLLM and SGLang split them, so a rank's share must be the engines' per-rank state
(``conv_dim / tp`` channels of ``K - 1`` inputs, ``heads / tp`` recurrent heads). The plan moves it once per request
(token 0 of a pool in blocks of one), prefix hits or not; the byte check covers it over TP pairs, layouts and
strategies drawn by Hypothesis; and ``check=decode`` rebuilds transformers' own linear-attention caches from the
moved states: a tiny Qwen3-Next and a tiny Nemotron-H decode as the undivided reference, and a state that is
dropped or corrupted fails it, named.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import E2E
from hypothesis import given, settings
from hypothesis import strategies as st
from test_decode_check import assert_decodes_as_reference, run_decode
from test_engine_layouts import model_preset, move

from kvlab.config.schema import build, compose
from kvlab.core.errors import ConfigError
from kvlab.model.parallel import SideSpec
from kvlab.model.plan import Request, plan
from kvlab.model.prefix import BLOCK_TOKENS, Prefix
from kvlab.model.schedule import preset_names
from kvlab.model.spec import ModelSpec
from kvlab.model.state import CacheState
from kvlab.rank import decode_check, hf_models

SCALE = settings.default.max_examples / 100  # a tenth under `pytest -m "not slow"` (tests/conftest.py)
QWEN, NEMOTRON = model_preset("qwen3_next_80b"), model_preset("nemotron_h")


def engine_rank_state_bytes(conv_dim: int, kernel: int, heads: int, a: int, b: int, tp: int) -> int:
    """What one TP rank of vLLM keeps per request and layer (mamba_utils' state shapes): the conv state
    ``(conv_dim / tp, K - 1)`` in bf16 and the recurrent state ``(heads / tp, a, b)`` in fp32."""
    return conv_dim // tp * (kernel - 1) * 2 + heads // tp * a * b * 4


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_a_rank_holds_the_engines_per_rank_state(tp):
    # Qwen3-Next: conv over q, k (16 key heads x 128) and v (32 value heads x 128); state [32, 128, 128]
    # Nemotron-H-8B: conv over x (128 heads x 64), B and C (8 groups x 128); state [128, 64, 128]
    for model, want in ((QWEN, engine_rank_state_bytes(2 * 16 * 128 + 32 * 128, 4, 32, 128, 128, tp)),
                        (NEMOTRON, engine_rank_state_bytes(128 * 64 + 2 * 8 * 128, 4, 128, 64, 128, tp))):
        side = SideSpec("gen", tp=tp)
        for r in range(tp):
            (state,) = [p for p in CacheState(model, side, r).pools() if p.spec.per_request]
            assert state.block_layer_bytes == want and state.tokens_per_block == 1
            assert len(state.heads) == model.state_groups // tp


def test_the_presets_layer_patterns_and_what_a_request_holds():
    assert [(p.name, len(p.layers)) for p in QWEN.pools()] == [("kv", 12), ("state", 36)]
    assert QWEN.pools()[0].layers == tuple(range(3, 48, 4))  # full_attention_interval 4
    assert [(p.name, len(p.layers)) for p in NEMOTRON.pools()] == [("kv", 4), ("state", 24)]
    assert NEMOTRON.pools()[0].layers == (7, 18, 29, 40)  # the '*' of the pattern; 24 '-' layers cache nothing
    state = sum(p.token_bytes() * len(p.layers) for p in QWEN.pools() if p.per_request)
    assert QWEN.request_bytes(2000) - QWEN.request_bytes(1000) == 1000 * QWEN.bytes_per_token()
    assert QWEN.request_bytes(1) == QWEN.bytes_per_token() + state  # the state once, whatever the prompt


@pytest.mark.parametrize("overrides, message", [
    (["model=qwen3_next_80b", "model.layer_pattern=MMX*"], "model.layer_pattern=MMX*: one character per layer"),
    (["model=qwen3_next_80b", "model.state="], "model.state=: state layers ('M') need one of gdn, mamba2"),
    (["model=qwen3_next_80b", "model.state_heads=20"], "model.state_heads=20: must be a multiple of"),
    (["model=nemotron_h", "ctx.tp=16"], "ctx.tp=16: nemotron_h's recurrent state splits by its 8 groups"),
    (["model=qwen3_next_80b", "check=decode", "model.decode.family=llama"], "model.decode.family=llama: model "),
])
def test_bad_hybrid_input_is_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        build(compose(overrides))
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_the_state_moves_once_per_request_after_the_last_token_prefix_hit_or_not():
    model = replace(QWEN, num_layers=8)
    ctx, gen = SideSpec("ctx", tp=2).resolved(model), SideSpec("gen", tp=1, prefix_cache_tokens=4096).resolved(model)
    hit = Prefix(keys=(1, 2, 3), hit=1, sources=(0,), full=2)  # one trace block of BLOCK_TOKENS held
    for req in (Request(0, 600), Request(1, 600, prefix=hit)):
        segs = plan(model, ctx, gen, req)
        state = [s for s in segs if s.rect.pool == "state"]
        assert {(s.src, s.rect.t0, s.rect.t1, s.rect.h0, s.rect.h1) for s in state} == {(0, 0, 1, 0, 8),
                                                                                      (1, 0, 1, 8, 16)}
        kv = [s for s in segs if s.rect.pool == "kv"]
        assert {s.rect.t0 for s in kv} == ({0} if req.prefix is None else {BLOCK_TOKENS})  # attention's blocks hit


@st.composite
def hybrids(draw):
    family = draw(st.sampled_from(["gdn", "mamba2"]))
    groups = draw(st.sampled_from([2, 4]))
    return ModelSpec("h", draw(st.integers(3, 6)), "gqa", kv_heads=2, head_dim=8,
                     layer_pattern=draw(st.sampled_from(["M*", "MM*", "M-*M", "*M"])), state=family,
                     state_heads=groups * draw(st.sampled_from([1, 2])), state_groups=groups, state_head_dim=4,
                     state_dim=draw(st.sampled_from([4, 8])), conv_kernel=draw(st.sampled_from([2, 4])),
                     window=draw(st.sampled_from([0, 16])), local_per_global=0)


@settings(max_examples=int(60 * SCALE) or 1, deadline=None)
@given(model=hybrids(), tps=st.sampled_from([(1, 2), (2, 1), (2, 2), (1, 1)]),
       layouts=st.tuples(*[st.sampled_from(["block_major", "layer_major"])] * 2),
       strategy=st.sampled_from(preset_names()), pull=st.booleans(), isl=st.integers(1, 70))
def test_hybrid_caches_move_verified(model, tps, layouts, strategy, pull, isl):
    """Any drawn hybrid (either state family, sliding or full attention beside it), TP split or merged on
    either side, kvlab's layouts, every strategy, pushed or pulled: every byte and canary checked."""
    if model.layer_pattern.count("*") == 0 or not model.has_attention:
        return
    ctx = SideSpec("ctx", tp=tps[0], layout=layouts[0], tokens_per_block=16)
    gen = SideSpec("gen", tp=tps[1], layout=layouts[1], tokens_per_block=8)
    errors, chunks, _ = move(model, ctx, gen, isl, strategy, pull=pull, slot=1 << 16)
    assert errors == [] and any(c.rect.pool == "state" for c in chunks)


def test_an_engine_layout_without_a_place_for_the_state_is_one_line():
    with pytest.raises(ConfigError, match=r"^gen.layout=trtllm: TensorRT-LLM .* no place for qwen3_next_80b's state"):
        build(compose(["model=qwen3_next_80b", "gen.layout=trtllm"]))


# ---------------------------------------------------------------- check=decode

@pytest.mark.parametrize("model", ["qwen3_next_80b", "nemotron_h"])
def test_the_reference_is_the_uninterrupted_decode_and_the_state_planes_suffice(model):
    """A fresh transformers cache rebuilt from the planes (the conv state's K - 1 inputs, the recurrent state, K
    and V) decodes the reference's tokens and logits; a recurrent state or a conv input changed in one group
    of one layer makes it diverge, and the difference is named."""
    s = build(compose(["check=decode", f"model={model}", "workload.isl=40", "check.tokens=4"]))
    ids = hf_models.prompt(s.check, s.model, 0, 40)
    ref = decode_check.reference(s.model, s.check, ids, use_disk=False)
    net, cfg = hf_models.build(s.model, s.check.seed)
    rebuilt = hf_models.decode(net, hf_models.model_cache(s.model, cfg, ref.planes, 40), ref.first, 4)
    assert decode_check.compare(*rebuilt, ref, 0.0).first_divergent is None
    assert decode_check.compare(*rebuilt, ref, 0.0).max_logit_diff == 0.0
    for comp in (0, 3):  # a conv input of group 1, the recurrent state of group 1
        planes = {k: [t.clone() for t in v] for k, v in ref.planes.items()}
        planes["state"][comp][0, 1] = 0
        got = decode_check.compare(*hf_models.decode(net, hf_models.model_cache(s.model, cfg, planes, 40),
                                                     ref.first, 4), ref, 0.0)
        assert got.max_logit_diff > 0
        assert hf_models.cache_differences(s.model, planes, ref.planes, 40) == [
            {"layer": s.model.pools()[-1].layers[0], "pool": "state", "component": comp, "token": 0, "tokens": 1}]


def test_hybrid_decode_end_to_end(kvlab_cli, tmp_path):
    """The issue's done run: Qwen3-Next's state split over two ctx ranks, merged on one gen rank."""
    res, summary, rows, out = run_decode(kvlab_cli, tmp_path, "model=qwen3_next_80b", "ctx.tp=2", "gen.tp=1",
                                         "workload.isl=64", "workload.requests=2", "check.tokens=4")
    assert_decodes_as_reference(res, summary, rows, out, 2, 4)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@settings(max_examples=2, **E2E)
@given(model=st.sampled_from(["qwen3_next_80b", "nemotron_h"]), tps=st.sampled_from([("2", "1"), ("1", "2")]),
       transfer=st.sampled_from(["chunked", "layerwise", "zerocopy"]), transport=st.sampled_from(["p2p", "ipc"]))
def test_hybrid_families_decode_over_tp_pairs(kvlab_cli, tmp_path_factory, model, tps, transfer, transport):
    res, summary, rows, out = run_decode(kvlab_cli, tmp_path_factory.mktemp("hybrid"), f"model={model}",
                                         f"ctx.tp={tps[0]}", f"gen.tp={tps[1]}", f"transfer={transfer}",
                                         f"transport={transport}", "workload.isl=80", "workload.requests=2",
                                         "check.tokens=4")
    assert_decodes_as_reference(res, summary, rows, out, 2, 4)


@pytest.mark.slow
@pytest.mark.parametrize("fault, byte_failures", [("fault.unwritten_layer=2", 1),  # a state layer never written
                                                  ("fault.flip_rank=2", 1)])  # a byte of the state in flight
def test_a_dropped_or_corrupted_state_fails_the_decode_check(kvlab_cli, tmp_path, fault, byte_failures):
    extra = [fault] + (["fault.flip_at=[0]"] if "flip" in fault else [])
    res, summary, rows, out = run_decode(kvlab_cli, tmp_path, "model=nemotron_h", "ctx.tp=2", "gen.tp=1",
                                         "workload.isl=64", "workload.requests=1", "check.tokens=4",
                                         "transfer=layerwise", *extra)
    assert res.returncode == 1
    (row,) = rows
    assert row["byte_check_failures"] == byte_failures and row["decode_first_divergent"] is not None
    assert "(state " in row["error"] and "byte check failed on gen0" in row["error"], row["error"]
    assert json.loads((Path(out) / "summary.json").read_text())["verified"] is False


def test_kvlab_plan_shows_the_state_and_its_share():
    from kvlab.cli.plan_cmd import summarize

    s = summarize(build(compose(["model=qwen3_next_80b", "ctx.tp=2", "workload.isl=32768", "workload.requests=1"])))
    assert s["ctx"]["wire_tile"]["state"] == 1 and s["gen"]["wire_tile"]["kv"] == 32
    # 36 GDN layers x (conv 8192 x 3 bf16 + recurrent 32 x 128 x 128 fp32), against 12 layers of 2 x 2 x 256 bf16
    assert s["pool_bytes"] == {"kv": 12 * 32768 * 2048, "state": 36 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)}


@pytest.mark.parametrize("capacity", [0, 16384])
def test_the_budget_counts_one_state_per_open_request(capacity):
    """A state pool holds a block (one state) per open request plus the canaries, with or without a fixed token
    capacity (which sizes the attention pools only)."""
    from kvlab.sizing.budget import estimate

    setup = build(compose(["model=qwen3_next_80b", "ctx.tp=2", "workload.isl=4096", "workload.requests=4",
                           f"cache.capacity_tokens={capacity}"]))
    b = estimate(setup)
    open_requests = min(4, setup.workload.concurrency + setup.transfer.slots)
    state_layer = 8192 * 3 * 2 + 32 * 128 * 128 * 4  # one rank of gen (tp 1): every group
    kv_tokens = capacity or open_requests * 4096
    kv = 12 * 2048 * (kv_tokens + setup.cache.spare_blocks * setup.gen.tokens_per_block)
    gen0 = next(r for r in b.ranks if r.name == "gen0")
    assert gen0.cache == kv + 36 * state_layer * (open_requests + setup.cache.spare_blocks)
