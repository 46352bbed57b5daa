"""How a chunk moves from a ctx rank's pool to a gen rank's pool: the transport seam.

A transport is chosen by the Hydra group ``transport=`` (``conf/transport/<name>.yaml``):
the file's ``_target_`` names the class, its other keys are the constructor's options.
``p2p`` (kvlab.transports.p2p) pushes each chunk over torch.distributed, staged through
slots or in place; ``ipc`` (kvlab.transports.ipc) lets the gen rank map the ctx rank's
pools and pull each chunk's runs straight into its own pool; ``nixl`` (kvlab.transports.nixl,
the ``nixl`` extra) WRITEs each chunk through NIXL's agents, staged or pool to pool; ``mooncake``
(kvlab.transports.mooncake, the ``mooncake`` extra) writes each chunk through the Mooncake Transfer
Engine, staged or pool to pool; ``auto`` (the default) is
``p2p``, or ``ipc`` where p2p's pair groups cannot be placed on the GPUs (kvlab.config.schema
``auto_transport``). A new transport is one module with a subclass of ``Transport`` and one
YAML file naming it.

The strategy (kvlab.model.schedule) decides what the chunks are, in which order they go and
when each is ready; the executor (kvlab.rank.executor) walks one rank's chunks in the global
order with at most ``transfer.slots`` in flight and owns requests, faults and records;
the transport moves bytes. Every strategy works with every transport.

Protocol. Every rank of both sides makes these calls, in this order:

1. ``cls.check(setup)`` (classmethod, in ``kvlab.config.schema.build``): ``ConfigError`` for
   options or setups the transport cannot serve, before anything is allocated. It needs no package of the
   transport's: ``kvlab plan``, ``kvlab sim`` and ``--help`` build setups of every transport. Then, only where
   bytes move (``kvlab run``, ``kvlab link``, each rank: ``Setup.check_installed``), ``cls.installed(setup)``:
   ``ConfigError`` naming the extra to install (kvlab.core.errors ``install_hint``) when its package is missing.
2. ``Transport(setup, side, rank, world_rank, device, **options)``: no allocation yet.
3. ``pool_storage(pool, nbytes)``: the zeroed uint8 tensor that holds one pool of this
   rank's cache (``kvlab.memory.cache.PagedCache`` asks for each pool once, at start). A pull
   transport puts the ctx pools where the gen ranks can map them.
4. ``connect(ctx)``: once, after the cache exists and after the device-memory
   baseline (what it allocates counts as the transfer's), before the barrier that starts
   the clock. Every rank calls it, so it may use the default group's store and
   collectives. ``ctx`` is the rank's ``RankContext`` (below; the base keeps it as ``self.ctx``):
   ``ctx.setup``, ``ctx.side``, ``ctx.rank``, ``ctx.device``, ``ctx.cache``, ``ctx.ops``,
   ``ctx.stream`` and ``ctx.faults``; ``ctx.clock`` is set only after it, and ``ctx.chunks``
   (this rank's chunks in the order ``start`` sees them) before the first ``start``.
5. ``opened(request)`` on a ctx rank: the request's blocks are allocated (the prefill
   writes them layer by layer later, kvlab.model.prefill); its block tables are
   ``ctx.cache.tables[request.id]``.
6. ``start(i, chunk, rec) -> handle``: chunk ``i`` of this rank's chunks. On a ctx rank
   the chunk's layers are written (the strategy's readiness was waited for; on GPUs the
   writes are queued on, or waited for by, ``ctx.stream``: work queued there after
   them sees them, another process must wait for the stream) and the chunk
   ``i - slots`` of this rank has finished. On a gen rank chunk ``i`` may be posted ahead
   of its data: nothing is assumed about the ctx side yet. ``rec`` is the request's
   ``RequestRecord``: append ``(start, end)`` clock marks of copies to ``rec.pack``.
7. ``finish(handle, rec) -> in_place``: called in ``start`` order, at most ``slots`` after
   it. On a ctx rank, when it returns the chunk's bytes are no longer needed by this
   transport (a slot may be reused; after a request's last chunk the executor frees its
   blocks, so a pull transport returns only once the reader is done). On a gen rank,
   when it returns the chunk's bytes are in the gen pool (the executor verifies the
   request after its last chunk). Returns whether the chunk moved without a copy into a
   staging buffer on this side. Appends ``(posted, done)`` to ``rec.wire``. Byte flips of
   fault injection (``ctx.faults.flip(i, buf)``, ``buf`` the chunk's bytes in wire
   order) happen in here, on the bytes in flight. A peer that is gone or silent for
   ``transfer.timeout_s`` raises ``ChunkFailed`` within that deadline; the host never
   waits longer than that anywhere in this protocol.
8. ``closed(request)``: after the request's last chunk on this rank is finished and its end is
   marked (a gen rank's end is the transfer's end): what may follow the transfer without being
   timed, such as a pull transport's report that the reader is done.
   ``poll(handle) -> bool`` (only where ``polls`` is true): whether the chunk is done, without
   waiting; the first time it says so, the transport marks the chunk's completion then, and
   ``finish`` uses that mark. The executor polls every chunk in flight while it waits (for the
   prefill, for a free slot), so completions are marked when they happen, not when the loop
   gets round to finishing them. A transport without it is finished only when the executor
   must (the window is full, or nothing else is left to start).
9. ``abandon(handle)``: a started chunk that will never be finished (the run is failing); then
   ``aborted()`` once: nothing the device waits for may stay queued (the finished requests are
   still checked, on the same stream).
10. ``close()``: once at the end, also after a failure, on every rank: unmap, unlink and
   free what ``connect`` and ``pool_storage`` made. Idempotent.

``link_reference``: how kvlab.rank.linkrate measures the link this transport's figures are a
share of, in every run (``"p2p"``: raw messages over the pair groups; ``"nixl"``: raw NIXL
WRITEs between the transport's agents; ``"copy"``: a local ``copy_`` of the same bytes, the
default; ``None``: no in-run reference, no link figures).

``peak_staging_bytes``: the most staging memory the transport held at once on this rank (the peak of
``staging``, where the transport keeps a kvlab.transports.staged.ChunkStaging there, else 0). ``pulls``
(class attribute): the gen rank copies each chunk straight from the ctx pool, with no staging, pack, message or unpack;
the cost model (kvlab.sizing.cost) charges such a chunk one copy on the gen device and one
control round trip. It also says whose ``rec.wire`` marks bracket a chunk in flight
(kvlab.core.figures: ``busy_s``, delivered GB/s): the gen rank's for a pulling transport, else the
ctx rank's.

Fault injection (kvlab.config.faults): the transfer's failure classes (``fault.transfer``) are injected where they
would happen, through hooks of ``ctx.faults`` the transport calls: ``notice(i, chunk)`` where it sends a
notice of its own (a completion, an acknowledgement, an announcement): the chunk the notice names, or None
where it is dropped; ``stuck(i, chunk)`` where it posts a chunk's bytes: true where they must never
progress (post nothing, and let the chunk's wait run into its deadline); ``reuse(ctx, i, chunk)`` on a ctx
rank before a chunk's bytes are read and on a gen rank once they have landed; ``torn(i, chunk)`` where a
sender writes: write the first half (``ctx.faults.half`` of its runs), wait until it is there, then
``die()`` before the notice. ``injects`` (class attribute) maps each class the transport's hooks show to
the sides whose rank injects it, and ``cannot`` each class that does not arise with this transport to why;
``kvlab.config.faults.check`` refuses the others. A transport without hooks injects none.

``has`` (class attribute): what the transport's runs have that the figures of some transports
need (kvlab.core.figures, ``Figure.needs``): ``"slots"`` when a ctx rank's chunks wait for a free
staging slot (``slot_wait_s``); a function of the transport's options where they decide it
(nixl: none in ``mode=direct``). A figure whose need is not declared is absent from the run's
rows, summary, terminal and wandb, not zero.
"""
from __future__ import annotations

import contextlib
import re
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvlab.config.faults import RankFaults
    from kvlab.config.schema import Setup
    from kvlab.core.clock import Clock
    from kvlab.memory.cache import PagedCache
    from kvlab.model.plan import Request
    from kvlab.model.schedule import Chunk
    from kvlab.results.metrics import RequestRecord


class ChunkFailed(RuntimeError):
    """A chunk that did not complete within ``transfer.timeout_s``, or whose peer is gone."""

    def __init__(self, message: str, request: int):
        super().__init__(message)
        self.request = request


def short(e: BaseException) -> str:
    """The backend's reason without its source location and advice: it goes into one-line reports."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", text)
    return text.split(". This is typically")[0].rstrip(".")


def failed(side: str, c: Chunk, what: str, e: BaseException | None = None) -> ChunkFailed:
    peer = ("gen" + str(c.dst)) if side == "ctx" else ("ctx" + str(c.src))
    why = f": {short(e)}" if e is not None else ""
    return ChunkFailed(f"request {c.request} chunk {c.seq} with {peer}: {what}{why}", c.request)



OVERDUE_S = 0.5  # what an overdue chunk's finish still waits: one last look before it names the failure

@dataclass
class RankContext:
    """What a transport may use of its rank, handed to ``connect``: the rank's cache (``cache.pools``,
    ``cache.tables[request][pool]``), its copy ops (``ops.pack``/``unpack``/``copy_rect`` on its device), the
    side stream its copies go on (GPUs), its fault hooks, and, set before the first ``start``, the run's clock
    and this rank's chunks in the order ``start`` sees them."""

    setup: Setup
    side: str
    rank: int
    world_rank: int
    device: torch.device
    cache: PagedCache
    ops: object
    stream: torch.cuda.Stream | None
    faults: RankFaults
    clock: Clock | None = None
    chunks: list[Chunk] = field(default_factory=list)
    aside: torch.cuda.Stream | None = None  # GPUs: for small uploads that must not queue behind ``stream``

    @contextlib.contextmanager
    def uploading(self):
        """Host-to-device copies made inside (block tables, say) go on ``aside``, and ``stream`` waits for them
        on the device: a copy from host memory waits for its stream's earlier work, and a device wait there for
        a peer that died never ends. Tensors made inside and used on ``stream`` need ``record_stream`` there."""
        if self.aside is None:
            yield
            return
        with torch.cuda.stream(self.aside):
            yield
            done = torch.cuda.Event()
            done.record(self.aside)
        self.stream.wait_event(done)

    def upload(self, values, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """``values`` as a tensor on the device, without queueing behind ``stream`` (``uploading``)."""
        with self.uploading():
            out = torch.tensor(values, dtype=dtype, device=self.device)
        if self.aside is not None:
            out.record_stream(self.stream)
        return out

    # set by the executor around ``finish`` of a chunk whose deadline it already waited out while polling it
    overdue: bool = False

    @property
    def timeout_s(self) -> float:
        return self.setup.transfer.timeout_s

    def deadline(self) -> float:
        """The host time by which a wait that starts now must end: ``transfer.timeout_s`` from now, or moments
        from now in the ``finish`` of a chunk that is ``overdue`` (its waits add up to one deadline, not two:
        ``finish`` then only names the failure)."""
        return time.time() + (OVERDUE_S if self.overdue else self.timeout_s)


class Transport(ABC):
    """Base of every transport; see the protocol at the top of this module."""

    link_reference = "copy"

    pulls = False

    polls = False  # has ``poll``: completions are seen (and marked) without waiting

    has: frozenset[str] = frozenset()

    staging = None  # the transport's kvlab.transports.staged.ChunkStaging, where it has one (peak_staging_bytes)

    injects: dict[str, frozenset[str]] = {}  # fault class -> the sides whose rank injects it (kvlab.config.faults)
    cannot: dict[str, str] = {}  # fault class -> why it does not arise with this transport

    def __init__(self, setup: Setup, side: str, rank: int, world_rank: int, device: torch.device):
        self.setup, self.side, self.rank, self.world_rank, self.device = setup, side, rank, world_rank, device
        self.ctx: RankContext | None = None

    @classmethod  # noqa: B027 -- an optional step of the protocol
    def check(cls, setup: Setup) -> None:
        """ConfigError for what this transport cannot serve; called before anything is allocated."""

    @classmethod  # noqa: B027 -- an optional step of the protocol
    def installed(cls, setup: Setup) -> None:
        """ConfigError naming the extra to install when this transport's package is missing; only where bytes
        move (kvlab.config.schema ``Setup.check_installed``)."""

    @property
    def sending(self) -> bool:
        return self.side == "ctx"

    @property
    def peak_staging_bytes(self) -> int:
        return self.staging.peak_bytes if self.staging is not None else 0

    @classmethod
    def pool_files(cls, setup: Setup) -> str | None:
        """The directory where this transport keeps the ctx ranks' pools as files (ipc on CPUs: /dev/shm), which
        ``kvlab run`` checks for room before any rank starts (kvlab.sizing.budget); None: in the ranks' own memory."""
        return None

    @classmethod
    def sweep_after(cls, setup: Setup) -> list[str]:
        """Called by the launcher once every rank has ended: remove what ranks that died left outside the run
        directory (ipc: pool files whose creator is gone); returns their names. Nothing by default."""
        return []

    def pool_storage(self, pool: str, nbytes: int) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8, device=self.device)

    def connect(self, ctx: RankContext) -> None:
        """Protocol step 4: pair groups, staging, registrations, mappings (they count as the transfer's memory)."""
        self.ctx = ctx

    def opened(self, request: Request) -> None:  # noqa: B027 -- an optional step of the protocol
        """Protocol step 5 (ctx): the request's blocks are allocated; its tables are ``ctx.cache.tables``."""

    @abstractmethod
    def start(self, i: int, chunk: Chunk, rec: RequestRecord) -> object:
        """Protocol step 6: post chunk ``i``; returns the handle ``finish``, ``poll`` and ``abandon`` get."""

    @abstractmethod
    def finish(self, handle, rec: RequestRecord) -> bool:
        """Protocol step 7: the chunk is done on this side (bytes landed, or no longer needed); appends one
        ``(posted, done)`` to ``rec.wire``; returns whether it moved without a staging copy on this side."""

    def poll(self, handle) -> bool:
        """Whether the chunk is done, without waiting (only called where ``polls`` is true)."""
        raise NotImplementedError(f"{type(self).__name__} sets polls but has no poll()")

    def closed(self, request: int) -> None:  # noqa: B027 -- an optional step of the protocol
        """Protocol step 8: the request's last chunk on this rank is finished and its end marked."""

    def abandon(self, handle) -> None:  # noqa: B027 -- an optional step of the protocol
        """Protocol step 9: a started chunk that will never be finished."""

    def aborted(self) -> None:  # noqa: B027 -- an optional step of the protocol
        """The loop failed (after ``abandon`` of every chunk still in flight): let go of anything the device
        still waits for, so that the checks of the requests that did finish can run."""

    def leave(self) -> None:  # noqa: B027 -- an optional step of the protocol
        """The rank is ending at once, from another thread (stopped during start-up, kvlab.core.interrupt.AtOnce):
        remove what would outlive the process (files); nothing that waits."""

    def close(self) -> None:  # noqa: B027 -- an optional step of the protocol
        """Protocol step 10: free what ``connect`` and ``pool_storage`` made; idempotent."""

    def failed(self, c: Chunk, what: str, e: BaseException | None = None) -> ChunkFailed:
        return failed(self.side, c, what, e)


def create(setup: Setup, side: str, rank: int, world_rank: int, device: torch.device) -> Transport:
    spec = setup.transport
    return spec.cls()(setup, side, rank, world_rank, device, **spec.options)
