"""Raw NIXL WRITE between two processes: the reference the NIXL transport is measured against.

Rank 0 WRITEs N bytes of registered memory into rank 1's, as one descriptor or cut into k
descriptors; rank 1 learns of it from the transfer's notification. A piece lies every other
piece-length in both buffers and lands at a shuffled place, so NIXL cannot merge neighbours
into fewer descriptors (a fragmented block table does the same to a KV cache). Time =
rank 0's post to rank 1's notification (one host, one clock), median of 3 after a warm-up;
every size is checked byte for byte on rank 1.

    python scripts/nixl_raw.py --mib 64 --descs 1 16 256 4096 65536 [--device cuda] [--out raw.json]

``write_gbps`` is what the transport benchmark (scripts/nixl_bench.py) calls for its
one-descriptor reference of the same bytes.
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

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MiB = 2**20
REPS = 3


def _descs(base: int, piece: int, order: np.ndarray, dev: int) -> np.ndarray:
    d = np.zeros((len(order), 3), dtype=np.uint64)
    d[:, 0] = base + order.astype(np.uint64) * np.uint64(2 * piece)
    d[:, 1] = piece
    d[:, 2] = dev
    return d


def rank_main(cases: list[tuple[int, int]], device: str, out: Path) -> None:
    """One rank: rank 0 writes every (bytes, descriptors) case into rank 1."""
    from kvlab import nixl

    rank, port = int(os.environ["RANK"]), int(os.environ["MASTER_PORT"])
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, rank == 0, dt.timedelta(seconds=120))
    ag = nixl.agent(f"raw{rank}")
    n_max = max(n for n, _ in cases)
    buf = torch.zeros(2 * n_max, dtype=torch.uint8, device=device)
    nixl.register(ag, [buf])
    peer = nixl.connect(ag, store, "raw", [f"raw{1 - rank}"])[f"raw{1 - rank}"]
    store.set(f"addr{rank}", str(buf.data_ptr()))
    remote = int(store.get(f"addr{1 - rank}").decode())
    dev = nixl.device_id(buf)
    results = []
    for n, k in cases:
        piece = n // k
        perm = np.random.default_rng(k).permutation(k)
        src = torch.randint(0, 256, (k, piece), generator=torch.Generator().manual_seed(n + k), dtype=torch.uint8)
        if rank == 0:
            buf[:2 * n].view(k, 2 * piece)[:, :piece].copy_(src)
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            h = ag.initialize_xfer("WRITE", ag.get_xfer_descs(_descs(buf.data_ptr(), piece, np.arange(k), dev),
                                                               nixl.mem_type(buf)),
                                   ag.get_xfer_descs(_descs(remote, piece, perm, dev), nixl.mem_type(buf)), peer)
            prep = time.perf_counter() - t
            times, posted = [], []
            for rep in range(REPS + 1):
                store.wait([f"ready/{n}/{k}/{rep}"])
                t0 = time.time()
                state = ag.transfer(h, f"{n}/{k}/{rep}".encode())
                while state == "PROC":
                    state = ag.check_xfer_state(h)
                if state != "DONE":
                    raise RuntimeError(f"WRITE of {n} B as {k} descriptors: {state}")
                posted.append(time.time() - t0)
                t1 = float(store.get(f"got/{n}/{k}/{rep}").decode())
                if rep:
                    times.append(t1 - t0)
            h.release()
            sec = sorted(times)[len(times) // 2]
            ok = store.get(f"ok/{n}/{k}").decode() == "1"
            results.append({"bytes": n, "descriptors": k, "piece_bytes": piece, "seconds": sec, "gbps": n / sec / 1e9,
                            "initiator_done_s": sorted(posted[1:])[len(posted[1:]) // 2], "prep_s": prep,
                            "verified": ok})
        else:
            for rep in range(REPS + 1):
                want = f"{n}/{k}/{rep}".encode()
                store.set(f"ready/{n}/{k}/{rep}", "1")
                while not ag.check_remote_xfer_done(peer, want):
                    time.sleep(20e-6)  # two cores: leave the writer its core
                store.set(f"got/{n}/{k}/{rep}", repr(time.time()))
            got = buf[:2 * n].view(k, 2 * piece)[perm, :piece].cpu()
            store.set(f"ok/{n}/{k}", "1" if torch.equal(got, src) else "0")
            buf.zero_()
    if rank == 0:
        out.write_text(json.dumps(results))


def measure(cases: list[tuple[int, int]], device: str = "cpu", env: dict | None = None) -> list[dict]:
    """Run both ranks as processes on this machine; one dict per (bytes, descriptors) case."""
    from kvlab.launch import free_port

    out = Path(tempfile.mkdtemp()) / "raw.json"
    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--rank-of", str(out), device,
                               *(f"{n}:{k}" for n, k in cases)],
                              env=dict(os.environ, **(env or {}), RANK=str(r), LOCAL_RANK=str(r),
                                       MASTER_PORT=str(port)))
             for r in range(2)]
    if any(p.wait() for p in procs):
        raise RuntimeError("raw NIXL measurement failed")
    return json.loads(out.read_text())


def write_gbps(sizes: list[int], device: str = "cpu") -> dict[int, dict]:
    """One descriptor per size: the reference of the transport benchmark."""
    return {r["bytes"]: r for r in measure([(n, 1) for n in sorted(set(sizes))], device)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, nargs="+", default=[64])
    ap.add_argument("--descs", type=int, nargs="+", default=[1, 16, 256, 4096, 65536])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--out")
    args = ap.parse_args()
    from kvlab import nixl

    cases = [(int(m * MiB) // k * k, k) for m in args.mib for k in args.descs]
    rows = measure(cases, args.device)
    report = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "device": args.device,
              **nixl.versions(), "torch": torch.__version__, "cases": rows}
    for r in rows:
        print(f"{r['bytes'] / MiB:8.1f} MiB  {r['descriptors']:6d} descriptors of {r['piece_bytes']:>9,d} B  "
              f"{r['gbps']:6.2f} GB/s  prep {r['prep_s'] * 1e3:7.2f} ms  verified {r['verified']}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--rank-of":
        rank_main([tuple(map(int, c.split(":"))) for c in sys.argv[4:]], sys.argv[3], Path(sys.argv[2]))
    else:
        main()
