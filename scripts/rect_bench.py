"""The rectangle copy (``transport=ipc``'s kernel) over engine layout pairs, and with the KV dtype converted in it,
against ``copy_`` of the same source bytes on the same GPU, in one process (no transport, no hand-off: the kernel's
own rate, which bounds what a run can deliver).

A whole request of Llama-3.1-8B (32 layers, 8 kv heads, head_dim 128, bf16) or DeepSeek-V3.2 (61 layers, the
576-value MLA row) at 32k tokens, each side in an engine's layout at its own block size, blocks shuffled on both
sides: one ``copy_rect`` of every layer, head and token, as the plan tiles it (the gcd of the block sizes where
both sides keep a head's token rows together, else single rows). Each case: a warm-up, then ``--repeats`` repeats
of ``--iters`` launches timed with CUDA events, each repeat next to ``copy_`` of the same source bytes; the ratio
is the copy's time over the kernel's, per repeat (median and range). ``gen fp8`` cases count the bf16 source
bytes, as scripts/ipc_bench.py does; ``copy_`` of those bytes writes about twice what fp8 delivers, so it is the
issue's yardstick but no ceiling. Each is also timed, interleaved, beside its ceiling: the source bytes read and the
delivered bytes written by the plainest kernel with no layout (``shrink_copy`` in scripts/kernel_ceilings.py, the
faster of its tunings per repeat), ``ceiling_ratio`` its time over the kernel's; where the rows are whole 16-byte
vectors (DeepSeek-V3.2's 1,152 -> 656 bytes), also beside the same traffic with the pair's own pattern (one piece per
token row, each side's runs of rows at random places: ``piece_shrink``), ``scattered_ratio``. Every case is checked
against the torch reference on its first 96 tokens, each ceiling on its own reference.

    python scripts/rect_bench.py --out rect_bench.json [--models llama3_8b deepseek_v32] [--pairs all|engines]
        [--layer-passes 0 4]   (0: one layer per work item, the kernels' earlier form; see cuda.LAYER_PASSES)
        [--convert-layer-passes 4 16]  (gen fp8 cases whose items are one token, cuda.CONVERT_LAYER_PASSES)
        [--convert-rows 4 8]  (gen fp8 cases: rows in flight per lane team, cuda.CONVERT_ROWS)
        [--convert-ring 0 4]  (gen fp8 cases: cp.async slots per warp, 0 for loads in registers, cuda.CONVERT_RING)
        [--convert-ctas 2]    (gen fp8 cases: CTAs per SM the registers are bounded for, cuda.CONVERT_MIN_CTAS)
        [--ceilings]          (first: the same bytes as scattered pieces of one size, scripts/kernel_ceilings.py)

``--ceilings`` times, before the pairs, what the memory gives for a paged cache's access pattern with no layout at
all: Llama-3.1-8B's 32k bytes cut into pieces of 256 B to 32 KiB, each moved whole to or from a random place (on
both sides, or on one), against ``copy_`` of the same bytes. A pair whose contiguous pieces are that long cannot
beat that row; where the row itself is short of 0.9 of ``copy_``, so is every kernel's.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvlab.core.clock import launches_s  # noqa: E402
from kvlab.memory.ops import cuda as cuda_ops  # noqa: E402
from kvlab.memory.ops import paths, reference  # noqa: E402
from kvlab.model.engine_layouts import LAYOUTS, EngineLayout, Layout  # noqa: E402
from kvlab.model.layout import Rect  # noqa: E402
from kvlab.model.spec import Kind, PoolSpec  # noqa: E402
from kvlab.model.state import RankPool  # noqa: E402

MODELS = {"llama3_8b": (Kind.kv, 32, 8, (128, 128)), "deepseek_v32": (Kind.mla, 61, 1, (576,))}
# the pairs of the table, first; --pairs all adds every other pair the model's layouts allow
ENGINE_PAIRS = [("vllm_lbnhc", "trtllm"), ("vllm_lbnhc", "sglang"), ("vllm_lbhnc", "trtllm"),
                ("vllm_lbnhc", "vllm_lbhnc"), ("flashinfer_nhd", "sglang"), ("flashinfer_hnd", "vllm_flash"),
                ("sglang", "trtllm"), ("trtllm", "vllm_lbnhc"), ("vllm_flash", "flashinfer_hnd"),
                ("block_major", "sglang"), ("sglang", "flashinfer_nhd"), ("layer_major", "trtllm"),
                ("block_major", "layer_major"), ("trtllm", "trtllm")]


def layout_of(name: str):
    return Layout(name) if name in Layout.__members__ else EngineLayout(name)


def pool(model: str, layout: str, fmt: str = "") -> RankPool:
    kind, layers, heads, elems = MODELS[model]
    spec = PoolSpec(kind.value, kind, tuple(range(layers)), 0, heads, elems, ("bf16",) * len(elems), fmt)
    tpb = LAYOUTS[layout].block_tokens({kind.value})[0]
    return RankPool(spec, range(layers), range(heads), tpb, layout_of(layout))


class Side:
    def __init__(self, p: RankPool, tokens: int, gen: torch.Generator, fill: bool):
        self.pool = p
        need = -(-tokens // p.tokens_per_block)
        self.num_blocks = need + need // 8
        self.ids = torch.randperm(self.num_blocks, generator=gen)[:need].to(torch.int32).cuda()
        n = p.pool_bytes(self.num_blocks)
        if fill:  # bf16 values (random bytes would hold NaNs for the conversion)
            self.bytes = (torch.randn(n // 2, device="cuda") * 3).to(torch.bfloat16).view(torch.uint8)
        else:
            self.bytes = torch.zeros(n, dtype=torch.uint8, device="cuda")


def time_pair(kernel, copy, iters: int, repeats: int, *more) -> list[tuple[float, ...]]:
    """(kernel ms, copy_ ms, then each of ``more``) per launch, per repeat, interleaved so that all see the same
    clocks."""
    fns = (kernel, copy, *more)
    for _ in range(2):
        for f in fns:
            f()
    torch.cuda.synchronize()
    return [tuple(launches_s(f, iters) * 1e3 for f in fns) for _ in range(repeats)]


def case(model: str, ctx: str, gen_layout: str, fp8: bool, tokens: int, iters: int, repeats: int,
         path: str | None = None) -> dict:
    g = torch.Generator().manual_seed(0)
    sp, dp = pool(model, ctx), pool(model, gen_layout, "fp8" if fp8 else "")
    src, dst = Side(sp, tokens, g, True), Side(dp, tokens, g, False)
    tile = math.gcd(sp.tokens_per_block, dp.tokens_per_block) if sp.token_runs and dp.token_runs else 1
    rect = Rect(sp.name, 0, len(sp.layers), 0, len(sp.heads), 0, tokens, tile)
    nbytes = rect.nbytes(sp.rows)

    def kernel(r=rect):
        cuda_ops.copy_rect(src.bytes, sp, src.num_blocks, src.ids, 0, dst.bytes, dp, dst.num_blocks, dst.ids, 0, r,
                           **({"path": path} if path else {}))

    # the check: the first 96 tokens against the torch reference
    small = Rect(sp.name, 0, len(sp.layers), 0, len(sp.heads), 0, min(96, tokens), tile)
    kernel(small)
    want = torch.zeros_like(dst.bytes)
    reference.copy_rect(src.bytes, sp, src.num_blocks, src.ids, 0, want, dp, dst.num_blocks, dst.ids, 0, small)
    ok = bool(torch.equal(dst.bytes, want))
    del want
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    delivered = rect.nbytes(dp.rows)
    more = []
    if fp8:  # the converting copy's own ceiling: the source bytes read, the delivered ones written, no layout
        import kernel_ceilings as kc

        c = b[:delivered]
        ceiling_ok = True
        for unroll in kc.SHRINK_UNROLLS:
            shrink = kc.shrink_copy(cuda_ops.device_arch(0), unroll)
            c.zero_()
            kc.launch_shrink(shrink, a, c)
            ceiling_ok &= bool(torch.equal(c, kc.shrink_reference(a, delivered)))
            more.append(lambda k=shrink: kc.launch_shrink(k, a, c))
        pattern, pattern_ok, pattern_runs = scattered_ceiling(sp, dp, tokens, a, c)
        more += pattern
    times = time_pair(kernel, lambda: b.copy_(a), iters, repeats, *more)
    ratios = sorted(t[1] / t[0] for t in times)
    kms = sorted(t[0] for t in times)
    cms = sorted(t[1] for t in times)
    shape = None
    if fp8:
        kind, _, _, elems = MODELS[model]
        shape = paths.convert_shape(kind.value, elems[0], "bf16", "bf16", "fp8")
    path = "convert" if fp8 else path or paths.copy_path(sp, dp)[0]
    r = {"model": model, "tokens": tokens, "ctx": ctx, "gen": gen_layout, "gen_fp8": fp8, "tile": tile, "path": path,
         "ctx_tpb": sp.tokens_per_block, "gen_tpb": dp.tokens_per_block, "source_bytes": nbytes,
         "delivered_bytes": delivered, "verified": ok, "one_pass": fp8 and shape is not None,
         "kernel_ms": kms[len(kms) // 2], "copy_ms": cms[len(cms) // 2],
         "gbps": nbytes / kms[len(kms) // 2] / 1e6, "copy_gbps": nbytes / cms[len(cms) // 2] / 1e6,
         "ratio": ratios[len(ratios) // 2], "ratio_min": ratios[0], "ratio_max": ratios[-1], "repeats": times}
    if fp8:  # the time columns after copy_'s: shrink_copy's tunings, then piece_shrink's
        cut = 2 + len(kc.SHRINK_UNROLLS)
        r.update(against_ceiling("ceiling", times, slice(2, cut), nbytes), ceiling_verified=ceiling_ok)
        if pattern:
            r.update(against_ceiling("scattered", times, slice(cut, None), nbytes), scattered_verified=pattern_ok,
                     scattered_runs=pattern_runs)
    return r


def against_ceiling(name: str, times: list[tuple[float, ...]], cols: slice, nbytes: int) -> dict:
    """``{name}_gbps``, ``{name}_ratio``, ``{name}_min``, ``{name}_max``: per repeat, the fastest of a ceiling's
    tunings (``cols`` of each repeat's times) over the kernel's time (column 0); its rate and the median ratio over
    the repeats, and their range."""
    ratios = sorted(min(t[cols]) / t[0] for t in times)
    ms = sorted(min(t[cols]) for t in times)
    return {f"{name}_gbps": nbytes / ms[len(ms) // 2] / 1e6, f"{name}_ratio": ratios[len(ratios) // 2],
            f"{name}_min": ratios[0], f"{name}_max": ratios[-1]}


def scattered_ceiling(sp: RankPool, dp: RankPool, tokens: int, a: torch.Tensor, c: torch.Tensor):
    """The converting copy's ceiling with the pair's own pattern (``piece_shrink`` in scripts/kernel_ceilings.py):
    ([a launch per tuning], verified, (source run, delivered run) in token rows), or ([], None, None) where a
    row is not whole 16-byte vectors, there is more than one component (Llama's 132-byte fp8 rows) or a side's
    last block of a layer would be partial (``--tokens`` not a multiple of its block)."""
    import kernel_ceilings as kc

    (rs,), (rd,) = (sp.rows, dp.rows) if len(sp.rows) == len(dp.rows) == 1 else ((0,), (0,))
    runs = tuple(p.tokens_per_block if p.token_runs else 1 for p in (sp, dp))
    if not (rs % 16 == 0 and rd % 16 == 0 and 0 < rd <= rs <= 2 * rd) or any(tokens % r for r in runs):
        return [], None, None
    n = len(sp.layers) * len(sp.heads) * tokens
    g = torch.Generator().manual_seed(1)
    ps, pd = (kc.run_places(n, run, g).cuda() for run in runs)
    src, dst = a[:n * rs], c[:n * rd]
    ok, fns = True, []
    pick = torch.randint(0, n, (4096,), device="cuda")
    for unroll in kc.SHRINK_UNROLLS:
        k = kc.piece_shrink(cuda_ops.device_arch(0), unroll)
        dst.zero_()
        kc.launch_piece_shrink(k, src, dst, ps, pd, rs, rd)
        want = kc.piece_shrink_reference(src, ps[pick], torch.arange(len(pick), device="cuda"), rs, rd)
        ok &= bool(torch.equal(dst.view(n, rd)[pd[pick].long()].reshape(-1), want))
        fns.append(lambda k=k: kc.launch_piece_shrink(k, src, dst, ps, pd, rs, rd))
    return fns, ok, runs


PIECES = (256, 656, 1152, 4096, 8192, 32768)  # 656: DeepSeek-V3.2's fp8 MLA row (codes, scales, bf16 RoPE)
SCATTERED = ("both", "dst", "src")  # where the pieces lie at random places; elsewhere back to back


def ceilings(nbytes: int, iters: int, repeats: int) -> list[dict]:
    """The scattered-pieces copy (scripts/kernel_ceilings.py) of ``nbytes`` per piece size and side, each against
    ``copy_`` of the same bytes, interleaved; a sample of pieces checked against torch's gather."""
    import kernel_ceilings as kc

    kernel = kc.piece_copy(cuda_ops.device_arch(0))
    a = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    out = []
    for piece in PIECES:
        n = nbytes // piece
        g = torch.Generator(device="cuda").manual_seed(piece)
        line = torch.arange(n, dtype=torch.int32, device="cuda")
        for where in SCATTERED:
            ps = torch.randperm(n, generator=g, device="cuda", dtype=torch.int32) if where != "dst" else line
            pd = torch.randperm(n, generator=g, device="cuda", dtype=torch.int32) if where != "src" else line
            src, dst = a[:n * piece], b[:n * piece]  # copy_ moves the same bytes
            dst.zero_()
            kc.launch_pieces(kernel, src, dst, ps, pd, piece)
            pick = torch.randint(0, n, (4096,), device="cuda")
            ok = bool(torch.equal(dst.view(n, piece)[pd[pick].long()], src.view(n, piece)[ps[pick].long()]))
            times = time_pair(lambda s=src, d=dst, ps=ps, pd=pd, n=piece: kc.launch_pieces(kernel, s, d, ps, pd, n),
                              lambda s=src, d=dst: d.copy_(s), iters, repeats)
            ratios = sorted(c / k for k, c in times)
            kms = sorted(k for k, _ in times)
            r = {"ceiling": "scattered pieces", "piece": piece, "scattered": where, "bytes": n * piece,
                 "gbps": n * piece / kms[len(kms) // 2] / 1e6, "ratio": ratios[len(ratios) // 2],
                 "ratio_min": ratios[0], "ratio_max": ratios[-1], "verified": ok, "repeats": times}
            print(json.dumps({k: v for k, v in r.items() if k != "repeats"}), flush=True)
            out.append(r)
            del ps, pd, src, dst
    del a, b
    torch.cuda.empty_cache()
    return out


def variant(r: dict) -> str:
    return f" ({r['convert_rows']}, ring {r['convert_ring']}, {r['convert_ctas']}/SM)" if r["gen_fp8"] else ""


def pairs_for(model: str, which: str) -> list[tuple[str, str]]:
    kind = MODELS[model][0].value
    ok = [n for n in LAYOUTS if LAYOUTS[n].holds(kind)]
    base = [(a, b) for a, b in ENGINE_PAIRS if a in ok and b in ok]
    if which == "engines":
        return base
    return base + [(a, b) for a in ok for b in ok if (a, b) not in base]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--pairs", choices=["engines", "all"], default="engines")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--paths", nargs="*", default=["span", "runs"],
                    help="the same-format kernels to time (none: only the gen fp8 cases)")
    ap.add_argument("--fp8-pairs", type=int, default=3, help="the first N pairs again with gen fp8")
    ap.add_argument("--layer-passes", type=int, nargs="+", default=[cuda_ops.LAYER_PASSES],
                    help="kvlab.memory.ops.cuda.LAYER_PASSES values to time each case with (0: a layer per item)")
    ap.add_argument("--convert-layer-passes", type=int, nargs="+", default=[cuda_ops.CONVERT_LAYER_PASSES],
                    help="the same for gen fp8 cases whose items are one token (cuda.CONVERT_LAYER_PASSES)")
    ap.add_argument("--convert-rows", type=int, nargs="+", default=[cuda_ops.CONVERT_ROWS],
                    help="kvlab.memory.ops.cuda.CONVERT_ROWS values to time each gen fp8 case with")
    ap.add_argument("--convert-ring", type=int, nargs="+", default=[cuda_ops.CONVERT_RING],
                    help="kvlab.memory.ops.cuda.CONVERT_RING values (0: loads in registers) for each gen fp8 case")
    ap.add_argument("--convert-ctas", type=int, nargs="+", default=[cuda_ops.CONVERT_MIN_CTAS],
                    help="kvlab.memory.ops.cuda.CONVERT_MIN_CTAS values for each gen fp8 case")
    ap.add_argument("--ceilings", action="store_true", help="first, the scattered-pieces ceilings (the docstring)")
    a = ap.parse_args()
    env = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
           "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv)}
    out = {"env": env, "runs": []}
    print(json.dumps(env), flush=True)
    if a.ceilings:
        _, layers, heads, elems = MODELS["llama3_8b"]
        out["ceilings"] = ceilings(a.tokens * layers * heads * 2 * sum(elems), a.iters, a.repeats)
        a.out.write_text(json.dumps(out, indent=1))
    for model in a.models:
        pairs = pairs_for(model, a.pairs)
        todo = [(p, False, path) for p in pairs for path in a.paths] + [(p, True, None) for p in pairs[:a.fp8_pairs]]
        fixed = [(cuda_ops.CONVERT_ROWS, cuda_ops.CONVERT_RING, cuda_ops.CONVERT_MIN_CTAS)]
        tunings = [(rows, ring, ctas) for rows in a.convert_rows for ring in a.convert_ring
                   for ctas in a.convert_ctas]
        variants = [(t, lp, tu) for t in todo for lp in (a.convert_layer_passes if t[1] else a.layer_passes)
                    for tu in (tunings if t[1] else fixed)]
        for ((ctx, gen), fp8, path), lp, (rows, ring, ctas) in variants:
            if fp8:
                cuda_ops.CONVERT_LAYER_PASSES = lp
            else:
                cuda_ops.LAYER_PASSES = lp
            cuda_ops.CONVERT_ROWS, cuda_ops.CONVERT_RING, cuda_ops.CONVERT_MIN_CTAS = rows, ring, ctas
            try:
                r = case(model, ctx, gen, fp8, a.tokens, a.iters, a.repeats, path)
            except Exception as e:  # one case's failure is a row of the table, not the end of the bench
                r = {"model": model, "ctx": ctx, "gen": gen, "gen_fp8": fp8, "error": f"{type(e).__name__}: {e}"}
            r["layer_passes"] = lp
            r["convert_rows"], r["convert_ring"], r["convert_ctas"] = (rows, ring, ctas) if fp8 else (None,) * 3
            torch.cuda.empty_cache()
            out["runs"].append(r)
            a.out.write_text(json.dumps(out, indent=1))
            print(json.dumps({k: v for k, v in r.items() if k != "repeats"}), flush=True)
    print("| model | ctx -> gen | tile | path | layer passes (rows in flight, ring, CTAs/SM) | gen fp8 "
          "| GB/s of source bytes | copy_ GB/s | ratio (median) | range | verified |")
    print("| --- | --- | ---: | --- | ---: | --- | ---: | ---: | ---: | --- | --- |")
    for r in out["runs"]:
        if "error" in r:
            print(f"| {r['model']} | {r['ctx']} -> {r['gen']} | | {r['gen_fp8']} | failed: {r['error'][:120]} |")
            continue
        print(f"| {r['model']} | {r['ctx']} -> {r['gen']} | {r['tile']} | {r['path']} | "
              f"{r['layer_passes']}{variant(r)} | "
              f"{'yes' if r['gen_fp8'] else ''} | "
              f"{r['gbps']:,.0f} | {r['copy_gbps']:,.0f} | {r['ratio']:.3f} | {r['ratio_min']:.3f}-{r['ratio_max']:.3f}"
              f" | {'yes' if r['verified'] else 'NO'} |")
    fp8 = [r for r in out["runs"] if r.get("gen_fp8") and "error" not in r]
    if fp8:
        print("| model | ctx -> gen | GB/s of source bytes | ratio to copy_ of the source bytes "
              "| ceiling: source read, fp8 written, GB/s | ratio to the ceiling (median) | range | verified |")
        print("| --- | --- | ---: | ---: | ---: | ---: | --- | --- |")
        for r in fp8:
            print(f"| {r['model']} | {r['ctx']} -> {r['gen']}{variant(r)} | {r['gbps']:,.0f} | {r['ratio']:.3f} | "
                  f"{r['ceiling_gbps']:,.0f} | {r['ceiling_ratio']:.3f} | {r['ceiling_min']:.3f}-{r['ceiling_max']:.3f}"
                  f" | {'yes' if r['verified'] and r['ceiling_verified'] else 'NO'} |")
    scattered = [r for r in fp8 if r.get("scattered_ratio") is not None]
    if scattered:
        print("| model | ctx -> gen | token rows per run (source, delivered) | ceiling with the pair's pattern, GB/s "
              "| ratio to it (median) | range | verified |")
        print("| --- | --- | --- | ---: | ---: | --- | --- |")
        for r in scattered:
            print(f"| {r['model']} | {r['ctx']} -> {r['gen']}{variant(r)} | {r['scattered_runs'][0]}, "
                  f"{r['scattered_runs'][1]} | {r['scattered_gbps']:,.0f} | {r['scattered_ratio']:.3f} | "
                  f"{r['scattered_min']:.3f}-{r['scattered_max']:.3f} | "
                  f"{'yes' if r['verified'] and r['scattered_verified'] else 'NO'} |")
    if out.get("ceilings"):
        print("| piece | random places on | GB/s | ratio to copy_ (median) | range | verified |")
        print("| ---: | --- | ---: | ---: | --- | --- |")
        for r in out["ceilings"]:
            print(f"| {r['piece']:,} | {r['scattered']} | {r['gbps']:,.0f} | {r['ratio']:.3f} | "
                  f"{r['ratio_min']:.3f}-{r['ratio_max']:.3f} | {'yes' if r['verified'] else 'NO'} |")


if __name__ == "__main__":
    main()
