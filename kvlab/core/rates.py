"""Machine rates for the cost model (kvlab.sizing.cost), and the ``cost`` config group that picks them.

A profile is one machine's measured rates: ``h200`` (2xH200 over NVLink with NCCL: the
one-message link figures and the kernel bench) or ``cpu`` (gloo on a small CPU machine with the
torch reference copies). ``cost.profile=auto`` picks ``cpu`` under gloo or without a GPU and
``h200`` otherwise; any other key of the group overrides one rate, e.g. ``cost.alpha_us=20``
or ``cost.link_gbps=[200,300,340,360]``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from kvlab.core.errors import ConfigError, require
from kvlab.core.sim_terms import Fitted

MiB = 2**20


@dataclass(frozen=True)
class CostRates:
    """Rates of one machine. Defaults: 2xH200 over NVLink with NCCL (measured: docs/design.md)."""

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
    # the prefill's writes of a ctx rank's cache (prefill=sim's fill: contents made and written), bytes per second;
    # 0: not modelled (a GPU writes them on a stream of its own, microseconds beside a layer's compute)
    fill_gbps: float = 0.0
    # a KV dtype converted in the copy itself where the kernels take the rows (kvlab.memory.ops.paths: ``convert``,
    # the CUDA kernels: the converting side's rows read or written once, in place of the wire's); False: one more
    # pass over them after or before the copy (torch's ``staged`` conversion, what a CPU rank runs)
    convert_in_copy: bool = True

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
        if self.host_us < 0 or self.devices < -1 or self.copy_gbps_per_cta < 0 or self.fill_gbps < 0:
            raise ValueError("cost.host_us, cost.copy_gbps_per_cta and cost.fill_gbps must be >= 0, "
                             "cost.devices >= -1")
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

    def fill_s(self, nbytes: float) -> float:
        """Seconds for a ctx rank's prefill to write ``nbytes`` of its cache (0 where not modelled)."""
        return nbytes / (self.fill_gbps * 1e9) if self.fill_gbps else 0.0


PROFILES = {
    "h200": CostRates(),
    # kvlab runs over gloo on a 2-core machine, fitted by scripts/cpu_profile.py to seven runs of the current code
    # (results/cpu_profile.json; docs/results/cpu.md): the copies at ~1.1 GB/s of payload plus ~1.9 ms of host work
    # each, the prefill's cache writes at ~3.9 GB/s; the runs are bound by those, not by the link, so alpha_us and
    # link_gbps sit on the fit's bounds (kvlab link measures the link itself); the ranks share the cores
    "cpu": CostRates(profile="cpu", alpha_us=20.0, link_mib=(16.0, 64.0), link_gbps=(6.0, 8.0),
                     copy_gbps=2.16, copy_efficiency=1.0, copy_gbps_per_cta=0.0, devices=-1, host_us=1890.0,
                     blocking=True, fill_gbps=3.92, convert_in_copy=False),
}


@dataclass(frozen=True)
class CostSpec:
    """The ``cost`` group: ``profile`` picks the rates, any other key set overrides one of them."""

    profile: str = "auto"  # auto (gloo or no GPU: cpu, else h200) | h200 | cpu
    # each of these, set, overrides the profile's rate of that name (kvlab.core.rates.Rates); null: the profile's
    alpha_us: float | None = None  # fixed cost of one message, us
    link_mib: tuple[float, ...] | None = None  # one-message sizes the link rates are given at, MiB
    link_gbps: tuple[float, ...] | None = None  # the link's end-to-end GB/s at those sizes
    copy_gbps: float | None = None  # device-to-device copy, bytes read + written per second
    copy_efficiency: float | None = None  # the pack/unpack kernels' best share of copy_gbps
    copy_gbps_per_cta: float | None = None  # the kernels' GB/s per CTA (transfer.pack_ctas)
    devices: int | None = None  # devices the ranks share (0: one per rank; -1: this machine's CPU cores)
    host_us: float | None = None  # host time per staged copy, us
    blocking: bool | None = None  # copies and host work share one core and the host waits for them (CPU)
    fill_gbps: float | None = None  # the prefill's cache writes on a ctx rank, GB/s (0: not modelled)
    convert_in_copy: bool | None = None  # a KV dtype converted in the copy's own pass (the CUDA kernels)
    fitted: Any = None  # a calibrated profile's terms (kvlab.core.sim_terms; written by kvlab sim calibrate)

    def __post_init__(self):
        object.__setattr__(self, "fitted", Fitted.of(self.fitted))
        for name in ("link_mib", "link_gbps"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(float(x) for x in getattr(self, name)))
        require(self.profile == "auto" or self.profile in PROFILES, "cost.profile", self.profile,
                f"use auto or one of {', '.join(PROFILES)}")
        # the overrides must make valid rates whichever profile auto picks at run time
        for name in ([self.profile] if self.profile != "auto" else list(PROFILES)):
            try:
                replace(PROFILES[name], **self.overrides)
            except ValueError as e:
                key = next((k for k in self.overrides if f"cost.{k}" in str(e)), "profile")
                raise ConfigError(f"cost.{key}", getattr(self, key), f"with the {name} rates: {e}") from None

    @property
    def overrides(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("profile", "fitted") and getattr(self, f.name) is not None}

    def rates(self, backend: str) -> CostRates:
        """The rates for a run whose pairs talk over ``backend`` (``gloo``, ``nccl``, ``cpu:gloo,cuda:nccl``)."""
        profile = self.profile if self.profile != "auto" else ("h200" if "nccl" in backend else "cpu")
        return replace(PROFILES[profile], **self.overrides)

    def rates_for(self, backend: str, transport: str) -> CostRates:
        """``rates``, or where the profile holds fitted terms for ``transport``, those terms as rates: a chunk
        costs ``piece_us`` plus its bytes at ``byte_ns``, staged bytes ``staged_byte_ns`` more (split between
        pack and unpack), on a device of its own per rank."""
        base = self.rates(backend)
        if self.fitted is None or transport not in self.fitted.transports:
            return base
        t = self.fitted.transports[transport]
        n = 16 * MiB
        wire_s = t.piece_us * 1e-6 + n * max(t.byte_ns, 1e-6) * 1e-9
        copy = 4.0 / t.staged_byte_ns if t.staged_byte_ns else 1e9
        return replace(base, profile=f"{self.profile} (fitted, {transport})", alpha_us=t.piece_us,
                       link_mib=(16.0,), link_gbps=(n / wire_s / 1e9,), copy_gbps=copy, copy_efficiency=1.0,
                       copy_gbps_per_cta=0.0, devices=0, host_us=0.0, blocking=False)
