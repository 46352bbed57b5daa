"""check=decode: a real model's prefill writes the moved cache, a real model's decode reads it.

The oracle is transformers' own decoding in one process (kvlab.rank.decode_check.reference). The unmarked
tests check the config group, the planes' wire order against kvlab's own pack and unpack, that the
reference is the uninterrupted decode for all six families, and one run end to end; the slow ones run
the families over strategies, transports and layout pairs drawn by Hypothesis, and show that what is
sent must suffice: a window trimmed by one token verifies byte for byte and still fails the decode
check, naming the layer, and a flipped byte fails both checks.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import E2E, check_figures
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.config.schema import build, compose
from kvlab.core.decode_spec import CheckSpec
from kvlab.core.errors import ConfigError
from kvlab.memory.cache import PagedCache
from kvlab.memory.ops import get_ops
from kvlab.model.layout import Rect
from kvlab.model.plan import Request
from kvlab.model.state import CacheState
from kvlab.rank import decode_check, hf_models

pytest.importorskip("transformers")  # the decode extra

# one preset per transformers family
FAMILIES = {"llama": "llama3_8b", "qwen3_moe": "qwen3_235b", "deepseek_v3": "deepseek_v3",
            "deepseek_v32": "deepseek_v32", "gpt_oss": "gpt_oss_120b", "gemma3": "gemma3_27b"}


def setup_of(*overrides: str):
    return build(compose(["check=decode", "ctx.tp=1", "gen.tp=1", *overrides]))


# ---------------------------------------------------------------- the config group

def test_bytes_is_the_default_and_leaves_the_model_alone():
    s = build(compose([]))
    assert s.check.kind == "bytes" and s.model.name == "tiny_gqa"


def test_decode_moves_the_tiny_model_of_the_preset():
    s = setup_of("model=gemma3_27b")
    assert s.check.decode and s.model.name == "gemma3_27b-tiny"
    assert (s.model.num_layers, s.model.kv_heads, s.model.window, s.model.local_per_global) == (6, 2, 32, 5)
    assert s.workload.isl > s.model.window  # prompts reach past the scaled-down window
    # a recorded config builds the same Setup again
    assert build(compose(["check=decode", "ctx.tp=1", "gen.tp=1", "model=gemma3_27b"])).model == s.model


@pytest.mark.parametrize("overrides, field", [
    (["check.tokens=0"], "check.tokens"),
    (["check.tolerance=-1"], "check.tolerance"),
    (["check.seed=-3"], "check.seed"),
    (["model.decode.family=mamba"], "model.decode.family"),
    (["model.decode.family=deepseek_v3"], "model.decode.family"),  # an MLA family for a GQA cache
    (["model.decode.q_heads=5"], "model.decode"),
    (["ctx.dtype=fp16", "gen.dtype=fp16"], "ctx.dtype"),
    (["fault.window_trim=1"], "fault.window_trim"),  # tiny_gqa has no sliding window
    (["fault.window_trim=-1", "model=tiny_swa"], "fault.window_trim"),
])
def test_bad_values_stop_with_one_line_naming_the_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        setup_of(*overrides)
    line = str(e.value)
    assert line.startswith(field) and "\n" not in line, line


def test_a_preset_without_a_decode_model_says_what_would_work():
    with pytest.raises(ConfigError, match="names no decode model.*check=bytes"):
        setup_of("model.decode.family=")


# ---------------------------------------------------------------- the planes and kvlab's layout

@settings(max_examples=40, deadline=None)
@given(st.data())
def test_wire_order_round_trips(data):
    rows = data.draw(st.lists(st.sampled_from([4, 8, 32]), min_size=1, max_size=2))
    L, H, T = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3)), data.draw(st.integers(1, 40))
    planes = [torch.randint(0, 256, (L, H, T, r), dtype=torch.uint8) for r in rows]
    l0 = data.draw(st.integers(0, L - 1))
    h0 = data.draw(st.integers(0, H - 1))
    t0 = data.draw(st.integers(0, T - 1))
    rect = Rect("p", l0, data.draw(st.integers(l0 + 1, L)), h0, data.draw(st.integers(h0 + 1, H)), t0,
                data.draw(st.integers(t0 + 1, T)), data.draw(st.sampled_from([1, 2, 4, 8])))
    back = hf_models.from_wire(hf_models.wire_bytes(planes, rect), rect, tuple(rows))
    for got, plane in zip(back, planes):
        assert torch.equal(got, plane[rect.l0:rect.l1, rect.h0:rect.h1, rect.t0:rect.t1])


@pytest.mark.parametrize("model, side", [("gpt_oss_120b", "gen.tp=2"), ("deepseek_v32", "gen.pp=2")])
def test_planes_land_where_kvlab_puts_them(model, side):
    """The model's planes written through kvlab's own unpack (PagedCache.fill) read back by its pack."""
    s = setup_of(f"model={model}", side, "gen.tokens_per_block=8", "gen.layout=layer_major", "workload.isl=50")
    state = CacheState(s.model, s.gen, 1)
    ops = get_ops("torch", "cpu")
    cache = PagedCache(state, {p.name: 8 for p in state.pools()}, 2, 0.5, 0, torch.device("cpu"))
    planes = {p.name: [torch.randint(0, 256, (len(p.layers), p.heads, 50, r), dtype=torch.uint8)
                       for r in p.comp_row_bytes()] for p in s.model.pools()}
    check = decode_check.DecodeCheck(s, "gen", 1, [Request(0, 50)], store=None)
    check.planes[0] = check._own(cache, planes)  # as prepare keeps them: the layers and heads this rank holds
    check.cache, cache.contents = cache, check.expected
    cache.allocate(Request(0, 50))
    cache.fill(Request(0, 50), ops)
    check.keep(Request(0, 50), ops, [])
    for name, pieces in check._planes(0).items():
        ((l0, l1, h0, h1, t0, t1), local, comps), = pieces
        assert t1 == 50 and (t0 == 0) == (not hf_models.pool_spec(s.model, name).window) and local is None
        for got, plane in zip(comps, planes[name]):
            assert torch.equal(got, plane[l0:l1, h0:h1, t0:t1])


def test_indexer_keys_round_trip_through_fp8_with_power_of_two_scales():
    keys = torch.randn(5, 128, dtype=torch.bfloat16) * torch.tensor([[1e-3], [1.0], [30.0], [0.0], [500.0]])
    values, scales = hf_models.quantize(keys)
    assert values.dtype == torch.float8_e4m3fn and scales.shape == (5, 1)
    assert torch.equal(torch.exp2(torch.log2(scales).round()), scales)
    back = hf_models.dequantize(values, scales).float()
    assert ((back - keys.float()).abs() <= keys.float().abs() * 0.07 + scales * 2 ** -6).all()


# ---------------------------------------------------------------- the oracle

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_reference_is_the_uninterrupted_decode_and_the_planes_suffice(family):
    """The reference equals transformers' own prefill-then-decode in one cache (the indexer keys read
    back through fp8), and a fresh cache rebuilt from its planes decodes the same tokens and logits."""
    from transformers import DynamicCache

    s = setup_of(f"model={FAMILIES[family]}", "workload.isl=48", "check.tokens=4")
    isl = s.workload.isl
    ids = hf_models.prompt(s.check, s.model, 0, isl)
    ref = decode_check.reference(s.model, s.check, ids, use_disk=False)
    net, cfg = hf_models.build(s.model, s.check.seed)
    cache = DynamicCache(config=cfg)
    with torch.no_grad(), hf_models.one_thread():
        first = int(net(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1].float().argmax())
    for layer in cache.layers:
        if getattr(layer, "indexer_keys", None) is not None:
            layer.indexer_keys = hf_models.round_trip(layer.indexer_keys)
    tokens, logits = hf_models.decode(net, cache, first, 4)
    assert (first, tokens) == (ref.first, ref.tokens) and torch.equal(logits, ref.logits)
    rebuilt = hf_models.decode(net, hf_models.model_cache(s.model, cfg, ref.planes, isl), first, 4)
    assert decode_check.compare(*rebuilt, ref, 0.0).first_divergent is None


def test_a_wrong_window_token_diverges_and_is_named():
    s = setup_of("model=tiny_swa", "workload.isl=100", "check.tokens=4")
    ids = hf_models.prompt(s.check, s.model, 0, 100)
    ref = decode_check.reference(s.model, s.check, ids, use_disk=False)
    net, cfg = hf_models.build(s.model, s.check.seed)
    planes = {k: [t.clone() for t in v] for k, v in ref.planes.items()}
    first_read = 100 - s.model.window + 1
    planes["kv_w64"][0][0, :, first_read] = 0  # layer 0's keys of the oldest token the next one attends to
    got = decode_check.compare(*hf_models.decode(net, hf_models.model_cache(s.model, cfg, planes, 100), ref.first, 4),
                               ref, 0.0)
    assert got.first_divergent == 0
    assert hf_models.cache_differences(s.model, planes, ref.planes, 100) == [
        {"layer": 0, "pool": "kv_w64", "component": 0, "token": first_read, "tokens": 1}]
    # a token older than the window is not read: changing it changes nothing
    planes = {k: [t.clone() for t in v] for k, v in ref.planes.items()}
    planes["kv_w64"][0][0, :, first_read - 1] = 0
    assert hf_models.cache_differences(s.model, planes, ref.planes, 100) == []


def test_reference_is_kept_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv(decode_check.CACHE_ENV, str(tmp_path))
    s = setup_of("workload.isl=16", "check.tokens=2")
    ids = hf_models.prompt(s.check, s.model, 3, 16)
    a = decode_check.reference(s.model, s.check, ids)
    assert len(list(tmp_path.glob("*.pt"))) == 1
    b = decode_check.reference(s.model, s.check, ids)
    assert a.tokens == b.tokens and torch.equal(a.logits, b.logits)
    other = CheckSpec(kind="decode", tokens=2, seed=1)
    decode_check.reference(s.model, other, hf_models.prompt(other, s.model, 3, 16))
    assert len(list(tmp_path.glob("*.pt"))) == 2  # another seed, another key


# ---------------------------------------------------------------- end to end

def run_decode(kvlab_cli, tmp_path: Path, *overrides: str, timeout: float = 600):
    out = tmp_path / "run"
    res = kvlab_cli("run", "check=decode", "logger=quiet", "transfer.baseline=false", f"hydra.run.dir={out}",
                    *overrides, cwd=tmp_path, timeout=timeout)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else None
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()] \
        if (out / "results.jsonl").exists() else []
    return res, summary, rows, out


def assert_decodes_as_reference(res, summary, rows, out, requests: int, tokens: int):
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert summary["verified"]
    assert summary["decode_tokens"] == summary["decode_tokens_equal"] == requests * tokens
    assert summary["decode_max_logit_diff"] == 0.0 and summary["decode_first_divergent"] is None
    assert summary["byte_check_failures"] == 0
    assert [r["decode_tokens_equal"] for r in rows] == [tokens] * requests
    assert f"check=decode: {requests}/{requests} requests decode as the reference" in res.stdout
    check_figures(out)


def test_decode_run_end_to_end(kvlab_cli, tmp_path):
    res, summary, rows, out = run_decode(kvlab_cli, tmp_path, "model=tiny_gqa", "ctx.tp=2", "gen.tp=1",
                                         "workload.isl=64", "workload.requests=2", "check.tokens=4")
    assert_decodes_as_reference(res, summary, rows, out, 2, 4)


LAYOUTS = {
    "tp1->tp4 duplicated heads": ["ctx.tp=1", "gen.tp=4"],  # the presets' decode models have 2 kv heads
    "tp2->tp1": ["ctx.tp=2", "gen.tp=1"],
    "pp2->pp3 uneven": ["ctx.tp=1", "ctx.pp=2", "gen.tp=1", "gen.pp=3"],  # + a split of the model's layers
    "gen attention-DP": ["ctx.tp=1", "gen.tp=1", "gen.dp=2"],
    "tpb and layout": ["ctx.tp=1", "gen.tp=1", "ctx.tokens_per_block=16", "gen.tokens_per_block=8",
                       "gen.layout=layer_major"],
}
GQA_ONLY = {"tp1->tp4 duplicated heads"}  # MLA replicates its latent over TP: nothing to duplicate


@pytest.mark.slow
@pytest.mark.timeout(3600)  # every example is a run of its own: rank processes, the model's prefill and decode
@settings(max_examples=2, **E2E)
@given(family=st.sampled_from(sorted(FAMILIES)), transfer=st.sampled_from(["chunked", "layerwise", "zerocopy"]),
       layout=st.sampled_from(sorted(LAYOUTS)), transport=st.sampled_from(["p2p", "p2p", "ipc"]))
def test_families_over_strategies_transports_and_layouts(kvlab_cli, tmp_path_factory, family, transfer, layout,
                                                         transport):
    model = FAMILIES[family]
    if layout in GQA_ONLY and family.startswith("deepseek"):
        layout = "tp2->tp1"
    parallel = list(LAYOUTS[layout])
    if layout == "pp2->pp3 uneven":  # the decode models' layer counts differ by family
        layers = setup_of(f"model={model}").model.num_layers
        parallel.append(f"gen.layer_split=[{layers - 2},1,1]")
    tmp = tmp_path_factory.mktemp("decode")
    res, summary, rows, out = run_decode(kvlab_cli, tmp, f"model={model}", f"transfer={transfer}",
                                         f"transport={transport}", "workload.isl=96", "workload.requests=2",
                                         "check.tokens=4", "transfer.slot_mib=0.05", *parallel)
    assert_decodes_as_reference(res, summary, rows, out, 2, 4)


@pytest.mark.slow
def test_the_done_run(kvlab_cli, tmp_path):
    res, summary, rows, out = run_decode(kvlab_cli, tmp_path, "model=deepseek_v32", "ctx.tp=2", "gen.tp=1",
                                         "gen.pp=2", "transfer=layerwise", "workload.requests=2")
    assert_decodes_as_reference(res, summary, rows, out, 2, 8)


@pytest.mark.slow
def test_a_window_trimmed_by_one_token_verifies_and_fails_the_decode_check(kvlab_cli, tmp_path):
    res, summary, rows, out = run_decode(kvlab_cli, tmp_path, "model=tiny_swa", "ctx.tp=1", "gen.tp=2",
                                         "transfer=zerocopy", "workload.isl=100", "workload.requests=2",
                                         "check.tokens=4", "fault.window_trim=1")
    assert res.returncode == 1
    assert summary["byte_check_failures"] == 0 and summary["decode_first_divergent"] == 0
    for r in rows:
        assert not r["verified"] and r["byte_check_failures"] == 0
        assert "diverges from the reference at step 0" in r["error"]
        assert "layer 0 (kv_w64 K, V: 1 token(s) from token 37)" in r["error"], r["error"]
        assert "byte check passed on every gen rank" in r["error"]
    assert "every byte sent verified, and decoding still diverged" in res.stdout
    # the first diagnosis on the terminal, not only in results.jsonl
    first = next(r["error"] for r in rows if r["error"])
    assert f"check=decode, first diagnosis: {first}" in " ".join(res.stdout.split()), res.stdout


@pytest.mark.slow
def test_a_flipped_byte_fails_both_checks(kvlab_cli, tmp_path):
    # world rank 1 is the gen rank; byte 1 of its stream is the high byte of layer 0's first key element
    res, summary, rows, out = run_decode(kvlab_cli, tmp_path, "model=tiny_gqa", "ctx.tp=1", "gen.tp=1",
                                         "workload.isl=64", "workload.requests=1", "check.tokens=4",
                                         "fault.flip_rank=1", "fault.flip_at=[1]")
    assert res.returncode == 1
    (row,) = rows
    assert row["byte_check_failures"] == 1 and row["decode_first_divergent"] == 0
    assert "wrong bytes" in row["error"] and "layer 0 (kv K: 1 token(s) from token 0)" in row["error"]
    assert "byte check failed on gen0" in row["error"]


@pytest.mark.slow
@pytest.mark.parametrize("model, transfer", [("gpt_oss_120b", "chunked"), ("deepseek_v32", "zerocopy")])
def test_decode_over_nixl(kvlab_cli, tmp_path, model, transfer):
    pytest.importorskip("nixl_cu13", reason='the nixl extra is not installed (pip install -e ".[nixl]")')
    res, summary, rows, out = run_decode(kvlab_cli, tmp_path, f"model={model}", "transport=nixl",
                                         f"transfer={transfer}", "ctx.tp=2", "gen.tp=1", "workload.isl=96",
                                         "workload.requests=2", "check.tokens=4")
    assert_decodes_as_reference(res, summary, rows, out, 2, 4)


def test_a_share_larger_than_a_store_value_crosses_the_store_in_pieces():
    """A gen rank's share of a long request is larger than torch's TCPStore takes in one value (8 MiB): it goes in
    pieces, arrives whole, and leaves nothing in the store."""
    import datetime
    import socket

    import torch.distributed as dist

    from kvlab.rank import store_pieces

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=30))
    data = torch.randint(0, 256, (20 << 20,), dtype=torch.uint8).numpy().tobytes()
    store_pieces.put(client, "share/0/1", data)
    assert store_pieces.get(server, "share/0/1", remove=True) == data
    assert server.num_keys() <= 1  # the store's own bookkeeping key at most
    store_pieces.put(client, "share/1/1", b"")
    assert store_pieces.get(server, "share/1/1") == b"" and store_pieces.get(server, "share/1/1") == b""
