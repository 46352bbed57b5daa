"""``kvlab sim calibrate RUN...``: fit the transfer and prefill terms (kvlab.core.sim_terms) to kvlab runs' records.

A RUN is a run directory (``config.yaml``, ``results.jsonl``) or a results file of the benchmarks
(``results/*.json``: entries with ``command``, ``summary`` and ``rows``), whole or one entry of it
(``FILE.json#name``). Each run is replayed by the simulator on its own machine (``conf/cluster/one_host``:
one ctx and one gen instance, its DP groups served as kvlab run serves them, its measured arrivals and
prompt lengths, no decode), so the fit is of the same code that simulates fleets. The replay knows one rule of kvlab
run's that a fleet does not have: its ranks serve chunks in one global order (kvlab.config.workload), so a request's
transfer may wait for the requests whose chunks come first in it (``order_wait`` says how much).

1. The prefill: ``prefill_s = scale * model_s + bytes * byte_ns + fixed_ms`` by non-negative least squares
   over every request's measured prefill, relative errors (the model: the run's own prefill group,
   ``prefill=gpu`` runs timed by ``prefill=sim``'s formula).
2. Per transport: ``prefill_slowdown``, the median of its runs' measured prefills over that model; then
   ``byte_ns``, ``staged_byte_ns``, ``piece_us``, ``rtt_us``, ``host_wait`` and ``order_wait``, started from a
   least-squares fit of each request's time in flight (``busy_s``) to its plan's pieces and bytes, and refined by
   coordinate search in log space on the error of a replay on the runs' measured prefills: the squared log
   ratio of predicted to measured exposed transfer and TTFT, p50 and p90, each plus 1 ms (what one run
   resolves: a 0.7 ms exposed time is not fitted as if it were exact), summed over the transport's runs.

3. Per transport, which terms the runs determine (``determination``): the rise of the fit's error when one term
   alone is doubled or halved. A term that moves it by less than ``DETERMINED`` is said not to be determined: the
   fitted value is then a solution, not a measurement.

The report gives each run's four figures measured and predicted, and their errors: exposed transfer from
the replay on the run's measured prefills (the transfer's own error), TTFT with every part modelled; the profile
(``cost/<name>.yaml``: the shipped ones in conf/, a user's in ``$XDG_CONFIG_HOME/kvlab``, where kvlab sim calibrate
writes them) keeps the base rates (``profile``) for anything without fitted terms.
"""
from __future__ import annotations

import dataclasses
import json
import math
import shlex
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from kvlab.core.errors import ConfigError
from kvlab.core.paths import write_whole
from kvlab.core.sim_terms import Fitted, PrefillTerms, TransportTerms
from kvlab.sim import plans
from kvlab.sim.cluster import ClusterSpec, LinkSpec, LinksSpec
from kvlab.sim.engine import prefill_model_s, simulate

FIGS = ("exposed_p50", "exposed_p90", "ttft_p50", "ttft_p90")
TERMS = ("byte_ns", "staged_byte_ns", "piece_us", "rtt_us", "host_wait", "order_wait")
FLOOR_S = 1e-3  # added to both sides of a ratio: a millisecond is about what one run resolves of an exposed time
GPU_ONLY = {"prefill": "sim", "device": None, "kernels": None}  # what this machine composes a GPU run's config with


@dataclass
class Replay:
    name: str
    setup: object
    arrival: np.ndarray
    isl: np.ndarray
    prefill_s: np.ndarray  # measured
    busy_s: np.ndarray
    measured: dict  # FIGS
    table: plans.PlanTable
    cluster: ClusterSpec
    model_s: np.ndarray
    after: list[np.ndarray]  # per request: those with chunks before its last one in the run's global order


def _setup_from_command(command: str, transport: str | None = None):
    """The setup of a benchmark's ``kvlab run ...`` command, as the summary says it ran (its transport where
    ``auto`` chose one on that machine)."""
    from kvlab.config.schema import build, compose

    overrides = [] if transport is None or "transport=" in command else [f"transport={transport}"]
    for a in shlex.split(command)[2:]:
        k, _, v = a.partition("=")
        if k in GPU_ONLY:
            if GPU_ONLY[k] is not None:
                overrides.append(f"{k}={GPU_ONLY[k]}")
            continue
        overrides.append(a)
    return build(compose(overrides + ["logger=quiet"]))


def _setup_from_dir(run_dir: Path):
    from omegaconf import OmegaConf

    from kvlab.config.schema import Config, build

    schema = OmegaConf.structured(Config)
    OmegaConf.set_struct(schema, False)
    cfg = OmegaConf.merge(schema, OmegaConf.load(run_dir / "config.yaml"))
    for k, v in GPU_ONLY.items():
        if k == "prefill" and cfg.prefill.kind == "gpu":
            cfg.prefill.kind = "sim"
        elif v is None and k in cfg:
            cfg[k] = "auto"
    return build(cfg)


def sources(paths: list[str]) -> list[tuple[str, object, list[dict]]]:
    """(name, setup, rows) of every run named."""
    out = []
    for p in paths:
        try:
            out += _source(p)
        except OSError as e:  # too long a name, no permission, a directory where a file was meant
            raise ConfigError("RUN_DIR", _short(p), f"cannot be read ({e.strerror or type(e).__name__}); give a kvlab "
                              "run directory or a results .json file") from None
        except ValueError as e:  # a corrupt results.jsonl or .json: named, not a bare decoder error
            raise ConfigError("RUN_DIR", _short(p), f"holds a file that is not valid JSON ({e}); give a finished "
                              "run's directory") from None
    return out


def _short(p: str) -> str:
    return p if len(p) <= 120 else f"{p[:60]}...({len(p)} characters)"


def _source(p: str) -> list[tuple[str, object, list[dict]]]:
    """(name, setup, rows) of the runs one argument names."""
    out = []
    path, _, only = p.partition("#")
    f = Path(path)
    if f.is_dir():
        res = f / "results.jsonl"
        if not res.exists() or not (f / "config.yaml").exists():
            raise ConfigError("RUN_DIR", _short(p),
                              "is no kvlab run directory (it needs config.yaml and results.jsonl)")
        rows = [json.loads(x) for x in res.read_text().splitlines() if x.strip()]
        out.append((f.name, lambda f=f: _setup_from_dir(f), rows))
    elif f.is_file() and f.suffix == ".json":
        entries = json.loads(f.read_text())
        entries = entries if isinstance(entries, list) else []
        picked = [e for e in entries if not only or e.get("name") in only.split(",")]
        if not picked:
            raise ConfigError("RUN_DIR", _short(p), "holds no entries with command, summary and rows"
                              + (f" named {only}" if only else ""))
        for e in picked:
            ran = (e.get("summary") or {}).get("transport")
            out.append((f"{f.stem}#{e.get('name')}", lambda e=e, ran=ran: _setup_from_command(e["command"], ran),
                        e.get("rows") or []))
    else:
        raise ConfigError("RUN_DIR", _short(p), "no such run directory or results .json file")
    return out




def _p(x, q):
    x = np.asarray(x, dtype=float)
    x = x[np.isfinite(x)]
    return float(np.percentile(x, q)) if len(x) else float("nan")


def replay_of(name: str, make_setup, rows: list[dict]) -> Replay:
    ok = [r for r in rows if r.get("verified") and (r.get("bytes") or 0) > 0 and r.get("ttft_s") is not None]
    if not ok:
        raise ConfigError("RUN_DIR", name, "holds no transfers (no verified request with bytes moved and a TTFT in "
                          "its results); give a finished kvlab run's directory")
    setup = make_setup()
    ok.sort(key=lambda r: r["request"])
    arrival = np.array([r["arrival_s"] for r in ok])
    isl = np.array([r["isl"] for r in ok], dtype=float)
    exposed, ttft = [r["exposed_s"] for r in ok], [r["ttft_s"] for r in ok]
    measured = {"exposed_p50": _p(exposed, 50), "exposed_p90": _p(exposed, 90), "ttft_p50": _p(ttft, 50),
                "ttft_p90": _p(ttft, 90)}
    p = setup.prefill
    from kvlab.core.paths import CONF_DIR
    from kvlab.sim.run import _typed

    cluster = _typed(ClusterSpec, yaml.safe_load((CONF_DIR / "cluster" / "one_host.yaml").read_text()), "cluster")
    cluster = dataclasses.replace(cluster, gpu=dataclasses.replace(cluster.gpu, tflops=p.tflops, mfu=p.mfu),
                                  links=LinksSpec(LinkSpec(1e9, 0.0), LinkSpec(0.0, 0.0)))
    table = plans.build(setup, isl)
    model_s, _ = prefill_model_s(setup, isl, p.tflops, p.mfu)
    return Replay(name, setup, arrival - arrival.min(), isl, np.array([r.get("prefill_s") or np.nan for r in ok]),
                  np.array([r.get("busy_s") or np.nan for r in ok]), measured, table, cluster, model_s,
                  _order_waits(setup, [r["request"] for r in ok]))


def _order_waits(setup, ids: list[int]) -> list[np.ndarray]:
    """For each request (``ids``, the rows replayed): the rows whose chunks come before its last chunk in the global
    order the run's ranks served (kvlab.config.workload.plan_run); [] where the run's own requests cannot be rebuilt."""
    from kvlab.config.workload import plan_run

    index = {rid: k for k, rid in enumerate(ids)}
    try:
        order = plan_run(setup).order
    except Exception:  # noqa: BLE001 - a run whose workload no longer builds: no order to follow
        return [np.zeros(0, dtype=np.int64) for _ in ids]
    last = {}
    for pos, c in enumerate(order):
        last[c.request] = pos
    out = []
    for rid in ids:
        before = {order[q].request for q in range(last.get(rid, -1))} - {rid}
        out.append(np.array(sorted(index[b] for b in before if b in index), dtype=np.int64))
    return out


def _replay(r: Replay, terms: TransportTerms, pre: PrefillTerms, measured_prefill: bool):
    return simulate(r.setup, r.cluster, terms, pre, r.table, r.arrival, r.isl, np.zeros(len(r.isl)), decode=False,
                    links=[[True]], prefill_s=r.prefill_s if measured_prefill else None, after=r.after)


def predict(r: Replay, terms: TransportTerms, pre: PrefillTerms) -> dict:
    """The exposed transfer replayed on the run's measured prefills (the transfer's own error); TTFT with every
    part modelled, the prefill by its calibrated terms."""
    o = _replay(r, terms, pre, True)
    full = _replay(r, terms, pre, False)
    return {"exposed_p50": _p(o.exposed, 50), "exposed_p90": _p(o.exposed, 90), "ttft_p50": _p(full.ttft, 50),
            "ttft_p90": _p(full.ttft, 90)}


def _fit_error(r: Replay, terms: TransportTerms, pre: PrefillTerms) -> float:
    o = _replay(r, terms, pre, True)
    p = {"exposed_p50": _p(o.exposed, 50), "exposed_p90": _p(o.exposed, 90), "ttft_p50": _p(o.ttft, 50),
         "ttft_p90": _p(o.ttft, 90)}
    return sum(math.log((p[k] + FLOOR_S) / (r.measured[k] + FLOOR_S)) ** 2 for k in FIGS)


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: drop the most negative column and refit until none is."""
    keep = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while keep:
        sol, *_ = np.linalg.lstsq(a[:, keep], b, rcond=None)
        if (sol >= 0).all():
            x[keep] = sol
            break
        keep.pop(int(np.argmin(sol)))
    return x


def fit_prefill(replays: list[Replay]) -> PrefillTerms:
    """The prefill model's terms over every run (each transport's slowdown apart: ``fit_slowdown``)."""
    rows, target = [], []
    for r in replays:
        nbytes = r.table.bytes.sum(axis=1)
        for m, b, y in zip(r.model_s, nbytes, r.prefill_s):
            if np.isfinite(y) and y > 0:
                rows.append([m / y, b * 1e-9 / y, 1e-3 / y])  # relative error: each row over its measurement
                target.append(1.0)
    if not rows:
        return PrefillTerms()
    x = _nnls(np.array(rows), np.array(target))
    return PrefillTerms(scale=float(x[0]), byte_ns=float(x[1]), fixed_ms=float(x[2]))


def fit_slowdown(replays: list[Replay], pre: PrefillTerms) -> float:
    """The median of the transport's runs' measured prefills over the prefill model's."""
    ratios = []
    for r in replays:
        model = pre.scale * r.model_s + r.table.bytes.sum(axis=1) * pre.byte_ns * 1e-9 + pre.fixed_ms * 1e-3
        ok = np.isfinite(r.prefill_s) & (model > 0)
        ratios += list(r.prefill_s[ok] / model[ok])
    return float(np.median(ratios)) if ratios else 1.0


def error(replays: list[Replay], terms: TransportTerms, pre: PrefillTerms) -> float:
    """What the transfer terms are fitted to: the replay on the runs' measured prefills, every figure of FIGS."""
    return sum(_fit_error(r, terms, pre) for r in replays)


def fit_transport(replays: list[Replay], pre: PrefillTerms) -> tuple[TransportTerms, float]:
    # start: each request's time in flight against its plan's pieces, bytes and staged bytes
    a, b = [], []
    for r in replays:
        for i in range(len(r.isl)):
            if np.isfinite(r.busy_s[i]) and r.busy_s[i] > 0:
                a.append([r.table.pieces[i].sum() * 1e-6, r.table.bytes[i].sum() * 1e-9,
                          r.table.staged[i].sum() * 1e-9])
                b.append(r.busy_s[i])
    x = _nnls(np.array(a), np.array(b)) if a else np.zeros(3)
    best_all = None
    slowdown = fit_slowdown(replays, pre)
    b0, s0, p0, r0 = max(x[1], 1e-4), x[2], max(x[0], 1.0), 50.0
    for wait in (0.0, 1.0):
        for order in (0.0, 1.0):
            t = TransportTerms(byte_ns=float(b0), staged_byte_ns=float(s0), piece_us=float(p0), rtt_us=float(r0),
                               host_wait=wait, order_wait=order, prefill_slowdown=slowdown)
            t, e = _search(replays, t, pre)
            if best_all is None or e < best_all[1]:
                best_all = (t, e)
    return best_all


FLOOR = {"byte_ns": 1e-4, "staged_byte_ns": 1e-3, "piece_us": 1.0, "rtt_us": 10.0, "host_wait": 0.1,
         "order_wait": 0.1}  # where the search takes a term at zero up from
SHARES = ("host_wait", "order_wait")  # at most 1
DETERMINED = 0.01  # the least rise of the fit's error that says the runs pin a term down: a figure moved by 10%


def determination(replays: list[Replay], terms: TransportTerms, pre: PrefillTerms) -> dict[str, float]:
    """Per term of TERMS, how much the fit's error rises when that term alone is doubled or halved, the smaller of
    the two (a term at zero: set to where the search starts it, ``FLOOR``; a share at most 1). Below ``DETERMINED``
    the runs do not pin the term down: other values fit them as well, so the fitted one is no measurement of that
    cost (runs whose requests all have the same pieces cannot tell a per-piece cost from a per-request one)."""
    base = error(replays, terms, pre)
    out = {}
    for k in TERMS:
        cur = getattr(terms, k)
        tries = [FLOOR[k]] if cur == 0 else [cur * 2, cur / 2]
        tries = [min(v, 1.0) if k in SHARES else v for v in tries]
        rises = [error(replays, dataclasses.replace(terms, **{k: float(v)}), pre) - base for v in tries if v != cur]
        out[k] = max(0.0, min(rises)) if rises else 0.0
    return out


def undetermined(rises: dict[str, float]) -> list[str]:
    return [k for k in TERMS if rises[k] < DETERMINED]


def _search(replays: list[Replay], t: TransportTerms, pre: PrefillTerms) -> tuple[TransportTerms, float]:
    """Coordinate search in log space: each term times a factor while the error falls; a term at zero is tried
    last (a zero cannot grow back by factors)."""
    best = error(replays, t, pre)
    for factors in ((4.0, 0.25, 2.0, 0.5, 1.25, 0.8), (0.0,), (1.25, 0.8, 1.1, 0.9)):
        for _ in range(8):
            improved = False
            for k in TERMS:
                for f in factors:
                    cur = getattr(t, k)
                    v = (cur or FLOOR[k]) * f if f else 0.0
                    if k in SHARES:
                        v = min(v, 1.0)
                    if v == cur:
                        continue
                    cand = dataclasses.replace(t, **{k: float(v)})
                    e = error(replays, cand, pre)
                    if e < best - 1e-9:
                        t, best, improved = cand, e, True
            if not improved:
                break
    return t, best


def calibrate(paths: list[str]) -> tuple[Fitted, list[dict], dict[str, dict[str, float]]]:
    """(the fitted terms, each run's figures measured and predicted, each transport's ``determination``)."""
    replays = [replay_of(n, s, rows) for n, s, rows in sources(paths)]
    pre = fit_prefill(replays)
    by_transport: dict[str, list[Replay]] = {}
    for r in replays:
        by_transport.setdefault(r.setup.transport.name, []).append(r)
    terms = {name: fit_transport(rs, pre)[0] for name, rs in sorted(by_transport.items())}
    rises = {name: determination(rs, terms[name], pre) for name, rs in sorted(by_transport.items())}
    report = []
    for r in replays:
        p = predict(r, terms[r.setup.transport.name], pre)
        row = {"run": r.name, "transport": r.setup.transport.name, "strategy": r.setup.transfer.strategy.name,
               "requests": len(r.isl)}
        for k in FIGS:
            row[f"{k}_measured_ms"] = r.measured[k] * 1e3
            row[f"{k}_predicted_ms"] = p[k] * 1e3
            row[f"{k}_error"] = p[k] / r.measured[k] - 1 if r.measured[k] > 0 else None
        report.append(row)
    names = ", ".join(r.name for r in replays)
    return Fitted(terms, pre, f"kvlab sim calibrate: {names}"), report, rises


def determination_line(name: str, rises: dict[str, float]) -> str:
    """One transport's ``determination``, as the command prints it and the profile keeps it."""
    cells = ", ".join(f"{k} +{rises[k]:.3g}" for k in TERMS)
    loose = undetermined(rises)
    says = (f"not determined by these runs: {', '.join(loose)}" if loose else "every term determined by these runs")
    return (f"{name}: {says} (the fit's error, doubling or halving one term alone, rises by: {cells}; "
            f"determined: {DETERMINED:g} or more)")


def table_lines(report: list[dict]) -> list[str]:
    head = f"{'run':<44}{'transport':>10}{'strategy':>11}" + "".join(f"{k:>22}" for k in FIGS)
    out = [head, " " * 65 + "".join(f"{'meas / pred ms (err)':>22}" for _ in FIGS)]
    for r in report:
        cells = []
        for k in FIGS:
            e = r[f"{k}_error"]
            err = "" if e is None else f"{e:+.0%}"
            cells.append(f"{r[f'{k}_measured_ms']:.1f}/{r[f'{k}_predicted_ms']:.1f} ({err})")
        out.append(f"{r['run']:<44}{r['transport']:>10}{r['strategy']:>11}" + "".join(f"{c:>22}" for c in cells))
    errs = [abs(r[f"{k}_error"]) for r in report for k in FIGS if r[f"{k}_error"] is not None]
    if errs:
        out.append(f"|error| over {len(errs)} figures: median {np.median(errs):.0%}, max {max(errs):.0%}; "
                   f"within 15%: {sum(e <= 0.15 for e in errs)}/{len(errs)}")
    return out


def write_profile(path: Path, fitted: Fitted, base: str, report: list[dict],
                  rises: dict[str, dict[str, float]] | None = None) -> None:
    lines = [f"# fitted by {fitted.source}",
             "# replay errors (predicted / measured - 1), exposed p50 p90, TTFT p50 p90:"]
    for r in report:
        errs = " ".join("n/a" if r[f"{k}_error"] is None else f"{r[f'{k}_error']:+.0%}" for k in FIGS)
        lines.append(f"#   {r['run']}: {errs}")
    for name, r in sorted((rises or {}).items()):
        lines.append(f"# {determination_line(name, r)}")
    body = {"profile": base, "fitted": fitted.to_dict()}
    write_whole(path, "\n".join(lines) + "\n" + yaml.safe_dump(body, sort_keys=False), "--out")
