"""Cache layouts as data: kvlab's two abstract ones and the engines' own, each a memory order of five dims.

Every pool (kvlab.model.spec) holds, per (block, layer), components (K and V; the MLA row; the indexer's values
and scales), each ``heads`` planes of ``tokens_per_block`` token rows. A layout says in which order those
dims lie in memory, outermost first, the row's bytes always innermost:

    B block, L layer, C component, H head, N token in the block

``block_major`` is ``BLCHN``, ``layer_major`` ``LBCHN``; an engine's layout is the permutation its tensor
shapes make, per cache kind (an engine stores its indexer keys differently from its K and V). From the
order, ``kvlab.model.state.RankPool.comp_strides`` derives every component's byte strides, and
``kvlab.model.layout.runs`` the memory address of every run of the wire order: one function for every layout.
Where a head's token rows are not next to each other in memory (``N`` outside ``H``, or K and V
interleaved per token), runs are single rows, and the plan sends such a pool in tiles of one token so
that both sides cut it alike (``kvlab.model.state.wire_tile``).

The engines' shapes (vLLM 0.33, FlashInfer 0.7, SGLang 0.5, TensorRT-LLM), per layer unless said:

- ``LBHNC``, ``LBNHC``, ``LHBNC``, ``BLHNC``, ``BLNHC``, ``BHLNC``: vLLM's ``KVCacheLayout``
  (``vllm/v1/kv_cache_layout.py``), every member of it: one logical ``[L, B, H, N, C]`` tensor per KV cache
  group, the member naming the memory order of those dims; C is a (head, token) cell's content, K's row then
  V's row (``AttentionSpec.state_content_size_bytes`` = ``(head_size + head_size_v) * dtype bytes``), the MLA
  row with H = 1. vLLM's legacy names are aliases, as ``vllm/config/cache.py`` maps them: ``NHD`` is
  ``LBNHC``, ``HND`` ``LBHNC``. The indexer keys keep their block interior (values, then scales) inside the
  member's L/B/H nesting;
- ``vllm_lbnhc`` (vLLM's K/V planes before ``KVCacheLayout``, "NHD"): K/V ``[2, blocks, block_size, H, D]``;
  MLA ``[blocks, block_size, 576]``; DeepSeek-V3.2's indexer keys ``[blocks, block_size * 132]``, a block's
  128-byte values of every token first, then their 4-byte scales; blocks of 64 tokens where the indexer exists;
- ``vllm_lbhnc`` ("HND", what vLLM's NIXL connector asks for): K/V ``[2, blocks, H, block_size, D]``; MLA
  and indexer as above;
- ``vllm_flash`` (vLLM's FlashAttention backend): ``[blocks, H, block_size, 2 * D]``, a token's K row and
  V row side by side; block sizes that are multiples of 16; no MLA;
- ``flashinfer_nhd`` / ``flashinfer_hnd``: ``[pages, 2, page_size, H, D]`` / ``[pages, 2, H, page_size, D]``;
  K and V only;
- ``sglang``: ``k_buffer[l]``, ``v_buffer[l]`` ``[slots, H, D]`` (slot = page * page_size + offset); MLA
  ``[slots, 1, 576]``; DSA index keys ``(pages, page_size * 132)``, keys then scales; pages of 64 tokens
  where the indexer exists;
- ``trtllm``: one pool ``{blocks, layers, kvFactor, H * tokens_per_block * D}`` (kvFactor 2 for K/V, 1 for
  MLA), the indexer keys a second pool of the same block size, 1 head, values then scales per block and
  layer; tokens_per_block a power of two, 64 where the indexer exists.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

DIMS = frozenset("BLCHN")


class Layout(str, Enum):
    """kvlab's abstract layouts: any block size, any cache kind."""

    block_major = "block_major"  # [block][layer][comp][head][token][row]: the C++ engines' pools
    layer_major = "layer_major"  # [layer][block][comp][head][token][row]: one tensor per layer


class EngineLayout(str, Enum):
    """The engines' own layouts (what each fixes: ``LAYOUTS``)."""

    vllm_lbnhc = "vllm_lbnhc"
    vllm_lbhnc = "vllm_lbhnc"
    vllm_flash = "vllm_flash"
    flashinfer_nhd = "flashinfer_nhd"
    flashinfer_hnd = "flashinfer_hnd"
    sglang = "sglang"
    trtllm = "trtllm"
    # vLLM's KVCacheLayout members, spelled as vLLM spells them (VLLM_KV_CACHE_LAYOUT)
    LBHNC = "LBHNC"
    LBNHC = "LBNHC"
    LHBNC = "LHBNC"
    BLHNC = "BLHNC"
    BLNHC = "BLNHC"
    BHLNC = "BHLNC"


# vLLM's stride permutations of [L, B, H, N, C] (vllm/v1/kv_cache_layout.py): its dims in memory order, outermost
# first. kvlab's C is a cell's components side by side, K's row then V's: vLLM's content dim.
VLLM_ORDERS = {"LBHNC": "LBHNC", "LBNHC": "LBNHC", "LHBNC": "LHBNC",
               "BLHNC": "BLHNC", "BLNHC": "BLNHC", "BHLNC": "BHLNC"}
# vLLM's legacy names for two of them (vllm/config/cache.py)
ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}


@dataclass(frozen=True)
class BlockRule:
    """Block sizes an engine allows: ``test(n)``, and how to say so."""

    text: str
    kind: str = "any"  # any | multiple | power_of_two
    of: int = 1

    def allows(self, n: int) -> bool:
        if self.kind == "multiple":
            return n % self.of == 0
        if self.kind == "power_of_two":
            return n & (n - 1) == 0
        return True


ANY_BLOCK = BlockRule("any block size")


@dataclass(frozen=True)
class LayoutDef:
    """One layout: its memory order per cache kind (``"*"``: every other kind), the kinds it holds (None:
    any), its block sizes (``default_tpb`` when none is given; ``fixed_tpb[kind]`` when the model has a
    pool of that kind) and what it stands for."""

    name: str
    engine: str
    orders: dict[str, str]
    shape: str  # the engine's tensor shape, as its code writes it: for messages and the plan
    kinds: tuple[str, ...] | None = None
    default_tpb: int = 32
    fixed_tpb: dict[str, int] = field(default_factory=dict)
    block_rule: BlockRule = ANY_BLOCK
    kind_shapes: dict[str, str] = field(default_factory=dict)  # the shapes of kinds other than K and V

    def __post_init__(self):
        for kind, order in self.orders.items():
            if len(order) != 5 or set(order) != DIMS:
                raise ValueError(f"layout {self.name}: order {order!r} of kind {kind} must list B, L, C, H, N once")

    def order(self, kind: str) -> str:
        return self.orders.get(kind, self.orders["*"])

    def shape_of(self, kind: str) -> str:
        return self.kind_shapes.get(kind, self.shape)

    def holds(self, kind: str) -> bool:
        return self.kinds is None or kind in self.kinds

    def block_tokens(self, kinds: set[str]) -> tuple[int, str | None]:
        """(tokens per block, the kind that fixes it or None) for a model whose pools are of ``kinds``."""
        for kind, n in self.fixed_tpb.items():
            if kind in kinds:
                return n, kind
        return self.default_tpb, None


def _values_then_scales(order: str) -> str:
    """``order`` with the components outside the token rows: a block's values of every token, then its scales."""
    return order.replace("C", "").replace("N", "CN")


_VLLM_MLA = "LBCNH"  # [blocks, block_size, 576]: one component, one head
_KV_DSA = {"indexer": 64}  # DeepSeek-V3.2's indexer keys: blocks of 64 tokens in vLLM, SGLang and TensorRT-LLM
_VLLM_SHAPES = {"mla": "per layer [blocks, block_size, 576]", "indexer": "per layer [blocks, block_size*132]"}

LAYOUTS: dict[str, LayoutDef] = {d.name: d for d in (
    LayoutDef("block_major", "kvlab", {"*": "BLCHN"}, "[blocks, layers, components, H, block, row]"),
    LayoutDef("layer_major", "kvlab", {"*": "LBCHN"}, "per layer [blocks, components, H, block, row]"),
    LayoutDef("vllm_lbnhc", "vLLM", {"kv": "LCBNH", "mla": _VLLM_MLA, "indexer": "LBCNH", "*": "LCBNH"},
              "per layer [2, blocks, block_size, H, D]", ("kv", "mla", "indexer"), 16, _KV_DSA,
              kind_shapes=_VLLM_SHAPES),
    LayoutDef("vllm_lbhnc", "vLLM", {"kv": "LCBHN", "mla": _VLLM_MLA, "indexer": "LBCNH", "*": "LCBHN"},
              "per layer [2, blocks, H, block_size, D]", ("kv", "mla", "indexer"), 16, _KV_DSA,
              kind_shapes=_VLLM_SHAPES),
    LayoutDef("vllm_flash", "vLLM's FlashAttention backend", {"*": "LBHNC"},
              "per layer [blocks, H, block_size, 2*D]", ("kv",), 16,
              block_rule=BlockRule("a multiple of 16", "multiple", 16)),
    LayoutDef("flashinfer_nhd", "FlashInfer", {"*": "LBCNH"}, "per layer [pages, 2, page_size, H, D]", ("kv",), 16),
    LayoutDef("flashinfer_hnd", "FlashInfer", {"*": "LBCHN"}, "per layer [pages, 2, H, page_size, D]", ("kv",), 16),
    LayoutDef("sglang", "SGLang", {"kv": "LCBNH", "mla": _VLLM_MLA, "indexer": "LBCNH", "*": "LCBNH"},
              "per layer k_buffer, v_buffer [slots, H, D]", ("kv", "mla", "indexer"), 1, _KV_DSA,
              kind_shapes={"mla": "per layer [slots, 1, 576]", "indexer": "per layer (pages, page_size*132)"}),
    LayoutDef("trtllm", "TensorRT-LLM", {"*": "BLCHN"}, "{blocks, layers, kvFactor, H*tokens_per_block*D}",
              ("kv", "mla", "indexer"), 32, _KV_DSA, BlockRule("a power of two", "power_of_two"),
              {"mla": "{blocks, layers, 1, tokens_per_block*576}",
               "indexer": "{blocks, layers, 1, tokens_per_block*132}"}),
    *(LayoutDef(name, "vLLM", {"*": order, "indexer": _values_then_scales(order)},
                f"one [L, B, H, N, C] tensor in memory order {name} (C: K then V of a cell)",
                ("kv", "mla", "indexer"), 16, _KV_DSA,
                kind_shapes={"mla": f"[L, B, 1, N, 576] in memory order {name}",
                             "indexer": f"[L, B, 1, N*132] in memory order {name}: values, then scales"})
      for name, order in VLLM_ORDERS.items()),
)}

NAMES = tuple(LAYOUTS)


def layout_of(name) -> Layout | EngineLayout:
    """The enum member of a layout name (either enum, or an engine's alias: ``ALIASES``); ValueError for an
    unknown name."""
    value = name.value if isinstance(name, Enum) else name
    value = ALIASES.get(value, value)
    for enum in (Layout, EngineLayout):
        try:
            return enum(value)
        except ValueError:
            pass
    raise ValueError(value)
