"""Presets compose and build with the published constants; bad input ends in one line naming the field."""
from __future__ import annotations

import pytest

from kvlab.cli.commands import check_overrides
from kvlab.config.schema import CONF_DIR, build, compose
from kvlab.model.spec import Attention

PRESETS = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
BF16 = 2


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int) -> int:
    return layers * kv_heads * head_dim * 2 * BF16  # K and V


def test_every_model_preset_composes_and_builds():
    assert len(PRESETS) >= 11
    for name in PRESETS:
        setup = build(compose([f"model={name}"]))
        assert setup.model.name == name
        assert setup.model.request_bytes(4096) > 0


@pytest.mark.parametrize("name,layers,kv_heads,head_dim,per_token", [
    ("llama3_8b", 32, 8, 128, 131072),
    ("llama3_70b", 80, 8, 128, 327680),
    ("qwen3_235b", 94, 4, 128, 192512),
])
def test_dense_gqa_presets(name, layers, kv_heads, head_dim, per_token):
    m = build(compose([f"model={name}", "parallel=same"])).model
    shape = (m.attention, m.num_layers, m.kv_heads, m.head_dim, m.window)
    assert shape == (Attention.gqa, layers, kv_heads, head_dim, 0)
    assert m.bytes_per_token() == kv_bytes_per_token(layers, kv_heads, head_dim) == per_token
    assert m.request_bytes(1000) == 1000 * per_token


def test_deepseek_v3_latent():
    m = build(compose(["model=deepseek_v3"])).model
    assert (m.attention, m.num_layers, m.mla_dim, m.indexer) == (Attention.mla, 61, 576, False)
    (pool,) = m.pools()
    assert pool.heads == 1 and pool.replicated
    assert m.bytes_per_token() == 61 * 576 * BF16


def test_deepseek_v32_indexer():
    m = build(compose(["model=deepseek_v32"])).model
    assert (m.attention, m.num_layers, m.mla_dim, m.indexer) == (Attention.mla, 61, 576, True)
    pools = {p.kind: p for p in m.pools()}
    assert set(pools) == {"mla", "indexer"}
    assert pools["indexer"].layers == pools["mla"].layers == tuple(range(61))
    # 128 fp8 values + one fp32 scale per 128 values, per token per layer, whatever the cache dtype
    assert pools["indexer"].token_bytes() == 132
    assert m.pools("fp8")[1].token_bytes() == 132
    assert pools["indexer"].comp_row_bytes() == (128, 4)
    assert m.bytes_per_token() == 61 * (576 * BF16 + 132)


def test_gpt_oss_alternates_sliding_128_and_full():
    m = build(compose(["model=gpt_oss_120b"])).model
    assert (m.num_layers, m.kv_heads, m.head_dim) == (36, 8, 64)
    by_window = {p.window: p.layers for p in m.pools()}
    assert set(by_window) == {0, 128}
    assert len(by_window[0]) == len(by_window[128]) == 18
    assert set(by_window[0]) | set(by_window[128]) == set(range(36))
    # alternation: no two neighbouring layers share a window
    assert all((layer in by_window[0]) != (layer + 1 in by_window[0]) for layer in range(35))
    per_layer_token = 8 * 64 * 2 * BF16
    assert m.request_bytes(10_000) == 18 * per_layer_token * (10_000 + 128)


def test_gemma3_five_local_per_global():
    m = build(compose(["model=gemma3_27b"])).model
    by_window = {p.window: p.layers for p in m.pools()}
    assert set(by_window) == {0, 1024}
    assert len(by_window[0]) == 10 and len(by_window[1024]) == 52
    # the pattern is five local layers then one global
    assert by_window[0] == tuple(range(5, 62, 6))


def test_tiny_presets_match_their_comments():
    assert build(compose(["model=tiny_gqa"])).model.kv_heads == 6
    swa = build(compose(["model=tiny_swa"])).model
    assert {p.window: len(p.layers) for p in swa.pools()} == {0: 3, 64: 3}
    dsa = build(compose(["model=tiny_dsa"])).model
    assert [p.kind for p in dsa.pools()] == ["mla", "indexer"]


@pytest.mark.parametrize("parallel", sorted(p.stem for p in (CONF_DIR / "parallel").glob("*.yaml")))
def test_parallel_presets_build(parallel):
    # presets are for the default tiny model (6 kv heads: tp 1, 2, 3 and 6 all split it)
    setup = build(compose([f"parallel={parallel}"]))
    assert setup.world_size == setup.ctx.size + setup.gen.size
    for w in range(setup.world_size):
        side, r = setup.side_of(w)
        assert setup.world_rank(side.name, r) == w


@pytest.mark.parametrize("strategy", ["naive", "chunked", "layerwise", "zerocopy"])
def test_transfer_presets_build(strategy):
    setup = build(compose([f"transfer={strategy}", "transfer.slot_mib=0.5"]))
    assert setup.transfer.strategy.name == strategy
    assert setup.transfer.slot_bytes == 2**19


def test_good_overrides_pass():
    assert check_overrides([]) is None
    assert check_overrides(["model=qwen3_235b", "ctx.tp=2", "gen.tp=8", "gen.pp=3", "gen.layer_split=[30,30,34]",
                            "ctx.dtype=fp8", "gen.dtype=fp8", "transfer=zerocopy"]) is None


BAD = [
    (["model=tiny_gqa", "ctx.tp=4"], "ctx.tp=4"),
    (["model=tiny_gqa", "gen.tp=9"], "gen.tp=9"),
    (["model=tiny_gqa", "ctx.pp=5"], "ctx.pp=5"),
    (["model=llama3_8b", "gen.pp=33"], "gen.pp=33"),
    (["ctx.pp=2", "ctx.layer_split=[1,2]"], "ctx.layer_split=[1, 2]"),
    (["gen.pp=2", "gen.layer_split=[1,1,2]"], "gen.layer_split=[1, 1, 2]"),
    (["gen.pp=2", "gen.layer_split=[4,0]"], "gen.layer_split=[4, 0]"),
    (["transfer.slot_mib=0.0001"], "transfer.slot_mib=0.0001"),
    (["transfer.slot_mib=0"], "transfer.slot_mib=0"),
    (["model=foo"], "model=foo"),
    (["transfer=foo"], "transfer=foo"),
    (["transfer.strategy=foo"], "transfer.strategy=foo"),
    (["ctx.tp=0"], "ctx.tp=0"),
    (["ctx.tp=-2"], "ctx.tp=-2"),
    (["workload.isl=0"], "workload.isl=0"),
    (["transfer.slots=-1"], "transfer.slots=-1"),
    (["gen.tokens_per_block=0"], "gen.tokens_per_block=0"),
    (["ctx.tp=abc"], "ctx.tp=abc"),
    (["ctx.layout=diagonal"], "ctx.layout=diagonal"),
    (["ctx.tpp=2"], "ctx.tpp=2"),
    (["model.num_layers=0"], "model.num_layers=0"),
    (["ctx.dtype=fp16"], "dtype=bf16"),
    (["ctx.dtype=int3", "gen.dtype=int3"], "ctx.dtype=int3"),
]


@pytest.mark.parametrize("overrides,names", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_overrides_give_one_line_naming_field_and_value(overrides, names):
    msg = check_overrides(overrides)
    assert isinstance(msg, str) and msg
    assert "\n" not in msg
    assert names in msg, msg


def test_dtype_mismatch_names_both_sides():
    msg = check_overrides(["ctx.dtype=fp16", "gen.dtype=bf16"])
    assert "ctx.dtype=fp16" in msg and "gen.dtype=bf16" in msg


def test_slot_message_names_the_row_it_must_hold():
    # tiny_gqa over ctx tp 2: a segment holds 3 heads, a token row of one layer is 3 * 2 * 16 * 2 bytes
    msg = check_overrides(["model=tiny_gqa", "parallel=tp2_to_tp1", "transfer.slot_mib=0.0001"])
    assert "192 B" in msg
    assert check_overrides(["model=tiny_gqa", "parallel=tp2_to_tp1", f"transfer.slot_mib={192 / 2**20}"]) is None


def test_cli_unknown_model_exits_2_with_one_line(tmp_path, kvlab_cli):
    p = kvlab_cli("plan", "model=foo", cwd=tmp_path, timeout=120)
    assert p.returncode == 2
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr
    assert "model=foo" in lines[0] and "llama3_8b" in lines[0]
    assert not list(tmp_path.iterdir()), "nothing may be written before the config is valid"
