"""The CPU benchmark: kvlab's delivered GB/s next to the link's own, measured in the same run.

Each case is one ``kvlab run`` (ctx TP2 -> gen TP1 over gloo, one request, verified) that
measures, after warm-up, raw gloo messages of its own chunk size between its own ranks
(``link_gbps``, kvlab.rank.linkrate) before it transfers. Recorded per case: delivered GB/s,
raw gloo GB/s, their ratio, the wall time of the whole command (start-up, fill and
verification included), each rank's peak resident memory against its cache + staging, how
busy the cores were during the transfer (``/proc/stat``), and once, the Llama case's copies
alone (pack, unpack and ``copy_`` of its chunks in one process). The machine's load average
is recorded before and after each case: on a shared machine a figure is only worth as much
as the quiet it was measured in.

How to measure (the CPU results page, docs/results/cpu.md, comes from the JSON this writes):
  1. nothing else running on the machine: `uptime` shows a load average well under 1;
  2. python scripts/cpu_bench.py --repeat 3 --out results/cpu_bench.json
     (each run is one `kvlab run` of 15-20 s on this 2-core machine at load 3);
  3. python scripts/cpu_bench.py --table results/cpu_bench.json
     prints that page's table rows (each run with its load average) from that JSON.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20

CASES = {
    "llama3_8b 16k chunked 4x16MiB": ["model=llama3_8b", "workload.isl=16384", "workload.requests=1",
                                      "transfer=chunked", "transfer.slot_mib=16", "transfer.slots=4"],
    # the same Llama run sending straight from the ctx pool where a chunk lies there in wire order: one copy
    # per byte fewer than the staged path (whose ceiling on a CPU-bound link is 2 copies / 4 = 0.5)
    "llama3_8b 16k zerocopy 4x16MiB": ["model=llama3_8b", "workload.isl=16384", "workload.requests=1",
                                       "transfer=zerocopy", "transfer.slot_mib=16", "transfer.slots=4"],
    "deepseek_v32 16k chunked 4x16MiB": ["model=deepseek_v32", "workload.isl=16384", "workload.requests=1",
                                         "transfer=chunked", "transfer.slot_mib=16", "transfer.slots=4"],
}
TARGETS = {"link_ratio": 0.5, "llama_wall_s": 30.0, "rss_over_cache_staging": 2.0}


def request_window(run_dir: Path) -> tuple[float, float]:
    """(start, end) wall times of the run's transfer: its first request's start to its last one's end."""
    rows = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines() if line.strip()]
    return min(r["start"] for r in rows), max(r["end"] for r in rows)


class CpuTimes:
    """The machine's CPU time split (``/proc/stat``: user, system, idle, ...) sampled every 20 ms in a thread,
    to say how busy the cores were during a window of wall time (the transfer's)."""

    def __init__(self):
        self.samples: list[tuple[float, list[int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            with open("/proc/stat") as f:
                self.samples.append((time.time(), [int(x) for x in f.readline().split()[1:]]))
            self._stop.wait(0.02)

    def __enter__(self):
        if os.path.exists("/proc/stat"):
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()

    def shares(self, start: float, end: float) -> dict | None:
        """Shares of user, system (with interrupts) and idle (with I/O wait) time between two wall times."""
        inside = [x for x in self.samples if start <= x[0] <= end]
        if len(inside) < 2:
            return None
        d = [b - a for a, b in zip(inside[0][1], inside[-1][1])]
        total = sum(d[:8]) or 1  # user nice system idle iowait irq softirq steal
        return {"user": (d[0] + d[1]) / total, "system": (d[2] + d[5] + d[6]) / total,
                "idle": (d[3] + d[4]) / total, "seconds": inside[-1][0] - inside[0][0]}


def run_case(name: str, overrides: list[str], work: Path) -> dict:
    run_dir = work / name.replace(" ", "_")
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    with CpuTimes() as cpu:
        p = subprocess.run([sys.executable, "-m", "kvlab", "run", f"hydra.run.dir={run_dir}", "logger=quiet",
                            *overrides], capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{name}: kvlab run failed ({p.returncode}):\n{p.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    ranks = []
    for f in sorted((run_dir / "parts").glob("rank*.json")):
        part = json.loads(f.read_text())
        peak = part["peak"]
        ranks.append({"rank": part["rank"], "side": part["side"], "max_rss_bytes": peak["max_rss"],
                      "cache_bytes": peak["cache"], "staging_bytes": peak["staging"],
                      "rss_over_cache_staging": peak["max_rss"] / (peak["cache"] + peak["staging"])})
    return {
        "case": name, "overrides": overrides, "verified": summary["verified"],
        "bytes": summary["total_bytes"], "gbps": summary["gbps"], "link_gbps": summary["link_gbps"],
        "link_ratio": summary["link_ratio"], "link": summary["link"], "busy_s": summary["busy_s"],
        "makespan_s": summary["makespan_s"],
        "wall_s": wall, "fill_s": summary["fill_s"], "verify_s": summary["verify_s"],
        "in_loop_requests": summary["in_loop_requests"], "ranks": ranks,
        # how busy the 2 cores were while the request moved: a transfer that leaves them idle is waiting
        "cpu_during_transfer": cpu.shares(*request_window(run_dir)),
        "max_rss_over_cache_staging": max(r["rss_over_cache_staging"] for r in ranks),
        "loadavg_before": load0, "loadavg_after": os.getloadavg(),
    }


def copy_rates(case: str = "llama3_8b 16k chunked 4x16MiB", passes: int = 3) -> dict:
    """One case's own copies alone, in this process: pack of each of its ctx0 -> gen0 chunks into its
    rotating slots, unpack of them into the gen pool, and ``copy_`` of the same sizes from the same pool;
    GB/s, median of ``passes`` over the request's chunks. What a staged transfer adds to the link per byte."""
    sys.path.insert(0, str(ROOT))
    from kvlab.config.schema import build, compose
    from kvlab.config.workload import plan_run
    from kvlab.memory.ops import cpu
    from kvlab.model.state import CacheState

    torch.set_num_threads(1)  # as every rank runs (kvlab.cli.launch: OMP_NUM_THREADS=1)
    setup = build(compose(CASES[case]))
    order = plan_run(setup).order
    chunks = [c for c in order if c.src == 0 and c.dst == 0]
    t = setup.transfer
    sides = []
    for spec in (setup.ctx, setup.gen):
        pool = CacheState(setup.model, spec, 0).pool(chunks[0].rect.pool)
        nb = -(-setup.workload.isl // pool.tokens_per_block)
        sides.append((pool, nb, torch.arange(nb)))
    (sp, snb, sids), (dp, dnb, dids) = sides
    src = torch.full((sp.pool_bytes(snb),), 7, dtype=torch.uint8)  # written: no page faults inside the timing
    dst = torch.zeros(dp.pool_bytes(dnb), dtype=torch.uint8)
    slots = torch.zeros(t.slots, t.slot_bytes, dtype=torch.uint8)

    def rate(step) -> float:
        t0 = time.perf_counter()
        for i, c in enumerate(chunks):
            step(i, c, slots[i % t.slots, :c.nbytes])
        return sum(c.nbytes for c in chunks) / (time.perf_counter() - t0) / 1e9

    def plain(i, c, slot):
        at = i * c.nbytes % (src.numel() - c.nbytes)
        slot.copy_(src[at:at + c.nbytes])

    out = {}
    for name, step in (("pack", lambda i, c, slot: cpu.pack(src, sp, snb, c.rect, sids, 0, slot)),
                       ("unpack", lambda i, c, slot: cpu.unpack(slot, dp, dnb, c.rect, dids, 0, dst)),
                       ("copy", plain)):
        got = sorted(rate(step) for _ in range(passes))
        out[f"{name}_gbps"] = got[len(got) // 2]
    out.update(case=case, chunk_mib=t.slot_bytes / MiB, chunks=len(chunks))
    return out


def busy(shares: dict | None) -> str:
    if not shares:
        return ""
    return f"{1 - shares['idle']:.0%} ({shares['user']:.0%} / {shares['system']:.0%})"


def table(path: Path) -> str:
    """The results page's rows for the runs of a JSON this script wrote."""
    runs = json.loads(path.read_text())["runs"]
    lines = ["| case | GiB | GB/s | raw gloo GB/s | link_ratio | CPU busy in the transfer (user / system) | wall s "
             "| peak RSS / (cache + staging), worst rank |",
             "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for r in runs:
        name = r["case"].replace(" chunked", "").replace(" 4x16MiB", "")
        lines.append(f"| {name} (load {r['loadavg_before'][0]:.1f}) | {r['bytes'] / 2**30:.2f} | {r['gbps']:.2f} | "
                     f"{r['link_gbps']:.2f} | {r['link_ratio']:.3f} | {busy(r.get('cpu_during_transfer'))} | "
                     f"{r['wall_s']:.1f} | "
                     f"{r['max_rss_over_cache_staging']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "cpu_bench.json", help="the JSON to write")
    ap.add_argument("--repeat", type=int, default=1, help="runs per case; the JSON keeps them all")
    ap.add_argument("--note", default="", help="a line kept in the JSON (where and how it was measured)")
    ap.add_argument("--table", type=Path, metavar="JSON", help="print the results page's table of a JSON and exit")
    args = ap.parse_args()
    if args.table is not None:
        print(table(args.table))
        return
    if args.repeat < 1:
        raise SystemExit(f"--repeat {args.repeat}: must be at least 1")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeat):
            for name, overrides in CASES.items():
                row = run_case(name, overrides, Path(tmp))
                rows.append(row)
                print(f"{name}: {row['gbps']:.2f} GB/s, raw gloo {row['link_gbps']:.2f} GB/s, "
                      f"ratio {row['link_ratio']:.3f}, wall {row['wall_s']:.1f} s, peak RSS / (cache + staging) "
                      f"{row['max_rss_over_cache_staging']:.2f}, load {row['loadavg_before'][0]:.1f}", flush=True)
    ops = copy_rates()
    print(f"one chunk's copies alone: pack {ops['pack_gbps']:.2f}, unpack {ops['unpack_gbps']:.2f}, "
          f"copy_ {ops['copy_gbps']:.2f} GB/s", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    out = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "python": platform.python_version(), "commit": commit.stdout.strip(),
           "cpus": os.cpu_count(), "machine": platform.machine(), "targets": TARGETS, "runs": rows,
           "copies_alone": ops}
    if args.note:
        out["note"] = args.note
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    print(table(args.out))


if __name__ == "__main__":
    main()
