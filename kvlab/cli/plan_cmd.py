"""``kvlab plan``: what will move, per (ctx rank -> gen rank), before anything runs.

Plans one request of ``workload.isl`` tokens for every gen attention-DP group, prints a
table of bytes, segments and chunks per pair with totals, and writes ``plan.json``
(``pairs``: src, dst, bytes, ...; ``total_bytes``) into the run directory, with the cost
model's estimate for those requests under ``predicted`` (seconds, gbps, extra_bytes, ...), the
transport the run would use (``transport``; ``transport_why``: why ``transport=auto`` chose it),
why this host could not place it (``transport_problem``, else null), and the most a chunk holds
for that transport (``chunk_cap_bytes``: null when a pulling transport's chunks are not cut by
size; kvlab.config.schema.Setup.chunk_cap).
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from kvlab.config import devices
from kvlab.config.schema import CONF_DIR, Setup, build
from kvlab.config.workload import plan_requests
from kvlab.core.errors import ConfigError
from kvlab.core.paths import write_whole
from kvlab.memory.ops import paths
from kvlab.model import kv_dtype
from kvlab.model.engine_layouts import LAYOUTS
from kvlab.model.parallel import label
from kvlab.model.plan import plan
from kvlab.model.schedule import schedule
from kvlab.model.state import pool_format, side_pools, wire_pool, wire_tile
from kvlab.sizing import budget
from kvlab.sizing.cost import predict


def summarize(setup: Setup) -> dict:
    pairs: dict[tuple[int, int], dict] = defaultdict(lambda: {"bytes": 0, "source_bytes": 0, "segments": 0,
                                                              "chunks": 0, "max_chunk_bytes": 0, "in_place_chunks": 0})
    reqs = plan_requests(setup)
    ctx_rows = {p.name: p.comp_row_bytes() for p in side_pools(setup.model, setup.ctx)}
    per_pool: dict[str, int] = defaultdict(int)
    for req in reqs:
        segs = plan(setup.model, setup.ctx, setup.gen, req)
        chunks = schedule(setup.model, setup.ctx, setup.gen, segs, setup.transfer.strategy, setup.chunk_cap)
        for s in segs:
            p = pairs[(s.src, s.dst)]
            per_pool[s.rect.pool] += s.nbytes
            p["bytes"] += s.nbytes  # on the wire
            p["source_bytes"] += s.rect.nbytes(ctx_rows[s.rect.pool])  # as the ctx pools hold them
            p["segments"] += 1
        for c in chunks:
            p = pairs[(c.src, c.dst)]
            p["chunks"] += 1
            p["max_chunk_bytes"] = max(p["max_chunk_bytes"], c.nbytes)
            p["in_place_chunks"] += int(c.ctx_in_place and c.gen_in_place)
    layouts = {side.name: f"{side.layout.value}/{side.tokens_per_block}" for side in (setup.ctx, setup.gen)}
    rows = [{"src": s, "dst": d, "src_world": setup.world_rank("ctx", s), "dst_world": setup.world_rank("gen", d),
             "ctx_layout": layouts["ctx"], "gen_layout": layouts["gen"], **v} for (s, d), v in sorted(pairs.items())]
    return {
        "model": setup.model.name,
        "isl": setup.workload.isl,
        "requests": len(reqs),
        "strategy": setup.transfer.strategy.name,
        "slot_bytes": setup.transfer.slot_bytes,
        "chunk_cap_bytes": setup.chunk_cap,  # null: not cut by size (a pulling transport, transfer.slot_mib unset)
        "transport": setup.transport.name,
        # why transport=auto picked it (empty when named); whether this host can place it: hydra_main
        "transport_why": setup.transport.auto,
        "ctx": side_summary(setup, setup.ctx),
        "gen": side_summary(setup, setup.gen),
        "pairs": rows,
        "kv_dtype": kv_dtypes(setup),
        "kernels": kernels(setup),
        "total_bytes": sum(r["bytes"] for r in rows),
        "pool_bytes": dict(per_pool),  # on the wire, per pool: how much of a hybrid's transfer is its state
        "total_source_bytes": sum(r["source_bytes"] for r in rows),
        "total_chunks": sum(r["chunks"] for r in rows),
    }


def kv_dtypes(setup: Setup) -> dict:
    """Per pool: each side's format, the wire's, and where the conversion happens (kvlab.model.kv_dtype)."""
    out = {}
    ctx_pools = {p.name: p for p in side_pools(setup.model, setup.ctx)}
    for g in side_pools(setup.model, setup.gen):
        wire, place = wire_pool(setup.model, setup.ctx, setup.gen, g.name)
        kind = str(getattr(g.kind, "value", g.kind))
        formats = (pool_format(ctx_pools[g.name]), pool_format(g))
        out[g.name] = {"ctx": formats[0], "gen": formats[1], "wire": pool_format(wire), "conversion": place,
                       "wire_row_bytes": sum(wire.comp_row_bytes()),
                       "granularity": kv_dtype.granularity(kind) if place != "none" and "fp8" in formats else ""}
    return out


def kernels(setup: Setup) -> dict:
    """Per pool: the GPU kernel that moves it from ctx rank 0's pool into gen rank 0's, and why
    (kvlab.memory.ops.paths: copy_rect's choice, which the pack and unpack conversions share)."""
    return {name: {"path": path, "why": why} for name, (path, why) in paths.pool_paths(setup).items()}


def side_summary(setup: Setup, side) -> dict:
    """A side's parallelism and cache layout: the layout, the engine it is, the block size, the engine's own
    tensor shape, and per pool the wire tile (1 where a side keeps a head's token rows apart)."""
    d = LAYOUTS[side.layout.value]
    pools = setup.model.pools(side.dtype)
    isl = setup.workload.isl
    # context parallelism: which tokens of a workload.isl-token prompt each rank of the first DP group and stage
    # holds (kvlab.model.tokens), as global intervals (a CP rank's chunks) or a count (a DCP rank's interleave runs)
    split = {}
    if side.cp > 1 or side.dcp > 1:
        for r in range(side.cp * side.ranks_tp):
            t = side.tokens(r, setup.model)
            split[f"{side.name}{r}"] = {"tokens": t.count(isl), **({"chunks": t.chunks(isl)} if side.cp > 1 else {})}
    return {"tp": side.tp, "pp": side.pp, "dp": side.dp, "layout": side.layout.value, "engine": d.engine,
            "cp": side.cp, "cp_scheme": side.cp_scheme, "dcp": side.dcp, "dcp_interleave": side.dcp_interleave,
            "tokens_per_rank": split, "label": label(side),
            "tokens_per_block": side.tokens_per_block,
            "shape": {p.name: d.shape_of(str(getattr(p.kind, "value", p.kind))) for p in pools},
            "wire_tile": {p.name: wire_tile(setup.ctx, setup.gen, setup.model, p) for p in pools}}


def predicted(setup: Setup) -> dict:
    """The cost model's estimate for the planned requests (one per gen DP group, all in flight at once)."""
    reqs = plan_requests(setup)
    return predict(setup, reqs, concurrency=len(reqs)).to_dict()


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


def _duration(s: float) -> str:
    return f"{s:,.3f} s" if s >= 1 else f"{s * 1e3:,.3f} ms"


def wide_console() -> Console:
    """The console the plan prints to: as wide as the terminal, or, in a pipe or a log file, wide enough
    that rich's default 80 columns do not cut the tables' columns (as kvlab.results.metrics.print_table)."""
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 132))
    return console


def print_summary(summary: dict, console: Console | None = None) -> None:
    console = console or wide_console()
    cap = summary.get("chunk_cap_bytes", summary["slot_bytes"])
    cut = f"chunks of at most {_mib(cap)} MiB" if cap is not None else \
        f"chunks not cut by size ({summary.get('transport', 'the transport')} pulls)"
    t = Table(title=f"kvlab plan: {summary['model']}, {summary['isl']} tokens x {summary['requests']} request(s), "
                    f"{summary['strategy']}, {cut}")
    for col in ("ctx rank", "gen rank", "ctx layout/tpb", "gen layout/tpb", "MiB", "segments", "chunks",
                "in place", "largest chunk MiB"):
        t.add_column(col, justify="right")
    for r in summary["pairs"]:
        t.add_row(f"ctx{r['src']}", f"gen{r['dst']}", r.get("ctx_layout", ""), r.get("gen_layout", ""),
                  _mib(r["bytes"]), str(r["segments"]), str(r["chunks"]), str(r.get("in_place_chunks", "")),
                  _mib(r["max_chunk_bytes"]))
    t.add_section()
    t.add_row("total", "", "", "", _mib(summary["total_bytes"]), str(sum(r["segments"] for r in summary["pairs"])),
              str(summary["total_chunks"]), str(sum(r.get("in_place_chunks", 0) for r in summary["pairs"])), "")
    console.print(t)
    for name in ("ctx", "gen"):
        side = summary.get(name, {})
        if "layout" in side:  # one line per side, for whoever greps it
            pools = "; ".join(f"{p}: {side['shape'][p]}, wire tile {n}" for p, n in side["wire_tile"].items())
            console.print(f"{name} layout: {side['layout']} ({side['engine']}), {side['tokens_per_block']} tokens "
                          f"per block; {pools}", soft_wrap=True, markup=False)
        if side.get("tokens_per_rank"):  # context parallelism: each rank's share of one prompt
            held = ", ".join(f"{r}: {v['tokens']}" + (" in " + " + ".join(f"[{a}, {b})" for a, b in v["chunks"])
                                                      if "chunks" in v else "")
                             for r, v in side["tokens_per_rank"].items())
            console.print(f"{name} context parallelism: {side['label']}; tokens of {summary['isl']} per rank of the "
                          f"first stage: {held}", soft_wrap=True, markup=False)
    for pool, d in summary.get("kv_dtype", {}).items():
        if d["conversion"] != "none":
            src, wire = summary.get("total_source_bytes", 0), summary["total_bytes"]
            console.print(f"kv dtype of {pool}: ctx {d['ctx']} -> gen {d['gen']}"
                          + (f" (fp8 scales {d['granularity']})" if d["granularity"] else "")
                          + f"; the wire carries {d['wire']}, converted in the {d['conversion']}; all pools: "
                          f"{_mib(wire)} MiB on the wire for {_mib(src)} MiB of ctx cache", soft_wrap=True,
                          markup=False)
    for pool, d in summary.get("kernels", {}).items():
        console.print(f"kernel for {pool}: {d['path']} ({d['why']})", soft_wrap=True, markup=False)
    if len(summary.get("pool_bytes", {})) > 1:  # e.g. how much of a hybrid's transfer is its recurrent state
        total = summary["total_bytes"] or 1
        console.print("bytes per pool: " + ", ".join(f"{name} {_mib(n)} MiB ({100 * n / total:.1f}%)" for name, n
                                                     in summary["pool_bytes"].items()), soft_wrap=True, markup=False)
    if "transport" in summary:
        console.print(f"transport: {summary['transport']} ({summary.get('transport_why') or 'as named'})",
                      soft_wrap=True, markup=False)  # one line, for whoever greps it
    p = summary.get("predicted")
    if p:
        console.print(f"predicted ({p['profile']} rates): {_duration(p['seconds'])}, {p['gbps']:,.2f} GB/s, "
                      f"{p['messages']} messages, extra device memory {_mib(p['extra_bytes'])} MiB per rank "
                      f"(ctx {_mib(p['extra_bytes_ctx'])}, gen {_mib(p['extra_bytes_gen'])})")


def print_budget(b: dict, console: Console | None = None) -> None:
    """What each rank will hold (kvlab.sizing.budget), and what the memories they draw on can give."""
    console = console or wide_console()
    # prefill=model's weights and activations, check=decode's references and shares: shown where a rank has them
    optional = tuple(p for p in ("model", "check") if any(r.get(p) for r in b["ranks"]))
    parts = ("cache", "staging", "tables", "temps", "transport", *optional, "plan", "process")
    t = Table(title=f"memory per rank in MiB, at most ({b['open_requests']} requests open at once)")
    for col in ("rank", "memory", *parts):
        t.add_column(col, justify="right")
    for r in b["ranks"]:
        t.add_row(r["name"], r["memory"], *(_mib(r.get(p, 0)) for p in parts))
    console.print(t)
    for memory, need in b["need"].items():
        have = b["available"].get(memory)
        console.print(f"{memory}: {_mib(need)} MiB needed" + (f", {_mib(have)} MiB available" if have is not None
                                                              else " (free device memory is read by the ranks)"))


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def hydra_main(cfg: DictConfig) -> None:
    setup = build(cfg)
    summary = summarize(setup)
    summary["predicted"] = predicted(setup)
    try:
        devices.check_placement(setup)
        summary["transport_problem"] = None
    except ConfigError as e:  # as with memory below: a plan may be for another machine
        summary["transport_problem"] = str(e)
    memory = budget.measure(setup)
    summary["memory"] = dict(memory.to_dict(), fits=True)
    console = wide_console()
    print_summary(summary, console)
    print_budget(summary["memory"], console)
    if summary["transport_problem"]:
        print(f"kvlab run would stop here: {summary['transport_problem']}")
    try:
        budget.check(setup, memory)
    except ConfigError as e:  # a plan is for looking at setups larger than this machine, too
        summary["memory"]["fits"] = False
        print(f"kvlab run would stop here: {e}")
    out = Path(HydraConfig.get().runtime.output_dir) / "plan.json"
    write_whole(out, json.dumps(summary, indent=2))
    print(f"plan written to {out}")
