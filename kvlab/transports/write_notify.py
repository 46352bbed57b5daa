"""What the one-sided transports (``nixl``, ``mooncake``) share: the ctx rank writes each chunk into the gen rank's
memory once the gen rank has said where, and tells it when the bytes are there.

The chunk's life, the same whatever moves the bytes:

- ctx ``start``: the chunk is packed into a staging slot (``staged``; or the pool is used where the chunk lies in
  wire order) or left in the pool (``direct``), an event is recorded after the pack on GPUs (neither engine
  follows CUDA streams), and the chunk waits in ``waiting``. ``_pump`` writes each waiting chunk whose pack has
  completed and whose room has come (``_room``: the gen slot a staged chunk goes to, or the block tables of the
  chunk's request, ``_tables_sent``, for a direct one) with the subclass's ``_write``.
- gen ``start``: a staged chunk gets a slot and a notice of it (``_room_notice``); a direct request's first chunk
  from each ctx rank a notice of its block tables (``_tables_notice``). Notices go out in chunk order
  (``_announce``, through the subclass's ``_publish``), each once its slot's last unpack has run.
- gen ``finish``: the subclass's ``_arrived`` waits for the ctx rank's word that the bytes are there; the bytes
  are then unpacked (staged) and the slot given back. ctx ``finish`` is the subclass's (``_written``).

A subclass gives the engine's side of it: ``_register_buffer``/``_deregister_buffer`` (the naive baseline's
per-chunk buffers), ``_room``, ``_tables_sent``, ``_room_notice``, ``_tables_notice``, ``_publish``,
``_write``, ``_arrived``, ``_written`` and ``_let_go`` (a write abandoned).
"""
from __future__ import annotations

import contextlib
import json
from abc import abstractmethod
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from kvlab.core.errors import ConfigError
from kvlab.model.schedule import Chunk
from kvlab.transports import RankContext, Transport
from kvlab.transports.deadline import spin_for
from kvlab.transports.direct import block_tables, coalesce, flip_landed, own_runs, pair_runs, rank_runs
from kvlab.transports.p2p import narrow
from kvlab.transports.staged import ChunkStaging

MODES = ("direct", "staged")


@dataclass
class Write:
    """A chunk on the ctx rank: packed (or not), waiting for the gen rank's room, then its writes in flight."""

    index: int
    chunk: Chunk
    rec: object
    buf: torch.Tensor | None  # the chunk in wire order (a slot, or the pool in place); None: direct from runs
    staged: bool
    event: object = None  # GPUs: the pack's (or the layers') completion; the engines do not follow streams
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
    notice: object = None  # what ``_publish`` sends (where the bytes go); None: nothing to announce
    after: object = None  # GPUs: the event of the slot's last unpack, announced once it has completed


@contextlib.contextmanager
def packing(stream):
    """Work queued meanwhile goes on ``stream`` (after everything queued so far on the current one), or stays on the
    current stream where ``stream`` is None."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield


class WriteNotify(Transport):
    """Base of the one-sided transports; the module's docstring gives the protocol a subclass fills in."""

    has = staticmethod(lambda options: frozenset() if options.get("mode") == "direct" else frozenset({"slots"}))
    # fault injection: a ctx rank's notice is its word that the bytes are there, a gen rank's its room or tables
    injects = {"drop_notice": frozenset({"ctx", "gen"}), "wrong_request": frozenset({"ctx", "gen"}),
               "stuck": frozenset({"ctx"}), "reused_block": frozenset({"ctx", "gen"}),
               "torn_chunk": frozenset({"ctx"})}

    write_cls = Write  # a subclass's Write, with what its engine keeps of a chunk's writes

    def __init__(self, setup, side, rank, world_rank, device, mode: str = "staged", pack_ctas: int | None = None):
        super().__init__(setup, side, rank, world_rank, device)
        self.mode = mode
        self.pack_ctas = pack_ctas
        self.waiting: list[Write] = []  # ctx: chunks packed, not yet written
        self.unannounced: deque[Landing] = deque()  # gen: chunks whose notice waits its turn (GPUs: an unpack)
        self.after_unpack: dict[int, object] = {}  # gen, GPUs: slot -> event of its last unpack
        self.told: set[tuple[int, int]] = set()  # gen, direct: (request, ctx rank) sent the block tables
        self.tables: dict[tuple[int, int], dict] = {}  # ctx, direct: (request, gen rank) -> its block tables
        self.spin_s = spin_for(device)
        self.pack_stream = None  # ctx, GPUs, staged: where the packs run, where a subclass needs it
        self.shut = False  # close() has run
        self.per_chunk = False  # naive: a buffer per chunk, registered for that chunk only
        self.window = setup.transfer.slots  # chunk i uses slot i % slots

    @classmethod
    def check_mode(cls, options: dict, direct: str, staged: str) -> None:
        mode = options.get("mode", "staged")
        if mode not in MODES:
            raise ConfigError("transport.mode", mode, f"use direct ({direct}) or staged ({staged})")
        ctas = options.get("pack_ctas")
        if ctas is not None and (not isinstance(ctas, int) or isinstance(ctas, bool) or ctas < 1):
            raise ConfigError("transport.pack_ctas", ctas, "use a positive number of CTAs, or null for one per SM")

    def _stage(self, ctx: RankContext) -> None:
        """The pack/unpack kernels and the staging of ``connect``. The engines' writes run on copy engines (one
        node) or the NIC, not on SMs: unlike NCCL's sends, nothing needs the SMs the kernels would leave free, so
        they take them all unless ``pack_ctas`` says otherwise (``transfer.pack_ctas`` is for p2p). Direct mode
        stages nothing, except a chunk that fault injection corrupts on its way out."""
        ctas = self.pack_ctas
        if ctas is None and self.device.type == "cuda":
            ctas = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.ops = narrow(ctx.ops, ctas or self.setup.transfer.pack_ctas)
        if self.mode == "staged" or (self.sending and ctx.faults.flips):
            self.staging = ChunkStaging(ctx, self.ops)
        self.per_chunk = self.staging is not None and self.staging.per_chunk

    # -- the engine's side ------------------------------------------------------------------------
    @abstractmethod
    def _register_buffer(self, buf: torch.Tensor) -> object:
        """Register a per-chunk buffer (the naive baseline's) with the engine; its registration."""

    @abstractmethod
    def _deregister_buffer(self, reg: object) -> None:
        """Undo ``_register_buffer``."""

    @abstractmethod
    def _room(self, c: Chunk):
        """Ctx, staged: the gen slot chunk ``c`` goes to, once its notice has come; else None."""

    @abstractmethod
    def _tables_sent(self, c: Chunk) -> str | bytes | None:
        """Ctx, direct: the gen rank's notice of the block tables of ``c``'s request (JSON), once it has come."""

    @abstractmethod
    def _room_notice(self, c: Chunk, buf: torch.Tensor, reg: object) -> object:
        """Gen, staged: the notice that chunk ``c`` may go to ``buf`` (registered as ``reg``, or None)."""

    @abstractmethod
    def _tables_notice(self, c: Chunk, tables: str) -> object:
        """Gen, direct: the notice of the block tables (JSON) of ``c``'s request to ``c``'s ctx rank."""

    @abstractmethod
    def _publish(self, h: Landing) -> None:
        """Gen: send ``h.notice`` to its chunk's ctx rank."""

    @abstractmethod
    def _write(self, w: Write, room) -> None:
        """Ctx: write chunk ``w`` to where ``room`` says (the gen slot, or the request's block tables)."""

    @abstractmethod
    def _arrived(self, h: Landing, deadline: float) -> None:
        """Gen: return once the ctx rank has said that chunk ``h``'s bytes are here; ChunkFailed by ``deadline``."""

    @abstractmethod
    def _written(self, w: Write, rec, deadline: float) -> None:
        """Ctx: return once chunk ``w``'s writes are complete, with one ``(posted, done)`` in ``rec.wire``."""

    @abstractmethod
    def _let_go(self, w: Write) -> None:
        """Ctx: a chunk's writes that will never be finished."""

    # -- chunks -----------------------------------------------------------------------------
    def start(self, i: int, c: Chunk, rec):
        if not self.sending:
            return self._land(i, c)
        self.ctx.faults.reuse(self.ctx, i, c)  # fault injection: before the chunk's bytes are read
        if self.mode == "direct":
            buf, staged = None, False
        else:
            buf, staged = self.staging.buffer(i, c)
        side = self.pack_stream if staged and not self.per_chunk and i not in self.ctx.faults.flips else None
        with packing(side):
            if staged:
                self.staging.copy(c, buf, rec)
            if self.staging is not None:
                buf, staged = self.staging.flip_outgoing(i, c, buf, staged, rec)
            w = self.write_cls(i, c, rec, buf, staged)
            if self.device.type == "cuda":
                w.event = torch.cuda.Event()
                w.event.record()
        if staged and self.per_chunk:
            w.reg = self._register_buffer(buf)
        self.waiting.append(w)
        self._pump()
        return w

    def _late(self, c: Chunk):
        """The failure of chunk ``c`` at its deadline, for ``wait_until``."""
        return lambda: self.failed(c, f"not done within {self.setup.transfer.timeout_s:g} s or peer gone")

    def _land(self, i: int, c: Chunk) -> Landing:
        """Gen ``start``: where the chunk lands, and the notice that says so, queued in chunk order."""
        mark = self.ctx.clock.mark()
        if self.mode == "direct":
            # the request's blocks are allocated at its first chunk here and stay until it is verified: one notice
            # per (request, ctx rank) with the block tables lets the ctx rank address every chunk
            h = Landing(i, c, None, False, mark)
            if (c.request, c.src) not in self.told:
                self.told.add((c.request, c.src))
                n = self.ctx.faults.notice(i, c)
                if n is not None:
                    h.notice = self._tables_notice(n, block_tables(self.ctx, c.request))
        else:
            buf, staged = self.staging.buffer(i, c)
            h = Landing(i, c, buf, staged, mark)
            if staged and self.per_chunk:
                # the naive baseline's buffer is new memory: registered before it is announced (the peer's engine
                # checks a write against the registrations, or needs the registration's key to write at all)
                h.reg = self._register_buffer(buf)
            elif staged:
                h.after = self.after_unpack.pop(i % self.window, None)  # the slot is free once that has run
            n = self.ctx.faults.notice(i, c)
            if n is not None:
                h.notice = self._room_notice(n, buf, h.reg)
        self.unannounced.append(h)
        self._announce()
        return h

    def _announce(self) -> None:
        """Gen: announce, in order, the chunks whose landing place is free (on GPUs: the slot's last unpack
        has run; the host does not wait for it)."""
        while self.unannounced and (self.unannounced[0].after is None or self.unannounced[0].after.query()):
            h = self.unannounced.popleft()
            h.after = None
            if h.notice:
                self._publish(h)

    def _landing(self, c: Chunk) -> dict | None:
        """Ctx, direct: the gen rank's block tables of the chunk's request, once they have arrived."""
        key = (c.request, c.dst)
        if key not in self.tables:
            got = self._tables_sent(c)
            if got is None:
                return None
            self.tables[key] = {name: (v[0], torch.tensor(v[1:], dtype=torch.int64))
                                for name, v in json.loads(got).items()}
        return self.tables[key]

    def _pump(self) -> None:
        """Write every packed chunk whose room on the gen rank has been announced."""
        still = []
        for w in self.waiting:
            if w.event is not None and not w.event.query():
                room = None  # (GPUs) still packing: the host does not wait for the device
            elif self.mode == "direct":
                room = self._landing(w.chunk)
            else:
                room = self._room(w.chunk)
            if room is None:
                still.append(w)
            else:
                self._write(w, room)
        self.waiting = still

    def _runs(self, w: Write, tables: dict, peer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Ctx, direct: (source addresses, destination addresses, lengths) of chunk ``w``'s writes into the gen pool
        of ``peer`` (its ``pools``: name -> (address, blocks), and its ``state``), given the request's block
        ``tables`` there; neighbours contiguous on both sides merged."""
        c = w.chunk
        base, ids = tables[c.rect.pool]
        peer_base, peer_blocks = peer.pools[c.rect.pool]
        dmem, dwire, length = rank_runs(peer.state.pool(c.rect.pool), peer_blocks, c, ids, base)
        dst = peer_base + dmem
        if w.buf is not None:  # corrupted on its way out: from the staging copy, in wire order
            src = w.buf.data_ptr() + dwire
        else:  # this side's runs are cut elsewhere when the layouts differ: each write within both
            smem, swire, _ = own_runs(self.ctx, c)
            src, dst, length = pair_runs(self.ctx.cache.pools[c.rect.pool].storage.data_ptr() + smem, swire,
                                         dst, dwire, length)
        return coalesce(np.asarray(src, dtype=np.int64), dst, length)

    def finish(self, h, rec) -> bool:
        c, deadline = h.chunk, self.ctx.deadline()
        if self.sending:
            self._written(h, rec, deadline)
            if h.staged:
                self._release(h)
            return not h.staged
        self._arrived(h, deadline)
        rec.wire.append((h.posted, self.ctx.clock.mark()))
        flip_landed(self.ctx, h.index, c, h.buf)
        if h.staged:
            self.staging.copy(c, h.buf, rec)
            if self.device.type == "cuda" and not self.per_chunk:
                ev = torch.cuda.Event()
                ev.record()
                self.after_unpack[h.index % self.window] = ev
            self._release(h)
        self.ctx.faults.reuse(self.ctx, h.index, c)  # fault injection: once the bytes have landed
        return not h.staged

    def closed(self, request: int) -> None:
        """The request's block tables are no longer needed on either side (direct)."""
        self.told = {k for k in self.told if k[0] != request}
        self.tables = {k: v for k, v in self.tables.items() if k[0] != request}

    def _release(self, h) -> None:
        if h.reg is not None:
            self._deregister_buffer(h.reg)
            h.reg = None
        self.staging.put(h.buf)

    def abandon(self, h) -> None:
        if isinstance(h, Write):
            if h in self.waiting:
                self.waiting.remove(h)
            self._let_go(h)
        elif h in self.unannounced:
            self.unannounced.remove(h)
        if h.staged and self.staging is not None:
            self._release(h)
