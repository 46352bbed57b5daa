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
    dims: ModelDims = field(default_factory=ModelDims)  # what a layer computes: the prefill's time model needs it
    decode: DecodeModel = field(default_factory=DecodeModel)  # check=decode's model (kvlab.core.decode_spec)

    def __post_init__(self):
        if isinstance(self.dims, dict):  # as a preset's YAML spells it
            object.__setattr__(self, "dims", ModelDims(**self.dims))
        if isinstance(self.decode, dict):
            object.__setattr__(self, "decode", DecodeModel(**self.decode))
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
            for kind in KINDS.values():
                shape = kind.shape(self, dtype)
                if shape is not None:
                    pools.append(PoolSpec(f"{kind.name}{suffix}", kind.name, tuple(layers), window, *shape))
        return tuple(pools)

    @classmethod
    def cache_fields(cls) -> tuple[str, ...]:
        """The fields that decide the cache's shape (what two sides must agree on): all but the name and what
        only the prefill's time model and the decode check read."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in ("name", "dims", "decode"))

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


def _indexer_shape(m: ModelSpec, dtype: str):
    return (1, (INDEXER_HEAD_DIM, math.ceil(INDEXER_HEAD_DIM / INDEXER_QUANT_BLOCK)), ("fp8", "fp32")) \
        if m.indexer else None


KINDS: dict[str, KindDef] = {  # in the order a model's pools are listed
    "kv": KindDef("kv", False, 1, lambda m, dtype: (m.kv_heads, (m.head_dim, m.head_dim), (dtype, dtype))
                     if m.attention == Attention.gqa else None),
    "mla": KindDef("mla", True, 2, lambda m, dtype: (1, (m.mla_dim,), (dtype,))
                      if m.attention == Attention.mla else None),
    "indexer": KindDef("indexer", True, 3, _indexer_shape),  # fp8 values, then their fp32 scales
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
    # a failure of the transfer itself (kvlab.config.faults): drop_notice, wrong_request, stuck, reused_block or
    # torn_chunk, injected through the transport's hooks; '' for none
    transfer: str = ""
    transfer_rank: int = -1  # world rank that injects fault.transfer, on a side where its transport shows it
    transfer_at_chunk: int = -1  # that rank acts at its first chance from this chunk (its own count) on

    def __post_init__(self):
        object.__setattr__(self, "flip_at", tuple(self.flip_at))
        require(isinstance(self.window_trim, int) and self.window_trim >= 0, "fault.window_trim", self.window_trim,
                "must be 0 (off) or a number of tokens")
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


WANDB_MODES = ("online", "offline", "shared", "disabled")


@dataclass(frozen=True)
class WandbSpec:
    mode: str = "offline"  # online | offline | shared | disabled
    project: str = "kvlab"  # wandb's project
    group: str | None = None  # wandb's group; null: the experiment's name, or the sweep's

    def __post_init__(self):
        require(self.mode in WANDB_MODES, "logger.wandb.mode", self.mode, "use online, offline, shared or disabled")


@dataclass(frozen=True)
class LoggerSpec:
    wandb: WandbSpec = field(default_factory=WandbSpec)
    progress: bool = True  # a progress bar on a terminal (off where the output is not one)
