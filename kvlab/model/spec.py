"""Model spec: what each layer of a model caches, grouped into pools.

A pool holds the layers that share a cache kind and a window. Every pool stores, per
(block, layer), a list of *components* (K and V for GQA; the latent for MLA; the fp8
values and the fp32 scales for the DeepSeek-V3.2 indexer), each component holding
``heads`` planes of ``tokens_per_block`` rows of ``row_bytes``. That one shape covers
every cache kind kvlab knows, so plan, schedule and the kernels never special-case one.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from kvlab.core import arrivals
from kvlab.core.bounds import bounded
from kvlab.core.decode_spec import DecodeModel
from kvlab.core.errors import positive, require
from kvlab.model import kv_dtype


class Attention(str, Enum):
    gqa = "gqa"
    mla = "mla"


class Kind(str, Enum):
    kv = "kv"
    mla = "mla"
    indexer = "indexer"
    state = "state"


# A hybrid model's layers, one character each (Nemotron-H's ``hybrid_override_pattern`` alphabet), the pattern cycled
# over ``num_layers``: attention (the model's ``attention``: GQA or MLA, its window), a recurrent state, no cache
LAYER_ATTENTION, LAYER_STATE, LAYER_NONE = "*", "M", "-"
# Recurrent-state families: the state's four components per TP group (``state_shape``)
STATE_FAMILIES = ("gdn", "mamba2")


DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}

# DeepSeek-V3.2 indexer K: index_head_dim fp8 values, then one fp32 scale per 128 values,
# stored per block as all values then all scales (TensorRT-LLM, vLLM, SGLang agree).
INDEXER_HEAD_DIM = 128
INDEXER_QUANT_BLOCK = 128
ROPE_DIM = 64  # MLA's decoupled rotary part of each query/key head (DeepSeek-V2/V3)


@dataclass(frozen=True)
class KindDef:
    """A cache kind as data: everything outside this table sees only the pools it makes (components of
    ``heads`` planes of token rows), so adding a kind is one entry here (and a model file that has it)."""

    name: str
    replicated: bool  # identical on every TP rank: never split by heads (MLA's latent, the indexer keys)
    # its number in the fill hash (kvlab.memory.fill): bytes delivered into another kind's pool are caught
    fill_tag: int
    # (heads, elements per token per head of each component, their dtypes) of its pools for a model whose cache
    # is stored in a dtype; None where the model has no such cache
    shape: Callable[[ModelSpec, str], tuple[int, tuple[int, ...], tuple[str, ...]] | None]
    # one state per request and layer, after the prompt's last token (held as token 0, in blocks of one)
    per_request: bool = False


@dataclass(frozen=True)
class PoolSpec:
    """Layers that share a cache kind and window, before any parallel split."""

    name: str
    kind: Kind | str  # a key of KINDS
    layers: tuple[int, ...]  # global layer ids, ascending
    window: int  # 0: full attention
    heads: int  # kv heads (GQA) or 1 (MLA latent, indexer)
    comp_elems: tuple[int, ...]  # elements per token per head of each component
    comp_dtypes: tuple[str, ...]
    # the KV dtype its rows hold (kvlab.model.kv_dtype: a side's kv_dtype); "": the comp_dtypes themselves
    fmt: str = ""

    @property
    def replicated(self) -> bool:
        return KINDS[self.kind].replicated

    @property
    def per_request(self) -> bool:
        """A recurrent state: one row per (layer, head) and request, not one per token."""
        return KINDS[self.kind].per_request

    @property
    def shares_prefix(self) -> bool:
        """Whether a prefix hit's blocks stand for this pool's leading blocks: full attention only (a window keeps
        only the tail; a recurrent state is the whole prompt's, at its end)."""
        return not self.window and not self.per_request

    def held_tokens(self, isl: int) -> int:
        """Token rows a request of ``isl`` tokens has in this pool (the end of what it holds)."""
        return 1 if self.per_request else isl

    def comp_row_bytes(self) -> tuple[int, ...]:
        if self.fmt:
            kind = str(getattr(self.kind, "value", self.kind))
            return tuple(kv_dtype.row_bytes(kind, n, d, self.fmt) for n, d in zip(self.comp_elems, self.comp_dtypes))
        return tuple(n * DTYPE_BYTES[d] for n, d in zip(self.comp_elems, self.comp_dtypes))

    def token_bytes(self, heads: int | None = None) -> int:
        """Bytes of one token of one layer for ``heads`` heads (all heads by default)."""
        return (self.heads if heads is None else heads) * sum(self.comp_row_bytes())


@dataclass(frozen=True)
class ModelDims:
    """What a layer computes, beyond what it caches (ModelSpec). 0 means unknown or not used."""

    hidden_size: int = bounded(0, hi=1 << 20)  # the model's width
    q_heads: int = bounded(0, hi=1 << 20)  # attention's query heads
    qk_head_dim: int = bounded(0, hi=1 << 20)  # 0: the model's head_dim (GQA)
    v_head_dim: int = bounded(0, hi=1 << 20)  # 0: qk_head_dim
    intermediate_size: int = bounded(0, hi=1 << 20)  # dense gated MLP
    experts_active: int = bounded(0, hi=1 << 20)  # routed + shared experts per token; 0: a dense model
    moe_intermediate_size: int = bounded(0, hi=1 << 20)  # an expert's MLP width
    dense_layers: int = bounded(0, hi=1 << 20)  # leading dense layers of a MoE model
    q_lora_rank: int = bounded(0, hi=1 << 20)  # MLA low-rank query; 0: a full-rank query projection
    attention_topk: int = bounded(0, hi=1 << 20)  # sparse attention: keys per query at most; 0: all
    indexer_heads: int = bounded(0, hi=1 << 20)  # DeepSeek-V3.2 lightning indexer

    def validate_for(self, model: ModelSpec) -> None:
        """The dimensions a time model needs; named so that a preset without them says which to add."""
        for name in ("hidden_size", "q_heads"):
            positive(f"model.dims.{name}", getattr(self, name))
        for name, v in vars(self).items():
            require(isinstance(v, int) and v >= 0, f"model.dims.{name}", v, "must be an integer >= 0")
        if self.experts_active == 0 or self.dense_layers > 0:
            positive("model.dims.intermediate_size", self.intermediate_size)
        if self.experts_active:
            positive("model.dims.moe_intermediate_size", self.moe_intermediate_size)
        require(self.dense_layers <= model.num_layers, "model.dims.dense_layers", self.dense_layers,
                f"must be <= model.num_layers={model.num_layers}")
        if model.attention == Attention.mla:
            require(self.qk_head_dim > ROPE_DIM, "model.dims.qk_head_dim", self.qk_head_dim,
                    f"MLA needs the query/key head size (> {ROPE_DIM}, e.g. 192 for DeepSeek-V3)")
            require(model.mla_dim > ROPE_DIM, "model.mla_dim", model.mla_dim, f"must be > {ROPE_DIM} for MLA")


@dataclass(frozen=True)
class ModelSpec:
    name: str  # the preset's name, in records and tables
    num_layers: int = bounded(hi=1 << 12)  # decoder layers
    attention: Attention = Attention.gqa  # gqa (K and V per kv head) or mla (one latent row per token)
    kv_heads: int = bounded(8, hi=1 << 12)  # GQA: K/V heads, split over TP (duplicated where TP exceeds them)
    head_dim: int = bounded(128, hi=1 << 14)  # GQA: values per head of K and of V
    mla_dim: int = bounded(576, hi=1 << 16)  # kv_lora_rank 512 + rope 64
    indexer: bool = False  # DeepSeek-V3.2's lightning indexer: fp8 keys and fp32 scales beside the latent
    window: int = bounded(0, hi=1 << 24)  # sliding window in tokens, 0 for none
    local_per_global: int = bounded(0, hi=1 << 12)  # sliding layers per full layer; 0 with window>0: every layer slides
    # hybrid models (kvlab.model.spec.LAYER_*): per layer '*' attention, 'M' recurrent state, '-' no cache, cycled;
    # "": every layer attention
    layer_pattern: str = ""
    state: str = ""  # the recurrent state's family: gdn (Gated DeltaNet) or mamba2; "" without state layers
    state_heads: int = bounded(0, hi=1 << 12)  # GDN linear_num_value_heads; Mamba-2 mamba_num_heads
    state_groups: int = bounded(0, hi=1 << 12)  # what TP splits: GDN linear_num_key_heads; Mamba-2 n_groups
    state_head_dim: int = bounded(0, hi=1 << 14)  # GDN linear_value_head_dim; Mamba-2 mamba_head_dim
    state_dim: int = bounded(0, hi=1 << 14)  # GDN linear_key_head_dim; Mamba-2 ssm_state_size
    # the causal conv's taps (linear_conv_kernel_dim, conv_kernel): K - 1 inputs are kept
    conv_kernel: int = bounded(4, lo=2, hi=64)
    state_dtype: str = "fp32"  # the recurrent state's dtype (the conv state is in the cache's dtype)
    dims: ModelDims = field(default_factory=ModelDims)  # what a layer computes: the prefill's time model needs it
    decode: DecodeModel = field(default_factory=DecodeModel)  # check=decode's model (kvlab.core.decode_spec)
    # prefill=model: the first layers run, the same cut on both sides and in the reference; 0: the whole model
    run_layers: int = 0

    def __post_init__(self):
        if isinstance(self.dims, dict):  # as a preset's YAML spells it
            object.__setattr__(self, "dims", ModelDims(**self.dims))
        if isinstance(self.decode, dict):
            object.__setattr__(self, "decode", DecodeModel(**self.decode))
        require(bool(self.name), "model.name", self.name, "must be a non-empty name")
        positive("model.num_layers", self.num_layers)
        require(isinstance(self.run_layers, int) and 0 <= self.run_layers, "model.run_layers", self.run_layers,
                "must be 0 (the whole model) or a number of leading layers that prefill=model runs")
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
        alphabet = {LAYER_ATTENTION, LAYER_STATE, LAYER_NONE}
        require(isinstance(self.layer_pattern, str) and set(self.layer_pattern) <= alphabet, "model.layer_pattern",
                self.layer_pattern, "one character per layer: '*' attention, 'M' recurrent state, '-' no cache")
        kinds = {self.layer_kind(layer) for layer in range(self.num_layers)}
        require(LAYER_ATTENTION in kinds or LAYER_STATE in kinds, "model.layer_pattern", self.layer_pattern,
                "leaves no layer with a cache")
        if LAYER_STATE in kinds:
            require(self.state in STATE_FAMILIES, "model.state", self.state,
                    f"state layers ('M') need one of {', '.join(STATE_FAMILIES)}")
            for name in ("state_heads", "state_groups", "state_head_dim", "state_dim"):
                positive(f"model.{name}", getattr(self, name))
            require(self.state_heads % self.state_groups == 0, "model.state_heads", self.state_heads,
                    f"must be a multiple of model.state_groups={self.state_groups}")
            require(self.conv_kernel >= 2, "model.conv_kernel", self.conv_kernel, "must be >= 2 taps")
            require(self.state_dtype in DTYPE_BYTES, "model.state_dtype", self.state_dtype,
                    f"use one of {', '.join(DTYPE_BYTES)}")

    def layer_kind(self, layer: int) -> str:
        """LAYER_ATTENTION, LAYER_STATE or LAYER_NONE: what ``layer`` caches."""
        if not self.layer_pattern:
            return LAYER_ATTENTION
        return self.layer_pattern[layer % len(self.layer_pattern)]

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
            if self.layer_kind(layer) == LAYER_ATTENTION:
                by_window.setdefault(self.layer_window(layer), []).append(layer)
        state_layers = tuple(layer for layer in range(self.num_layers) if self.layer_kind(layer) == LAYER_STATE)
        pools = []
        for window, layers in sorted(by_window.items()):
            suffix = f"_w{window}" if window else ""
            for kind in KINDS.values():
                shape = kind.shape(self, dtype)
                if shape is not None and not kind.per_request:
                    pools.append(PoolSpec(f"{kind.name}{suffix}", kind.name, tuple(layers), window, *shape))
        for kind in KINDS.values():
            shape = kind.shape(self, dtype)
            if shape is not None and kind.per_request and state_layers:
                pools.append(PoolSpec(kind.name, kind.name, state_layers, 0, *shape))
        return tuple(pools)

    @classmethod
    def cache_fields(cls) -> tuple[str, ...]:
        """The fields that decide the cache's shape (what two sides must agree on): all but the name and what
        only the prefill's time model and the decode check read."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in ("name", "dims", "decode"))

    @property
    def has_attention(self) -> bool:
        return any(self.layer_kind(layer) == LAYER_ATTENTION for layer in range(self.num_layers))

    @property
    def has_state(self) -> bool:
        return any(self.layer_kind(layer) == LAYER_STATE for layer in range(self.num_layers))

    @property
    def tp_heads(self) -> int:
        """Heads that tensor parallelism splits or duplicates (1 for MLA: the latent is replicated)."""
        return self.kv_heads if self.attention == Attention.gqa else 1

    def bytes_per_token(self, dtype: str = "bf16") -> int:
        """Cache bytes per token over all layers (windowed layers included, as if uncapped; a recurrent state,
        the same for any prompt, left out)."""
        return sum(p.token_bytes() * len(p.layers) for p in self.pools(dtype) if not p.per_request)

    def request_bytes(self, isl: int, dtype: str = "bf16") -> int:
        """Bytes of one request's cache over all layers and heads, windowed layers capped at their window, a
        recurrent state once."""
        return sum(p.token_bytes() * len(p.layers) * (min(isl, p.window) if p.window else p.held_tokens(isl))
                   for p in self.pools(dtype))


def _indexer_shape(m: ModelSpec, dtype: str):
    return (1, (INDEXER_HEAD_DIM, math.ceil(INDEXER_HEAD_DIM / INDEXER_QUANT_BLOCK)), ("fp8", "fp32")) \
        if m.indexer else None


def state_shape(m: ModelSpec, dtype: str):
    """A recurrent state as ``state_groups`` planes of one row each, a plane holding what one TP group keeps:
    the conv state's channels of the group in three parts, ``conv_kernel - 1`` inputs per channel (a channel's
    inputs back to back, as the engines' ``[conv_dim, K - 1]`` keeps them), then the group's recurrent state.

    - GDN (Qwen3-Next, vLLM ``qwen3_next.py``, SGLang ``qwen3_next.py``): the conv runs over q, k and v; a key
      head (``state_groups``) serves ``state_heads / state_groups`` value heads; q and k have ``state_dim``
      channels per key head, v ``state_head_dim`` per value head; the recurrent state is ``[value heads,
      state_dim, state_head_dim]``. Both engines shard q, k and v by heads and the state by value heads over TP:
      a TP rank holds whole key heads with their value heads, i.e. whole groups. SGLang's
      ``_send_mamba_state_slice`` slices dim 3 of ``conv_state [layers, slots, conv_dim / tp, K - 1]`` and of
      ``temporal_state [layers, slots, heads / tp, ...]``, the GDN conv's q, k and v sub-blocks each on its own:
      the three conv parts here.
    - Mamba-2 (Nemotron-H, vLLM ``mamba_mixer2.py``): the conv runs over x (``state_head_dim`` channels per
      head), B and C (``state_dim`` channels per group each); the recurrent state is ``[heads, state_head_dim,
      state_dim]``. vLLM shards x and the state by heads and B, C by groups (where ``n_groups`` divides TP):
      again whole groups per rank.
    """
    if not m.state or not m.has_state:
        return None
    r, k = m.state_heads // m.state_groups, m.conv_kernel - 1
    if m.state == "gdn":
        conv = (m.state_dim, m.state_dim, r * m.state_head_dim)  # q, k, v
    else:
        conv = (r * m.state_head_dim, m.state_dim, m.state_dim)  # x, B, C
    return (m.state_groups, (*(c * k for c in conv), r * m.state_head_dim * m.state_dim),
            (dtype, dtype, dtype, m.state_dtype))


KINDS: dict[str, KindDef] = {  # in the order a model's pools are listed
    "kv": KindDef("kv", False, 1, lambda m, dtype: (m.kv_heads, (m.head_dim, m.head_dim), (dtype, dtype))
                     if m.attention == Attention.gqa and m.has_attention else None),
    "mla": KindDef("mla", True, 2, lambda m, dtype: (1, (m.mla_dim,), (dtype,))
                      if m.attention == Attention.mla and m.has_attention else None),
    "indexer": KindDef("indexer", True, 3, lambda m, dtype: _indexer_shape(m, dtype)
                       if m.has_attention else None),  # fp8 values, then their fp32 scales
    "state": KindDef("state", False, 4, state_shape, per_request=True),  # conv parts, then the recurrent state
}


# ---------------------------------------------------------------- the other config groups
# One frozen dataclass per group: its fields, defaults and checks are the group's only definition;
# kvlab.config.schema derives the Hydra schema from it. Checks that need another group live in
# kvlab.config.schema.Setup.

DISTRIBUTIONS = ("fixed", "uniform", "lognormal")


@dataclass(frozen=True)
class WorkloadSpec:
    isl: int = bounded(4096, hi=1 << 24, unit="tokens")  # prompt tokens when no list or distribution is given
    requests: int = bounded(4, hi=1 << 24)  # requests in the run (a trace's first ones, or drawn)
    concurrency: int = bounded(2, hi=1 << 24)  # requests in flight at once
    distribution: str = "fixed"  # fixed | uniform | lognormal
    isl_list: tuple[int, ...] | None = None  # explicit prompt lengths, cycled
    isl_min: int = bounded(128, hi=1 << 24, unit="tokens")  # prompt lengths drawn within [isl_min, isl_max] (tokens)
    # and the longest a trace's prompt may be (workload.long_prompts)
    isl_max: int = bounded(131072, hi=1 << 24, unit="tokens")
    seed: int = bounded(0, lo=0, hi=2**32 - 1, why="a seed numpy takes")  # of the drawn lengths and arrivals
    arrival: str = "burst"  # burst | poisson | trace (kvlab.core.arrivals)
    rate: float = 1.0  # requests per second with arrival=poisson (kvlab.core.arrivals bounds the run's span)
    # the gaps' gamma shape with arrival=poisson, as vLLM's serving benchmark: 1 a Poisson process, below 1 burstier,
    # above 1 more even (1e6: all but constant gaps of 1/rate); the mean gap stays 1/rate
    burstiness: float = bounded(1.0, lo=arrivals.BURSTINESS.lo, hi=arrivals.BURSTINESS.hi, why=arrivals.BURSTINESS.why)
    trace: str | None = None  # Mooncake .jsonl or Azure .csv, with arrival=trace (kvlab.core.traces)
    time_scale: float = 1.0  # multiplies arrival times: 0.1 replays ten times faster
    long_prompts: str = "clip"  # clip | refuse: trace prompts above isl_max (or cache.capacity_tokens)
    # output tokens per request where no trace gives them (carried, not decoded)
    osl: int | None = bounded(None, hi=1 << 24, unit="tokens")

    def __post_init__(self):
        positive("workload.isl", self.isl)
        positive("workload.requests", self.requests)
        positive("workload.concurrency", self.concurrency)
        require(self.distribution in DISTRIBUTIONS, "workload.distribution", self.distribution,
                "use fixed, uniform or lognormal")
        positive("workload.isl_min", self.isl_min)
        require(self.isl_max >= self.isl_min, "workload.isl_max", self.isl_max,
                f"must be >= workload.isl_min={self.isl_min}")
        if self.isl_list is not None:
            object.__setattr__(self, "isl_list", tuple(self.isl_list))
            require(len(self.isl_list) > 0 and all(isinstance(x, int) and x > 0 for x in self.isl_list),
                    "workload.isl_list", list(self.isl_list), "must be a non-empty list of positive token counts")
        require(self.osl is None or isinstance(self.osl, int) and not isinstance(self.osl, bool) and self.osl >= 0,
                "workload.osl", self.osl, "must be a token count >= 0, or null (unknown)")
        arrivals.check(self)
        if self.arrival == "trace":
            self.timed_trace()  # reads and checks the file: a bad line stops here

    def timed_trace(self, capacity: int = 0) -> list[tuple[float, int]]:
        """(arrival s, prompt tokens) of the trace requests a run serves: capped by ``requests``, prompts
        above isl_max (or a smaller cache ``capacity``) clipped or refused."""
        limit, name = (capacity, "cache.capacity_tokens") if 0 < capacity < self.isl_max else \
            (self.isl_max, "workload.isl_max")
        return arrivals.from_trace(self, limit, name)

    def longest_prompt(self, capacity: int = 0) -> tuple[str, object, int]:
        """(field, value, tokens): the longest prompt the workload can produce, and the field that sets it
        (kvlab.config.workload.prompt_lengths: a list wins, distributions are clipped to isl_max; a trace's
        prompts are clipped to isl_max or the cache's ``capacity``)."""
        if self.arrival == "trace":
            return "workload.trace", self.trace, max(n for _, n in self.timed_trace(capacity))
        if self.isl_list:
            return "workload.isl_list", list(self.isl_list), max(self.isl_list)
        if self.distribution == "fixed":
            return "workload.isl", self.isl, self.isl
        return "workload.isl_max", self.isl_max, self.isl_max


@dataclass(frozen=True)
class CacheSpec:
    fragmentation: float = 0.0  # share of block allocations taken from a shuffled free list
    spare_blocks: int = bounded(8, hi=1 << 16)  # canary blocks per pool beyond what the workload needs
    # tokens each pool of a rank holds; 0: sized to the workload's worst moment
    capacity_tokens: int = bounded(0, hi=1 << 24, unit="tokens")

    def __post_init__(self):
        require(0.0 <= self.fragmentation <= 1.0, "cache.fragmentation", self.fragmentation, "must be in [0, 1]")
        require(isinstance(self.spare_blocks, int) and self.spare_blocks >= 0, "cache.spare_blocks",
                self.spare_blocks, "must be >= 0 (canary blocks per pool)")
        require(isinstance(self.capacity_tokens, int) and self.capacity_tokens >= 0, "cache.capacity_tokens",
                self.capacity_tokens, "must be 0 (sized to the workload) or a positive number of tokens")


# the failure classes of the transfer itself that fault.transfer injects (kvlab.config.faults says what each does)
TRANSFER_FAULTS = ("drop_notice", "stuck", "reused_block", "torn_chunk", "wrong_request")


@dataclass(frozen=True)
class FaultSpec:
    """Faults injected on purpose, to test that failures end cleanly and corruption is caught.

    Chunk indices count the chunks one rank takes part in, in its own order (from 0). Byte
    offsets in ``flip_at`` count everything ``flip_rank`` sends (a ctx rank: flipped after pack,
    before the send) or receives (a gen rank: flipped in the receive buffer, before unpack), its
    messages laid end to end in its chunk order. Ranks are checked against the world in
    kvlab.config.schema.Setup, positions against the run's chunks in kvlab.config.faults.check.
    """

    kill_rank: int = -1  # world rank that dies (exit code 3) just before posting chunk kill_at_chunk
    kill_at_chunk: int = -1  # that rank's own chunk count
    stall_rank: int = -1  # world rank that sleeps stall_s just before posting chunk stall_at_chunk
    stall_at_chunk: int = -1  # that rank's own chunk count
    stall_s: float = bounded(0.0, hi=1e6, unit="s")  # how long it sleeps there
    # world rank that stops itself (SIGSTOP) just before posting chunk freeze_at_chunk: alive, its connections
    # open, silent; nobody sees it die
    freeze_rank: int = -1
    freeze_at_chunk: int = -1  # that rank's own chunk count
    flip_rank: int = -1  # world rank whose messages get bytes inverted (x ^ 0xFF) in flight
    flip_at: tuple[int, ...] = ()  # byte offsets in everything that rank sends or receives, end to end
    unwritten_layer: int = -1  # global layer ctx ranks never write: its chunks carry what the blocks held before
    # tokens every sliding-window segment leaves out, from the first one the next token attends to: the bytes
    # sent all verify, and the decode check (check=decode) must still fail
    window_trim: int = 0
    # check=decode: the gen side's gather of a request's cache swaps the tokens of interleave runs N and N+1
    # (gen.dcp_interleave tokens each, in global order; a DCP group's shards reassembled out of order): the bytes
    # all verify, and the decode must fail; -1: off
    misplaced_run: int = -1
    # a failure of the transfer itself (kvlab.config.faults): drop_notice, wrong_request, stuck, reused_block or
    # torn_chunk, injected through the transport's hooks; '' for none
    transfer: str = ""
    transfer_rank: int = -1  # world rank that injects fault.transfer, on a side where its transport shows it
    transfer_at_chunk: int = -1  # that rank acts at its first chance from this chunk (its own count) on

    def __post_init__(self):
        object.__setattr__(self, "flip_at", tuple(self.flip_at))
        require(isinstance(self.window_trim, int) and self.window_trim >= 0, "fault.window_trim", self.window_trim,
                "must be 0 (off) or a number of tokens")
        require(isinstance(self.misplaced_run, int) and self.misplaced_run >= -1, "fault.misplaced_run",
                self.misplaced_run, "must be -1 (off) or an interleave run of the prompt")
        require(isinstance(self.unwritten_layer, int) and self.unwritten_layer >= -1, "fault.unwritten_layer",
                self.unwritten_layer, "must be -1 (off) or a global layer")
        for name, r in self.ranks.items():
            require(isinstance(r, int) and r >= -1, f"fault.{name}_rank", r, "must be -1 (off) or a world rank")
        require(self.transfer in ("", *TRANSFER_FAULTS), "fault.transfer", self.transfer,
                f"use one of {', '.join(TRANSFER_FAULTS)}, or '' (off)")
        require(bool(self.transfer) == (self.transfer_rank >= 0), "fault.transfer_rank", self.transfer_rank,
                "fault.transfer and fault.transfer_rank go together; set both or neither")
        for name in ("kill", "stall", "freeze", "transfer"):
            on, at = getattr(self, f"{name}_rank") >= 0, getattr(self, f"{name}_at_chunk")
            require(at >= 0 if on else at == -1, f"fault.{name}_at_chunk", at,
                    f"set it to the chunk (>= 0) at which fault.{name}_rank acts" if on
                    else f"takes effect only with fault.{name}_rank >= 0; set both or neither")
        require(self.stall_s >= 0, "fault.stall_s", self.stall_s, "must be >= 0 seconds")
        require(self.stall_rank < 0 or self.stall_s > 0, "fault.stall_s", self.stall_s,
                "a stall needs a duration > 0 seconds")
        flips = list(self.flip_at)
        require(all(isinstance(x, int) and x >= 0 for x in flips), "fault.flip_at", flips,
                "must be byte offsets >= 0 into the flip rank's stream")
        field_, value = ("fault.flip_at", flips) if self.flip_rank >= 0 else ("fault.flip_rank", self.flip_rank)
        require(bool(flips) == (self.flip_rank >= 0), field_, value,
                "fault.flip_rank and fault.flip_at go together; set both or neither")

    @property
    def ranks(self) -> dict[str, int]:
        return {"kill": self.kill_rank, "stall": self.stall_rank, "freeze": self.freeze_rank, "flip": self.flip_rank,
                "transfer": self.transfer_rank}

    @property
    def active(self) -> bool:
        return max(self.ranks.values()) >= 0


WANDB_MODES = ("auto", "online", "offline", "shared", "disabled")


@dataclass(frozen=True)
class WandbSpec:
    mode: str = "auto"  # auto (offline where wandb is installed, else off) | online | offline | shared | disabled
    project: str = "kvlab"  # wandb's project
    group: str | None = None  # wandb's group; null: the experiment's name, or the sweep's

    def __post_init__(self):
        require(self.mode in WANDB_MODES, "logger.wandb.mode", self.mode,
                "use auto, online, offline, shared or disabled")


@dataclass(frozen=True)
class LoggerSpec:
    wandb: WandbSpec = field(default_factory=WandbSpec)
    progress: bool = True  # a progress bar on a terminal (off where the output is not one)
