"""One side's parallelism and the mapping of its ranks to layers and heads.

Side-local rank ``r = dp_rank * (pp * tp) + pp_rank * tp + tp_rank``. Every attention-DP
group holds the whole model and serves its own requests. Heads split evenly over TP when
``tp <= heads``; when ``tp > heads`` each head is duplicated on ``tp / heads`` consecutive
ranks. PP splits layers evenly (earlier stages take the remainder) or by an explicit
``layer_split``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from kvlab.core.bounds import bounded
from kvlab.core.errors import ConfigError, positive, require
from kvlab.model import kv_dtype
from kvlab.model.engine_layouts import LAYOUTS, NAMES, EngineLayout, Layout, layout_of
from kvlab.model.prefix import BLOCK_TOKENS
from kvlab.model.spec import DTYPE_BYTES, ModelSpec

__all__ = ["EngineLayout", "Layout", "RankCoord", "SideSpec"]


@dataclass(frozen=True)
class RankCoord:
    dp: int
    pp: int
    tp: int


@dataclass(frozen=True)
class SideSpec:
    name: str  # "ctx" or "gen"
    tp: int = bounded(1, hi=1 << 12)  # tensor-parallel ranks of one replica: heads split over them
    pp: int = bounded(1, hi=1 << 12)  # pipeline stages: layers split over them (layer_split, else as evenly as they go)
    dp: int = bounded(1, hi=1 << 12)  # replicas (attention data parallel): each serves its own requests
    # None: the layout's default (kvlab.model.engine_layouts); for a layout whose block size some cache kind fixes, left
    # None until ``resolved`` for a model (a run's Setup holds it resolved); read it through ``block_tokens``
    tokens_per_block: int | None = bounded(None, hi=1 << 16)
    # a Layout or an EngineLayout name (kvlab.model.engine_layouts); the enum member once built
    layout: str = "block_major"
    dtype: str = "bf16"  # the model's compute dtype, of what the prefill writes
    # layers per pipeline stage, adding up to the model's; null: even
    layer_split: tuple[int, ...] | None = bounded(None, hi=1 << 12)
    # the dtype its K/V (or MLA) rows are kept in (kvlab.model.kv_dtype): bf16, fp16, or fp8 e4m3 with fp32 scales;
    # None: ``dtype``. Where the two sides differ the values are converted in flight
    kv_dtype: str | None = None
    # gen only: tokens of earlier prompts' blocks each gen DP group keeps for prefix reuse (each rank its share), LRU by
    # block hash (kvlab.model.prefix; needs a trace with hash_ids, workload=mooncake); 0: off
    prefix_cache_tokens: int = bounded(0, hi=1 << 24)

    def __post_init__(self):
        for f in ("tp", "pp", "dp"):
            positive(f"{self.name}.{f}", getattr(self, f))
        try:
            object.__setattr__(self, "layout", layout_of(self.layout))
        except ValueError:
            raise ConfigError(f"{self.name}.layout", self.layout, f"use one of {', '.join(NAMES)}") from None
        if self.tokens_per_block is not None:
            positive(f"{self.name}.tokens_per_block", self.tokens_per_block)
        elif not LAYOUTS[self.layout.value].fixed_tpb:  # the layout's default, whatever the model
            object.__setattr__(self, "tokens_per_block", LAYOUTS[self.layout.value].default_tpb)
        require(self.dtype in DTYPE_BYTES, f"{self.name}.dtype", self.dtype, f"use one of {', '.join(DTYPE_BYTES)}")
        if self.kv_dtype is not None:
            require(self.kv_dtype in kv_dtype.KV_DTYPES, f"{self.name}.kv_dtype", self.kv_dtype,
                    f"use one of {', '.join(kv_dtype.KV_DTYPES)} (fp8: e4m3 with fp32 scales), or leave it unset")
            require(self.dtype in kv_dtype.BASES, f"{self.name}.kv_dtype", self.kv_dtype,
                    f"converts bf16 or fp16 values; {self.name}.dtype={self.dtype} is neither")
        field, tokens = f"{self.name}.prefix_cache_tokens", self.prefix_cache_tokens
        require(isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0, field, tokens,
                "must be a token count >= 0 (0: no prefix cache)")
        if tokens:
            require(self.name == "gen", field, tokens, "the prefill side keeps no prefix cache here; set "
                    "gen.prefix_cache_tokens, or 0")
            require(tokens >= BLOCK_TOKENS, field, tokens, f"holds less than one {BLOCK_TOKENS}-token block of the "
                    f"trace's hash_ids; use 0 (off) or >= {BLOCK_TOKENS}")
        if self.layer_split is not None:
            object.__setattr__(self, "layer_split", tuple(self.layer_split))
            require(len(self.layer_split) == self.pp, f"{self.name}.layer_split", list(self.layer_split),
                    f"needs one layer count per pp stage ({self.pp})")
            require(all(isinstance(n, int) and n > 0 for n in self.layer_split), f"{self.name}.layer_split",
                    list(self.layer_split), "every stage needs at least one layer")

    @property
    def fmt(self) -> str:
        """The format of its converted pools (``PoolSpec.fmt``): "" where the rows hold ``dtype`` itself."""
        return "" if self.kv_dtype in (None, self.dtype) else self.kv_dtype

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp

    def coord(self, rank: int) -> RankCoord:
        require(0 <= rank < self.size, f"{self.name}.rank", rank, f"must be in [0, {self.size})")
        return RankCoord(rank // (self.pp * self.tp), rank // self.tp % self.pp, rank % self.tp)

    def rank(self, dp: int, pp: int, tp: int) -> int:
        return dp * self.pp * self.tp + pp * self.tp + tp

    def block_tokens(self, model: ModelSpec) -> int:
        """Tokens per block: as set, else what the layout fixes for this model's pools, else its default."""
        if self.tokens_per_block is not None:
            return self.tokens_per_block
        return LAYOUTS[self.layout.value].block_tokens({p.kind for p in model.pools(self.dtype)})[0]

    def resolved(self, model: ModelSpec) -> SideSpec:
        """This side with its block size made explicit for ``model`` (what a run's Setup holds)."""
        return self if self.tokens_per_block is not None else replace(self, tokens_per_block=self.block_tokens(model))

    def validate_layout(self, model: ModelSpec) -> None:
        """What the layout cannot hold of ``model``, or a block size its engine does not allow, in one line."""
        d = LAYOUTS[self.layout.value]
        field, value = f"{self.name}.layout", self.layout.value
        holders = [n for n, x in LAYOUTS.items() if all(x.holds(p.kind) for p in model.pools(self.dtype))]
        for p in model.pools(self.dtype):
            if d.holds(p.kind):
                continue
            what = ("MLA latent (one 576-value row per token, no per-head K and V)" if p.kind == "mla"
                    else "DeepSeek-V3.2 indexer keys" if p.kind == "indexer" else f"{p.kind} cache")
            raise ConfigError(field, value, f"{d.engine} stores per-head K and V ({d.shape}) and has no place for "
                              f"{model.name}'s {what}; for this model use one of {', '.join(holders)}")
        kinds = {p.kind for p in model.pools(self.dtype)}
        fixed, by = d.block_tokens(kinds)
        n = self.block_tokens(model)
        if by is not None:
            require(n == fixed, f"{self.name}.tokens_per_block", n,
                    f"{d.engine} ({value}) stores {model.name}'s {by} keys in blocks of {fixed} tokens; "
                    f"use {fixed}, or leave it unset")
        require(d.block_rule.allows(n), f"{self.name}.tokens_per_block", n,
                f"{d.engine} ({value}) takes block sizes that are {d.block_rule.text}")

    def validate_for(self, model: ModelSpec) -> None:
        """Check what depends on the model; raises ConfigError naming the field before anything is allocated."""
        self.validate_layout(model)
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
