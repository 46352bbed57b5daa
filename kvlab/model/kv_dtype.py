"""The KV dtype of each side's cache (``ctx.kv_dtype`` / ``gen.kv_dtype``), and its conversion in flight.

A pool's *format* says how its K/V (or MLA) rows hold the values the prefill computed:

- ``bf16`` / ``fp16``: the values themselves;
- ``fp8``: float8 e4m3 (``e4m3fn``: bias 7, no infinities, largest 448) with fp32 scales inside the row, at the
  granularity the engines use for the cache kind: K and V one scale per token and head (a row of ``D`` values
  is ``D`` bytes then its 4-byte scale); the MLA row as vLLM's ``fp8_ds_mla`` (576 values: the 512-value latent
  in e4m3 with one scale per 128 values, then the 64 RoPE values in the base dtype: 656 bytes in bf16). Per-block
  scales have no place in a token row: not offered.

The rule (``quantize``): per scale group ``s = amax(|x|) / 448`` in fp32 (1 where the group is all zeros), then
``x / s`` clamped to [-448, 448] and rounded to the nearest e4m3 value, ties to the even code (torch's cast).
Reading it back is ``e4m3 * s``. The indexer keys are fp8 already and never converted.

Where the two sides' formats differ, the wire carries the smaller of the two (bytes on the wire halved for
bf16 -> fp8): a pool converted to it in the pack (ctx) or from it in the unpack (gen), the plan's choice
(``wire_format``); both are in the copy for a pulling transport. A pool's contents are always the prefill's
values in that pool's format (kvlab.memory.fill), so the gen side's byte check is a value check: the expected fp8
bytes computed from the expected bf16 values by the same rule.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where values are converted: the config layer reads row sizes only
    import torch

KV_DTYPES = ("bf16", "fp16", "fp8")
CONVERTED_KINDS = ("kv", "mla")  # the indexer keys are fp8 already
FP8_MAX = 448.0
GROUP = 128  # values per scale of the MLA latent (vLLM fp8_ds_mla)
ROPE = 64  # the MLA row's RoPE part, kept in the base dtype
BASES = ("bf16", "fp16")


def _dt(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "e4m3": torch.float8_e4m3fn}[name]


def granularity(kind: str) -> str:
    return "per token and head" if kind == "kv" else f"per {GROUP} values (the RoPE part kept)"


def row_bytes(kind: str, elems: int, base: str, fmt: str) -> int:
    """Bytes of one row of ``elems`` values of ``kind`` whose base dtype is ``base`` (bf16/fp16), in ``fmt``."""
    if fmt != "fp8":
        return elems * 2
    if kind == "kv":
        return elems + 4
    latent = elems - ROPE
    return latent + 4 * math.ceil(latent / GROUP) + ROPE * 2


def converts(kind: str, base: str) -> bool:
    """Whether a pool of ``kind`` whose values are ``base`` can be held in another KV dtype."""
    return kind in CONVERTED_KINDS and base in BASES


def groups(kind: str, elems: int) -> tuple[int, int]:
    """(values quantized, values per scale) of a row."""
    return (elems, elems) if kind == "kv" else (elems - ROPE, GROUP)


def quantize(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``x`` [..., n] -> (e4m3 codes uint8 [..., n], fp32 scales [..., ceil(n / group)])."""
    import torch

    n = x.shape[-1]
    pad = -n % group
    g = torch.nn.functional.pad(x, (0, pad)).unflatten(-1, (-1, group))
    amax = g.abs().amax(-1)
    # a tensor divisor, not the number: CUDA divides by a number as a multiplication by its reciprocal, which
    # differs from the division in the last bit for some amax, and the scale must not depend on the device
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    q = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2)[..., :n].contiguous().view(torch.uint8), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    n = codes.shape[-1]
    v = codes.contiguous().view(_dt("e4m3")).float()
    return v * scale.repeat_interleave(group, -1)[..., :n]


def to_values(rows: torch.Tensor, kind: str, elems: int, base: str, fmt: str) -> torch.Tensor:
    """uint8 rows [..., row bytes] in ``fmt`` -> fp32 values [..., elems]."""
    import torch

    if fmt != "fp8":
        return rows.contiguous().view(_dt(fmt)).float()
    q, group = groups(kind, elems)
    ns = math.ceil(q / group)
    # clone: a row's scales may start off a 4-byte boundary of its storage (a wire buffer at any even offset)
    vals = dequantize(rows[..., :q], rows[..., q:q + 4 * ns].clone().view(_dt("fp32")), group)
    if kind == "kv":
        return vals
    rope = rows[..., q + 4 * ns:].contiguous().view(_dt(base)).float()
    return torch.cat([vals, rope], -1)


def from_values(x: torch.Tensor, kind: str, base: str, fmt: str) -> torch.Tensor:
    """fp32 values [..., elems] -> uint8 rows [..., row bytes] in ``fmt``."""
    import torch

    if fmt != "fp8":
        return x.to(_dt(fmt)).view(torch.uint8)
    elems = x.shape[-1]
    q, group = groups(kind, elems)
    codes, scale = quantize(x[..., :q], group)
    parts = [codes, scale.contiguous().view(torch.uint8)]
    if kind != "kv":
        parts.append(x[..., q:].contiguous().to(_dt(base)).view(torch.uint8))
    return torch.cat(parts, -1)


def convert_rows(rows: torch.Tensor, kind: str, elems: int, base: str, src: str, dst: str) -> torch.Tensor:
    """Rows of one component from format ``src`` to ``dst`` (bf16 to fp16 and back are casts, fp8 quantizes)."""
    if src == dst:
        return rows
    return from_values(to_values(rows, kind, elems, base, src), kind, base, dst)


def wire_format(ctx_fmt: str, gen_fmt: str, ctx_row: int, gen_row: int) -> tuple[str, str]:
    """(the format on the wire, where the conversion happens: ``pack``, ``unpack`` or ``none``): the smaller
    row on the wire; at equal sizes the ctx's, converted where the decode side receives it."""
    if ctx_fmt == gen_fmt:
        return ctx_fmt, "none"
    if gen_row < ctx_row:
        return gen_fmt, "pack"
    return ctx_fmt, "unpack"
