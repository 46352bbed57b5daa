"""transport=mooncake next to nixl and p2p, each against its own raw reference measured in the same run.

Two parts:
  - the raw curve: one process writes into another with the Mooncake Transfer Engine (P2P handshake,
    registered buffers, ``--window`` writes in flight), bytes per write against GB/s, each size verified
    byte for byte on the target after its timed writes (``--curve-only`` runs this part alone);
  - the side-by-side table: Llama-3.1-8B and DeepSeek-V3.2 at 4k and 32k prompt tokens, ctx TP2 -> gen TP1,
    one request per run, verified, with ``transport=mooncake`` staged and direct, ``transport=nixl`` staged
    and direct and ``transport=p2p``; every run reports its in-run link (its transport's raw writes or
    messages of its own chunk size between its own ranks, kvlab.rank.linkrate) and the descriptors it posted per
    request. GB/s of a run = bytes delivered / time with chunks in flight, as every kvlab figure.

    python scripts/mooncake_bench.py --out results/mooncake_cpu.json     # CPU: TCP over loopback (2 cores)
    python scripts/mooncake_bench.py --gpu --out results/mooncake_h200.json
        # one GPU, every rank on it: mooncake over nvlink_intra (the CUDA-13 wheel) next to transport=ipc,
        # whose in-run reference is a local copy_ of the same bytes
    python scripts/mooncake_bench.py --table results/mooncake_cpu.json   # print the markdown tables

The JSON keeps the load average before and after, the commit measured, the wheel and the wall time.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MiB = 2**20
CASES = [("llama3_8b", 4096), ("llama3_8b", 32768), ("deepseek_v32", 4096), ("deepseek_v32", 32768)]
CURVE = [2**k for k in range(12, 27, 2)]  # 4 KiB .. 64 MiB per write


def transports(gpu: bool) -> list[tuple[str, list[str]]]:
    if gpu:
        return [("mooncake staged", ["transport=mooncake", "transport.mode=staged", "transport.protocol=auto"]),
                ("mooncake direct", ["transport=mooncake", "transport.mode=direct", "transport.protocol=auto"]),
                ("ipc", ["transport=ipc"])]
    return [("mooncake staged", ["transport=mooncake", "transport.mode=staged"]),
            ("mooncake direct", ["transport=mooncake", "transport.mode=direct"]),
            ("nixl staged", ["transport=nixl", "transport.mode=staged"]),
            ("nixl direct", ["transport=nixl", "transport.mode=direct"]),
            ("p2p", ["transport=p2p"])]


# on the GPU, Llama-3.1-8B 32k also from vLLM's NHD cache into TensorRT-LLM's, in bf16 and with the gen side in fp8
# (converted in the pack: the wire carries fp8), the fp8 row's rate also counted in the source bytes it delivers
ENGINE_CASE = ("llama3_8b", 32768)
ENGINE_ROWS = [("mooncake staged, vllm_lbnhc -> trtllm",
                ["transport=mooncake", "transport.mode=staged", "transport.protocol=auto", "ctx.layout=vllm_lbnhc",
                 "gen.layout=trtllm"]),
               ("mooncake staged, vllm_lbnhc -> trtllm, gen fp8",
                ["transport=mooncake", "transport.mode=staged", "transport.protocol=auto", "ctx.layout=vllm_lbnhc",
                 "gen.layout=trtllm", "gen.kv_dtype=fp8"])]


def common(gpu: bool) -> list[str]:
    return ["logger=quiet", "workload.requests=1", "workload.concurrency=1", "ctx.tp=2", "gen.tp=1",
            "transfer=chunked", "transfer.slot_mib=16", f"device={'cuda' if gpu else 'cpu'}",
            *(["kernels=cuda"] if gpu else []),
            # on a busy CPU machine the prefill's cache writes alone can outlast the default deadline
            "transfer.timeout_s=600"]


# -- the raw curve: two processes, one writer -----------------------------------------------------
def _raw_rank(rank: int, port: int, sizes: list[int] | str, window: int, device: str, out: str) -> None:
    """Rank 0 writes ``buf[:size]`` (seeded random bytes) into rank 1's registered buffer, ``window`` writes in
    flight; rank 1 zeroes its buffer before each size and compares it byte for byte after."""
    import torch
    import torch.distributed as dist

    from kvlab.transports import mooncake_engine as mooncake

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=dt.timedelta(seconds=300))
    te, session = mooncake.engine(mooncake.protocol("auto", device), 60)
    total = 2 * RUNS * RUN_BYTES if isinstance(sizes, str) else max(sizes)
    expect = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    buf = (expect.clone() if rank == 0 else torch.zeros_like(expect)).to(device)
    mooncake.register(te, buf.data_ptr(), buf.numel())
    store.set(f"s{rank}", json.dumps([session, buf.data_ptr()]))
    peer, addr = json.loads(store.get(f"s{1 - rank}"))
    # a GPU write completes within microseconds: a sleep between polls would be the reference's ceiling (a
    # reference must be one); on the 2-core CPU machine a spinning poll would take the engine's TCP threads' core
    pause = 0.0 if device == "cuda" else 20e-6
    rows = []
    if isinstance(sizes, str):  # one form of the scattered runs
        rows, sizes = _scattered_runs(sizes, rank, store, te, peer, buf, addr, expect, pause), []
    for size in sizes:
        if rank == 1:
            buf.zero_()
            store.set(f"ready{size}", "1")
            store.wait([f"done{size}"])
            store.set(f"checked{size}", "1" if torch.equal(buf[:size].cpu(), expect[:size]) else "0")
            continue
        store.wait([f"ready{size}"])
        n = max(4, min(512, (256 * MiB) // size))
        submits: list[float] = []

        def writes(count: int, size: int = size, submits: list = submits) -> None:
            inflight = []
            for _ in range(count):
                if len(inflight) >= window:
                    _complete(te, inflight.pop(0), pause, f"a write of {size} B")
                t = time.perf_counter()
                bid = te.transfer_submit_write(peer, buf.data_ptr(), addr, size)
                submits.append(time.perf_counter() - t)
                if bid == 0:
                    raise RuntimeError(f"the engine refused a write of {size} B")
                inflight.append(bid)
            for bid in inflight:
                _complete(te, bid, pause, f"a write of {size} B")

        writes(window)  # connection and pages warm, not timed
        times = []
        submits.clear()
        for _ in range(3):
            t0 = time.perf_counter()
            writes(n)
            times.append(time.perf_counter() - t0)
        store.set(f"done{size}", "1")
        store.wait([f"checked{size}"])
        mid = sorted(times)[1]  # the median of three
        # how long the submit call itself holds the caller (nvlink_intra's waits there for the caller's stream)
        rows.append({"bytes": size, "writes": n, "window": window, "seconds": mid, "gbps": n * size / mid / 1e9,
                     "submit_us": 1e6 * sorted(submits)[len(submits) // 2],
                     "gbps_range": [n * size / max(times) / 1e9, n * size / min(times) / 1e9],
                     "verified": store.get(f"checked{size}") == b"1"})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    if rank == 1:
        store.set("bye", "1")
    else:  # the store's host leaves last
        store.wait(["bye"])


def _complete(te, bid: int, pause: float, what: str) -> None:
    """Until the engine says write ``bid`` is done, ``pause`` s between looks (0: spinning); RuntimeError naming
    ``what`` if it failed."""
    while (s := te.transfer_check_status(bid)) == 0:
        if pause:
            time.sleep(pause)
    if s != 1:
        raise RuntimeError(f"{what} failed ({s})")


RUN_BYTES, RUNS = 32 * 1024, 512  # Llama-3.1-8B's run in transport.mode=direct: one block of one layer's K or V
# how a chunk's runs can be handed to the engine: one transfer_submit_write each, all in flight; one
# batch_transfer_async_write polled on its first entry (transfer_check_status) and then waited for as a whole
# (get_batch_transfer_status); the same batch only waited for as a whole
FORMS = ("per run", "one batch, first entry polled", "one batch, waited")


def _scattered_runs(form, rank, store, te, peer, buf, addr, expect, pause) -> list[dict]:
    """``RUNS`` writes of ``RUN_BYTES`` each, from consecutive places into every other place of the target (no two
    adjacent on both sides, as a direct chunk's runs), handed over as ``form`` says; verified on the target."""
    import torch

    src = [buf.data_ptr() + i * RUN_BYTES for i in range(RUNS)]
    dst = [addr + 2 * i * RUN_BYTES for i in range(RUNS)]
    rows = []
    if rank == 1:
        buf.zero_()
        store.set(f"ready{form}", "1")
        store.wait([f"done{form}"])
        got = buf[:2 * RUNS * RUN_BYTES].view(RUNS, 2, RUN_BYTES)[:, 0].cpu()
        store.set(f"checked{form}", "1" if torch.equal(got.reshape(-1), expect[:RUNS * RUN_BYTES]) else "0")
        return rows
    store.wait([f"ready{form}"])
    times, first, after = [], [], None
    for _ in range(4):  # the first untimed
        t0 = time.perf_counter()
        if form == "per run":
            ids = [te.transfer_submit_write(peer, s, d, RUN_BYTES) for s, d in zip(src, dst)]
        else:
            ids = [te.batch_transfer_async_write(peer, src, dst, [RUN_BYTES] * RUNS)]
        for bid in ids if form != FORMS[2] else []:
            _complete(te, bid, pause, f"scattered runs, {form}: a write")
        first.append(time.perf_counter() - t0)
        if form != "per run":  # every entry done (this call blocks until they are)
            after = te.get_batch_transfer_status(ids)
        times.append(time.perf_counter() - t0)
    times, first = sorted(times[1:]), sorted(first[1:])
    store.set(f"done{form}", "1")
    store.wait([f"checked{form}"])
    # gbps counts until every entry is done; first_entry_gbps until the first entry's status said so, which on
    # nvlink_intra (one stream, queried as a whole) is every entry, and on tcp is not
    polled = RUNS * RUN_BYTES / first[1] / 1e9 if form != FORMS[2] else None
    rows.append({"runs": RUNS, "run_bytes": RUN_BYTES, "form": form, "seconds": times[1],
                 "gbps": RUNS * RUN_BYTES / times[1] / 1e9, "first_entry_gbps": polled,
                 "batch_status": after, "verified": store.get(f"checked{form}") == b"1"})
    return rows


def raw_curve(sizes: list[int], window: int, device: str) -> list[dict]:
    """Bytes per write against GB/s between two processes of this machine (rank 0 writes into rank 1), then the
    scattered runs in each form."""
    rows = pair(sizes, window, device)
    if rows is None:
        raise SystemExit("raw curve: a rank failed")
    for form in FORMS:  # each in processes of its own: a form the engine cannot take may end them
        got = pair(form, window, device)
        rows += got or [{"runs": RUNS, "run_bytes": RUN_BYTES, "form": form, "error": "a rank failed"}]
    return rows


def pair(part: list[int] | str, window: int, device: str) -> list[dict] | None:
    """``_raw_rank``'s rows for ``part`` from two fresh processes; None if either failed."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "curve.json")
        procs = []
        for rank in (0, 1):
            code = (f"import runpy; runpy.run_path({__file__!r})['_raw_rank']"
                    f"({rank}, {port}, {part!r}, {window}, {device!r}, {out!r})")
            procs.append(subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, OMP_NUM_THREADS="1")))
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=300))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        if any(codes):
            print(f"raw writes, {part}: exit codes {codes}", flush=True)
            return None
        return json.loads(Path(out).read_text())


# -- the side-by-side table -----------------------------------------------------------------------
def phases(run_dir: Path) -> dict:
    """Where a chunk's time went, from every rank's part (medians in ms over the request's chunks): ``write_ms``,
    a ctx rank's chunk from its write's submission to its completion seen; ``ctx_step_ms``, between two
    completions of one ctx rank; ``gen_step_ms``, between two chunks landed on a gen rank; ``pack_ms`` and
    ``unpack_ms``, a chunk's share of its side's copies (kvlab.results.metrics keeps the same marks)."""
    import statistics

    write, ctx_step, gen_step, pack, unpack = [], [], [], [], []
    for f in sorted((run_dir / "parts").glob("rank*.json")):
        d = json.loads(f.read_text())
        for p in d["parts"]:
            wire = p.get("wire") or []
            done = [b for _, b in wire]
            steps = [b - a for a, b in zip(done, done[1:])]
            if d["side"] == "ctx":
                write += [b - a for a, b in wire]
                ctx_step += steps
                pack += [p["copy_s"] / len(wire)] if wire else []
            else:
                gen_step += steps
                unpack += [p["copy_s"] / len(wire)] if wire else []

    def ms(xs: list) -> float | None:
        return 1e3 * statistics.median(xs) if xs else None

    return {"write_ms": ms(write), "ctx_step_ms": ms(ctx_step), "gen_step_ms": ms(gen_step), "pack_ms": ms(pack),
            "unpack_ms": ms(unpack)}


def one_run(over: list[str], keep: Path | None = None) -> dict:
    from kvlab.api import run_transfer

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        s = run_transfer(over, Path(tmp))
        rows = [json.loads(x) for x in (Path(tmp) / "results.jsonl").read_text().splitlines()]
        steps = phases(Path(tmp))
        if keep is not None:
            shutil.copytree(tmp, keep, dirs_exist_ok=True)
    link = s.get("link") or {}
    return {"verified": s["verified"], "bytes": s["total_bytes"], "gbps": s["gbps"], "link_gbps": s.get("link_gbps"),
            "link_ratio": s.get("link_ratio"), "link_reference": link.get("reference"),
            "link_gbps_min": link.get("gbps_min"), "link_gbps_max": link.get("gbps_max"),
            "message_bytes": link.get("message_bytes"), "chunks": rows[0]["chunks"],
            "descriptors": rows[0]["descriptors"], "peak_staging_bytes": s["peak_staging_bytes"],
            "phases": steps, "wall_s": time.time() - t0}


def why(e: BaseException) -> str:
    """One line: a refused config (kvlab.core.errors.ConfigError, e.g. the host's memory on a loaded machine) as kvlab
    prints it, anything else with its type."""
    text = " ".join(str(a) for a in e.args) or type(e).__name__
    return f"{type(e).__name__}: {text.splitlines()[0]}"


def commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def markdown(report: dict) -> str:
    out = ["| bytes per write | GB/s | verified |", "| ---: | ---: | :---: |"]
    for r in report.get("curve", []):
        if "bytes" not in r:
            continue
        out.append(f"| {r['bytes'] / 1024:,.0f} KiB | {r['gbps']:.2f} | {'yes' if r['verified'] else 'NO'} |")
    runs = [r for r in report.get("curve", []) if "runs" in r]
    if runs:
        out += ["", "| scattered runs | form | GB/s, every entry done | GB/s, first entry's status | verified |",
                "| --- | --- | ---: | ---: | :---: |"]
        for r in runs:
            got = (f"failed: {r['error']} | | |" if "error" in r else
                   f"{r['gbps']:.2f} | {r['first_entry_gbps'] or 0:.2f} | {'yes' if r['verified'] else 'NO'} |")
            out.append(f"| {r['runs']} x {r['run_bytes'] // 1024} KiB | {r['form']} | {got}")
    out += ["", "| model | tokens | transport | GB/s | own reference GB/s (range) | ratio | chunks | descriptors "
            "| verified |", "| --- | ---: | --- | ---: | --- | ---: | ---: | ---: | :---: |"]
    for r in report.get("runs", []):
        if "error" in r or r.get("gbps") is None:
            out.append(f"| {r['model']} | {r['isl']} | {r['transport']} | failed: {r.get('error', 'no figure')} "
                       "| | | | | |")
            continue
        rng = (f"{r['link_gbps']:.2f} ({r['link_gbps_min']:.2f}-{r['link_gbps_max']:.2f})" if r["link_gbps"]
               else "")
        src = f" ({r['source_gbps']:.2f} of the bf16 source)" if "source_gbps" in r else ""
        out.append(f"| {r['model']} | {r['isl']} | {r['transport']} | {r['gbps']:.2f}{src} | {rng} | "
                   f"{r['link_ratio']:.3f} | {r['chunks']} | {r['descriptors']} | "
                   f"{'yes' if r['verified'] else 'NO'} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--gpu", action="store_true", help="one GPU, every rank on it: nvlink_intra and transport=ipc")
    ap.add_argument("--only", default="", help="run only the cases whose 'model isl transport' contains this")
    ap.add_argument("--window", type=int, default=4, help="raw curve: writes in flight")
    ap.add_argument("--curve-only", action="store_true")
    ap.add_argument("--no-curve", action="store_true", help="the table alone (each run has its in-run reference)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="more overrides for every run of the table (for example transfer.slots=8)")
    ap.add_argument("--profile", action="store_true",
                    help="each case once more with every rank under cProfile: its ranks' top functions, in the JSON")
    ap.add_argument("--keep", metavar="DIR", help="keep each run's directory (its parts: every chunk's marks) in DIR")
    ap.add_argument("--table", metavar="JSON", help="print the markdown tables of a report, run nothing")
    ap.add_argument("--redo-failed", metavar="JSON", help="run again the cases of a report that failed or did not "
                    "arrive verified (a run that could not start on a loaded machine), replacing their rows in place")
    args = ap.parse_args()
    if args.table:
        print(markdown(json.loads(Path(args.table).read_text())))
        return
    if args.redo_failed:
        path = Path(args.redo_failed)
        report = json.loads(path.read_text())
        for i, row in enumerate(report["runs"]):
            if "error" not in row and row.get("verified"):
                continue
            over = dict(transports(report["device"] == "cuda") + ENGINE_ROWS)[row["transport"]]
            new = {"model": row["model"], "isl": row["isl"], "transport": row["transport"]}
            try:
                new |= one_run(common(report["device"] == "cuda") + over
                               + [f"model={row['model']}", f"workload.isl={row['isl']}"])
            except Exception as e:  # noqa: BLE001
                new["error"] = why(e)
            new["redone"] = dt.datetime.now().isoformat(timespec="seconds")
            report["runs"][i] = new
            path.write_text(json.dumps(report, indent=1) + "\n")
        print(markdown(report))
        return
    from kvlab.transports import mooncake_engine as mooncake

    device = "cuda" if args.gpu else "cpu"
    report = {"device": device, "commit": commit(), "when": dt.datetime.now().isoformat(timespec="seconds"),
              "loadavg_before": os.getloadavg(), **mooncake.versions(),
              "protocol": mooncake.protocol("auto", device), "overrides": args.set, "curve": [], "runs": []}

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")

    report["curve"] = [] if args.no_curve else raw_curve(CURVE, args.window, device)
    save()
    if not args.curve_only:
        for model, isl in CASES:
            extra = ENGINE_ROWS if args.gpu and (model, isl) == ENGINE_CASE else []
            for name, over in transports(args.gpu) + extra:
                label = f"{model} {isl} {name}"
                if args.only and args.only not in label:
                    continue
                row = {"model": model, "isl": isl, "transport": name}
                try:
                    keep = Path(args.keep) / label.replace(" ", "_").replace(",", "") if args.keep else None
                    row |= one_run(common(args.gpu) + over + [f"model={model}", f"workload.isl={isl}", *args.set],
                                   keep)
                except Exception as e:  # noqa: BLE001 - one failed case is a row, not the end of the table
                    row["error"] = why(e)
                if args.profile and "error" not in row:
                    from kvlab.api import profile_transfer

                    row["profiles"] = profile_transfer(common(args.gpu) + over + [f"model={model}",
                                                                                  f"workload.isl={isl}", *args.set])
                if name.endswith("gen fp8") and "gbps" in row and report["runs"] and "gbps" in report["runs"][-1]:
                    bf16 = report["runs"][-1]  # its bf16 sibling, the row before
                    row["source_bytes"] = bf16["bytes"]
                    row["source_gbps"] = row["gbps"] * bf16["bytes"] / row["bytes"]
                report["runs"].append(row)
                shown = ("gbps", "link_gbps", "link_ratio", "descriptors", "phases", "error")
                print(label, {k: row.get(k) for k in shown}, flush=True)
                save()
    report["loadavg_after"] = os.getloadavg()
    save()
    print(markdown(report))


if __name__ == "__main__":
    main()
