"""Strategies are data: the presets are read from conf/transfer/, traits combine freely, and a
strategy defined in a user's own module is selected from the user's own config file and runs end
to end through ``kvlab run`` without any change to kvlab."""
from __future__ import annotations

import json
import os
import textwrap

import pytest
from conftest import check_figures

from kvlab.config.schema import build, compose
from kvlab.core.errors import ConfigError
from kvlab.model.parallel import SideSpec
from kvlab.model.plan import Request, plan
from kvlab.model.schedule import Cut, Order, Ready, Staging, Strategy, make_strategy, preset, preset_names, schedule
from kvlab.model.spec import Attention, ModelSpec

USER_MODULE = '''
from dataclasses import dataclass

from kvlab.model.schedule import Strategy


@dataclass(frozen=True)
class BiggestFirst(Strategy):
    """Any traits; within each round the larger segments go first."""

    def arrange(self, per_seg):
        return super().arrange(sorted(per_seg, key=lambda chunks: -sum(c.nbytes for c in chunks)))
'''

USER_CONF = '''
defaults: [base_transfer, _self_]
strategy:
  _target_: my_strategies.BiggestFirst
  name: layerwise_in_place
  cut: layer
  order: ready_layer
  ready: layer
  in_place: true
  staging: slots
layer_compute_ms: 1.0
'''


def test_presets_are_their_yaml_files():
    assert set(preset_names()) >= {"naive", "chunked", "layerwise", "zerocopy"}
    assert preset("naive") == Strategy("naive", Cut.segment, Order.as_is, Ready.request, False, Staging.per_chunk)
    assert preset("layerwise").traits() == {"name": "layerwise", "cut": "layer", "order": "ready_layer",
                                            "ready": "layer", "in_place": False, "staging": "slots"}
    assert preset("zerocopy").in_place and preset("zerocopy").cut == Cut.slot
    for name in preset_names():
        assert build(compose([f"transfer={name}"])).transfer.strategy == preset(name)
        assert build(compose([f"transfer.strategy={name}"])).transfer.strategy == preset(name)


def test_traits_combine_without_a_new_name():
    """Layer-wise and in place at once: chunks never span layers, go by ready layer, and whole-block
    chunks are in wire order on both sides (the zero-copy decision of the in_place trait)."""
    model = ModelSpec("g", 4, Attention.gqa, 8, 64)
    ctx, gen = SideSpec("ctx", tp=2), SideSpec("gen", tp=2)
    segs = plan(model, ctx, gen, Request(0, 1000))
    both = Strategy("mine", cut=Cut.layer, order=Order.ready_layer, ready=Ready.layer, in_place=True)
    chunks = schedule(model, ctx, gen, segs, both, 1 << 16)
    assert all(c.rect.n_layers == 1 for c in chunks)
    assert [c.ready_layer for c in chunks] == sorted(c.ready_layer for c in chunks)
    assert any(c.ctx_in_place and c.gen_in_place for c in chunks)
    # the same cut without in_place: identical bytes, no in-place decisions
    plain = schedule(model, ctx, gen, segs, preset("layerwise"), 1 << 16)
    assert sum(c.nbytes for c in plain) == sum(c.nbytes for c in chunks)
    assert not any(c.ctx_in_place or c.gen_in_place for c in plain)


@pytest.mark.parametrize("overrides, field", [
    (["transfer.strategy.cut=diagonal"], "transfer.strategy.cut=diagonal"),
    (["transfer.strategy.order=random"], "transfer.strategy.order=random"),
    (["transfer=naive", "transfer.strategy.staging=slots"], "transfer.strategy.staging=slots"),
    (["transfer.strategy._target_=nowhere.Nothing"], "transfer.strategy._target_=nowhere.Nothing"),
    (["transfer.strategy._target_=collections.OrderedDict"], "transfer.strategy._target_=collections.OrderedDict"),
])
def test_bad_traits_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        build(compose(overrides))
    assert str(e.value).startswith(field) and len(str(e.value).splitlines()) == 1


def test_make_strategy_accepts_names_and_nodes():
    assert make_strategy("chunked") == preset("chunked")
    node = {"_target_": "kvlab.model.schedule.Strategy", "name": "x", "cut": "layer", "in_place": True}
    assert make_strategy(node) == Strategy("x", Cut.layer, in_place=True)


@pytest.mark.slow
def test_user_strategy_from_its_own_module_runs_end_to_end(tmp_path, kvlab_cli):
    (tmp_path / "my_strategies.py").write_text(USER_MODULE)
    (tmp_path / "conf" / "transfer").mkdir(parents=True)
    (tmp_path / "conf" / "transfer" / "layerwise_in_place.yaml").write_text(textwrap.dedent(USER_CONF))
    run_dir = tmp_path / "run"
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    # per-layer tensors on both sides: a layer's consecutive blocks are one run, so layer chunks go in place
    overrides = ["model=tiny_gqa", "ctx.tp=2", "gen.tp=2", "ctx.layout=layer_major", "gen.layout=layer_major",
                 "workload.isl=1000", "workload.requests=2",
                 "transfer.slot_mib=0.05"]
    p = kvlab_cli("run", f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "transfer=layerwise_in_place",
                  f"hydra.run.dir={run_dir}", "logger=quiet", *overrides, cwd=tmp_path, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["verified"] and summary["strategy"] == "layerwise_in_place"
    rows = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["verified"] for r in rows)
    check_figures(run_dir, importable=tmp_path)
    assert sum(r["in_place_chunks"] for r in rows) > 0  # the in_place trait took effect on the gen side
    assert (run_dir / "timeline.jsonl").exists()  # the ready=layer trait: a per-layer timeline
