"""The ``check`` group and each model preset's decode model: what ``check=decode`` runs.

``check=bytes`` (the default) verifies every byte the gen side received against the hash fill
(kvlab.memory.fill). ``check=decode`` replaces the hash with a real model's cache: each preset names a
transformers family and a tiny config of the same cache shape (``model.decode``: the same
attention kind and kv-head/q-head ratio, the MLA latent and RoPE widths and the indexer's, the
window pattern with a smaller window), weights drawn from ``check.seed``; the ctx ranks' prefill
writes that model's cache, and the gen side decodes ``check.tokens`` greedy tokens from what it
received and compares them with a reference run that never left one process (kvlab.rank.decode_check).

The run's model spec becomes the decode model's (``tiny``): its pools are what moves, so the plan,
the schedule and every check of the other groups see the cache the model really has.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from kvlab.core.bounds import bounded
from kvlab.core.errors import ConfigError, install_hint, positive, require
from kvlab.core.paths import NO_ROOM, room_fix, unwritable

CHECKS = ("bytes", "decode")
CACHE_ENV = "KVLAB_DECODE_CACHE"  # where references are kept; ~/.cache/kvlab/decode by default
FAMILIES = ("llama", "qwen3_moe", "deepseek_v3", "deepseek_v32", "gpt_oss", "gemma3", "qwen3_next", "nemotron_h")
# hybrid families and the recurrent state each keeps (kvlab.model.spec.state_shape)
STATE_OF = {"qwen3_next": "gdn", "nemotron_h": "mamba2"}
MLA_FAMILIES = ("deepseek_v3", "deepseek_v32")
ROPE_DIM = 64  # the RoPE part of the MLA row (kvlab.model.spec.ROPE_DIM): the latent is the rest
TINY_SUFFIX = "-tiny"
MODEL_SUFFIX = "-model"  # prefill=model's spec: the preset's own widths (``wide``)


@dataclass(frozen=True)
class DecodeModel:
    """A preset's model for ``check=decode``: a transformers family and a tiny config of its cache's shape.
    A cache field left unset (None) is the preset's own; the rest is what a layer computes, kept small so
    that a CPU prefills and decodes it in a moment."""

    family: str = ""  # one of FAMILIES; "" for a preset without a decode model
    # null: the preset's (a cache field: what moves keeps the preset's shape)
    num_layers: int | None = bounded(None, hi=256)
    kv_heads: int | None = bounded(None, hi=256)  # null: the preset's
    head_dim: int | None = bounded(None, hi=1024)  # null: the preset's
    window: int | None = bounded(None, hi=1 << 16)  # the sliding window, scaled down with the prompts a CPU can prefill
    layer_pattern: str | None = None  # hybrids: null for the preset's (kvlab.model.spec LAYER_*)
    state_heads: int | None = bounded(None, hi=1024)  # hybrids: the recurrent state's heads, null for the preset's
    state_groups: int | None = bounded(None, hi=1024)  # hybrids: its TP groups (>= 2: TP 2 splits it), or null
    state_head_dim: int | None = bounded(None, hi=1024)  # hybrids: values per state head, or null for the preset's
    state_dim: int | None = bounded(None, hi=1024)  # hybrids: GDN key head dim, Mamba-2 d_state, or null
    hidden_size: int = bounded(64, hi=4096)  # the decode model's width (what a layer computes, kept small)
    q_heads: int = bounded(4, hi=256)  # a multiple of kv_heads (GQA): the preset's ratio where it fits
    intermediate_size: int = bounded(128, hi=16384)  # its dense MLP width
    vocab_size: int = bounded(128, hi=1 << 17)  # its vocabulary: the prompts' token ids and the logits compared
    experts: int = bounded(0, hi=256)  # routed experts; 0: dense MLPs
    experts_per_token: int = bounded(2, hi=256)  # routed experts each token uses
    moe_intermediate_size: int = bounded(32, hi=16384)  # an expert's MLP width
    q_lora_rank: int = bounded(32, hi=4096)  # MLA
    qk_nope_head_dim: int = bounded(16, hi=1024)  # MLA: the query/key part without RoPE, per head
    v_head_dim: int = bounded(16, hi=1024)  # MLA: values per head
    indexer_heads: int = bounded(4, hi=256)  # DeepSeek-V3.2's lightning indexer
    indexer_topk: int = bounded(16, hi=1 << 16)  # fewer than a prompt's tokens, so that the indexer's choice matters

    def __post_init__(self):
        require(self.family in ("", *FAMILIES), "model.decode.family", self.family,
                f"use one of {', '.join(FAMILIES)}")
        for name in ("num_layers", "kv_heads", "head_dim", "state_heads", "state_groups", "state_head_dim",
                     "state_dim"):
            v = getattr(self, name)
            require(v is None or isinstance(v, int) and v > 0, f"model.decode.{name}", v,
                    "must be a positive integer, or null for the preset's own")
        require(self.window is None or isinstance(self.window, int) and self.window >= 0, "model.decode.window",
                self.window, "must be 0 (full attention), a positive number of tokens, or null for the preset's")
        for name in ("hidden_size", "q_heads", "intermediate_size", "vocab_size", "experts_per_token",
                     "moe_intermediate_size", "q_lora_rank", "qk_nope_head_dim", "v_head_dim", "indexer_heads",
                     "indexer_topk"):
            positive(f"model.decode.{name}", getattr(self, name))
        require(isinstance(self.experts, int) and self.experts >= 0, "model.decode.experts", self.experts,
                "must be 0 (dense) or a number of routed experts")
        require(self.experts == 0 or self.experts_per_token <= self.experts, "model.decode.experts_per_token",
                self.experts_per_token, f"must be <= model.decode.experts={self.experts}")


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvlab" / "decode")


def check_cache_dir() -> None:
    """ConfigError naming the decode check's reference cache unless a file can be written there: checked where
    it is acquired, in the parent before any rank starts (a rank found out only after its prefill)."""
    where = cache_dir()
    name = CACHE_ENV if os.environ.get(CACHE_ENV) else f"{CACHE_ENV} (unset: ~/.cache/kvlab/decode)"
    why = unwritable(where)
    if why:
        raise ConfigError(name, str(where), f"cannot hold check=decode's reference caches ({why}); "
                          f"{room_fix(CACHE_ENV) if why in NO_ROOM else f'point {CACHE_ENV} at a writable directory'}")


def tiny(model, suffix: str = TINY_SUFFIX):
    """The ModelSpec of ``model``'s decode model: the cache fields its ``decode`` node sets, the name marked.
    Idempotent: a spec already tiny comes back as it is (a recorded config builds the same Setup again)."""
    d = model.decode
    if model.name.endswith((TINY_SUFFIX, MODEL_SUFFIX)):
        return model
    if not d.family:
        raise ConfigError("check", "decode", f"model {model.name} names no decode model (model.decode.family); "
                          "use a preset that does, e.g. model=tiny_gqa, or check=bytes")
    mla = model.attention.value == "mla" if hasattr(model.attention, "value") else model.attention == "mla"
    require(mla == (d.family in MLA_FAMILIES), "model.decode.family", d.family,
            f"model {model.name} has {'MLA' if mla else 'GQA'} attention; use a family with the same "
            f"({', '.join(MLA_FAMILIES) if mla else 'llama, qwen3_moe, gpt_oss, gemma3'})")
    require(model.indexer == (d.family == "deepseek_v32"), "model.decode.family", d.family,
            "the DeepSeek-V3.2 indexer cache needs family deepseek_v32, and that family needs model.indexer=true")
    require(model.has_state == (d.family in STATE_OF) and STATE_OF.get(d.family, "") == model.state,
            "model.decode.family", d.family,
            f"model {model.name} " + (f"keeps a {model.state} recurrent state; use "
                                      f"{', '.join(f for f, s in STATE_OF.items() if s == model.state)}"
                                      if model.has_state else "has no recurrent state; use a family without one"))
    set_ = {k: getattr(d, k) for k in ("num_layers", "kv_heads", "head_dim", "window", "layer_pattern", "state_heads",
                                       "state_groups", "state_head_dim", "state_dim") if getattr(d, k) is not None}
    dims = dataclasses.replace(model.dims, hidden_size=d.hidden_size, q_heads=d.q_heads,
                               intermediate_size=d.intermediate_size,
                               experts_active=d.experts_per_token if d.experts else 0,
                               moe_intermediate_size=d.moe_intermediate_size if d.experts else 0,
                               dense_layers=min(model.dims.dense_layers, 1) if d.experts else 0,
                               qk_head_dim=d.qk_nope_head_dim + ROPE_DIM if mla else 0,
                               v_head_dim=d.v_head_dim if mla else 0, q_lora_rank=d.q_lora_rank if mla else 0,
                               attention_topk=d.indexer_topk if model.indexer else 0,
                               indexer_heads=d.indexer_heads if model.indexer else 0)
    out = dataclasses.replace(model, name=model.name + suffix, dims=dims, **set_)
    require(d.hidden_size % d.q_heads == 0, "model.decode.hidden_size", d.hidden_size,
            f"must be a multiple of model.decode.q_heads={d.q_heads}")
    if not mla:
        require(d.q_heads % out.kv_heads == 0, "model.decode.q_heads", d.q_heads,
                f"must be a multiple of the kv heads ({out.kv_heads})")
    else:
        require(out.mla_dim > ROPE_DIM, "model.mla_dim", out.mla_dim,
                f"the MLA row is the latent then {ROPE_DIM} RoPE elements; use > {ROPE_DIM}")
    return out


def wide(model):
    """The ModelSpec of ``prefill=model``: the preset's decode family at the preset's own width (``model.dims``:
    hidden size, query heads, MLP and expert widths, MLA ranks and head dims, indexer heads and top-k) and its
    own cache shape (kv heads, head dim, window, recurrent state), cut to ``model.run_layers`` leading layers
    where set. What ``model.dims`` does not say stays the decode model's: the vocabulary (the prompts' ids and
    the logits compared) and the number of routed experts. Idempotent, as ``tiny``."""
    if model.name.endswith((TINY_SUFFIX, MODEL_SUFFIX)):
        return model
    d, dims = model.decode, model.dims
    mla = model.attention.value == "mla" if hasattr(model.attention, "value") else model.attention == "mla"
    require(dims.hidden_size > 0 and dims.q_heads > 0, "model.dims.hidden_size", dims.hidden_size,
            f"prefill=model runs model {model.name} at its width: set model.dims.hidden_size and q_heads")
    require(model.run_layers <= model.num_layers, "model.run_layers", model.run_layers,
            f"model {model.name} has {model.num_layers} layers; use 0 (all) or fewer")
    widths = dict(hidden_size=dims.hidden_size, q_heads=dims.q_heads,
                  intermediate_size=dims.intermediate_size or d.intermediate_size,
                  moe_intermediate_size=dims.moe_intermediate_size or d.moe_intermediate_size,
                  q_lora_rank=dims.q_lora_rank or d.q_lora_rank, indexer_heads=dims.indexer_heads or d.indexer_heads,
                  indexer_topk=dims.attention_topk or d.indexer_topk)
    if mla:
        widths |= dict(qk_nope_head_dim=max(1, (dims.qk_head_dim or ROPE_DIM + d.qk_nope_head_dim) - ROPE_DIM),
                       v_head_dim=dims.v_head_dim or dims.qk_head_dim or d.v_head_dim)
    at_width = DecodeModel(family=d.family, num_layers=model.run_layers or None, vocab_size=d.vocab_size,
                           experts=d.experts, experts_per_token=d.experts_per_token, **widths)
    return tiny(dataclasses.replace(model, decode=at_width), MODEL_SUFFIX)


@dataclass(frozen=True)
class CheckSpec:
    """What the gen side checks after a request lands (the ``check`` group)."""

    kind: str = "bytes"  # bytes | decode
    # greedy tokens decoded from the moved cache (check=decode): each is one decode step on the CPU, twice
    # (the reference and the moved cache), within the run's timeouts
    tokens: int = bounded(8, lo=1, hi=1024, why="each is a decode step of the reference and of the check")
    # the decode model's weights and prompts
    seed: int = bounded(0, lo=0, hi=2**32 - 1, why="a seed torch and numpy take")
    # largest |logit difference| against the reference that still passes; 0 on CPU, where the same
    # operations on the same bytes give the same bits
    tolerance: float = 0.0

    def __post_init__(self):
        require(self.kind in CHECKS, "check.kind", self.kind, "use check=bytes or check=decode")
        require(isinstance(self.tokens, int) and not isinstance(self.tokens, bool) and self.tokens > 0,
                "check.tokens", self.tokens, "must be a positive number of tokens to decode")
        require(isinstance(self.seed, int) and self.seed >= 0, "check.seed", self.seed, "must be an integer >= 0")
        require(self.tolerance >= 0, "check.tolerance", self.tolerance,
                "must be >= 0 (the largest |logit difference| that passes)")

    @property
    def decode(self) -> bool:
        return self.kind == "decode"

    def model_for(self, model, prefill: str = "sim"):
        """The model spec a run with this check (and this prefill kind) moves the cache of: prefill=model's at
        the preset's width, check=decode's tiny one, else the preset."""
        if prefill == "model":
            return wide(model)
        return tiny(model) if self.decode else model

    def validate(self, setup) -> None:
        """What spans groups: the model runs in the cache's dtype, on the CPU."""
        if not self.decode:
            require(setup.prefill.kind != "model", "prefill", setup.prefill.kind,
                    "prefill=model writes the model's own cache, which the gen side checks against the reference: "
                    "use it with check=decode")
            require(setup.fault.misplaced_run < 0, "fault.misplaced_run", setup.fault.misplaced_run,
                    "misplaces tokens in the decode check's gather; use it with check=decode")
            return
        require(setup.ctx.dtype == "bf16", "ctx.dtype", setup.ctx.dtype,
                "check=decode runs the model in the cache's dtype; use bf16")
        require(setup.prefill.kind in ("sim", "model"), "prefill", setup.prefill.kind,
                "check=decode writes the decode model's own cache; use prefill=sim, or prefill=model to time the "
                "model's own forward")
        if setup.fault.window_trim:
            windows = [p.window for p in setup.model.pools(setup.ctx.dtype) if p.window]
            require(bool(windows), "fault.window_trim", setup.fault.window_trim,
                    f"model {setup.model.name} has no sliding-window layer to trim")
        run = setup.fault.misplaced_run
        if run >= 0:
            n = setup.gen.dcp_interleave
            shortest = min(setup.workload.isl_list or (setup.workload.isl,))
            require((run + 2) * n <= shortest, "fault.misplaced_run", run,
                    f"runs {run} and {run + 1} of {n} tokens must lie in every prompt ({shortest} tokens); use < "
                    f"{shortest // n - 1}")
        import importlib.util

        if importlib.util.find_spec("transformers") is None:
            raise ConfigError("check", "decode", install_hint("decode", "transformers, which the decode check needs,"))
        check_cache_dir()


def check_line(rows) -> str | None:
    """One line on the decode check and the byte check side by side, from the merged rows
    (kvlab.results.records.RequestRow);
    None for a run without check=decode."""
    decoded = [r for r in rows if getattr(r, "decode_tokens", None) is not None]
    if not decoded:
        return None
    good = [r for r in decoded if r.decode_first_divergent is None and r.decode_tokens_equal == r.decode_tokens]
    bad = [r for r in decoded if r not in good]
    bytes_ok = [r for r in decoded if not r.byte_check_failures]
    diff = max(r.decode_max_logit_diff for r in decoded)
    if bad and all(r.verified for r in bad):  # diverged and still verified: a lossy KV dtype's cost, not a failure
        return (f"check=decode: a lossy KV dtype's cost (reported, not failed): "
                f"{sum(r.decode_tokens_equal for r in decoded)}/{sum(r.decode_tokens for r in decoded)} tokens equal, "
                f"max |logit difference| {diff:.4g}, {len(good)}/{len(rows)} requests decode as the reference; "
                f"value check passed on {len(bytes_ok)}/{len(decoded)}")
    out = (f"check=decode: {len(good)}/{len(rows)} requests decode as the reference"
           + (" (" + ", ".join(f"request {r.request} from step {r.decode_first_divergent}" for r in bad[:4])
              + (" ..." if len(bad) > 4 else "") + ")" if bad else "")
           + f"; {sum(r.decode_tokens_equal for r in decoded)}/{sum(r.decode_tokens for r in decoded)} tokens equal, "
           f"max |logit difference| {diff:.4g}; byte check passed on {len(bytes_ok)}/{len(decoded)}")
    hidden = [r.request for r in bad if not r.byte_check_failures]
    if hidden:
        out += f" (requests {hidden}: every byte sent verified, and decoding still diverged)"
    first = next((r.error for r in bad if getattr(r, "error", None)), None)
    if first:  # the diagnosis (step, layers, components) is in results.jsonl for every request; the first here
        out += f"\ncheck=decode, first diagnosis: {first}"
    return out
