"""Pack/unpack kernel bandwidth against a device-to-device copy of the same bytes, on one GPU.

A Llama-3.1-8B-like pool (32 layers, 8 kv heads, head_dim 128, bf16, 32 tokens per block:
runs of 8 KiB) and DeepSeek-V3.2-like pools (61 layers; the MLA latent, one 1152-byte row per
token: runs of 36 KiB; the indexer, 128 value bytes and 4 scale bytes per token: runs of
4 KiB and 128 bytes) with their blocks in a shuffled order; one chunk is a rectangle of whole
blocks (all layers, all or half of the heads) of about 64 or 256 MiB. Bandwidth counts bytes read + written, as the
copy figure of docs/design.md does. The copy (torch ``copy_`` over the whole GPU) is measured in
the same run; the kernels run on a given number of CTAs, the point being to stay close to
it on few CTAs so that NCCL keeps its SMs.

    python scripts/kernel_bench.py --out kernel_bench.json
    python scripts/kernel_bench.py --out ceilings.json --ceilings-only   (scripts/kernel_ceilings.py: what few CTAs,
        and the copy engines, can move at all)
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import platform

import torch

from kvlab.core.clock import median_launches_s
from kvlab.memory.ops import cuda as cuda_ops
from kvlab.memory.ops import reference
from kvlab.model.layout import Rect
from kvlab.model.parallel import Layout
from kvlab.model.spec import Kind, PoolSpec
from kvlab.model.state import RankPool

MiB = 2**20
DEVICE = "cuda"
LAYERS, HEADS, HEAD_DIM, TPB = 32, 8, 128, 32
DSV32_LAYERS = 61


def llama8b_pool(layout: Layout, heads: range = range(HEADS)) -> RankPool:
    spec = PoolSpec("kv", Kind.kv, tuple(range(LAYERS)), 0, HEADS, (HEAD_DIM, HEAD_DIM), ("bf16", "bf16"))
    return RankPool(spec, range(LAYERS), heads, TPB, layout)


def dsv32_pool(kind: Kind, layout: Layout = Layout.block_major) -> RankPool:
    """DeepSeek-V3.2's MLA latent (576 bf16) or indexer K (128 fp8 values + one fp32 scale) pool, as bytes."""
    elems, dtypes = ((576,), ("bf16",)) if kind == Kind.mla else ((128, 1), ("fp8", "fp32"))
    spec = PoolSpec(kind.value, kind, tuple(range(DSV32_LAYERS)), 0, 1, elems, dtypes)
    return RankPool(spec, range(DSV32_LAYERS), range(1), TPB, layout)


def long_run_pool() -> RankPool:
    """One layer, one head, 64 KiB rows, 32 tokens per block: each block is one 2 MiB run."""
    spec = PoolSpec("kv", Kind.kv, (0,), 0, 1, (65536,), ("fp8",))
    return RankPool(spec, range(1), range(1), TPB, Layout.block_major)


def time_ms(fn, iters: int, trials: int = 5) -> float:
    """Median over trials of the mean time per call, from CUDA events."""
    return median_launches_s(fn, iters, trials, warmup=3) * 1e3


def gbps(nbytes: int, ms: float) -> float:
    return 2 * nbytes / (ms * 1e-3) / 1e9  # read + written


class Chunk:
    """A pool with shuffled blocks and one rectangle of whole blocks, at most ``chunk_bytes``, over the given heads.

    ``pool``: defaults to the Llama-3.1-8B pool in ``layout``.
    """

    def __init__(self, layout: Layout, chunk_bytes: int, heads: range, gen: torch.Generator,
                 pool: RankPool | None = None):
        self.pool = pool or llama8b_pool(layout, range(HEADS))
        nl = len(self.pool.layers)
        tok_bytes = nl * len(heads) * sum(self.pool.rows)
        tokens = chunk_bytes // tok_bytes // TPB * TPB
        self.num_blocks = 2 * tokens // TPB  # the chunk's blocks scattered over twice as many
        self.rect = Rect(self.pool.name, 0, nl, heads.start, heads.stop, 0, tokens, TPB)
        self.ids = torch.randperm(self.num_blocks, generator=gen)[: tokens // TPB].to(DEVICE)
        self.pool_bytes = torch.randint(0, 256, (self.pool.pool_bytes(self.num_blocks),), dtype=torch.uint8,
                                        device=DEVICE)
        self.nbytes = self.rect.nbytes(self.pool.rows)
        self.wire = torch.empty(self.nbytes, dtype=torch.uint8, device=DEVICE)

    def pack(self, ctas, tuning=cuda_ops.DEFAULT_TUNING):
        cuda_ops.pack(self.pool_bytes, self.pool, self.num_blocks, self.rect, self.ids, 0, self.wire, ctas=ctas,
                      tuning=tuning)

    def unpack(self, ctas, tuning=cuda_ops.DEFAULT_TUNING):
        cuda_ops.unpack(self.wire, self.pool, self.num_blocks, self.rect, self.ids, 0, self.pool_bytes, ctas=ctas,
                        tuning=tuning)

    def verify(self, tuning=cuda_ops.DEFAULT_TUNING) -> None:
        """The bytes the bench moves are right: pack and unpack against the reference."""
        self.pack(16, tuning)
        want = torch.empty_like(self.wire)
        reference.pack(self.pool_bytes, self.pool, self.num_blocks, self.rect, self.ids, 0, want)
        assert torch.equal(self.wire, want), "pack differs from the reference"
        before = self.pool_bytes.clone()
        self.pool_bytes.zero_()
        self.unpack(16, tuning)
        expect = torch.zeros_like(before)
        reference.unpack(want, self.pool, self.num_blocks, self.rect, self.ids, 0, expect)
        assert torch.equal(self.pool_bytes, expect), "unpack differs from the reference"
        self.pool_bytes.copy_(before)


def d2d_copy_gbps(nbytes: int, iters: int) -> float:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return gbps(nbytes, time_ms(lambda: dst.copy_(src), iters))


WARP_TUNINGS = [cuda_ops.Tuning(1024, 4), cuda_ops.Tuning(512, 8), cuda_ops.Tuning(512, 16), cuda_ops.Tuning(256, 16)]
BULK_TUNINGS = [cuda_ops.Tuning(threads=t, bulk=True, stages=st, piece=pc)
                for t, st, pc in ((128, 6, 8192), (256, 3, 8192), (256, 6, 4096), (512, 3, 4096), (1024, 3, 2048))]


class Bench:
    def __init__(self, args, meta):
        self.args, self.meta = args, meta
        self.rows: list[dict] = []
        self.copy_gbps: dict[int, float] = {}
        self.errors: list[str] = []

    def measure(self, case: str, ch: Chunk, mib: int, ctas_list, tuning) -> None:
        for ctas in ctas_list:
            for op in ("pack", "unpack"):
                fn = getattr(ch, op)
                g = gbps(ch.nbytes, time_ms(lambda: fn(ctas, tuning), self.args.iters))  # noqa: B023
                self.rows.append({"case": case, "chunk_mib": mib, "op": op, "ctas": ctas,
                                  "kernel": kernel_name(tuning), "threads": tuning.threads,
                                  "unroll": tuning.unroll, "bulk": tuning.bulk, "stages": tuning.stages,
                                  "piece": tuning.piece, "gbps": g, "copy_gbps": self.copy_gbps[mib],
                                  "ratio": g / self.copy_gbps[mib]})

    def summary(self) -> dict:
        best: dict = {}
        for r in self.rows:
            if r["ctas"] <= 32:
                k = (r["op"], r["chunk_mib"])
                if r["ratio"] > best.get(k, {"ratio": -1})["ratio"]:
                    best[k] = r
        keys = ("case", "kernel", "ctas", "gbps", "ratio")
        return {f"{op} {mib} MiB": {k: best[(op, mib)][k] for k in keys} for (op, mib) in sorted(best)}

    def save(self) -> None:
        with open(self.args.out, "w") as f:
            json.dump({"meta": self.meta, "copy_gbps": self.copy_gbps, "rows": self.rows,
                       "best_le_32_ctas": self.summary(), "errors": self.errors}, f, indent=1)


def kernel_name(t) -> str:
    return f"bulk {t.threads // 32}w x{t.stages} x{t.piece // 1024}K" if t.bulk else f"warp {t.threads}x{t.unroll}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON results path")
    ap.add_argument("--chunks-mib", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--ctas", type=int, nargs="+", default=[8, 16, 32, 132])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-bulk", action="store_true", help="skip the cp.async.bulk kernels")
    ap.add_argument("--ceilings-only", action="store_true",
                    help="only the linear copy on the given CTAs and the copy engines (scripts/kernel_ceilings.py)")
    args = ap.parse_args()

    import cuda.core
    from rich.console import Console

    torch.cuda.set_device(0)
    cuda_ops.ensure_compiled()
    props = torch.cuda.get_device_properties(0)
    meta = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": props.name, "sms": props.multi_processor_count, "arch": cuda_ops.device_arch(0),
        "torch": torch.__version__, "cuda": torch.version.cuda, "cuda_core": cuda.core.__version__,
        "nvrtc": cuda_ops._nvrtc_version(), "host": platform.node(),
        "pool": f"{LAYERS} layers, {HEADS} kv heads, head_dim {HEAD_DIM}, bf16, {TPB} tokens/block",
        "bandwidth": "bytes read + written per second",
    }
    console = Console(width=150)
    console.print(meta)
    gen = torch.Generator().manual_seed(0)
    b = Bench(args, meta)
    for mib in args.chunks_mib:
        b.copy_gbps[mib] = d2d_copy_gbps(mib * MiB, args.iters)

    if args.ceilings_only:
        ceilings(b, gen)
        b.save()
        print_table(b, props, console)
        return
    cases = [("block_major", Layout.block_major, range(HEADS), None),
             ("layer_major", Layout.layer_major, range(HEADS), None),
             ("block_major heads 0-3", Layout.block_major, range(HEADS // 2), None),
             ("dsv32 mla 1152B", Layout.block_major, range(1), dsv32_pool(Kind.mla)),
             ("dsv32 indexer 128+4B", Layout.block_major, range(1), dsv32_pool(Kind.indexer)),
             # the kernels' own ceiling on few CTAs: one 2 MiB run per block, no per-run work to speak of
             ("one long run", Layout.block_major, range(1), long_run_pool())]
    for name, layout, heads, pool in cases:
        for mib in args.chunks_mib:
            ch = Chunk(layout, mib * MiB, heads, gen, pool)
            if mib == min(args.chunks_mib):
                ch.verify()
            b.measure(name, ch, mib, args.ctas, cuda_ops.DEFAULT_TUNING)
            del ch
            torch.cuda.empty_cache()
    b.save()

    # bytes in flight per SM is what few CTAs must make up for: vary how the kernel holds them
    few = [c for c in args.ctas if c <= 32] + [132]
    sections = [("warp", WARP_TUNINGS)] + ([] if args.no_bulk else [("bulk", BULK_TUNINGS)])
    for section, tunings in sections:
        try:
            for mib in args.chunks_mib:
                ch = Chunk(Layout.block_major, mib * MiB, range(HEADS), gen)
                for tuning in tunings:
                    cuda_ops.ensure_compiled(tuning=tuning)
                    if section == "bulk" and mib == min(args.chunks_mib):
                        ch.verify(tuning)
                    b.measure("block_major", ch, mib, few, tuning)
                del ch
                torch.cuda.empty_cache()
        except Exception as e:  # the bulk path is experimental: keep what was measured
            b.errors.append(f"{section}: {type(e).__name__}: {e}")
            console.print(f"[red]{section} tunings failed: {e}")
        b.save()

    print_table(b, props, console)


def ceilings(b: Bench, gen: torch.Generator) -> None:
    """scripts/kernel_ceilings.py's rows: the linear copy on each CTA count, the copy engines on none."""
    import kernel_ceilings as kc

    arch = cuda_ops.device_arch(0)
    for mib in b.args.chunks_mib:
        n = mib * MiB
        linear_rows(b, kc, arch, mib)
        for name, layout, heads in (("block_major", Layout.block_major, range(HEADS)),
                                    ("layer_major", Layout.layer_major, range(HEADS)),
                                    ("block_major heads 0-3", Layout.block_major, range(HEADS // 2))):
            ch = Chunk(layout, n, heads, gen)
            try:
                ce = kc.CopyEngines(ch)
                ch.wire.zero_()
                ce()
                want = torch.empty_like(ch.wire)
                reference.pack(ch.pool_bytes, ch.pool, ch.num_blocks, ch.rect, ch.ids, 0, want)
                assert torch.equal(ch.wire, want), "the copy engines' pack differs from the reference"
                g = gbps(ch.nbytes, time_ms(ce, b.args.iters))
                b.rows.append({"case": name, "chunk_mib": mib, "op": "pack by copy engines", "ctas": 0,
                               "kernel": f"cuMemcpyBatchAsync, {ce.count} copies", "copies": ce.count,
                               "host_ms": ce.host_ms(b.args.iters), "gbps": g, "copy_gbps": b.copy_gbps[mib],
                               "ratio": g / b.copy_gbps[mib]})
            except Exception as e:  # noqa: BLE001 - a driver without the batch API: say so, keep the rest
                b.errors.append(f"copy engines {name} {mib} MiB: {type(e).__name__}: {e}")
            del ch
            torch.cuda.empty_cache()


def linear_rows(b: Bench, kc, arch: str, mib: int) -> None:
    n = mib * MiB
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    for threads, unroll in kc.LINEAR_TUNINGS:
        k = kc.linear_copy(arch, unroll)
        kc.launch_linear(k, src, dst, 32, threads)
        assert torch.equal(src, dst), "the linear copy differs from its source"
        for ctas in [*b.args.ctas, 64]:
            g = gbps(n, time_ms(lambda: kc.launch_linear(k, src, dst, ctas, threads), b.args.iters))  # noqa: B023
            b.rows.append({"case": "one buffer", "chunk_mib": mib, "op": "linear copy", "ctas": ctas,
                           "kernel": f"linear {threads}x{unroll}", "threads": threads, "unroll": unroll,
                           "gbps": g, "copy_gbps": b.copy_gbps[mib], "ratio": g / b.copy_gbps[mib]})


def print_table(b: Bench, props, console) -> None:
    from rich.table import Table

    table = Table(title=f"pack/unpack vs d2d copy on {props.name} (GB/s, read + written)")
    for col in ("case", "MiB", "kernel", "op", "ctas", "GB/s", "copy", "ratio"):
        table.add_column(col, justify="left" if col in ("case", "kernel", "op") else "right")
    for r in b.rows:
        table.add_row(r["case"], str(r["chunk_mib"]), r["kernel"], r["op"], str(r["ctas"]), f"{r['gbps']:.0f}",
                      f"{r['copy_gbps']:.0f}", f"{r['ratio']:.2f}")
    console.print(table)
    console.print("d2d copy GB/s:", {k: round(v) for k, v in b.copy_gbps.items()})
    for k, v in b.summary().items():
        console.print(f"best at <= 32 CTAs, {k}: {v['kernel']} on {v['ctas']} CTAs ({v['case']}): "
                      f"{v['gbps']:.0f} GB/s = {v['ratio']:.2f} of copy")
    if b.errors:
        console.print("[red]errors:", b.errors)
    console.print(f"wrote {b.args.out}")


if __name__ == "__main__":
    main()
