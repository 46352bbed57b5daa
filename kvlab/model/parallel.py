"""One side's parallelism and the mapping of its ranks to layers, heads and tokens.

Side-local rank ``r = dp_rank * (pp * cp * T) + pp_rank * (cp * T) + cp_rank * T + tp_rank`` with
``T = tp * dcp`` TP ranks per stage, as TensorRT-LLM's ``Mapping`` numbers them (TP innermost, CP across TP
groups, PP outside): context parallelism on the prefill side (``ctx.cp``) adds ranks, ``cp`` TP groups of one
stage each holding its chunks of every request (kvlab.model.tokens). Decode context parallelism (``gen.dcp``,
vLLM's DCP) lives inside TP, as in vLLM, whose DCP group is ``dcp`` consecutive ranks of its TP group: TP rank
``t`` is DCP rank ``t % dcp`` of head group ``t // dcp``, holding that group's heads and the tokens of its
interleave runs. ``gen.tp`` counts the head groups (what heads split over), so the side's TP group has
``tp * dcp`` ranks: vLLM's ``--tensor-parallel-size`` is ``gen.tp * gen.dcp`` with
``--decode-context-parallel-size gen.dcp`` (DCP reuses the ranks that would otherwise hold duplicate heads).
Every attention-DP group holds the whole model and
serves its own requests. Heads split evenly over TP when ``tp <= heads``; when ``tp > heads`` each head is
duplicated on ``tp / heads`` consecutive ranks. PP splits layers evenly (earlier stages take the remainder) or by
an explicit ``layer_split``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvlab.core.bounds import bounded
from kvlab.core.errors import ConfigError, positive, require
from kvlab.model import kv_dtype
from kvlab.model.engine_layouts import ALIASES, LAYOUTS, NAMES, EngineLayout, Layout, layout_of
from kvlab.model.prefix import BLOCK_TOKENS
from kvlab.model.spec import DTYPE_BYTES, ModelSpec
from kvlab.model.tokens import SCHEMES, Tokens

__all__ = ["EngineLayout", "Layout", "RankCoord", "SideSpec"]


def label(side) -> str:
    """A side's parallelism in a title, ``tp2 pp1 dp1`` and its context parallelism where it has one; ``side``: a
    SideSpec or its dict (a summary's)."""
    get = side.get if isinstance(side, dict) else lambda k, d=None: getattr(side, k, d)
    out = f"tp{get('tp')} pp{get('pp')} dp{get('dp')}"
    if (get("cp", 1) or 1) > 1:
        out += f" cp{get('cp')} {get('cp_scheme')}"
    if (get("dcp", 1) or 1) > 1:
        out += f" dcp{get('dcp')} interleave {get('dcp_interleave')}"
    return out


@dataclass(frozen=True)
class RankCoord:
    dp: int
    pp: int
    tp: int
    cp: int = 0  # the prefill side's context-parallel index (the decode side's DCP index is tp % dcp)


# ranks of one DP group (tp x pp x cp x dcp): beyond any engine's model-parallel group, and what keeps a plan (one
# chunk per rank pair, a simulation plans each prompt length) within seconds: a plan's work grows with the ranks
MAX_GROUP = 1 << 10


@dataclass(frozen=True)
class SideSpec:
    name: str  # "ctx" or "gen"
    tp: int = bounded(1, hi=1 << 12)  # tensor-parallel ranks of one replica: heads split over them
    pp: int = bounded(1, hi=1 << 12)  # pipeline stages: layers split over them (layer_split, else as evenly as they go)
    dp: int = bounded(1, hi=1 << 12)  # replicas (attention data parallel): each serves its own requests
    # None: the layout's default (kvlab.model.engine_layouts); for a layout whose block size some cache kind fixes, left
    # None until ``resolved`` for a model (a run's Setup holds it resolved); read it through ``block_tokens``
    tokens_per_block: int | None = bounded(None, hi=1 << 16)
    # a Layout or an EngineLayout name (kvlab.model.engine_layouts); the enum member once built
    layout: str = "block_major"
    dtype: str = "bf16"  # the model's compute dtype, of what the prefill writes
    # layers per pipeline stage, adding up to the model's; null: even
    layer_split: tuple[int, ...] | None = bounded(None, hi=1 << 12)
    # the dtype its K/V (or MLA) rows are kept in (kvlab.model.kv_dtype): bf16, fp16, or fp8 e4m3 with fp32 scales;
    # None: ``dtype``. Where the two sides differ the values are converted in flight
    kv_dtype: str | None = None
    # gen only: tokens of earlier prompts' blocks each gen DP group keeps for prefix reuse (each rank its share), LRU by
    # block hash (kvlab.model.prefix; needs a trace with hash_ids, workload=mooncake); 0: off
    prefix_cache_tokens: int = bounded(0, hi=1 << 24)
    # ctx only: context-parallel ranks, each holding chunks of every request's tokens (kvlab.model.tokens): more
    # ranks, cp TP groups per stage
    cp: int = bounded(1, hi=1 << 12)
    cp_scheme: str = "contiguous"  # contiguous (chunk r on CP rank r) | load_balanced (chunks r and 2cp-1-r of 2cp)
    # gen only: decode context parallelism (vLLM's DCP): tokens dealt round-robin in runs of dcp_interleave over
    # dcp consecutive TP ranks holding the same heads (the TP group has tp * dcp ranks: vLLM's tp = tp * dcp)
    dcp: int = bounded(1, hi=1 << 12)
    # tokens per run (vLLM's dcp_kv_cache_interleave_size); divides tokens_per_block
    dcp_interleave: int = bounded(1, hi=1 << 16)

    def __post_init__(self):
        for f in ("tp", "pp", "dp", "cp", "dcp", "dcp_interleave"):
            positive(f"{self.name}.{f}", getattr(self, f))
        self._check_group()
        self._check_context_parallel()
        try:
            object.__setattr__(self, "layout", layout_of(self.layout))
        except ValueError:
            raise ConfigError(f"{self.name}.layout", self.layout, f"use one of {', '.join(NAMES)} (or vLLM's aliases "
                              f"{', '.join(f'{a}={b}' for a, b in ALIASES.items())})") from None
        if self.tokens_per_block is not None:
            positive(f"{self.name}.tokens_per_block", self.tokens_per_block)
        elif not LAYOUTS[self.layout.value].fixed_tpb:  # the layout's default, whatever the model
            object.__setattr__(self, "tokens_per_block", LAYOUTS[self.layout.value].default_tpb)
        require(self.dtype in DTYPE_BYTES, f"{self.name}.dtype", self.dtype, f"use one of {', '.join(DTYPE_BYTES)}")
        if self.kv_dtype is not None:
            require(self.kv_dtype in kv_dtype.KV_DTYPES, f"{self.name}.kv_dtype", self.kv_dtype,
                    f"use one of {', '.join(kv_dtype.KV_DTYPES)} (fp8: e4m3 with fp32 scales), or leave it unset")
            require(self.dtype in kv_dtype.BASES, f"{self.name}.kv_dtype", self.kv_dtype,
                    f"converts bf16 or fp16 values; {self.name}.dtype={self.dtype} is neither")
        field, tokens = f"{self.name}.prefix_cache_tokens", self.prefix_cache_tokens
        require(isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0, field, tokens,
                "must be a token count >= 0 (0: no prefix cache)")
        if tokens:
            require(self.name == "gen", field, tokens, "the prefill side keeps no prefix cache here; set "
                    "gen.prefix_cache_tokens, or 0")
            require(tokens >= BLOCK_TOKENS, field, tokens, f"holds less than one {BLOCK_TOKENS}-token block of the "
                    f"trace's hash_ids; use 0 (off) or >= {BLOCK_TOKENS}")
        if self.layer_split is not None:
            object.__setattr__(self, "layer_split", tuple(self.layer_split))
            require(len(self.layer_split) == self.pp, f"{self.name}.layer_split", list(self.layer_split),
                    f"needs one layer count per pp stage ({self.pp})")
            require(all(isinstance(n, int) and n > 0 for n in self.layer_split), f"{self.name}.layer_split",
                    list(self.layer_split), "every stage needs at least one layer")

    def _check_group(self) -> None:
        """One DP group's ranks at most ``MAX_GROUP``: a plan, a simulation's table and the budget walk every rank of
        a group, so each field's own bound would let their product ask for 2**48 ranks."""
        group = self.group
        if group <= MAX_GROUP:
            return
        dims = {d: getattr(self, d) for d in self.RANK_DIMS if d != "dp"}
        dim = max(dims, key=lambda d: (dims[d], d == "cp" or d == "dcp"))  # the largest, the token split on ties
        rest = group // dims[dim]
        fits = (f"use {self.name}.{dim} <= {MAX_GROUP // rest}" if rest <= MAX_GROUP
                else f"lower {', '.join(f'{self.name}.{d}' for d in dims)}")
        raise ConfigError(f"{self.name}.{dim}", dims[dim], f"makes one {self.name} DP group {group:,} ranks "
                          f"({' x '.join(f'{d} {v}' for d, v in dims.items())}); kvlab maps groups of at most "
                          f"{MAX_GROUP:,} ranks: {fits}")

    def _check_context_parallel(self) -> None:
        n = self.name
        if self.cp > 1:
            require(n == "ctx", f"{n}.cp", self.cp, "the decode side splits a request's tokens as vLLM's DCP does; "
                    "set gen.dcp (and gen.dcp_interleave) instead, or gen.cp=1")
        require(self.cp_scheme in SCHEMES, f"{n}.cp_scheme", self.cp_scheme, f"use {' or '.join(SCHEMES)}")
        if self.dcp > 1:
            require(n == "gen", f"{n}.dcp", self.dcp, "the prefill side splits a request's tokens in chunks; set "
                    "ctx.cp (and ctx.cp_scheme) instead, or ctx.dcp=1")
            require(not self.prefix_cache_tokens, f"{n}.prefix_cache_tokens", self.prefix_cache_tokens,
                    "prefix reuse keeps whole blocks of undivided ranks; use 0 with gen.dcp > 1")
        else:
            require(self.dcp_interleave == 1, f"{n}.dcp_interleave", self.dcp_interleave,
                    f"interleaves tokens over DCP ranks; set {n}.dcp > 1 too, or leave it 1")

    @property
    def ranks_tp(self) -> int:
        """TP ranks of one stage (and CP rank): ``tp`` head groups of ``dcp`` DCP ranks each."""
        return self.tp * self.dcp

    @property
    def head_tp(self) -> int:
        """Head groups: what heads split over (the DCP ranks of a group hold the same heads)."""
        return self.tp

    def tokens(self, rank: int, model: ModelSpec) -> Tokens:
        """Which of a request's tokens side-local rank ``rank`` holds (kvlab.model.tokens)."""
        c = self.coord(rank)
        if self.cp > 1:
            return Tokens(self.cp_scheme, self.cp, c.cp, align=self.block_tokens(model))
        if self.dcp > 1:
            return Tokens("interleaved", self.dcp, c.tp % self.dcp, self.dcp_interleave)
        return Tokens()

    @property
    def fmt(self) -> str:
        """The format of its converted pools (``PoolSpec.fmt``): "" where the rows hold ``dtype`` itself."""
        return "" if self.kv_dtype in (None, self.dtype) else self.kv_dtype

    # the parallel sizes whose product is the side's ranks: what a refusal of too many ranks may name
    # (kvlab.sizing.budget)
    RANK_DIMS = ("tp", "pp", "dp", "cp", "dcp")

    @property
    def size(self) -> int:
        return math.prod(getattr(self, d) for d in self.RANK_DIMS)

    @property
    def group(self) -> int:
        """Ranks of one DP group (``tp x pp x cp x dcp``); side-local ranks number DP outermost, so rank ``r`` is
        rank ``r % group`` of its group."""
        return self.size // self.dp

    def coord(self, rank: int) -> RankCoord:
        """Its dp, pp and cp index, and ``tp``: its rank in the stage's TP group (of ``tp * dcp`` ranks)."""
        require(0 <= rank < self.size, f"{self.name}.rank", rank, f"must be in [0, {self.size})")
        t = self.ranks_tp
        stage = self.cp * t
        return RankCoord(rank // (self.pp * stage), rank // stage % self.pp, rank % t, rank // t % self.cp)

    def rank(self, dp: int, pp: int, tp: int, cp: int = 0) -> int:
        return (dp * self.pp + pp) * self.cp * self.ranks_tp + cp * self.ranks_tp + tp

    def block_tokens(self, model: ModelSpec) -> int:
        """Tokens per block: as set, else what the layout fixes for this model's pools, else its default."""
        if self.tokens_per_block is not None:
            return self.tokens_per_block
        return LAYOUTS[self.layout.value].block_tokens({p.kind for p in model.pools(self.dtype)})[0]

    def resolved(self, model: ModelSpec) -> SideSpec:
        """This side with its block size made explicit for ``model`` (what a run's Setup holds)."""
        return self if self.tokens_per_block is not None else replace(self, tokens_per_block=self.block_tokens(model))

    def validate_layout(self, model: ModelSpec) -> None:
        """What the layout cannot hold of ``model``, or a block size its engine does not allow, in one line."""
        d = LAYOUTS[self.layout.value]
        field, value = f"{self.name}.layout", self.layout.value
        holders = [n for n, x in LAYOUTS.items() if all(x.holds(p.kind) for p in model.pools(self.dtype))]
        for p in model.pools(self.dtype):
            if d.holds(p.kind):
                continue
            what = ("MLA latent (one 576-value row per token, no per-head K and V)" if p.kind == "mla"
                    else "DeepSeek-V3.2 indexer keys" if p.kind == "indexer" else f"{p.kind} cache")
            raise ConfigError(field, value, f"{d.engine} stores per-head K and V ({d.shape}) and has no place for "
                              f"{model.name}'s {what}; for this model use one of {', '.join(holders)}")
        kinds = {p.kind for p in model.pools(self.dtype)}
        fixed, by = d.block_tokens(kinds)
        n = self.block_tokens(model)
        if by is not None:
            require(n == fixed, f"{self.name}.tokens_per_block", n,
                    f"{d.engine} ({value}) stores {model.name}'s {by} keys in blocks of {fixed} tokens; "
                    f"use {fixed}, or leave it unset")
        require(d.block_rule.allows(n), f"{self.name}.tokens_per_block", n,
                f"{d.engine} ({value}) takes block sizes that are {d.block_rule.text}")

    def validate_for(self, model: ModelSpec) -> None:
        """Check what depends on the model; raises ConfigError naming the field before anything is allocated."""
        self.validate_layout(model)
        n = model.num_layers
        require(self.pp <= n, f"{self.name}.pp", self.pp, f"{model.name} has {n} layers; use pp <= {n}")
        if self.layer_split is not None:
            require(sum(self.layer_split) == n, f"{self.name}.layer_split", list(self.layer_split),
                    f"must add up to the {n} layers of {model.name}")
        if model.has_state:  # the engines split a state by whole groups (kvlab.model.spec.state_shape)
            require(model.state_groups % self.tp == 0, f"{self.name}.tp", self.tp,
                    f"{model.name}'s recurrent state splits by its {model.state_groups} groups over TP, as vLLM "
                    f"and SGLang split it; use a divisor of {model.state_groups}")
            # a recurrent state is the prompt's running summary, not rows per token: a CP rank's chunk has no state
            # of its own to send, and no engine splits one over DCP ranks
            for field, value in ((f"{self.name}.cp", self.cp), (f"{self.name}.dcp", self.dcp)):
                require(value == 1, field, value, f"{model.name} keeps a recurrent state, which kvlab does not split "
                        f"over context-parallel ranks; use {field}=1")
        h, t = model.tp_heads, self.head_tp
        if h > 1 and model.has_attention:
            over = f"{t} DCP groups of {self.dcp} ranks" if self.dcp > 1 else f"{t} ranks"
            require(h % t == 0 or t % h == 0, f"{self.name}.tp", self.tp,
                    f"{model.name}'s {h} kv heads cannot be split or duplicated over {over}; "
                    f"use a divisor or a multiple of {h}")
        if self.dcp > 1:
            n = self.block_tokens(model)
            require(n % self.dcp_interleave == 0, f"{self.name}.dcp_interleave", self.dcp_interleave,
                    f"a run of interleaved tokens must lie in one block, as vLLM requires "
                    f"(tokens_per_block % interleave == 0); use a divisor of {self.name}.tokens_per_block={n}")

    def stage_layers(self, model: ModelSpec, pp_rank: int) -> range:
        """Global layers held by pipeline stage ``pp_rank``."""
        if self.layer_split is not None:
            counts = self.layer_split
        else:
            base, extra = divmod(model.num_layers, self.pp)
            counts = [base + (1 if s < extra else 0) for s in range(self.pp)]
        start = sum(counts[:pp_rank])
        return range(start, start + counts[pp_rank])

    def head_range(self, heads: int, tp_rank: int) -> range:
        """Heads held by ``tp_rank`` out of ``heads`` (one head when duplicated; all when replicated); the ranks
        of one DCP group hold the same heads."""
        if heads == 1:
            return range(1)
        tp, g = self.head_tp, tp_rank // self.dcp
        if tp <= heads:
            per = heads // tp
            return range(g * per, (g + 1) * per)
        h = g // (tp // heads)
        return range(h, h + 1)

    def head_holders(self, heads: int, head: int) -> range:
        """TP ranks that hold ``head`` (several when duplicated or replicated, or a DCP group)."""
        if heads == 1:
            return range(self.ranks_tp)
        tp, d = self.head_tp, self.dcp
        if tp <= heads:
            t = head // (heads // tp)
            return range(t * d, (t + 1) * d)
        dup = tp // heads
        return range(head * dup * d, (head + 1) * dup * d)
