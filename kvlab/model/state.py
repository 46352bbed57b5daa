"""Cache state: everything the other side must know about one rank's cache.

Both sides build their states from the config, exchange them once at handshake and
derive plan, schedule and zero-copy decisions from the pair with pure functions, so the
two sides always post matching sends and receives. ``check_compatible`` names every
difference the transfer cannot bridge on both sides before any byte moves.
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, replace

import torch

from kvlab.core.errors import ConfigError
from kvlab.model import kv_dtype
from kvlab.model.engine_layouts import LAYOUTS, EngineLayout, Layout
from kvlab.model.parallel import RankCoord, SideSpec
from kvlab.model.spec import ModelSpec, PoolSpec
from kvlab.model.tokens import Tokens


@dataclass(frozen=True)
class CompStrides:
    """Where component ``c`` of a pool lies: byte ``x`` of the row of (block b, held layer l, held head h,
    token n of the block) is at ``offset + b*block + l*layer + h*head + n*token + x``."""

    offset: int
    block: int
    layer: int
    head: int
    token: int
    row: int

    @property
    def token_runs(self) -> bool:
        """Whether a head's consecutive token rows lie back to back (a run may hold several tokens)."""
        return self.token == self.row


@dataclass(frozen=True)
class RankPool:
    """The part of a pool one rank holds, and where its bytes lie: the layout's order of the dims block,
    layer, component, head and token (kvlab.model.engine_layouts), made strides by ``comp_strides``."""

    spec: PoolSpec
    layers: range  # pool-local layer indices held by the rank (contiguous)
    heads: range  # global head ids held by the rank
    tokens_per_block: int
    layout: Layout | EngineLayout
    tokens: Tokens = Tokens()  # which of a request's tokens the rank holds (context parallelism)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def rows(self) -> tuple[int, ...]:
        return self.spec.comp_row_bytes()

    @property
    def order(self) -> str:
        """The memory order of this pool's dims, outermost first (the row's bytes innermost)."""
        return LAYOUTS[self.layout.value].order(str(getattr(self.spec.kind, "value", self.spec.kind)))

    @property
    def block_layer_bytes(self) -> int:
        """Bytes of one block of one layer: every component, every held head, every token row."""
        return self.tokens_per_block * len(self.heads) * sum(self.rows)

    @functools.lru_cache(maxsize=256)  # noqa: B019 -- pools are few, frozen and live as long as the process
    def comp_strides(self, num_blocks: int) -> tuple[CompStrides, ...]:
        """Every component's strides in a pool tensor of ``num_blocks`` blocks, from the layout's order: walking
        the dims from the innermost out, each dim's stride is what lies inside it; the components, of
        different row sizes, sit one after the other where ``C`` stands."""
        rows = self.rows
        size = {"B": num_blocks, "L": len(self.layers), "H": len(self.heads), "N": self.tokens_per_block}
        ext, off = list(rows), [0] * len(rows)
        strides: list[dict[str, int]] = [{} for _ in rows]
        for d in reversed(self.order):
            if d == "C":
                acc = 0
                for c in range(len(rows)):
                    off[c] += acc
                    acc += ext[c]
                ext = [acc] * len(rows)
                continue
            for c in range(len(rows)):
                strides[c][d] = ext[c]
                ext[c] *= size[d]
        return tuple(CompStrides(off[c], s["B"], s["L"], s["H"], s["N"], rows[c]) for c, s in enumerate(strides))

    @property
    def token_runs(self) -> bool:
        """Whether every component's token rows of one head lie back to back (kvlab.model.layout.runs may then hold
        several tokens per run); a property of the layout and the held heads, not of the block count."""
        return all(s.token_runs for s in self.comp_strides(1))

    def strides(self, num_blocks: int) -> tuple[int, int]:
        """(block stride, layer stride) of the first component, in bytes (every component's: ``comp_strides``)."""
        s = self.comp_strides(num_blocks)[0]
        return s.block, s.layer

    def comp_offsets(self) -> tuple[int, ...]:
        """Byte offset of each component inside one (block, layer) of a block-major or layer-major pool:
        ``[comp][head][token][row]`` (any layout: ``comp_strides``)."""
        out, acc = [], 0
        for row in self.rows:
            out.append(acc)
            acc += len(self.heads) * self.tokens_per_block * row
        return tuple(out)

    def pool_bytes(self, num_blocks: int) -> int:
        return num_blocks * len(self.layers) * self.block_layer_bytes

    def block_views(self, storage: torch.Tensor, num_blocks: int, block: int) -> list[torch.Tensor]:
        """All bytes of one block (every layer), one strided view [layers, heads, tokens, row] per component."""
        out = []
        for s in self.comp_strides(num_blocks):
            out.append(storage.as_strided((len(self.layers), len(self.heads), self.tokens_per_block, s.row),
                                          (s.layer, s.head, s.token, 1), s.offset + block * s.block))
        return out

    def held_start(self, isl: int) -> int:
        """First position whose block this rank holds for a prompt of ``isl`` tokens (windows keep only their
        tail), in the positions its rectangles count (a DCP rank's local ones)."""
        start = window_start(self.spec, isl, 1)
        if self.tokens.local is not None:
            start = self.tokens.local_ceil(start)
        return start // self.tokens_per_block * self.tokens_per_block

    def held(self, isl: int) -> list[tuple[int, int]]:
        """The position intervals this rank holds of a request, in the positions its rectangles count (global
        tokens, or a DCP rank's local ones), from the first block a window keeps."""
        start, stop = self.held_start(isl), self.spec.held_tokens(isl)  # a recurrent state: token 0 only
        if self.tokens.local is not None:
            return [(start, self.tokens.count(isl))] if self.tokens.count(isl) > start else []
        return [(max(a, start), min(b, stop)) for a, b in self.tokens.chunks(isl) if b > start and a < stop]

    def held_blocks(self, isl: int) -> int:
        """Blocks this rank allocates for a request of ``isl`` tokens: the union of its spans, counted without the
        table (a budget check asks this of prompts of billions of tokens)."""
        total, end = 0, 0
        for a, b in self._block_spans(isl):
            total += max(0, b - max(a, end))
            end = max(end, b)
        return total

    def _block_spans(self, isl: int) -> list[tuple[int, int]]:
        """The logical blocks [a, b) of each interval this rank holds, ascending."""
        tpb = self.tokens_per_block
        return [(a // tpb, (b - 1) // tpb + 1) for a, b in self.held(isl)]

    def block_table(self, isl: int) -> tuple[int, list[bool]]:
        """(first logical block, whether each logical block from there is held): the block table's shape for a
        request; a context-parallel rank holds no block between its two chunks (``HOLE`` there)."""
        spans = self._block_spans(isl)
        if not spans:
            return 0, []
        first = spans[0][0]
        used = [False] * (spans[-1][1] - first)
        for a, b in spans:
            for i in range(a, b):
                used[i - first] = True
        return first, used


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
        for p in side_pools(self.model, self.side):
            local = [i for i, g in enumerate(p.layers) if g in stage]
            if local:
                out.append(RankPool(p, range(local[0], local[-1] + 1), self.side.head_range(p.heads, c.tp),
                                    pool_block_tokens(self.model, self.side, p), self.side.layout,
                                    self.side.tokens(self.rank, self.model)))
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


def pool_block_tokens(model: ModelSpec, side: SideSpec, pool: PoolSpec) -> int:
    """Token rows per block of ``pool`` on ``side``: the side's block size; one for a recurrent state, whose one
    row per request is a block of its own (a block of the side's size would hold one state and waste the rest)."""
    return 1 if pool.per_request else side.block_tokens(model)


def in_format(pool: PoolSpec, fmt: str) -> PoolSpec:
    """``pool`` holding its rows in format ``fmt`` (kvlab.model.kv_dtype), where its kind converts; else as it is."""
    base = pool.comp_dtypes[0]
    if not kv_dtype.converts(str(getattr(pool.kind, "value", pool.kind)), base):
        return pool
    return replace(pool, fmt="" if fmt in ("", base) else fmt)


def pool_format(pool: PoolSpec) -> str:
    """The format of a pool's rows: its KV dtype, or the dtype of its first component."""
    return pool.fmt or pool.comp_dtypes[0]


def side_pools(model: ModelSpec, side: SideSpec) -> tuple[PoolSpec, ...]:
    """The model's pools as ``side`` keeps them: its ``dtype``, K/V and MLA rows in its ``kv_dtype``."""
    return tuple(in_format(p, side.fmt) for p in model.pools(side.dtype))


def check_kv_dtypes(ctx: SideSpec, gen: SideSpec) -> None:
    """A KV dtype is converted from the values the prefill computed (``ctx.dtype``): a ctx side that keeps another
    one already rounded them, and converting those again is not what kvlab checks value by value."""
    if ctx.fmt and ctx.fmt != gen.fmt:
        raise ConfigError("ctx.kv_dtype", ctx.kv_dtype,
                          f"kvlab converts the prefill's own {ctx.dtype} values in flight, not values already kept "
                          f"in {ctx.kv_dtype}; leave ctx.kv_dtype unset, or set gen.kv_dtype={ctx.kv_dtype} too")


def wire_pool(model: ModelSpec, ctx: SideSpec, gen: SideSpec, name: str) -> tuple[PoolSpec, str]:
    """(pool ``name`` in the format the wire carries, where it is converted: ``pack``, ``unpack`` or ``none``)
    (kvlab.model.kv_dtype.wire_format: the smaller rows travel)."""
    c = next(p for p in side_pools(model, ctx) if p.name == name)
    g = next(p for p in side_pools(model, gen) if p.name == name)
    _, place = kv_dtype.wire_format(pool_format(c), pool_format(g), sum(c.comp_row_bytes()),
                                    sum(g.comp_row_bytes()))
    return (g if place == "pack" else c), place


def side_pool(model: ModelSpec, side: SideSpec, pool: PoolSpec) -> RankPool:
    """``pool`` as the first TP rank of ``side`` holds it, all its layers: for shape questions (token runs,
    strides per block) that hold for every rank of the side alike."""
    return RankPool(in_format(pool, side.fmt), range(len(pool.layers)), side.head_range(pool.heads, 0),
                    pool_block_tokens(model, side, pool), side.layout)


def wire_tile(ctx: SideSpec, gen: SideSpec, model: ModelSpec | None = None, pool: PoolSpec | None = None) -> int:
    """Tokens per wire tile: a tile never crosses a block on either side. For ``pool`` of ``model``, one token
    where either side does not keep a head's token rows back to back (the NHD layouts, K and V interleaved):
    both sides' runs are then single rows, cut alike, whatever the other side's layout."""
    if model is None:
        return math.gcd(ctx.tokens_per_block, gen.tokens_per_block)
    if pool is not None and pool.per_request:
        return 1
    if pool is not None and not (side_pool(model, ctx, pool).token_runs and side_pool(model, gen, pool).token_runs):
        return 1
    # a tile lies in one interleave run of a DCP rank: its tokens are consecutive on both sides
    runs = [s.dcp_interleave for s in (ctx, gen) if s.dcp > 1]
    return math.gcd(ctx.block_tokens(model), gen.block_tokens(model), *runs)


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
        for key in ("tp", "pp", "dp", "tokens_per_block", "layout", "layer_split", "kv_dtype", "prefix_cache_tokens",
                    "cp", "cp_scheme", "dcp", "dcp_interleave"):
            if a["side"].get(key) != b["side"].get(key):
                side = a["side"]["name"]
                raise ConfigError(f"{side}.{key}", f"{a['side'][key]} ({names[0]}) vs {b['side'][key]} ({names[1]})",
                                  f"every {side} rank must be started with the same {side} config")
