"""Per-request figures and the run summary, from every rank's parts (kvlab.records types), and the table.

Times are absolute wall seconds on a shared epoch (kvlab.clock). A request's ``seconds``
runs from its first chunk free to go on a ctx rank (the prefill wrote its layer) to the last
of its ranks finishing; ``wire_s`` is the time at least one of its chunks was on the wire
(union of post->done intervals on the ctx side); ``pack_s``/``unpack_s`` the copy time spent
on ctx/gen ranks; the serving timeline (arrival, queue, prefill, first and last chunk,
exposed transfer, TTFT) and its percentiles come from kvlab.serving.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
from rich.console import Console
from rich.table import Table

from kvlab import serving
from kvlab.clock import Clock
from kvlab.records import Env, Link, Peak, RankPart, RequestRow, Summary, TimelineRow


@dataclass
class RequestRecord:
    """This rank's part of one request while it runs (clock marks); ``resolve`` turns it into plain values."""

    request: int
    isl: int
    side: str
    rank: int
    chunks_total: int
    start: object = None
    end: object = None
    bytes: int = 0
    chunks: int = 0
    in_place: int = 0
    descriptors: int = 0  # memory descriptors the transport posted for this rank's chunks (nixl direct: runs)
    pack: list = field(default_factory=list)  # (start mark, end mark) per packed/unpacked chunk
    wire: list = field(default_factory=list)  # (posted mark, done mark) per chunk
    prefill_start: object = None  # host seconds (prefill=sim) or a GPU event (prefill=gpu)
    prefill_end: object = None
    arrival: float | None = None  # host time (kvlab.clock epoch + the timeline's arrival)
    next_layer: int = 0  # the prefill's next global layer (ctx)
    layer_ready: dict = field(default_factory=dict)  # global layer -> when its cache was written (mark)
    first_post: object = None  # mark of its first chunk's start on this rank
    slot_wait: float = 0.0  # host seconds its chunks waited for a free slot
    prefill_alone_s: float | None = None  # prefill=gpu: the same prefill with nothing else on the GPU
    layer_done: dict = field(default_factory=dict)  # global layer -> mark of its last chunk's completion
    errors: list = field(default_factory=list)
    fill_s: float = 0.0  # host seconds writing the request's cache (ctx)
    verify_s: float = 0.0  # host seconds checking it (gen)
    in_loop: list = field(default_factory=list)  # ["verify"] when the check ran inside the transfer loop


def flatten(d: dict, prefix: str = "") -> dict:
    """Nested dicts as one level of dotted keys (summary fields as table columns)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = v
    return out


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(tuple(i) for i in intervals):  # parts read back from JSON hold lists
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def resolve(rec: RequestRecord, clock: Clock, num_layers: int) -> RankPart:
    """Plain values of one rank's record (GPU events turned into seconds)."""
    s = clock.seconds
    opt = lambda mark: None if mark is None else s(mark)  # noqa: E731 -- host seconds or GPU events
    return RankPart(
        request=rec.request, isl=rec.isl, side=rec.side, rank=rec.rank, start=s(rec.start), end=s(rec.end),
        bytes=rec.bytes, chunks=rec.chunks, in_place=rec.in_place, descriptors=rec.descriptors,
        copy_s=sum(clock.span(a, b) for a, b in rec.pack),
        wire=[(s(a), s(b)) for a, b in rec.wire],
        prefill_start=opt(rec.prefill_start), prefill_end=opt(rec.prefill_end),
        layer_done={int(k): s(v) for k, v in rec.layer_done.items()},
        errors=list(rec.errors), num_layers=num_layers,
        arrival=rec.arrival, epoch=clock.epoch, chunks_total=rec.chunks_total, first_post=opt(rec.first_post),
        slot_wait=rec.slot_wait, prefill_alone_s=rec.prefill_alone_s,
        layer_ready={int(k): s(v) for k, v in rec.layer_ready.items()},
        fill_s=rec.fill_s, verify_s=rec.verify_s, in_loop=list(rec.in_loop))


def merge(parts: list[RankPart], failures: dict[int, str], ctx_dp: dict[int, int], gen_dp: dict[int, int],
          layerwise: bool = True) -> tuple[list[RequestRow], list[TimelineRow]]:
    """(results rows, timeline rows: per layer, for layer-wise runs) from every rank's parts."""
    by_req: dict[int, list[RankPart]] = {}
    for p in parts:
        by_req.setdefault(p.request, []).append(p)
    rows, timeline = [], []
    for rid in sorted(set(by_req) | set(failures)):
        ps = by_req.get(rid, [])
        ctx = [p for p in ps if p.side == "ctx"]
        gen = [p for p in ps if p.side == "gen"]
        # the transfer starts when ctx has the request (gen ranks open it earlier to post receives)
        start = min((p.start for p in (ctx or ps)), default=None)
        # it ends when the last gen rank holds the bytes (a pull transport's ctx rank finishes later, once the
        # readers have said so; on a shared GPU its end mark may also queue behind the gen rank's verification)
        end = max((p.end for p in (gen or ps) if p.end is not None), default=None)
        nbytes = sum(p.bytes for p in gen)
        seconds = (end - start) if start is not None and end is not None else None
        errors = [e for p in gen for e in p.errors]
        if rid in failures:
            errors.append(failures[rid])
        rows.append(RequestRow(
            request=rid, isl=ps[0].isl if ps else None, ctx_dp=ctx_dp.get(rid), gen_dp=gen_dp.get(rid),
            bytes=nbytes, chunks=sum(p.chunks for p in gen), in_place_chunks=sum(p.in_place for p in gen),
            ctx_in_place_chunks=sum(p.in_place for p in ctx), descriptors=sum(p.descriptors for p in ctx),
            seconds=seconds, start=start, end=end,
            gbps=nbytes / seconds / 1e9 if seconds else None,
            pack_s=sum(p.copy_s for p in ctx), wire_s=_union([w for p in ctx for w in p.wire]),
            unpack_s=sum(p.copy_s for p in gen),
            verified=bool(gen) and not errors and rid not in failures, error="; ".join(errors) or None,
            fill_s=sum(p.fill_s for p in ctx), verify_s=sum(p.verify_s for p in gen),
            in_loop=sorted({w for p in ps for w in p.in_loop}),
            **serving.request_timeline(ctx, gen)))
        for p in ctx:
            if p.prefill_end is None or not layerwise:
                continue
            for layer, done in p.layer_done.items():
                timeline.append(TimelineRow(request=rid, rank=p.rank, layer=layer,
                                            prefill_done_s=p.layer_ready[layer] - p.prefill_start,
                                            transfer_done_s=done - p.prefill_start))
    return rows, timeline


def summarize(rows: list[RequestRow], parts: list[RankPart], setup, peaks: list[Peak], env: Env,
              errors: list[str], predicted_s: float | None, silent: list[int], link: Link | None = None
              ) -> Summary:
    starts = [p.start for p in parts if p.side == "ctx"] or [p.start for p in parts]
    ends = ([p.end for p in parts if p.side == "gen" and p.end is not None]
            or [p.end for p in parts if p.end is not None])
    seconds = (max(ends) - min(starts)) if starts and ends else 0.0
    total = sum(r.bytes for r in rows)
    gbps = total / seconds / 1e9 if seconds else 0.0
    isl = [r.isl for r in rows if r.isl]
    side = lambda s: {"tp": s.tp, "pp": s.pp, "dp": s.dp, "tokens_per_block": s.tokens_per_block,  # noqa: E731
                      "layout": s.layout.value}
    return Summary(
        total_bytes=total,
        verified=bool(rows) and all(r.verified for r in rows) and not errors,
        gbps=gbps,
        seconds=seconds,
        peak_staging_bytes=max((p.staging for p in peaks), default=0),
        peak_extra_device_bytes=max((p.extra for p in peaks), default=0),
        device_free_drop_bytes=max((p.free_drop for p in peaks), default=0),
        cache_bytes=max((p.cache for p in peaks), default=0),
        exposed_s=max((r.exposed_s for r in rows if r.exposed_s is not None), default=None),
        requests=len(rows),
        failed_requests=[r.request for r in rows if not r.verified],
        errors=list(errors),
        strategy=setup.transfer.strategy.name,
        transport=setup.transport.name,
        model=setup.model.name,
        isl_mean=sum(isl) / len(isl) if isl else 0,
        isl_max=max(isl, default=0),
        slot_bytes=setup.transfer.slot_bytes,
        slots=setup.transfer.slots,
        ctx=side(setup.ctx), gen=side(setup.gen),
        world_size=setup.world_size,
        backend=env.backend, device=env.device, kernels=env.kernels,
        torch=torch.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        predicted_s=predicted_s,
        silent_ranks=list(silent),
        arrival=setup.workload.arrival, prefill=setup.prefill.kind,
        serving=serving.percentiles(rows),
        link_gbps=link.gbps if link else None,
        link_ratio=gbps / link.gbps if link and link.gbps and gbps else None,
        link=link,
        fill_s=sum(r.fill_s for r in rows),
        verify_s=sum(r.verify_s for r in rows),
        in_loop_requests={"verify": sum("verify" in r.in_loop for r in rows)},
    )


def print_table(rows: list[RequestRow], summary: Summary, console: Console | None = None, limit: int = 12) -> None:
    if console is None:
        console = Console()
        if not console.is_terminal:  # a log file or a pipe: rich's 80 columns would cut the table's columns
            console = Console(width=max(console.width, 132))
    c, g = summary.ctx, summary.gen
    t = Table(title=f"kvlab run: {summary.model}, {summary.strategy}, ctx tp{c['tp']} pp{c['pp']} dp{c['dp']} -> "
                    f"gen tp{g['tp']} pp{g['pp']} dp{g['dp']}, {summary.device}")
    for col in ("request", "tokens", "MiB", "ms", "GB/s", "arrival ms", "TTFT ms", "exposed ms", "verified"):
        t.add_column(col, justify="right")
    shown = rows if len(rows) <= limit else rows[: limit - 1]
    for r in shown:
        t.add_row(str(r.request), str(r.isl), f"{r.bytes / 2**20:,.2f}",
                  f"{(r.seconds or 0) * 1e3:,.1f}", f"{r.gbps or 0:,.2f}",
                  *("" if v is None else f"{v * 1e3:,.1f}" for v in (r.arrival_s, r.ttft_s, r.exposed_s)),
                  "yes" if r.verified else "[red]NO[/red]")
    if len(shown) < len(rows):
        t.add_row("...", f"{len(rows) - len(shown)} more", "", "", "", "", "", "", "")
    t.add_section()
    t.add_row("all", "", f"{summary.total_bytes / 2**20:,.2f}", f"{summary.seconds * 1e3:,.1f}",
              f"{summary.gbps:,.2f}", "", "", "", "yes" if summary.verified else "[red]NO[/red]")
    console.print(t)
    link = summary.link
    if summary.link_gbps:
        # requests share the link with each other: only the run as a whole has a ratio
        mib = f"{link.message_bytes / 2**20:,.2f} MiB"
        what = {"p2p": f"raw messages of {mib} between the same ranks",
                "nixl": f"raw NIXL WRITEs of {mib} between the same ranks"}.get(
            link.reference, f"a local copy_ of the same {mib} pieces")
        console.print(f"link_ratio {summary.link_ratio or 0:.3f}: delivered {summary.gbps:,.2f} GB/s against "
                      f"{summary.link_gbps:,.2f} GB/s of {what}, in the same run")
    line = serving.summary_line(summary.serving)
    if line:
        console.print(f"{summary.arrival} arrivals, prefill={summary.prefill}; {line}", markup=False,
                      highlight=False)
    console.print(f"peak staging {summary.peak_staging_bytes / 2**20:,.2f} MiB per rank, "
                  f"peak extra device memory {summary.peak_extra_device_bytes / 2**20:,.2f} MiB")
