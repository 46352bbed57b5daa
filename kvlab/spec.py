"""Model spec: what each layer of a model caches, grouped into pools.

A pool holds the layers that share a cache kind and a window. Every pool stores, per
(block, layer), a list of *components* (K and V for GQA; the latent for MLA; the fp8
values and the fp32 scales for the DeepSeek-V3.2 indexer), each component holding
``heads`` planes of ``tokens_per_block`` rows of ``row_bytes``. That one shape covers
every cache kind kvlab knows, so plan, schedule and the kernels never special-case one.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from enum import Enum

from kvlab.errors import positive, require


class Attention(str, Enum):
    gqa = "gqa"
    mla = "mla"


class Kind(str, Enum):
    kv = "kv"
    mla = "mla"
    indexer = "indexer"


DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}

# DeepSeek-V3.2 indexer K: index_head_dim fp8 values, then one fp32 scale per 128 values,
# stored per block as all values then all scales (TensorRT-LLM, vLLM, SGLang agree).
INDEXER_HEAD_DIM = 128
INDEXER_QUANT_BLOCK = 128


@dataclass(frozen=True)
class PoolSpec:
    """Layers that share a cache kind and window, before any parallel split."""

    name: str
    kind: Kind
    layers: tuple[int, ...]  # global layer ids, ascending
    window: int  # 0: full attention
    heads: int  # kv heads (GQA) or 1 (MLA latent, indexer)
    comp_elems: tuple[int, ...]  # elements per token per head of each component
    comp_dtypes: tuple[str, ...]

    @property
    def replicated(self) -> bool:
        """MLA latents and indexer keys are identical on every TP rank: never split by heads."""
        return self.kind != Kind.kv

    def comp_row_bytes(self) -> tuple[int, ...]:
        return tuple(n * DTYPE_BYTES[d] for n, d in zip(self.comp_elems, self.comp_dtypes))

    def token_bytes(self, heads: int | None = None) -> int:
        """Bytes of one token of one layer for ``heads`` heads (all heads by default)."""
        return (self.heads if heads is None else heads) * sum(self.comp_row_bytes())


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    attention: Attention = Attention.gqa
    kv_heads: int = 8
    head_dim: int = 128
    mla_dim: int = 576  # kv_lora_rank 512 + rope 64
    indexer: bool = False
    window: int = 0  # sliding window in tokens, 0 for none
    local_per_global: int = 0  # sliding layers per full layer; 0 with window>0: every layer slides

    def __post_init__(self):
        require(bool(self.name), "model.name", self.name, "must be a non-empty name")
        positive("model.num_layers", self.num_layers)
        require(self.attention in (Attention.gqa, Attention.mla), "model.attention", self.attention,
                "use gqa or mla")
        object.__setattr__(self, "attention", Attention(self.attention))
        if self.attention == Attention.gqa:
            positive("model.kv_heads", self.kv_heads)
            positive("model.head_dim", self.head_dim)
            require(not self.indexer, "model.indexer", self.indexer, "the indexer K cache needs attention=mla")
        else:
            positive("model.mla_dim", self.mla_dim)
        require(isinstance(self.window, int) and self.window >= 0, "model.window", self.window,
                "must be 0 (full attention) or a positive number of tokens")
        require(isinstance(self.local_per_global, int) and self.local_per_global >= 0,
                "model.local_per_global", self.local_per_global, "must be 0 or a positive count")
        require(self.local_per_global == 0 or self.window > 0, "model.local_per_global",
                self.local_per_global, "sliding layers need model.window > 0")

    def layer_window(self, layer: int) -> int:
        if self.window == 0:
            return 0
        if self.local_per_global == 0:
            return self.window
        return self.window if layer % (self.local_per_global + 1) < self.local_per_global else 0

    @functools.cache  # noqa: B019 -- specs are few, frozen and live as long as the process
    def pools(self, dtype: str = "bf16") -> tuple[PoolSpec, ...]:
        """The pools of this model when its cache is stored in ``dtype`` (the indexer is always fp8+fp32)."""
        require(dtype in DTYPE_BYTES, "dtype", dtype, f"use one of {', '.join(DTYPE_BYTES)}")
        by_window: dict[int, list[int]] = {}
        for layer in range(self.num_layers):
            by_window.setdefault(self.layer_window(layer), []).append(layer)
        pools = []
        for window, layers in sorted(by_window.items()):
            suffix = f"_w{window}" if window else ""
            if self.attention == Attention.gqa:
                pools.append(PoolSpec(f"kv{suffix}", Kind.kv, tuple(layers), window, self.kv_heads,
                                      (self.head_dim, self.head_dim), (dtype, dtype)))
            else:
                pools.append(PoolSpec(f"mla{suffix}", Kind.mla, tuple(layers), window, 1,
                                      (self.mla_dim,), (dtype,)))
                if self.indexer:
                    scales = math.ceil(INDEXER_HEAD_DIM / INDEXER_QUANT_BLOCK)
                    pools.append(PoolSpec(f"indexer{suffix}", Kind.indexer, tuple(layers), window, 1,
                                          (INDEXER_HEAD_DIM, scales), ("fp8", "fp32")))
        return tuple(pools)

    @property
    def tp_heads(self) -> int:
        """Heads that tensor parallelism splits or duplicates (1 for MLA: the latent is replicated)."""
        return self.kv_heads if self.attention == Attention.gqa else 1

    def bytes_per_token(self, dtype: str = "bf16") -> int:
        """Cache bytes per token over all layers (windowed layers included, as if uncapped)."""
        return sum(p.token_bytes() * len(p.layers) for p in self.pools(dtype))

    def request_bytes(self, isl: int, dtype: str = "bf16") -> int:
        """Bytes of one request's cache over all layers and heads, windowed layers capped at their window."""
        return sum(p.token_bytes() * len(p.layers) * (min(isl, p.window) if p.window else isl)
                   for p in self.pools(dtype))
