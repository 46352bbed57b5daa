"""Calibrated terms: what ``kvlab sim calibrate`` fits from runs' records, kept in a cost profile.

A calibrated profile (``cost/<name>.yaml``, in conf/ or the user's config directory) holds under ``fitted`` one
set of terms per transport and one for the prefill. A request's transfer, per (ctx GPU -> gen GPU) pair of its
plan, costs

    pair_s = pieces * piece_us + bytes * max(byte_ns, link) + staged_bytes * staged_byte_ns

(``staged_bytes``: the pair's bytes that go through a staging slot, not in place; ``link``: the seconds per
byte of the link the pair crosses, none in a replay of a run on one machine), and the request once
``rtt_us`` (its control round trips: readiness, block tables, completion) plus the links' latency.
``host_wait``: where the ctx side's host runs the prefill and the transfers on the same cores (a CPU run),
a transfer waits that share of the time until its ctx instance has no prefill left (1: it moves bytes
only while nothing prefills; 0: beside the prefill). ``order_wait``: in the replay of a kvlab run, the share of
the wait for the requests whose chunks come before a request's last one in the run's global chunk order
(kvlab.config.workload: every rank serves its chunks in that order; binding on the shared CPU cores, not on one
H200). A fleet has no such order. The prefill a run measured is

    prefill_s = prefill_slowdown * (scale * model_s + bytes * byte_ns + fixed_ms)

with ``model_s`` the prefill group's model (kvlab.model.prefill), ``bytes`` the cache the request writes and
``prefill_slowdown`` the transport's: its copies beside the prefill slow it (kvlab run's figure
``prefill_slowdown`` on one GPU, the shared cores on a CPU).
``kvlab sim`` reads the terms; ``kvlab plan`` and a run's ``predicted_s`` read the same terms through
``CostSpec.rates_for`` (kvlab.core.rates).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from kvlab.core.errors import ConfigError, require


def _nonneg(where: str, name: str, v) -> float:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
    require(ok, f"{where}.{name}", v, "must be a number >= 0")
    return float(v)


@dataclass(frozen=True)
class TransportTerms:
    byte_ns: float = 0.0  # per byte moved, the transport's own rate (the link's, where slower, wins)
    staged_byte_ns: float = 0.0  # per byte through a staging slot (pack and unpack), on top
    piece_us: float = 0.0  # per chunk
    rtt_us: float = 0.0  # per request: its control round trips
    host_wait: float = 0.0  # share of the wait for the ctx instance's prefills to be done that a transfer waits
    order_wait: float = 0.0  # share of the wait for the requests ahead in a kvlab run's global chunk order (replays)
    prefill_slowdown: float = 1.0  # the prefill while this transport moves bytes beside it, over the prefill model

    @classmethod
    def of(cls, d: dict, where: str) -> TransportTerms:
        require(isinstance(d, dict), where, d, "must be a mapping of byte_ns, staged_byte_ns, piece_us, rtt_us, "
                "host_wait, order_wait, prefill_slowdown")
        d = {k: v for k, v in d.items() if k != "_target_"}  # as a run's recorded config writes it
        unknown = set(d) - {f for f in cls.__dataclass_fields__}
        require(not unknown, f"{where}.{sorted(unknown)[0]}" if unknown else where, "?",
                f"no such term; use {', '.join(cls.__dataclass_fields__)}")
        vals = {k: _nonneg(where, k, v) for k, v in d.items()}
        for k in ("host_wait", "order_wait"):
            require(vals.get(k, 0.0) <= 1, f"{where}.{k}", vals.get(k), "must be in [0, 1]")
        return cls(**vals)


@dataclass(frozen=True)
class PrefillTerms:
    scale: float = 1.0  # on the prefill group's model
    byte_ns: float = 0.0  # per byte of cache the request writes
    fixed_ms: float = 0.0

    @classmethod
    def of(cls, d: dict, where: str) -> PrefillTerms:
        require(isinstance(d, dict), where, d, "must be a mapping of scale, byte_ns, fixed_ms")
        d = {k: v for k, v in d.items() if k != "_target_"}
        unknown = set(d) - {f for f in cls.__dataclass_fields__}
        require(not unknown, where, d, f"no such term; use {', '.join(cls.__dataclass_fields__)}")
        return cls(**{k: _nonneg(where, k, v) for k, v in d.items()})

    def seconds(self, model_s: float, nbytes: float) -> float:
        return self.scale * model_s + nbytes * self.byte_ns * 1e-9 + self.fixed_ms * 1e-3


@dataclass(frozen=True)
class Fitted:
    """The ``fitted`` block of a cost profile."""

    transports: dict[str, TransportTerms] = field(default_factory=dict)
    prefill: PrefillTerms = field(default_factory=PrefillTerms)
    source: str = ""  # what it was fitted from

    @classmethod
    def of(cls, d, where: str = "cost.fitted") -> Fitted | None:
        if d is None or isinstance(d, Fitted):
            return d
        require(isinstance(d, dict), where, d, "must be a mapping with transports and prefill (kvlab sim calibrate "
                "writes it)")
        ts = d.get("transports") or {}
        require(isinstance(ts, dict), f"{where}.transports", ts, "must map a transport name to its terms")
        return cls({k: TransportTerms.of(dict(v or {}), f"{where}.transports.{k}") for k, v in ts.items()},
                   PrefillTerms.of(dict(d.get("prefill") or {}), f"{where}.prefill"), str(d.get("source", "")))

    def terms(self, transport: str, profile: str) -> TransportTerms:
        if transport not in self.transports:
            raise ConfigError("transport", transport, f"the cost profile {profile} has no fitted terms for it; "
                              f"use one of {', '.join(sorted(self.transports)) or '(none)'} or calibrate it "
                              "(kvlab sim calibrate RUN_DIRS...)")
        return self.transports[transport]

    def to_dict(self) -> dict:
        return {"source": self.source, "prefill": asdict(self.prefill),
                "transports": {k: asdict(v) for k, v in sorted(self.transports.items())}}
