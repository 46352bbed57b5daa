"""The sweep presets in conf/experiment: every job they launch composes into a valid, small setup."""
import itertools

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf, open_dict

from kvlab.config.schema import CONF_DIR, build
from kvlab.config.workload import make_requests
from kvlab.model.plan import plan

PRESETS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
GROUPS = {p.name for p in CONF_DIR.iterdir() if p.is_dir()}


@pytest.fixture(scope="module")
def hydra_conf():
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base=None, config_dir=str(CONF_DIR)):
        yield compose
    GlobalHydra.instance().clear()


_JOBS = {}


def jobs(hydra_conf, preset):
    """The setups of every job ``kvlab run -m +experiment=<preset>`` launches."""
    if preset not in _JOBS:
        _JOBS[preset] = _jobs(hydra_conf, preset)
    return _JOBS[preset]


def _jobs(hydra_conf, preset):
    head = hydra_conf("config", overrides=[f"+experiment={preset}"], return_hydra_config=True)
    params = {k: str(v).split(",") for k, v in head.hydra.sweeper.params.items()}
    groups = [k for k in params if k in GROUPS]
    values = [k for k in params if k not in GROUPS]
    out = []
    # composing costs ~0.15 s: once per group choice, the plain values set on the result
    for gchoice in itertools.product(*(params[k] for k in groups)):
        base = hydra_conf("config", overrides=[f"+experiment={preset}"] + [f"{k}={v}" for k, v in
                                                                           zip(groups, gchoice, strict=True)])
        for vchoice in itertools.product(*(params[k] for k in values)):
            cfg = base.copy()
            with open_dict(cfg):
                for k, v in zip(values, vchoice, strict=True):
                    OmegaConf.update(cfg, k, int(v) if v.isdigit() else v)
            out.append((dict(zip(groups + values, gchoice + vchoice, strict=True)), build(cfg)))
    return params, out


@pytest.mark.parametrize("preset", PRESETS)
def test_every_job_is_valid_and_small(hydra_conf, preset):
    params, setups = jobs(hydra_conf, preset)
    assert len(setups) == len(list(itertools.product(*params.values()))) > 1
    for choice, s in setups:
        assert s.model.num_layers <= 8 and s.world_size <= 6, choice  # a CPU machine runs it in seconds
        total = sum(seg.nbytes for r in make_requests(s) for seg in plan(s.model, s.ctx, s.gen, r))
        assert 0 < total <= 128 * 2**20, (choice, total)
        for k, v in choice.items():  # the sweep really varies what it says
            if k == "transfer":
                assert s.transfer.strategy.name == v
            else:
                assert str(OmegaConf.select(OmegaConf.create(s.to_dict()), k)) == v


def test_sweep_presets_cover_strategies_layouts_and_prompt_lengths(hydra_conf):
    p = {name: jobs(hydra_conf, name)[0] for name in ("strategies", "parallel_matrix", "prompt_lengths")}
    assert set(p["strategies"]["transfer"]) == {"naive", "chunked", "layerwise", "zerocopy"}
    assert p["parallel_matrix"] == {"ctx.tp": ["1", "2", "3"], "gen.tp": ["1", "2", "3"]}
    isl = [int(x) for x in p["prompt_lengths"]["workload.isl"]]
    assert min(isl) == 1024 and max(isl) == 131072
