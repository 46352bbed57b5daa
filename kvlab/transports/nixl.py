"""``transport=nixl``: the ctx rank WRITEs each chunk into the gen rank's memory with NIXL.

NIXL is what production engines move KV caches with (vLLM's NixlConnector, TensorRT-LLM,
SGLang, Dynamo); its UCX backend picks the path (cross-memory attach between processes of
one host, CUDA IPC between GPUs of one node, RDMA across nodes). One agent per rank;
every pool and slot is registered once in ``connect``, and the agents' metadata, pool
addresses and sizes go through the torch.distributed store. Both sides then follow the
same chunk order; only the ctx rank moves bytes. ``transport.mode``:

- ``staged``: the design of kvlab's chunked strategies over NCCL (and of TensorRT-LLM's
  bounded bounce buffer): pack into a registered slot (or use the pool where the chunk
  lies in wire order), one WRITE of one descriptor into the gen rank's registered slot,
  unpack there. Same slots, same flow control, same bounded memory as ``p2p``.
- ``direct``: what vLLM's NixlConnector and TensorRT-LLM's Python transceiver do: no
  staging; one WRITE whose descriptors are the chunk's runs (``kvlab.model.layout.runs`` of the
  same rectangle on both states, neighbours that are contiguous on both sides merged), from
  the ctx pool straight into the gen pool. Both sides compute the runs; the gen rank sends
  only its block tables, once per request.

Flow control, through NIXL notifications (the gen rank's agent receives them without a
receive being posted): staged, a gen rank whose slot for chunk ``i`` is free again sends
``R<request>.<seq>`` with the slot's address; direct, a gen rank that has allocated a
request's blocks sends each ctx rank feeding it ``T<request>`` with its block tables, once
for all the request's chunks. The ctx rank WRITEs once that has arrived, with the
notification ``D<request>.<seq>`` that NIXL delivers after the bytes; the gen rank finishes
the chunk when it sees it: in direct mode one notification per chunk. Every wait polls with a
deadline of ``transfer.timeout_s``; a peer that is gone fails the WRITE at once (UCX
reports the disconnect).

Per chunk the host does only what NIXL needs. A staged WRITE from a slot into a gen slot
is prepared once and posted again with each chunk's notification (preparing one took
0.16 ms in the raw benchmark on an H200, where a 16 MiB WRITE takes about 0.01 ms). On
GPUs nothing blocks the host on the device: a packed chunk is written once its pack's
event has completed (NIXL does not follow CUDA streams), and a gen slot is announced again
once the event of its last unpack has; until then the rank goes on polling. On GPUs a
wait first spins (``SPIN_S``, yielding the core) before it sleeps between polls: a sleep
costs more than a WRITE of a slot there, while on a CPU machine the ranks share the cores
the WRITEs run on.

The in-run link reference (``link_reference = "nixl"``, kvlab.rank.linkrate) is raw NIXL: the
run's ctx ranks WRITE messages of the run's chunk size from a registered buffer into one
on each gen rank they feed, ``transfer.slots`` in flight, after one untimed round.
"""
from __future__ import annotations

import json
import struct
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from kvlab.core.errors import ConfigError
from kvlab.model.schedule import Chunk, Staging
from kvlab.model.state import CacheState
from kvlab.transports import RankContext, Transport
from kvlab.transports import nixl_agent as nixl
from kvlab.transports.deadline import spin_for, wait_until
from kvlab.transports.direct import block_tables, coalesce, flip_landed, own_runs, pair_runs, rank_runs
from kvlab.transports.p2p import narrow
from kvlab.transports.staged import ChunkStaging

MODES = ("direct", "staged")
STUCK = object()  # fault injection: the WRITE of a chunk that never progresses (kvlab.config.faults: stuck)


def descs(addr: np.ndarray, length: np.ndarray, dev: int) -> np.ndarray:
    out = np.empty((len(addr), 3), dtype=np.uint64)
    out[:, 0], out[:, 1], out[:, 2] = addr, length, dev
    return out


@dataclass
class Write:
    """A chunk on the ctx rank: packed (or not), waiting for the gen rank's room, then WRITE in flight."""

    index: int
    chunk: Chunk
    rec: object
    buf: torch.Tensor | None  # the chunk in wire order (a slot, or the pool in place); None: direct from runs
    staged: bool
    event: object = None  # the pack's completion on GPUs: NIXL does not follow CUDA streams
    xfer: object = None
    kept: bool = False  # the WRITE is a prepared slot-to-slot one, posted again by later chunks
    posted: object = None
    reg: object = None  # a per-chunk buffer's registration (naive)


@dataclass
class Landing:
    """A chunk on the gen rank: room announced, bytes awaited."""

    index: int
    chunk: Chunk
    buf: torch.Tensor | None
    staged: bool
    posted: object
    reg: object = None  # a per-chunk buffer's registration (naive)
    notice: bytes = b""  # the announcement to send (where the bytes go); empty: nothing to announce
    after: object = None  # GPUs: the event of the slot's last unpack, announced once it has completed


@dataclass
class Peer:
    agent: str
    pools: dict = field(default_factory=dict)  # pool name -> (address, blocks)
    dev: int = 0
    state: CacheState | None = None


class Nixl(Transport):
    link_reference = "nixl"  # kvlab.rank.linkrate: raw NIXL WRITEs of the run's chunk size between its pairs
    polls = False  # its own notifications, not the pair groups' ops: finished when the executor must
    has = staticmethod(lambda options: frozenset() if options.get("mode") == "direct" else frozenset({"slots"}))
    # fault injection: a ctx rank's notice is the WRITE's notification, a gen rank's its room or block tables
    injects = {"drop_notice": frozenset({"ctx", "gen"}), "wrong_request": frozenset({"ctx", "gen"}),
               "stuck": frozenset({"ctx"}), "reused_block": frozenset({"ctx", "gen"}),
               "torn_chunk": frozenset({"ctx"})}

    def __init__(self, setup, side, rank, world_rank, device, mode: str = "staged", pack_ctas: int | None = None,
                 progress_thread: bool = False):
        super().__init__(setup, side, rank, world_rank, device)
        self.staging: ChunkStaging | None = None  # direct mode stages nothing (but a chunk to corrupt)
        self.mode = mode
        self.pack_ctas = pack_ctas
        self.progress_thread = progress_thread
        self.agent = None
        self.regs: list = []
        self.peers: dict[int, Peer] = {}  # side-local rank of the other side -> its agent and memory
        self.inbox: dict[bytes, bytes] = {}  # notifications by key, until their chunk takes them
        self.waiting: list[Write] = []  # ctx: chunks packed, not yet written
        self.unannounced: deque[Landing] = deque()  # gen: chunks whose notice waits its turn (GPUs: an unpack)
        self.after_unpack: dict[int, object] = {}  # gen, GPUs: slot -> event of its last unpack
        self.xfers: dict[tuple, object] = {}  # ctx: prepared slot-to-slot WRITEs, posted again per chunk
        self.told: set[tuple[int, int]] = set()  # gen, direct: (request, ctx rank) sent the block tables
        self.tables: dict[tuple[int, int], dict] = {}  # ctx, direct: (request, gen rank) -> its block tables
        self.spin_s = spin_for(device)
        self.shut = False  # close() has run
        self.per_chunk = False  # naive: a buffer per chunk, registered for that chunk only
        self.window = setup.transfer.slots  # chunk i uses slot i % slots

    @classmethod
    def check(cls, setup) -> None:
        mode = setup.transport.options.get("mode", "staged")
        if mode not in MODES:
            raise ConfigError("transport.mode", mode, "use direct (runs straight into the gen pool) or staged "
                              "(one WRITE per chunk through registered slots)")
        ctas = setup.transport.options.get("pack_ctas")
        if ctas is not None and (not isinstance(ctas, int) or isinstance(ctas, bool) or ctas < 1):
            raise ConfigError("transport.pack_ctas", ctas, "use a positive number of CTAs, or null for one per SM")
        thread = setup.transport.options.get("progress_thread", False)
        if not isinstance(thread, bool):
            raise ConfigError("transport.progress_thread", thread, "use true (NIXL's own thread progresses WRITEs "
                              "and notifications) or false (the rank polls them)")

    @classmethod
    def installed(cls, setup) -> None:
        nixl.api()
        nixl.probe_ucx()

    @property
    def peak_staging_bytes(self) -> int:
        return self.staging.peak_bytes if self.staging is not None else 0

    # -- start-up ---------------------------------------------------------------------------
    def connect(self, ctx: RankContext) -> None:
        """Agent, registrations, peers' metadata and memory through the store, one notification each way."""
        self.ctx = ctx
        t = self.setup.transfer
        # NIXL's WRITE runs on copy engines (one node) or the NIC, not on SMs: unlike NCCL's sends, nothing
        # needs the SMs the pack/unpack kernels would leave free (transfer.pack_ctas is for p2p)
        ctas = self.pack_ctas
        if ctas is None and self.device.type == "cuda":
            ctas = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.ops = narrow(ctx.ops, ctas or t.pack_ctas)
        # direct mode stages nothing, except a chunk that fault injection corrupts on its way out
        if self.mode == "staged" or (self.sending and ctx.faults.flips):
            self.staging = ChunkStaging(ctx, self.ops)
        self.per_chunk = self.staging is not None and self.staging.per_chunk
        me = f"{self.side}{self.rank}"
        self.agent = nixl.agent(me, self.progress_thread)
        pools = ctx.cache.pools
        tensors = [s.storage for s in pools.values()]
        if self.staging is not None and self.staging.slots is not None:
            tensors.append(self.staging.slots.storage)
        self.regs = nixl.register(self.agent, tensors)
        store = dist.distributed_c10d._get_default_store()
        info = {"pools": {n: (s.storage.data_ptr(), s.num_blocks) for n, s in pools.items()},
                "dev": nixl.device_id(tensors[0])}
        store.set(f"nixl/info/{me}", json.dumps(info))
        other = "gen" if self.sending else "ctx"
        spec = self.setup.gen if self.sending else self.setup.ctx
        names = [f"{other}{r}" for r in range(spec.size)]
        agents = nixl.connect(self.agent, store, "nixl/md", names)
        for r, name in enumerate(names):
            got = json.loads(store.get(f"nixl/info/{name}"))
            self.peers[r] = Peer(agents[name], {n: tuple(v) for n, v in got["pools"].items()}, got["dev"],
                                 CacheState(self.setup.model, spec, r))
        # endpoints are built at the first message: not inside the first timed chunk
        for p in self.peers.values():
            self.agent.send_notif(p.agent, b"H")
        deadline = time.time() + max(t.timeout_s, 30.0)
        for p in self.peers.values():
            self._await(b"H", p.agent, deadline,
                        lambda p=p: RuntimeError(f"nixl: agent {p.agent} did not answer within the start-up deadline"))

    # -- the in-run link reference (kvlab.rank.linkrate) -----------------------------------------
    def raw_writes(self, nbytes: int, n: int, pairs: list[tuple[int, int]]) -> float:
        """Seconds this rank took, from a barrier, for its pairs' ``n`` raw WRITEs of ``nbytes`` each (one
        untimed round first): a ctx rank WRITEs round-robin over its gen ranks, ``transfer.slots`` in flight
        as the transfer has (one for the naive baseline, as p2p's reference); a gen rank is done when every
        WRITE's notification has arrived. One buffer of one message per rank, registered for this measure
        alone; every wait is bounded by ``transfer.timeout_s``."""
        store = dist.distributed_c10d._get_default_store()
        mine = [(c, g) for c, g in pairs if (c if self.sending else g) == self.rank]
        window = self.setup.transfer.slots if self.setup.transfer.strategy.staging == Staging.slots else 1
        timeout = self.setup.transfer.timeout_s
        buf = torch.empty(nbytes if mine else 1, dtype=torch.uint8, device=self.device)
        reg = self.agent.register_memory(buf)
        dev, mem = nixl.device_id(buf), nixl.mem_type(buf)

        def late(what: str) -> RuntimeError:
            return RuntimeError(f"nixl link reference: {what} not done within {timeout:g} s")

        xfers: dict[int, list] = {}
        if not self.sending:
            # the ctx agents learn this buffer's key from its partial metadata: it came after connect
            store.set(f"nixl/link/gen{self.rank}",
                      struct.pack("<Q", buf.data_ptr()) + self.agent.get_partial_agent_metadata(reg, False))

            def rounds(tag: bytes, count: int) -> None:
                deadline = time.time() + timeout
                for k in range(count):
                    for c, _ in mine:
                        self._await(b"%s%d" % (tag, k), self.peers[c].agent, deadline,
                                    lambda c=c: late(f"a WRITE from ctx{c}"))
        else:
            one = np.array([nbytes], dtype=np.int64)
            for _, g in mine:
                got = store.get(f"nixl/link/gen{g}")
                self.agent.add_remote_agent(got[8:])
                dst = np.array(struct.unpack("<Q", got[:8]), dtype=np.int64)
                peer = self.peers[g]
                # a handle is posted again only once it is done: one per message in flight
                xfers[g] = [self.agent.initialize_xfer(
                    "WRITE", self.agent.get_xfer_descs(descs(np.array([buf.data_ptr()]), one, dev), mem),
                    self.agent.get_xfer_descs(descs(dst, one, peer.dev), mem), peer.agent) for _ in range(window)]

            def done(x, deadline: float) -> None:
                wait_until(lambda: self.agent.check_xfer_state(x) != "PROC", deadline, lambda: late("a WRITE"),
                           spin_s=self.spin_s)
                if self.agent.check_xfer_state(x) != "DONE":
                    raise late("a WRITE")

            def rounds(tag: bytes, count: int) -> None:
                deadline, inflight = time.time() + timeout, deque()
                for j in range(count * len(mine)):
                    k, at = divmod(j, len(mine))
                    if len(inflight) >= window:
                        done(inflight.popleft(), deadline)
                    x = xfers[mine[at][1]][k % window]
                    if self.agent.transfer(x, b"%s%d" % (tag, k)) == "ERR":
                        raise late("a WRITE")
                    inflight.append(x)
                while inflight:
                    done(inflight.popleft(), deadline)

        try:
            rounds(b"LW", 1)  # the first WRITEs of this size: endpoints and registrations warm, not timed
            dist.barrier()
            t0 = time.perf_counter()
            rounds(b"L", n)
            seconds = time.perf_counter() - t0
            dist.barrier()  # every WRITE has landed before a gen rank frees its buffer
        finally:
            for x in (x for xs in xfers.values() for x in xs):
                x.release()
            self.agent.deregister_memory(reg)
        return seconds

    # -- notifications ----------------------------------------------------------------------
    def _poll(self) -> None:
        for sender, msgs in self.agent.get_new_notifs().items():
            for m in msgs:
                key, _, payload = bytes(m).partition(b" ")
                self.inbox[key + b"@" + (sender.encode() if isinstance(sender, str) else sender)] = payload

    def _take(self, key: bytes, agent: str) -> bytes | None:
        return self.inbox.pop(key + b"@" + agent.encode(), None)

    def _await(self, key: bytes, agent: str, deadline: float, err) -> bytes:
        got: list[bytes] = []

        def arrived() -> bool:
            self._announce()
            self._poll()
            payload = self._take(key, agent)
            if payload is not None:
                got.append(payload)
            return bool(got)

        wait_until(arrived, deadline, err, spin_s=self.spin_s)
        return got[0]

    @staticmethod
    def _key(kind: bytes, c: Chunk) -> bytes:
        return b"%s%d.%d" % (kind, c.request, c.seq)

    # -- chunks -----------------------------------------------------------------------------
    def _landing(self, c: Chunk, peer: Peer) -> dict | None:
        """Ctx, direct: the gen rank's block tables of the chunk's request, once they have arrived."""
        key = (c.request, c.dst)
        if key not in self.tables:
            got = self._take(b"T%d" % c.request, peer.agent)
            if got is None:
                return None
            self.tables[key] = {name: (v[0], torch.tensor(v[1:], dtype=torch.int64))
                                for name, v in json.loads(got).items()}
        return self.tables[key]

    def start(self, i: int, c: Chunk, rec):
        clock = self.ctx.clock
        if not self.sending:
            if self.mode == "direct":
                # the request's blocks are allocated at its first chunk here and stay until it is verified:
                # one notice per (request, ctx rank) with its block tables lets the ctx rank address every chunk
                h = Landing(i, c, None, False, clock.mark())
                if (c.request, c.src) not in self.told:
                    self.told.add((c.request, c.src))
                    n = self.ctx.faults.notice(i, c)
                    if n is not None:
                        h.notice = b"T%d " % n.request + block_tables(self.ctx, c.request).encode()
                self.unannounced.append(h)
                self._announce()
                return h
            buf, staged = self.staging.buffer(i, c)
            n = self.ctx.faults.notice(i, c)
            h = Landing(i, c, buf, staged, clock.mark(), notice=b"" if n is None else
                        self._key(b"R", n) + b" " + struct.pack("<QQ", buf.data_ptr(), buf.numel()))
            if staged and self.per_chunk:
                # the naive baseline's buffer is new memory: registered now, and its partial metadata
                # (the key the ctx agent needs to write into it) travels with the announcement
                h.reg = self.agent.register_memory(buf)
                if h.notice:
                    h.notice += self.agent.get_partial_agent_metadata(h.reg, False)
            elif staged:
                h.after = self.after_unpack.pop(i % self.window, None)  # the slot is free once that has run
            self.unannounced.append(h)
            self._announce()
            return h
        self.ctx.faults.reuse(self.ctx, i, c)  # fault injection: before the chunk's bytes are read
        if self.mode == "direct":
            buf, staged = None, False
        else:
            buf, staged = self.staging.buffer(i, c)
            if staged:
                self.staging.copy(c, buf, rec)
        if self.staging is not None:
            buf, staged = self.staging.flip_outgoing(i, c, buf, staged, rec)
        w = Write(i, c, rec, buf, staged)
        if staged and self.per_chunk:
            w.reg = self.agent.register_memory(buf)
        if self.device.type == "cuda":
            w.event = torch.cuda.Event()
            w.event.record()
        self.waiting.append(w)
        self._pump()
        return w

    def _announce(self) -> None:
        """Gen: announce, in order, the chunks whose landing place is free (on GPUs: the slot's last unpack
        has run; the host does not wait for it)."""
        while self.unannounced and (self.unannounced[0].after is None or self.unannounced[0].after.query()):
            h = self.unannounced.popleft()
            h.after = None
            if h.notice:
                self._send(self.peers[h.chunk.src].agent, h.notice, h.chunk)

    def _send(self, agent: str, msg: bytes, c: Chunk) -> None:
        try:
            self.agent.send_notif(agent, msg)
        except Exception as e:  # noqa: BLE001 - NIXL's errors are plain Exceptions (remote disconnect, ...)
            raise self.failed(c, "notification failed", e) from e

    def _pump(self) -> None:
        """WRITE every packed chunk whose room on the gen rank has been announced."""
        if not self.waiting:
            return
        self._poll()
        still = []
        for w in self.waiting:
            peer = self.peers[w.chunk.dst]
            if w.event is not None and not w.event.query():
                room = None  # (GPUs) still packing: the host does not wait for the device
            elif self.mode == "direct":
                room = self._landing(w.chunk, peer)
            else:
                room = self._take(self._key(b"R", w.chunk), peer.agent)
            if room is None:
                still.append(w)
            else:
                self._write(w, peer, room)
        self.waiting = still

    def _write(self, w: Write, peer: Peer, room) -> None:
        """WRITE a chunk to where ``room`` says: staged, the gen slot's (address, bytes[, key]); direct, the gen
        rank's block tables of the request."""
        c = w.chunk
        storage = self.ctx.cache.pools[c.rect.pool].storage
        dev, mem = nixl.device_id(storage), nixl.mem_type(storage)
        if self.mode == "staged":
            addr, n = struct.unpack("<QQ", room[:16])
            if len(room) > 16:  # a buffer registered for this chunk alone
                self.agent.add_remote_agent(room[16:])
            if n != c.nbytes:
                raise self.failed(c, f"gen rank offers {n} B for a {c.nbytes} B chunk")
            src, dst, length = (np.array([w.buf.data_ptr()], dtype=np.int64), np.array([addr], dtype=np.int64),
                                np.array([n], dtype=np.int64))
        else:
            base, ids = room[c.rect.pool]
            base_addr, blocks = peer.pools[c.rect.pool]
            dmem, dwire, length = rank_runs(peer.state.pool(c.rect.pool), blocks, c, ids, base)
            dst = base_addr + dmem
            if w.buf is not None:  # corrupted on its way out: from the staging copy, in wire order
                src = w.buf.data_ptr() + dwire
            else:  # this side's runs are cut elsewhere when the layouts differ: each write within both
                smem, swire, _ = own_runs(self.ctx, c)
                src, dst, length = pair_runs(storage.data_ptr() + smem, swire, dst, dwire, length)
            src, dst, length = coalesce(src, dst, length)
        faults = self.ctx.faults
        if faults.stuck(w.index, c):  # fault injection: posted, and never progresses
            w.xfer, w.posted = STUCK, self.ctx.clock.mark()
            return
        if faults.torn(w.index, c):  # fault injection: half the bytes land, then the sender dies
            self._torn(c, *faults.half(src, dst, length), dev, mem, peer)
        w.rec.descriptors += len(length)
        # a WRITE between two slots is prepared once and posted again; any other (runs, a pool in place,
        # a per-chunk buffer) is prepared for this chunk and released when it is done
        key = (int(src[0]), int(dst[0]), int(length[0]), peer.agent) if w.staged and not self.per_chunk else None
        try:
            w.xfer = self.xfers.get(key) if key else None
            if w.xfer is None:
                w.xfer = self.agent.initialize_xfer("WRITE", self.agent.get_xfer_descs(descs(src, length, dev), mem),
                                                    self.agent.get_xfer_descs(descs(dst, length, peer.dev), mem),
                                                    peer.agent)
                if key:
                    self.xfers[key] = w.xfer
            w.kept = key is not None
            w.posted = self.ctx.clock.mark()
            n = self.ctx.faults.notice(w.index, c)
            # a dropped notice: a key no chunk waits for (NIXL keeps a prepared WRITE's last notification)
            if self.agent.transfer(w.xfer, self._key(b"D", n) if n is not None else b"-") == "ERR":
                raise RuntimeError("NIXL refused the WRITE")
        except Exception as e:  # noqa: BLE001 - NIXL's errors are plain Exceptions (remote disconnect, ...)
            raise self.failed(c, "WRITE failed", e) from e

    def _torn(self, c: Chunk, src, dst, length, dev: int, mem: str, peer: Peer) -> None:
        """fault.transfer=torn_chunk: WRITE these runs with no notification, wait until they have landed, die."""
        x = self.agent.initialize_xfer("WRITE", self.agent.get_xfer_descs(descs(src, length, dev), mem),
                                       self.agent.get_xfer_descs(descs(dst, length, peer.dev), mem), peer.agent)
        self.agent.transfer(x)
        wait_until(lambda: self.agent.check_xfer_state(x) != "PROC", time.time() + self.setup.transfer.timeout_s,
                   lambda: self.failed(c, "half WRITE not done"), spin_s=self.spin_s)
        self.ctx.faults.die()

    def finish(self, h, rec) -> bool:
        c, timeout = h.chunk, self.setup.transfer.timeout_s
        deadline = time.time() + timeout
        late = lambda: self.failed(c, f"not done within {timeout:g} s or peer gone")  # noqa: E731
        if not self.sending:
            self._await(self._key(b"D", c), self.peers[c.src].agent, deadline, late)
            rec.wire.append((h.posted, self.ctx.clock.mark()))
            flip_landed(self.ctx, h.index, h.chunk, h.buf)
            if h.staged:
                self.staging.copy(c, h.buf, rec)
                if self.device.type == "cuda" and not self.per_chunk:
                    ev = torch.cuda.Event()
                    ev.record()
                    self.after_unpack[h.index % self.window] = ev
                self._release(h)
            self.ctx.faults.reuse(self.ctx, h.index, c)  # fault injection: once the bytes have landed
            return not h.staged
        def written() -> bool:
            self._pump()
            if h.xfer is None or h.xfer is STUCK:
                return False
            try:
                state = self.agent.check_xfer_state(h.xfer)
            except Exception as e:  # noqa: BLE001
                raise self.failed(c, "WRITE failed", e) from e
            if state == "ERR":
                raise self.failed(c, "WRITE failed")
            return state == "DONE"

        wait_until(written, deadline, late, spin_s=self.spin_s)
        rec.wire.append((h.posted, self.ctx.clock.mark()))
        if not h.kept:
            h.xfer.release()
        h.xfer = None
        if h.staged:
            self._release(h)
        return not h.staged

    def closed(self, request: int) -> None:
        """The request's block tables are no longer needed on either side (direct)."""
        self.told = {k for k in self.told if k[0] != request}
        self.tables = {k: v for k, v in self.tables.items() if k[0] != request}

    def _release(self, h) -> None:
        if h.reg is not None:
            self.agent.deregister_memory(h.reg)
            h.reg = None
        self.staging.put(h.buf)

    def abandon(self, h) -> None:
        if isinstance(h, Write):
            if h in self.waiting:
                self.waiting.remove(h)
            if h.xfer not in (None, STUCK) and not h.kept:  # a prepared one is released in close
                try:
                    h.xfer.release()
                except Exception:  # noqa: BLE001 - a WRITE to a dead peer may not be cancellable; the run ends
                    pass
            h.xfer = None
        elif h in self.unannounced:
            self.unannounced.remove(h)
        if h.staged and self.staging is not None:
            self._release(h)

    def close(self) -> None:
        if self.shut or self.agent is None:
            self.shut = True
            return
        self.shut = True
        for x in self.xfers.values():
            try:
                x.release()
            except Exception:  # noqa: BLE001 - one still in flight to a dead peer may not be releasable
                pass
        self.xfers = {}
        for p in self.peers.values():
            try:
                self.agent.remove_remote_agent(p.agent)
            except Exception:  # noqa: BLE001 - the peer may be gone already
                pass
        for reg in self.regs:
            self.agent.deregister_memory(reg)
        self.regs, self.agent = [], None
