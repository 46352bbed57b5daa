"""Which GPU kernel moves a pair of pools' rectangles, and why: the choice ``kvlab plan`` prints and the CUDA ops
(kvlab.memory.ops.cuda) make, from the two pools' layouts alone (the launch still falls back where a storage's
address is not aligned).

- Same format, ``span`` (``kv_copy_span`` in kernels/run_copy.cu): 16-byte vectors over spans of
  gcd(tokens_per_block) tokens by every head, where every row and stride is 16-byte aligned and the runs are
  short: single rows on one side (vLLM's NHD into TensorRT-LLM's HND) or runs below ``LONG_RUN`` (Gemma-3's
  4 KiB of one block of one head). Else ``runs`` (``kv_copy_rect``: a warp per long run, lane groups per short
  one, any alignment). Pools of more than two components (a recurrent state) and a DCP rank's positions against
  global tokens take ``span`` where aligned (a launch per component; spans mapped to the global tokens), else the
  torch reference.
- Another KV dtype, ``convert`` (``kv_convert_rect`` in kernels/fp8_rows.cu): read, convert, write in one pass,
  where the rows are bf16/fp16 <-> fp8 in groups of whole 8-value pieces of at most 256 values; else ``staged``
  (kvlab.memory.ops.convert: the rows moved into scratch, converted, moved out).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvlab.model import kv_dtype
from kvlab.model.spec import PoolSpec
from kvlab.model.state import CacheState, RankPool, pool_format

if TYPE_CHECKING:
    from kvlab.config.schema import Setup

# runs this long keep a warp's lanes busy and amortize their decode: kv_copy_rect moves them at about 0.9 of copy_
# (docs/results/kernels.md); shorter ones, and single rows, go to kv_copy_span
LONG_RUN = 8192


# components kv_copy_rect and the pack/unpack kernels address (K and V; the indexer's values and scales: their
# strides come in pairs); kv_copy_span takes one component per launch, so a pool of more (a recurrent state's three
# conv parts and its state) takes it where its rows are aligned, else the torch reference (kvlab.memory.ops.reference)
KERNEL_COMPONENTS = 2


def copy_path(src_pool: RankPool, dst_pool: RankPool) -> tuple[str, str]:
    """(``span``, ``runs`` or ``reference``, why) for a rectangle between two pools of one format."""
    n = max(len(src_pool.rows), len(dst_pool.rows))
    # one side keeps a DCP rank's local positions, the other global tokens: only the span kernel maps them
    dcp = src_pool.tokens.local != dst_pool.tokens.local
    for name, p in (("ctx", src_pool), ("gen", dst_pool)):
        for c, s in enumerate(p.comp_strides(1)):
            bad = (f"{name} rows of component {c} are {s.row} bytes, not a multiple of 16" if s.row % 16 else
                   f"{name} strides of component {c} are not 16-byte aligned"
                   if math.gcd(s.offset, s.block, s.layer, s.head, s.token) % 16 else "")
            if bad and (n > KERNEL_COMPONENTS or dcp):
                why = f"{n} components" if n > KERNEL_COMPONENTS else "a DCP rank's positions"
                return "reference", f"{why} and {bad}: torch's runs move them"
            if bad:
                return "runs", bad
    if n > KERNEL_COMPONENTS:
        return "span", f"{n} components, one span launch each (kv_copy_rect addresses {KERNEL_COMPONENTS})"
    if dcp:
        return "span", "a DCP rank's positions: each span mapped to the global tokens it holds"
    g = math.gcd(src_pool.tokens_per_block, dst_pool.tokens_per_block)
    if src_pool.token_runs and dst_pool.token_runs:
        run = g * min(src_pool.rows)
        if run >= LONG_RUN:
            return "runs", f"runs of {g} tokens of one head ({run} bytes or more): a warp per run streams them"
        how = f"runs of {g} tokens of one head, {run} bytes"
    else:
        side = "ctx" if not src_pool.token_runs else "gen"
        how = f"a transpose: the {side} side keeps single {src_pool.rows[0]}-byte token rows"
    return "span", f"spans of {g} tokens x every head in 16-byte vectors ({how})"


@dataclass(frozen=True)
class ConvertShape:
    """One component's conversion as ``kv_convert_rect`` does it: ``q`` values quantized in groups of ``group``,
    a team of ``lanes`` lanes per row, ``to_fp8`` the direction."""

    kind: str
    elems: int
    base: str
    q: int
    group: int
    lanes: int
    to_fp8: bool


def convert_shape(kind: str, elems: int, base: str, src: str, dst: str) -> ConvertShape | None:
    """The one-pass kernel's shape for rows of ``kind`` from format ``src`` to ``dst``, or None where it does not
    take them (a cast between bf16 and fp16, groups not of whole 8-value pieces or above 256 values)."""
    if base not in kv_dtype.BASES or not kv_dtype.converts(kind, base) or {src, dst} != {base, "fp8"}:
        return None
    q, group = kv_dtype.groups(kind, elems)
    if q <= 0 or q % 8 or group % 8 or group > 256:
        return None
    lanes = 1
    while lanes * 8 < group:
        lanes *= 2
    return ConvertShape(kind, elems, base, q, group, lanes, dst == "fp8")


def convert_shapes(src: PoolSpec, dst: PoolSpec) -> list[ConvertShape] | None:
    """Every component's shape from ``src``'s format into ``dst``'s, or None where one is not the kernel's."""
    kind = str(getattr(src.kind, "value", src.kind))
    sf, df = pool_format(src), pool_format(dst)
    shapes = [convert_shape(kind, n, d, sf, df) for n, d in zip(src.comp_elems, src.comp_dtypes)]
    return None if any(x is None for x in shapes) else shapes


def rect_path(src_pool: RankPool, dst_pool: RankPool) -> tuple[str, str]:
    """(path, why) of ``copy_rect`` between the two pools (``transport=ipc``'s pull)."""
    sf, df = pool_format(src_pool.spec), pool_format(dst_pool.spec)
    if sf == df:
        return copy_path(src_pool, dst_pool)
    if convert_shapes(src_pool.spec, dst_pool.spec) is not None:
        return "convert", f"{sf} -> {df} converted in one pass (rows read once, codes and scales written once)"
    return "staged", f"{sf} -> {df}: rows moved into scratch, converted in torch, moved out"


def pool_paths(setup: Setup) -> dict[str, tuple[str, str]]:
    """Per pool: ``rect_path`` from ctx rank 0's pool into gen rank 0's (the path the pack, the unpack and a pull
    share), for ``kvlab plan`` to print and the cost model to charge."""
    ctx, gen = CacheState(setup.model, setup.ctx, 0), CacheState(setup.model, setup.gen, 0)
    mine = {p.name: p for p in ctx.pools()}
    return {g.name: rect_path(mine[g.name], g) for g in gen.pools() if g.name in mine}
