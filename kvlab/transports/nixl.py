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
from kvlab.transports import RankContext, write_notify
from kvlab.transports import nixl_agent as nixl
from kvlab.transports.deadline import wait_until
from kvlab.transports.write_notify import Landing, WriteNotify

STUCK = object()  # fault injection: the WRITE of a chunk that never progresses (kvlab.config.faults: stuck)


def descs(addr: np.ndarray, length: np.ndarray, dev: int) -> np.ndarray:
    out = np.empty((len(addr), 3), dtype=np.uint64)
    out[:, 0], out[:, 1], out[:, 2] = addr, length, dev
    return out


@dataclass
class Write(write_notify.Write):
    """A chunk on the ctx rank: packed (or not), waiting for the gen rank's room, then its WRITE in flight."""

    xfer: object = None
    kept: bool = False  # the WRITE is a prepared slot-to-slot one, posted again by later chunks


@dataclass
class Peer:
    agent: str
    pools: dict = field(default_factory=dict)  # pool name -> (address, blocks)
    dev: int = 0
    state: CacheState | None = None


class Nixl(WriteNotify):
    """The chunk's life is kvlab.transports.write_notify's; NIXL's agent, WRITEs and notifications here."""

    link_reference = "nixl"  # kvlab.rank.linkrate: raw NIXL WRITEs of the run's chunk size between its pairs
    write_cls = Write
    polls = False  # its own notifications, not the pair groups' ops: finished when the executor must

    def __init__(self, setup, side, rank, world_rank, device, mode: str = "staged", pack_ctas: int | None = None,
                 progress_thread: bool = False):
        super().__init__(setup, side, rank, world_rank, device, mode, pack_ctas)
        self.progress_thread = progress_thread
        self.agent = None
        self.regs: list = []
        self.peers: dict[int, Peer] = {}  # side-local rank of the other side -> its agent and memory
        self.inbox: dict[bytes, bytes] = {}  # notifications by key, until their chunk takes them
        self.xfers: dict[tuple, object] = {}  # ctx: prepared slot-to-slot WRITEs, posted again per chunk

    @classmethod
    def check(cls, setup) -> None:
        cls.check_mode(setup.transport.options, "runs straight into the gen pool",
                       "one WRITE per chunk through registered slots")
        thread = setup.transport.options.get("progress_thread", False)
        if not isinstance(thread, bool):
            raise ConfigError("transport.progress_thread", thread, "use true (NIXL's own thread progresses WRITEs "
                              "and notifications) or false (the rank polls them)")

    @classmethod
    def installed(cls, setup) -> None:
        nixl.api()
        nixl.probe_ucx()

    # -- start-up ---------------------------------------------------------------------------
    def connect(self, ctx: RankContext) -> None:
        """Agent, registrations, peers' metadata and memory through the store, one notification each way."""
        super().connect(ctx)
        t = self.setup.transfer
        self._stage(ctx)
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

    # -- chunks (the engine's side of kvlab.transports.write_notify) ----------------------------------
    def _register_buffer(self, buf: torch.Tensor) -> object:
        return self.agent.register_memory(buf)

    def _deregister_buffer(self, reg: object) -> None:
        self.agent.deregister_memory(reg)

    def _pump(self) -> None:
        if self.waiting:
            self._poll()  # once for all the chunks waiting: their rooms and tables come as notifications
            super()._pump()

    def _room(self, c: Chunk):
        return self._take(self._key(b"R", c), self.peers[c.dst].agent)

    def _tables_sent(self, c: Chunk) -> bytes | None:
        return self._take(b"T%d" % c.request, self.peers[c.dst].agent)

    def _room_notice(self, c: Chunk, buf: torch.Tensor, reg: object) -> bytes:
        msg = self._key(b"R", c) + b" " + struct.pack("<QQ", buf.data_ptr(), buf.numel())
        # a buffer registered for this chunk alone: the key the ctx agent needs to write into it travels with it
        return msg if reg is None else msg + self.agent.get_partial_agent_metadata(reg, False)

    def _tables_notice(self, c: Chunk, tables: str) -> bytes:
        return b"T%d " % c.request + tables.encode()

    def _publish(self, h: Landing) -> None:
        self._send(self.peers[h.chunk.src].agent, h.notice, h.chunk)

    def _send(self, agent: str, msg: bytes, c: Chunk) -> None:
        try:
            self.agent.send_notif(agent, msg)
        except Exception as e:  # noqa: BLE001 - NIXL's errors are plain Exceptions (remote disconnect, ...)
            raise self.failed(c, "notification failed", e) from e

    def _write(self, w: Write, room) -> None:
        """WRITE a chunk to where ``room`` says: staged, the gen slot's (address, bytes[, key]); direct, the gen
        rank's block tables of the request."""
        c = w.chunk
        peer = self.peers[c.dst]
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
            src, dst, length = self._runs(w, room, peer)
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

    def _arrived(self, h: Landing, deadline: float) -> None:
        c = h.chunk
        self._await(self._key(b"D", c), self.peers[c.src].agent, deadline, self._late(c))

    def _written(self, w: Write, rec, deadline: float) -> None:
        c = w.chunk

        def written() -> bool:
            self._pump()
            if w.xfer is None or w.xfer is STUCK:
                return False
            try:
                state = self.agent.check_xfer_state(w.xfer)
            except Exception as e:  # noqa: BLE001
                raise self.failed(c, "WRITE failed", e) from e
            if state == "ERR":
                raise self.failed(c, "WRITE failed")
            return state == "DONE"

        wait_until(written, deadline, self._late(c), spin_s=self.spin_s)
        rec.wire.append((w.posted, self.ctx.clock.mark()))
        if not w.kept:
            w.xfer.release()
        w.xfer = None

    def _let_go(self, w: Write) -> None:
        if w.xfer not in (None, STUCK) and not w.kept:  # a prepared one is released in close
            try:
                w.xfer.release()
            except Exception:  # noqa: BLE001 - a WRITE to a dead peer may not be cancellable; the run ends
                pass
        w.xfer = None

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
