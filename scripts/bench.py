"""The H200 benchmark: every figure next to the physical reference measured in the same run.

One invocation on a machine with 2 GPUs measures
  - raw NCCL: one message of the same bytes as each transfer, GPU0 -> GPU1, over a pair group
    (the communicator path kvlab itself uses), median of 3 after a warm-up;
  - device-to-device copy and the pack/unpack kernels (scripts/kernel_bench.py);
  - every strategy for the Llama-3.1-8B layout at 4k, 32k and 128k prompt tokens and for
    DeepSeek-V3.2 (MLA + indexer) at 128k, ctx TP1 on GPU0 -> gen TP1 on GPU1, verified;
and writes one JSON file plus a table of ratios: strategy GB/s / raw NCCL GB/s of the same bytes,
kernel GB/s / copy GB/s, extra device memory / staging pool and / KV cache.

    python scripts/bench.py --out bench.json            # all of it (about 5 minutes on 2xH200)
    python scripts/bench.py --out bench.json --quick    # 4k and 32k only
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MiB, GiB = 2**20, 2**30


def raw_rank(sizes: list[int], out: Path) -> None:
    """Rank body: one NCCL message per size from rank 0 (GPU0) to rank 1 (GPU1)."""
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("cpu:gloo,cuda:nccl")
    group = dist.new_group([0, 1], backend="nccl")
    peer = 1 - rank
    results = {}
    buf = torch.empty(max(sizes), dtype=torch.uint8, device="cuda")
    for n in sorted(sizes):
        view = buf[:n]
        op = dist.P2POp(dist.isend if rank == 0 else dist.irecv, view, peer, group=group)
        times = []
        for i in range(4):
            dist.barrier(group=group, device_ids=[rank])
            torch.cuda.synchronize()
            t = time.perf_counter()
            dist.batch_isend_irecv([op])[0].wait()
            torch.cuda.synchronize()
            if i:  # the first is the warm-up
                times.append(time.perf_counter() - t)
        # the receiver's clock sees the whole message; the sender's may finish early
        results[n] = sorted(times)[1]
    gathered = [None, None]
    dist.all_gather_object(gathered, results)
    if rank == 0:
        recv = gathered[1]
        out.write_text(json.dumps({str(n): {"seconds": recv[n], "gbps": n / recv[n] / 1e9} for n in sizes}))
    dist.destroy_process_group()


def raw_nccl(sizes: list[int]) -> dict[int, dict]:
    from kvlab.cli.launch import reserve_port

    out = Path(tempfile.mkdtemp()) / "raw.json"
    with reserve_port() as reserved:
        port = reserved.getsockname()[1]
        procs = [subprocess.Popen([sys.executable, __file__, "--raw-rank", str(out), *map(str, sizes)],
                                  env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
                 for r in range(2)]
        if any([p.wait() for p in procs]):  # every rank waited for, not only up to the first that failed
            raise RuntimeError("raw NCCL measurement failed")
    return {int(k): v for k, v in json.loads(out.read_text()).items()}


def kernel_bench() -> dict:
    out = Path(tempfile.mkdtemp()) / "kernel.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_bench.py"), "--out", str(out)], check=True)
    return json.loads(out.read_text())


def transfers(quick: bool) -> list[tuple[str, list[str]]]:
    common = ["parallel=same", "logger=quiet", "workload.requests=1", "workload.concurrency=1", "device=cuda",
              "cache.spare_blocks=2"]
    lengths = [4096, 32768] if quick else [4096, 32768, 131072]
    runs = []
    for model, isls in (("llama3_8b", lengths), ("deepseek_v32", [] if quick else [131072])):
        for isl in isls:
            for strategy, extra in (("naive", []),
                                    ("chunked", ["transfer.slot_mib=64", "transfer.slots=4"]),
                                    ("chunked", ["transfer.slot_mib=128", "transfer.slots=2"]),
                                    ("zerocopy", ["transfer.slot_mib=128", "transfer.slots=2"]),
                                    # in-place chunks take no slot: the slot size only sets the message size
                                    ("zerocopy", ["transfer.slot_mib=256", "transfer.slots=1"]),
                                    ("zerocopy", ["transfer.slot_mib=1024", "transfer.slots=1"]),
                                    # per-layer compute >= per-layer transfer: 512 MiB per layer at 128k
                                    ("layerwise", ["transfer.slot_mib=64", "transfer.slots=4",
                                                   f"transfer.layer_compute_ms={max(0.1, isl / 131072 * 2.0):.3f}"])):
                runs.append((f"{model} {isl} {strategy} {' '.join(e for e in extra if 'slot' in e)}",
                             common + [f"model={model}", f"workload.isl={isl}", f"transfer={strategy}"] + extra))
    return runs


def mismatched() -> list[tuple[str, list[str]]]:
    """Sides that differ, on 2 GPUs: ctx ranks share GPU0, gen ranks GPU1, one communicator per pair."""
    common = ["parallel=same", "logger=quiet", "workload.concurrency=1", "device=cuda", "cache.spare_blocks=2",
              "transfer=chunked",
              "transfer.slot_mib=128", "transfer.slots=2", "workload.isl=32768"]
    return [(f"{name}: {' '.join(o)}", common + ["workload.requests=1"] + o) for name, o in (
        ("gqa ctx TP2 -> gen TP1", ["model=llama3_8b", "ctx.tp=2", "gen.tp=1"]),
        ("gqa ctx TP1 -> gen TP2", ["model=llama3_8b", "ctx.tp=1", "gen.tp=2"]),
        ("gqa ctx PP2 -> gen TP2", ["model=llama3_8b", "ctx.pp=2", "gen.tp=2"]),
        ("mla ctx TP2 -> gen TP1", ["model=deepseek_v32", "ctx.tp=2", "gen.tp=1"]),
        ("gqa ctx TP1 -> gen TP1 DP2", ["model=llama3_8b", "gen.dp=2", "workload.requests=2"]),
    )]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--suite", choices=("strategies", "mismatched"), default="strategies")
    ap.add_argument("--only", default="", help="run only transfers whose name contains this")
    args = ap.parse_args()

    from rich.console import Console
    from rich.table import Table

    from kvlab.api import run_transfer
    from kvlab.results import records

    console = Console()
    if torch.cuda.device_count() < 2:
        sys.exit("bench: needs 2 GPUs (ctx on GPU0, gen on GPU1)")
    report = records.BenchReport(
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), device=torch.cuda.get_device_name(0),
        gpus=torch.cuda.device_count(), torch=torch.__version__, nccl=".".join(map(str, torch.cuda.nccl.version())),
        cuda=torch.version.cuda)
    if not args.skip_kernels:
        report.kernels = kernel_bench()
    runs = []
    for name, overrides in (transfers(args.quick) if args.suite == "strategies" else mismatched()):
        if args.only not in name:
            continue
        with tempfile.TemporaryDirectory() as d:
            t = time.time()
            run_transfer(overrides, d)
            s = records.read_summary(Path(d))
            runs.append(records.BenchTransfer(name=name, overrides=list(overrides), summary=s,
                                              requests=records.read_rows(Path(d)), wall_s=time.time() - t))
            console.print(f"{name}: {s.gbps:.1f} GB/s, verified={s.verified}, {time.time() - t:.0f} s")
    raw = raw_nccl(sorted({r.summary.total_bytes for r in runs}))
    table = Table(title=f"kvlab on {report.device} x2, torch {report.torch}, NCCL {report.nccl}, {report.date[:10]}")
    for col in ("transfer", "GiB", "GB/s", "raw NCCL GB/s", "ratio", "extra MiB", "extra/staging", "extra/cache",
                "exposed ms", "verified"):
        table.add_column(col, justify="right")
    for r in runs:
        s = r.summary
        ref = raw[s.total_bytes]
        r.raw_nccl_gbps = ref["gbps"]
        r.ratio_to_raw = s.gbps / ref["gbps"]
        staging = s.peak_staging_bytes
        r.extra_over_staging = s.peak_extra_device_bytes / staging if staging else None
        r.extra_over_cache = s.peak_extra_device_bytes / s.cache_bytes if s.cache_bytes else None
        exposed = s.exposed_s
        table.add_row(r.name, f"{s.total_bytes / GiB:.2f}", f"{s.gbps:.1f}", f"{ref['gbps']:.1f}",
                      f"{r.ratio_to_raw:.3f}", f"{s.peak_extra_device_bytes / MiB:,.0f}",
                      "" if r.extra_over_staging is None else f"{r.extra_over_staging:.2f}",
                      "" if r.extra_over_cache is None else f"{r.extra_over_cache:.4f}",
                      "" if exposed is None else f"{exposed * 1e3:.2f}", str(s.verified))
    report.transfers = runs
    report.raw_nccl = {str(k): v for k, v in raw.items()}
    console.print(table)
    if report.kernels:
        console.print(report.kernels.get("table_text", ""))
    records.write_bench(Path(args.out), report)
    console.print(f"written {args.out}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--raw-rank":
        raw_rank([int(x) for x in sys.argv[3:]], Path(sys.argv[2]))
    else:
        main()
