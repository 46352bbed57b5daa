"""``transport=mooncake``: the ctx rank writes each chunk into the gen rank's memory with the Mooncake
Transfer Engine.

Mooncake's engine is SGLang's default disaggregation transport (also a backend of vLLM, TensorRT-LLM and
LMCache): one-sided writes between registered buffers of two engines, over TCP, RDMA or, within a node
between GPUs, NVLink (CUDA IPC). One engine per rank, started with ``P2PHANDSHAKE`` (no metadata
server: the session ids ``host:port`` go through the torch.distributed store, kvlab.transports.mooncake_engine); every
pool, the staging slots and a small probe buffer are registered once in ``connect``, and the pools'
addresses go through the store with the session ids. ``transport.protocol``: ``tcp`` (the CPU wheel's;
GPU buffers go through the host), ``nvlink_intra`` (CUDA wheels, GPUs of one node), ``auto`` (the
second where the wheel has it and the ranks use GPUs, else the first). Both sides follow the same chunk
order; only the ctx rank moves bytes. ``transport.mode``, as for nixl:

- ``staged``: pack into a registered slot (or use the pool where the chunk lies in wire order), one
  write of the whole chunk into the gen rank's registered slot, unpack there. Same slots, same flow
  control, same bounded memory as ``p2p``.
- ``direct``: no staging; one write per run (``kvlab.model.layout.runs`` of the same rectangle on both states,
  neighbours contiguous on both sides merged), from the ctx pool straight into the gen pool. The gen
  rank sends only its block tables, once per (request, ctx rank).

Completion is polled: each write is submitted on its own (``transfer_submit_write``) and polled without
blocking (``transfer_check_status``). The Python binding's batch calls do not fit a rank that polls
with a deadline: ``batch_transfer_async_write``'s status call, ``get_batch_transfer_status``, blocks
until the whole batch is done, spinning a core, under the engine's own timeout (at least 5 s), and
``transfer_check_status`` on a batch reads its first entry only (measured: "done" after 11 ms for a
batch whose second entry of 100 MiB took about 100 ms) and frees the batch then; on ``nvlink_intra`` one
H200, polling a batch so ended the writing process. So a direct chunk's runs are submitted back to back,
one call each (about 5 us per call on the CPU machine), and its completion is the last of theirs. A batch
would not lift direct's ceiling on one GPU much: 512 runs of 32 KiB move 2.24 GB/s one call each and 4.98 as
one batch waited for whole (scripts/mooncake_bench.py, docs/results/mooncake.md).

Control plane: the default group's store (Mooncake's own notifications need a synchronous write to carry
them: 0.64 ms per notice measured, against tens of microseconds for a store request). Per-chunk notices go
through one queue per (ctx rank, gen rank) and kind, ``<request>.<seq> <value>`` each: ``mc/R/<ctx>/<gen>``
(staged: the gen slot's address and size, once it is free) and ``mc/D/<ctx>/<gen>`` (the ctx rank saw every
write of the chunk complete: the bytes are in the gen rank's memory). A push is one request to the store
and a pop one more, with nothing left to delete, where a keyed notice took a set, a check, a get and a
delete (on one H200 the staged rate did not move with it: docs/results/mooncake.md). A notice popped for
another chunk than the one awaited is kept until that chunk asks. ``mc/T/<ctx>/<gen>/<request>`` (direct:
the gen rank's block tables, once per request) stays a key. The ctx rank ``polls``: the executor sees each
completion, and the notice goes out, when it happens. Every wait polls with the deadline
``transfer.timeout_s``; a write to a gen rank that is gone fails at once (the engine reports the broken
connection), a rank waiting on a peer asks the peer's engine whether it is there every ``PROBE_S``
(``send_probe``: a gen rank learns so that a ctx rank is gone, since only ctx ranks write), and a store
that is gone (rank 0) fails the call. A gen rank polls its queue every ``LAND_POLL_S`` on CPUs, not faster:
each poll is a round trip to the store's host, on the cores the engine's TCP copies run on; on GPUs, whose
copies run on copy engines, every ``LAND_POLL_GPU_S``.

On GPUs nothing blocks the host on the device: a chunk is written once the event recorded after its
pack (or its layers' writes) has completed (the engine does not follow CUDA streams; its submit waits on
the host for the caller's default stream, so a ctx rank's packs run on a stream of their own), and a gen slot is
announced again once the event of its last unpack has.

The in-run link reference (``link_reference = "mooncake"``, kvlab.rank.linkrate): raw writes of the run's
chunk size from a registered buffer into one on each gen rank the ctx rank feeds, ``transfer.slots`` in
flight, after one untimed round.
"""
from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import QueueEmptyError

from kvlab.core.errors import ConfigError
from kvlab.model.schedule import Chunk, Staging
from kvlab.model.state import CacheState
from kvlab.transports import RankContext, write_notify
from kvlab.transports import mooncake_engine as mooncake
from kvlab.transports.deadline import wait_until
from kvlab.transports.write_notify import Landing, WriteNotify

DIRECT_WAVE = 1024  # writes of one chunk in flight at once (_write)
LAND_POLL_S = 2.5e-4  # gen, CPUs: between two looks for a chunk's notice in the store
LAND_POLL_GPU_S = 5e-5  # gen, GPUs
PROBE_S = 0.25  # between two probes of a peer's engine while waiting on it


@dataclass
class Write(write_notify.Write):
    """A chunk on the ctx rank: packed (or not), waiting for the gen rank's room, then its writes in flight."""

    ids: list | None = None  # the engine's ids of the writes not yet seen complete; None: not yet submitted
    done: object = None  # the completion mark, set when it was seen
    stuck: bool = False  # fault injection: posted, and never progresses


@dataclass
class Peer:
    session: str
    pools: dict = field(default_factory=dict)  # pool name -> (address, blocks)
    probe: int = 0
    state: CacheState | None = None


class Mooncake(WriteNotify):
    """The chunk's life is kvlab.transports.write_notify's; Mooncake's engine, writes and the store's notices here."""

    link_reference = "mooncake"  # kvlab.rank.linkrate: raw writes of the run's chunk size between its pairs
    write_cls = Write

    def __init__(self, setup, side, rank, world_rank, device, mode: str = "staged", protocol: str = "auto",
                 pack_ctas: int | None = None):
        super().__init__(setup, side, rank, world_rank, device, mode, pack_ctas)
        self.protocol = protocol
        # the ctx rank polls its writes' status locally; a gen rank's poll would be a store round trip per
        # chunk in flight per loop, so it is finished when the executor must
        self.polls = side == "ctx"
        self.te = None
        self.wire = ""
        self.session = ""
        self.regs: list[int] = []
        self.peers: dict[int, Peer] = {}
        self.store = None
        self.heard: dict[str, dict[str, str]] = {}  # queue -> notices popped before their chunk asked
        self.probed: dict[int, float] = {}  # peer -> when its engine was last asked whether it is there
        self.land_poll_s = LAND_POLL_GPU_S if getattr(device, "type", device) == "cuda" else LAND_POLL_S

    @classmethod
    def check(cls, setup) -> None:
        o = setup.transport.options
        cls.check_mode(o, "one write per run, pool to pool", "one write per chunk through registered slots")
        proto = o.get("protocol", "auto")
        if proto not in mooncake.PROTOCOLS:
            raise ConfigError("transport.protocol", proto, "use tcp, nvlink_intra (GPUs of one node, CUDA wheels) "
                              "or auto (nvlink_intra where the wheel and the GPUs have it, else tcp)")
        if proto == "nvlink_intra" and setup.device == "cpu":
            raise ConfigError("transport.protocol", proto, "NVLink moves GPU memory; use transport.protocol=tcp "
                              "(or auto) with device=cpu")

    @classmethod
    def installed(cls, setup) -> None:
        mc = mooncake.api()
        if setup.transport.options.get("protocol", "auto") == "nvlink_intra" and not mc.SUPPORT_INTRA_NVLINK:
            raise ConfigError("transport.protocol", "nvlink_intra", "the installed Mooncake wheel has no intra-node "
                              "NVLink transport (the CUDA wheel has); use transport.protocol=tcp or auto")

    # -- start-up ---------------------------------------------------------------------------
    def connect(self, ctx: RankContext) -> None:
        """Engine, registrations, session ids and pool addresses through the store, one write each way."""
        super().connect(ctx)
        t = self.setup.transfer
        self._stage(ctx)
        if self.sending and self.staging is not None and self.device.type == "cuda":
            # the engine's submit first waits, on the host, for the caller's default stream: on torch's legacy
            # stream that is every pack queued so far, the later chunks' too. On a stream of their own a chunk's
            # write waits for nothing but its own pack, which its event gates.
            self.pack_stream = torch.cuda.Stream(self.device)
        self.wire = mooncake.protocol(self.protocol, self.device.type)
        self.te, self.session = mooncake.engine(self.wire, t.timeout_s)
        pools = ctx.cache.pools
        self.probe = torch.zeros(64, dtype=torch.uint8, device=self.device)
        tensors = [s.storage for s in pools.values()] + [self.probe]
        if self.staging is not None and self.staging.slots is not None:
            tensors.append(self.staging.slots.storage)
        for x in tensors:
            self._register(x.data_ptr(), x.numel())
        self.store = dist.distributed_c10d._get_default_store()
        me = f"{self.side}{self.rank}"
        info = {"session": self.session, "probe": self.probe.data_ptr(),
                "pools": {n: (s.storage.data_ptr(), s.num_blocks) for n, s in pools.items()}}
        self.store.set(f"mc/info/{me}", json.dumps(info))
        other = "gen" if self.sending else "ctx"
        spec = self.setup.gen if self.sending else self.setup.ctx
        for r in range(spec.size):
            self.store.wait([f"mc/info/{other}{r}"])
            got = json.loads(self.store.get(f"mc/info/{other}{r}"))
            self.peers[r] = Peer(got["session"], {n: tuple(v) for n, v in got["pools"].items()}, got["probe"],
                                 CacheState(self.setup.model, spec, r))
        # the first write to a peer fetches its segment (its registered buffers) and opens the connection:
        # not inside the first timed chunk. Every registration above is in it.
        dist.barrier()
        if self.sending:
            deadline = time.time() + max(t.timeout_s, 30.0)
            for r, p in self.peers.items():
                ids = self._submit(p.session, [self.probe.data_ptr()], [p.probe], [self.probe.numel()])
                if ids is None or not self._wait_ids(ids, deadline):
                    raise RuntimeError(f"mooncake: no write reached gen{r} ({p.session}) within the start-up deadline")
        dist.barrier()

    def _register(self, addr: int, nbytes: int) -> None:
        mooncake.register(self.te, addr, nbytes)
        self.regs.append(addr)

    def _unregister(self, addr: int) -> None:
        self.te.unregister_memory(addr)
        self.regs.remove(addr)

    # -- the engine's writes ----------------------------------------------------------------
    def _submit(self, session: str, src, dst, length) -> list | None:
        """One write per (src, dst, length): their ids, or None if the engine refused one (those already
        submitted are polled until they end, so that none is left running)."""
        ids = []
        for s, d, n in zip(src, dst, length):
            bid = self.te.transfer_submit_write(session, int(s), int(d), int(n))
            if bid == 0:
                self._drain(ids)
                return None
            ids.append(bid)
        return ids

    def _progress(self, ids: list) -> bool:
        """Drop from ``ids`` the writes that are complete (the engine frees each id the first time it says so);
        True when none is left. RuntimeError when one failed."""
        keep = []
        for k, bid in enumerate(ids):
            s = self.te.transfer_check_status(bid)
            if s == 0:
                keep.append(bid)
            elif s != 1:
                self._drain(keep + ids[k + 1:])
                ids.clear()
                raise RuntimeError("the engine reports the write " + ("timed out" if s == -2 else "failed"))
        ids[:] = keep
        return not ids

    def _drain(self, ids: list) -> None:
        """Poll writes that will not be used until each ends either way (an id is freed when it ends)."""
        deadline = time.time() + self.setup.transfer.timeout_s
        pending = list(ids)
        while pending and time.time() < deadline:
            pending = [b for b in pending if self.te.transfer_check_status(b) == 0]
            if pending:
                time.sleep(1e-4)

    def _wait_ids(self, ids: list, deadline: float) -> bool:
        try:
            wait_until(lambda: self._progress(ids), deadline, TimeoutError, spin_s=self.spin_s)
        except TimeoutError:
            return False
        return True

    # -- control keys -----------------------------------------------------------------------
    @staticmethod
    def _notice(kind: str, c: Chunk, value: str) -> tuple[str, str]:
        """(queue, entry) of chunk ``c``'s notice of ``kind`` carrying ``value``."""
        return f"mc/{kind}/{c.src}/{c.dst}", f"{c.request}.{c.seq} {value}"

    def _ask(self, c: Chunk, call, *args):
        """``call(*args)``, a request to the store; one that fails (the store's host gone) fails chunk ``c``."""
        try:
            return call(*args)
        except Exception as e:  # noqa: BLE001 - the store's errors are plain RuntimeErrors (host gone, ...)
            raise self.failed(c, "control store unreachable", e) from e

    def _heard(self, kind: str, c: Chunk) -> str | None:
        """The value of chunk ``c``'s notice of ``kind`` once it has come, else None: the pair's queue is popped
        until it has, or is empty; notices of other chunks popped meanwhile wait in ``heard`` for theirs."""
        queue = f"mc/{kind}/{c.src}/{c.dst}"
        got = self.heard.setdefault(queue, {})
        name = f"{c.request}.{c.seq}"
        while name not in got:
            try:
                entry = self.store.queue_pop(queue, block=False)
            except QueueEmptyError:
                return None
            except Exception as e:  # noqa: BLE001
                raise self.failed(c, "control store unreachable", e) from e
            k, _, v = (entry.decode() if isinstance(entry, bytes) else entry).partition(" ")
            got[k] = v
        return got.pop(name)

    def _take(self, key: str, c: Chunk) -> str | None:
        """The key's value, deleted, if it is there; None otherwise."""
        try:
            if not self.store.check([key]):
                return None
            got = self.store.get(key)
            self.store.delete_key(key)
        except Exception as e:  # noqa: BLE001
            raise self.failed(c, "control store unreachable", e) from e
        return got.decode() if isinstance(got, bytes) else got

    # -- chunks (the engine's side of kvlab.transports.write_notify) ----------------------------------
    def _register_buffer(self, buf: torch.Tensor) -> int:
        self._register(buf.data_ptr(), buf.numel())
        return buf.data_ptr()

    def _deregister_buffer(self, reg: int) -> None:
        self._unregister(reg)

    def _room(self, c: Chunk) -> str | None:
        return self._heard("R", c)

    def _tables_sent(self, c: Chunk) -> str | None:
        return self._take(f"mc/T/{c.src}/{c.dst}/{c.request}", c)

    def _room_notice(self, c: Chunk, buf: torch.Tensor, reg: int | None) -> tuple:
        return (self.store.queue_push, *self._notice("R", c, f"{buf.data_ptr()} {buf.numel()}"))

    def _tables_notice(self, c: Chunk, tables: str) -> tuple:
        return (self.store.set, f"mc/T/{c.src}/{c.dst}/{c.request}", tables)

    def _publish(self, h: Landing) -> None:
        self._ask(h.chunk, *h.notice)

    def _write(self, w: Write, room) -> None:
        """Write a chunk to where ``room`` says: staged, the gen slot's "address bytes"; direct, the gen rank's
        block tables of the request."""
        c = w.chunk
        peer = self.peers[c.dst]
        if self.mode == "staged":
            addr, n = map(int, room.split())
            if n != c.nbytes:
                raise self.failed(c, f"gen rank offers {n} B for a {c.nbytes} B chunk")
            src, dst, length = [w.buf.data_ptr()], [addr], [n]
        else:
            src, dst, length = self._runs(w, room, peer)
        faults = self.ctx.faults
        if faults.stuck(w.index, c):  # fault injection: posted, and never progresses
            w.ids, w.stuck, w.posted = [], True, self.ctx.clock.mark()
            return
        if faults.torn(w.index, c):  # fault injection: half the bytes land, then the sender dies
            ids = self._submit(peer.session, *faults.half(src, dst, length))
            self._wait_ids(ids or [], time.time() + self.setup.transfer.timeout_s)
            faults.die()
        w.rec.descriptors += len(length)
        w.posted = self.ctx.clock.mark()
        # the engine fails writes once some thousands are in flight to one peer (two 16 MiB direct chunks of
        # 8 KiB runs to one gen rank did): a chunk of more runs goes in waves, each but the last waited for here
        deadline = time.time() + self.setup.transfer.timeout_s
        while len(length) > DIRECT_WAVE:
            try:
                ids = self._submit(peer.session, src[:DIRECT_WAVE], dst[:DIRECT_WAVE], length[:DIRECT_WAVE])
                if ids is None or not self._wait_ids(ids, deadline):
                    raise RuntimeError("refused or not complete within the timeout")
            except RuntimeError as e:
                raise self.failed(c, "write failed", e) from e
            src, dst, length = src[DIRECT_WAVE:], dst[DIRECT_WAVE:], length[DIRECT_WAVE:]
        w.ids = self._submit(peer.session, src, dst, length)
        if w.ids is None:
            raise self.failed(c, "the engine refused the write")

    def poll(self, w: Write) -> bool:
        """Ctx: whether every write of the chunk is complete; the first time, its completion is marked and the
        gen rank told."""
        if w.done is not None:
            return True
        self._pump()
        if w.ids is None or w.stuck:
            return False
        try:
            complete = self._progress(w.ids)
        except RuntimeError as e:
            raise self.failed(w.chunk, "write failed", e) from e
        if complete:
            w.done = self.ctx.clock.mark()
            n = self.ctx.faults.notice(w.index, w.chunk)
            if n is not None:
                self._ask(w.chunk, self.store.queue_push, *self._notice("D", n, ""))
        return complete

    def _written(self, w: Write, rec, deadline: float) -> None:
        def written() -> bool:
            if self.poll(w):
                return True
            if w.ids is None:  # still waiting for the gen rank's room or block tables
                self._alive(w.chunk, w.chunk.dst)
            return False

        wait_until(written, deadline, self._late(w.chunk), spin_s=self.spin_s)
        rec.wire.append((w.posted, w.done))

    def _arrived(self, h: Landing, deadline: float) -> None:
        """Gen: until the ctx rank's notice says the chunk's bytes are here, polling the store every
        ``land_poll_s`` (the module's docstring says why not faster) and asking the ctx engine whether it is
        still there every ``PROBE_S``."""
        c = h.chunk
        while True:
            self._announce()
            if self._heard("D", c) is not None:
                return
            self._alive(c, c.src)
            if time.time() > deadline:
                raise self._late(c)()
            time.sleep(self.land_poll_s)

    def _alive(self, c: Chunk, peer: int) -> None:
        """ChunkFailed if the peer's engine no longer answers (asked at most every ``PROBE_S``): a gen rank learns
        of a ctx rank that is gone only so, since only the ctx rank writes."""
        now = time.time()
        if now - self.probed.get(peer, 0.0) < PROBE_S:
            return
        self.probed[peer] = now
        rc = self.te.send_probe(self.peers[peer].session)
        if rc != 0:
            raise self.failed(c, f"peer gone: its engine does not answer (probe returned {rc})")

    def closed(self, request: int) -> None:
        """The request's block tables (direct) and its notices never asked for are dropped on either side."""
        super().closed(request)
        mine = f"{request}."  # notices never asked for (a fault's, or a chunk's that failed first)
        for got in self.heard.values():
            for name in [n for n in got if n.startswith(mine)]:
                del got[name]

    def _let_go(self, w: Write) -> None:
        w.ids = None  # writes to a peer that is gone end on their own; the engine frees them in close

    def close(self) -> None:
        if self.shut or self.te is None:
            self.shut = True
            return
        self.shut = True
        for addr in list(self.regs):
            try:
                self.te.unregister_memory(addr)
            except Exception:  # noqa: BLE001 - a registration the engine already dropped
                pass
        self.regs, self.te = [], None

    # -- the in-run link reference (kvlab.rank.linkrate) -----------------------------------------
    def raw_writes(self, nbytes: int, n: int, pairs: list[tuple[int, int]]) -> float:
        """Seconds this rank took, from a barrier, for its pairs' ``n`` raw writes of ``nbytes`` each (one
        untimed round first): a ctx rank writes round-robin over its gen ranks, ``transfer.slots`` in flight as
        the transfer has (one for the naive baseline, as p2p's reference), and is done when its last write is
        complete, when the bytes are in the gen rank's memory; a gen rank moves nothing and times nothing. One
        message per rank, in the rank's largest pool where it holds one (registered at connect, before the peers
        fetched each other's segments: a buffer registered later is unknown to a peer that already wrote to this
        rank, and ``nvlink_intra`` refuses writes into it), else in a buffer registered for this measure alone.
        What the writes cover in a gen rank's pool (its canaries included) is put back after the measure.
        Every wait is bounded by ``transfer.timeout_s``."""
        mine = [(c, g) for c, g in pairs if (c if self.sending else g) == self.rank]
        window = self.setup.transfer.slots if self.setup.transfer.strategy.staging == Staging.slots else 1
        timeout = self.setup.transfer.timeout_s
        pool = max((s.storage for s in self.ctx.cache.pools.values()), key=lambda x: x.numel(), default=None)
        buf = kept = None
        if pool is not None and pool.numel() >= nbytes:
            addr = pool.data_ptr()
            if not self.sending and mine:
                kept = pool[:nbytes].clone()
        else:
            buf = torch.zeros(nbytes if mine else 1, dtype=torch.uint8, device=self.device)  # pages mapped now
            self._register(buf.data_ptr(), buf.numel())
            addr = buf.data_ptr()
        key = f"mc/link/gen{self.rank}"
        if not self.sending and mine:
            self.store.set(key, str(addr))
        dist.barrier()
        dst = {g: int(self.store.get(f"mc/link/gen{g}")) for _, g in mine} if self.sending else {}

        def rounds(count: int) -> None:
            deadline, inflight = time.time() + timeout, deque()
            for j in range(count * len(mine)):
                g = mine[j % len(mine)][1]
                if len(inflight) >= window:
                    if not self._wait_ids(inflight.popleft(), deadline):
                        raise RuntimeError(f"mooncake link reference: a write not done within {timeout:g} s")
                ids = self._submit(self.peers[g].session, [addr], [dst[g]], [nbytes])
                if ids is None:
                    raise RuntimeError(f"mooncake link reference: the engine refused a write to gen{g}")
                inflight.append(ids)
            while inflight:
                if not self._wait_ids(inflight.popleft(), deadline):
                    raise RuntimeError(f"mooncake link reference: a write not done within {timeout:g} s")

        try:
            if self.sending:
                rounds(1)  # the first writes of this size: connections and pages warm, not timed
            dist.barrier()
            t0 = time.perf_counter()
            if self.sending:
                rounds(n)
            seconds = time.perf_counter() - t0 if self.sending else 0.0
            dist.barrier()  # every write has landed before a gen rank frees its buffer
            if not self.sending and mine:
                self.store.delete_key(key)
        finally:
            if kept is not None:
                pool[:nbytes].copy_(kept)
            if buf is not None:
                self._unregister(buf.data_ptr())
        return seconds
