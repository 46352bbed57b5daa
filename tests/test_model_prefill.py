"""prefill=model: the preset's transformers model is the ctx ranks' prefill, each layer writing its real cache when
it finishes, and the same run decodes from what arrived (kvlab.rank.prefill_model)."""
from __future__ import annotations

import json

import pytest
import torch
from test_decode_check import assert_decodes_as_reference, run_decode

from kvlab.config.schema import build, compose
from kvlab.core.decode_spec import MODEL_SUFFIX, wide
from kvlab.core.errors import ConfigError
from kvlab.rank import hf_models
from kvlab.rank.prefill_model import ModelPrefill

pytest.importorskip("transformers")  # the decode extra


def setup_of(*overrides):
    return build(compose(["parallel=same", "device=cpu", "check=decode", "prefill=model", *overrides]))


def assert_a_lone_share_ends_with_its_last_layer(out):
    """A ctx rank with no tensor-parallel peer (and every layer) ends its share of a prefill at its last layer's
    mark: on a GPU the device's completion of that layer, not when the prefill thread ran again after it."""
    seen = 0
    for f in (out / "parts").glob("rank*.json"):
        rank = json.loads(f.read_text())
        for p in rank["parts"] if rank["side"] == "ctx" else ():
            ready = {int(k): v for k, v in p["layer_ready"].items()}
            assert p["prefill_end"] == ready[max(ready)], (f.name, p["request"])
            seen += 1
    assert seen


@pytest.mark.parametrize("preset", ["tiny_gqa", "tiny_mla"])
def test_the_model_runs_at_the_presets_width_and_cache_shape(preset):
    base = build(compose(["parallel=same", f"model={preset}"])).model
    s = setup_of(f"model={preset}")
    m = s.model
    assert m.name == preset + MODEL_SUFFIX and wide(m) is m  # idempotent: a recorded config builds it again
    assert (m.num_layers, m.attention, m.kv_heads, m.head_dim, m.mla_dim) == \
        (base.num_layers, base.attention, base.kv_heads, base.head_dim, base.mla_dim)
    assert (m.dims.hidden_size, m.dims.q_heads) == (base.dims.hidden_size, base.dims.q_heads)
    cfg = hf_models.hf_config(m)
    assert (cfg.hidden_size, cfg.num_attention_heads) == (base.dims.hidden_size, base.dims.q_heads)
    assert setup_of(f"model={preset}", "model.run_layers=2").model.num_layers == 2


@pytest.mark.parametrize("preset", ["tiny_gqa", "tiny_mla", "tiny_swa", "tiny_dsa"])
def test_each_layer_holds_its_cache_when_it_is_marked_and_all_of_it_is_the_references(preset):
    s = setup_of(f"model={preset}")
    m = ModelPrefill(s, torch.device("cpu"))
    planes, seen = {}, []

    def on_layer(layer):  # the layer's cache is in the planes when it is marked, later layers' not yet
        for p in s.model.pools("bf16"):
            if layer in p.layers:
                assert planes[p.name][0][p.layers.index(layer)].any()
            after = [i for i, g in enumerate(p.layers) if g > layer]
            if p.name in planes and after:
                assert not planes[p.name][0][after].any()
        seen.append(layer)

    first = m.run(3, 48, planes, on_layer)
    assert seen == list(range(s.model.num_layers))
    net, cfg = hf_models.build(s.model, s.check.seed, "cpu")
    cache, last = hf_models.full_prefill(net, cfg, hf_models.prompt(s.check, s.model, 3, 48))
    want = hf_models.pool_rows(s.model, cache)
    assert first == int(last.argmax())
    assert planes.keys() == want.keys()
    for name in want:
        assert all(torch.equal(a, b) for a, b in zip(planes[name], want[name]))


@pytest.mark.parametrize("overrides, field, hint", [
    (["check=bytes"], "prefill=model", "use it with check=decode"),
    (["model=llama3_8b"], "model=llama3_8b", "model.run_layers"),
    (["model.run_layers=9"], "model.run_layers=9", "has 4 layers"),
    (["model.run_layers=-1"], "model.run_layers=-1", "must be 0"),
])
def test_bad_input_is_one_line_naming_the_field(overrides, field, hint):
    with pytest.raises(ConfigError) as e:
        setup_of("model=tiny_gqa", *overrides)
    line = str(e.value)
    assert "\n" not in line and field in line and hint in line, line


def test_tp_pair_layerwise_decodes_as_the_reference(kvlab_cli, tmp_path):
    res, summary, rows, out = run_decode(kvlab_cli, tmp_path, "prefill=model", "model=tiny_gqa", "ctx.tp=2",
                                         "gen.tp=1", "transfer=layerwise", "workload.isl=64", "workload.requests=2",
                                         "check.tokens=4")
    assert_decodes_as_reference(res, summary, rows, out, 2, 4)
    assert "prefill=model" in res.stdout
    assert all(0 < r["prefill_s"] for r in rows)
    # every layer marked when the forward finished it: in the model's order, on each ctx rank
    timeline = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()]
    for key in {(t["request"], t["rank"]) for t in timeline}:
        mine = sorted((t for t in timeline if (t["request"], t["rank"]) == key), key=lambda t: t["layer"])
        done = [t["prefill_done_s"] for t in mine]
        assert len(done) == 4 and done == sorted(done) and len(set(done)) == 4


@pytest.mark.slow
def test_mla_to_a_tp_pair_decodes_as_the_reference(kvlab_cli, tmp_path):
    res, summary, rows, out = run_decode(kvlab_cli, tmp_path, "prefill=model", "model=tiny_mla", "ctx.tp=1",
                                         "gen.tp=2", "transfer=chunked", "workload.isl=64", "workload.requests=1",
                                         "check.tokens=4")
    assert_decodes_as_reference(res, summary, rows, out, 1, 4)
    assert_a_lone_share_ends_with_its_last_layer(out)


def test_a_layer_left_unwritten_fails_the_decode(kvlab_cli, tmp_path):
    res, summary, rows, out = run_decode(kvlab_cli, tmp_path, "prefill=model", "model=tiny_gqa", "ctx.tp=1",
                                         "gen.tp=1", "transfer=layerwise", "workload.isl=64", "workload.requests=1",
                                         "check.tokens=4", "fault.unwritten_layer=2")
    assert res.returncode == 1
    (row,) = rows
    # the first token is the ctx side's own forward's (right); the cache of layer 2 is not
    assert row["byte_check_failures"] >= 1 and row["decode_first_divergent"] is not None
    assert "layer 2 (kv K, V" in row["error"], row["error"]


def test_the_budget_counts_the_model_and_a_model_that_fits_nowhere_is_one_line():
    from kvlab.sizing import budget

    s = setup_of("model=tiny_gqa", "workload.isl=256")
    weights, activations = budget.model_bytes(s, 256)
    b = budget.estimate(s)
    assert weights > 0 and activations > 0 and all(r.model == weights + activations for r in b.ranks)
    assert all(r.model == 0 for r in budget.estimate(build(compose(["parallel=same", "check=decode"]))).ranks)
    need = b.need("host")
    b.available = {"host": sum(need.values()) - need["model"] // 2}  # half the model's room short: 2 of 4 layers
    with pytest.raises(ConfigError) as e:
        budget.check(s, b)
    assert e.value.field == "model.run_layers" and "model.run_layers=2" in e.value.hint and "\n" not in str(e.value)
    b.available = {"host": sum(need.values()) - need["model"]}
    with pytest.raises(ConfigError) as e:
        budget.check(s, b)
    assert e.value.field == "model" and "cannot hold even one layer of tiny_gqa" in e.value.hint


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("preset, sides", [("tiny_gqa", ["ctx.tp=2", "gen.tp=1"]), ("tiny_dsa", ["gen.pp=2"]),
                                           ("tiny_swa", ["ctx.tp=1", "gen.tp=2"])])
def test_on_the_gpu_weights_drawn_there_and_planes_kept_there_decode_as_the_reference(kvlab_cli, tmp_path, preset,
                                                                                     sides):
    # every rank and the reference draw their weights on the GPU (hf_models.build) and the ctx ranks keep each
    # layer's planes there: the decode is still the reference's, bit for bit, with the layers written as computed
    res, summary, rows, out = run_decode(kvlab_cli, tmp_path, "prefill=model", f"model={preset}", *sides,
                                         "device=cuda", "transport=ipc", "transfer=layerwise", "workload.isl=300",
                                         "workload.requests=2", "check.tokens=4")
    assert_decodes_as_reference(res, summary, rows, out, 2, 4)
    assert all(0 < r["prefill_s"] for r in rows)
    if "ctx.tp=1" in sides:
        assert_a_lone_share_ends_with_its_last_layer(out)
