"""Fit the ``cpu`` cost profile (kvlab.core.rates.PROFILES["cpu"]) to the current code on this machine.

Every ``kvlab run`` prints the cost model's predicted run time against its measured makespan (kvlab.results.metrics
.prediction_line), so a profile that no longer describes the code shows at once. This script measures a few CPU
runs that pull the model's terms apart (the default run; layer-wise; longer prompts, larger chunks; many short
requests; one rank each side; zero-copy), each ``--repeat`` times, and fits the profile's rates to their makespans:
the fixed cost of a message (``alpha_us``), the link's rate (both of its points scaled together), the copies'
rate (``copy_gbps``), the host's time per copy (``host_us``) and the prefill's cache writes (``fill_gbps``),
minimising the squared log of predicted/measured over every run (coordinate descent over factors from the
current profile, each rate within what such a machine can do: ``BOUNDS``). Each case's predicted/measured is
reported before and after, with the machine's load average.

    python scripts/cpu_profile.py --repeat 3 --out results/cpu_profile.json

Measure on a quiet machine (``uptime`` well under 1): the fitted rates are this machine's and this load's.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvlab.config.schema import build, compose  # noqa: E402
from kvlab.config.workload import plan_run  # noqa: E402
from kvlab.core.rates import PROFILES, CostRates  # noqa: E402
from kvlab.sizing.cost import predict  # noqa: E402

CASES = {
    "default": [],
    "layerwise": ["transfer=layerwise"],
    "16k x 2": ["workload.isl=16384", "workload.requests=2"],
    "1k x 8": ["workload.isl=1024", "workload.requests=8"],
    "tp1 -> tp1": ["parallel=same"],
    "zerocopy": ["transfer=zerocopy"],
    "llama3_8b 2k x 2": ["model=llama3_8b", "workload.isl=2048", "workload.requests=2"],
}
FIT = ("alpha_us", "link_scale", "copy_gbps", "host_us", "fill_gbps")
# what a 2-core machine's gloo, copies and host can be: a term the runs cannot pin (the link, where copies and
# prefill writes dominate) stays within what the machine physically does instead of running off to 0 or infinity
BOUNDS = {"alpha_us": (20.0, 3000.0), "link_scale": (0.25, 4.0), "copy_gbps": (0.02, 50.0), "host_us": (1.0, 20000.0),
          "fill_gbps": (0.02, 50.0)}
FACTORS = (0.5, 0.7, 0.85, 0.95, 1.05, 1.2, 1.4, 2.0)


def load() -> float:
    return os.getloadavg()[0]


def measure(name: str, overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        before = load()
        p = subprocess.run([sys.executable, "-m", "kvlab", "run", f"hydra.run.dir={tmp}", "logger=quiet",
                            "cost=cpu", *overrides], capture_output=True, text=True, cwd=ROOT, timeout=600)
        summary = Path(tmp) / "summary.json"
        if p.returncode or not summary.exists():
            raise SystemExit(f"{name}: kvlab run failed (exit {p.returncode}):\n{(p.stderr or p.stdout)[-2000:]}")
        s = json.loads(summary.read_text())
    return {"makespan_s": s["makespan_s"], "predicted_s": s["predicted_s"], "verified": s["verified"],
            "load_before": before, "load_after": load()}


def rates_of(base: CostRates, x: dict) -> CostRates:
    return replace(base, alpha_us=x["alpha_us"], link_gbps=tuple(g * x["link_scale"] for g in base.link_gbps),
                   copy_gbps=x["copy_gbps"], host_us=x["host_us"], fill_gbps=x["fill_gbps"])


def fit(cases: dict, base: CostRates, rounds: int = 40) -> tuple[dict, float]:
    setups = {name: (lambda s: (s, plan_run(s).requests))(build(compose(["logger=quiet", "cost=cpu", *ovs])))
              for name, ovs in CASES.items() if name in cases}

    def loss(x: dict) -> float:
        try:
            r = rates_of(base, x)
        except ValueError:  # rates the profile refuses (a link faster than alpha allows)
            return math.inf
        total = 0.0
        for name, (setup, reqs) in setups.items():
            p = predict(setup, reqs, rates=r, with_prefill=True).seconds
            total += sum(math.log(p / m["makespan_s"]) ** 2 for m in cases[name])
        return total

    x = {"alpha_us": base.alpha_us, "link_scale": 1.0, "copy_gbps": base.copy_gbps, "host_us": max(base.host_us, 1.0),
         "fill_gbps": base.fill_gbps or 0.5}
    best = loss(x)
    for _ in range(rounds):
        moved = False
        for k in FIT:
            for f in FACTORS:
                lo, hi = BOUNDS[k]
                y = dict(x, **{k: min(hi, max(lo, x[k] * f))})
                v = loss(y)
                if v < best - 1e-9:
                    x, best, moved = y, v, True
        if not moved:
            break
    return x, best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    base = PROFILES["cpu"]
    cases = {name: [measure(name, ovs) for _ in range(args.repeat)] for name, ovs in CASES.items()}
    for name, runs in cases.items():
        print(f"{name}: makespan {[round(r['makespan_s'] * 1e3, 1) for r in runs]} ms, "
              f"load {runs[0]['load_before']:.2f}")
    x, loss = fit(cases, base)
    fitted = rates_of(base, x)
    report = []
    for name, ovs in CASES.items():
        setup = build(compose(["logger=quiet", "cost=cpu", *ovs]))
        reqs = plan_run(setup).requests
        after = predict(setup, reqs, rates=fitted, with_prefill=True).seconds
        before = predict(setup, reqs, rates=base, with_prefill=True).seconds
        ms = sorted(r["makespan_s"] for r in cases[name])
        report.append({"case": name, "overrides": ovs, "measured_s": [r["makespan_s"] for r in cases[name]],
                       "measured_median_s": ms[len(ms) // 2], "predicted_before_s": before,
                       "predicted_after_s": after, "ratio_before": before / ms[len(ms) // 2],
                       "ratio_after": after / ms[len(ms) // 2],
                       "load": [r["load_before"] for r in cases[name]]})
        print(f"{name:>18}: predicted/measured {before / ms[len(ms) // 2]:.2f} -> {after / ms[len(ms) // 2]:.2f}")
    out = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
           "command": "python scripts/cpu_profile.py " + " ".join(sys.argv[1:]), "repeat": args.repeat,
           "before": asdict(base), "fitted": asdict(fitted), "fit": x, "loss": loss, "cases": report}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    keep = {k: getattr(fitted, k) for k in ("alpha_us", "link_mib", "link_gbps", "copy_gbps", "host_us", "fill_gbps")}
    print("fitted:", ", ".join(f"{k}={v!r}" if not isinstance(v, float) else f"{k}={v:.4g}" for k, v in keep.items()))


if __name__ == "__main__":
    main()
