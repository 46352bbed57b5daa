"""Raw NIXL WRITEs into one process: the reference the NIXL transport is measured against.

W writer processes (``--writers``, 1 by default; 2 for ctx TP2 -> gen TP1) each WRITE their
share of N bytes of registered memory into the target's, at once, each as one descriptor or
cut into k/W; the target learns of each WRITE from its notification. Piece i lands at a
shuffled place, so NIXL cannot merge neighbours into fewer descriptors (a fragmented block
table does the same to a KV cache). Time = the first writer's post to the target's last
notification (one host, one clock), median of 5 after a warm-up; every piece of random bytes
is checked on the target against its writer's checksum of it.

    python scripts/nixl_raw.py --mib 64 --descs 1 16 256 4096 65536 [--writers 2] [--device cuda] [--out raw.json]

``measure`` gives the transport benchmark (scripts/nixl_bench.py) its references.
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
REPS = 5


def _descs(base: int, piece: int, slots: np.ndarray, dev: int) -> np.ndarray:
    d = np.zeros((len(slots), 3), dtype=np.uint64)
    d[:, 0] = base + slots.astype(np.uint64) * np.uint64(piece)
    d[:, 1] = piece
    d[:, 2] = dev
    return d


def _sums(pieces: torch.Tensor) -> list[int]:
    """A checksum per piece (int64 words summed; random bytes make misplaced or missing pieces show)."""
    return pieces[:, :pieces.shape[1] // 8 * 8].contiguous().view(torch.int64).sum(dim=1).tolist()


def rank_main(cases: list[tuple[int, int]], writers: int, device: str, out: Path) -> None:
    """One process: ranks 0..writers-1 write every (bytes, descriptors) case into rank ``writers``."""
    from kvlab.transports import nixl_agent as nixl

    rank, port = int(os.environ["RANK"]), int(os.environ["MASTER_PORT"])
    target = rank == writers
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    store = torch.distributed.TCPStore("127.0.0.1", port, writers + 1, rank == 0, dt.timedelta(seconds=600))
    ag = nixl.agent(f"raw{rank}")
    n_max = max(n for n, _ in cases)
    buf = torch.zeros(n_max if target else n_max // writers, dtype=torch.uint8, device=device)
    nixl.register(ag, [buf])
    names = [f"raw{w}" for w in range(writers)] if target else [f"raw{writers}"]
    peers = nixl.connect(ag, store, "raw", names)
    store.set(f"addr{rank}", str(buf.data_ptr()))
    remote = int(store.get(f"addr{writers}").decode())
    dev, mem = nixl.device_id(buf), nixl.mem_type(buf)
    results = []
    for n, k in cases:
        share, kw = n // writers, k // writers
        piece = share // kw
        # piece i of a writer lands at piece perm[i] of its share on the target: neighbours never continue
        # each other on both sides, so NIXL cannot merge descriptors
        perm = np.random.default_rng(k).permutation(kw)
        tag = f"{n}/{k}"
        if not target:
            view = buf[:share].view(kw, piece)
            view.random_(0, 256)
            store.set(f"sums/{tag}/{rank}", json.dumps(_sums(view)))
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            h = ag.initialize_xfer("WRITE", ag.get_xfer_descs(_descs(buf.data_ptr(), piece, np.arange(kw), dev), mem),
                                   ag.get_xfer_descs(_descs(remote + rank * share, piece, perm, dev), mem),
                                   peers[f"raw{writers}"])
            prep = time.perf_counter() - t
            for rep in range(REPS + 1):
                store.wait([f"ready/{tag}/{rep}"])
                store.set(f"t0/{tag}/{rep}/{rank}", repr(time.time()))
                state = ag.transfer(h, f"{tag}/{rep}".encode())
                while state == "PROC":
                    state = ag.check_xfer_state(h)
                if state != "DONE":
                    raise RuntimeError(f"WRITE of {share} B as {kw} descriptors: {state}")
                store.wait([f"got/{tag}/{rep}"])
            h.release()
            if rank == 0:
                times = [float(store.get(f"got/{tag}/{rep}").decode())
                         - min(float(store.get(f"t0/{tag}/{rep}/{w}").decode()) for w in range(writers))
                         for rep in range(1, REPS + 1)]
                sec = sorted(times)[len(times) // 2]
                results.append({"bytes": n, "descriptors": k, "writers": writers, "piece_bytes": piece,
                                "seconds": sec, "gbps": n / sec / 1e9, "prep_s": prep,
                                "verified": store.get(f"ok/{tag}").decode() == "1"})
        else:
            buf[:n].zero_()
            if device == "cuda":
                torch.cuda.synchronize()
            for rep in range(REPS + 1):
                store.set(f"ready/{tag}/{rep}", "1")
                for w in range(writers):
                    while not ag.check_remote_xfer_done(peers[f"raw{w}"], f"{tag}/{rep}".encode()):
                        time.sleep(20e-6)  # two cores: leave the writers their cores
                store.set(f"got/{tag}/{rep}", repr(time.time()))
            idx = torch.from_numpy(perm).to(buf.device)
            ok = all(_sums(buf[w * share:(w + 1) * share].view(kw, piece)[idx])
                     == json.loads(store.get(f"sums/{tag}/{w}").decode()) for w in range(writers))
            store.set(f"ok/{tag}", "1" if ok else "0")
    if rank == 0:
        out.write_text(json.dumps(results))
    store.set(f"bye/{rank}", "1")
    if rank == 0:  # the store lives in rank 0: it leaves last
        store.wait([f"bye/{r}" for r in range(writers + 1)])


def measure(cases: list[tuple[int, int]], device: str = "cpu", env: dict | None = None, writers: int = 1) -> dict:
    """Run the writers and the target as processes on this machine: {"cases": one dict per (bytes,
    descriptors), "log": their output} (with ``UCX_PROTO_INFO=y`` in ``env`` the log holds the protocols
    UCX chose). Bytes must split into ``writers`` x descriptors pieces of whole 8-byte words."""
    from kvlab.cli.launch import reserve_port

    for n, k in cases:
        if n <= 0 or k % writers or n % (8 * k):
            raise ValueError(f"{n} B in {k} descriptors over {writers} writers: not whole 8-byte pieces")
    out = Path(tempfile.mkdtemp()) / "raw.json"
    with reserve_port() as reserved:
        port = reserved.getsockname()[1]
        procs = [subprocess.Popen([sys.executable, __file__, "--rank-of", str(out), str(writers), device,
                                   *(f"{n}:{k}" for n, k in cases)],
                                  env=dict(os.environ, **(env or {}), RANK=str(r), LOCAL_RANK=str(r),
                                           MASTER_PORT=str(port)),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(writers + 1)]
        logs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("raw NIXL measurement failed:\n" + "\n".join(log[-3000:] for log in logs))
    return {"cases": json.loads(out.read_text()), "log": "\n".join(logs)}


def fit(n: int, k: int, writers: int) -> tuple[int, int]:
    """(bytes, descriptors) closest below (n, k) that ``measure`` accepts."""
    k = max(writers, k // writers * writers)
    return n // (8 * k) * 8 * k, k


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, nargs="+", default=[64])
    ap.add_argument("--descs", type=int, nargs="+", default=[1, 16, 256, 4096, 65536])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--writers", type=int, default=1)
    ap.add_argument("--out")
    args = ap.parse_args()
    from kvlab.transports import nixl_agent as nixl

    cases = [fit(int(m * MiB), k, args.writers) for m in args.mib for k in args.descs]
    rows = measure(cases, args.device, writers=args.writers)["cases"]
    report = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "device": args.device,
              **nixl.versions(), "torch": torch.__version__, "cases": rows}
    for r in rows:
        print(f"{r['bytes'] / MiB:8.1f} MiB  {r['writers']} writers  {r['descriptors']:6d} descriptors of "
              f"{r['piece_bytes']:>9,d} B  "
              f"{r['gbps']:6.2f} GB/s  prep {r['prep_s'] * 1e3:7.2f} ms  verified {r['verified']}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    if len(sys.argv) > 4 and sys.argv[1] == "--rank-of":
        rank_main([tuple(map(int, c.split(":"))) for c in sys.argv[5:]], int(sys.argv[3]), sys.argv[4],
                  Path(sys.argv[2]))
        # everything is written: the interpreter's teardown of a NIXL agent with registered memory can crash
        # where UCX finds RDMA libraries (libibverbs, which transport=mooncake's wheel needs), failing a done run
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    else:
        main()
