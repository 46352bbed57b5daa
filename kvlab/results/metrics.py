"""Per-request figures and the run summary, from every rank's parts (kvlab.results.records types), the terminal's
table, and the identities they obey.

Times are absolute wall seconds on a shared epoch (kvlab.core.clock). What each figure means and how
it is computed is kvlab.core.figures.TABLE: ``merge`` makes one row per request from its parts with it,
``summarize`` the run's figures, ``print_table`` shows the figures it gives a column, and
``violations`` checks the identities the figures obey (kvlab.core.figures says which).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
from rich.console import Console
from rich.table import Table

from kvlab.core import figures, serving
from kvlab.core.clock import Clock
from kvlab.core.decode_spec import check_line
from kvlab.core.paths import provenance
from kvlab.model.parallel import label
from kvlab.results.records import Env, Link, Peak, RankPart, RequestRow, Summary, TimelineRow


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
    peer_bytes: dict = field(default_factory=dict)  # side-local rank of the other side -> bytes moved with it
    chunks: int = 0
    in_place: int = 0
    descriptors: int = 0  # memory descriptors the transport posted for this rank's chunks (nixl direct: runs)
    pack: list = field(default_factory=list)  # (start mark, end mark) per packed/unpacked chunk
    wire: list = field(default_factory=list)  # (posted mark, done mark) per chunk
    prefill_start: object = None  # host seconds (prefill=sim) or a GPU event (prefill=gpu)
    prefill_end: object = None
    arrival: float | None = None  # host time (kvlab.core.clock epoch + the timeline's arrival)
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
    # prefix reuse (gen, kvlab.model.prefix): bytes of its plan this rank already held; trace blocks hit and looked up
    skipped_bytes: int = 0
    prefix_hit_blocks: int | None = None
    prefix_blocks: int | None = None


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


def resolve(rec: RequestRecord, clock: Clock, num_layers: int) -> RankPart:
    """Plain values of one rank's record (GPU events turned into seconds)."""
    s = clock.seconds
    opt = lambda mark: None if mark is None else s(mark)  # noqa: E731 -- host seconds or GPU events
    return RankPart(
        request=rec.request, isl=rec.isl, side=rec.side, rank=rec.rank, start=opt(rec.start), end=opt(rec.end),
        bytes=rec.bytes, peer_bytes=dict(rec.peer_bytes), chunks=rec.chunks, in_place=rec.in_place,
        descriptors=rec.descriptors,
        copy_s=sum(clock.span(a, b) for a, b in rec.pack),
        wire=[(s(a), s(b)) for a, b in rec.wire],
        prefill_start=opt(rec.prefill_start), prefill_end=opt(rec.prefill_end),
        layer_done={int(k): s(v) for k, v in rec.layer_done.items()},
        errors=list(rec.errors), num_layers=num_layers,
        arrival=rec.arrival, epoch=clock.epoch, chunks_total=rec.chunks_total, first_post=opt(rec.first_post),
        slot_wait=rec.slot_wait, prefill_alone_s=rec.prefill_alone_s,
        layer_ready={int(k): s(v) for k, v in rec.layer_ready.items()},
        fill_s=rec.fill_s, verify_s=rec.verify_s, in_loop=list(rec.in_loop), skipped_bytes=rec.skipped_bytes,
        prefix_hit_blocks=rec.prefix_hit_blocks, prefix_blocks=rec.prefix_blocks)




def _by_request(parts: list[RankPart]) -> dict[int, list[RankPart]]:
    out: dict[int, list[RankPart]] = {}
    for p in parts:
        out.setdefault(p.request, []).append(p)
    return out


def _pairs(order) -> dict[int, list[tuple[int, int]]] | None:
    if order is None:
        return None
    out: dict[int, list[tuple[int, int]]] = {}
    for c in order:
        out.setdefault(c.request, []).append((c.src, c.dst))
    return out


def _parts(rid: int, ps: list[RankPart], traits: figures.Traits, pairs) -> figures.Parts:
    return figures.Parts([p for p in ps if p.side == "ctx"], [p for p in ps if p.side == "gen"], traits,
                         None if pairs is None else pairs.get(rid, []))


def merge(parts: list[RankPart], failures: dict[int, str], ctx_dp: dict[int, int], gen_dp: dict[int, int],
          layerwise: bool = True, traits: figures.Traits = figures.PLAIN, order=None, slo=None
          ) -> tuple[list[RequestRow], list[TimelineRow]]:
    """(results rows, timeline rows: per layer, for layer-wise runs) from every rank's parts. ``traits``: the
    run's transport's (kvlab.core.figures.Traits.of): which figures it has; ``order``: the global chunk order
    (kvlab.config.workload), which pairs each chunk's marks on its two sides (kvlab.core.figures: in flight);
    ``slo``: the
    run's SLOs (kvlab.core.serving.SloSpec), which each request meets or not."""
    by_req, pairs = _by_request(parts), _pairs(order)
    rows, timeline = [], []
    for rid in sorted(set(by_req) | set(failures)):
        ps = by_req.get(rid, [])
        request = _parts(rid, ps, traits, pairs)
        errors = [e for p in request.gen for e in p.errors]
        if rid in failures:
            errors.append(failures[rid])
        request.verified, request.slo = bool(request.gen) and not errors and rid not in failures, slo
        rows.append(RequestRow(
            request=rid, isl=ps[0].isl if ps else None, ctx_dp=ctx_dp.get(rid), gen_dp=gen_dp.get(rid),
            verified=request.verified, error="; ".join(errors) or None,
            in_loop=sorted({w for p in ps for w in p.in_loop}), **figures.request_values(request)))
        for p in request.ctx:
            if p.prefill_end is None or not layerwise:
                continue
            for layer, done in p.layer_done.items():
                timeline.append(TimelineRow(request=rid, rank=p.rank, layer=layer,
                                            prefill_done_s=p.layer_ready[layer] - p.prefill_start,
                                            transfer_done_s=done - p.prefill_start))
    return rows, timeline


def summarize(rows: list[RequestRow], parts: list[RankPart], setup, peaks: list[Peak], env: Env,
              errors: list[str], predicted_s: float | None, silent: list[int], link: Link | None = None,
              traits: figures.Traits = figures.PLAIN, order=None) -> Summary:
    """The run's figures (kvlab.core.figures) and what it was; ``traits`` and ``order`` as for ``merge``."""
    pairs = _pairs(order)
    run = figures.Run(rows, [_parts(rid, ps, traits, pairs) for rid, ps in _by_request(parts).items()], peaks, link)
    isl = [r.isl for r in rows if r.isl]
    side = lambda s: {"tp": s.tp, "pp": s.pp, "dp": s.dp, "tokens_per_block": s.tokens_per_block,  # noqa: E731
                      "layout": s.layout.value, "cp": s.cp, "cp_scheme": s.cp_scheme, "dcp": s.dcp,
                      "dcp_interleave": s.dcp_interleave}
    return Summary(
        verified=bool(rows) and all(r.verified for r in rows) and not errors,
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
        serving=serving.percentiles(rows, setup.serving.percentiles),
        slo={k: v for k, v in vars(setup.serving.slo).items() if v is not None},
        repeat=setup.repeat,
        link=link,
        in_loop_requests={"verify": sum("verify" in r.in_loop for r in rows)},
        provenance=provenance(),
        **figures.run_values(run, traits),
    )


def violations(rows: list[RequestRow], summary: Summary | None = None, parts: list[RankPart] | None = None,
               plan=None, tol: float = 1e-5, pulls: bool = False) -> list[str]:
    """The identities of kvlab.core.figures that the rows, the summary and the parts break, one line each (none: []).

    ``plan``: what the run was to move, as segments by request (a ``kvlab.config.workload.RunPlan``'s) or any
    iterable of segments or chunks (``request``, ``src``, ``dst``, ``nbytes``). ``tol``: seconds of slack in
    the time identities, for marks of absolute wall time (about 0.2 us resolution each) subtracted and added.
    ``pulls``: the run's transport pulls (``Transport.pulls``): a gen rank's copies are then its chunks' flight.
    """
    out = []
    if pulls:
        busy = {r.request: r.busy_s for r in rows if r.busy_s is not None}
        # a ctx rank that sent no report (it died, or its part came after the summary) took its chunks' marks along:
        # their flight is not in busy_s. Ctx ranks are the first world ranks, so a silent world rank is its own
        silent = set(summary.silent_ranks or ()) if summary is not None else set()
        reported = {(p.request, p.rank) for p in parts or () if p.side == "ctx" and p.rank not in silent}
        for p in parts or ():
            if p.side == "gen" and p.request in busy and p.copy_s > busy[p.request] + tol \
                    and all((p.request, src) in reported for src in p.peer_bytes):
                out.append(f"request {p.request}: gen{p.rank}'s copies took {p.copy_s:.6f} s, more than its time "
                           f"in flight (busy_s) {busy[p.request]:.6f}")
    for r in rows:
        q = f"request {r.request}"
        parts_of_ttft = (r.queue_s, r.prefill_s, r.exposed_s)
        if r.ttft_s is not None and None not in parts_of_ttft and abs(r.ttft_s - sum(parts_of_ttft)) > tol:
            out.append(f"{q}: ttft_s {r.ttft_s:.6f} != queue_s + prefill_s + exposed_s {sum(parts_of_ttft):.6f}")
        if r.exposed_s is not None and r.exposed_s < 0:
            out.append(f"{q}: exposed_s {r.exposed_s:.6f} < 0")
        if r.exposed_s is not None and r.seconds is not None and r.exposed_s > r.seconds + tol:
            out.append(f"{q}: exposed_s {r.exposed_s:.6f} > its transfer span (seconds) {r.seconds:.6f}")
        if r.busy_s is not None and r.seconds is not None and r.busy_s > r.seconds + tol:
            out.append(f"{q}: busy_s {r.busy_s:.6f} > its transfer span (seconds) {r.seconds:.6f}")
        if r.prefix_blocks is not None and not 0 <= r.prefix_hit_blocks <= r.prefix_blocks:
            out.append(f"{q}: prefix_hit_blocks {r.prefix_hit_blocks} outside [0, prefix_blocks {r.prefix_blocks}]")
        if r.skipped_bytes and not r.prefix_hit_blocks:
            out.append(f"{q}: skipped_bytes {r.skipped_bytes} without a prefix hit")
        if r.ttft_no_reuse_s is not None and r.ttft_no_reuse_s < r.ttft_s - tol:
            out.append(f"{q}: ttft_no_reuse_s {r.ttft_no_reuse_s:.6f} < ttft_s {r.ttft_s:.6f}")
    if summary is not None and summary.busy_s is not None and summary.makespan_s is not None \
            and summary.busy_s > summary.makespan_s + tol:
        out.append(f"run: busy_s {summary.busy_s:.6f} > makespan_s {summary.makespan_s:.6f}")
    if plan is not None:
        out += _bytes_violations(rows, parts or [], plan)
    return out


def _bytes_violations(rows: list[RequestRow], parts: list[RankPart], plan) -> list[str]:
    """Bytes each rank moved for each request, and each verified request's, against the plan's."""
    pieces = [s for v in plan.values() for s in v] if isinstance(plan, dict) else list(plan)
    side: dict[tuple, int] = {}
    pair: dict[tuple, int] = {}
    total: dict[int, int] = {}
    for s in pieces:
        side[(s.request, "ctx", s.src)] = side.get((s.request, "ctx", s.src), 0) + s.nbytes
        side[(s.request, "gen", s.dst)] = side.get((s.request, "gen", s.dst), 0) + s.nbytes
        pair[(s.request, s.src, s.dst)] = pair.get((s.request, s.src, s.dst), 0) + s.nbytes
        total[s.request] = total.get(s.request, 0) + s.nbytes
    out = []
    for p in parts:
        if p.chunks != p.chunks_total:  # stopped part way: it moved less, and says so elsewhere
            continue
        want = side.get((p.request, p.side, p.rank), 0)
        if p.bytes != want:
            out.append(f"request {p.request} {p.side}{p.rank}: {p.bytes} bytes moved, the plan's {want}")
        for peer, got in p.peer_bytes.items():
            key = (p.request, p.rank, peer) if p.side == "ctx" else (p.request, peer, p.rank)
            if got != pair.get(key, 0):
                out.append(f"request {p.request} ctx{key[1]} -> gen{key[2]}: {got} bytes moved "
                           f"({p.side} side), the plan's {pair.get(key, 0)}")
    for r in rows:
        if r.verified and r.bytes != total.get(r.request, 0):
            out.append(f"request {r.request}: {r.bytes} bytes delivered, the plan's {total.get(r.request, 0)}")
    return out


def prefix_line(summary: Summary) -> str | None:
    """What prefix reuse (gen.prefix_cache_tokens) did for the run: its hit rate over the prompts' full blocks and
    the bytes its gen ranks already held, so did not move; None with reuse off."""
    if summary.prefix_blocks is None:
        return None
    skipped, moved = summary.skipped_bytes or 0, summary.total_bytes or 0
    share = f" ({skipped / (skipped + moved):.1%} of the {(skipped + moved) / 2**20:,.2f} MiB without reuse)" \
        if skipped + moved else ""
    hits = summary.prefix_hit_blocks or 0
    rate = hits / summary.prefix_blocks if summary.prefix_blocks else 0.0
    return (f"prefix reuse: hit rate {rate:.3f} ({hits} of "
            f"{summary.prefix_blocks} full blocks found); skipped {skipped / 2**20:,.2f} MiB{share}, moved "
            f"{moved / 2**20:,.2f} MiB")


DRIFT = 2.0  # predicted/measured beyond this factor either way: the cost profile no longer describes the code


def prediction_line(summary: Summary) -> str | None:
    """The cost model's predicted run time against the measured makespan, in one line, so that a profile that no
    longer matches the code (or the machine) shows in every run; None without both."""
    p, m = summary.predicted_s, summary.makespan_s
    if not p or not m:
        return None
    span = figures.BY_NAME["makespan_s"]
    ratio = p / m
    far = (f"; more than {DRIFT:g}x apart: the cost profile (cost=) no longer describes this code or machine, "
           "kvlab sim calibrate fits one") if not 1 / DRIFT <= ratio <= DRIFT else ""
    return (f"cost model: predicted {span.show(p)} ms against the measured {span.show(m)} ms makespan "
            f"(predicted/measured {ratio:.2f}){far}")


def sharing_line(summary: Summary) -> str | None:
    """One line where processes shared a GPU without MPS: their kernels took turns on it, and the copies'
    figures hold the other processes' turns (kvlab.config.devices.gpu_sharing)."""
    share = summary.gpu_sharing or {}
    if share.get("ranks_per_gpu", 0) <= 1 or share.get("mps") is not False:
        return None
    return (f"up to {share['ranks_per_gpu']} processes shared a GPU without a CUDA MPS daemon: they took turns on it, "
            "and a copy's time holds the turns of the others' kernels (prefills, checks); under MPS "
            "(nvidia-cuda-mps-control -d) they run side by side")


def console_for() -> Console:
    """The terminal's console: its own width on a terminal; on a log file or a pipe 132 columns at least (rich's
    80 would cut the tables' columns)."""
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 132))
    return console


def _request_table(title: str, cols: list, rows: list[RequestRow], summary: Summary, limit: int) -> Table:
    t = Table(title=title)
    for col in ("request", "tokens", *(f.column for f in cols), "verified"):
        t.add_column(col, justify="right", overflow="fold")
    shown = rows if len(rows) <= limit else rows[: limit - 1]
    for r in shown:
        t.add_row(str(r.request), str(r.isl), *(f.show(getattr(r, f.name)) for f in cols),
                  "yes" if r.verified else "[red]NO[/red]")
    if len(shown) < len(rows):
        t.add_row("...", f"{len(rows) - len(shown)} more", *[""] * len(cols), "")
    t.add_section()
    # the run's own value of a column (a total, a union, a rate), not one request's (the largest)
    t.add_row("all", "", *(f.show(getattr(summary, f.summary_name)) if f.run not in (None, "max") else ""
                           for f in cols), "yes" if summary.verified else "[red]NO[/red]")
    return t


def _width(cols: list, rows: list[RequestRow]) -> int:
    """The columns a table of ``cols`` needs with no cell folded and every header word whole."""
    need = 0
    for head, cells in (("request", [str(r.request) for r in rows] + ["all"]), ("tokens", [str(r.isl) for r in rows]),
                        *((f.column, [f.show(getattr(r, f.name)) for r in rows]) for f in cols),
                        ("verified", ["yes"])):
        need += max(map(len, [*head.split(), *cells])) + 3  # a space each side and the rule
    return need + 1


def print_table(rows: list[RequestRow], summary: Summary, console: Console | None = None, limit: int = 12) -> None:
    console = console or console_for()
    c, g = summary.ctx, summary.gen
    device = f", {summary.device}" if summary.device else ""  # an interrupted run's merge may not know it
    title = f"kvlab run: {summary.model}, {summary.strategy}, ctx {label(c)} -> gen {label(g)}{device}"
    # a column no request has a value in (an SLO not set, a check not run) says nothing: left out
    cols = [f for f in figures.columns() if any(getattr(r, f.name) is not None for r in rows)
            or (not rows and f.name not in figures.OPTIONAL_COLUMNS)]
    checks = [f for f in cols if f.name in figures.OPTIONAL_COLUMNS]
    if checks and _width(cols, rows) > console.width:  # the checks' columns in a table of their own
        main = [f for f in cols if f not in checks]
        console.print(_request_table(title, main, rows, summary, limit))
        console.print(_request_table("the checks, per request", checks, rows, summary, limit))
    else:
        console.print(_request_table(title, cols, rows, summary, limit))
    busy, span = figures.BY_NAME["busy_s"], figures.BY_NAME["makespan_s"]
    if summary.busy_s:
        console.print(f"delivered {summary.gbps or 0:,.2f} GB/s over {busy.show(summary.busy_s)} ms with chunks in "
                      f"flight, of the run's {span.show(summary.makespan_s)} ms")
    drift = prediction_line(summary)
    if drift:
        console.print(drift, markup=False, highlight=False)
    link = summary.link
    if summary.link_gbps:
        # requests share the link with each other: only the run as a whole has a ratio
        if summary.link_ratio is None:  # nothing measured in flight: no ratio, rather than a ratio of 0
            console.print(f"link {link.describe()}, in the same run; no delivered figure")
        else:
            console.print(f"link_ratio {summary.link_ratio:.3f}: delivered {summary.gbps:,.2f} GB/s against "
                          f"{link.describe()}, in the same run")
            beaten = link.beaten_by(summary.gbps)
            if beaten:
                console.print(beaten, markup=False, highlight=False)
    shared = sharing_line(summary)
    if shared:
        console.print(shared, markup=False, highlight=False)
    if summary.serving:
        console.print(serving.table(summary.serving))
        console.print(f"{summary.arrival} arrivals, prefill={summary.prefill}; "
                      + "; ".join(serving.report_lines(summary)), markup=False, highlight=False)
    check = check_line(rows)
    if check:
        console.print(check, markup=False, highlight=False)
    reuse = prefix_line(summary)
    if reuse:
        console.print(reuse, markup=False, highlight=False)
    console.print(f"peak staging {summary.peak_staging_bytes / 2**20:,.2f} MiB per rank, "
                  f"peak extra device memory {summary.peak_extra_device_bytes / 2**20:,.2f} MiB")
