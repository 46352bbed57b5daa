"""``transport=ipc`` on one GPU: ctx and gen processes on the same device, every figure next to a
``copy_`` of the same bytes on that device, measured in the same run.

For each case (Llama-3.1-8B at 32k and 128k prompt tokens, DeepSeek-V3.2 at 128k; ctx TP1 -> gen
TP1 with equal layouts, TP1 -> TP2, TP2 -> TP1, block_major tpb 32 -> layer_major tpb 64) one
``kvlab run transport=ipc`` of one verified request: GB/s delivered (kvlab's own clock: ctx's
first chunk to the gen rank's last) / GB/s of ``copy_`` of the same bytes between two buffers of
this GPU, the faster of two forms (median of 3 each): the run's own chunks, one ``copy_`` per
chunk (the same pieces as the run moves), and one ``copy_`` per request (``copy_reference``; the
reference is a ceiling: a delivered figure above its fastest repeat is printed as such), and the
same bytes over the gen rank's copy kernels alone (their events; one gen rank only) with the
rest of each request's time outside them. First, the
copy of one whole reshard (block_major tpb 32 -> layer_major tpb 64) by the run-copy kernel
against the copy engine (``cudaMemcpyBatchAsync`` over the same runs), both checked byte for
byte; last, ``scripts/ipc_handoff.py`` in its own process: the hand-off between two processes'
streams on this GPU, which every one-GPU request pays.

    python scripts/ipc_bench.py --out ipc.json            # every case
    python scripts/ipc_bench.py --out ipc.json --quick    # Llama-3.1-8B 32k only
    python scripts/ipc_bench.py --out engines.json --engines   # the engines' layouts and the KV dtype instead
    python scripts/ipc_bench.py --out gemma.json --gemma       # Gemma-3-27B ctx TP2 -> gen TP1 layer_major tpb 64, 32k
    python scripts/ipc_bench.py ... --set workload.concurrency=1   # more overrides for every case

``--engines``: Llama-3.1-8B and DeepSeek-V3.2 at 32k, TP1 -> TP1, vLLM's NHD cache (``vllm_lbnhc``) on the ctx
side into TensorRT-LLM's (``trtllm``) on the gen side, against ``copy_`` of the same bytes; then the same with
``gen.kv_dtype=fp8`` (the pull converts bf16 into fp8 in its copy): bytes delivered (fp8 rows and scales) and
GB/s of the source bytes (the bf16 sibling's) over the same busy time, against the bf16 run and its ``copy_``,
and against the converting copy's ceiling (``ceiling_gbps``: one request's source bytes read and its delivered
bytes written by scripts/kernel_ceilings.py's ``shrink_copy``; ``copy_`` of the source bytes writes twice what fp8
delivers, so it is the issue's yardstick but no ceiling).

Each request also says whether another request's prefill ran while it was in flight (``beside_prefill``: its
first chunk posted to its last landed, against the others' prefill start to end): on one GPU without MPS the ctx
processes' prefill kernels take turns with the gen rank's copies, so such a request's rate holds theirs. The
steady table gives the median over the requests with none beside them (``alone_median``, of ``alone_n``), the
copy path's own rate end to end.
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

from kvlab.core.clock import median_launches_s  # noqa: E402

GiB = 2**30
MODELS = [("llama3_8b", 32768), ("llama3_8b", 131072), ("deepseek_v32", 131072)]
SIDES = [("TP1 -> TP1", ["ctx.tp=1", "gen.tp=1"]),
         ("TP1 -> TP2", ["ctx.tp=1", "gen.tp=2"]),
         ("TP2 -> TP1", ["ctx.tp=2", "gen.tp=1"]),
         ("block_major tpb 32 -> layer_major tpb 64", ["ctx.tp=1", "gen.tp=1", "gen.tokens_per_block=64",
                                                       "gen.layout=layer_major"])]
ENGINE_MODELS = [("llama3_8b", 32768), ("deepseek_v32", 32768)]
ENGINE_SIDES = [("vllm_lbnhc -> trtllm", ["ctx.tp=1", "gen.tp=1", "ctx.layout=vllm_lbnhc", "gen.layout=trtllm"]),
                ("vllm_lbnhc -> trtllm, gen fp8", ["ctx.tp=1", "gen.tp=1", "ctx.layout=vllm_lbnhc",
                                                   "gen.layout=trtllm", "gen.kv_dtype=fp8"])]
# the issue's Gemma-3 case: two ctx ranks (blocks of 32 tokens) into one gen rank's layer_major blocks of 64 tokens:
# runs of 32 tokens of one head (8 KiB), from two processes' pools
GEMMA_MODELS = [("gemma3_27b", 32768)]
GEMMA_SIDES = [("TP2 -> TP1, gen layer_major tpb 64", ["ctx.tp=2", "gen.tp=1", "gen.layout=layer_major",
                                                       "gen.tokens_per_block=64"])]
# ipc's chunks are not cut by size unless transfer.slot_mib is given: the default gives it its largest chunks
COMMON = ["transport=ipc", "device=cuda", "kernels=cuda", "logger=quiet",
          "transfer=chunked", "transfer.timeout_s=120"]


def copy_reference(overrides: list[str], reps: int = 3):
    """The run's bytes copied on this GPU as it moves them: every chunk of the plan as one ``copy_`` (each
    request's chunks side by side from the start of two buffers of its size), and one ``copy_`` per request;
    a kvlab.results.records.Link of ``reps`` repeats, each counting the faster form."""
    from kvlab.config.schema import build, compose
    from kvlab.config.workload import plan_run
    from kvlab.rank import linkrate

    order = plan_run(build(compose(overrides))).order
    per_request: dict[int, list[int]] = {}
    for c in order:
        per_request.setdefault(c.request, []).append(c.nbytes)
    size = max(sum(v) for v in per_request.values())
    a = torch.zeros(size, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    pieces, wholes = [], []
    for sizes in per_request.values():
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        pieces += list(zip(offsets, sizes))
        wholes.append((0, sum(sizes)))
    forms = [linkrate.views(a, b, pieces), linkrate.views(a, b, wholes)]
    for copies in forms:
        linkrate.copies_s(copies)  # every page touched and the kernels loaded before the clock
    seconds = [[linkrate.copies_s(copies, events=True) for copies in forms] for _ in range(reps)]
    del forms, a, b
    torch.cuda.empty_cache()
    return linkrate.summarize("copy", max(n for _, n in pieces), len(pieces), sum(n for _, n in pieces), seconds,
                              ("pieces", "whole"), size)


def copy_gbps(n: int, reps: int = 3) -> float:
    """Bytes delivered per second by one ``copy_`` of ``n`` bytes on this GPU (median of ``reps``)."""
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    seconds = median_launches_s(lambda src=a, dst=b: dst.copy_(src), trials=reps, warmup=1)
    del a, b
    torch.cuda.empty_cache()
    return n / seconds / 1e9


def ceiling_gbps(source: int, delivered: int, reps: int = 3) -> float:
    """Source bytes per second of the converting copy's ceiling on this GPU: ``source`` bytes read and
    ``delivered`` written by the plainest kernel (scripts/kernel_ceilings.py ``shrink_copy``; median of ``reps``,
    the faster tuning).
    A gen fp8 run reads the bf16 rows and writes fp8 ones: ``copy_`` of the source bytes writes twice as much."""
    import kernel_ceilings as kc

    from kvlab.memory.ops import cuda as cuda_ops

    a = torch.empty(source // 16 * 16, dtype=torch.uint8, device="cuda")
    b = torch.empty(delivered // 16 * 16, dtype=torch.uint8, device="cuda")
    kernels = [kc.shrink_copy(cuda_ops.device_arch(0), u) for u in kc.SHRINK_UNROLLS]
    seconds = min(median_launches_s(lambda s=a, d=b, k=k: kc.launch_shrink(k, s, d), trials=reps, warmup=1)
                  for k in kernels)
    del a, b
    torch.cuda.empty_cache()
    return source / seconds / 1e9


def run_case(model: str, isl: int, label: str, overrides: list[str], keep: Path | None = None,
             requests: int = 1) -> dict:
    """One ``kvlab run``; ``keep``: leave its run directory there (parts, per-rank profiles with KVLAB_PROFILE=1)."""
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        if keep is not None:
            # a name Hydra's override grammar takes as one value (a label's comma would make it a list), and one
            # directory per repeat, so that a later repeat does not overwrite an earlier one's parts
            keep.mkdir(parents=True, exist_ok=True)
            d = Path(tempfile.mkdtemp(prefix=f"{model}-{isl}-{re.sub(r'[^A-Za-z0-9_.]+', '_', label)}-", dir=keep))
        args = [sys.executable, "-m", "kvlab", "run", f"hydra.run.dir={d}", f"model={model}",
                f"workload.isl={isl}", *COMMON, f"workload.requests={requests}", *overrides]
        t0 = time.time()
        p = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=400)
        path = d / "summary.json"
        if p.returncode or not path.exists():
            return {"model": model, "isl": isl, "sides": label, "error": (p.stderr or p.stdout)[-2000:]}
        s = json.loads(path.read_text())
        rows = [json.loads(line) for line in (d / "results.jsonl").read_text().splitlines() if line.strip()]
        beside = beside_prefill(rows)
    return {"model": model, "isl": isl, "sides": label, "overrides": overrides, "bytes": s["total_bytes"],
            "gbps": s["gbps"], "busy_s": s["busy_s"], "makespan_s": s["makespan_s"], "verified": s["verified"],
            "link_gbps": s.get("link_gbps"), "link_ratio": s.get("link_ratio"),
            # kvlab's clock (ctx's first chunk to the gen rank's last) = the copy kernels (unpack_s: their
            # events on the gen stream) + the rest: the hand-off from the ctx process and the gaps between
            # kernels (scripts/ipc_handoff.py, run last, measures the hand-off alone)
            # gbps is bytes over busy_s (kvlab.core.figures), not over seconds: both kept, so gbps x busy_s = bytes
            "requests": [{"seconds": r["seconds"], "busy_s": r["busy_s"], "bytes": r["bytes"], "gbps": r["gbps"],
                          "kernel_s": r["unpack_s"],
                          "other_s": r["seconds"] - r["unpack_s"], "beside_prefill": b}
                         for r, b in zip(rows, beside)],
            "peak_staging_bytes": s["peak_staging_bytes"], "peak_extra_device_bytes": s["peak_extra_device_bytes"],
            # ranks on one GPU take turns on it without MPS: the figures hold the others' kernels
            "gpu_sharing": s.get("gpu_sharing"), "wall_s": time.time() - t0}


def kernel_vs_engine(isl: int = 32768) -> dict:
    """One whole reshard of Llama-3.1-8B's cache in one process (block_major tpb 32 -> layer_major tpb 64):
    the rectangle-copy kernel in a few shapes, and the copy engine over the same runs."""
    from cuda.bindings import runtime as rt

    from kvlab.memory.ops import cuda as cuda_ops
    from kvlab.model.layout import runs
    from kvlab.model.parallel import Layout, SideSpec
    from kvlab.model.plan import Request, plan
    from kvlab.model.spec import ModelSpec
    from kvlab.model.state import CacheState

    model = ModelSpec("llama3_8b", 32, kv_heads=8, head_dim=128)
    ctx, gen = SideSpec("ctx", tokens_per_block=32), SideSpec("gen", tokens_per_block=64, layout=Layout.layer_major)
    (seg,) = plan(model, ctx, gen, Request(0, isl))
    dev = torch.device("cuda")
    sides = []
    for side in (ctx, gen):
        pool = CacheState(model, side, 0).pool(seg.rect.pool)
        nb = -(-isl // pool.tokens_per_block)
        ids = torch.randperm(nb, device=dev)  # scattered blocks, as a paged cache has them
        storage = torch.zeros(pool.pool_bytes(nb), dtype=torch.uint8, device=dev)
        sides.append((storage, pool, nb, ids))
    (src, sp, snb, sids), (dst, dp, dnb, dids) = sides
    src.random_(0, 256)
    n = seg.rect.nbytes(sp.rows)

    def timed(fn) -> float:
        return median_launches_s(fn, trials=5, warmup=1)

    copy = copy_gbps(n)
    # the expected pool through the pack and unpack kernels (tested against the torch reference elsewhere)
    want, wire = torch.zeros_like(dst), torch.empty(n, dtype=torch.uint8, device=dev)
    cuda_ops.pack(src, sp, snb, seg.rect, sids, 0, wire)
    cuda_ops.unpack(wire, dp, dnb, seg.rect, dids, 0, want)
    del wire
    out = {"bytes": n, "runs": int(runs(sp, snb, seg.rect, sids, 0).mem.numel()), "copy_gbps": copy, "kernel": []}
    # ctas None: the resident CTAs (the default); a number: that grid, walked in several waves
    for threads, unroll, ctas in ((256, 8, None), (256, 4, None), (512, 8, None), (128, 8, None), (1024, 4, None),
                                  (256, 8, 132 * 16)):
        tuning = cuda_ops.Tuning(threads=threads, unroll=unroll)
        dst.zero_()
        s = timed(lambda c=ctas, t=tuning: cuda_ops.copy_rect(src, sp, snb, sids, 0, dst, dp, dnb, dids, 0, seg.rect,
                                                              ctas=c, tuning=t))
        out["kernel"].append({"threads": threads, "unroll": unroll, "ctas": ctas, "gbps": n / s / 1e9,
                              "ratio": n / s / 1e9 / copy, "verified": bool(torch.equal(dst, want))})
    dst.zero_()
    try:
        rs, rd = runs(sp, snb, seg.rect, sids, 0), runs(dp, dnb, seg.rect, dids, 0)
        srcs = (rs.mem + src.data_ptr()).tolist()
        dsts = (rd.mem + dst.data_ptr()).tolist()
        sizes = rd.length.tolist()
        attr = rt.cudaMemcpyAttributes()
        attr.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        side = torch.cuda.Stream()  # the batch API refuses the legacy default stream
        stream = side.cuda_stream
        batch = 1 << 16

        def engine():
            for i in range(0, len(sizes), batch):
                k = min(batch, len(sizes) - i)
                (err, *_rest) = rt.cudaMemcpyBatchAsync(dsts[i:i + k], srcs[i:i + k], sizes[i:i + k], k, [attr], [0],
                                                        1, stream)
                if err != rt.cudaError_t.cudaSuccess:
                    raise RuntimeError(f"cudaMemcpyBatchAsync: {err}")

        with torch.cuda.stream(side):
            engine_s = timed(engine)
        out.update(engine_gbps=n / engine_s / 1e9, engine_verified=bool(torch.equal(dst, want)))
    except Exception as e:  # noqa: BLE001 - the comparison is reported, not required
        out["engine_error"] = f"{type(e).__name__}: {e}"
    return out


def beside_prefill(rows: list[dict]) -> list[bool]:
    """Per request (rows of one run's results.jsonl): whether another request's prefill ran while it was in flight,
    its first chunk posted to its last landed (the run's clock, seconds from its epoch)."""
    def span(q: dict, a: str, b: str) -> tuple[float, float] | None:
        return (q[a], q[b]) if q.get(a) is not None and q.get(b) is not None else None

    prefills = [span(q, "prefill_start_s", "prefill_end_s") for q in rows]
    out = []
    for i, q in enumerate(rows):
        moving = span(q, "first_chunk_s", "last_chunk_s")
        out.append(moving is not None and any(p is not None and j != i and p[0] < moving[1] and p[1] > moving[0]
                                              for j, p in enumerate(prefills)))
    return out


def steady(r: dict) -> None:
    """Per repeat: the median of kvlab's GB/s (ctx's first chunk to the gen rank's last, in source bytes for gen
    fp8) of the requests after the run's first (which pays the one-time costs), over the case's ``copy_``;
    ``ratio_median``, ``ratio_min``, ``ratio_max`` over the repeats."""
    scale = r.get("source_bytes", r["bytes"]) / r["bytes"]  # gen fp8: the bf16 bytes the delivered rows stand for
    for ref, name in (("copy_gbps", "ratio"), ("ceiling_gbps", "ceiling")):  # gen fp8 also against its ceiling
        ratios = []
        for rep in r["repeats"] if ref in r else ():
            reqs = rep["requests"] or []
            gbps = sorted(q["gbps"] for q in (reqs[1:] if len(reqs) > 1 else reqs))
            if gbps:
                ratios.append(gbps[len(gbps) // 2] * scale / r[ref])
        r.update(spread(name, ratios))
    # the requests (after each run's first) that moved with no other request's prefill beside them, every repeat's
    alone = [q["gbps"] * scale / r["copy_gbps"] for rep in r["repeats"]
             for q in (rep["requests"] or [])[1:] if q.get("beside_prefill") is False]
    if alone:
        r.update(spread("alone", alone), alone_n=len(alone),
                 steady_n=sum(len((rep["requests"] or [])[1:]) for rep in r["repeats"]))


def spread(name: str, values: list[float]) -> dict:
    """``{name}_median``, ``{name}_min`` and ``{name}_max`` of ``values`` (none where there are none)."""
    v = sorted(values)
    return {f"{name}_median": v[len(v) // 2], f"{name}_min": v[0], f"{name}_max": v[-1]} if v else {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--keep", type=Path, help="keep each run's directory under this folder")
    ap.add_argument("--requests", type=int, default=1, help="requests per run (the first pays one-time costs)")
    ap.add_argument("--no-kernels", action="store_true", help="skip the kernel-against-copy-engine comparison")
    ap.add_argument("--no-handoff", action="store_true", help="skip scripts/ipc_handoff.py")
    ap.add_argument("--engines", action="store_true", help="the engines' layouts and gen fp8 (the docstring)")
    ap.add_argument("--gemma", action="store_true", help="Gemma-3-27B ctx TP2 -> gen TP1 instead (the docstring)")
    ap.add_argument("--models", nargs="*", help="only these models of the set (e.g. llama3_8b)")
    ap.add_argument("--sides", nargs="*", help="only the cases of the set with these labels")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="more overrides for every case and its copy_ reference (e.g. workload.concurrency=1)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs per case: the ratio's median and range over them, each run's requests after its first")
    a = ap.parse_args()
    if a.engines and a.gemma:
        ap.error("--engines and --gemma are two sets of cases: give one")
    models = ENGINE_MODELS if a.engines else GEMMA_MODELS if a.gemma else MODELS[:1] if a.quick else MODELS
    sides = ENGINE_SIDES if a.engines else GEMMA_SIDES if a.gemma else SIDES
    for flag, given, known in (("--models", a.models, [m for m, _ in models]),
                               ("--sides", a.sides, [label for label, _ in sides])):
        unknown = [x for x in given or () if x not in known]
        if unknown:
            ap.error(f"{flag} {' '.join(unknown)}: not in this set of cases; it has {', '.join(map(repr, known))}")
    models = [m for m in models if not a.models or m[0] in a.models]
    sides = [(label, [*ov, *a.set]) for label, ov in sides if not a.sides or label in a.sides]
    env = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
           "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "gpus": torch.cuda.device_count()}
    import cuda.bindings
    env["cuda_bindings"] = cuda.bindings.__version__
    print(json.dumps(env))
    reshard = not (a.no_kernels or a.engines or a.gemma)
    out = {"env": env, "kernel_vs_engine": kernel_vs_engine() if reshard else None, "runs": []}
    print(json.dumps(out["kernel_vs_engine"]))
    torch.cuda.empty_cache()
    from kvlab.results.records import to_dict

    for model, isl in models:
        bf16 = None  # the model's bf16 run: the source bytes and the copy_ of a gen fp8 run
        for label, ov in sides:
            reps = [run_case(model, isl, label, ov, a.keep, a.requests) for _ in range(a.repeats)]
            r = reps[0]
            r["repeats"] = [{"requests": q.get("requests"), "error": q.get("error")} for q in reps]
            if "bytes" in r and "gen.kv_dtype=fp8" in ov:
                if bf16 is not None:  # fp8 rows land: the rate that compares is the source bytes' over the same time
                    r["source_bytes"] = bf16["bytes"]
                    r["copy_gbps"] = bf16["copy_gbps"]
                    r["source_gbps"] = bf16["bytes"] / r["busy_s"] / 1e9
                    r["ratio"] = r["source_gbps"] / r["copy_gbps"]
                    r["vs_bf16"] = r["source_gbps"] / bf16["gbps"]
                    r["ceiling_gbps"] = ceiling_gbps(bf16["requests"][0]["bytes"], r["requests"][0]["bytes"])
                    r["kernel_ratio"] = None
            elif "bytes" in r:
                ref = copy_reference([f"model={model}", f"workload.isl={isl}", *COMMON,
                                      f"workload.requests={a.requests}", *ov])
                r["copy"] = to_dict(ref)
                if ref.bytes != r["bytes"]:  # the plan's chunks are the bytes the run moved: else a bug to look at
                    r["copy_bytes_differ"] = ref.bytes
                r["copy_gbps"] = ref.gbps
                r["ratio"] = r["gbps"] / r["copy_gbps"]
                r["beats"] = ref.beaten_by(r["gbps"])
                if r["beats"]:
                    print(f"{model} {isl} {label}: {r['beats']}", flush=True)
                k = sum(q["kernel_s"] for q in r["requests"])
                # one gen rank: its kernel spans are the copy; two gen processes time-slice, each span holds both
                one_gen = "gen.tp=1" in r["overrides"]
                r["kernel_ratio"] = r["bytes"] / k / 1e9 / r["copy_gbps"] if k and one_gen else None
                bf16 = r
            if "copy_gbps" in r:
                steady(r)
            out["runs"].append(r)
            print(json.dumps(r), flush=True)
            a.out.write_text(json.dumps(out, indent=1))
    if a.engines or a.gemma:  # the steady ratio over repeats
        print("| model | tokens | sides | GiB delivered | GiB of source | GB/s of the source bytes | copy_ GB/s "
              "| ratio | against bf16 | steady ratio, median (range) | with no prefill beside, median (range, n) "
              "| ceiling GB/s | steady ratio to the ceiling | verified |")
        print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: | --- | --- |")
        for r in out["runs"]:
            if "copy_gbps" in r:
                src = r.get("source_bytes", r["bytes"])
                print(f"| {r['model']} | {r['isl']} | {r['sides']} | {r['bytes'] / GiB:.3f} | {src / GiB:.3f} | "
                      f"{r.get('source_gbps', r['gbps']):,.0f} | {r['copy_gbps']:,.0f} | {r['ratio']:.3f} | "
                      f"{r.get('vs_bf16', 1.0):.3f} | {r.get('ratio_median', float('nan')):.3f} "
                      f"({r.get('ratio_min', float('nan')):.3f}-{r.get('ratio_max', float('nan')):.3f}) | "
                      + (f"{r['alone_median']:.3f} ({r['alone_min']:.3f}-{r['alone_max']:.3f}, {r['alone_n']} of "
                         f"{r['steady_n']}) | " if "alone_median" in r else "none | ")
                      + (f"{r['ceiling_gbps']:,.0f} | {r['ceiling_median']:.3f} ({r['ceiling_min']:.3f}-"
                         f"{r['ceiling_max']:.3f}) | " if "ceiling_median" in r else " | | ")
                      + f"{'yes' if r['verified'] else 'NO'} |")
    print("| model | tokens | sides | GiB | GB/s | copy_ GB/s (same pieces or per request, the faster) | ratio "
          "| kernels alone | rest ms "
          "| staging MiB | extra MiB | verified |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in out["runs"]:
        if "bytes" not in r or "copy_gbps" not in r:
            why = r.get("error", "no bf16 sibling")[-200:]
            print(f"| {r['model']} | {r['isl']} | {r['sides']} | failed: {why!r} |")
            continue
        print(f"| {r['model']} | {r['isl']} | {r['sides']} | {r['bytes'] / GiB:.2f} | {r['gbps']:,.0f} | "
              f"{r['copy_gbps']:,.0f} | {r['ratio']:.3f} | {r['kernel_ratio'] or float('nan'):.3f} | "
              f"{sum(q['other_s'] for q in r['requests']) * 1e3:.2f} | {r['peak_staging_bytes'] / 2**20:.0f} | "
              f"{r['peak_extra_device_bytes'] / 2**20:.1f} | {'yes' if r['verified'] else 'NO'} |")
    if not a.no_handoff:  # last, in its own process and time limit: the hand-off between two processes alone
        try:
            p = subprocess.run([sys.executable, str(ROOT / "scripts" / "ipc_handoff.py")], capture_output=True,
                               text=True, cwd=ROOT, timeout=120)
            lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
            out["handoff"] = json.loads(lines[-1]) if p.returncode == 0 and lines else {"error": p.stderr[-3000:]}
        except subprocess.TimeoutExpired as e:
            out["handoff"] = {"error": f"no answer within 120 s: {str(e.stderr or '')[-3000:]}"}
        print(json.dumps(out["handoff"]))
        a.out.write_text(json.dumps(out, indent=1))

if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
