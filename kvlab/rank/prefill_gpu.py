"""``prefill=gpu``: one ctx rank's share of each layer as real kernels on its GPU.

Each layer runs, on a compute stream of its own, the GEMMs of the model's shapes with random
bf16 weights (this rank's share under tensor parallelism: its query heads, its slice of the
MLP) and causal attention over the prompt (``scaled_dot_product_attention``), then writes the
layer's cache (kvlab.memory.cache.PagedCache.fill) and records an event. Transfers of layer l wait
for that event on the device (``Stream.wait_event``): the host never sleeps or synchronises
for the prefill. One layer's weights serve every layer (same shapes, same time), and every
layer reads the same random input, so values stay finite and memory stays one layer's.

What is left out or approximated, so that the figures say what they measure:
- MoE: the active experts of a token run as one MLP of ``experts_active * moe_intermediate_size``
  (the FLOPs of routed experts, without routing, imbalance or expert parallelism);
- MLA: queries and keys of ``qk_head_dim`` and values padded to it, on the expanded heads (the
  prefill form of DeepSeek's attention); the DeepSeek-V3.2 indexer is not run, and its sparse
  attention runs as a window of ``attention_topk`` keys;
- sliding windows (and top-k) run blockwise: query blocks of the window's size over their own
  block and the one before, masked to the window;
- norms, rotary embeddings, residuals and the LM head are not run.

The reference of a request's ``prefill_slowdown`` (``alone_with_cache_s``, before the run, per
prompt length) is the same prefill with nothing else on the GPU: the same layers, each followed
by the same cache write into the same cache, so that the slowdown is what the transfers add.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvlab.core.clock import launches_s
from kvlab.model.spec import ROPE_DIM, Attention, ModelSpec

if TYPE_CHECKING:
    from kvlab.memory.cache import PagedCache
    from kvlab.model.plan import Request

TOKEN_CHUNK = 16384  # rows of a projection or MLP GEMM at once: bounds activation memory at long prompts


class GpuPrefill:
    def __init__(self, model: ModelSpec, tp: int, device: torch.device, seed: int = 0):
        d = model.dims
        self.model, self.device = model, device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # CPU: shape checks only
        g = torch.Generator(device=device).manual_seed(seed)
        self.heads = math.ceil(d.q_heads / tp)
        self.kv_heads = max(1, model.kv_heads // tp) if model.attention == Attention.gqa else self.heads
        if model.attention == Attention.mla:
            self.qk = d.qk_head_dim
            v = d.v_head_dim or self.qk
            self.v = v
            q_in = d.q_lora_rank or d.hidden_size
            shapes = {"q_a": (d.hidden_size, d.q_lora_rank)} if d.q_lora_rank else {}
            shapes |= {"q_b": (q_in, self.heads * self.qk), "kv_a": (d.hidden_size, model.mla_dim),
                       "kv_b": (model.mla_dim - ROPE_DIM, self.heads * (self.qk - ROPE_DIM + v)),
                       "o": (self.heads * v, d.hidden_size)}
        else:
            self.qk = self.v = d.qk_head_dim or model.head_dim
            shapes = {"qkv": (d.hidden_size, (self.heads + 2 * self.kv_heads) * self.qk),
                      "o": (self.heads * self.v, d.hidden_size)}
        self.width = {True: math.ceil(d.intermediate_size / tp),
                      False: math.ceil(d.experts_active * d.moe_intermediate_size / tp)}
        for dense in (True, False):
            if self.width[dense]:
                shapes[f"gate_up_{int(dense)}"] = (d.hidden_size, 2 * self.width[dense])
                shapes[f"down_{int(dense)}"] = (self.width[dense], d.hidden_size)
        self.w = {k: torch.randn(*s, generator=g, device=device, dtype=torch.bfloat16) / math.sqrt(s[0])
                  for k, s in shapes.items()}
        self.hidden = d.hidden_size
        self._x: torch.Tensor | None = None

    def _input(self, n: int) -> torch.Tensor:
        if self._x is None or self._x.shape[0] < n:
            self._x = torch.randn(n, self.hidden, device=self.device, dtype=torch.bfloat16)
        return self._x[:n]

    def _reach(self, layer: int) -> int:
        d = self.model.dims
        return min((r for r in (self.model.layer_window(layer), d.attention_topk) if r), default=0)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, w = x.shape[0], self.w
        if self.model.attention == Attention.mla:
            qa = x @ w["q_a"] if "q_a" in w else x
            q = (qa @ w["q_b"]).view(n, self.heads, self.qk)
            latent = x @ w["kv_a"]
            kv = (latent[:, : self.model.mla_dim - ROPE_DIM] @ w["kv_b"]).view(n, self.heads, -1)
            k = torch.cat([kv[..., : self.qk - ROPE_DIM],
                           latent[:, None, -ROPE_DIM:].expand(n, self.heads, ROPE_DIM)], dim=-1)
            v = F.pad(kv[..., self.qk - ROPE_DIM:], (0, self.qk - self.v))
            return q, k, v
        qkv = (x @ w["qkv"]).view(n, self.heads + 2 * self.kv_heads, self.qk)
        return qkv[:, : self.heads], qkv[:, self.heads: self.heads + self.kv_heads], qkv[:, self.heads + self.kv_heads:]

    def _attention(self, q, k, v, reach: int) -> torch.Tensor:
        """[n, heads, v] causal attention, blockwise when a query sees at most ``reach`` keys."""
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, n, dim]
        gqa = k.shape[1] != q.shape[1]
        n = q.shape[2]
        if not reach or reach >= n:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            o = torch.empty_like(q[..., : v.shape[-1]])
            for s in range(0, n, reach):
                e, k0 = min(n, s + reach), max(0, s - reach)
                i = torch.arange(s, e, device=q.device)[:, None]
                j = torch.arange(k0, e, device=q.device)[None, :]
                mask = (j <= i) & (j > i - reach)
                o[:, :, s:e] = F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, k0:e], v[:, :, k0:e],
                                                              attn_mask=mask, enable_gqa=gqa)
        return o[0].transpose(0, 1)[..., : self.v]

    def layer(self, layer: int, n: int) -> None:
        """Queue global layer ``layer`` of an ``n``-token prefill on the current stream."""
        x = self._input(n)
        parts = [self._qkv(x[s:s + TOKEN_CHUNK]) for s in range(0, n, TOKEN_CHUNK)]
        q, k, v = (torch.cat([p[i] for p in parts]) if len(parts) > 1 else parts[0][i] for i in range(3))
        o = self._attention(q, k, v, self._reach(layer)).reshape(n, -1)
        d = self.model.dims
        dense = d.experts_active == 0 or layer < d.dense_layers
        width = self.width[dense]
        for s in range(0, n, TOKEN_CHUNK):
            y = o[s:s + TOKEN_CHUNK] @ self.w["o"]
            h = y @ self.w[f"gate_up_{int(dense)}"]
            h = F.silu(h[:, :width]) * h[:, width:]
            h @ self.w[f"down_{int(dense)}"]

    def alone_s(self, n: int, repeat: int = 2, write: Callable[[int], None] | None = None,
                layers: Iterable[int] | None = None) -> float:
        """Seconds of a whole prefill of ``n`` tokens with nothing else on the GPU (the reference a run's
        prefill under transfers is compared with); the first pass warms the kernels up. ``write(layer)``
        runs after each layer's kernels, on the same stream: the cache write the run's prefill does (without
        it the first request of a run, alone on the GPU, read 1.37 times its reference). ``layers``: the
        global layers this rank computes (every layer by default). On a CPU, host seconds (shape checks)."""
        layers = range(self.model.num_layers) if layers is None else sorted(layers)

        def once() -> None:
            for layer in layers:
                self.layer(layer, n)
                if write is not None:
                    write(layer)

        with torch.cuda.stream(self.stream):
            once()
            return launches_s(once, repeat, gpu=self.stream is not None)

    def alone_with_cache_s(self, req: Request, cache: PagedCache, ops, repeat: int = 2) -> float:
        """``alone_s`` of ``req``'s prompt as the run's prefill does it on this rank: the layers whose cache
        ``cache`` holds, each followed by the write of that layer of ``req`` (``cache.fill``). The request's
        blocks are allocated for the measure and released after it: call it before the run opens any."""
        held = {p.spec.layers[i] for p in cache.state.pools() for i in p.layers}
        cache.allocate(req)
        try:
            return self.alone_s(req.isl, repeat, lambda layer: cache.fill(req, ops, layer), held)
        finally:
            cache.release(req.id)
