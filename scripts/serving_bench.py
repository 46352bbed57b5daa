"""The serving timeline on one GPU: what moving the cache costs a request under load, as measured.

Cases (every one a real ``kvlab run``, its figures read back from ``summary.json`` and
``results.jsonl``):

- ``default``: the newcomer's ``kvlab run`` (the transport the machine allows: ipc on one GPU);
- ``mooncake-{layerwise,chunked}``: Llama-3.1-8B, ctx TP1 -> gen TP1 on one GPU, ``transport=ipc
  prefill=gpu workload=mooncake``, 16 requests of up to 32k tokens, 4 at a time, the trace's
  arrivals at half speed; per-request GB/s over the request's own in-flight time and exposed
  transfer p50/p90/p99; run again under a CUDA MPS daemon (``scripts/gpu_check.sh`` starts one:
  every process that sees ``CUDA_MPS_PIPE_DIRECTORY`` is its client), the same with the GPU's
  time-slicing between the ctx and gen processes taken out;
- ``--cpu``: the default run against the same with a near-zero prefill and with Poisson arrivals
  at 5/s (``link_ratio`` is the link's share, not the arrival process's), and Poisson at 40/s
  with 40 ms prefills (``prefill.layer_ms=10``, 4 layers): the measured prefill of every request;
- ``ipc-{gemma,llama}``: ``transport=ipc`` at its default cut, Gemma-3-27B ctx TP2 -> gen TP1
  layer_major tpb 64 and Llama-3.1-8B TP1 -> TP2, 32k tokens: delivered GB/s over busy time
  against the in-run ``copy_`` reference of the same bytes (``link_ratio``).

    python scripts/serving_bench.py --out serving.json [--only NAME ...] [--tag mps] [--root DIR]

``--root DIR`` runs the kvlab of another checkout (an earlier version, for before/after figures
measured on the same machine in the same invocation).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MOONCAKE = ["model=llama3_8b", "ctx.tp=1", "gen.tp=1", "transport=ipc", "prefill=gpu", "workload=mooncake",
            "workload.requests=16", "workload.concurrency=4", "workload.isl_max=32768", "workload.time_scale=0.5"]
CPU_CASES = {  # the same questions on a CPU machine (gloo, p2p): is link_ratio a property of the link?
    "cpu-default": [],
    "cpu-default-no-prefill": ["prefill.layer_ms=0.001"],
    "cpu-poisson-5": ["workload.arrival=poisson", "workload.rate=5", "workload.requests=12"],
    "cpu-poisson-40": ["model=tiny_gqa", "workload.arrival=poisson", "workload.rate=40", "workload.requests=12",
                       "prefill.layer_ms=10"],
}
CASES = {
    "default": [],
    "mooncake-layerwise": [*MOONCAKE, "transfer=layerwise"],
    "mooncake-chunked": [*MOONCAKE, "transfer=chunked"],
    "ipc-gemma": ["model=gemma3_27b", "ctx.tp=2", "gen.tp=1", "gen.layout=layer_major", "gen.tokens_per_block=64",
                  "transport=ipc", "workload.isl=32768", "workload.requests=4"],
    "ipc-llama": ["model=llama3_8b", "ctx.tp=1", "gen.tp=2", "transport=ipc", "workload.isl=32768",
                  "workload.requests=4"],
}


def run(name: str, overrides: list[str], root: Path = ROOT, timeout: float = 480) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"kvlab-{name}-"))
    cmd = [sys.executable, "-m", "kvlab", "run", f"hydra.run.dir={out}", "logger=quiet", *overrides]
    t0 = time.time()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    try:
        p = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        p = subprocess.CompletedProcess(cmd, -1, str(e.stdout or ""), f"{e}")
    wall = time.time() - t0
    summary_file = out / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else None
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()] \
        if (out / "results.jsonl").exists() else []
    tail = (p.stdout + p.stderr).strip().splitlines()[-12:]
    return {"name": name, "command": "kvlab run " + " ".join(overrides), "rc": p.returncode, "wall_s": wall,
            "summary": summary, "rows": rows, "output_tail": tail}


def prefill_ms(r: dict) -> list[float]:
    return [x["prefill_s"] * 1e3 for x in r["rows"] if x.get("prefill_s") is not None]


def brief(r: dict) -> str:
    s = r["summary"] or {}
    serving = s.get("serving") or {}
    exp = serving.get("exposed_s") or {}
    gbps = [x.get("gbps") for x in r["rows"] if x.get("gbps")]
    parts = [f"{r['name']:<22} rc {r['rc']} verified {s.get('verified')}",
             f"GB/s {s.get('gbps') or 0:,.1f} link {s.get('link_gbps') or 0:,.1f} ratio {s.get('link_ratio') or 0:.3f}"]
    if gbps:
        parts.append(f"per-request GB/s {min(gbps):,.1f}-{max(gbps):,.1f}")
    pre = prefill_ms(r)
    if pre:
        parts.append(f"prefill ms {min(pre):,.1f}-{max(pre):,.1f}")
    if exp:
        parts.append("exposed ms p50/p90/p99 " + " / ".join(f"{exp[q] * 1e3:,.1f}" for q in ("p50", "p90", "p99")))
    return "; ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tag", default="", help="appended to every case's name (e.g. mps)")
    ap.add_argument("--root", type=Path, default=ROOT, help="the kvlab checkout to run (default: this one)")
    ap.add_argument("--only", nargs="*", help="case names (default: all of the set)")
    ap.add_argument("--cpu", action="store_true", help="the CPU cases instead of the GPU ones")
    args = ap.parse_args()
    results = []
    for name, over in (CPU_CASES if args.cpu else CASES).items():
        if args.only and name not in args.only:
            continue
        results.append(run(f"{name}-{args.tag}" if args.tag else name, over, args.root.resolve()))
        print(brief(results[-1]), flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1))  # after every case: a cut-off call keeps the rest


if __name__ == "__main__":
    main()
