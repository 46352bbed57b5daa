"""One side's parallelism and the mapping of its ranks to layers and heads.

Side-local rank ``r = dp_rank * (pp * tp) + pp_rank * tp + tp_rank``. Every attention-DP
group holds the whole model and serves its own requests. Heads split evenly over TP when
``tp <= heads``; when ``tp > heads`` each head is duplicated on ``tp / heads`` consecutive
ranks. PP splits layers evenly (earlier stages take the remainder) or by an explicit
``layer_split``.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvlab.errors import positive, require
from kvlab.spec import DTYPE_BYTES, ModelSpec


class Layout(str, Enum):
    block_major = "block_major"  # [block][layer][comp][head][token][row]: the C++ engines' pools
    layer_major = "layer_major"  # [layer][block][comp][head][token][row]: one tensor per layer


@dataclass(frozen=True)
class RankCoord:
    dp: int
    pp: int
    tp: int


@dataclass(frozen=True)
class SideSpec:
    name: str  # "ctx" or "gen"
    tp: int = 1
    pp: int = 1
    dp: int = 1
    tokens_per_block: int = 32
    layout: Layout = Layout.block_major
    dtype: str = "bf16"
    layer_split: tuple[int, ...] | None = None

    def __post_init__(self):
        for f in ("tp", "pp", "dp", "tokens_per_block"):
            positive(f"{self.name}.{f}", getattr(self, f))
        require(self.layout in (Layout.block_major, Layout.layer_major), f"{self.name}.layout", self.layout,
                "use block_major or layer_major")
        object.__setattr__(self, "layout", Layout(self.layout))
        require(self.dtype in DTYPE_BYTES, f"{self.name}.dtype", self.dtype, f"use one of {', '.join(DTYPE_BYTES)}")
        if self.layer_split is not None:
            object.__setattr__(self, "layer_split", tuple(self.layer_split))
            require(len(self.layer_split) == self.pp, f"{self.name}.layer_split", list(self.layer_split),
                    f"needs one layer count per pp stage ({self.pp})")
            require(all(isinstance(n, int) and n > 0 for n in self.layer_split), f"{self.name}.layer_split",
                    list(self.layer_split), "every stage needs at least one layer")

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp

    def coord(self, rank: int) -> RankCoord:
        require(0 <= rank < self.size, f"{self.name}.rank", rank, f"must be in [0, {self.size})")
        return RankCoord(rank // (self.pp * self.tp), rank // self.tp % self.pp, rank % self.tp)

    def rank(self, dp: int, pp: int, tp: int) -> int:
        return dp * self.pp * self.tp + pp * self.tp + tp

    def validate_for(self, model: ModelSpec) -> None:
        """Check what depends on the model; raises ConfigError naming the field before anything is allocated."""
        n = model.num_layers
        require(self.pp <= n, f"{self.name}.pp", self.pp, f"{model.name} has {n} layers; use pp <= {n}")
        if self.layer_split is not None:
            require(sum(self.layer_split) == n, f"{self.name}.layer_split", list(self.layer_split),
                    f"must add up to the {n} layers of {model.name}")
        h = model.tp_heads
        if h > 1:
            require(h % self.tp == 0 or self.tp % h == 0, f"{self.name}.tp", self.tp,
                    f"{model.name}'s {h} kv heads cannot be split or duplicated over {self.tp} ranks; "
                    f"use a divisor or a multiple of {h}")

    def stage_layers(self, model: ModelSpec, pp_rank: int) -> range:
        """Global layers held by pipeline stage ``pp_rank``."""
        if self.layer_split is not None:
            counts = self.layer_split
        else:
            base, extra = divmod(model.num_layers, self.pp)
            counts = [base + (1 if s < extra else 0) for s in range(self.pp)]
        start = sum(counts[:pp_rank])
        return range(start, start + counts[pp_rank])

    def head_range(self, heads: int, tp_rank: int) -> range:
        """Heads held by ``tp_rank`` out of ``heads`` (one head when duplicated; all when replicated)."""
        if heads == 1:
            return range(1)
        if self.tp <= heads:
            per = heads // self.tp
            return range(tp_rank * per, (tp_rank + 1) * per)
        h = tp_rank // (self.tp // heads)
        return range(h, h + 1)

    def head_holders(self, heads: int, head: int) -> range:
        """TP ranks that hold ``head`` (several when duplicated or replicated)."""
        if heads == 1:
            return range(self.tp)
        if self.tp <= heads:
            t = head // (heads // self.tp)
            return range(t, t + 1)
        dup = self.tp // heads
        return range(head * dup, (head + 1) * dup)
