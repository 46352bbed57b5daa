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

import contextlib
import json
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import QueueEmptyError

from kvlab.core.errors import ConfigError
from kvlab.model.schedule import Chunk, Staging
from kvlab.model.state import CacheState
from kvlab.transports import RankContext, Transport
from kvlab.transports import mooncake_engine as mooncake
from kvlab.transports.deadline import spin_for, wait_until
from kvlab.transports.direct import block_tables, coalesce, flip_landed, own_runs, pair_runs, rank_runs
from kvlab.transports.p2p import narrow
from kvlab.transports.staged import ChunkStaging

MODES = ("direct", "staged")
DIRECT_WAVE = 1024  # writes of one chunk in flight at once (_write)
LAND_POLL_S = 2.5e-4  # gen, CPUs: between two looks for a chunk's notice in the store
LAND_POLL_GPU_S = 5e-5  # gen, GPUs
PROBE_S = 0.25  # between two probes of a peer's engine while waiting on it


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


@dataclass
class Write:
    """A chunk on the ctx rank: packed (or not), waiting for the gen rank's room, then its writes in flight."""

    index: int
    chunk: Chunk
    rec: object
    buf: torch.Tensor | None  # the chunk in wire order (a slot, or the pool in place); None: direct from runs
    staged: bool
    event: object = None  # GPUs: the pack's (or the layers') completion; the engine does not follow streams
    ids: list | None = None  # the engine's ids of the writes not yet seen complete; None: not yet submitted
    posted: object = None
    done: object = None  # the completion mark, set when it was seen
    reg: int = 0  # a per-chunk buffer's registered address (naive)
    stuck: bool = False  # fault injection: posted, and never progresses


@dataclass
class Landing:
    """A chunk on the gen rank: room announced, bytes awaited."""

    index: int
    chunk: Chunk
    buf: torch.Tensor | None
    staged: bool
    posted: object
    reg: int = 0  # a per-chunk buffer's registered address (naive)
    notice: tuple | None = None  # (store call, key, value) to publish: a queue push or a set; None: nothing
    after: object = None  # GPUs: the event of the slot's last unpack, announced once it has completed


@dataclass
class Peer:
    session: str
    pools: dict = field(default_factory=dict)  # pool name -> (address, blocks)
    probe: int = 0
    state: CacheState | None = None


class Mooncake(Transport):
    link_reference = "mooncake"  # kvlab.rank.linkrate: raw writes of the run's chunk size between its pairs
    # kvlab.core.figures: a ctx rank's chunks wait for a free staging slot, except in direct mode, which has none
    has = staticmethod(lambda options: frozenset() if options.get("mode") == "direct" else frozenset({"slots"}))
    # fault injection: a ctx rank's notice is its done key, a gen rank's its room or block tables key
    injects = {"drop_notice": frozenset({"ctx", "gen"}), "wrong_request": frozenset({"ctx", "gen"}),
               "stuck": frozenset({"ctx"}), "reused_block": frozenset({"ctx", "gen"}),
               "torn_chunk": frozenset({"ctx"})}

    def __init__(self, setup, side, rank, world_rank, device, mode: str = "staged", protocol: str = "auto",
                 pack_ctas: int | None = None):
        super().__init__(setup, side, rank, world_rank, device)
        self.staging = None
        self.mode = mode
        self.protocol = protocol
        self.pack_ctas = pack_ctas
        # the ctx rank polls its writes' status locally; a gen rank's poll would be a store round trip per
        # chunk in flight per loop, so it is finished when the executor must
        self.polls = side == "ctx"
        self.te = None
        self.wire = ""
        self.session = ""
        self.regs: list[int] = []
        self.peers: dict[int, Peer] = {}
        self.store = None
        self.waiting: list[Write] = []  # ctx: chunks packed, not yet written
        self.unannounced: deque[Landing] = deque()  # gen: chunks whose room waits its turn (GPUs: an unpack)
        self.after_unpack: dict[int, object] = {}  # gen, GPUs: slot -> event of its last unpack
        self.told: set[tuple[int, int]] = set()  # gen, direct: (request, ctx rank) sent the block tables
        self.heard: dict[str, dict[str, str]] = {}  # queue -> notices popped before their chunk asked
        self.tables: dict[tuple[int, int], dict] = {}  # ctx, direct: (request, gen rank) -> its block tables
        self.probed: dict[int, float] = {}  # peer -> when its engine was last asked whether it is there
        self.spin_s = spin_for(device)
        self.pack_stream = None  # ctx, GPUs, staged: where the packs run (connect)
        self.land_poll_s = LAND_POLL_GPU_S if getattr(device, "type", device) == "cuda" else LAND_POLL_S
        self.shut = False
        self.per_chunk = False
        self.window = setup.transfer.slots

    @classmethod
    def check(cls, setup) -> None:
        o = setup.transport.options
        mode = o.get("mode", "staged")
        if mode not in MODES:
            raise ConfigError("transport.mode", mode, "use direct (one write per run, pool to pool) or staged "
                              "(one write per chunk through registered slots)")
        proto = o.get("protocol", "auto")
        if proto not in mooncake.PROTOCOLS:
            raise ConfigError("transport.protocol", proto, "use tcp, nvlink_intra (GPUs of one node, CUDA wheels) "
                              "or auto (nvlink_intra where the wheel and the GPUs have it, else tcp)")
        ctas = o.get("pack_ctas")
        if ctas is not None and (not isinstance(ctas, int) or isinstance(ctas, bool) or ctas < 1):
            raise ConfigError("transport.pack_ctas", ctas, "use a positive number of CTAs, or null for one per SM")
        if proto == "nvlink_intra" and setup.device == "cpu":
            raise ConfigError("transport.protocol", proto, "NVLink moves GPU memory; use transport.protocol=tcp "
                              "(or auto) with device=cpu")

    @classmethod
    def installed(cls, setup) -> None:
        mc = mooncake.api()
        if setup.transport.options.get("protocol", "auto") == "nvlink_intra" and not mc.SUPPORT_INTRA_NVLINK:
            raise ConfigError("transport.protocol", "nvlink_intra", "the installed Mooncake wheel has no intra-node "
                              "NVLink transport (the CUDA wheel has); use transport.protocol=tcp or auto")

    @property
    def peak_staging_bytes(self) -> int:
        return self.staging.peak_bytes if self.staging is not None else 0

    # -- start-up ---------------------------------------------------------------------------
    def connect(self, ctx: RankContext) -> None:
        """Engine, registrations, session ids and pool addresses through the store, one write each way."""
        super().connect(ctx)
        t = self.setup.transfer
        ctas = self.pack_ctas
        if ctas is None and self.device.type == "cuda":
            # the engine's writes run on copy engines or the NIC, not on SMs: the kernels may take them all
            ctas = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.ops = narrow(ctx.ops, ctas or t.pack_ctas)
        if self.mode == "staged" or (self.sending and ctx.faults.flips):
            self.staging = ChunkStaging(ctx, self.ops)
        self.per_chunk = self.staging is not None and self.staging.per_chunk
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

    # -- chunks -----------------------------------------------------------------------------
    def _landing(self, c: Chunk) -> dict | None:
        """Ctx, direct: the gen rank's block tables of the chunk's request, once they have arrived."""
        key = (c.request, c.dst)
        if key not in self.tables:
            got = self._take(f"mc/T/{c.src}/{c.dst}/{c.request}", c)
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
                # one key per (request, ctx rank) with the block tables lets the ctx rank address every chunk
                h = Landing(i, c, None, False, clock.mark())
                if (c.request, c.src) not in self.told:
                    self.told.add((c.request, c.src))
                    n = self.ctx.faults.notice(i, c)
                    if n is not None:
                        h.notice = (self.store.set, f"mc/T/{c.src}/{c.dst}/{n.request}",
                                    block_tables(self.ctx, c.request))
            else:
                buf, staged = self.staging.buffer(i, c)
                h = Landing(i, c, buf, staged, clock.mark())
                if staged and self.per_chunk:
                    # the naive baseline's buffer is new memory: registered before it is announced (the peer's
                    # engine checks a write against the registrations when it lands)
                    self._register(buf.data_ptr(), buf.numel())
                    h.reg = buf.data_ptr()
                elif staged:
                    h.after = self.after_unpack.pop(i % self.window, None)  # the slot is free once that has run
                n = self.ctx.faults.notice(i, c)
                if n is not None:
                    h.notice = (self.store.queue_push, *self._notice("R", n, f"{buf.data_ptr()} {buf.numel()}"))
            self.unannounced.append(h)
            self._announce()
            return h
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
            w = Write(i, c, rec, buf, staged)
            if self.device.type == "cuda":
                w.event = torch.cuda.Event()
                w.event.record()
        if staged and self.per_chunk:
            self._register(buf.data_ptr(), buf.numel())
            w.reg = buf.data_ptr()
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
                self._ask(h.chunk, *h.notice)

    def _pump(self) -> None:
        """Write every packed chunk whose room on the gen rank has been announced."""
        still = []
        for w in self.waiting:
            if w.event is not None and not w.event.query():
                room = None  # (GPUs) still packing: the host does not wait for the device
            elif self.mode == "direct":
                room = self._landing(w.chunk)
            else:
                room = self._heard("R", w.chunk)
            if room is None:
                still.append(w)
            else:
                self._write(w, room)
        self.waiting = still

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
            base, ids = room[c.rect.pool]
            base_addr, blocks = peer.pools[c.rect.pool]
            dmem, dwire, length = rank_runs(peer.state.pool(c.rect.pool), blocks, c, ids, base)
            dst = base_addr + dmem
            if w.buf is not None:  # corrupted on its way out: from the staging copy, in wire order
                src = w.buf.data_ptr() + dwire
            else:  # this side's runs are cut elsewhere when the layouts differ: each write within both
                smem, swire, _ = own_runs(self.ctx, c)
                src, dst, length = pair_runs(self.ctx.cache.pools[c.rect.pool].storage.data_ptr() + smem, swire,
                                             dst, dwire, length)
            src, dst, length = coalesce(np.asarray(src, dtype=np.int64), dst, length)
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

    def finish(self, h, rec) -> bool:
        c, timeout = h.chunk, self.setup.transfer.timeout_s
        deadline = self.ctx.deadline()
        if not self.sending:
            self._land(c, deadline)
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
            if self.poll(h):
                return True
            if h.ids is None:  # still waiting for the gen rank's room or block tables
                self._alive(c, c.dst)
            return False

        wait_until(written, deadline, lambda: self.failed(c, f"not done within {timeout:g} s or peer gone"),
                   spin_s=self.spin_s)
        rec.wire.append((h.posted, h.done))
        if h.staged:
            self._release(h)
        return not h.staged

    def _land(self, c: Chunk, deadline: float) -> None:
        """Gen: until the ctx rank's notice says the chunk's bytes are here, polling the store every
        ``land_poll_s`` (the module's docstring says why not faster) and asking the ctx engine whether it is
        still there every ``PROBE_S``."""
        timeout = self.setup.transfer.timeout_s
        while True:
            self._announce()
            if self._heard("D", c) is not None:
                return
            self._alive(c, c.src)
            if time.time() > deadline:
                raise self.failed(c, f"not done within {timeout:g} s or peer gone")
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
        self.told = {k for k in self.told if k[0] != request}
        self.tables = {k: v for k, v in self.tables.items() if k[0] != request}
        mine = f"{request}."  # notices never asked for (a fault's, or a chunk's that failed first)
        for got in self.heard.values():
            for name in [n for n in got if n.startswith(mine)]:
                del got[name]

    def _release(self, h) -> None:
        if h.reg:
            self._unregister(h.reg)
            h.reg = 0
        self.staging.put(h.buf)

    def abandon(self, h) -> None:
        if isinstance(h, Write):
            if h in self.waiting:
                self.waiting.remove(h)
            h.ids = None  # writes to a peer that is gone end on their own; the engine frees them in close
        elif h in self.unannounced:
            self.unannounced.remove(h)
        if h.staged and self.staging is not None:
            self._release(h)

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
