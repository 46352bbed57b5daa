"""``transport=ipc``: the gen rank maps the ctx rank's pools once and pulls each chunk's runs
straight from the ctx pool into its own pool. No slot, no wire buffer, no pack, no unpack:
heads, layers, tokens per block and layout are resharded in the same pass.

Memory. On CPUs every ctx pool is a file in POSIX shared memory (``/dev/shm``) mapped with
``torch.from_file(shared=True)`` by its ctx rank and, once, by every gen rank; the ctx rank
unlinks the files as soon as every gen rank has mapped them, so no file outlives the
handshake even when a rank dies later: the pages live as long as some rank maps them, and
the operating system frees them when the last one exits. On GPUs every ctx pool is a plain
device allocation exported with CUDA IPC (``cuMemGetAddressRange`` for the allocation's
base, ``cuIpcGetMemHandle``), opened once per (gen rank, exported allocation: small pools can
share one) with the gen rank's GPU current, and closed in ``close``; a dead ctx process's memory stays valid for
the gen ranks that opened it until they close it.

Control plane: the default group's store (small keys, no tensors):
- ``connect``: ctx publishes each pool (file path or IPC handle, bytes, blocks); gen maps
  them and says so; ctx waits for every gen rank, then unlinks.
- ``opened`` (ctx): the request's block ids per pool, published as soon as they are allocated
  (the gen rank never derives the ctx rank's block ids from the config); a gen rank fetches
  them, and copies them to its device, before it waits for the data.
- ``start`` (ctx): the first chunk of each (request, ready layer) publishes one key: every
  chunk of that request whose ready layer it is may be pulled (the strategy's readiness was
  waited for; on GPUs the stream is synchronized once for all of them): one key per layer
  group of the request, not one per chunk.
- ``finish`` (gen): wait for the chunk's ready key unless an earlier chunk already did, then
  queue the copy of its runs (run ``i`` of the rectangle on both sides has the same wire
  offset and length: ``src + mem_ctx[i]`` -> ``dst + mem_gen[i]``) on the stream, with no
  host sync: on GPUs one kernel launch (``ops.copy_rect``) that computes both sides' runs
  from the block tables. After its last chunk of the request from a ctx rank it records an
  event; the (request, ctx rank) is acked once that event has passed: checked at each later
  ``finish``, and waited for in ``closed``, once the request's end is marked (the ack is not
  part of the transfer's time). ``finish`` (ctx): a chunk returns at once, except the
  request's last one, which waits for the ack of every gen rank that reads it, so that a
  request's blocks are freed only after every reader is done. A ctx rank's marks are host
  times: it queues no GPU work while the gen ranks copy.
So a request costs the store one key per ready layer and one per (ctx, gen) pair, and the
gen rank one host wait per request, after its end, whatever the chunk size.

Device-side readiness (GPUs where stream memory operations work; probed at ``connect``, else
the ready keys are waited for on the host as on CPUs). Each ctx rank numbers its (request,
ready layer) units in the order it publishes them (its chunk order) and sends each request's
numbers with its block table. Publishing a unit is then a write of its number, queued on the
ctx rank's stream after the layer's writes (``cuStreamWriteValue64`` into one int64 slot per
gen rank of a small exported buffer), plus the ready key; the ctx host never waits for the
device. A gen rank queues ``cuStreamWaitValue64(slot >= number)`` before the unit's copies, so
they start the moment the layer is written, with no host round trip between. Its host runs at
most one unit ahead of the ready keys it has seen, and polls each request's completion event
with the deadline: a ctx rank that dies before writing its counter fails the request there,
and the gen rank then writes the largest int64 into its own slots (the wait compares signed)
so that its stream drains before the mappings close.
Every wait has the deadline ``transfer.timeout_s``: a dead or stalled peer fails the chunk's
request there, as with ``p2p``.

Fault injection: bytes are flipped in the gen pool right after the copy, at the chunk's wire
offsets; the gen rank is the one that copies, so ``fault.flip_rank`` must be a gen rank.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
import time
import uuid

import torch
import torch.distributed as dist

from kvlab.config import devices
from kvlab.core import held
from kvlab.core.errors import ConfigError
from kvlab.core.held import create_locked
from kvlab.model.layout import Rect, runs
from kvlab.model.plan import Segment
from kvlab.model.schedule import Chunk, cut_rect
from kvlab.model.state import CacheState
from kvlab.transports import ChunkFailed, RankContext, Transport, cuda_ipc
from kvlab.transports.deadline import wait_until

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
POOL_PREFIX = "kvlab-ipc-"  # a ctx pool's file in SHM_DIR: its creator holds a lock on it (flock) while it lives
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
# A chunk is not cut to a slot here (kvlab.config.schema.Setup.chunk_cap), but the copies that build index tensors
# (kernels=torch: one per byte; the CPU rows: one per row) would grow with it: they go in pieces of this size,
# so the gen rank's temporaries stay flat in the prompt. The CUDA kernel computes its runs itself: one launch.
COPY_PIECE_BYTES = 16 << 20


class RequestStore:
    """The default group's store, whose host is world rank 0: once that rank is gone every call raises. A call on
    a request's key (``ipc/<kind>/<request>/...``) then fails that request (ChunkFailed), as a lost peer does on
    the other transports, so the executor keeps the records of what this rank did and goes on to its report; a
    call before the transfers (the pools, the flags) raises as it is."""

    def __init__(self, store):
        self._store = store

    def _call(self, op: str, key: str, *args):
        try:
            return getattr(self._store, op)(*args)
        except dist.DistError as e:  # DistNetworkError, DistStoreError: the host is gone or does not answer
            parts = key.split("/")
            if len(parts) > 2 and parts[2].isdigit():
                raise ChunkFailed(f"request {parts[2]}: the control store (world rank 0) is gone "
                                  f"({type(e).__name__})", int(parts[2])) from e
            raise

    def set(self, key: str, value):
        return self._call("set", key, key, value)

    def get(self, key: str):
        return self._call("get", key, key)

    def check(self, keys: list[str]):
        return self._call("check", keys[0], keys)

    def wait(self, keys: list[str], *args):
        return self._call("wait", keys[0], keys, *args)

    def delete_key(self, key: str):
        return self._call("delete_key", key, key)

    def __getattr__(self, name):
        return getattr(self._store, name)


def sweep(directory: str = SHM_DIR) -> list[str]:
    """Remove the pool files whose creator is gone (kvlab.core.held: it died before unlinking them, e.g. killed
    between creating its pools and the gen ranks mapping them); returns their names."""
    return held.sweep(directory, POOL_PREFIX)


def copy_pieces(rect: Rect, rows: tuple[int, ...], ops: str, piece_bytes: int = COPY_PIECE_BYTES) -> list[Rect]:
    """``rect`` as the rectangles one ``copy_rect`` call of ``ops`` copies: itself for the CUDA kernel, else
    pieces of at most ``piece_bytes`` that cover it exactly once."""
    if ops == "cuda":
        return [rect]
    return cut_rect(Segment(0, 0, 0, rect, rect.nbytes(rows)), rows, piece_bytes, per_layer=False,
                    split_tail=False)


class Ipc(Transport):
    polls = True  # ctx: a request's last chunk is done once every reader's ack is in the store
    pulls = True
    # fault injection: a ctx rank's notice is a ready key, a gen rank's its pulled key; the gen rank moves the bytes
    injects = {"drop_notice": frozenset({"ctx", "gen"}), "wrong_request": frozenset({"ctx", "gen"}),
               "stuck": frozenset({"gen"}), "reused_block": frozenset({"ctx", "gen"})}
    cannot = {"torn_chunk": "the ctx rank publishes a layer only once it is written and the gen rank copies it "
                            "itself: no rank is left holding half a chunk it takes for whole (a ctx rank that dies "
                            "is fault.kill_rank)"}

    def __init__(self, setup, side, rank, world_rank, device, shm_dir: str | None = None):
        super().__init__(setup, side, rank, world_rank, device)
        self.shm_dir = shm_dir or SHM_DIR  # where this ctx rank's pools live as files (CPUs)
        self.files: list[str] = []  # shared-memory files this ctx rank created and has not unlinked yet
        self.locks: list[int] = []  # their descriptors, which hold the lock that says their creator lives
        self.peers: dict[int, dict[str, tuple[torch.Tensor, int]]] = {}  # ctx rank -> pool -> (bytes, blocks)
        # CUDA IPC mappings this gen rank opened, by handle: tensors that share an allocation (small pools and
        # the counter slots in one cached segment) share its handle, which a process may open only once
        self.opened_handles: dict[str, int] = {}
        self.tables: dict[tuple[int, int], dict[str, tuple[int, torch.Tensor]]] = {}  # (request, ctx) -> pool -> table
        self.store = None
        self.gpu = device.type == "cuda"
        self.src_pools: dict[int, CacheState] = {}  # ctx rank -> its cache state (pool shapes)
        self.published: dict[int, dict[int, object]] = {}  # ctx: request -> ready layer whose key is set -> its mark
        self.readers: dict[int, set[int]] = {}  # ctx: request -> gen ranks reading its chunks
        self.seen: set[tuple[int, int, int]] = set()  # gen: (request, ctx, ready layer) keys waited for
        self.last: dict[tuple[int, int], int] | None = None  # gen: (request, ctx) -> index of its last chunk
        self.unacked: list[tuple[torch.cuda.Event | None, int, int]] = []  # gen: pulls not yet reported done
        # device-side readiness (GPUs with stream memory operations): each ctx rank's stream writes its
        # publishing counter into one int64 slot per gen rank; a gen rank's stream waits for the value
        self.flags: torch.Tensor | None = None  # ctx: the slots
        self.seqs: dict[int, dict[int, int]] | None = None  # ctx: request -> ready layer -> counter value
        self.peer_flags: dict[int, int] = {}  # gen: ctx rank -> address of this gen rank's slot there
        self.unit_seq: dict[tuple[int, int], dict[int, int]] = {}  # gen: (request, ctx) -> ready layer -> value
        self.unconfirmed: tuple[str, Chunk] | None = None  # gen: a queued device wait whose key is not seen yet

    @classmethod
    def check(cls, setup) -> None:
        world = os.environ.get("WORLD_SIZE")
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if world is not None and local is not None and int(local) != int(world):
            raise ConfigError("transport", "ipc", f"{world} ranks span several nodes ({local} on this one); ipc maps "
                              "memory within one node: use transport=p2p across nodes")
        if devices.uses_cuda(setup):
            try:
                cuda_ipc.check_supported()
            except Exception as e:  # noqa: BLE001 - any reason ipc cannot work here is the config's to change
                raise ConfigError("transport", "ipc", f"CUDA IPC is unavailable here ({e}); use transport=p2p, "
                                  "or device=cpu") from None
        shm = setup.transport.options.get("shm_dir")
        if shm is not None and not (isinstance(shm, str) and os.path.isdir(shm)):
            raise ConfigError("transport.shm_dir", shm, "must be an existing directory (a tmpfs with room for the "
                              "ctx pools), or null for /dev/shm")
        f = setup.fault
        if 0 <= f.flip_rank < setup.ctx.size:
            raise ConfigError("fault.flip_rank", f.flip_rank, "with transport=ipc the gen rank copies the bytes; flip "
                              f"on a gen rank (world rank {setup.ctx.size}..{setup.world_size - 1})")

    # -- memory ---------------------------------------------------------------------------
    @classmethod
    def pool_files(cls, setup) -> str | None:
        return None if devices.uses_cuda(setup) else setup.transport.options.get("shm_dir") or SHM_DIR

    @classmethod
    def sweep_after(cls, setup) -> list[str]:
        where = cls.pool_files(setup)
        return sweep(where) if where is not None else []

    def pool_storage(self, pool: str, nbytes: int) -> torch.Tensor:
        if not self.sending or self.gpu:
            return super().pool_storage(pool, nbytes)
        if not self.files and not self.locks:  # before this rank's first pool: what dead runs left goes
            gone = sweep(self.shm_dir)
            if gone:
                print(f"kvlab: ctx{self.rank} removed {len(gone)} shared-memory pool file{'s' * (len(gone) > 1)} "
                      f"a dead run left in {self.shm_dir}: {', '.join(gone)}", file=sys.stderr, flush=True)
        path = os.path.join(self.shm_dir, f"{POOL_PREFIX}{uuid.uuid4().hex}-ctx{self.rank}-{pool}")
        self.locks.append(create_locked(path, nbytes))
        self.files.append(path)
        storage = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)  # a new file: zeroed
        # its pages are allocated now, before the clock (as torch.zeros does for a pool in private memory),
        # not by the prefill's first writes
        return storage.zero_()

    def _wait(self, key: str, what: str, c: Chunk | None = None) -> None:
        timeout = self.setup.transfer.timeout_s
        left = timeout if self.ctx is None else self.ctx.deadline() - time.time()
        try:
            self.store.wait([key], datetime.timedelta(seconds=max(left, 0.01)))
        except RuntimeError as e:  # the deadline passed, or the store's host is gone
            if c is None:
                raise RuntimeError(f"transport=ipc: {what} not within {timeout:g} s") from e
            raise self.failed(c, f"{what} not within {timeout:g} s or peer gone", e) from e

    def _wait_ctx(self, key: str, what: str, c: Chunk) -> None:
        """A gen rank's wait for what a ctx rank publishes. That ctx rank may itself be waiting for this rank
        to report pulls done (it frees a request's blocks only then, and publishes nothing meanwhile): every
        pull whose copies are queued is reported before this rank blocks."""
        if self.unacked and not self.store.check([key]):
            self._acks(wait=True)
        self._wait(key, what, c)

    def connect(self, ctx: RankContext) -> None:
        super().connect(ctx)
        self.store = RequestStore(dist.distributed_c10d._get_default_store())
        cache = ctx.cache
        if self.sending:
            flags = {}
            if self.gpu:
                if cuda_ipc.stream_ops_error(self.device) is None:
                    self.flags = torch.zeros(self.setup.gen.size, dtype=torch.int64, device=self.device)
                    torch.cuda.synchronize(self.device)  # zeroed before any stream writes a count into it
                    flags["handle"], flags["offset"] = cuda_ipc.export(self.flags)
            self.store.set(f"ipc/flags/{self.rank}", json.dumps(flags))
            pools = {}
            for name, st in cache.pools.items():
                pools[name] = {"bytes": st.storage.numel(), "blocks": st.num_blocks}
                if self.gpu:
                    pools[name]["handle"], pools[name]["offset"] = cuda_ipc.export(st.storage)
                else:
                    pools[name]["path"] = next(p for p in self.files if p.endswith(f"-ctx{self.rank}-{name}"))
            self.store.set(f"ipc/pools/{self.rank}", json.dumps(pools))
            for g in range(self.setup.gen.size):
                self._wait(f"ipc/mapped/{g}", f"gen{g} mapping the pools")
            self._unlink()
            return
        for src in range(self.setup.ctx.size):
            self._wait(f"ipc/pools/{src}", f"ctx{src} publishing its pools")
            pools = json.loads(self.store.get(f"ipc/pools/{src}"))
            self.peers[src] = {name: (self._map(p), p["blocks"]) for name, p in pools.items()}
            flags = json.loads(self.store.get(f"ipc/flags/{src}"))  # set before the pools
            if flags:
                slots = self._map({**flags, "bytes": 8 * self.setup.gen.size})
                self.peer_flags[src] = slots.data_ptr() + 8 * self.rank
        self._warm_up()
        self.store.set(f"ipc/mapped/{self.rank}", "1")

    def _warm_up(self) -> None:
        """Load the copy path's kernel before the clock starts: one token of the first pool copied onto
        itself, which changes no byte."""
        ex = self.ctx
        store = next(iter(ex.cache.pools.values()))
        p = store.pool
        rect = Rect(p.name, p.layers.start, p.layers.start + 1, p.heads.start, p.heads.start + 1, 0, 1, 1,
                    local=p.tokens.local)
        ids = torch.zeros(1, dtype=torch.int64, device=self.device)
        ex.ops.copy_rect(store.storage, p, store.num_blocks, ids, 0, store.storage, p, store.num_blocks, ids, 0, rect)
        if self.gpu:
            torch.cuda.synchronize(self.device)

    def _map(self, p: dict) -> torch.Tensor:
        if not self.gpu:
            mapped = torch.from_file(p["path"], shared=True, size=p["bytes"], dtype=torch.uint8)
            # one read per page maps the ctx rank's pages into this process now, not one fault per page
            # inside the timed copies
            int(mapped[::PAGE_BYTES].sum())
            return mapped
        if p["handle"] not in self.opened_handles:
            self.opened_handles[p["handle"]] = cuda_ipc.open_handle(p["handle"], self.device)
        return cuda_ipc.view(self.opened_handles[p["handle"]] + p["offset"], p["bytes"], self.device)

    def _unlink(self) -> None:
        for path in self.files:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.files.clear()
        for fd in self.locks:  # the mappings keep the pages; the descriptors only held the lock
            os.close(fd)
        self.locks.clear()

    def leave(self) -> None:
        self._unlink()

    def _release(self) -> None:
        """Let this gen rank's stream past every device wait it queued (the run is ending or failing; a
        dead ctx rank never writes its counter): the copies behind them read stale bytes, which no one
        checks any more."""
        if self.peer_flags:
            side = torch.cuda.Stream(self.device)
            for ptr in self.peer_flags.values():
                cuda_ipc.write_value(side.cuda_stream, ptr, cuda_ipc.RELEASE)
            side.synchronize()

    def close(self) -> None:
        self._unlink()
        if self.opened_handles:
            self._release()
            torch.cuda.synchronize(self.device)  # no copy may still read a mapping being closed
            for base in self.opened_handles.values():
                cuda_ipc.close(base)
            self.opened_handles.clear()
        self.peers.clear()

    # -- requests and chunks --------------------------------------------------------------
    def opened(self, req) -> None:
        if self.seqs is None:  # the counter's value for each unit: units are published in this rank's order
            self.seqs, units = {}, 0
            for c in self.ctx.chunks:
                layers = self.seqs.setdefault(c.request, {})
                if c.ready_layer not in layers:
                    units += 1
                    layers[c.ready_layer] = units
        tables = self.ctx.cache.tables[req.id]
        seq = self.seqs[req.id]
        self.store.set(f"ipc/t/{req.id}/{self.rank}", json.dumps(
            {"tables": {name: [t.base, list(t.host)] for name, t in tables.items()}, "seq": seq}))

    def _table(self, c: Chunk) -> tuple[int, torch.Tensor]:
        key = (c.request, c.src)
        if key not in self.tables:
            self._wait_ctx(f"ipc/t/{c.request}/{c.src}", "the block table from the ctx rank", c)
            got = json.loads(self.store.get(f"ipc/t/{c.request}/{c.src}"))
            self.tables[key] = {name: (base, self.ctx.upload(ids))
                                for name, (base, ids) in got["tables"].items()}
            self.unit_seq[key] = {int(layer): v for layer, v in got["seq"].items()}
        return self.tables[key][c.rect.pool]

    def _last_chunks(self) -> dict[tuple[int, int], int]:
        if self.last is None:
            self.last = {(c.request, c.src): i for i, c in enumerate(self.ctx.chunks)}
        return self.last

    def _mark(self):
        """A ctx rank's marks are host times: a GPU event it recorded while a gen rank copies would
        switch the shared GPU to the ctx process's context in the middle of the copy."""
        return self.ctx.clock.host() if self.sending else self.ctx.clock.mark()

    def start(self, i: int, c: Chunk, rec):
        posted = self._mark()
        if self.sending:
            self.readers.setdefault(c.request, set()).add(c.dst)
            done = self.published.setdefault(c.request, {})
            if c.ready_layer not in done:
                self.ctx.faults.reuse(self.ctx, i, c)  # fault injection: before the gen ranks may read the bytes
                # another process reads these bytes: the prefill's writes queued on our stream come first
                if self.flags is not None:  # ordered on the device: the host does not wait
                    value = self.seqs[c.request][c.ready_layer]
                    for g in range(self.setup.gen.size):
                        cuda_ipc.write_value(self.ctx.stream.cuda_stream, self.flags.data_ptr() + 8 * g, value)
                elif self.gpu:
                    self.ctx.stream.synchronize()
                n = self.ctx.faults.notice(i, c)
                if n is not None:
                    self.store.set(f"ipc/r/{n.request}/{self.rank}/{n.ready_layer}", "1")
                done[c.ready_layer] = posted
            # every chunk of a published layer may be pulled from then on: a later chunk's own start (the loop may
            # come to it after a gen rank has copied it) would cut its flight short
            posted = done[c.ready_layer]
        return i, c, posted

    def poll(self, handle) -> bool:
        """ctx: done, except a request's last chunk, which is done once every gen rank reading the request
        has said it pulled it; gen: always (finishing pulls the chunk once it is published)."""
        i, c, _ = handle
        if not self.sending or self._last_chunks()[(c.request, c.src)] != i:
            return True
        return all(self.store.check([f"ipc/d/{c.request}/{self.rank}/{g}"])
                   for g in self.readers.get(c.request, ()))

    def finish(self, handle, rec) -> bool:
        i, c, posted = handle
        if self.sending:
            if rec.chunks + 1 == rec.chunks_total:  # every reader of this request's blocks must be done
                for g in sorted(self.readers.pop(c.request)):
                    self._wait(f"ipc/d/{c.request}/{self.rank}/{g}", f"pulled by gen{g}", c)
                    self.store.delete_key(f"ipc/d/{c.request}/{self.rank}/{g}")
                for layer in self.published.pop(c.request):
                    self.store.delete_key(f"ipc/r/{c.request}/{self.rank}/{layer}")
                self.store.delete_key(f"ipc/t/{c.request}/{self.rank}")
        else:
            unit = (c.request, c.src, c.ready_layer)
            self._table(c)  # published when the ctx rank allocated the blocks: fetched before the data is ready
            if unit not in self.seen:
                key = f"ipc/r/{c.request}/{c.src}/{c.ready_layer}"
                if c.src in self.peer_flags:
                    # the copies wait on the device; the host runs at most one unit ahead of what it has seen
                    # published, so that a dead ctx rank is noticed within the deadline
                    if self.unconfirmed is not None:
                        before, at = self.unconfirmed
                        self._wait_ctx(before, "ready on the ctx rank", at)
                    value = self.unit_seq[(c.request, c.src)][c.ready_layer]
                    cuda_ipc.wait_value(self.ctx.stream.cuda_stream, self.peer_flags[c.src], value)
                    self.unconfirmed = (key, c)
                else:
                    self._wait_ctx(key, "ready on the ctx rank", c)
                self.seen.add(unit)
            self._acks(wait=False)
            if self.ctx.faults.stuck(i, c):  # fault injection: a copy that never completes
                timeout = self.setup.transfer.timeout_s
                wait_until(lambda: False, time.time() + timeout,
                           lambda: self.failed(c, f"copy not done within {timeout:g} s"))
            self._pull(i, c, rec)
            self.ctx.faults.reuse(self.ctx, i, c)  # fault injection: once the bytes have landed
            done = self._mark()
            if self._last_chunks()[(c.request, c.src)] == i:
                # the ctx rank frees the blocks once they are reported pulled: report when the copies are done,
                # without making the host wait for them here (the next chunks' copies are queued meanwhile)
                event = None
                if self.gpu:
                    event = torch.cuda.Event()
                    event.record(self.ctx.stream)
                self.unacked.append((event, c.request, c.src))
                self.tables.pop((c.request, c.src), None)
                self.seen = {u for u in self.seen if u[:2] != (c.request, c.src)}
                if event is None:  # copied already: the ctx rank may free the blocks now
                    self._acks(wait=False)
            # in flight from the copy's start (after the wait for the ctx rank's publish), not from the post:
            # a gen rank posts ahead of the data, and that wait is the prefill's, not the transfer's
            rec.wire.append((rec.pack[-1][0], done))
            return True
        rec.wire.append((posted, self._mark()))
        return True

    def _acks(self, wait: bool, request: int | None = None) -> None:
        """Tell the ctx ranks which (request, ctx rank) pulls are complete: those whose copies are done, or
        with ``wait`` every one (of ``request`` only, if given), waiting for their copies."""
        keep = []
        timeout = self.setup.transfer.timeout_s
        deadline = time.time() + timeout
        for event, rid, src in self.unacked:
            mine = request is None or rid == request
            if mine and wait and event is not None:
                def late(rid=rid, src=src) -> ChunkFailed:
                    self._release()  # a device wait on a dead ctx rank's counter would never end
                    return ChunkFailed(f"request {rid} with ctx{src}: its copies not done within {timeout:g} s "
                                       "(the ctx rank never published it)", rid)

                wait_until(event.query, deadline, late)
            if mine and (wait or event is None or event.query()):
                if self.unconfirmed is not None and self.unconfirmed[1].request == rid \
                        and self.unconfirmed[1].src == src:
                    self.unconfirmed = None  # its copies ran: the counter was written; its key may be deleted
                last = self._last_chunks()[(rid, src)]
                n = self.ctx.faults.notice(last, self.ctx.chunks[last])
                if n is not None:
                    self.store.set(f"ipc/d/{n.request}/{src}/{self.rank}", "1")
            else:
                keep.append((event, rid, src))
        self.unacked = keep

    def closed(self, request: int) -> None:
        if not self.sending:  # the request's end is marked: its last acks leave the measured path
            self._acks(wait=True, request=request)

    def abandon(self, handle) -> None:
        if not self.sending:
            self._acks(wait=False)  # pulls that did complete: their ctx ranks may free those blocks
            if self.gpu:  # queued copies may still read a ctx pool that is about to be freed
                self._release()
                self.ctx.stream.synchronize()

    def aborted(self) -> None:
        # a failed wait for a ctx rank's key leaves the device wait for its previous unit queued (its chunk
        # already left the loop's window, so no abandon releases it): the finished requests' checks, queued
        # on the same stream, would wait behind it forever
        if not self.sending and self.gpu:
            self._release()
            self.ctx.stream.synchronize()

    def _pull(self, i: int, c: Chunk, rec) -> None:
        ex = self.ctx
        t0 = ex.clock.mark()
        src_bytes, src_blocks = self.peers[c.src][c.rect.pool]
        if c.src not in self.src_pools:
            self.src_pools[c.src] = CacheState(self.setup.model, self.setup.ctx, c.src)
        src_pool = self.src_pools[c.src].pool(c.rect.pool)
        base, ids = self._table(c)
        store = ex.cache.pools[c.rect.pool]
        table = ex.cache.tables[c.request][c.rect.pool]
        for rect in copy_pieces(c.rect, src_pool.rows, ex.ops.name):
            ex.ops.copy_rect(src_bytes, src_pool, src_blocks, ids, base,
                             store.storage, store.pool, store.num_blocks, table.ids, table.base, rect)
        flips = ex.faults.flips.get(i, [])
        if flips:  # inside the copy's output, at the chunk's wire offsets
            dst = runs(store.pool, store.num_blocks, c.rect, table.ids, table.base)
            for j in flips:
                k = int(((dst.wire <= j) & (j < dst.wire + dst.length)).nonzero()[0])
                at = int(dst.mem[k]) + j - int(dst.wire[k])
                store.storage[at:at + 1].bitwise_xor_(0xFF)
        rec.pack.append((t0, ex.clock.mark()))
