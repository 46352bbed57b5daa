"""The ``link`` config group: the message sizes and repeats of ``kvlab link`` (kvlab.rank.linkcurve).

As nccl-tests' ``-b``/``-e``/``-f``: sizes from ``min_bytes`` to ``max_bytes``, each ``factor`` times the
one before; unset, 64 KiB to 64 MiB on CPUs and 1 MiB to 1 GiB on GPUs, factor 4. Each size gets one
untimed round and ``repeats`` timed ones (median and range reported), then one checked round.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvlab.core.bounds import bounded
from kvlab.core.errors import require

MAX_BYTES = 1 << 32  # one message is one staging slot of every rank: 4 GiB is beyond any host's budget for it
DEFAULT_RANGE = {"cpu": (64 << 10, 64 << 20), "cuda": (1 << 20, 1 << 30)}


@dataclass(frozen=True)
class LinkSpec:
    # the smallest message (bytes); unset: 64 KiB on CPUs, 1 MiB on GPUs
    min_bytes: int | None = bounded(None, hi=MAX_BYTES, unit="bytes")
    # the largest message (bytes); unset: 64 MiB on CPUs, 1 GiB on GPUs
    max_bytes: int | None = bounded(None, hi=MAX_BYTES, unit="bytes")
    factor: int = bounded(4, hi=1024)  # each size this many times the one before
    repeats: int = bounded(5, hi=10000)  # timed repeats per size, after one untimed round

    def __post_init__(self):
        for name in ("min_bytes", "max_bytes"):
            v = getattr(self, name)
            require(v is None or isinstance(v, int) and not isinstance(v, bool) and v > 0, f"link.{name}", v,
                    "must be a message size in bytes > 0, e.g. 65536")
        if self.min_bytes and self.max_bytes:
            require(self.max_bytes >= self.min_bytes, "link.max_bytes", self.max_bytes,
                    f"must be >= link.min_bytes={self.min_bytes}")
        require(isinstance(self.factor, int) and self.factor >= 2, "link.factor", self.factor,
                "must be an integer >= 2 (each size that many times the one before)")
        require(isinstance(self.repeats, int) and self.repeats >= 1, "link.repeats", self.repeats,
                "must be a positive number of timed repeats")

    def sizes(self, kind: str = "cpu") -> list[int]:
        lo, hi = DEFAULT_RANGE["cuda" if kind == "cuda" else "cpu"]
        lo, hi = self.min_bytes or min(lo, self.max_bytes or lo), self.max_bytes or max(hi, self.min_bytes or hi)
        out = [lo]
        while out[-1] * self.factor <= hi:
            out.append(out[-1] * self.factor)
        return out
