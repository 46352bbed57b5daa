"""Paged cache of one rank: a storage tensor per pool, a block allocator, block tables.

Each pool is one uint8 tensor of ``num_blocks`` blocks laid out by ``RankPool.strides``.
The allocator hands out block ids; with ``fragmentation > 0`` that share of allocations
draws from a shuffled free list, so block ids of a request are not consecutive and the
transfer must follow the block table. A few *canary* blocks at both ends of each pool
are never handed out: they hold a known pattern that must survive every transfer.
Sliding-window pools hold only the blocks that overlap the window.

With prefix reuse (a gen rank's ``share``, kvlab.model.prefix) a request's leading blocks may be another
request's: its block table points at the source's physical blocks, and each such block counts its
references, the source and every planned sharer, so that it is freed only when the last of them is
released, whatever order they finish in. The references are planned (the same pure LRU both sides
derive the plan from), not taken at run time: a block is never freed while a later sharer still
needs it, and never kept past the last one.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

import torch

from kvlab.memory.fill import expected, key_of, locate, mix
from kvlab.model.layout import Rect, as_stored
from kvlab.model.plan import Request, Segment
from kvlab.model.prefix import users
from kvlab.model.schedule import cut_rect
from kvlab.model.state import CacheState, RankPool

VERIFY_PIECE_BYTES = 8 << 20  # fill and verify in pieces through two scratch buffers of this size
# on a GPU a piece's cost is its kernel launches, not its bytes: 8 MiB pieces checked 3 GB at 1.8 GB/s on an
# H200, which stalled a gen rank whose cache needed a verified request's blocks back (kvlab.rank.executor)
VERIFY_PIECE_BYTES_GPU = 128 << 20


def verify_piece_bytes(device) -> int:
    return VERIFY_PIECE_BYTES_GPU if torch.device(device).type == "cuda" else VERIFY_PIECE_BYTES
CANARY_PIECE_WORDS = 1 << 14  # canary words hashed per step: the int64 temporaries stay in L1/L2


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal`` of two uint8 tensors of one shape, compared as 8-byte words where their strides and
    addresses allow: equal's byte loop runs at about a seventh of the word loop's speed."""
    for size, dtype in ((8, torch.int64), (4, torch.int32)):
        if all(t.shape[-1] % size == 0 and t.stride(-1) == 1 and t.data_ptr() % size == 0
               and all(st % size == 0 for st in t.stride()[:-1]) for t in (a, b)):
            return torch.equal(a.view(dtype), b.view(dtype))
    k = a.numel() // 8 * 8
    if a.dim() == 1 and 0 < k < a.numel():  # a 1-D buffer of any length: the word prefix, then the tail
        return same_bytes(a[:k], b[:k]) and torch.equal(a[k:], b[k:])
    return torch.equal(a, b)


class BlockAllocator:
    def __init__(self, num_blocks: int, reserved: set[int], fragmentation: float, seed: int):
        self.num_blocks = num_blocks
        self.free = sorted(set(range(num_blocks)) - reserved)
        self.fragmentation = fragmentation
        self.rng = random.Random(seed)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise MemoryError(f"cache full: {n} blocks wanted, {len(self.free)} free")
        if self.fragmentation and self.rng.random() < self.fragmentation:
            taken = self.rng.sample(self.free, n)
        else:
            taken = self.free[:n]
        gone = set(taken)
        self.free = [b for b in self.free if b not in gone]
        return taken

    def release(self, blocks: list[int]) -> None:
        self.free = sorted(self.free + blocks)


@dataclass
class PoolStore:
    pool: RankPool
    num_blocks: int
    storage: torch.Tensor  # uint8 [num_blocks * block bytes]
    allocator: BlockAllocator
    canaries: list[int]


@dataclass(frozen=True)
class BlockTable:
    ids: torch.Tensor  # physical block of each logical block, on the cache's device
    base: int  # logical index of ids[0]
    host: tuple[int, ...]


def blocks_for(pool: RankPool, isl: int) -> int:
    return math.ceil(pool.held_stop(isl) / pool.tokens_per_block) - pool.held_start(isl) // pool.tokens_per_block


class PagedCache:
    def __init__(self, state: CacheState, blocks_needed: dict[str, int], spare_blocks: int, fragmentation: float,
                 seed: int, device: torch.device, storage_of=None):
        """``blocks_needed[pool]``: blocks the requests in flight at the worst moment hold together;
        ``storage_of(pool name, bytes)``: where a pool lives (a transport's choice), zeroed device memory by default."""
        self.state, self.device = state, device
        self.tick = lambda: None  # called per fill/verify piece: long requests still show progress
        self.contents = expected  # a rectangle's bytes in wire order: the hash fill, or a model's (check=decode)
        self.after_verify = None  # called with (request, ops, errors) after its byte check, before its release
        self.pools: dict[str, PoolStore] = {}
        self.tables: dict[int, dict[str, BlockTable]] = {}
        # prefix reuse (``share``): (source request, pool, block n) -> its requests sharing it; the physical block of
        # each such block once its source allocated it; references left per (pool, physical block)
        self.sharers: dict[tuple[int, str, int], list[int]] = {}
        self.kept: dict[tuple[int, str, int], int] = {}
        self.kept_as: dict[tuple[str, int], tuple[int, str, int]] = {}  # the other way round
        self.refs: dict[tuple[str, int], int] = {}
        # fill's and verification's two scratch pieces (expected and packed bytes), allocated with the pools,
        # before the transfer's baseline: they are the emulated prefill's and decode's memory, not the transfer's
        self._scratch = torch.empty(2, verify_piece_bytes(device), dtype=torch.uint8, device=device)
        for i, pool in enumerate(state.pools()):
            n = blocks_needed.get(pool.name, 0) + spare_blocks
            # canaries at both ends of the pool: stray writes past a request's first or last block land
            # there, and the blocks between stay consecutive for zero-copy
            canaries = sorted(set(range(spare_blocks // 2)) | set(range(n - (spare_blocks - spare_blocks // 2), n)))
            storage = (storage_of(pool.name, pool.pool_bytes(n)) if storage_of is not None
                       else torch.zeros(pool.pool_bytes(n), dtype=torch.uint8, device=device))
            alloc = BlockAllocator(n, set(canaries), fragmentation, seed * 7919 + state.rank * 31 + i)
            self.pools[pool.name] = PoolStore(pool, n, storage, alloc, canaries)
        for store in self.pools.values():
            for b in store.canaries:
                for view, want in zip(self._block_view(store, b), self._canary(store, b)):
                    view.copy_(want)

    @property
    def nbytes(self) -> int:
        return sum(s.storage.numel() for s in self.pools.values())

    # -- blocks ---------------------------------------------------------------------------
    def share(self, requests: list[Request]) -> None:
        """A gen rank's prefix reuse: plan which of its blocks each request shares with which earlier one."""
        pools = [(name, s.pool.tokens_per_block, s.pool.spec.shares_prefix) for name, s in self.pools.items()]
        self.sharers = users({r.id: r.prefix for r in requests if r.prefix is not None},
                             {r.id: r.isl for r in requests}, pools)

    def shared(self, req: Request) -> dict[str, list[tuple[int, int]]]:
        """Per pool, (source request, block n) of each leading block ``req`` shares (none without prefix reuse)."""
        if req.prefix is None or not self.sharers:
            return {}
        out = {}
        for name, store in self.pools.items():
            tpb = store.pool.tokens_per_block
            if store.pool.spec.shares_prefix:
                out[name] = [(req.prefix.source(n, tpb), n) for n in range(req.prefix.shared_blocks(req.isl, tpb))]
        return out

    def sources(self, req: Request) -> set[int]:
        """The earlier requests whose blocks ``req`` shares here."""
        return {src for pairs in self.shared(req).values() for src, _ in pairs}

    def missing(self, req: Request) -> set[int]:
        """The sources of ``req`` not allocated here yet (their blocks must exist before ``req`` points at them)."""
        return {src for name, pairs in self.shared(req).items() for src, n in pairs if (src, name, n) not in self.kept}

    def allocate(self, req: Request) -> dict[str, BlockTable]:
        tables, shared = {}, self.shared(req)
        for name, store in self.pools.items():
            reused = [self.kept[(src, name, n)] for src, n in shared.get(name, ())]  # KeyError: a source not here
            try:
                ids = reused + store.allocator.allocate(blocks_for(store.pool, req.isl) - len(reused))
            except MemoryError:  # all pools or none: a request waiting for blocks must not hold some
                for done, table in tables.items():
                    self._free(done, table.host)
                raise
            for n in range(len(reused), len(ids)):  # its own blocks that later requests will share
                users_n = self.sharers.get((req.id, name, n))
                if users_n:
                    self.kept[(req.id, name, n)] = ids[n]
                    self.kept_as[(name, ids[n])] = (req.id, name, n)
                    self.refs[(name, ids[n])] = 1 + len(users_n)
            base = store.pool.held_start(req.isl) // store.pool.tokens_per_block
            tables[name] = BlockTable(torch.tensor(ids, dtype=torch.int64, device=self.device), base, tuple(ids))
        self.tables[req.id] = tables
        return tables

    def _free(self, name: str, blocks) -> None:
        """Give back one holder's blocks: a shared block only once its last reference goes."""
        free = []
        for b in blocks:
            left = self.refs.get((name, b))
            if left is None:
                free.append(b)
            elif left > 1:
                self.refs[(name, b)] = left - 1
            else:
                del self.refs[(name, b)]
                del self.kept[self.kept_as.pop((name, b))]
                free.append(b)
        self.pools[name].allocator.release(free)

    def release(self, req_id: int) -> None:
        for name, table in self.tables.pop(req_id).items():
            self._free(name, table.host)

    # -- contents -------------------------------------------------------------------------
    def _pieces(self, rect: Rect, pool: RankPool) -> list[Rect]:
        rect = as_stored(rect)  # the pool's own rows (a segment's wire may carry another KV dtype)
        seg = Segment(0, 0, 0, rect, rect.nbytes(pool.rows))
        return cut_rect(seg, pool.rows, verify_piece_bytes(self.device), per_layer=False, split_tail=False)

    def held_rect(self, name: str, isl: int) -> Rect:
        """Everything this rank holds of a request in pool ``name``."""
        p = self.pools[name].pool
        return Rect(name, p.layers.start, p.layers.stop, p.heads.start, p.heads.stop, p.held_start(isl),
                    p.held_stop(isl), p.tokens_per_block)

    def _buffers(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two views of ``nbytes`` into scratch allocated once: fill and verify allocate nothing per piece."""
        return self._scratch[0, :nbytes], self._scratch[1, :nbytes]

    def fill(self, req: Request, ops, layer: int | None = None) -> None:
        """Write the request's deterministic contents into every block this rank holds for it (the prefill);
        only global layer ``layer`` when given (the prefill writes each layer when it has computed it)."""
        for name, store in self.pools.items():
            table = self.tables[req.id][name]
            rect = self.held_rect(name, req.isl)
            if layer is not None:
                if layer not in store.pool.spec.layers[rect.l0:rect.l1]:
                    continue
                i = store.pool.spec.layers.index(layer)
                rect = replace(rect, l0=i, l1=i + 1)
            for piece in self._pieces(rect, store.pool):
                self.tick()
                data = self.contents(key_of(req), store.pool, piece,
                                     out=self._buffers(piece.nbytes(store.pool.rows))[0])
                ops.unpack(data, store.pool, store.num_blocks, piece, table.ids, table.base, store.storage)

    def verify(self, req: Request, segments: list[Segment], ops) -> list[str]:
        """Bit-exact check of everything this rank received for ``req``, and of the blocks it shares with earlier
        requests (prefix reuse: what it would have received); one line per wrong piece."""
        errors = []
        checks = [(seg.rect, f"from ctx{seg.src}") for seg in segments]
        for name, pairs in self.shared(req).items():
            if pairs:
                rect = replace(self.held_rect(name, req.isl), t1=len(pairs) * self.pools[name].pool.tokens_per_block)
                sources = ", ".join(str(s) for s in sorted({src for src, _ in pairs}))
                checks.append((rect, f"in the prefix shared from request {sources}"))
        for rect, where in checks:
            store = self.pools[rect.pool]
            table = self.tables[req.id][rect.pool]
            for piece in self._pieces(rect, store.pool):
                self.tick()
                want, got = self._buffers(piece.nbytes(store.pool.rows))
                self.contents(key_of(req), store.pool, piece, out=want)
                ops.pack(store.storage, store.pool, store.num_blocks, piece, table.ids, table.base, got)
                if same_bytes(got, want):
                    continue
                bad = (got != want).nonzero()
                at = locate(store.pool, piece, int(bad[0]))
                block = table.host[at["token"] // store.pool.tokens_per_block - table.base]  # where it lies here
                errors.append(
                    f"request {req.id}: {bad.numel()} wrong bytes {where}, first at pool {at['pool']} "
                    f"layer {at['layer']} component {at['component']} head {at['head']} token {at['token']} "
                    f"byte {at['byte']} (block {block})")
        if self.after_verify is not None:
            self.after_verify(req, ops, errors)
        return errors

    def _block_view(self, store: PoolStore, block: int) -> list[torch.Tensor]:
        """All bytes of one block (every layer), as strided views, one per component (``RankPool.block_views``)."""
        return store.pool.block_views(store.storage, store.num_blocks, block)

    def _canary(self, store: PoolStore, block: int) -> list[torch.Tensor]:
        """The known contents of canary block ``block``, shaped as ``_block_view``'s views: a 32-bit hash of
        (block, word) per 4 bytes, a piece at a time (a hash per byte over whole int64 arrays took 0.3 s per 4 MiB)."""
        n = len(store.pool.layers) * store.pool.block_layer_bytes
        words = torch.empty((n + 3) // 4, dtype=torch.int32, device=self.device)
        seed = int(mix(torch.tensor(block * 0x2545F491 + 0x1234567, dtype=torch.int64)))
        piece = words.numel() if self.device.type == "cuda" else min(CANARY_PIECE_WORDS, words.numel())
        x = torch.arange(piece, device=self.device, dtype=torch.int64)
        for a in range(0, words.numel(), x.numel()):
            m = min(x.numel(), words.numel() - a)
            words[a:a + m] = mix(x[:m] + (seed + a))  # the int32 store keeps the hash's low 32 bits
        flat, out, off = words.view(torch.uint8)[:n], [], 0
        for view in self._block_view(store, block):
            out.append(flat[off:off + view.numel()].view(view.shape))
            off += view.numel()
        return out

    def check_canaries(self) -> list[str]:
        errors = []
        for name, store in self.pools.items():
            for b in store.canaries:
                if not all(torch.equal(v, w) for v, w in zip(self._block_view(store, b), self._canary(store, b))):
                    errors.append(f"{self.state.side.name}{self.state.rank}: canary block {b} of pool {name} changed")
        return errors
