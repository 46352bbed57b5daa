"""Cache state: everything the other side must know about one rank's cache.

Both sides build their states from the config, exchange them once at handshake and
derive plan, schedule and zero-copy decisions from the pair with pure functions, so the
two sides always post matching sends and receives. ``check_compatible`` names every
difference the transfer cannot bridge on both sides before any byte moves.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from kvlab.errors import ConfigError
from kvlab.parallel import Layout, RankCoord, SideSpec
from kvlab.spec import ModelSpec, PoolSpec


@dataclass(frozen=True)
class RankPool:
    """The part of a pool one rank holds, and its memory strides inside one (block, layer)."""

    spec: PoolSpec
    layers: range  # pool-local layer indices held by the rank (contiguous)
    heads: range  # global head ids held by the rank
    tokens_per_block: int
    layout: Layout

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def rows(self) -> tuple[int, ...]:
        return self.spec.comp_row_bytes()

    @property
    def block_layer_bytes(self) -> int:
        """Bytes of one block of one layer: every component, every held head, every token row."""
        return self.tokens_per_block * len(self.heads) * sum(self.rows)

    def comp_offsets(self) -> tuple[int, ...]:
        """Byte offset of each component inside one (block, layer): [comp][head][token][row]."""
        out, acc = [], 0
        for row in self.rows:
            out.append(acc)
            acc += len(self.heads) * self.tokens_per_block * row
        return tuple(out)

    def strides(self, num_blocks: int) -> tuple[int, int]:
        """(block stride, layer stride) in bytes for a pool tensor of ``num_blocks`` blocks."""
        if self.layout == Layout.block_major:
            return len(self.layers) * self.block_layer_bytes, self.block_layer_bytes
        return self.block_layer_bytes, num_blocks * self.block_layer_bytes

    def pool_bytes(self, num_blocks: int) -> int:
        return num_blocks * len(self.layers) * self.block_layer_bytes

    def held_start(self, isl: int) -> int:
        """First token whose block this rank holds for a prompt of ``isl`` tokens (windows keep only their tail)."""
        return window_start(self.spec, isl, self.tokens_per_block)


def window_start(pool: PoolSpec, isl: int, align: int) -> int:
    """First token of a request that pool ``pool`` needs, rounded down to ``align`` tokens."""
    if not pool.window:
        return 0
    return max(0, isl - pool.window) // align * align


@dataclass(frozen=True)
class CacheState:
    model: ModelSpec
    side: SideSpec
    rank: int  # side-local

    @property
    def coord(self) -> RankCoord:
        return self.side.coord(self.rank)

    def pools(self) -> tuple[RankPool, ...]:
        """The pools this rank holds (pools with no layer in this rank's stage are left out)."""
        c = self.coord
        stage = self.side.stage_layers(self.model, c.pp)
        out = []
        for p in self.model.pools(self.side.dtype):
            local = [i for i, g in enumerate(p.layers) if g in stage]
            if local:
                out.append(RankPool(p, range(local[0], local[-1] + 1), self.side.head_range(p.heads, c.tp),
                                    self.side.tokens_per_block, self.side.layout))
        return tuple(out)

    def pool(self, name: str) -> RankPool:
        for p in self.pools():
            if p.name == name:
                return p
        raise KeyError(f"{self.side.name} rank {self.rank} holds no pool {name}")

    def to_dict(self) -> dict:
        """What travels at handshake: plain values, so a peer can compare field by field."""
        d = {"side": asdict(self.side), "model": asdict(self.model), "rank": self.rank}
        d["side"]["layout"] = self.side.layout.value
        d["model"]["attention"] = self.model.attention.value
        return d


def wire_tile(ctx: SideSpec, gen: SideSpec) -> int:
    """Tokens per wire tile: a tile never crosses a block on either side."""
    return math.gcd(ctx.tokens_per_block, gen.tokens_per_block)


def check_compatible(a: dict, b: dict, names: tuple[str, str] = ("ctx", "gen")) -> None:
    """Raise one ConfigError naming both values for the first difference no transfer can bridge.

    ``a`` and ``b`` are ``CacheState.to_dict()`` of two ranks (a ctx and a gen rank, or two
    ranks of one side, which must also agree on their side's parallelism).
    """
    am, bm = a["model"], b["model"]
    for key in ModelSpec.cache_fields():
        if am[key] != bm[key]:
            raise ConfigError(f"model.{key}", f"{am[key]} ({names[0]}) vs {bm[key]} ({names[1]})",
                              "both sides must serve the same model")
    if a["side"]["dtype"] != b["side"]["dtype"]:
        raise ConfigError("dtype", f"{a['side']['dtype']} ({names[0]}) vs {b['side']['dtype']} ({names[1]})",
                          "kvlab moves cache bytes as they are; give both sides the same dtype")
    if a["side"]["name"] == b["side"]["name"]:
        for key in ("tp", "pp", "dp", "tokens_per_block", "layout", "layer_split"):
            if a["side"][key] != b["side"][key]:
                side = a["side"]["name"]
                raise ConfigError(f"{side}.{key}", f"{a['side'][key]} ({names[0]}) vs {b['side'][key]} ({names[1]})",
                                  f"every {side} rank must be started with the same {side} config")
