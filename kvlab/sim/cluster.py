"""The ``cluster`` group and the ``sim`` keys: what ``kvlab sim`` simulates, typed and checked.

A cluster is ``ctx_instances`` prefill instances and ``gen_instances`` decode instances, each with
its side's parallel layout (``ctx.*`` / ``gen.*``: TP x PP GPUs per attention-DP group, ``dp``
groups per instance), on GPUs of one kind (``cluster.gpu``). GPUs sit in NVLink domains of
``cluster.domain_gpus``; ``cluster.placement`` fills them with instances in order, either every
ctx instance first (``separate``: prefill and decode racks apart) or ctx and gen instances taking
turns (``mixed``). A (ctx GPU, gen GPU) pair in one domain crosses ``links.nvlink``, any other
pair ``links.nic`` (each GPU its own NIC); a link of ``gbit_s: 0`` is not there, and a link that no
pair of the placement crosses is refused (it would only look like part of the answer).

Decode, per attention-DP group of a gen instance, one step for its whole batch (the formula is
``DecodeSpec``'s). Capacity: a request is admitted to a gen DP group when its prompt plus its
output fit the group's KV tokens and the batch has room; its transfer starts only then.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvlab.core.bounds import bounded
from kvlab.core.errors import ConfigError, require

PLACEMENTS = ("separate", "mixed")
ROUTINGS = ("least_loaded", "round_robin")


def _pos(name: str, value, what: str = "must be > 0") -> None:
    require(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0,
            name, value, what)


def _count(name: str, value) -> None:
    require(isinstance(value, int) and not isinstance(value, bool) and value > 0, name, value,
            "must be a positive integer")


@dataclass(frozen=True)
class GpuSpec:
    """One GPU kind: its compute and memory rates (defaults: H200 SXM)."""

    name: str = "h200"
    tflops: float = 989.0  # dense bf16 peak
    mfu: float = 0.5  # share of it a prefill reaches (the prefill group's figure when it says otherwise)
    hbm_gb: float = 141.0  # memory per GPU, GB
    hbm_gbps: float = 4800.0  # memory bandwidth, GB/s
    hbm_efficiency: float = 0.7  # share of it a decode step's reads reach

    def __post_init__(self):
        for k in ("tflops", "hbm_gb", "hbm_gbps"):
            _pos(f"cluster.gpu.{k}", getattr(self, k))
        for k in ("mfu", "hbm_efficiency"):
            v = getattr(self, k)
            require(isinstance(v, (int, float)) and 0 < v <= 1, f"cluster.gpu.{k}", v, "must be in (0, 1]")


@dataclass(frozen=True)
class LinkSpec:
    """One kind of link, per GPU and direction; ``gbit_s: 0`` is no such link."""

    # Gb/s; below 1 Mb/s a transfer of one cache takes days of simulated time, events the sim would crawl through
    gbit_s: float = bounded(400.0, lo=1e-3, zero=True, unit="Gb/s", why="1 Mb/s")
    latency_us: float = bounded(5.0, hi=1e9, unit="us")  # one way, added to every control round trip

    def check(self, name: str) -> None:
        require(isinstance(self.gbit_s, (int, float)) and math.isfinite(self.gbit_s) and self.gbit_s >= 0,
                f"cluster.links.{name}.gbit_s", self.gbit_s, "must be >= 0 Gb/s (0: no such link)")
        require(math.isfinite(self.latency_us) and self.latency_us >= 0, f"cluster.links.{name}.latency_us",
                self.latency_us, "must be >= 0 us")

    @property
    def present(self) -> bool:
        return self.gbit_s > 0

    @property
    def byte_s(self) -> float:
        return 8.0 / (self.gbit_s * 1e9)


@dataclass(frozen=True)
class LinksSpec:
    nvlink: LinkSpec = field(default_factory=lambda: LinkSpec(3600.0, 2.0))  # 450 GB/s a direction
    nic: LinkSpec = field(default_factory=LinkSpec)  # one 400 Gb/s NIC per GPU

    def __post_init__(self):
        for name in ("nvlink", "nic"):
            getattr(self, name).check(name)

    def get(self, name: str) -> LinkSpec | None:
        link = getattr(self, name)
        return link if link.present else None


@dataclass(frozen=True)
class DecodeSpec:
    """The decode step of one gen attention-DP group of ``G = gen.tp * gen.pp`` GPUs:

        step_s = step_us + max( (W + K * kv_token_bytes) / (G * hbm_gbps * hbm_efficiency),
                                2 * A * B / (G * tflops * mfu) )

    with ``W`` the weights read every step (``weights_gb``, else the active parameters per token from
    ``model.dims``, as the prefill counts them, at ``weight_bytes`` each: a lower bound for MoE, whose
    batch touches more experts than one token does), ``K`` the tokens in the batch's caches,
    ``kv_token_bytes`` the cache bytes of one token (the plan's), ``A`` the active parameters and ``B``
    the batch. A request's time per output token is its decode span over its output tokens.
    """

    step_us: float = bounded(200.0, hi=1e9, unit="us")  # per step: scheduling, launches, sampling
    weights_gb: float | None = None  # weights read each step by one DP group, GB; null: from model.dims
    weight_bytes: float = 1.0  # bytes per parameter when derived (1: fp8, 2: bf16)
    max_batch: int = bounded(256, lo=1, hi=1 << 20)  # requests one DP group decodes at once
    capacity_tokens: int = 0  # KV tokens one DP group holds; 0: what its HBM leaves after the weights
    memory_fraction: float = 0.9  # share of HBM the engine takes (weights + KV)

    def __post_init__(self):
        require(math.isfinite(self.step_us) and self.step_us >= 0, "cluster.decode.step_us", self.step_us,
                "must be >= 0 us")
        if self.weights_gb is not None:
            require(math.isfinite(self.weights_gb) and self.weights_gb >= 0, "cluster.decode.weights_gb",
                    self.weights_gb, "must be >= 0 GB, or null (from model.dims)")
        _pos("cluster.decode.weight_bytes", self.weight_bytes)
        _count("cluster.decode.max_batch", self.max_batch)
        require(isinstance(self.capacity_tokens, int) and self.capacity_tokens >= 0, "cluster.decode.capacity_tokens",
                self.capacity_tokens, "must be 0 (from HBM) or a positive number of tokens")
        require(0 < self.memory_fraction <= 1, "cluster.decode.memory_fraction", self.memory_fraction,
                "must be in (0, 1]")


@dataclass(frozen=True)
class ClusterSpec:
    ctx_instances: int = bounded(4, lo=1, hi=1 << 16)
    gen_instances: int = bounded(4, lo=1, hi=1 << 16)
    gpu: GpuSpec = field(default_factory=GpuSpec)
    domain_gpus: int = 8  # GPUs of one NVLink domain (8: HGX; 72: NVL72)
    placement: str = "separate"  # separate | mixed
    routing: str = "least_loaded"  # least_loaded (the earliest free) | round_robin (request i to i % n, as kvlab run)
    links: LinksSpec = field(default_factory=LinksSpec)
    decode: DecodeSpec = field(default_factory=DecodeSpec)

    def __post_init__(self):
        _count("cluster.ctx_instances", self.ctx_instances)
        _count("cluster.gen_instances", self.gen_instances)
        _count("cluster.domain_gpus", self.domain_gpus)
        require(self.placement in PLACEMENTS, "cluster.placement", self.placement, f"use {' or '.join(PLACEMENTS)}")
        require(self.routing in ROUTINGS, "cluster.routing", self.routing, f"use {' or '.join(ROUTINGS)}")

    def domains(self, ctx_gpus: int, gen_gpus: int) -> tuple[list[int], list[int]]:
        """NVLink domain of each ctx instance and each gen instance (of its first GPU), as placed."""
        order = [("ctx", i) for i in range(self.ctx_instances)] + [("gen", j) for j in range(self.gen_instances)]
        if self.placement == "mixed":  # ctx and gen instances take turns
            order = [(side, k) for k in range(max(self.ctx_instances, self.gen_instances))
                     for side, n in (("ctx", self.ctx_instances), ("gen", self.gen_instances)) if k < n]
        ctx, gen = [0] * self.ctx_instances, [0] * self.gen_instances
        gpu = 0
        for side, i in order:
            size = ctx_gpus if side == "ctx" else gen_gpus
            left = self.domain_gpus - gpu % self.domain_gpus
            if size <= self.domain_gpus and size > left:  # an instance that fits a domain is not split over two
                gpu += left
            (ctx if side == "ctx" else gen)[i] = gpu // self.domain_gpus
            gpu += size
        return ctx, gen

    def same_domain(self, ctx_gpus: int, gen_gpus: int) -> list[list[bool]]:
        """``[i][j]``: whether ctx instance i and gen instance j share an NVLink domain (both whole in it)."""
        cd, gd = self.domains(ctx_gpus, gen_gpus)
        fits = ctx_gpus <= self.domain_gpus and gen_gpus <= self.domain_gpus
        return [[fits and c == g for g in gd] for c in cd]

    def check_links(self, ctx_gpus: int, gen_gpus: int) -> None:
        """Every pair has a link to cross, and every link is crossed by some pair."""
        same = self.same_domain(ctx_gpus, gen_gpus)
        any_in = any(any(row) for row in same)
        any_out = any(not x for row in same for x in row)
        for name, used, where in (("nvlink", any_in, "no ctx and gen instance share an NVLink domain"),
                                  ("nic", any_out, "every ctx and gen instance share an NVLink domain")):
            link = self.links.get(name)
            if link is not None and not used:
                raise ConfigError(f"cluster.links.{name}.gbit_s", f"{link.gbit_s:g}",
                                  f"no placement uses it: {where} (cluster.placement={self.placement}, "
                                  f"domain_gpus={self.domain_gpus}, {self.ctx_instances} x {ctx_gpus} ctx GPUs, "
                                  f"{self.gen_instances} x {gen_gpus} gen GPUs); set it to 0 (no such link) "
                                  "or change the placement")
            if link is None and used:
                raise ConfigError(f"cluster.links.{name}.gbit_s", 0, f"some ctx/gen pairs need it under "
                                  f"cluster.placement={self.placement}; give its rate (Gb/s per GPU)")


@dataclass(frozen=True)
class SloSpec:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __post_init__(self):
        for k in ("ttft_ms", "tpot_ms"):
            v = getattr(self, k)
            if v is not None:
                _pos(f"sim.slo.{k}", v, "must be a time > 0 in ms, or null for no SLO on it")

    def met(self, ttft_s: float, tpot_s: float) -> bool:
        ok = self.ttft_ms is None or ttft_s * 1e3 <= self.ttft_ms
        return ok and (self.tpot_ms is None or not math.isfinite(tpot_s) or tpot_s * 1e3 <= self.tpot_ms)


@dataclass(frozen=True)
class SimSpec:
    """The ``sim`` keys: the rate, the SLOs, the rate search and what is written."""

    terms: str | None = None  # whose fitted terms cost the transfers (a transport's name); null: the transport's own
    # req/s: Poisson at this rate, or the trace rescaled to it; null: as the workload
    rate: float | None = bounded(None, lo=1e-3, hi=1e9, unit="requests/s")
    slo: SloSpec = field(default_factory=SloSpec)
    target: float = 0.9  # share of requests that must meet the SLOs for a rate to count as served
    search: bool = False  # search the highest rate meeting the SLOs (bracket, then bisection over sim.rate)
    # req/s: the first bracket; the search moves it down (x1/4) while it misses
    search_lo: float = bounded(0.1, lo=1e-3, hi=1e9, unit="requests/s")
    # req/s: moved up (x4) while it still meets them
    search_hi: float = bounded(1000.0, lo=1e-3, hi=1e9, unit="requests/s")
    search_steps: int = bounded(8, lo=1, hi=64)  # bisection steps once the rate is bracketed
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    decode: bool = True  # false: no decode (a kvlab run's replay, where the gen ranks verify instead)
    write_requests: bool = True  # requests.jsonl in the output directory

    def __post_init__(self):
        if self.rate is not None:
            _pos("sim.rate", self.rate, "must be > 0 requests per second, or null (the workload's own)")
        require(0 < self.target <= 1, "sim.target", self.target, "must be in (0, 1]")
        _pos("sim.search_lo", self.search_lo)
        require(self.search_hi > self.search_lo, "sim.search_hi", self.search_hi,
                f"must be > sim.search_lo={self.search_lo}")
        _count("sim.search_steps", self.search_steps)
        object.__setattr__(self, "percentiles", tuple(float(q) for q in self.percentiles))
        require(all(0 <= q <= 100 for q in self.percentiles) and self.percentiles, "sim.percentiles",
                list(self.percentiles), "must be a non-empty list in [0, 100]")
        if self.search:
            require(self.slo.ttft_ms is not None or self.slo.tpot_ms is not None, "sim.search", True,
                    "needs an SLO to search under: set sim.slo.ttft_ms and/or sim.slo.tpot_ms")
