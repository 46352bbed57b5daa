"""``prefill=model``'s default depth: the whole model where it fits the GPUs beside the pools, else the largest
prefix of whole layers that does, decided by the launcher and said in one line (kvlab.sizing.depth).

The GPUs are faked (CUDA visible, one GPU, its free memory given) so that the launcher's decision runs on CPUs;
the ranks' start is replaced, and what they would have been given is read back.
"""
from __future__ import annotations

import pytest
import torch
import yaml
from omegaconf import open_dict

from kvlab.cli import commands as cli
from kvlab.config import schema as config
from kvlab.config.schema import build, compose
from kvlab.core.errors import ConfigError
from kvlab.sizing import budget, depth

GiB = 1 << 30
DSV32 = ["model=deepseek_v32", "prefill=model", "check=decode", "device=cuda", "transport=ipc", "ctx.tp=1", "gen.pp=2",
         "workload.isl=4096", "workload.requests=2", "logger=quiet"]
LLAMA = ["model=llama3_8b", "prefill=model", "check=decode", "device=cuda", "transport=ipc",
         "workload.isl=16384", "workload.requests=2", "logger=quiet"]


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(config, "visible_gpus", lambda device: 1)


def cfg_of(overrides, layers=None):
    cfg = compose(overrides)
    if layers is not None:
        with open_dict(cfg):
            cfg.model.run_layers = layers
    return cfg


def fits(overrides, layers, free) -> bool:
    s = build(cfg_of(overrides, layers))
    b = budget.estimate(s, 1)
    b.available = {"cuda:0": budget.usable(free)}
    try:
        budget.check(s, b)
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("overrides, free_gib", [(DSV32, 140), (DSV32, 60), (LLAMA, 30)])
def test_the_cut_is_the_largest_prefix_that_fits(one_gpu, overrides, free_gib):
    whole = compose(overrides).model.num_layers
    cut = depth.fit(build(cfg_of(overrides)), lambda n: build(cfg_of(overrides, n)), whole, [free_gib * GiB])
    assert cut is not None and cut.of == whole and 1 <= cut.layers < whole
    assert fits(overrides, cut.layers, free_gib * GiB) and not fits(overrides, cut.layers + 1, free_gib * GiB)
    assert f"model.run_layers={cut.layers}" in cut.line and "\n" not in cut.line


@pytest.mark.parametrize("overrides, free_gib", [(LLAMA, 140), (DSV32, 1)])
def test_no_cut_where_the_whole_model_fits_or_not_one_layer_does(one_gpu, overrides, free_gib):
    whole = compose(overrides).model.num_layers
    assert depth.fit(build(cfg_of(overrides)), lambda n: build(cfg_of(overrides, n)), whole, [free_gib * GiB]) is None


def test_a_pipeline_keeps_a_layer_per_stage(one_gpu):
    # so little room that one layer would fit, but gen.pp=2 needs two: the cut is 2 or no cut
    whole = compose(DSV32).model.num_layers
    for free in (2, 4, 8, 16):
        cut = depth.fit(build(cfg_of(DSV32)), lambda n: build(cfg_of(DSV32, n)), whole, [free * GiB])
        assert cut is None or cut.layers >= 2


def test_the_launcher_cuts_says_so_once_and_hands_the_ranks_the_cut(one_gpu, monkeypatch, tmp_path, capsys,
                                                                     no_ranks):
    monkeypatch.setattr(depth, "gpu_free", lambda: [140 * GiB])
    cli.main(["run", f"hydra.run.dir={tmp_path / 'run'}", *DSV32])
    lines = [x for x in capsys.readouterr().out.splitlines() if "prefill=model runs" in x]
    assert len(lines) == 1 and lines[0].startswith("kvlab: prefill=model runs the first ")
    (given,) = no_ranks
    n = given["model"]["run_layers"]
    assert 2 <= n < 61 and f"model.run_layers={n} " in lines[0]
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]["run_layers"] == n


def test_a_depth_the_user_set_is_kept(one_gpu, monkeypatch, tmp_path, capsys, no_ranks):
    monkeypatch.setattr(depth, "gpu_free", lambda: [140 * GiB])
    cli.main(["run", f"hydra.run.dir={tmp_path / 'run'}", *DSV32, "model.run_layers=4"])
    assert "prefill=model runs" not in capsys.readouterr().out
    assert no_ranks[0]["model"]["run_layers"] == 4
