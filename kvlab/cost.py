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
  (``zerocopy``, consecutive blocks) skips that side's copy;
- a device's copies run one at a time, and so do its outgoing and its incoming messages;
  different devices run at once, so pairs on distinct GPUs overlap; ranks sit on devices
  as the runner puts them (``kvlab.transport.gpu_index``);
- each rank keeps at most ``slots`` chunks in flight, as the executor does, and a chunk
  waits for its turn; the simulated prefill (``layer_compute_ms`` per layer) releases a
  ``layerwise`` chunk when its layer is done and any other chunk when every layer is.

Pipeline fill and drain, back-pressure and layer readiness follow from placing the chunks
on the clock one by one in the global order.

Extra device memory per rank: ``slots * slot_bytes`` (allocated once at start), or for
``naive`` the largest sum of ``slots`` consecutive per-chunk buffers of any rank (a chunk
is a whole segment there, so it grows with the prompt).

Rates come from a profile: ``h200`` (the measured figures in DESIGN.md and the kernel
bench) or ``cpu`` (gloo on a small CPU machine with the torch reference copies), picked
from the backend (gloo: cpu) or the device, and overridable key by key:
``cost.alpha_us=20``, ``cost.link_gbps=[200,300,340,360]``, ``cost=cpu`` once ``cost`` is a
group of conf/config.yaml; until then append them: ``+cost.alpha_us=20``, ``+cost.profile=cpu``.

Against the 2xH200 benchmark (scripts/bench.py, results/bench_h200x2.json: Llama-3.1-8B at
4k-128k and DeepSeek-V3.2 at 128k, every strategy) the extra memory is exact and the time
within 8% for naive, zerocopy and chunked with 2 x 128 MiB slots from 32k tokens on (median
ratio 0.94 over all 28 transfers); 4k requests take up to 2x, and layerwise at 4k 4x, longer
than predicted (per-request and per-layer host costs are not modelled). On a 2-core CPU the
time is within about 0.5-1.5x.
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from kvlab.plan import Request, plan
from kvlab.schedule import Chunk, Strategy, schedule

if TYPE_CHECKING:
    from kvlab.config import Setup

MiB = 2**20


@dataclass(frozen=True)
class CostRates:
    """Rates of one machine. Defaults: 2xH200 over NVLink with NCCL (DESIGN.md, measured)."""

    profile: str = "h200"
    alpha_us: float = 15.0  # fixed cost of one message: 4096 x 64 KiB moved at 4.2 GB/s
    link_mib: tuple[float, ...] = (16.0, 64.0, 256.0, 1024.0)  # one-message sizes measured ...
    link_gbps: tuple[float, ...] = (214.0, 304.0, 345.0, 365.0)  # ... and their end-to-end GB/s
    copy_gbps: float = 4210.0  # device-to-device copy, bytes read + bytes written per second
    copy_efficiency: float = 0.9  # the pack/unpack kernels' best share of it (bench: 0.91 on all 132 SMs)
    copy_gbps_per_cta: float = 88.0  # kernels on transfer.pack_ctas CTAs (bench: ~730/1400/2800 at 8/16/32)
    devices: int = 0  # devices the ranks share (0: one per rank; -1: this machine's CPU cores)
    host_us: float = 0.0  # host time per staged copy (block table to copy runs, launch); unmeasured on GPUs
    blocking: bool = False  # copies and host work share one core and the host waits for them (CPU)

    def __post_init__(self):
        object.__setattr__(self, "link_mib", tuple(float(x) for x in self.link_mib))
        object.__setattr__(self, "link_gbps", tuple(float(x) for x in self.link_gbps))
        if not self.link_mib or len(self.link_mib) != len(self.link_gbps):
            raise ValueError(f"cost.link_mib ({len(self.link_mib)} sizes) and cost.link_gbps "
                             f"({len(self.link_gbps)} rates) need one rate per size")
        if list(self.link_mib) != sorted(self.link_mib):
            raise ValueError(f"cost.link_mib={list(self.link_mib)}: sizes must ascend")
        for name in ("copy_gbps", "copy_efficiency"):
            if getattr(self, name) <= 0:
                raise ValueError(f"cost.{name}={getattr(self, name)}: must be > 0")
        if self.host_us < 0 or self.devices < -1 or self.copy_gbps_per_cta < 0:
            raise ValueError("cost.host_us and cost.copy_gbps_per_cta must be >= 0, cost.devices >= -1")
        if self.alpha_us < 0 or any(g <= 0 for g in self.link_gbps):
            raise ValueError("cost.alpha_us must be >= 0 and cost.link_gbps > 0")
        for n, g in zip(self.link_mib, self.link_gbps, strict=True):
            if n * MiB / (g * 1e9) <= self.alpha_us * 1e-6:
                raise ValueError(f"cost.link_gbps: {g} GB/s for {n} MiB is faster than alpha_us={self.alpha_us} "
                                 "allows; lower alpha_us or the rate")

    @property
    def alpha_s(self) -> float:
        return self.alpha_us * 1e-6

    @property
    def peak_link_gbps(self) -> float:
        return max(self.link_gbps)

    def wire_rate(self, nbytes: float) -> float:
        """Bytes per second on the wire, after alpha, for one message of ``nbytes``."""
        pts = [(math.log2(n * MiB), n * MiB / (n * MiB / (g * 1e9) - self.alpha_s))
               for n, g in zip(self.link_mib, self.link_gbps, strict=True)]
        x = math.log2(max(nbytes, 1))
        if x <= pts[0][0]:
            return pts[0][1]
        for (x0, r0), (x1, r1) in zip(pts, pts[1:], strict=False):
            if x <= x1:
                return r0 + (r1 - r0) * (x - x0) / (x1 - x0)
        return pts[-1][1]

    def message_s(self, nbytes: float) -> float:
        """Seconds of one message of ``nbytes`` alone on a link."""
        return self.alpha_s + nbytes / self.wire_rate(nbytes)

    def copy_s(self, nbytes: float, ctas: int = 0) -> float:
        """Seconds to pack or unpack ``nbytes`` (each byte read once and written once) on ``ctas`` CTAs."""
        rate = self.copy_gbps * self.copy_efficiency
        if ctas and self.copy_gbps_per_cta:
            rate = min(rate, self.copy_gbps_per_cta * ctas)
        return 2 * nbytes / (rate * 1e9)


PROFILES = {
    "h200": CostRates(),
    # kvlab runs over gloo on a 2-core machine, fitted: ~0.3 ms per message (in-place chunks
    # back to back) plus 1.2-2.7 GB/s (loopback; ecosystem.md saw 0.33 GiB/s on another host),
    # the torch reference copies at ~0.063 GB/s of payload plus ~2.6 ms of Python per copy;
    # the ranks share the cores
    "cpu": CostRates(profile="cpu", alpha_us=300.0, link_mib=(16.0, 64.0), link_gbps=(1.5, 2.0),
                     copy_gbps=0.125, copy_efficiency=1.0, copy_gbps_per_cta=0.0, devices=-1, host_us=2600.0,
                     blocking=True),
}


@dataclass
class CostCfg:
    """Hydra schema of the ``cost`` group: ``profile`` picks the rates, any other key overrides one."""

    profile: str = "auto"  # auto (gloo or no GPU: cpu, else h200) | h200 | cpu
    alpha_us: float | None = None
    link_mib: list[float] | None = None
    link_gbps: list[float] | None = None
    copy_gbps: float | None = None
    copy_efficiency: float | None = None
    copy_gbps_per_cta: float | None = None
    devices: int | None = None
    host_us: float | None = None
    blocking: bool | None = None


def _auto_profile(cfg: Any, backend: str | None) -> str:
    if backend:
        return "cpu" if "nccl" not in backend else "h200"
    device = (cfg.get("device") if cfg is not None else None) or "auto"
    if device == "cpu":
        return "cpu"
    if device == "cuda":
        return "h200"
    try:
        import torch

        return "h200" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def rates_from_cfg(cfg: Any = None, backend: str | None = None) -> CostRates:
    """The rates for a composed config: ``cfg.cost`` if present (profile and key overrides), else auto."""
    cost = cfg.get("cost") if cfg is not None else None
    cost = dict(cost) if cost else {}
    profile = cost.pop("profile", None) or "auto"
    if profile == "auto":
        profile = _auto_profile(cfg, backend)
    if profile not in PROFILES:
        raise ValueError(f"cost.profile={profile}: unknown profile; use auto or one of {', '.join(PROFILES)}")
    known = {f.name for f in fields(CostRates)} - {"profile"}
    unknown = set(cost) - known
    if unknown:
        raise ValueError(f"cost.{sorted(unknown)[0]}: unknown cost key; use one of {', '.join(sorted(known))}")
    overrides = {k: (tuple(v) if k.startswith("link_") else v) for k, v in cost.items() if v is not None}
    return replace(PROFILES[profile], **overrides)


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
    seconds: float  # the whole workload: first request opened to last byte unpacked
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
    (``kvlab.transport.gpu_index``); with ``devices=-1`` the devices are this machine's CPU cores."""
    from kvlab.transport import gpu_index

    nc, ng = setup.ctx.size, setup.gen.size
    world = nc + ng
    if devices == -1:  # gloo ranks are processes spread over the cores
        cores = os.cpu_count() or 1
        return [r % cores for r in range(nc)], [(nc + r) % cores for r in range(ng)]
    if devices <= 0 or devices >= world:
        return list(range(nc)), list(range(nc, world))
    where = [gpu_index(setup, w, w, world, devices) for w in range(world)]
    return where[:nc], where[nc:]


def as_requests(setup: Setup, requests: Iterable[Request | int] | None = None) -> list[Request]:
    """The runner's requests (kvlab.workload) by default; bare prompt lengths are spread over the DP groups."""
    if requests is None:
        from kvlab.workload import make_requests

        return make_requests(setup)
    out = []
    for i, r in enumerate(requests):
        out.append(r if isinstance(r, Request) else Request(i, int(r), i % setup.ctx.dp, i % setup.gen.dp))
    return out


def request_chunks(setup: Setup, req: Request) -> list[Chunk]:
    segs = plan(setup.model, setup.ctx, setup.gen, req)
    return schedule(setup.model, setup.ctx, setup.gen, segs, setup.transfer.strategy, setup.transfer.slot_bytes)


def _order(setup: Setup, reqs: list[Request], concurrency: int) -> list[Chunk]:
    """Every request's schedule, merged into the global order the executor walks."""
    from dataclasses import replace as dc_replace

    from kvlab.workload import interleave

    shapes: dict[tuple[int, int, int], list[Chunk]] = {}  # zerocopy schedules are slow to derive: once per shape
    schedules = []
    for req in reqs:
        key = (req.isl, req.ctx_dp, req.gen_dp)
        if key not in shapes:
            shapes[key] = request_chunks(setup, req)
        schedules.append([dc_replace(c, request=req.id) for c in shapes[key]])
    return interleave(schedules, concurrency)


def predict(setup: Setup, requests: Iterable[Request | int] | None = None, rates: CostRates | None = None,
            backend: str | None = None, concurrency: int | None = None) -> Prediction:
    """Place every chunk of the workload on the clock, in the executor's order and under its rules.

    Each rank walks its chunks of the global order with at most ``slots`` in flight: chunk
    ``k`` of a rank starts only once its chunk ``k - slots`` is complete (ctx: sent; gen:
    received and unpacked), in place or not. A ctx rank opens a request at its first chunk
    and, with ``layer_compute_ms``, sends a chunk once the simulated prefill has finished
    the chunk's layer (``layerwise``) or every layer (the others). Every copy costs its side's
    host ``host_us`` first. With ``blocking`` rates (CPU) a rank's core does that work and the
    copies itself, one after the other, shared with the ranks on the same core; on GPUs
    copies queue on the rank's stream and only the copy engine and the window order them.
    """
    rates = rates or rates_from_cfg(setup.cfg, backend)
    reqs = as_requests(setup, requests)
    by_id = {r.id: r for r in reqs}
    strategy = setup.transfer.strategy
    concurrency = concurrency or int(setup.cfg.workload.get("concurrency", 1) or 1)
    blocking = rates.blocking
    host_s = rates.host_us * 1e-6
    ctas = setup.transfer.pack_ctas
    window = setup.transfer.slots
    layer_s = setup.transfer.layer_compute_ms * 1e-3
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

    order = _order(setup, reqs, concurrency)
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
            prefill[key] = host_c[c.src]
        if rc is None:
            rc = costs[c.request] = RequestCost(c.request, by_id[c.request].isl, 0, 0, 0,
                                                min(prefill[key], recv_ready), prefill[key], 0.0, 0.0, 0.0, 0.0)
        if layer_s:
            layer = c.ready_layer if strategy == Strategy.layerwise else last_layer
            host_c[c.src] = max(host_c[c.src], prefill[key] + (layer + 1) * layer_s)
            rc.prefill_end_s = max(rc.prefill_end_s, prefill[key] + (last_layer + 1) * layer_s)
        t = max(host_c[c.src], slot_ready)
        pack = 0.0 if c.ctx_in_place else rates.copy_s(n, ctas)
        rc.pack_s += pack
        if pack and blocking:
            t = host_c[c.src] = copy_free[sd] = max(t, copy_free[sd]) + host_s + pack
        elif pack:
            host_c[c.src] += host_s
            t = copy_free[sd] = max(t, host_c[c.src], copy_free[sd]) + pack
        w0 = max(t, recv_ready, out_free[sd], in_free[dd])
        w1 = w0 + rates.message_s(n)
        out_free[sd] = in_free[dd] = w1
        rc.wire_s += rates.message_s(n)
        sent[c.src].append(w1)
        # gen completes its chunks in order: wait for the bytes, then unpack
        t = max(w1, done_g[c.dst][-1] if kg else 0.0)
        unpack = 0.0 if c.gen_in_place else rates.copy_s(n, ctas)
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
        if strategy != Strategy.naive:
            return setup.transfer.slots * setup.transfer.slot_bytes
        # a buffer per chunk in flight, at most `window` of them
        return max((max(sum(s[max(0, i - window + 1):i + 1]) for i in range(len(s))) for s in sizes if s), default=0)

    ec, eg = extra(sizes_c), extra(sizes_g)
    done = [costs[r.id] for r in reqs if r.id in costs]
    start = min((r.start_s for r in done), default=0.0)
    total = sum(r.bytes for r in done)
    raw = sum(rates.message_s(r.bytes) for r in done if r.bytes)
    return Prediction(rates.profile, strategy.value, max((r.end_s for r in done), default=0.0) - start, total,
                      len(order), max(ec, eg), ec, eg, raw, done)


def predict_cfg(cfg, requests: Iterable[Request | int] | None = None, backend: str | None = None) -> Prediction:
    """``predict`` from a composed config (builds and validates it first)."""
    from kvlab.config import build

    return predict(build(cfg), requests, backend=backend)


def predict_run(setup: Setup, requests: Iterable[Request | int] | None = None, backend: str | None = None
                ) -> float | None:
    """Predicted seconds of a run, for its summary; never raises (a missing estimate must not lose a run)."""
    try:
        return predict(setup, requests, backend=backend).seconds
    except Exception as e:  # noqa: BLE001
        import warnings

        warnings.warn(f"cost model: no prediction ({type(e).__name__}: {e})", stacklevel=2)
        return None
