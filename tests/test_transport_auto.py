"""``transport=auto``: p2p, or ipc on one node whose GPUs cannot hold p2p's NCCL pair groups.

The GPU count is faked (``kvlab.config.schema.visible_gpus``, which every count goes through) so that
the one-GPU decisions run on CPUs: the resolution in ``build``, the refusal of an explicit
``transport=p2p``, and the launcher path of ``kvlab run`` and ``kvlab plan`` in this process,
with the ranks' start replaced.
"""
from __future__ import annotations

import json

import pytest
import yaml

from kvlab.cli import commands as cli
from kvlab.config import devices
from kvlab.config import schema as config
from kvlab.config.schema import Setup, build, compose
from kvlab.core.errors import ConfigError

QUIET = ["logger=quiet"]


def gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(config, "visible_gpus", lambda device: n)


def test_cpus_keep_p2p():
    setup = build(compose(QUIET))
    assert setup.transport.name == "p2p" and "CPUs" in setup.transport.auto
    assert Setup(setup.model).transport.name == "p2p"  # no transport given: auto too
    assert build(compose(QUIET + ["transport=p2p"])).transport.auto == ""  # named: nothing to explain
    devices.check_placement(setup)


@pytest.mark.parametrize("n, ctx_tp, gen_tp, want", [
    (1, 2, 1, "ipc"), (1, 1, 1, "ipc"), (2, 2, 1, "p2p"), (2, 2, 2, "p2p"), (3, 2, 1, "p2p"), (8, 2, 1, "p2p")])
def test_auto_on_gpus(monkeypatch, n, ctx_tp, gen_tp, want):
    gpus(monkeypatch, n)
    setup = build(compose(QUIET + [f"ctx.tp={ctx_tp}", f"gen.tp={gen_tp}"]))
    assert setup.transport.name == want
    assert setup.transport.target == {"p2p": "kvlab.transports.p2p.P2P", "ipc": "kvlab.transports.ipc.Ipc"}[want]
    if want == "ipc":
        assert setup.transport.auto.startswith(f"transport=auto is ipc, not p2p: {n} GPU visible")
    devices.check_placement(setup)  # whatever auto picks can be placed


def test_explicit_p2p_on_one_gpu_is_refused(monkeypatch):
    gpus(monkeypatch, 1)
    setup = build(compose(QUIET + ["transport=p2p"]))  # a config may be for another machine: build accepts it
    with pytest.raises(ConfigError, match=r"^transport=p2p: 1 GPU visible for 3 ranks on this host, .* ctx0 and "
                                          r"gen0 would share cuda:0 \(p2p needs at least 2 GPUs here\); use "
                                          r"transport=ipc \(one node\)$"):
        devices.check_placement(setup)
    devices.check_placement(setup, gpus=2)
    devices.check_placement(build(compose(QUIET + ["transport=ipc"])))  # ipc shares a GPU


def test_several_nodes(monkeypatch):
    # torchrun numbers hosts' ranks consecutively: with 2 per host, ctx0 and gen0 of TP1 -> TP3 share one
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    gpus(monkeypatch, 1)
    setup = build(compose(QUIET + ["ctx.tp=1", "gen.tp=3"]))
    assert setup.transport.name == "p2p" and "several nodes" in setup.transport.auto  # ipc cannot span them
    with pytest.raises(ConfigError, match=r"^transport=p2p: 1 GPU visible for 2 ranks on this host.*ctx0 and gen0"
                                          r".*ipc works within one node only\)$"):
        devices.check_placement(setup)
    # TP2 -> TP2 on two hosts: the ctx ranks on one, the gen ranks on the other; no pair shares a GPU
    devices.check_placement(build(compose(QUIET + ["ctx.tp=2", "gen.tp=2"])))


def test_auto_takes_no_options():
    with pytest.raises(ConfigError, match=r"^transport.mode=direct: transport=auto takes no options; .*"
                                          r"transport=nixl transport.mode=..."):
        build(compose(QUIET + ["+transport.mode=direct"]))


def test_run_on_one_gpu_uses_ipc_and_says_so(monkeypatch, tmp_path, capsys, no_ranks):
    gpus(monkeypatch, 1)
    run_dir = tmp_path / "run"
    cli.main(["run", f"hydra.run.dir={run_dir}", *QUIET])
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "transport=auto" in line]
    assert lines == ["kvlab: transport=auto is ipc, not p2p: 1 GPU visible for 3 ranks on this host, and NCCL "
                     "refuses two ranks of one pair group on one GPU: ctx0 and gen0 would share cuda:0 (p2p needs "
                     "at least 2 GPUs here)"]
    # the ranks, and a later rebuild of the run elsewhere, get the transport chosen here
    assert [c["transport"]["name"] for c in no_ranks] == ["ipc"]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["transport"]["_target_"] == \
        "kvlab.transports.ipc.Ipc"


def test_run_on_cpus_says_nothing(tmp_path, capsys, no_ranks):
    run_dir = tmp_path / "run"
    cli.main(["run", f"hydra.run.dir={run_dir}", *QUIET])
    assert "transport=auto" not in capsys.readouterr().out
    assert [c["transport"]["name"] for c in no_ranks] == ["p2p"]


def test_run_refuses_p2p_on_one_gpu_before_any_rank(monkeypatch, tmp_path, capsys, no_ranks):
    gpus(monkeypatch, 1)
    with pytest.raises(SystemExit) as e:
        cli.main(["run", f"hydra.run.dir={tmp_path / 'run'}", *QUIET, "transport=p2p"])
    assert e.value.code == 2 and no_ranks == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvlab: error: transport=p2p: 1 GPU visible for 3 ranks")
    assert err[0].endswith("use transport=ipc (one node)")


def test_launch_refuses_p2p_on_one_gpu(monkeypatch, tmp_path, no_ranks):
    # kvlab.api's path: launch itself checks before it starts anything
    from kvlab.cli.run_cmd import launch

    gpus(monkeypatch, 1)
    with pytest.raises(ConfigError, match=r"^transport=p2p: 1 GPU"):
        launch(build(compose(QUIET + ["transport=p2p"])), tmp_path)
    assert no_ranks == []


@pytest.mark.parametrize("n, overrides, transport, problem", [
    (1, [], "ipc", None), (1, ["transport=p2p"], "p2p", "transport=p2p: 1 GPU visible"), (0, [], "p2p", None),
    (2, [], "p2p", None)])
def test_plan_says_which_transport_and_why(monkeypatch, tmp_path, capsys, n, overrides, transport, problem):
    gpus(monkeypatch, n)
    run_dir = tmp_path / "plan"
    cli.main(["plan", f"hydra.run.dir={run_dir}", *overrides])
    out = capsys.readouterr().out
    data = json.loads((run_dir / "plan.json").read_text())
    assert data["transport"] == transport
    why = data["transport_why"]
    assert (why == "") == bool(overrides)
    assert f"transport: {transport} ({why or 'as named'})" in out
    if problem:
        assert data["transport_problem"].startswith(problem)
        assert f"kvlab run would stop here: {problem}" in out
    else:
        assert data["transport_problem"] is None and "would stop here" not in out
