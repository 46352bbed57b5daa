"""Cost model: how long a workload's transfers should take and how much device memory they add.

Built from the same requests, plan, schedule and global chunk order the executor runs, so
every message, its size, its ranks and its zero-copy decision are the real ones; only the
clock is modelled. Each chunk goes

    pack on the ctx device ─► one message on the link ─► unpack on the gen device

- a message costs ``alpha`` plus its bytes at the wire rate of a message of that size; the
  wire rates are derived from measured one-message figures (so that ``alpha + n / rate``
  reproduces them) and interpolated in log size;
- pack and unpack read and write every byte at the kernels' rate: ``copy_gbps_per_cta`` per
  CTA of ``transfer.pack_ctas``, at most ``copy_efficiency`` of the device copy rate
  ``copy_gbps`` (both count bytes read plus bytes written); a chunk in place on a side
  (strategy trait ``in_place``, consecutive blocks) skips that side's copy; a KV dtype converted on the way
  costs, where the kernels convert in the copy (``cost.convert_in_copy``, the pool's ``convert`` path), the
  converting side's own rows in place of a second copy of the wire's, else one more pass over those rows;
- a device's copies run one at a time, and so do its outgoing and its incoming messages;
  different devices run at once, so pairs on distinct GPUs overlap; ranks sit on devices
  as the runner puts them (``kvlab.config.devices.gpu_index``);
- each rank keeps at most ``slots`` chunks in flight, as the executor does, and a chunk
  waits for its turn; the simulated prefill (``prefill.layer_ms`` per layer; the older
  ``transfer.layer_compute_ms`` still exists only as an alias that kvlab.config.schema copies there when
  ``prefill.layer_ms`` is unset) releases a chunk when its layer is done (strategy trait ``ready: layer``)
  or when every layer is (``request``).

Pipeline fill and drain, back-pressure and layer readiness follow from placing the chunks
on the clock one by one in the global order.

Extra device memory per rank: ``slots * slot_bytes`` (allocated once at start), or for
``staging: per_chunk`` (naive) the largest sum of ``slots`` consecutive per-chunk buffers of any rank (a chunk
is a whole segment there, so it grows with the prompt); none for a pulling transport. The chunks are
cut to the run's ``Setup.chunk_cap``: for a pulling transport by default one per segment (per ready layer
of it for a layer-wise cut), so its fixed cost per chunk is paid once per piece the readiness allows.

Rates come from the ``cost`` group (kvlab.core.rates): a profile (``h200`` or ``cpu``, picked from
the backend or the device by ``cost=auto``), any rate overridable on its own, e.g.
``cost.alpha_us=20``, ``cost.link_gbps=[200,300,340,360]``, ``cost=cpu``.

Against the 2xH200 benchmark (scripts/bench.py, results/bench_h200x2.json: Llama-3.1-8B at
4k-128k and DeepSeek-V3.2 at 128k, every strategy) the extra memory is exact and the time
within 8% for naive, zerocopy and chunked with 2 x 128 MiB slots from 32k tokens on (median
ratio 0.94 over all 28 transfers); 4k requests take up to 2x, and layerwise at 4k 4x, longer
than predicted (per-request and per-layer host costs are not modelled). On a 2-core CPU, a run's makespan on its
prefill timeline (``predict_run``) is within 0.62-1.87x over the seven runs scripts/cpu_profile.py fits the ``cpu``
profile to (docs/results/cpu.md).
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvlab.config.devices import gpu_index, pair_backend
from kvlab.config.workload import as_requests, interleave
from kvlab.core.rates import CostRates
from kvlab.memory.ops import paths
from kvlab.model.plan import Request, conversion_bytes, plan
from kvlab.model.prefill import layer_seconds, ready_s, timeline
from kvlab.model.schedule import Chunk, Ready, Staging, schedule

if TYPE_CHECKING:
    from kvlab.config.schema import Setup

MiB = 2**20


@dataclass
class RequestCost:
    request: int
    isl: int
    bytes: int
    chunks: int
    in_place_chunks: int  # in place on both sides
    start_s: float  # first of its ranks opened it (ctx: the simulated prefill starts)
    prefill_end_s: float  # the prefill's last layer is done (= start_s without layer compute)
    end_s: float  # its last byte is unpacked
    pack_s: float  # copy time on ctx ranks
    wire_s: float  # message time, summed over its messages
    unpack_s: float  # copy time on gen ranks
    layer_done_s: dict[int, float] = field(default_factory=dict)  # global layer -> its last send done
    ready_s: float = math.inf  # its first chunk is free to go (the prefill has written its layer): its start

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s

    @property
    def exposed_s(self) -> float:
        """Transfer time left once the prefill's last layer is done."""
        return max(0.0, self.end_s - self.prefill_end_s)

    def to_dict(self) -> dict:
        return {"request": self.request, "isl": self.isl, "bytes": self.bytes, "chunks": self.chunks,
                "in_place_chunks": self.in_place_chunks, "seconds": self.seconds,
                "gbps": self.bytes / self.seconds / 1e9 if self.seconds > 0 else None,
                "exposed_s": self.exposed_s, "pack_s": self.pack_s, "wire_s": self.wire_s,
                "unpack_s": self.unpack_s}


@dataclass
class Prediction:
    profile: str
    strategy: str
    seconds: float  # the whole workload: first request opened (or, with the prefill, first chunk free) to last
    # byte unpacked
    total_bytes: int
    messages: int
    extra_bytes: int  # largest extra device memory of any rank
    extra_bytes_ctx: int
    extra_bytes_gen: int
    raw_link_s: float  # the same bytes as one message per request, back to back on one link, no copies
    requests: list[RequestCost] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        return self.total_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_dict(self, per_request: bool = False) -> dict:
        d = {"profile": self.profile, "strategy": self.strategy, "seconds": self.seconds, "gbps": self.gbps,
             "total_bytes": self.total_bytes, "messages": self.messages, "extra_bytes": self.extra_bytes,
             "extra_bytes_ctx": self.extra_bytes_ctx, "extra_bytes_gen": self.extra_bytes_gen,
             "raw_link_s": self.raw_link_s}
        if per_request:
            d["requests"] = [r.to_dict() for r in self.requests]
        return d

    def timeline(self) -> list[dict]:
        """Predicted ``timeline.jsonl`` rows: per request and layer, relative to the prefill's start."""
        rows = []
        for r in self.requests:
            n = len(r.layer_done_s)
            per_layer = (r.prefill_end_s - r.start_s) / max(1, n) if n else 0.0
            for layer, done in sorted(r.layer_done_s.items()):
                rows.append({"request": r.request, "layer": layer, "prefill_done_s": (layer + 1) * per_layer,
                             "transfer_done_s": done - r.start_s})
        return rows


def device_map(setup: Setup, devices: int) -> tuple[list[int], list[int]]:
    """Device of every ctx rank and every gen rank, as the runner places them on one host
    (``kvlab.config.devices.gpu_index``); with ``devices=-1`` the devices are this machine's CPU cores."""
    nc, ng = setup.ctx.size, setup.gen.size
    world = nc + ng
    if devices == -1:  # gloo ranks are processes spread over the cores
        cores = os.cpu_count() or 1
        return [r % cores for r in range(nc)], [(nc + r) % cores for r in range(ng)]
    if devices <= 0 or devices >= world:
        return list(range(nc)), list(range(nc, world))
    where = [gpu_index(setup, w, w, world, devices) for w in range(world)]
    return where[:nc], where[nc:]


def request_chunks(setup: Setup, req: Request) -> list[Chunk]:
    segs = plan(setup.model, setup.ctx, setup.gen, req)
    return schedule(setup.model, setup.ctx, setup.gen, segs, setup.transfer.strategy, setup.chunk_cap)


def _order(setup: Setup, reqs: list[Request], concurrency: int) -> list[Chunk]:
    """Every request's schedule, merged into the global order the executor walks."""
    from dataclasses import replace as dc_replace

    shapes: dict[tuple[int, int, int], list[Chunk]] = {}  # zerocopy schedules are slow to derive: once per shape
    schedules = []
    for req in reqs:
        key = (req.isl, req.ctx_dp, req.gen_dp)
        if key not in shapes:
            shapes[key] = request_chunks(setup, req)
        schedules.append([dc_replace(c, request=req.id) for c in shapes[key]])
    return interleave(schedules, concurrency)


def _copy_s(rates: CostRates, n: float, conv: float, fused: bool, ctas: int = 0) -> float:
    """Seconds of a copy of ``n`` wire bytes that converts ``conv`` bytes of its side's own rows (0: none) on the
    way: in one pass, the own rows read or written in place of a second copy of the wire's (``fused``), else a
    copy and one more pass over the own bytes."""
    if not conv:
        return rates.copy_s(n, ctas)
    if fused:
        return rates.copy_s((n + conv) / 2, ctas)  # copy_s counts each byte read and written: n + conv moved
    return rates.copy_s(n, ctas) + rates.copy_s(conv, ctas)


def prefill_times(setup: Setup, reqs: list[Request], order: list[Chunk], rates: CostRates) -> dict:
    """The run's prefill timeline (kvlab.model.prefill.timeline: first come first served per ctx DP group, what
    the ranks plan from), each layer lasting its configured time or, where longer, the time its ctx ranks take to
    write their cache of it (``fill_gbps``: on a CPU the writes, not the simulated compute, pace the prefill)."""
    sent: dict[tuple[int, int], int] = {}
    for c in order:
        sent[(c.request, c.src)] = sent.get((c.request, c.src), 0) + c.nbytes
    isl_of = {r.id: r.isl for r in reqs}
    most: dict[int, int] = {}  # a prompt length -> the most bytes one ctx rank writes of it
    for (req, _), n in sent.items():
        most[isl_of[req]] = max(most.get(isl_of[req], 0), n)
    cp = setup.ctx.tokens(0, setup.model)

    def seconds_of(isl: int) -> list[float]:
        sim = layer_seconds(setup.model, setup.prefill, setup.ctx.tp, isl, cp)
        fill = rates.fill_s(most.get(isl, 0)) / max(1, len(sim))
        return [max(s, fill) for s in sim]

    return timeline(reqs, seconds_of)


def predict(setup: Setup, requests: Iterable[Request | int] | None = None, rates: CostRates | None = None,
            backend: str | None = None, concurrency: int | None = None, with_prefill: bool = False) -> Prediction:
    """Place every chunk of the workload on the clock, in the executor's order and under its rules.

    Each rank walks its chunks of the global order with at most ``slots`` in flight: chunk
    ``k`` of a rank starts only once its chunk ``k - slots`` is complete (ctx: sent; gen:
    received and unpacked), in place or not. A ctx rank opens a request at its first chunk
    and, with ``prefill.layer_ms``, sends a chunk once the simulated prefill has finished
    the chunk's layer (``ready: layer``) or every layer (``ready: request``). Every copy costs its side's
    host ``host_us`` first. With ``blocking`` rates (CPU) a rank's core does that work and the
    copies itself, one after the other, shared with the ranks on the same core; on GPUs
    copies queue on the rank's stream and only the copy engine and the window order them.

    ``with_prefill``: chunks go when the run's prefill timeline (``prefill_times``: arrivals, queueing and
    the cache writes included) lets them, and the workload's time runs from its first chunk free to go, as a
    run's makespan does (kvlab.core.figures); without it, the transfer alone (``kvlab plan``) with a fixed
    ``prefill.layer_ms`` if set.
    """
    rates = rates or setup.cost.rates_for(backend or pair_backend(setup), setup.transport.name)
    reqs = as_requests(setup, requests)
    by_id = {r.id: r for r in reqs}
    strategy = setup.transfer.strategy
    concurrency = concurrency or setup.workload.concurrency
    blocking = rates.blocking
    host_s = rates.host_us * 1e-6
    ctas = setup.transfer.pack_ctas
    window = setup.transfer.slots
    layer_s = setup.prefill.layer_ms * 1e-3  # fixed per layer: arrivals and dims-timed prefill are not modelled
    last_layer = setup.model.num_layers - 1
    ctx_dev, gen_dev = device_map(setup, rates.devices)
    ndev = max(ctx_dev + gen_dev) + 1
    copy_free, out_free, in_free = [0.0] * ndev, [0.0] * ndev, [0.0] * ndev
    host_c = [0.0] * setup.ctx.size
    host_g = [0.0] * setup.gen.size
    sent: list[list[float]] = [[] for _ in range(setup.ctx.size)]  # per ctx rank: send done of its k-th chunk
    done_g: list[list[float]] = [[] for _ in range(setup.gen.size)]  # per gen rank: k-th chunk unpacked
    sizes_c: list[list[int]] = [[] for _ in range(setup.ctx.size)]
    sizes_g: list[list[int]] = [[] for _ in range(setup.gen.size)]
    prefill: dict[tuple[int, int], float] = {}  # (request, ctx rank) -> prefill start
    costs: dict[int, RequestCost] = {}

    # a pull transport (ipc): no staging, pack, message or unpack; the gen rank copies each chunk
    # from the ctx pool on its device (the whole device's copy rate) after one control round trip
    pulls = setup.transport.cls().pulls
    # the pools whose KV dtype change the kernels make inside the copy (the path kvlab plan prints)
    one_pass = {name for name, (path, _) in paths.pool_paths(setup).items() if path == "convert"}
    order = _order(setup, reqs, concurrency)
    times = prefill_times(setup, reqs, order, rates) if with_prefill else None
    per_layer = strategy.ready == Ready.layer
    for c in order:
        n = c.nbytes
        sd, dd = ctx_dev[c.src], gen_dev[c.dst]
        kc, kg = len(sent[c.src]), len(done_g[c.dst])
        rc = costs.get(c.request)
        # gen: the receive is posted once the chunk `window` places back is unpacked
        recv_ready = done_g[c.dst][kg - window] if kg >= window else 0.0
        if not blocking and not c.gen_in_place:
            host_g[c.dst] += host_s
            recv_ready = max(recv_ready, host_g[c.dst])
        # ctx: same window; a blocking host waits for it before anything else
        slot_ready = sent[c.src][kc - window] if kc >= window else 0.0
        if blocking:
            host_c[c.src] = max(host_c[c.src], slot_ready)
        key = (c.request, c.src)
        if key not in prefill:
            prefill[key] = times[c.request].start if times is not None else host_c[c.src]
        if rc is None:
            rc = costs[c.request] = RequestCost(c.request, by_id[c.request].isl, 0, 0, 0,
                                                min(prefill[key], recv_ready), prefill[key], 0.0, 0.0, 0.0, 0.0)
        if times is not None:
            pt = times[c.request]
            ready = ready_s(pt, c.ready_layer, per_layer)
            host_c[c.src] = max(host_c[c.src], ready)
            rc.prefill_end_s = pt.end
            rc.ready_s = min(rc.ready_s, ready)
        elif layer_s:
            layer = c.ready_layer if per_layer else last_layer
            host_c[c.src] = max(host_c[c.src], prefill[key] + (layer + 1) * layer_s)
            rc.prefill_end_s = max(rc.prefill_end_s, prefill[key] + (last_layer + 1) * layer_s)
        t = max(host_c[c.src], slot_ready)
        # a KV dtype converted in flight (kvlab.model.kv_dtype): the converting side's own bytes
        conv_c, conv_g = conversion_bytes(setup.model, setup.ctx, setup.gen, c.rect)
        fused = rates.convert_in_copy and c.rect.pool in one_pass
        pack = 0.0 if c.ctx_in_place or pulls else _copy_s(rates, n, conv_c, fused, ctas)
        rc.pack_s += pack
        if pack and blocking:
            t = host_c[c.src] = copy_free[sd] = max(t, copy_free[sd]) + host_s + pack
        elif pack:
            host_c[c.src] += host_s
            t = copy_free[sd] = max(t, host_c[c.src], copy_free[sd]) + pack
        w0 = max(t, recv_ready, out_free[sd], in_free[dd])
        wire = rates.alpha_s if pulls else rates.message_s(n)
        w1 = w0 + wire
        out_free[sd] = in_free[dd] = w1
        rc.wire_s += wire
        sent[c.src].append(w1)
        # gen completes its chunks in order: wait for the bytes, then unpack
        t = max(w1, done_g[c.dst][-1] if kg else 0.0)
        if pulls:  # a pull converts in its copy, whichever side's format the rows are converted from
            unpack = _copy_s(rates, n, conv_c + conv_g, fused)
        elif c.gen_in_place:
            unpack = rates.copy_s(conv_g, ctas)
        else:
            unpack = _copy_s(rates, n, conv_g, fused, ctas)
        rc.unpack_s += unpack
        if unpack:
            t = copy_free[dd] = max(t, copy_free[dd]) + (host_s if blocking else 0.0) + unpack
        done_g[c.dst].append(t)
        sizes_c[c.src].append(n)
        sizes_g[c.dst].append(n)
        rc.bytes += n
        rc.chunks += 1
        rc.in_place_chunks += int(c.ctx_in_place and c.gen_in_place)
        rc.end_s = max(rc.end_s, t)
        rc.start_s = min(rc.start_s, prefill[key], recv_ready)
        rc.layer_done_s[c.ready_layer] = max(rc.layer_done_s.get(c.ready_layer, 0.0), w1)

    def extra(sizes: list[list[int]]) -> int:
        if pulls:
            return 0
        if strategy.staging == Staging.slots:
            return setup.transfer.slots * setup.transfer.slot_bytes
        # a buffer per chunk in flight, at most `window` of them
        return max((max(sum(s[max(0, i - window + 1):i + 1]) for i in range(len(s))) for s in sizes if s), default=0)

    ec, eg = extra(sizes_c), extra(sizes_g)
    done = [costs[r.id] for r in reqs if r.id in costs]
    start = min((r.ready_s if times is not None else r.start_s for r in done), default=0.0)
    total = sum(r.bytes for r in done)
    raw = sum(rates.message_s(r.bytes) for r in done if r.bytes)
    return Prediction(rates.profile, strategy.name, max((r.end_s for r in done), default=0.0) - start, total,
                      len(order), max(ec, eg), ec, eg, raw, done)


def predict_run(setup: Setup, requests: Iterable[Request | int] | None = None, backend: str | None = None
                ) -> float | None:
    """Predicted seconds of a run, for its summary; never raises (a missing estimate must not lose a run)."""
    try:
        return predict(setup, requests, backend=backend, with_prefill=True).seconds
    except Exception as e:  # noqa: BLE001
        import warnings

        warnings.warn(f"cost model: no prediction ({type(e).__name__}: {e})", stacklevel=2)
        return None
