"""Every figure a run reports, in one table (``TABLE``): its name and unit, what it means, how one
request's parts make it, how the run reduces it, and how the terminal shows it.

Readers and writers of figures take them from here: kvlab.results.records derives the figure fields of
``RequestRow`` (one per request figure) and ``Summary`` (one per run figure) from the table;
kvlab.results.metrics computes rows and summary with it (``request_values``, ``run_values``) and prints the
terminal's table from its ``column`` entries; kvlab.core.serving takes the percentiles and the summary
line of the figures with a ``line``; the wandb sink logs their histograms; kvlab.analysis.sweeps scales
and labels plots with it and lists it (``analysis.figures()``). A new figure is one entry here,
plus, when its raw part is new, where that part is measured (a field of kvlab.results.records.RankPart and
the executor or transport that fills it).

Units: ``B`` bytes, ``count``, ``s`` a duration, ``t`` seconds from the run's start (the clock epoch
every rank shares, kvlab.core.clock), ``epoch s`` absolute wall seconds (order and overlap of requests),
``GB/s`` (10^9 bytes per second), ``x`` a ratio, ``req/s`` requests per second, ``bool`` yes or no.

Serving. A request meets the SLOs (``serving.slo``, kvlab.core.serving.SloSpec) when it verified and every
SLO set holds; ``duration_s`` is the run's serving span, first arrival to last chunk landed, over
which request throughput and goodput count requests (as vLLM's benchmark counts its duration).

In flight. Each side's transport appends a chunk's (posted, done) marks to ``RankPart.wire``, in
the rank's chunk order, so the global order (kvlab.config.workload) pairs a chunk's two sides: it is in
flight from the later of its two posts (a gen rank posts receives, a pulling gen rank its copy,
ahead of the data; the ctx rank posts when the data is ready) to the gen side's done (the bytes
are on the gen rank; a ctx rank sees a send complete when the kernel or the NIC has the bytes,
and a pulling transport's ctx rank only after the reader says so). Without the order (``pairs``
not given), the side that moves the bytes stands for both: the ctx ranks' marks for a pushing
transport, the gen ranks' for a pulling one (``Transport.pulls``). A request's intervals are
clipped to its span [``start``, ``end``]. ``busy_s`` is their union, per request over its own chunks
and per run over every request's, so that concurrent requests count once and time with nothing in
flight (arrivals, prefill, verification) not at all. Delivered GB/s (``gbps``) and ``link_ratio``
are over ``busy_s``; ``makespan_s`` is the run's whole span, which moves with the arrival process.

Absent is not zero. A figure that needs what a transport may lack (``needs``: a trait of
``Transport.has``, e.g. ``"slots"``) is ``None`` in every row, and missing from the percentiles,
the summary line and wandb, for a transport without it. A serving figure is ``None`` for a request
whose parts lack its marks (a failed request, parts written before the timeline existed).

Identities, checked on every run by kvlab.results.metrics.violations (the run prints a line when one
fails) and by the tests on every end-to-end run: ``ttft_s = queue_s + prefill_s + exposed_s``;
``0 <= exposed_s <= seconds`` (the request's transfer span: its first chunk free to go is at the
latest its prefill's end); ``busy_s <= seconds`` per request and ``busy_s <= makespan_s`` for the
run; for a pulling transport, each gen rank's copy time of a request (its share of ``unpack_s``) at most
the request's ``busy_s`` (its pulls are its chunks' flight, one after another on its stream); with prefix
reuse, ``0 <= prefix_hit_blocks <= prefix_blocks``, ``skipped_bytes`` 0 without a hit and
``ttft_no_reuse_s >= ttft_s`` (and, in the tests, bytes + skipped_bytes = the plan's without reuse); the
bytes of each (request, ctx rank) and (request, gen rank), and of each (ctx, gen) pair where the parts
carry ``peer_bytes``, equal the plan's.

Schema 2 (kvlab.results.records.SCHEMA): a figure's ``was`` is its name in older files, which read under
the new name; ``before`` says what its value meant there. Older ``gbps`` and ``link_ratio`` were over
the run's span (now ``makespan_s``), older rows' ``gbps`` over the request's span ``seconds``, and
older ``slot_wait_s`` also counted gen ranks' waits.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MiB = 2**20

# terminal and summary-line format per unit: (scale, format, unit shown)
DISPLAY = {
    "B": (1 / MiB, "{:,.2f}", "MiB"),
    "count": (1, "{:,}", ""),
    "s": (1e3, "{:,.1f}", "ms"),
    "t": (1e3, "{:,.1f}", "ms"),
    "epoch s": (1, "{:,.6f}", "s"),
    "GB/s": (1, "{:,.2f}", "GB/s"),
    "x": (1, "{:.3f}", "x"),
    "req/s": (1, "{:,.3f}", "req/s"),
    "bool": (1, "{}", ""),
    "logit": (1, "{:.4g}", ""),
}


@dataclass(frozen=True)
class Traits:
    """What a run's transport has, for the figures that depend on it (kvlab.transports.Transport)."""

    pulls: bool = False  # the gen ranks move the bytes: their marks stand for a chunk's flight without the order
    has: frozenset[str] = frozenset()  # e.g. "slots": a ctx rank's chunks wait for a free staging slot

    @classmethod
    def of(cls, transport, options: dict | None = None) -> Traits:
        """A transport class's declared traits; ``options``: its config's (a transport whose ``has`` depends on
        them declares it as a function of them)."""
        has = getattr(transport, "has", ())
        return cls(bool(getattr(transport, "pulls", False)), frozenset(has(options or {}) if callable(has) else has))


PLAIN = Traits()  # a pushing transport that declares nothing: no figure that needs a trait


def union(intervals) -> float:
    """Seconds covered by at least one of the (start, end) intervals."""
    total, end = 0.0, -math.inf
    for a, b in sorted(tuple(i) for i in intervals):  # parts read back from JSON hold lists
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def rate(nbytes: float, seconds: float | None) -> float | None:
    """GB/s: the one definition every figure of delivered bandwidth uses."""
    return nbytes / seconds / 1e9 if seconds else None


def _sum(parts, attr: str):
    return sum(getattr(p, attr) for p in parts)


def _since(t: float | None, t0: float | None) -> float | None:
    return None if t is None or t0 is None else t - t0


def _decoded(r, attr: str):
    """check=decode: ``attr`` of the request's decode result (kvlab.results.records.DecodeResult), on the gen rank
    that decoded it; None without one."""
    d = next((p.decode for p in r.gen if getattr(p, "decode", None) is not None), None)
    return None if d is None else getattr(d, attr)


def _over_rows(name: str, reduce):
    """A run figure reducing the rows' present values (None when no row has one: absent, not zero)."""
    return lambda run: (lambda vs: reduce(vs) if vs else None)([getattr(r, name) for r in run.rows
                                                                 if getattr(r, name) is not None])


class Parts:
    """One request's parts (kvlab.results.records.RankPart, one per rank that moved some of it), as the request
    figures read them. The figures computed so far are set on it as attributes, in table order, so a
    figure may use those above it."""

    def __init__(self, ctx, gen, traits: Traits = PLAIN, pairs: list[tuple[int, int]] | None = None):
        """``pairs``: the request's (ctx rank, gen rank) of each chunk, in the global order, which pairs each
        chunk's marks on its two sides."""
        self.ctx, self.gen, self.traits, self.pairs = list(ctx), list(gen), traits, pairs
        every = self.ctx + self.gen
        # the transfer starts when a ctx rank has a chunk free to go (gen ranks open it earlier to post
        # receives), at the latest when its prefill ended
        firsts = [min(x for x in (p.start, p.prefill_end) if x is not None) for p in self.ctx
                  if p.start is not None or p.prefill_end is not None]
        if not self.ctx:
            firsts = [p.start for p in every if p.start is not None]
        self.start = min(firsts, default=None)
        # it ends when the last gen rank holds the bytes (a pull transport's ctx rank finishes later, once the
        # readers have said so)
        self.end = max((p.end for p in (self.gen or every) if p.end is not None), default=None)
        # the serving timeline, from the ctx parts that know the request's arrival
        tl = [p for p in self.ctx if p.arrival is not None]
        self.epoch = min((p.epoch for p in tl if p.epoch is not None), default=None)
        self.arrival = min((p.arrival for p in tl), default=None)
        self.prefill_start = min((p.prefill_start for p in tl if p.prefill_start is not None), default=None)
        ends = [p.prefill_end for p in tl]
        self.prefill_end = max(ends) if tl and None not in ends else None
        self.first_post = min((p.first_post for p in tl if p.first_post is not None), default=None)
        landed = [p.end for p in self.gen]
        complete = bool(self.gen) and None not in landed and all(p.chunks == p.chunks_total for p in self.gen)
        self.last = max(landed) if complete else None  # its last chunk landed on the last gen rank needing it
        # what the merge decides from the errors, and the run's SLOs (kvlab.core.serving.SloSpec; None: none set)
        self.verified: bool | None = None
        self.slo = None

    def _flights(self) -> list[tuple[float, float]]:
        if self.pairs is None:
            return [tuple(w) for p in (self.gen if self.traits.pulls else self.ctx) for w in p.wire]
        # a rank's marks are a prefix of its chunks in order (it finishes them in order, and may stop)
        ctx = {p.rank: iter(p.wire) for p in self.ctx}
        gen = {p.rank: iter(p.wire) for p in self.gen}
        out = []
        for src, dst in self.pairs:
            sent = next(ctx[src], None) if src in ctx else None
            got = next(gen[dst], None) if dst in gen else None
            if sent is not None and got is not None:
                out.append((max(sent[0], got[0]), got[1]))
        return out

    def in_flight(self) -> list[tuple[float, float]]:
        """Its chunks' in-flight intervals, clipped to its span."""
        lo = -math.inf if self.start is None else self.start
        hi = math.inf if self.end is None else self.end
        return [(max(a, lo), min(b, hi)) for a, b in self._flights() if min(b, hi) > max(a, lo)]

    def busy(self) -> float | None:
        return union(self.in_flight()) if self._flights() else None


@dataclass
class Run:
    """What the run figures read: the merged rows, every request's parts, each rank's memory peak and the
    in-run link; the run figures computed so far are set on it as attributes, in table order."""

    rows: list
    requests: list[Parts]
    peaks: list
    link: Any = None


@dataclass(frozen=True)
class Figure:
    name: str  # its RequestRow field (a request figure) or its Summary field (a run figure only)
    unit: str  # a key of DISPLAY
    meaning: str  # one sentence
    how: str  # how a request's parts make it, or how the run does
    request: Callable[[Parts], Any] | None = None  # its value for one request; None: a run figure only
    run: str | Callable[[Run], Any] | None = None  # the run's value: "sum" or "max" over the rows, or a function
    run_name: str | None = None  # the Summary field of the run's value, where it is not ``name``
    default: Any = None  # a row's value with nothing measured: None (absent) or 0 (nothing counted)
    run_default: Any = None
    column: str | None = None  # its column in the terminal's table of requests (the run's value in its last row)
    line: str | None = None  # its label in the summary line: p50 / p90 / p99 over the verified requests
    needs: str | None = None  # a transport trait (Transport.has) without which it is absent
    was: str | None = None  # its field's name in files of schema < 2
    before: str | None = None  # what it meant in files of schema < 2

    @property
    def summary_name(self) -> str | None:
        return (self.run_name or self.name) if self.run is not None else None

    def present(self, traits: Traits) -> bool:
        return self.needs is None or self.needs in traits.has

    def show(self, v) -> str:
        """Its value as the terminal shows it (unit of DISPLAY); '' when absent."""
        if v is None:
            return ""
        if self.unit == "bool":
            return "yes" if v else "no"
        scale, fmt, _ = DISPLAY[self.unit]
        return fmt.format(v * scale if scale != 1 else v)


TABLE: tuple[Figure, ...] = (
    # -- what moved
    Figure("bytes", "B", "Bytes delivered to the request's gen ranks.", "sum of the gen parts' bytes",
           request=lambda r: _sum(r.gen, "bytes"), default=0, run="sum", run_name="total_bytes", run_default=0,
           column="MiB"),
    Figure("chunks", "count", "Chunks the request's gen ranks received.", "sum of the gen parts' chunks",
           request=lambda r: _sum(r.gen, "chunks"), default=0),
    Figure("in_place_chunks", "count", "Chunks received straight into the gen pool, with no staging copy.",
           "sum of the gen parts' in_place", request=lambda r: _sum(r.gen, "in_place"), default=0),
    Figure("ctx_in_place_chunks", "count", "Chunks sent straight from the ctx pool, with no staging copy.",
           "sum of the ctx parts' in_place", request=lambda r: _sum(r.ctx, "in_place"), default=0),
    Figure("descriptors", "count", "Memory descriptors the transport posted for the request (nixl: one per run).",
           "sum of the ctx parts' descriptors", request=lambda r: _sum(r.ctx, "descriptors"), default=0),
    # -- when it moved
    Figure("start", "epoch s", "When the request's transfer began: its first chunk free to go on a ctx rank.",
           "min over ctx parts of min(start, prefill_end) (gen parts' start without ctx parts)",
           request=lambda r: r.start),
    Figure("end", "epoch s", "When the last gen rank held the request's bytes.", "max of the gen parts' end",
           request=lambda r: r.end),
    Figure("seconds", "s", "The request's transfer span: first chunk free to go to the bytes on every gen rank, "
           "waits for the link and for slots included.", "end - start", request=lambda r: _since(r.end, r.start)),
    Figure("busy_s", "s", "Time at least one of the request's chunks was in flight.",
           "union of its chunks' intervals from the later of their two sides' posts to the gen side's done, "
           "clipped to [start, end]; the run: the union over every request",
           request=lambda r: r.busy(), run=lambda run: union([i for q in run.requests for i in q.in_flight()])
           if any(q.busy() is not None for q in run.requests) else None,
           column="busy ms", was="wire_s", before="union of the ctx parts' wire intervals, unclipped (transport=ipc: "
           "the ctx rank's, which wait for the readers)"),
    Figure("gbps", "GB/s", "Delivered bandwidth: bytes over the time they were in flight.", "bytes / busy_s",
           request=lambda r: rate(r.bytes, r.busy_s), run=lambda run: rate(run.total_bytes, run.busy_s),
           column="GB/s", before="the request's: bytes / seconds; the run's: total_bytes / makespan_s"),
    Figure("makespan_s", "s", "The run's span: first ctx rank's transfer start to last gen rank's end.",
           "max of the rows' end - min of their start",
           run=lambda run: _since(max((r.end for r in run.rows if r.end is not None), default=None),
                                  min((r.start for r in run.rows if r.start is not None), default=None)),
           was="seconds"),
    Figure("pack_s", "s", "Copy time on the ctx ranks (pack into staging; ipc: none).", "sum of the ctx parts' copy_s",
           request=lambda r: _sum(r.ctx, "copy_s"), default=0.0),
    Figure("unpack_s", "s", "Copy time on the gen ranks (unpack from staging; ipc: the pull itself).",
           "sum of the gen parts' copy_s", request=lambda r: _sum(r.gen, "copy_s"), default=0.0),
    # -- the serving timeline
    Figure("arrival_s", "t", "When the request arrived.", "min of the ctx parts' arrival - epoch",
           request=lambda r: _since(r.arrival, r.epoch), column="arrival ms"),
    Figure("prefill_start_s", "t", "When the request's prefill began.", "min of the ctx parts' prefill_start - epoch",
           request=lambda r: _since(r.prefill_start, r.epoch)),
    Figure("prefill_end_s", "t", "When its last layer was written on every ctx rank.",
           "max of the ctx parts' prefill_end - epoch", request=lambda r: _since(r.prefill_end, r.epoch)),
    Figure("prefill_s", "s", "The prefill: its start to its last layer written.", "prefill end - prefill start",
           request=lambda r: _since(r.prefill_end, r.prefill_start)),
    Figure("prefill_alone_s", "s", "The same prefill with nothing else on the GPU, measured before the run "
           "(prefill=gpu).", "max of the ctx parts' prefill_alone_s",
           request=lambda r: max((p.prefill_alone_s for p in r.ctx if p.prefill_alone_s), default=None)
           if r.prefill_s is not None else None),
    Figure("first_chunk_s", "t", "When its first chunk was posted by a ctx rank.",
           "min of the ctx parts' first_post - epoch", request=lambda r: _since(r.first_post, r.epoch)),
    Figure("last_chunk_s", "t", "When its last chunk landed on the last gen rank needing it (before that rank "
           "verifies it: decode would start here).", "max of the gen parts' end - epoch, once all chunks landed",
           request=lambda r: _since(r.last, r.epoch)),
    Figure("ttft_s", "s", "Arrival to the cache complete on every gen rank needing it: the part of the time to "
           "first token that prefill and transfer make (no decode step runs).", "last chunk landed - arrival",
           request=lambda r: _since(r.last, r.arrival), column="TTFT ms", line="TTFT"),
    Figure("slo_met", "bool", "Whether the request met every SLO set (serving.slo): it verified and its TTFT was "
           "within serving.slo.ttft_ms.", "serving.slo's met(ttft_s, verified); absent without an SLO",
           request=lambda r: r.slo.met(r.ttft_s, r.verified) if r.slo is not None else None, column="SLO"),
    Figure("exposed_s", "s", "Transfer left after the prefill's last layer: what the transfer adds to TTFT "
           "(waits for the link after the prefill included).", "max(0, last chunk landed - prefill end); the run: "
           "its largest", request=lambda r: None if r.last is None or r.prefill_end is None
           else max(0.0, r.last - r.prefill_end), run="max", column="exposed ms", line="exposed transfer"),
    Figure("queue_s", "s", "Wait for the request's ctx DP group: arrival to its prefill's start.",
           "min of the ctx parts' prefill_start - arrival", request=lambda r: _since(r.prefill_start, r.arrival),
           line="prefill queue"),
    Figure("transfer_s", "s", "First chunk posted to the last one landed.",
           "last chunk landed - min of the ctx parts' first_post", request=lambda r: _since(r.last, r.first_post),
           line="transfer"),
    Figure("slot_wait_s", "s", "Time the request's ctx ranks waited for a free staging slot before posting its "
           "chunks.", "sum of the ctx parts' slot_wait", request=lambda r: _sum(r.ctx, "slot_wait"),
           line="slot wait", needs="slots", before="summed over ctx and gen parts, whatever the transport"),
    Figure("prefill_slowdown", "x", "The prefill in the run over the same prefill alone on the GPU (prefill=gpu).",
           "prefill_s / prefill_alone_s", request=lambda r: None if r.prefill_s is None or not r.prefill_alone_s
           else r.prefill_s / r.prefill_alone_s, line="prefill slowdown x"),
    # -- prefix reuse on the decode side (gen.prefix_cache_tokens, kvlab.model.prefix); absent with it off
    Figure("skipped_bytes", "B", "Bytes of the request's cache its gen ranks already held from earlier prompts "
           "(prefix reuse), so that nothing moved them: bytes + skipped_bytes is what it moves without reuse.",
           "sum of the gen parts' skipped_bytes", request=lambda r: _sum(r.gen, "skipped_bytes"), default=0,
           run="sum", run_default=0),
    Figure("prefix_hit_blocks", "count", "Leading 512-token blocks of the prompt the gen DP group's prefix cache "
           "held at its arrival.", "max of the gen parts' prefix_hit_blocks; the run: their sum",
           request=lambda r: max((p.prefix_hit_blocks for p in r.gen if p.prefix_hit_blocks is not None),
                                 default=None), run=_over_rows("prefix_hit_blocks", sum)),
    Figure("prefix_blocks", "count", "Full 512-token blocks of the prompt, the ones the prefix cache was asked "
           "for.", "max of the gen parts' prefix_blocks; the run: their sum",
           request=lambda r: max((p.prefix_blocks for p in r.gen if p.prefix_blocks is not None), default=None),
           run=_over_rows("prefix_blocks", sum)),
    Figure("prefix_hit_rate", "x", "The share of the prompt's full blocks found in the prefix cache.",
           "prefix_hit_blocks / prefix_blocks; the run: sum over sum",
           request=lambda r: r.prefix_hit_blocks / r.prefix_blocks if r.prefix_blocks else None,
           run=lambda run: run.prefix_hit_blocks / run.prefix_blocks if run.prefix_blocks else None),
    Figure("ttft_no_reuse_s", "s", "An estimate of the TTFT without prefix reuse, from the same run: the skipped "
           "bytes added after the moved ones at the request's own delivered rate (a second run with "
           "gen.prefix_cache_tokens=0 measures it instead).", "ttft_s + skipped_bytes / (bytes / busy_s)",
           request=lambda r: None if r.prefix_blocks is None or r.ttft_s is None or not r.busy_s or not r.bytes
           else r.ttft_s + r.skipped_bytes * r.busy_s / r.bytes, line="TTFT without reuse (est.)"),
    # -- around the transfer
    Figure("fill_s", "s", "Host time writing the request's cache, inside the prefill (ctx ranks together).",
           "sum of the ctx parts' fill_s", request=lambda r: _sum(r.ctx, "fill_s"), default=0.0, run="sum",
           run_default=0.0),
    Figure("verify_s", "s", "Host time checking the request's cache after the transfer (gen ranks together): "
           "decode's stand-in.", "sum of the gen parts' verify_s", request=lambda r: _sum(r.gen, "verify_s"),
           default=0.0, run="sum", run_default=0.0),
    # -- the run as a serving system
    Figure("duration_s", "s", "The run's serving span: its first arrival to the last chunk landed of any request "
           "(vLLM's benchmark duration).", "max of the rows' last_chunk_s - min of their arrival_s",
           run=lambda run: _since(max((r.last_chunk_s for r in run.rows if r.last_chunk_s is not None), default=None),
                                  min((r.arrival_s for r in run.rows if r.arrival_s is not None), default=None))),
    Figure("completed", "count", "Requests that arrived whole and verified.", "count of the verified rows",
           run=lambda run: sum(bool(r.verified) for r in run.rows), run_default=0),
    Figure("failed", "count", "Requests that failed (not delivered whole, or not verified).",
           "count of the rows not verified", run=lambda run: sum(not r.verified for r in run.rows), run_default=0),
    Figure("request_throughput", "req/s", "Completed requests per second of the serving span.",
           "completed / duration_s", run=lambda run: run.completed / run.duration_s if run.duration_s else None),
    Figure("good_requests", "count", "Requests that met every SLO set.", "count of the rows with slo_met; "
           "absent without an SLO", run=lambda run: sum(bool(r.slo_met) for r in run.rows)
           if any(r.slo_met is not None for r in run.rows) else None),
    Figure("goodput", "req/s", "Requests meeting every SLO per second of the serving span (vLLM's goodput).",
           "good_requests / duration_s", run=lambda run: run.good_requests / run.duration_s
           if run.good_requests is not None and run.duration_s else None),
    Figure("slo_attainment", "x", "The share of the run's requests that met every SLO (a failed one did not).",
           "good_requests / all rows", run=lambda run: run.good_requests / len(run.rows)
           if run.good_requests is not None and run.rows else None),
    # -- the run's own
    Figure("link_gbps", "GB/s", "The link's speed for the run's own messages, measured in the same run "
           "(kvlab.rank.linkrate).", "the run's Link.gbps", run=lambda run: run.link.gbps if run.link else None),
    Figure("link_ratio", "x", "The share of the link the run delivered, comparable across machines.",
           "gbps / link_gbps", run=lambda run: run.gbps / run.link_gbps if run.gbps and run.link_gbps else None,
           before="gbps over makespan_s / link_gbps"),
    Figure("peak_staging_bytes", "B", "The most staging memory one rank held at once.", "max over ranks",
           run=lambda run: max((p.staging for p in run.peaks), default=0), run_default=0),
    Figure("peak_extra_device_bytes", "B", "The most extra device memory of the transfer on one rank (staging "
           "included).", "max over ranks", run=lambda run: max((p.extra for p in run.peaks), default=0),
           run_default=0),
    Figure("device_free_drop_bytes", "B", "The most device free memory one rank lost, NCCL's own buffers "
           "included (GPUs).", "max over ranks", run=lambda run: max((p.free_drop for p in run.peaks), default=0),
           run_default=0),
    Figure("cache_bytes", "B", "The largest KV cache of one rank.", "max over ranks",
           run=lambda run: max((p.cache for p in run.peaks), default=0), run_default=0),
    # -- check=decode (kvlab.rank.decode_check): the moved cache decoded, against a run that never left one process
    Figure("byte_check_failures", "count", "Gen ranks whose byte check of the request failed (check=decode: "
           "against the reference's own cache).", "the decoding gen rank's count of its group's failed checks",
           request=lambda r: _decoded(r, "byte_failures"), run=_over_rows("byte_check_failures", sum),
           column="byte fails"),
    Figure("decode_tokens", "count", "Greedy tokens decoded from the moved cache.", "check.tokens per decoded request",
           request=lambda r: _decoded(r, "tokens"), run=_over_rows("decode_tokens", sum), column="decoded"),
    Figure("decode_tokens_equal", "count", "Of the decoded tokens, those equal to the reference's.",
           "counted on the decoding gen rank", request=lambda r: _decoded(r, "equal"),
           run=_over_rows("decode_tokens_equal", sum), column="tokens ="),
    Figure("decode_max_logit_diff", "logit", "Largest |logit difference| from the reference over the decoded steps.",
           "max over the steps; the run: over every request", request=lambda r: _decoded(r, "max_logit_diff"),
           run=_over_rows("decode_max_logit_diff", max), column="max |dlogit|"),
    Figure("decode_first_divergent", "count", "First decode step whose token or logits differ from the reference's "
           "(beyond check.tolerance); absent when none does.", "the first such step; the run: the earliest",
           request=lambda r: _decoded(r, "first_divergent"), run=_over_rows("decode_first_divergent", min),
           column="diverges at"),
)

BY_NAME = {f.name: f for f in TABLE}
# columns the terminal shows only in runs that have them
OPTIONAL_COLUMNS = frozenset({"byte_check_failures", "decode_tokens", "decode_tokens_equal", "decode_max_logit_diff",
                              "decode_first_divergent"})


def request_figures() -> list[Figure]:
    return [f for f in TABLE if f.request is not None]


def run_figures() -> list[Figure]:
    return [f for f in TABLE if f.run is not None]


def line_figures() -> list[Figure]:
    """The figures with percentiles (Summary.serving), a place in the summary line and a wandb histogram."""
    return [f for f in TABLE if f.line]


def columns() -> list[Figure]:
    return [f for f in TABLE if f.column]


def field_type(default, unit: str):
    """The type of a record field holding a figure, from its default and unit: a figure that may be absent is
    ``X | None``, true or false where its unit is ``bool`` (read back as written: kvlab.results.records), else a
    number."""
    if default is not None:
        return type(default)
    return bool | None if unit == "bool" else float | None


def request_values(r: Parts) -> dict:
    """Every request figure of one request, in table order (None where absent)."""
    out = {}
    for f in request_figures():
        out[f.name] = f.request(r) if f.present(r.traits) else None
        setattr(r, f.name, out[f.name])
    return out


def run_values(run: Run, traits: Traits = PLAIN) -> dict:
    """Every run figure, in table order, by its Summary field."""
    out = {}
    for f in run_figures():
        if not f.present(traits):
            v = None
        elif f.run == "sum":
            v = sum(getattr(r, f.name) or 0 for r in run.rows)
        elif f.run == "max":
            v = max((getattr(r, f.name) for r in run.rows if getattr(r, f.name) is not None), default=None)
        else:
            v = f.run(run)
        out[f.summary_name] = f.run_default if v is None else v
        setattr(run, f.summary_name, v)
    return out
