"""Prefix reuse on the decode side: which leading blocks of a prompt a gen DP group already holds.

A trace that names the blocks of its prompts (Mooncake's ``hash_ids``: one id per ``BLOCK_TOKENS``-token
block, equal ids meaning an equal prefix) lets the decode side keep the blocks of earlier prompts and ask
only for what it lacks, as vLLM's and SGLang's decode instances serve a prefix hit. kvlab models that
cache exactly and deterministically, so that both sides of every pair derive the same plan from it:

- **Keys.** Block ``b``'s key chains the ids of blocks ``0..b`` (``chain_keys``), as vLLM chains its block
  hashes: two prompts share block ``b`` only when they share everything up to it.
- **The cache.** One LRU of keys per gen DP group (every rank of the group holds its own share of the same
  blocks), at most ``gen.prefix_cache_tokens // BLOCK_TOKENS`` blocks. ``assign`` walks the requests in
  arrival order: a request's hit is the longest run of its leading *full* blocks whose keys the LRU holds
  (each hit names its ``source``, the request whose own blocks hold it); then its hit keys are touched and
  its other full blocks inserted, each request's blocks last-first, so that the LRU evicts a prompt's tail
  before its head. The partial last block is never cached (another prompt cannot hold those exact tokens
  as a full block).
- **Granularity.** A hit counts in trace blocks (512 tokens); what it saves on a gen pool is the whole
  blocks of that pool (``tokens_per_block`` T, which may differ per pool and from the ctx side's) lying
  inside the hit, and never the prompt's last token (``shared_blocks``: ``min(hit * 512, isl - 1) // T``;
  vLLM and SGLang leave the last token out of a hit too). A pool of blocks larger than the hit saves
  nothing. The ctx side's block size plays no part: the plan's segments start at the first token not
  held, a multiple of T and so of the wire tile, which divides both sides' blocks. Sliding-window pools
  hold only the window's blocks and reuse nothing.
- **Sharing.** A hit gen block ``n`` of pool T lies in trace blocks up to ``b = ((n + 1) * T - 1) // 512``;
  it is block ``n`` of that block's source, whose own (not itself shared) block it is, since the source
  inserted ``b`` and so had no hit reaching it. The gen rank's cache points the request's block table at
  those physical blocks (kvlab.memory.cache.PagedCache, counted references), so reuse is real sharing, and
  verification reads the source's landed bytes as the request's own.
- **Contents.** With prefix reuse on, a token's cache is a hash of its block's chain key instead of the
  request (kvlab.memory.fill), so that equal prefixes have equal bytes on the ctx side too, and the check of a
  request covers its shared blocks: a block shared from the wrong source, or freed and reused while still
  shared, fails it.

Pure and torch-free: the plan, the fill, the cache and the figures read it.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

BLOCK_TOKENS = 512  # the Mooncake trace's block of hash_ids
_MASK = (1 << 62) - 1


def chain_keys(hash_ids) -> tuple[int, ...]:
    """Each block's key: a hash of its own id and every earlier one (fits an int64 with room to mix)."""
    out, k = [], 0x2545F4914F6CDD1D
    for h in hash_ids:
        k = ((k ^ (int(h) + 0x9E3779B97F4A7C15 + (k << 6) + (k >> 2))) * 0xBF58476D1CE4E5B9) & _MASK
        out.append(k)
    return tuple(out)


@dataclass(frozen=True)
class Prefix:
    """One request's blocks as the gen DP group's prefix cache saw them at its arrival."""

    keys: tuple[int, ...]  # chain key of every trace block of the prompt (the last may be partial)
    hit: int  # leading full blocks the cache held
    sources: tuple[int, ...]  # per hit block: the request whose own blocks hold it
    full: int  # full blocks of the prompt: the ones looked up

    def shared_blocks(self, isl: int, tokens_per_block: int) -> int:
        """Leading blocks of a gen pool of ``tokens_per_block`` that the hit covers (never the last token)."""
        return min(self.hit * BLOCK_TOKENS, isl - 1) // tokens_per_block

    def shared_tokens(self, isl: int, tokens_per_block: int) -> int:
        return self.shared_blocks(isl, tokens_per_block) * tokens_per_block

    def source(self, n: int, tokens_per_block: int) -> int:
        """The request whose own block ``n`` (of a pool of ``tokens_per_block``) this request shares."""
        return self.sources[((n + 1) * tokens_per_block - 1) // BLOCK_TOKENS]


def assign(requests, capacity_tokens: int, groups: int) -> dict[int, Prefix]:
    """``requests``: (id, prompt tokens, hash_ids, gen DP group) in arrival order; each one's Prefix."""
    cap = capacity_tokens // BLOCK_TOKENS
    lru: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(groups)]
    out = {}
    for rid, isl, hash_ids, group in requests:
        cache = lru[group]
        keys = chain_keys(hash_ids)
        full = min(isl // BLOCK_TOKENS, len(keys))
        hit = 0
        while hit < full and keys[hit] in cache:
            hit += 1
        out[rid] = Prefix(keys, hit, tuple(cache[keys[b]] for b in range(hit)), full)
        for b in reversed(range(full)):  # last-first: the head ends most recent, the tail is evicted first
            if b >= hit:
                cache[keys[b]] = rid  # (a later block still held past an evicted one is this request's now)
            cache.move_to_end(keys[b])
        while len(cache) > cap:
            cache.popitem(last=False)
    return out


def users(prefixes: dict[int, Prefix], isl: dict[int, int], pools) -> dict[tuple[int, str, int], list[int]]:
    """(source request, pool name, block n) -> the requests sharing that block, for ``pools``: (name, tokens per
    block, reuses) of one gen rank."""
    out: dict[tuple[int, str, int], list[int]] = {}
    for rid, p in prefixes.items():
        for name, tpb, reuses in pools:
            if not reuses:
                continue
            for n in range(p.shared_blocks(isl[rid], tpb)):
                out.setdefault((p.source(n, tpb), name, n), []).append(rid)
    return out
