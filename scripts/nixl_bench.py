"""transport=nixl in both modes, next to raw NIXL WRITEs of the same bytes measured in the same run.

For Llama-3.1-8B and DeepSeek-V3.2 at 4k and 32k prompt tokens, ctx TP2 -> gen TP1 (mismatched
sides), one request per run, verified: ``transport.mode=staged`` (one descriptor per chunk
through registered slots) and ``direct`` (one descriptor per merged run, pool to pool), each
next to
  - raw NIXL: the same bytes WRITten by two processes into a third, one descriptor each
    (scripts/nixl_raw.py: the shape of the run, its ctx ranks into its gen rank), the ceiling;
  - raw NIXL cut into as many descriptors as the run posted per request (same bytes, same
    mean descriptor size): what NIXL itself does with that many descriptors, without kvlab.
GB/s of a run = bytes delivered / (ctx's first chunk -> gen's last landing), as every kvlab
figure. What UCX chose for the WRITEs is read from UCX's own protocol report.

    python scripts/nixl_bench.py --out results/nixl_cpu.json               # CPU (DRAM, this machine)
    python scripts/nixl_bench.py --device cuda --out nixl_h200.json        # one GPU: ranks share it (VRAM)
    python scripts/nixl_bench.py --only "llama3_8b 4096"                   # a subset
    python scripts/nixl_bench.py --slot-mib 16 128 --slots 2 ...           # staged with 16 and 128 MiB slots
    python scripts/nixl_bench.py --profile "32768 nixl staged 16" ...      # + host profiles of those ranks

Every run also reports its in-run link (raw NIXL WRITEs of its own chunk size between its
own ranks, kvlab.rank.linkrate) and the ratio to it; the JSON keeps the load average, the
commit measured and the wall time.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

MiB, GiB = 2**20, 2**30
WRITERS = 2  # ctx TP2 -> gen TP1: two ctx ranks write into one gen rank
CURVE = (2, 32, 512, 8192, 131072)  # descriptors of the raw curve, from one per writer to 4 KiB pieces at 512 MiB


def runs(device: str, with_ipc: bool, slot_mib: list[float], slots: int, thread: bool = False
         ) -> list[tuple[str, list[str]]]:
    common = ["logger=quiet", "workload.requests=1", "workload.concurrency=1", "cache.spare_blocks=2",
              f"ctx.tp={WRITERS}", "gen.tp=1", "transfer=chunked", f"transfer.slots={slots}", f"device={device}",
              # on a busy CPU machine the ctx rank's fill (the prefill's output) alone can outlast the default
              # 60 s that a gen rank waits for its first chunk
              "transfer.timeout_s=600"]
    # a slot is a chunk: staged runs once per slot size; direct and ipc cut chunks of the first size
    transports = [(f"nixl staged {m:g} MiB", ["transport=nixl", "transport.mode=staged", f"transfer.slot_mib={m}"])
                  for m in slot_mib]
    transports.append((f"nixl direct {slot_mib[0]:g} MiB", ["transport=nixl", "transport.mode=direct",
                                                            f"transfer.slot_mib={slot_mib[0]}"]))
    if thread:  # the first staged case again, NIXL's progress thread completing WRITEs and notifications
        name, over = transports[0]
        transports.append((f"{name} progress thread", over + ["transport.progress_thread=true"]))
    if with_ipc:
        transports.append((f"ipc {slot_mib[0]:g} MiB", ["transport=ipc", f"transfer.slot_mib={slot_mib[0]}"]))
    out = []
    for model in ("llama3_8b", "deepseek_v32"):
        for isl in (4096, 32768):
            for name, t in transports:
                out.append((f"{model} {isl} {name}", common + [f"model={model}", f"workload.isl={isl}"] + t))
    return out


def commit() -> str | None:
    """The measured code's commit (with "+dirty" when the working tree differs from it)."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("+dirty" if dirty else "")


def ucx_choice(log: str) -> list[str]:
    """The protocols UCX reported for remote writes (``UCX_PROTO_INFO=y``): range, method, transport."""
    out, inside = [], False
    for line in log.splitlines():
        if "remote memory write by ucp_put" in line:
            inside = True
            continue
        if inside:
            m = re.search(r"\|\s*([\d.]+\S*)\s*\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|\s*$", line)
            if m:
                out.append(f"{m.group(1)} {m.group(2)} {m.group(3)}")
            elif not re.search(r"\+-|Range", line):
                inside = False
    return sorted(set(out))


def markdown(report: dict) -> str:
    """The results page's tables of a report: transfers against their references, then the raw curve."""
    load = [r["load_avg"][0] for r in report["transfers"] if r.get("load_avg")]
    cores = f" ({report['cpus']} cores)" if report.get("cpus") else ""
    head = (f"{report['device']}{cores}, NIXL {report['nixl']}, UCX {report.get('ucx')}, torch {report['torch']}, "
            f"{report['date'][:10]}"
            + (f", load average {min(load):.1f}-{max(load):.1f} during the runs" if load else "")
            + f"; UCX wrote with: {', '.join(report.get('ucx_write', []))}.")
    lines = [head, "",
             "| transfer | GiB | descriptors / request | B / descriptor | GB/s | raw NIXL GB/s (1 descriptor per "
             "writer) | ratio | raw NIXL GB/s (same descriptors) | ratio | in-run link GB/s | link_ratio | "
             "staging MiB | verified |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in report["transfers"]:
        s, k = r["summary"], max(1, r["descriptors"])
        link = f"{s['link_gbps']:.2f} | {s['link_ratio']:.3f}" if s.get("link_gbps") else " | "
        lines.append(f"| {r['name']} | {s['total_bytes'] / GiB:.2f} | {r['descriptors']:,} | "
                     f"{s['total_bytes'] // k:,} | {s['gbps']:.2f} | {r['raw_one_gbps']:.2f} | "
                     f"{r['ratio_to_raw']:.3f} | "
                     f"{r['raw_same_descriptors_gbps']:.2f} | {r['ratio_to_raw_same_descriptors']:.3f} | {link} | "
                     f"{s['peak_staging_bytes'] / MiB:,.0f} | {'yes' if s['verified'] else 'NO'} |")
    curve = sorted(report["curve"], key=lambda c: c["descriptors"])
    lines += ["", "| raw NIXL: MiB | descriptors | B / descriptor | GB/s | ratio to the fewest |",
              "| ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {c['bytes'] / MiB:,.0f} | {c['descriptors']:,} | {c['piece_bytes']:,} | {c['gbps']:.2f} | "
              f"{c['gbps'] / curve[0]['gbps']:.3f} |" for c in curve]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--table", metavar="JSON", help="print the markdown tables of a report, run nothing")
    ap.add_argument("--out")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--only", default="", help="run only transfers whose name contains this")
    ap.add_argument("--ipc", action="store_true", help="add transport=ipc rows (the pull transport)")
    ap.add_argument("--slot-mib", type=float, nargs="+", default=[16.0],
                    help="slot (= chunk) sizes: staged runs once per size, direct and ipc with the first")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--progress-thread", action="store_true",
                    help="add the first staged case with NIXL's progress thread (transport.progress_thread=true)")
    ap.add_argument("--profile", default="", help="run the transfers whose name contains this once more, every "
                    "rank under cProfile, and keep the profiles in the JSON")
    args = ap.parse_args()
    if args.table:
        print(markdown(json.loads(Path(args.table).read_text())))
        return
    if not args.out:
        ap.error("--out is required to run the benchmark")

    from nixl_raw import fit, measure
    from rich.console import Console
    from rich.table import Table

    from kvlab.api import profile_transfer, run_transfer
    from kvlab.transports import nixl_agent as nixl

    console = Console()
    report = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **nixl.versions(),
              "torch": torch.__version__, "device": torch.cuda.get_device_name(0) if args.device == "cuda" else
              "cpu", "cpus": os.cpu_count(), "commit": commit(), "load_avg_start": os.getloadavg(),
              "transfers": []}
    started = time.time()
    done = []
    for name, overrides in runs(args.device, args.ipc, args.slot_mib, args.slots, args.progress_thread):
        if args.only not in name:
            continue
        with tempfile.TemporaryDirectory() as d:
            t = time.time()
            s = run_transfer(overrides, d)
            (row,) = [json.loads(line) for line in (Path(d) / "results.jsonl").read_text().splitlines()]
            done.append({"name": name, "overrides": overrides, "summary": s, "request": row,
                         "wall_s": time.time() - t, "load_avg": os.getloadavg()})
            console.print(f"{name}: {s['gbps']:.2f} GB/s (link_ratio {s.get('link_ratio') or 0:.3f}), "
                          f"{row['descriptors']} descriptors, verified={s['verified']}, {time.time() - t:.0f} s, "
                          f"load {os.getloadavg()[0]:.1f}")
            Path(args.out).write_text(json.dumps(dict(report, transfers=done), indent=2))  # kept if cut short
    if args.profile:
        # host profiles of every rank, from runs of their own: cProfile slows the host, not the figures above
        report["profiles"] = {name: profile_transfer(overrides) for name, overrides in runs(
            args.device, args.ipc, args.slot_mib, args.slots, args.progress_thread) if args.profile in name}
    # the references, after the runs (a small machine runs one thing at a time), from as many writers as the
    # runs have ctx ranks into one target: one descriptor per writer of the same bytes, and the same bytes
    # in as many descriptors as each run posted
    failed = [r["name"] for r in done if not r["summary"]["verified"]]
    done = [r for r in done if r["summary"]["verified"]]  # a failed run delivered too little to compare
    report["failed"] = failed
    cases = set()
    for r in done:
        n, k = r["summary"]["total_bytes"], max(1, r["request"]["descriptors"])
        cases |= {fit(n, 1, WRITERS), fit(n, k, WRITERS)}
    # and the curve itself: the smallest run's bytes in ever more descriptors
    if not done:
        sys.exit(f"nixl_bench: no transfer matches --only {args.only!r}")
    curve = [fit(min(r["summary"]["total_bytes"] for r in done), k, WRITERS) for k in CURVE]
    cases |= set(curve)
    t = time.time()
    raw = measure(sorted(cases), args.device, env={"UCX_PROTO_INFO": "y"}, writers=WRITERS)
    report["raw_wall_s"] = time.time() - t
    report["ucx_write"] = ucx_choice(raw["log"])
    by = {(c["bytes"], c["descriptors"]): c for c in raw["cases"]}
    table = Table(title=f"transport=nixl on {report['device']}, NIXL {report['nixl']}, UCX {report.get('ucx')}, "
                        f"{report['date'][:10]}; UCX wrote with: {', '.join(report['ucx_write'])}")
    for col in ("transfer", "GiB", "descriptors / request", "B / descriptor", "GB/s", "raw 1 desc GB/s", "ratio",
                "raw same desc GB/s", "ratio", "in-run link GB/s", "link_ratio", "staging MiB", "verified"):
        table.add_column(col, justify="right")
    for r in done:
        s, k = r["summary"], max(1, r["request"]["descriptors"])
        one, many = by[fit(s["total_bytes"], 1, WRITERS)], by[fit(s["total_bytes"], k, WRITERS)]
        r.update(raw_one_gbps=one["gbps"], raw_same_descriptors_gbps=many["gbps"], ratio_to_raw=s["gbps"] / one["gbps"],
                 ratio_to_raw_same_descriptors=s["gbps"] / many["gbps"], descriptors=r["request"]["descriptors"])
        table.add_row(r["name"], f"{s['total_bytes'] / GiB:.2f}", f"{r['descriptors']:,}",
                      f"{s['total_bytes'] // k:,}", f"{s['gbps']:.2f}", f"{one['gbps']:.2f}",
                      f"{r['ratio_to_raw']:.3f}", f"{many['gbps']:.2f}", f"{r['ratio_to_raw_same_descriptors']:.3f}",
                      f"{s.get('link_gbps') or 0:.2f}", f"{s.get('link_ratio') or 0:.3f}",
                      f"{s['peak_staging_bytes'] / MiB:,.0f}", "yes" if s["verified"] else "NO")
    report["transfers"] = done
    report["raw"] = raw["cases"]
    console.print(table)
    curve_table = Table(title="raw NIXL: the same bytes in more descriptors")
    for col in ("MiB", "descriptors", "B / descriptor", "GB/s", "ratio to the fewest"):
        curve_table.add_column(col, justify="right")
    for n, k in sorted(curve, key=lambda c: c[1]):
        c = by[(n, k)]
        curve_table.add_row(f"{n / MiB:,.0f}", f"{k:,}", f"{c['piece_bytes']:,}", f"{c['gbps']:.2f}",
                            f"{c['gbps'] / by[curve[0]]['gbps']:.3f}")
    report["curve"] = [by[c] for c in curve]
    report["load_avg_end"], report["wall_s"] = os.getloadavg(), time.time() - started
    console.print(curve_table)
    console.print(f"{report['wall_s']:.0f} s in all (raw {report['raw_wall_s']:.0f} s); load average "
                  f"{report['load_avg_start'][0]:.1f} at the start, {report['load_avg_end'][0]:.1f} at the end")
    Path(args.out).write_text(json.dumps(report, indent=2))
    console.print(f"written {args.out}")


if __name__ == "__main__":
    main()
