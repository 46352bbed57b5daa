"""One simulation from a composed config: the typed setup, the requests, the plan table, the outcome.

The config is kvlab run's (every group: model, ``ctx.*``/``gen.*`` for each instance's layout, transfer,
transport, workload, prefill, cost) plus ``cluster`` (kvlab.sim.cluster.ClusterSpec) and ``sim``
(``SimSpec``). The cost group must hold fitted terms (kvlab.core.sim_terms: ``kvlab sim calibrate`` writes them);
``sim.terms`` names whose terms cost the transfers when they are not the transport's own (e.g. terms measured
with ``ipc`` on one GPU, applied across NICs where the NIC's rate bounds them).
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from kvlab.config.schema import CONF_DIR, Config, Setup, build, schema
from kvlab.config.workload import make_requests
from kvlab.core import traces
from kvlab.core.bounds import check_tree
from kvlab.core.checks import check_config
from kvlab.core.errors import ConfigError, require
from kvlab.core.sim_terms import PrefillTerms, TransportTerms
from kvlab.sim import plans, report
from kvlab.sim.cluster import ClusterSpec, SimSpec
from kvlab.sim.engine import Outcome, check_decode_capacity, check_decode_memory, decode_rates, simulate

SIM_KEYS = ("cluster", "sim")


def _sim_schema() -> type:
    base = [(f.name, f.type, f) for f in dataclasses.fields(Config)]
    extra = [("cluster", schema(ClusterSpec), field(default_factory=schema(ClusterSpec))),
             ("sim", schema(SimSpec), field(default_factory=schema(SimSpec)))]
    return dataclasses.make_dataclass("SimConfig", [(n, t, f) for n, t, f in base] + extra,
                                      namespace={"__doc__": "Hydra schema of kvlab sim's config"})


SimConfig = _sim_schema()


def register() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="base_sim", node=SimConfig)


register()


def _typed(spec: type, node: Any, where: str):
    """``spec`` from a plain mapping, nested specs first (their own checks name the field)."""
    if node is None:
        return None
    hints = typing.get_type_hints(spec)
    values = {}
    for f in dataclasses.fields(spec):
        if f.name not in node:
            continue
        v, tp = node[f.name], hints[f.name]
        if dataclasses.is_dataclass(tp) and isinstance(v, dict):
            v = _typed(tp, v, f"{where}.{f.name}")
        if isinstance(v, list):
            v = tuple(v)
        values[f.name] = v
    return spec(**values)


@dataclass(frozen=True)
class SimSetup:
    setup: Setup
    cluster: ClusterSpec
    sim: SimSpec
    terms: TransportTerms
    prefill: PrefillTerms
    terms_name: str


def build_sim(cfg: DictConfig) -> SimSetup:
    """The typed, checked setup; raises ConfigError (one line) before anything is simulated."""
    check_config(cfg, SimConfig)
    plain = OmegaConf.to_container(cfg, resolve=True)
    check_tree(ClusterSpec, plain.get("cluster") or {}, "cluster.")
    check_tree(SimSpec, plain.get("sim") or {}, "sim.")
    base = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k not in SIM_KEYS])
    if (cfg.sim.get("rate") is not None or cfg.sim.get("search")) and base.workload.get("arrival") != "trace":
        # a set rate makes the workload Poisson (``requests``): its checks (workload.burstiness) must see that
        base = base.copy()
        base.workload.arrival = "poisson"
    setup = build(base)
    plain = OmegaConf.to_container(cfg, resolve=True)
    cluster = _typed(ClusterSpec, plain.get("cluster") or {}, "cluster")
    sim = _typed(SimSpec, plain.get("sim") or {}, "sim")
    ctx_gpus, gen_gpus = setup.ctx.size, setup.gen.size
    cluster.check_links(ctx_gpus, gen_gpus)
    if sim.decode:
        check_decode_memory(setup, cluster)
    fitted = setup.cost.fitted
    if fitted is None:
        raise ConfigError("cost", setup.cost.profile, "holds no fitted terms; kvlab sim costs transfers with "
                          "calibrated ones: use cost=cpu_fit or cost=h200_ipc_fit, or write a profile with kvlab sim "
                          "calibrate RUN_DIRS...")
    name = sim.terms or setup.transport.name
    terms = fitted.terms(name, setup.cost.profile)
    return SimSetup(setup, cluster, sim, terms, fitted.prefill, name)


def compose_sim(overrides=()) -> DictConfig:
    from kvlab.config.schema import compose

    return compose(list(overrides), config_name="sim")


def requests(s: SimSetup) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(arrival, prompt, output) of the workload, arrival order; ``sim.rate`` sets a Poisson rate or rescales a
    trace to that mean rate."""
    w = s.setup.workload
    if s.sim.rate is not None:
        if w.arrival == "trace":
            rows = traces.read(w.trace)[:w.requests]
            span = rows[-1].arrival_s - rows[0].arrival_s
            require(span > 0, "sim.rate", s.sim.rate, f"the trace's first {len(rows)} requests arrive at one instant; "
                    "raise workload.requests or use workload.arrival=poisson")
            native = (len(rows) - 1) / span
            w = dataclasses.replace(w, time_scale=native / s.sim.rate)
        else:
            w = dataclasses.replace(w, arrival="poisson", rate=s.sim.rate)
    setup = dataclasses.replace(s.setup, workload=w) if w is not s.setup.workload else s.setup
    reqs = make_requests(setup)
    osl = [r.osl for r in reqs]
    if s.sim.decode and any(o is None for o in osl):
        raise ConfigError("workload.osl", None, "kvlab sim decodes every request: give workload.osl=<tokens>, or a "
                          "trace with output lengths (workload=mooncake)")
    return (np.array([r.arrival_s for r in reqs]), np.array([r.isl for r in reqs], dtype=float),
            np.array([o or 0 for o in osl], dtype=float))


@dataclass
class Result:
    outcome: Outcome
    summary: dict
    table_s: float  # wall seconds building the plan table


def table_for(s: SimSetup, isl: np.ndarray, osl: np.ndarray) -> plans.PlanTable:
    """The plan table of these prompts. With decode on, a request that no gen DP group can hold is refused from the
    largest prompt's plan, before any prompt is cut into chunks (a model of many heads takes seconds there)."""
    need = np.asarray(isl, dtype=float) + osl

    def check(per_token: float) -> None:
        check_decode_capacity(s.cluster, decode_rates(s.setup, s.cluster, per_token)[3], per_token, need)

    return plans.build(s.setup, isl, check if s.sim.decode else None)


def run(s: SimSetup, arrival=None, isl=None, osl=None, table: plans.PlanTable | None = None) -> Result:
    import time

    if arrival is None:
        arrival, isl, osl = requests(s)
    t0 = time.perf_counter()
    table = table or table_for(s, isl, osl)
    t_table = time.perf_counter() - t0
    o = simulate(s.setup, s.cluster, s.terms, s.prefill, table, arrival, isl, osl, decode=s.sim.decode)
    summary = report.summarize(o, s.sim.slo, s.sim.percentiles)
    summary.update(plan_table_s=t_table, terms=s.terms_name, strategy=s.setup.transfer.strategy.name,
                   transport=s.setup.transport.name, model=s.setup.model.name,
                   ctx_instances=s.cluster.ctx_instances, gen_instances=s.cluster.gen_instances,
                   ctx_gpus=s.cluster.ctx_instances * s.setup.ctx.size,
                   gen_gpus=s.cluster.gen_instances * s.setup.gen.size,
                   rate=s.sim.rate, slo={"ttft_ms": s.sim.slo.ttft_ms, "tpot_ms": s.sim.slo.tpot_ms},
                   kv_tokens_per_group=o.extra.get("kv_tokens_per_group"))
    return Result(o, summary, t_table)


def vary(s: SimSetup, **changes) -> SimSetup:
    """``s`` with ``cluster_<key>`` / ``sim_<key>`` fields changed (``vary(s, cluster_ctx_instances=2, sim_rate=5)``),
    checked again: what a sweep over instances and rates changes without composing the config again."""
    cluster, sim = {}, {}
    for key, v in changes.items():
        group, _, name = key.partition("_")
        require(group in SIM_KEYS, key, v, "vary takes cluster_<field> or sim_<field>")
        (cluster if group == "cluster" else sim)[name] = v
    out = dataclasses.replace(s, cluster=dataclasses.replace(s.cluster, **cluster),
                              sim=dataclasses.replace(s.sim, **sim))
    out.cluster.check_links(s.setup.ctx.size, s.setup.gen.size)
    return out


SEARCH_FACTOR = 4.0  # how far a bracket's end moves per step while the rate is not bracketed
SEARCH_MOVES = 6  # moves per end at most: 4**6, four thousand times the rate first tried


def _quantile_ms(values, q: float) -> float:
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    return float(np.quantile(v, q) * 1e3) if len(v) else float("nan")


def why_missed(s: SimSetup, summary: dict, outcome: Outcome) -> tuple[str, bool]:
    """Why ``s`` at its rate misses the SLOs, in one clause, and whether any lower rate could help: the prefill
    alone exceeding the TTFT SLO at the target's quantile (no rate meets it), else the quantiles of TTFT's parts."""
    q, slo = s.sim.target, s.sim.slo
    pq = f"p{q * 100:g}"
    met = summary.get("slo_attainment") or 0.0
    head = f"at {s.sim.rate:.3g} req/s {met:.0%} of requests met the SLOs (sim.target={q:g})"
    if slo.ttft_ms is not None:
        prefill = _quantile_ms(outcome.prefill, q)
        if prefill > slo.ttft_ms:
            return (f"the {pq} prefill alone ({prefill / 1e3:,.3g} s) exceeds the TTFT SLO ({slo.ttft_ms / 1e3:g} s) "
                    "at any rate; a faster prefill (ctx.tp, cluster) or a looser sim.slo.ttft_ms", False)
        parts = {name: _quantile_ms(getattr(outcome, name), q) for name in ("queue", "prefill", "exposed")}
        ttft = _quantile_ms(outcome.ttft, q)
        if ttft > slo.ttft_ms:
            said = ", ".join(f"{n} {v:,.0f} ms" for n, v in parts.items())
            return f"{head}: TTFT {pq} {ttft:,.0f} ms > {slo.ttft_ms:g} ms ({pq}s: {said})", True
    if slo.tpot_ms is not None:
        tpot = _quantile_ms(outcome.tpot, q)
        if tpot > slo.tpot_ms:
            return f"{head}: TPOT {pq} {tpot:,.1f} ms > {slo.tpot_ms:g} ms", True
    return head, True


def max_rate(s: SimSetup) -> dict:
    """The highest ``sim.rate`` at which ``sim.target`` of the requests meet the SLOs (attainment is taken to fall
    with the rate). The search brackets the rate first: from [``sim.search_lo``, ``sim.search_hi``], the low end
    moves down (x1/4) while it misses and the high end up (x4) while it still meets them, each at most
    ``SEARCH_MOVES`` times; then ``sim.search_steps`` bisections in log rate. The plan table is built once (prompts
    do not change with the rate).

    Returns ``max_rate`` (None when no rate met them), ``bound``: ``"="`` (bracketed: the rate found meets them and
    one above it does not), ``">="`` (the highest rate tried still meets them: the fleet's limit is beyond it) or
    None; ``why``: a line on what the answer cannot say (``why_missed`` at the lowest rate, when nothing met them);
    ``bracket`` (the last rate that met them and the first that did not) and ``tried`` (every rate with its
    attainment, in the order tried)."""
    at = lambda r: dataclasses.replace(s, sim=dataclasses.replace(s.sim, rate=r))  # noqa: E731
    a, i, o = requests(at(s.sim.search_lo))
    table = table_for(s, i, o)
    tried = []

    def probe(rate: float) -> tuple[bool, Result]:
        arr, isl, osl = requests(at(rate))
        r = run(at(rate), arr, isl, osl, table)
        att = r.summary["slo_attainment"]
        tried.append({"rate": rate, "slo_attainment": att})
        return att is not None and att >= s.sim.target, r

    def answer(rate, bound, bracket, why=None) -> dict:
        return {"max_rate": rate, "bound": bound, "why": why, "bracket": bracket, "tried": tried}

    lo, hi = s.sim.search_lo, s.sim.search_hi
    ok, r = probe(lo)
    moves, before = 0, None
    while not ok:  # the low end misses: move it down until one meets them, or say why none does
        why, lower_helps = why_missed(at(lo), r.summary, r.outcome)
        att = r.summary["slo_attainment"]
        if before is not None and att is not None and att <= before:
            # a quarter of the rate served no more requests: what misses does not shrink with the rate (requests
            # of a trace that arrive at one instant queue for the prefill at any rate)
            return answer(None, None, [None, lo], f"{why}; a quarter of the rate meets them no better (requests that "
                          "arrive together wait for each other at any rate)")
        if not lower_helps or moves == SEARCH_MOVES:  # a part that no rate shrinks, or nothing lower left
            return answer(None, None, [None, lo], why)
        before = att
        try:
            ok, r = probe(lo / SEARCH_FACTOR)
        except ConfigError as e:  # a trace stretched past what it can be (kvlab.config.workload's limits)
            return answer(None, None, [None, lo], f"{why}; a lower rate cannot be tried ({e.hint.split(';')[0]})")
        hi, lo, moves = lo, lo / SEARCH_FACTOR, moves + 1
    if moves == 0:  # the low end meets them: move the high end up until it misses
        up, r_hi = probe(hi)
        while up:
            n = len(r_hi.outcome.ttft)
            arrivals = r_hi.outcome.arrival
            burst = len(arrivals) < 2 or np.ptp(arrivals) < np.nanmedian(r_hi.outcome.prefill)
            if burst or moves == SEARCH_MOVES:  # a higher rate would bring the same burst of requests
                why = (f"the {n} requests arrive almost at once there (within a median prefill) and still meet them: "
                       "the fleet serves this burst; more requests (workload.requests) load it for longer"
                       if burst else "raise sim.search_hi")
                return answer(hi, ">=", [hi, None], f"{hi:.4g} req/s, the highest rate tried, meets the SLOs; {why}")
            lo, hi, moves = hi, hi * SEARCH_FACTOR, moves + 1
            up, r_hi = probe(hi)
    for _ in range(s.sim.search_steps):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if probe(mid)[0] else (lo, mid)
    return answer(lo, "=", [lo, hi])


__all__ = ["CONF_DIR", "SimConfig", "SimSetup", "build_sim", "compose_sim", "requests", "run", "max_rate"]
