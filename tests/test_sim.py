"""kvlab sim: the cluster's placement and links, the plan table against the plan, the event loop's identities
and orders, the decode clock against stepping it, calibration and its profile, the command and its bad input."""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlab.core.errors import ConfigError
from kvlab.core.sim_terms import PrefillTerms, TransportTerms
from kvlab.model.plan import Request, plan
from kvlab.sim import plans
from kvlab.sim.cluster import ClusterSpec, LinkSpec, LinksSpec, SimSpec, SloSpec
from kvlab.sim.engine import DecodeGroup, simulate
from kvlab.sim.run import build_sim, compose_sim, requests, run

ROOT = Path(__file__).resolve().parents[1]
CPU_RUNS = ROOT / "results" / "sim_calibration_cpu"
SMALL = ["model=tiny_gqa", "ctx.tp=1", "gen.tp=1", "cost=cpu_fit", "transport=p2p", "sim.terms=null",
         "cluster=h200_400g", "cluster.domain_gpus=1",
         "cluster.ctx_instances=2", "cluster.gen_instances=2", "workload.requests=40", "cluster.gpu.hbm_gb=1",
         "cluster.decode.max_batch=8", "sim.slo.ttft_ms=500", "sim.slo.tpot_ms=50"]
FEW = settings(max_examples=int(os.environ.get("KVLAB_SIM_EXAMPLES", 6)), deadline=None,
               suppress_health_check=[HealthCheck.too_slow])


@functools.lru_cache(maxsize=64)
def sim_setup(*extra: str):
    return build_sim(compose_sim([*SMALL, *extra]))


# ---------------------------------------------------------------- the cluster


@FEW
@given(nc=st.integers(1, 9), ng=st.integers(1, 9), cg=st.sampled_from([1, 2, 4, 8, 16]),
       gg=st.sampled_from([1, 2, 4, 8]), domain=st.sampled_from([4, 8, 72]), mixed=st.booleans())
def test_placement_never_splits_an_instance_that_fits_a_domain(nc, ng, cg, gg, domain, mixed):
    c = ClusterSpec(nc, ng, domain_gpus=domain, placement="mixed" if mixed else "separate")
    cd, gd = c.domains(cg, gg)
    same = c.same_domain(cg, gg)
    for i in range(nc):
        for j in range(ng):
            assert same[i][j] == (cg <= domain and gg <= domain and cd[i] == gd[j]), (i, j)
    if not mixed:  # every ctx instance first, then every gen instance, domains in order
        assert cd == sorted(cd) and gd == sorted(gd) and cd[-1] <= gd[0]
    if cg <= domain and gg <= domain:  # an instance that fits a domain sits whole in one
        per_domain: dict[int, int] = {}
        for d in cd:
            per_domain[d] = per_domain.get(d, 0) + cg
        for d in gd:
            per_domain[d] = per_domain.get(d, 0) + gg
        assert max(per_domain.values()) <= domain


def test_a_link_no_placement_uses_is_one_line():
    c = ClusterSpec(2, 2, domain_gpus=8, placement="separate", links=LinksSpec(LinkSpec(3600, 2), LinkSpec()))
    with pytest.raises(ConfigError) as e:
        c.check_links(4, 4)
    assert str(e.value).startswith("cluster.links.nvlink.gbit_s=3600: no placement uses it")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^cluster.links.nvlink.gbit_s=3600: no placement uses it"):
        sim_setup("cluster.links.nvlink.gbit_s=3600")
    with pytest.raises(ConfigError, match=r"^cluster.links.nic.gbit_s=0: some ctx/gen pairs need it"):
        sim_setup("cluster.links.nic.gbit_s=0")


@pytest.mark.parametrize("key", ["sim.slo.ttft_ms", "sim.slo.tpot_ms"])
@pytest.mark.parametrize("value", ["0", "-5"])
def test_an_slo_at_or_below_zero_is_one_line(key, value):
    with pytest.raises(ConfigError) as e:
        sim_setup(f"{key}={value}")
    assert str(e.value) == f"{key}={float(value)}: must be a time > 0 in ms, or null for no SLO on it"


def test_an_instance_layout_the_model_cannot_split_is_one_line():
    with pytest.raises(ConfigError) as e:
        sim_setup("ctx.tp=4")
    assert str(e.value).startswith("ctx.tp=4: ") and "6 kv heads" in str(e.value)


def test_a_profile_without_fitted_terms_is_refused():
    with pytest.raises(ConfigError, match=r"^cost=cpu: holds no fitted terms"):
        sim_setup("cost=cpu")


# ---------------------------------------------------------------- the plan table


@FEW
@given(isls=st.lists(st.integers(100, 20000), min_size=49, max_size=60), tp=st.sampled_from([(1, 2), (2, 1), (3, 2)]))
def test_the_plan_table_is_the_plan_at_its_grid_and_its_line_between(isls, tp):
    from kvlab.config.schema import build, compose

    model = "model=tiny_gqa" if tp != (3, 2) else "model=tiny_mla"
    setup = build(compose([f"ctx.tp={tp[0]}", f"gen.tp={tp[1]}", model]))
    table = plans.build(setup, isls)
    grid = plans.grid_for(np.asarray(isls), setup)
    exact = {}
    for k, n in enumerate(isls):
        if n not in exact:
            segs = plan(setup.model, setup.ctx, setup.gen, Request(0, n))
            exact[n] = sum(s.nbytes for s in segs)
        got = table.bytes[k].sum()
        # full attention: bytes linear in the prompt, up to one tile row per pool and segment
        tol = 0 if n in grid else setup.model.num_layers * 64 * 1024
        assert abs(got - exact[n]) <= tol, (n, got, exact[n])


# ---------------------------------------------------------------- the event loop


@FEW
@given(rate=st.sampled_from([2.0, 20.0, 200.0]), strategy=st.sampled_from(["chunked", "layerwise", "zerocopy"]),
       nc=st.integers(1, 3), ng=st.integers(1, 3), wait=st.sampled_from([0.0, 1.0]))
def test_every_request_keeps_the_identities_and_the_orders(rate, strategy, nc, ng, wait):
    s = sim_setup(f"transfer={strategy}", f"sim.rate={rate}", f"cluster.ctx_instances={nc}",
                  f"cluster.gen_instances={ng}")
    s = dataclasses.replace(s, terms=dataclasses.replace(s.terms, host_wait=wait))
    a, i, o = requests(s)
    out = run(s, a, i, o).outcome
    assert np.allclose(out.ttft, out.queue + out.prefill + out.exposed)
    assert (out.exposed >= -1e-12).all() and (out.queue >= -1e-12).all() and (out.admit_wait >= -1e-12).all()
    assert (out.finish >= out.arrival + out.ttft - 1e-9).all()
    assert (out.transfer_start >= out.admitted - 1e-9).all()
    start, end = out.arrival + out.queue, out.arrival + out.queue + out.prefill
    for server in np.unique(out.server):  # first come first served, one prefill at a time
        ids = np.nonzero(out.server == server)[0]
        ids = ids[np.argsort(out.arrival[ids], kind="stable")]
        assert (np.diff(start[ids]) >= -1e-12).all()
        assert (start[ids][1:] >= end[ids][:-1] - 1e-9).all()


def test_a_link_serves_one_transfer_at_a_time():
    s = sim_setup("sim.rate=400", "cluster.ctx_instances=1", "cluster.gen_instances=1", "sim.decode=false")
    s = dataclasses.replace(s, terms=TransportTerms(byte_ns=1.0, piece_us=100.0))
    a, i, o = requests(s)
    out = run(s, a, i, o).outcome
    held = out.transfer - 2 * s.cluster.links.nic.latency_us * 1e-6  # the link is free before the last byte lands
    spans = sorted(zip(out.transfer_start, out.transfer_start + held))
    for (_, e0), (s1, _) in zip(spans, spans[1:]):
        assert s1 >= e0 - 1e-9  # one ctx GPU, one gen GPU: the transfers follow each other


def test_the_decode_clock_matches_stepping_the_batch():
    fixed, per_token, per_member = 1e-3, 2e-8, 1e-4
    g = DecodeGroup(fixed, per_token, per_member)
    isl, osl = [3000, 100, 50000], [40, 200, 90]
    for k in range(3):  # all join at t=0
        g.heap.append((osl[k], k))
        g.b += 1
        g.c += isl[k]
    g.heap.sort()
    t, left, cached, done = 0.0, list(osl), list(isl), {}
    while len(done) < 3:  # step by step: one token for every member still decoding
        live = [k for k in range(3) if k not in done]
        t += fixed + max(per_token * sum(cached[k] for k in live), per_member * len(live))
        for k in live:
            left[k] -= 1
            cached[k] += 1
            if not left[k]:
                done[k] = t
    for k in sorted(range(3), key=lambda k: osl[k]):
        nxt = g.next_finish()
        g.advance(nxt)
        v, r = g.heap.pop(0)
        assert r == k
        assert nxt == pytest.approx(done[k], rel=0.02), (k, nxt, done[k])
        g.b -= 1
        g.c -= isl[r] - (g.v - osl[r])


def test_decode_never_holds_more_tokens_than_a_group_has():
    s = sim_setup("sim.rate=50", "cluster.decode.capacity_tokens=60000", "workload.isl_max=20000")
    a, i, o = requests(s)
    out = run(s, a, i, o).outcome
    assert np.isfinite(out.admitted).all()
    for g in np.unique(out.group):
        ids = np.nonzero(out.group == g)[0]
        changes = sorted([(out.admitted[k], i[k] + o[k]) for k in ids] + [(out.finish[k], -(i[k] + o[k])) for k in ids],
                         key=lambda x: (x[0], x[1]))  # a release at the same instant goes first
        held = np.cumsum([d for _, d in changes])
        assert held.max() <= 60000 + 1e-6, (g, held.max())


def test_a_request_larger_than_any_decode_group_is_one_line():
    with pytest.raises(ConfigError, match=r"^cluster.decode.capacity_tokens=100: a gen DP group holds 100 KV tokens"):
        s = sim_setup("cluster.decode.capacity_tokens=100")
        run(s)


def test_a_request_no_decode_group_can_hold_is_refused_before_the_table_is_planned():
    """Drawn by the config fuzzer: ``model.kv_heads=2536`` cut every prompt length of the table into chunks (16 s)
    before the decode capacity refused the largest request, naming as ``capacity_tokens`` a value the user never set.
    The refusal now comes from the largest prompt's plan, before any chunk; a capacity from the HBM is said to be
    one."""
    real = plans._one
    planned, said = [], []

    def counted(setup, isl, *a):
        planned.append(isl)
        return real(setup, isl, *a)

    s = sim_setup("cluster.gpu.hbm_gb=0.005")
    _, isl, _ = requests(s)
    assert len(plans.grid_for(isl, s.setup)) > 10
    with mock.patch.object(plans, "_one", counted), pytest.raises(
            ConfigError, match=r"^cluster.decode.capacity_tokens=0: from its HBM a gen DP group holds [\d,]+ KV tokens "
                               r"of [\d,]+ bytes each and request \d+ needs [\d,]+ \(prompt \+ output\); give"):
        run(s)
    assert planned == []
    # the bytes per token the check is given are the table's own
    table = plans.build(s.setup, isl, said.append)
    assert said == [table.kv_token_bytes] and table.kv_token_bytes > 0
    ok = sim_setup("cluster.gpu.hbm_gb=0.005", "sim.decode=false")  # nothing decoded, nothing held: the whole table
    with mock.patch.object(plans, "_one", counted):
        run(ok)
    assert planned == plans.grid_for(isl, s.setup)


@pytest.mark.parametrize("model", ["gemma3_27b", "deepseek_v32", "qwen3_next_80b"])
def test_the_capacity_checks_bytes_per_token_are_the_tables(model):
    """The segments' bytes the capacity check reads are the chunks' the table holds: sliding windows, the MLA latent
    beside the indexer keys, recurrent state; ctx TP2 -> gen TP1."""
    s = build_sim(compose_sim([f"model={model}", "workload.requests=8", "ctx.tp=2", "gen.tp=1"]))
    _, isl, _ = requests(s)
    said = []
    table = plans.build(s.setup, isl, said.append)
    assert said == [table.kv_token_bytes] and table.kv_token_bytes > 0


# ---------------------------------------------------------------- calibration and profiles


def test_a_calibration_dir_with_no_transfers_is_one_line(tmp_path):
    from kvlab.sim import calibrate

    run_dir = tmp_path / "empty"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text((CPU_RUNS / "p2p_pois_chunked" / "config.yaml").read_text())
    rows = [json.loads(x) for x in (CPU_RUNS / "p2p_pois_chunked" / "results.jsonl").read_text().splitlines()]
    (run_dir / "results.jsonl").write_text("".join(json.dumps(dict(r, bytes=0)) + "\n" for r in rows))
    with pytest.raises(ConfigError) as e:
        calibrate.calibrate([str(run_dir)])
    assert str(e.value).startswith("RUN_DIR=empty: holds no transfers") and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^RUN_DIR=.*: no such run directory"):
        calibrate.calibrate([str(tmp_path / "absent")])


def test_calibrate_says_which_terms_its_runs_determine():
    """A term is determined where doubling or halving it alone raises the fit's error by DETERMINED or more: the
    figure is the smaller of the two rises, and a term the runs cannot see (a pulling transport stages nothing, so
    ``staged_byte_ns`` moves nothing) is said to be undetermined."""
    from kvlab.sim import calibrate

    runs = calibrate.sources([str(CPU_RUNS / "ipc_pois_chunked")])
    replays = [calibrate.replay_of(n, s, rows) for n, s, rows in runs]
    pre = calibrate.fit_prefill(replays)
    terms, base = calibrate.fit_transport(replays, pre)
    rises = calibrate.determination(replays, terms, pre)
    assert set(rises) == set(calibrate.TERMS) and all(v >= 0 for v in rises.values())
    assert rises["staged_byte_ns"] == 0 and "staged_byte_ns" in calibrate.undetermined(rises)
    assert base == pytest.approx(calibrate.error(replays, terms, pre))
    for k in ("piece_us", "byte_ns"):  # the figure's definition, term by term
        cur = getattr(terms, k)
        tries = [cur * 2, cur / 2] if cur else [calibrate.FLOOR[k]]
        each = [calibrate.error(replays, dataclasses.replace(terms, **{k: v}), pre) - base for v in tries]
        assert rises[k] == pytest.approx(max(0.0, min(each)), abs=1e-12)
    line = calibrate.determination_line("ipc", rises)
    assert line.startswith("ipc: not determined by these runs: ") and "staged_byte_ns +0," in line and "\n" not in line


def test_calibrated_terms_reach_the_plan_and_the_summary_prediction():
    from kvlab.cli.plan_cmd import predicted
    from kvlab.config.schema import build, compose
    from kvlab.sizing.cost import predict

    setup = build(compose(["cost=cpu_fit", "transport=nixl"]))
    p = predicted(setup)
    assert p["profile"] == "cpu (fitted, nixl)"
    t = setup.cost.fitted.transports["nixl"]
    # one chunk alone: its piece, its bytes, its staged bytes (pack and unpack)
    one = predict(setup, [64], concurrency=1)
    assert one.messages >= 1 and one.seconds >= t.piece_us * 1e-6


@pytest.mark.slow
def test_calibrate_writes_a_profile_kvlab_sim_and_plan_read(tmp_path):
    out = tmp_path / "mine.yaml"
    runs = [str(CPU_RUNS / "nixl_pois_chunked"), str(CPU_RUNS / "nixl_moon_chunked")]
    r = subprocess.run([sys.executable, "-m", "kvlab", "sim", "calibrate", *runs, "--out", str(out), "--base", "cpu",
                        "--report", str(tmp_path / "rep.json")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rep = json.loads((tmp_path / "rep.json").read_text())
    assert [x["run"] for x in rep] == ["nixl_pois_chunked", "nixl_moon_chunked"]
    said = r"^ *# nixl: (not determined by these runs: [\w, ]+|every term determined by these runs) \(the fit's error"
    assert re.search(said.replace("# ", "", 1), r.stdout, re.M) and re.search(said, out.read_text(), re.M), r.stdout
    assert all(x[f"{k}_measured_ms"] > 0 for x in rep for k in ("exposed_p50", "ttft_p90"))
    conf = tmp_path / "conf" / "cost"
    conf.mkdir(parents=True)
    (conf / "mine.yaml").write_text(out.read_text())
    r = subprocess.run([sys.executable, "-m", "kvlab", "plan", f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
                        "cost=mine", "transport=nixl", f"hydra.run.dir={tmp_path / 'plan'}"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "plan" / "plan.json").read_text())["predicted"]["profile"] == "cpu (fitted, nixl)"


def test_calibrate_writes_into_the_user_config_directory_that_cost_name_reads(tmp_path):
    """Never into the package's conf/ (in a wheel: site-packages): $XDG_CONFIG_HOME/kvlab/cost/NAME.yaml, which
    cost=NAME finds beside the shipped profiles, in kvlab plan and kvlab sim."""
    from kvlab.core.paths import CONF_DIR

    before = sorted(p.name for p in (CONF_DIR / "cost").iterdir())
    env = dict(os.environ, XDG_CONFIG_HOME=str(tmp_path / "xdg"))
    r = subprocess.run([sys.executable, "-m", "kvlab", "sim", "calibrate", str(CPU_RUNS / "p2p_pois_chunked"),
                        "--name", "mine"], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    profile = tmp_path / "xdg" / "kvlab" / "cost" / "mine.yaml"
    assert profile.is_file() and f"profile written to {profile} (cost=mine)" in r.stdout, r.stdout
    assert sorted(p.name for p in (CONF_DIR / "cost").iterdir()) == before
    r = subprocess.run([sys.executable, "-m", "kvlab", "plan", "cost=mine", "transport=p2p",
                        f"hydra.run.dir={tmp_path / 'plan'}"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
    assert json.loads((tmp_path / "plan" / "plan.json").read_text())["predicted"]["profile"] == "cpu (fitted, p2p)"
    wrong = subprocess.run([sys.executable, "-m", "kvlab", "plan", "cost=theirs"], capture_output=True, text=True,
                           timeout=300, env=env, cwd=tmp_path)
    assert wrong.returncode == 2 and "mine" in wrong.stderr and "cpu_fit" in wrong.stderr, wrong.stderr
    # a shipped profile's name would be shadowed by the shipped one: refused, before any fitting
    taken = subprocess.run([sys.executable, "-m", "kvlab", "sim", "calibrate", str(CPU_RUNS / "p2p_pois_chunked"),
                            "--name", "cpu_fit"], capture_output=True, text=True, timeout=300, env=env)
    assert taken.returncode == 2 and taken.stderr.startswith("kvlab: error: --name=cpu_fit: cost=cpu_fit is a profile "
                                                             "kvlab ships"), taken.stderr
    assert not (tmp_path / "xdg" / "kvlab" / "cost" / "cpu_fit.yaml").exists()
    # beside the runs instead: DIR/cost/NAME.yaml, found with DIR on the searchpath, as the line says
    beside = tmp_path / "runs"
    r = subprocess.run([sys.executable, "-m", "kvlab", "sim", "calibrate", str(CPU_RUNS / "p2p_pois_chunked"),
                        "--name", "here", "--out", str(beside)], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0 and (beside / "cost" / "here.yaml").is_file(), r.stderr
    assert f"(cost=here hydra.searchpath=[file://{beside.resolve()}])" in r.stdout, r.stdout


def test_the_rate_search_brackets_and_says_its_limits():
    """Bracketed (an answer with the rate above it that misses), at least the highest rate tried (a burst the fleet
    serves: a higher rate brings the same burst), or none, with why (the prefill alone over the TTFT SLO)."""
    from kvlab.sim.cmd import search_line
    from kvlab.sim.run import max_rate, vary

    poisson = ("workload.arrival=poisson", "workload.trace=null", "workload.osl=32")
    s = vary(sim_setup(*poisson), sim_search_lo=1.0, sim_search_hi=2.0, sim_search_steps=3)
    found = max_rate(s)
    lo, hi = found["bracket"]
    assert found["bound"] == "=" and found["max_rate"] == lo and hi > lo
    att = {t["rate"]: t["slo_attainment"] for t in found["tried"]}
    assert att[lo] >= s.sim.target > att[hi]
    assert max(att) > 2.0  # the high end moved up until it missed
    assert f"{lo:.4g} req/s ({hi:.4g} req/s misses them;" in search_line(s, found)

    loose = vary(sim_setup("sim.slo.ttft_ms=100000", "sim.slo.tpot_ms=100000"), sim_search_lo=1.0, sim_search_hi=4.0)
    found = max_rate(loose)
    assert found["bound"] == ">=" and found["max_rate"] == max(t["rate"] for t in found["tried"])
    assert "arrive almost at once" in found["why"]
    assert search_line(loose, found).startswith(f"highest rate with 90% of requests within the SLOs: >= "
                                                f"{found['max_rate']:.4g} req/s: ")

    tight = sim_setup("sim.slo.ttft_ms=1")
    found = max_rate(tight)
    assert found["max_rate"] is None and found["bound"] is None and len(found["tried"]) == 1  # no lower rate helps
    assert found["why"].startswith("the p90 prefill alone (") and "exceeds the TTFT SLO (0.001 s)" in found["why"]
    assert search_line(tight, found).startswith("highest rate with 90% of requests within the SLOs: none: the p90 "
                                                "prefill alone")


# ---------------------------------------------------------------- the command


def _kvlab(*args, cwd=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "kvlab", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd)


@pytest.mark.slow
def test_kvlab_sim_sweeps_and_searches(tmp_path):
    r = _kvlab("sim", "-m", *SMALL, "sim.rate=5,50", "transfer=chunked,layerwise", f"hydra.sweep.dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    summaries = sorted(tmp_path.glob("*/summary.json"))
    assert len(summaries) == 4
    for p in summaries:
        s = json.loads(p.read_text())
        assert s["requests"] == 40 and s["ttft_s"]["n"] == 40 and 0 <= s["slo_attainment"] <= 1
        assert len((p.parent / "requests.jsonl").read_text().splitlines()) == 40
    r = _kvlab("sim", *SMALL, "sim.search=true", "sim.search_steps=4", "sim.slo.ttft_ms=20000",
               f"hydra.run.dir={tmp_path / 'search'}")
    assert r.returncode == 0, r.stderr
    found = json.loads((tmp_path / "search" / "search.json").read_text())
    assert len(found["tried"]) >= 2 and "highest rate" in r.stdout
    # the table says which rate it describes
    assert f"at {found['max_rate']:.3g} req/s: the highest rate" in r.stdout, r.stdout
    fleet = next(line for line in r.stdout.splitlines() if line.startswith("requests "))
    assert "; duration " in fleet and " ms;" in fleet and "duration_s" not in fleet  # shown in ms, named so


@pytest.mark.slow
@pytest.mark.parametrize("bad, line", [
    (["sim.slo.ttft_ms=0"], "kvlab: error: sim.slo.ttft_ms=0.0: must be a time > 0 in ms, or null for no SLO on it"),
    (["cluster.links.nvlink.gbit_s=3600"],
     "kvlab: error: cluster.links.nvlink.gbit_s=3600: no placement uses it"),
])
def test_kvlab_sim_bad_input_is_one_line(tmp_path, bad, line):
    r = _kvlab("sim", *SMALL, *bad, f"hydra.run.dir={tmp_path / 'x'}")
    assert r.returncode == 2 and r.stderr.startswith(line) and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "x").exists()


def test_slo_and_sim_specs_refuse_what_cannot_work():
    with pytest.raises(ConfigError, match=r"^sim.search=True: needs an SLO"):
        SimSpec(search=True)
    assert SloSpec(ttft_ms=100).met(0.05, float("nan"))
    with pytest.raises(ConfigError, match=r"^sim.rate=0: must be > 0"):
        SimSpec(rate=0)


@pytest.mark.parametrize("key, value", [("cluster.decode.weight_bytes", 4.4e16), ("cluster.decode.weights_gb", 2000.0)])
def test_weights_that_fill_the_gen_hbm_are_one_line_naming_them(key, value):
    """Drawn by the config fuzzer: weights that leave a gen DP group no HBM for KV were refused only mid-simulation,
    naming ``cluster.decode.capacity_tokens=0``, which the user never set."""
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}={re.escape(str(value))}: the weights .* no room for KV"):
        sim_setup(f"{key}={value}")
    sim_setup(f"{key}={value}", "sim.decode=false")  # no decode, no KV held: nothing to refuse
    sim_setup(f"{key}={value}", "cluster.decode.capacity_tokens=200000")  # a capacity of its own: as given


def test_a_set_rate_makes_a_workload_poisson_before_its_burstiness_is_checked():
    """``sim.rate`` makes any workload but a trace Poisson at that rate (kvlab.sim.run.requests), so a
    ``workload.burstiness`` beside it shapes the gaps, where ``kvlab run`` with the same burst workload refuses it."""
    runs = {b: sim_setup("workload=default", "workload.osl=16", "workload.requests=400", "sim.rate=10",
                         f"workload.burstiness={b}") for b in (1, 0.25)}
    assert {s.setup.workload.arrival for s in runs.values()} == {"poisson"}
    gaps = {b: np.diff(requests(s)[0]) for b, s in runs.items()}
    cv = {b: g.std() / g.mean() for b, g in gaps.items()}  # gamma gaps of shape b: 1 / sqrt(b), 1 and 2
    assert 0.8 < cv[1] < 1.2 and 1.6 < cv[0.25] < 2.4, cv
    with pytest.raises(ConfigError, match=r"^workload.burstiness=0.25: shapes the gaps of workload.arrival=poisson"):
        sim_setup("workload=default", "workload.osl=16", "workload.burstiness=0.25")  # no rate: its own burst


def test_simulate_without_decode_ends_at_the_transfer():
    s = sim_setup("sim.decode=false", "sim.rate=10")
    a, i, o = requests(s)
    table = plans.build(s.setup, i)
    out = simulate(s.setup, s.cluster, s.terms, PrefillTerms(), table, a, i, o, decode=False)
    assert np.allclose(out.finish, out.arrival + out.ttft) and np.isnan(out.tpot).all()


def test_a_replay_keeps_the_global_order_of_kvlab_run():
    s = sim_setup("sim.decode=false", "sim.rate=50", "cluster.ctx_instances=1", "cluster.gen_instances=1")
    a, i, o = requests(s)
    table = plans.build(s.setup, i)
    after = [np.array([j for j in range(len(a)) if j != k], dtype=np.int64) for k in range(len(a))]
    free = simulate(s.setup, s.cluster, s.terms, s.prefill, table, a, i, o, decode=False)
    terms = dataclasses.replace(s.terms, order_wait=1.0)
    held = simulate(s.setup, s.cluster, terms, s.prefill, table, a, i, o, decode=False, after=after)
    last_prefill = (free.arrival + free.queue + free.prefill).max()
    # every request's chunks wait behind every other's: none lands before the last prefill is done
    assert (held.arrival + held.ttft >= last_prefill - 1e-9).all()
    assert (held.ttft >= free.ttft - 1e-9).all()


@pytest.mark.parametrize("preset", sorted(p.stem for p in (ROOT / "conf" / "cluster").glob("*.yaml")))
def test_every_cluster_preset_builds_with_the_default_sim(preset):
    s = build_sim(compose_sim([f"cluster={preset}"]))
    assert s.cluster.ctx_instances >= 1 and s.terms_name == "ipc"
