"""The prefill: how long each layer of a request takes, and when each ctx DP group computes it.

``prefill=sim`` (the default) times a layer from the model's real dimensions
(``model.dims``, sources in each model's YAML) on the accelerator ``prefill.tflops`` at
``prefill.mfu`` of its peak, split over the ctx side's TP ranks:

    layer FLOPs = 2 * prompt * (attention projections + MLP weights active per token)
                + 2 * q_heads * (qk_head_dim + v_head_dim) * attended pairs
                [+ 2 * indexer_heads * 128 * causal pairs  (DeepSeek-V3.2's lightning indexer)]

- GQA projections: hidden * head_dim * (q_heads + 2 kv_heads) + q_heads * head_dim * hidden.
- MLA projections: the low-rank query (hidden * q_lora_rank + q_lora_rank * q_heads * qk_head_dim),
  the latent (hidden * mla_dim), its up-projection to keys and values ((mla_dim - 64) * q_heads *
  (qk_head_dim - 64 + v_head_dim)) and the output (q_heads * v_head_dim * hidden); 64 is the
  decoupled RoPE part, shared by every head.
- MLP: a gated MLP (gate, up, down: 3 * hidden * intermediate) on dense layers (every layer of
  a dense model, the first ``dense_layers`` of a MoE); ``experts_active`` (routed + shared) of
  3 * hidden * moe_intermediate_size on MoE layers. Routers, norms and embeddings are left out.
- Attended pairs: causal, so n (n + 1) / 2 for a prompt of n tokens; a query sees at most
  ``window`` keys on sliding-window layers and ``attention_topk`` keys with sparse attention.

``prefill.layer_ms`` > 0 replaces the model: every layer takes that long whatever the prompt.
A ctx DP group prefills one request at a time, first come first served, each layer after the
previous (pipeline stages in turn): ``timeline`` turns arrival times into when each request's
prefill would start and each of its layers end. It is pure, so every rank derives the same one,
and it is only the estimate the global chunk order is planned from (kvlab.config.workload): the run's
prefill (kvlab.rank.prefiller) measures what happens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvlab.core.bounds import bounded
from kvlab.core.errors import ConfigError, require
from kvlab.model.spec import INDEXER_HEAD_DIM, ROPE_DIM, Attention, ModelSpec
from kvlab.model.tokens import Tokens

KINDS = ("sim", "gpu", "model")


@dataclass(frozen=True)
class PrefillSpec:
    kind: str = "sim"  # sim | gpu | model (the transformers model itself: kvlab.rank.prefill_model)
    # > 0: every layer takes this long (sim), whatever the prompt
    layer_ms: float = bounded(0.0, hi=60000.0, unit="ms", why="a minute a layer")
    # peak dense bf16 of the simulated accelerator (H200 SXM); far below any accelerator's: a silent run
    tflops: float = bounded(989.0, lo=1e-3, hi=1e9, unit="TFLOP/s", why="1 GFLOP/s")
    mfu: float = bounded(0.5, lo=1e-3, hi=1.0, why="0.1% of the peak")  # share of the peak a long prefill reaches

    def __post_init__(self):
        require(self.kind in KINDS, "prefill.kind", self.kind,
                f"use one of {', '.join(sorted(KINDS))} (the prefill group's options: prefill=sim, ...)")
        require(math.isfinite(self.layer_ms) and self.layer_ms >= 0, "prefill.layer_ms", self.layer_ms,
                "must be >= 0 ms (0: timed from model.dims)")
        require(math.isfinite(self.tflops) and self.tflops > 0, "prefill.tflops", self.tflops,
                "must be > 0 (peak dense TFLOP/s of the prefill accelerator, e.g. 989 for H200)")
        require(math.isfinite(self.mfu) and 0 < self.mfu <= 1, "prefill.mfu", self.mfu, "must be in (0, 1]")


def causal_pairs(n: int, reach: int = 0) -> int:
    """(query, key) pairs of causal attention over n tokens when a query sees at most ``reach`` keys."""
    if reach <= 0 or reach >= n:
        return n * (n + 1) // 2
    return reach * (reach + 1) // 2 + (n - reach) * reach


def layer_kind(model: ModelSpec, layer: int) -> tuple[int, bool]:
    """What of a layer its FLOPs depend on: the keys a query reaches (0: all of them) and whether its MLP is dense;
    layers of one kind cost the same."""
    dims = model.dims
    reach = min((r for r in (model.layer_window(layer), dims.attention_topk) if r), default=0)
    return reach, dims.experts_active == 0 or layer < dims.dense_layers


def layer_flops(model: ModelSpec, layer: int, n: int, queries: tuple[int, int] | None = None) -> float:
    """Forward FLOPs of global layer ``layer`` over a prompt of ``n`` tokens (the formula above); of the queries
    ``[a, b)`` alone where given (a context-parallel rank's chunk: its keys are all those before it)."""
    dims = model.dims
    h, qh = dims.hidden_size, dims.q_heads
    if model.attention == Attention.mla:
        qk = dims.qk_head_dim
        v = dims.v_head_dim or qk
        q_proj = h * dims.q_lora_rank + dims.q_lora_rank * qh * qk if dims.q_lora_rank else h * qh * qk
        proj = q_proj + h * model.mla_dim + (model.mla_dim - ROPE_DIM) * qh * (qk - ROPE_DIM + v) + qh * v * h
    else:
        qk = dims.qk_head_dim or model.head_dim
        v = dims.v_head_dim or qk
        proj = h * qk * qh + 2 * h * model.kv_heads * qk + qh * v * h
    reach, dense = layer_kind(model, layer)
    mlp = 3 * h * (dims.intermediate_size if dense else dims.experts_active * dims.moe_intermediate_size)
    a, b = queries or (0, n)
    flops = 2.0 * (b - a) * (proj + mlp) + 2.0 * qh * (qk + v) * (causal_pairs(b, reach) - causal_pairs(a, reach))
    if dims.indexer_heads:
        flops += 2.0 * dims.indexer_heads * INDEXER_HEAD_DIM * (causal_pairs(b) - causal_pairs(a))
    return flops


def layer_seconds(model: ModelSpec, spec: PrefillSpec, tp: int, n: int, cp: Tokens | None = None) -> list[float]:
    """Seconds of each global layer of an ``n``-token prefill on one ctx DP group of ``tp`` ranks; with context
    parallelism (``cp``: any CP rank's token split, kvlab.model.tokens) the layer ends with its slowest CP rank,
    which computes the queries of its chunks against every key before them (ring attention): contiguous chunks
    leave the last rank the most attention, load-balanced ones even it out."""
    if spec.layer_ms:
        return [spec.layer_ms / 1e3] * model.num_layers
    rate = tp * spec.tflops * 1e12 * spec.mfu
    if cp is None or cp.ranks == 1:
        return [layer_flops(model, layer, n) / rate for layer in range(model.num_layers)]
    ranks = [replace(cp, rank=r).chunks(n) for r in range(cp.ranks)]
    kinds = [layer_kind(model, layer) for layer in range(model.num_layers)]
    slowest: dict[tuple[int, bool], float] = {}  # per layer kind: the ranks are walked once per kind, not per layer
    for layer, kind in enumerate(kinds):
        if kind not in slowest:
            slowest[kind] = max(sum(layer_flops(model, layer, n, q) for q in chunks) for chunks in ranks) / rate
    return [slowest[kind] for kind in kinds]


@dataclass(frozen=True)
class PrefillTimes:
    """One request's prefill on the shared timeline (seconds from the run's start)."""

    request: int
    group: int  # ctx DP group
    arrival: float
    start: float
    layer_end: tuple[float, ...]  # per global layer

    @property
    def end(self) -> float:
        return self.layer_end[-1]

    @property
    def queue(self) -> float:
        return self.start - self.arrival


def timeline(requests, seconds_of) -> dict[int, PrefillTimes]:
    """FIFO per ctx DP group: a request starts when it has arrived and its group is free.
    ``requests`` carry ``id``, ``isl``, ``ctx_dp`` and ``arrival_s``; ``seconds_of(isl)`` gives per-layer
    seconds. Ties in arrival go by request id, the order every rank agrees on."""
    free: dict[int, float] = {}
    out = {}
    for r in sorted(requests, key=lambda r: (r.arrival_s, r.id)):
        t = start = max(r.arrival_s, free.get(r.ctx_dp, 0.0))
        ends = []
        for s in seconds_of(r.isl):
            t += s
            ends.append(t)
        free[r.ctx_dp] = t
        out[r.id] = PrefillTimes(r.id, r.ctx_dp, r.arrival_s, start, tuple(ends))
    return out


def times_for(setup, requests) -> dict[int, PrefillTimes]:
    """The run's estimated prefill timeline: what every rank plans the chunk order from."""
    cp = setup.ctx.tokens(0, setup.model)
    return timeline(requests, lambda isl: layer_seconds(setup.model, setup.prefill, setup.ctx.tp, isl, cp))


def ready_s(times: PrefillTimes, layer: int, per_layer: bool) -> float:
    """When a chunk may go: its layer is done (layer-wise) or the whole prefill is (every other strategy)."""
    return times.layer_end[layer] if per_layer else times.end


def check_gpu(spec: PrefillSpec) -> None:
    if spec.kind != "gpu":
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("prefill", "gpu", "no CUDA device is visible here; use prefill=sim (the default)")
