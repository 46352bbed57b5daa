"""The decode models of ``check=decode``, in transformers: built from a preset's ``model.decode``, run in
the cache's dtype (bf16) on the CPU, and their caches as kvlab's pools hold them.

A pool (kvlab.model.spec) holds per layer a list of components, each ``heads`` planes of token rows.
``pool_rows`` turns a model's cache after prefill into those planes, one uint8 tensor
``[pool layers, heads, tokens, row bytes]`` per component; ``wire_bytes`` and ``from_wire`` are the
wire order of a rectangle of them (kvlab.model.layout), which ``PagedCache.fill`` unpacks into a pool and
``ops.pack`` reads back; ``model_cache`` puts planes gathered from the gen ranks back into a fresh
``DynamicCache``. What lands in each pool, per kind:

- GQA: K and V, ``[kv heads, tokens, head_dim]`` each, as the model's cache holds them;
- MLA: one row per token, the latent (transformers' ``keys``) then its RoPE part (``values``), the
  engines' 512 + 64 row;
- a recurrent state (Qwen3-Next's Gated DeltaNet, Nemotron-H's Mamba-2): per state layer one row per TP group
  (kvlab.model.spec.state_shape) from the model's ``conv_states`` ``[1, conv_dim, K]`` and ``recurrent_states``
  ``[1, heads, a, b]`` (fp32): the conv state's last ``K - 1`` inputs, what the engines keep and what a decode
  step reads (transformers keeps K and drops the oldest at the next step; the gen side rebuilds it with zeros
  there);
- DeepSeek-V3.2's indexer keys: 128 fp8 (e4m3) values and one fp32 scale per token, quantized as the
  engines quantize them (a scale per 128 values, a power of two: ``ue8m0``); transformers scores them
  in bf16, so the reference (kvlab.rank.decode_check) decodes with the same round trip applied to its own
  keys, and equality stays exact.

Everything here runs on one thread: the CPU's reductions then add in one order, so two processes
that compute the same thing from the same bytes get the same bits.
"""
from __future__ import annotations

import contextlib
import functools

import torch

from kvlab.core.decode_spec import ROPE_DIM, CheckSpec
from kvlab.model.hf_config import INIT_STD, MAX_POSITIONS, _model_class, hf_config  # noqa: F401 - used here and by callers
from kvlab.model.layout import Rect
from kvlab.model.spec import Kind, ModelSpec, PoolSpec
from kvlab.model.tokens import to_global

FP8_MAX = 448.0  # largest float8_e4m3fn


@contextlib.contextmanager
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    was = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(was)


@functools.lru_cache(maxsize=2)
def build(model: ModelSpec, seed: int, device: str = "cpu"):
    """(transformers model in bf16, eval mode, its config) on ``device``: weights drawn from ``seed``. For a CPU
    they are drawn there in fp32 on one thread; for a GPU on the GPU itself, in bf16: a full-width 8B model drawn
    on one CPU thread takes minutes, and its fp32 draw would need twice the weights' memory. Every device of one
    kind draws the same weights, and a reference is computed on the kind of device that checks against it
    (kvlab.rank.decode_check)."""
    cfg = hf_config(model)
    dev = torch.device(device)
    if dev.type == "cpu":
        with torch.random.fork_rng(devices=[]), one_thread():
            torch.manual_seed(seed)
            net = _model_class(model.decode.family)(cfg)
        return net.to(torch.bfloat16).eval(), cfg
    with torch.random.fork_rng(devices=[dev], device_type=dev.type), dev, _default_dtype(torch.bfloat16):
        torch.manual_seed(seed)
        net = _model_class(model.decode.family)(cfg)
    return net.to(torch.bfloat16).eval(), cfg


def prompt(check: CheckSpec, model: ModelSpec, request: int, isl: int) -> torch.Tensor:
    """Request ``request``'s prompt: ``isl`` token ids drawn from ``check.seed`` and the request."""
    g = torch.Generator().manual_seed(check.seed * 1_000_003 + request)
    return torch.randint(0, model.decode.vocab_size, (1, isl), generator=g)


# ---------------------------------------------------------------- the indexer keys as the engines store them

def quantize(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 e4m3 values, fp32 scales [..., 1]) of ``keys`` [..., 128]: one power-of-two scale per 128 values
    (DeepSeek-V3.2's ``ue8m0`` scale format), so that every value fits fp8's range."""
    x = keys.float()
    amax = x.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    return (x / scale).to(torch.float8_e4m3fn), scale


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    return (values.float() * scales).to(dtype)


def round_trip(keys: torch.Tensor) -> torch.Tensor:
    """The indexer keys as the gen side reads them back from the pool."""
    return dequantize(*quantize(keys), keys.dtype)


# ---------------------------------------------------------------- model cache <-> pool planes

def full_prefill(net, cfg, ids: torch.Tensor, on_cache=None):
    """Prefill ``ids``; returns (cache, last position's logits in fp32). Sliding-window layers keep every token
    (``activate_past_recording``: the pool holds the whole window, the model's cache one token less).
    ``on_cache(cache)`` sees the cache before the forward fills it (prefill=model reads it layer by layer)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=cfg)
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            layer.activate_past_recording()
    if on_cache is not None:
        on_cache(cache)
    with torch.no_grad(), one_thread():
        # the last position's logits alone: at 32k prompts every position's would be gigabytes nobody reads
        out = net(input_ids=ids.to(net.device), past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache, out.logits[0, -1].float().cpu()


def pool_rows(model: ModelSpec, cache, dtype: str = "bf16", only: int | None = None,
              on_device: bool = False) -> dict[str, list[torch.Tensor]]:
    """Pool name -> per component uint8 ``[pool layers, heads, tokens, row bytes]`` in host memory (where the
    cache is with ``on_device``), from a prefill's cache; of global layer ``only`` alone where given (``[1, heads,
    tokens, row]``, the pools that hold it: prefill=model writes each layer when it is computed)."""
    out = {}
    for p in model.pools(dtype):
        layers = [cache.layers[g] for g in p.layers if only is None or g == only]
        if not layers:
            continue
        if p.kind == Kind.kv:
            for attr in ("keys", "values"):
                out.setdefault(p.name, []).append(
                    torch.stack([getattr(layer, attr)[0] for layer in layers]).contiguous().view(torch.uint8))
        elif p.kind == Kind.mla:
            rows = torch.stack([torch.cat([layer.keys[0, 0], layer.values[0, 0]], -1) for layer in layers])
            out[p.name] = [rows[:, None].contiguous().view(torch.uint8)]
        elif p.kind == Kind.state:
            out[p.name] = state_planes(model, layers)
        else:
            vals, scales = quantize(torch.stack([layer.indexer_keys[0] for layer in layers]))
            out[p.name] = [vals[:, None].contiguous().view(torch.uint8), scales[:, None].contiguous().view(torch.uint8)]
    return {name: [plane if on_device else plane.cpu() for plane in planes] for name, planes in out.items()}


def _conv_parts(model: ModelSpec) -> tuple[int, int, int]:
    """Channels of the conv state's three parts (GDN q, k, v; Mamba-2 x, B, C), over all groups."""
    g, r = model.state_groups, model.state_heads // model.state_groups
    if model.state == "gdn":
        return g * model.state_dim, g * model.state_dim, g * r * model.state_head_dim
    return g * r * model.state_head_dim, g * model.state_dim, g * model.state_dim


def _row(t: torch.Tensor) -> torch.Tensor:
    """[layers, groups, ...] as uint8 [layers, groups, 1 (token), bytes]."""
    return t.flatten(2).contiguous().view(torch.uint8)[:, :, None]


def state_planes(model: ModelSpec, layers) -> list[torch.Tensor]:
    """A state pool's four planes from the model's state layers: each conv part's channels of a group with their
    last ``K - 1`` inputs, then the group's heads of the recurrent state."""
    g = model.state_groups
    conv = torch.stack([layer.conv_states[0][0, :, 1:] for layer in layers])  # [layers, conv_dim, K - 1]
    planes, start = [], 0
    for n in _conv_parts(model):
        planes.append(_row(conv[:, start:start + n].unflatten(1, (g, -1))))
        start += n
    rec = torch.stack([layer.recurrent_states[0][0] for layer in layers])  # [layers, heads, a, b]
    planes.append(_row(rec.unflatten(1, (g, -1))))
    return planes


def _set_state(model: ModelSpec, layer, planes: list[torch.Tensor], i: int, dtype, device) -> None:
    """Layer ``i`` of a state pool's planes into a transformers linear-attention cache layer, as after a prefill:
    the conv state's oldest input (never read again) zero."""
    parts = [planes[c][i, :, 0].contiguous().view(dtype).view(n, model.conv_kernel - 1)
             for c, n in enumerate(_conv_parts(model))]
    conv = torch.nn.functional.pad(torch.cat(parts), (1, 0))[None].to(device)
    rec = planes[3][i, :, 0].contiguous().view(STATE_DTYPES[model.state_dtype])
    rec = rec.view(model.state_heads, *((model.state_dim, model.state_head_dim) if model.state == "gdn"
                                        else (model.state_head_dim, model.state_dim)))[None].to(device)
    layer.update_conv_state(conv, conv_kernel_size=model.conv_kernel)
    layer.update_recurrent_state(rec)


STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _tile_groups(rect: Rect) -> list[tuple[int, int, int]]:
    from kvlab.memory.fill import _tile_groups

    return _tile_groups(rect)


def wire_bytes(rows: list[torch.Tensor], rect: Rect, out: torch.Tensor | None = None) -> torch.Tensor:
    """The bytes of ``rect`` of a pool's planes ``rows`` in wire order (kvlab.model.layout): for each tile, each
    layer, each component, each head, the tile's token rows."""
    n = rect.n_layers * rect.n_heads * rect.n_tokens * sum(r.shape[-1] for r in rows)
    out = torch.empty(n, dtype=torch.uint8, device=rows[0].device) if out is None else out
    nl, nh, off = rect.n_layers, rect.n_heads, 0
    for ts, ntiles, ntok in _tile_groups(rect):
        pieces = []
        # a DCP rank's positions: the tiles' global tokens (kvlab.model.tokens), consecutive within a tile only
        tok = None if rect.local is None else to_global(rect.local, torch.arange(ts, ts + ntiles * ntok))
        for r in rows:
            x = r[rect.l0:rect.l1, rect.h0:rect.h1]
            x = x[:, :, ts:ts + ntiles * ntok] if tok is None else x.index_select(2, tok.to(x.device))
            pieces.append(x.reshape(nl, nh, ntiles, ntok, -1).permute(2, 0, 1, 3, 4).reshape(ntiles, nl, -1))
        g = torch.cat(pieces, 2).reshape(-1)
        out[off:off + g.numel()].copy_(g)
        off += g.numel()
    return out


def from_wire(data: torch.Tensor, rect: Rect, row_bytes: tuple[int, ...]) -> list[torch.Tensor]:
    """``wire_bytes``' inverse: per component uint8 ``[rect layers, rect heads, rect tokens, row]``."""
    nl, nh = rect.n_layers, rect.n_heads
    outs = [torch.empty(nl, nh, rect.n_tokens, row, dtype=torch.uint8) for row in row_bytes]
    off = 0
    for ts, ntiles, ntok in _tile_groups(rect):
        size = ntiles * nl * ntok * nh * sum(row_bytes)
        g = data[off:off + size].view(ntiles, nl, -1)
        o = 0
        for c, row in enumerate(row_bytes):
            x = g[:, :, o:o + nh * ntok * row].reshape(ntiles, nl, nh, ntok, row)
            outs[c][:, :, ts - rect.t0:ts - rect.t0 + ntiles * ntok] = x.permute(1, 2, 0, 3, 4).reshape(nl, nh, -1, row)
            o += nh * ntok * row
        off += size
    return outs


def _bf16(plane: torch.Tensor) -> torch.Tensor:
    return plane.contiguous().view(torch.bfloat16)


def model_cache(model: ModelSpec, cfg, rows: dict[str, list[torch.Tensor]], isl: int, device="cpu"):
    """A fresh ``DynamicCache`` holding a prefill of ``isl`` tokens, from every pool's planes (tokens
    ``[0, isl)``; a sliding-window layer reads only its window's tail, which it keeps with the
    prefill's length, as the model's own cache does), on ``device``."""
    from transformers import DynamicCache

    cache = DynamicCache(config=cfg)
    by_layer: dict[int, dict] = {}
    for p in model.pools("bf16"):
        for i, g in enumerate(p.layers):
            by_layer.setdefault(g, {})[p.kind] = (p, i)
    for g, layer in enumerate(cache.layers):
        kinds = by_layer.get(g)
        if not kinds:  # a layer without a cache (Nemotron-H's MLP-only layers)
            continue
        if Kind.state in kinds:
            p, i = kinds[Kind.state]
            _set_state(model, layer, rows[p.name], i, torch.bfloat16, device)
            continue
        if Kind.kv in kinds:
            p, i = kinds[Kind.kv]
            k, v = (_bf16(rows[p.name][c][i])[None] for c in (0, 1))
        else:
            p, i = kinds[Kind.mla]
            row = _bf16(rows[p.name][0][i, 0])
            k, v = row[None, None, :, :-ROPE_DIM], row[None, None, :, -ROPE_DIM:]
        k, v = k[:, :, :isl].contiguous().to(device), v[:, :, :isl].contiguous().to(device)
        if p.window:
            keep = p.window - 1  # what transformers' sliding layer keeps of a prefill
            layer.update(k[:, :, -keep:], v[:, :, -keep:])
            layer.cumulative_length = isl
        else:
            layer.update(k, v)
        if Kind.indexer in kinds:
            q, j = kinds[Kind.indexer]
            vals = rows[q.name][0][j, 0, :isl].contiguous().view(torch.float8_e4m3fn)
            scales = rows[q.name][1][j, 0, :isl].contiguous().view(torch.float32)
            layer.update_indexer(dequantize(vals, scales)[None].to(device))
    return cache


def reference_cache(model: ModelSpec, cache, isl: int) -> None:
    """Turn a ``full_prefill`` cache into what the model would hold after an ordinary prefill, with the
    indexer keys' fp8 round trip applied: sliding layers keep their window's tail (a prefill of ``isl``
    tokens), indexer keys read as the gen side will read them."""
    for g, layer in enumerate(cache.layers):
        w = model.layer_window(g)
        if getattr(layer, "is_sliding", False):
            keep = w - 1
            layer.keys, layer.values = layer.keys[:, :, -keep:], layer.values[:, :, -keep:]
            layer.record_past = False
            layer.cumulative_length = isl
        if getattr(layer, "indexer_keys", None) is not None:
            layer.indexer_keys = round_trip(layer.indexer_keys)


def decode(net, cache, first: int, steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding of ``steps`` tokens after ``first``: (tokens, logits [steps, vocab] in fp32, on the CPU)."""
    tok, tokens, logits = first, [], []
    with torch.no_grad(), one_thread():
        for _ in range(steps):
            out = net(input_ids=torch.tensor([[tok]], device=net.device), past_key_values=cache, use_cache=True)
            lg = out.logits[0, -1].float().cpu()
            logits.append(lg)
            tok = int(lg.argmax())
            tokens.append(tok)
    return tokens, torch.stack(logits)


def cache_differences(model: ModelSpec, rows: dict[str, list[torch.Tensor]], want: dict[str, list[torch.Tensor]],
                      isl: int) -> list[dict]:
    """Where ``rows`` differ from ``want`` in the tokens decoding reads (a sliding layer: the last ``window - 1``
    of the prompt): per layer and component, the first token that differs and how many do."""
    out = []
    for p in model.pools("bf16"):
        start, end = (max(0, isl - p.window + 1) if p.window else 0), p.held_tokens(isl)
        for c, (got, exp) in enumerate(zip(rows[p.name], want[p.name])):
            bad = (got[:, :, start:end] != exp[:, :, start:end]).flatten(3).any(-1).any(1)  # [layers, tokens]
            for i in torch.nonzero(bad.any(-1)).flatten().tolist():
                toks = torch.nonzero(bad[i]).flatten()
                out.append({"layer": p.layers[i], "pool": p.name, "component": c, "token": start + int(toks[0]),
                            "tokens": int(toks.numel())})
    return sorted(out, key=lambda d: (d["layer"], d["component"]))


def pool_spec(model: ModelSpec, name: str) -> PoolSpec:
    return next(p for p in model.pools("bf16") if p.name == name)


def planes_bytes(rows: dict[str, list[torch.Tensor]]) -> int:
    return sum(t.numel() for ts in rows.values() for t in ts)
