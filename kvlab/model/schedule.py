"""The schedule: a request's segments cut into chunks and ordered by the strategy.

Pure, like the plan: both sides derive the same chunk list from the same states. Each
chunk is exactly one message on the wire, whatever either side does with it, so a side's
choice to send or receive a chunk in place never changes what the other side posts: the
zero-copy hang of engines that switch to one message per block cannot happen here.

A strategy is data: a ``Strategy`` names its traits, and its YAML file under
``conf/transfer/`` holds them (``transfer.strategy``, instantiated through Hydra's
``_target_``). The schedule, the executor and the cost model read the traits, never the
name, so a new combination (layer-wise *and* in place, say) is a new YAML file, and a
strategy with its own cutting or ordering is a subclass in the user's own module named by
``_target_``. The traits:

- ``cut``: ``segment`` (one chunk per segment, as large as the segment), ``slot`` (at
  most the run's chunk cap, spanning as many layers as fit) or ``layer`` (at most the cap,
  never spanning layers). The cap is the run's, for its transport
  (``kvlab.config.schema.Setup.chunk_cap``): a staging slot, or none for a pulling transport
  unless ``transfer.slot_mib`` is set, so that ``slot`` gives one chunk per segment and
  ``layer`` one per ready layer of it;
- ``order``: ``as_is`` (segment after segment), ``round_robin`` (over the segments, so
  that every pair of ranks is busy early) or ``ready_layer`` (round-robin within a layer,
  layers in the order the prefill finishes them);
- ``ready``: a chunk may leave once its ``request`` is prefilled, or once its ``layer``
  (``Chunk.ready_layer``, the global layer that must be done first) is;
- ``in_place``: cut the last partial tile off so that whole-block chunks can go in place
  (not when chunks are not cut by size: such a chunk is never staged);
  ``ctx_in_place`` / ``gen_in_place`` say, from both cache states alone, whether a chunk's
  shape is in wire order on that side when its blocks are consecutive;
- ``staging``: ``slots`` (fixed slots allocated once) or ``per_chunk`` (a buffer per chunk,
  sized to it: the naive baseline).

The presets: ``naive`` (segment, as_is, per_chunk), ``chunked`` (slot, round_robin),
``layerwise`` (layer, ready_layer, ready=layer), ``zerocopy`` (slot, round_robin, in place).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from enum import Enum
from functools import cache

from kvlab.core.errors import ConfigError
from kvlab.model.layout import Rect, identity_blocks, is_in_place, runs
from kvlab.model.parallel import SideSpec
from kvlab.model.plan import Segment
from kvlab.model.spec import ModelSpec
from kvlab.model.state import CacheState, wire_pool


class Cut(str, Enum):
    segment = "segment"
    slot = "slot"
    layer = "layer"


class Order(str, Enum):
    as_is = "as_is"
    round_robin = "round_robin"
    ready_layer = "ready_layer"


class Ready(str, Enum):
    request = "request"
    layer = "layer"


class Staging(str, Enum):
    slots = "slots"
    per_chunk = "per_chunk"


@dataclass(frozen=True)
class Chunk:
    request: int
    seq: int  # position in the request's schedule
    src: int  # ctx side-local rank
    dst: int  # gen side-local rank
    rect: Rect
    nbytes: int
    ready_layer: int  # global layer the prefill must have finished
    ctx_in_place: bool = False
    gen_in_place: bool = False


def cut_rect(seg: Segment, rows: tuple[int, ...], slot_bytes: int | None, per_layer: bool,
             split_tail: bool) -> list[Rect]:
    """``seg``'s rectangle cut into chunks of at most ``slot_bytes`` (None: no cut by size), of one
    layer each with ``per_layer``, the partial last tile apart with ``split_tail``."""
    r = seg.rect
    T = r.tile
    bpl = r.n_heads * sum(rows)  # bytes per token per layer
    if per_layer:
        groups = [(layer, layer + 1) for layer in range(r.l0, r.l1)]
    elif slot_bytes is None:
        groups = [(r.l0, r.l1)]
    else:
        m = max(1, min(r.n_layers, slot_bytes // (T * bpl)))
        groups = [(a, min(a + m, r.l1)) for a in range(r.l0, r.l1, m)]
    out = []
    for a, b in groups:
        per_tok = (b - a) * bpl
        if slot_bytes is None:
            ends = [r.t1]
        else:
            if per_tok > slot_bytes:
                raise ConfigError("transfer.slot_mib", slot_bytes / 2**20,
                                  f"a slot must hold one token row of pool {r.pool} ({per_tok} B)")
            step = (slot_bytes // (T * per_tok)) * T or slot_bytes // per_tok
            ends = list(range(r.t0 + step, r.t1, step)) + [r.t1]
        if split_tail and (r.t1 - r.t0) > T and r.t1 % T:
            tail = r.t1 // T * T  # first token of the partial last tile
            # keep cuts inside the tail too: when a slot holds less than a tile they bound its size
            ends = sorted(set(ends) | {tail})
        start = r.t0
        for end in ends:
            out.append(replace(r, l0=a, l1=b, t0=start, t1=end))
            start = end
    return out


def in_place_shape(state: CacheState, rect: Rect) -> bool:
    """Whether ``rect`` lies in wire order in this side's memory when its blocks are consecutive."""
    pool = state.pool(rect.pool)
    ids, base = identity_blocks(rect, pool.tokens_per_block, pool)
    return is_in_place(runs(pool, len(ids) + 1, rect, ids, base))


@dataclass(frozen=True)
class Strategy:
    """How a request's segments become chunks and when each may go (the traits above).

    Both sides build the same strategy from the same config and derive the same chunks from it.
    Subclasses may override ``rects`` and ``arrange``; they must stay pure functions of their input.
    """

    name: str  # a preset's name (conf/transfer/), or one of the user's own
    cut: Cut = Cut.slot  # segment (one chunk each), slot (up to the chunk cap), layer (up to it, within a layer)
    order: Order = Order.round_robin  # as_is, round_robin (over the segments), ready_layer (as layers finish)
    ready: Ready = Ready.request  # a chunk may leave once its request is prefilled, or once its layer is
    in_place: bool = False  # whole-block chunks, sent or received in place where in wire order (zero-copy)
    staging: Staging = Staging.slots  # slots (fixed, allocated once) or per_chunk (a buffer each: naive)

    def __post_init__(self):
        for f, kind in (("cut", Cut), ("order", Order), ("ready", Ready), ("staging", Staging)):
            v = getattr(self, f)
            try:
                object.__setattr__(self, f, kind(v.value if isinstance(v, Enum) else v))
            except ValueError:
                raise ConfigError(f"transfer.strategy.{f}", v, f"use {', '.join(k.value for k in kind)}") from None
        if not isinstance(self.in_place, bool):
            raise ConfigError("transfer.strategy.in_place", self.in_place, "use true or false")
        if self.cut == Cut.segment and self.staging != Staging.per_chunk:
            raise ConfigError("transfer.strategy.staging", self.staging.value,
                              "a chunk of a whole segment does not fit a fixed slot; use per_chunk, or cut: slot")

    def traits(self) -> dict:
        return {f.name: (v.value if isinstance(v := getattr(self, f.name), Enum) else v) for f in fields(self)}

    def rects(self, seg: Segment, rows: tuple[int, ...], slot_bytes: int | None) -> list[Rect]:
        """``seg`` cut into chunk rectangles of at most ``slot_bytes`` (None: the run's transport caps no
        chunk, kvlab.config.schema.Setup.chunk_cap)."""
        if self.cut == Cut.segment:
            return [seg.rect]
        return cut_rect(seg, rows, slot_bytes, self.cut == Cut.layer, self.in_place and slot_bytes is not None)

    def arrange(self, per_seg: list[list[Chunk]]) -> list[Chunk]:
        """One request's chunks in sending order, from its chunks per segment."""
        if self.order == Order.as_is:
            return [c for chunks in per_seg for c in chunks]
        order = [chunks[i] for i in range(max(map(len, per_seg), default=0)) for chunks in per_seg if i < len(chunks)]
        if self.order == Order.ready_layer:
            order.sort(key=lambda c: c.ready_layer)  # stable: round-robin within a layer
        return order


def schedule(model: ModelSpec, ctx: SideSpec, gen: SideSpec, segments: list[Segment], strategy: Strategy,
             slot_bytes: int | None) -> list[Chunk]:
    """A request's chunks in sending order; ``slot_bytes``: the most one chunk holds, the run's
    ``Setup.chunk_cap`` (None: not cut by size, for a pulling transport)."""
    per_seg: list[list[Chunk]] = []
    for seg in segments:
        pool = wire_pool(model, ctx, gen, seg.rect.pool)[0]  # its rows as the wire carries them (kvlab.model.kv_dtype)
        rows = pool.comp_row_bytes()
        chunks = []
        for rect in strategy.rects(seg, rows, slot_bytes):
            c = Chunk(seg.request, 0, seg.src, seg.dst, rect, rect.nbytes(rows), pool.layers[rect.l1 - 1])
            if strategy.in_place:
                c = replace(c, ctx_in_place=in_place_shape(CacheState(model, ctx, seg.src), rect),
                            gen_in_place=in_place_shape(CacheState(model, gen, seg.dst), rect))
            chunks.append(c)
        per_seg.append(chunks)
    return [replace(c, seq=i) for i, c in enumerate(strategy.arrange(per_seg))]


def make_strategy(node) -> Strategy:
    """The strategy a config names: a preset's name, or a node with ``_target_`` (a Strategy or a factory
    in any importable module) and its traits."""
    if isinstance(node, Strategy):
        return node
    if isinstance(node, str):
        names = preset_names()
        if node not in names:
            raise ConfigError("transfer.strategy", node, f"use one of {', '.join(names)}, or a node with _target_ "
                              "and traits (see conf/transfer/)")
        return preset(node)
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    target = node.get("_target_") if hasattr(node, "get") else None
    if not target:
        raise ConfigError("transfer.strategy", node, "needs _target_ (e.g. kvlab.model.schedule.Strategy) and traits, "
                          "or a preset name")
    try:
        out = instantiate(node, _convert_="all")
    except InstantiationException as e:
        if isinstance(e.__cause__, ConfigError):
            raise e.__cause__ from None
        raise ConfigError("transfer.strategy._target_", target, f"cannot be built: {str(e).splitlines()[0]}") from None
    if not isinstance(out, Strategy):
        raise ConfigError("transfer.strategy._target_", target,
                          f"built a {type(out).__name__}; it must build a kvlab.model.schedule.Strategy")
    return out


@cache
def preset_names() -> tuple[str, ...]:
    from kvlab.core.paths import CONF_DIR

    return tuple(sorted(p.stem for p in (CONF_DIR / "transfer").glob("*.yaml")))


@cache
def preset(name: str) -> Strategy:
    """A built-in strategy, read from its file under conf/transfer/ (the one place its traits live)."""
    from omegaconf import OmegaConf

    from kvlab.core.paths import CONF_DIR

    return make_strategy(OmegaConf.load(CONF_DIR / "transfer" / f"{name}.yaml").strategy)
