"""``transport=p2p``: the ctx rank pushes each chunk over torch.distributed, staged or in place.

Bytes move over one two-rank group per ctx/gen pair, created once at start by every rank
in the same order: NCCL on GPUs (a pair group is what lets two ranks share a GPU with a
third rank elsewhere: NCCL refuses two ranks of one communicator on one GPU), gloo on
CPUs. Every chunk is one ``batch_isend_irecv`` of one contiguous uint8 tensor (batches,
unlike plain send/recv, use the group's own communicator), whatever either side does with
it: a side whose pool holds the chunk in wire order (``Chunk.ctx_in_place`` /
``gen_in_place`` and consecutive blocks) sends or receives in place, else through its
staging (kvlab.memory.staging: fixed slots, or a buffer per chunk for the naive baseline); chunk
``i`` uses slot ``i % slots``.

- ctx: pack into the slot (or not) -> isend. Finishing = the send is done.
- gen: irecv into the slot (or in place), posted ``slots`` chunks ahead. Finishing = wait
  for the bytes, unpack.

On GPUs every copy runs on the executor's side stream; NCCL orders itself after the work
queued there when an op is posted, and ``Work.wait`` makes the side stream wait for NCCL,
so the host never blocks on the device per chunk and pack(i+1) overlaps the wire of i.
On CPUs (gloo) the same calls block the host where they must.
"""
from __future__ import annotations

import datetime
import functools
import queue
import threading
import time
import types
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kvlab.config import devices
from kvlab.model.schedule import Chunk
from kvlab.transports import RankContext, Transport
from kvlab.transports.staged import ChunkStaging


def pair_groups(setup) -> dict[tuple[int, int], dist.ProcessGroup]:
    """One group per (ctx world rank, gen world rank), created by every rank in the same order."""
    groups = {}
    timeout = datetime.timedelta(seconds=max(setup.transfer.timeout_s, 1.0))
    backend = devices.pair_backend(setup)
    for c in range(setup.ctx.size):
        for g in range(setup.gen.size):
            pair = (c, setup.ctx.size + g)
            # a lost peer fails the pair's ops after transfer.timeout_s, not NCCL's default of minutes
            groups[pair] = dist.new_group(list(pair), backend=backend, timeout=timeout)
    return groups


def post(buf: torch.Tensor, peer: int, group, send: bool):
    op = dist.P2POp(dist.isend if send else dist.irecv, buf, peer, group=group)
    return dist.batch_isend_irecv([op])[0]


def warm_up(groups: dict, world_rank: int, device: torch.device) -> None:
    """One tiny message per pair, in one global order: NCCL builds a communicator at its first op,
    which must not be timed as part of the first chunk."""
    buf = torch.zeros(1, dtype=torch.uint8, device=device)
    for (c, g), group in sorted(groups.items()):
        if world_rank in (c, g):
            post(buf, g if world_rank == c else c, group, send=world_rank == c).wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def narrow(ops, ctas: int):
    """The pack/unpack ops on few CTAs on GPUs: the copies must leave the wire its SMs (docs/design.md)."""
    if ops.name != "cuda":
        return ops
    return types.SimpleNamespace(name=ops.name, pack=functools.partial(ops.pack, ctas=ctas),
                                 unpack=functools.partial(ops.unpack, ctas=ctas))


@dataclass
class Watch:
    """One posted op as a completion thread sees it."""

    work: object
    seen: threading.Event = field(default_factory=threading.Event)
    done: float | None = None  # host time the wait returned: the op's completion
    error: BaseException | None = None


class Completions:
    """gloo's ops say they are complete only once waited for (``is_completed`` stays false until
    ``wait``), so a thread per peer waits for them in the order they were posted (one pair's ops
    complete in that order) and marks each completion when it happens, while the executor's loop
    goes on posting and polling. Every wait has the run's deadline."""

    def __init__(self, timeout_s: float):
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.queues: dict[int, queue.SimpleQueue] = {}
        self.threads: list[threading.Thread] = []

    def watch(self, peer: int, work) -> Watch:
        if peer not in self.queues:
            self.queues[peer] = q = queue.SimpleQueue()
            t = threading.Thread(target=self._main, args=(q,), name=f"p2p-completions-{peer}", daemon=True)
            t.start()
            self.threads.append(t)
        w = Watch(work)
        self.queues[peer].put(w)
        return w

    def _main(self, q: queue.SimpleQueue) -> None:
        while (w := q.get()) is not None:
            try:
                w.work.wait(timeout=self.timeout)
            except BaseException as e:  # noqa: BLE001 -- finish raises it on the loop's thread
                w.error = e
            w.done = time.time()
            w.seen.set()

    def close(self) -> None:
        for q in self.queues.values():
            q.put(None)
        for t in self.threads:  # each ends within its current wait's deadline
            t.join(timeout=self.timeout.total_seconds() + 1.0)
        self.queues.clear()
        self.threads.clear()


class Stuck:
    """fault.transfer=stuck: an operation posted that never progresses. Its wait ends as a timed-out one
    does, after the deadline it is given."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    def wait(self, timeout: datetime.timedelta | None = None) -> None:
        s = timeout.total_seconds() if timeout is not None else self.timeout_s
        time.sleep(s)
        raise RuntimeError(f"timed out after {s:g} s: the operation made no progress")


@dataclass
class Posted:
    index: int
    chunk: Chunk
    work: object
    buf: torch.Tensor
    staged: bool
    posted: object
    watch: Watch | None = None  # CPUs: its completion as the completion thread saw it


class P2P(Transport):
    link_reference = "p2p"  # kvlab.rank.linkrate: raw messages over the same pair groups
    has = frozenset({"slots"})  # kvlab.core.figures: a ctx rank's chunks wait for a free staging slot
    polls = True
    injects = {"stuck": frozenset({"ctx"}), "reused_block": frozenset({"ctx", "gen"})}
    cannot = {
        "drop_notice": "its only notice is the message itself (a message that never arrives is fault.transfer=stuck)",
        "wrong_request": "its messages name no request: a pair's operations match in the one order both sides "
                         "derive (another request's bytes in a message are fault.transfer=reused_block)",
        "torn_chunk": "gloo and NCCL deliver a message whole or fail its operation (a sender that dies mid-message "
                      "is fault.kill_rank)",
    }

    def __init__(self, setup, side, rank, world_rank, device):
        super().__init__(setup, side, rank, world_rank, device)
        self.groups: dict = {}
        self.completions = Completions(max(setup.transfer.timeout_s, 1.0))

    def connect(self, ctx: RankContext) -> None:
        super().connect(ctx)
        t = self.setup.transfer
        self.groups = pair_groups(self.setup)
        # the staging is allocated after the device-memory baseline: it is the transfer's extra memory
        self.staging = ChunkStaging(ctx, narrow(ctx.ops, t.pack_ctas))
        warm_up(self.groups, self.world_rank, self.device)  # after the baseline: NCCL's buffers count as extra

    def _peer(self, c: Chunk) -> int:
        return self.setup.world_rank("gen" if self.sending else "ctx", c.dst if self.sending else c.src)

    def _group(self, c: Chunk):
        return self.groups[(self.setup.world_rank("ctx", c.src), self.setup.world_rank("gen", c.dst))]

    def start(self, i: int, c: Chunk, rec) -> Posted:
        if self.sending:
            self.ctx.faults.reuse(self.ctx, i, c)  # fault injection: before the chunk's bytes are read
        buf, staged = self.staging.buffer(i, c)
        if self.sending and staged:
            self.staging.copy(c, buf, rec)
        if self.sending:
            buf, staged = self.staging.flip_outgoing(i, c, buf, staged, rec)
        posted = self.ctx.clock.mark()
        try:
            if self.sending and self.ctx.faults.stuck(i, c):
                work = Stuck(max(self.setup.transfer.timeout_s, 1.0))
            else:
                work = post(buf, self._peer(c), self._group(c), send=self.sending)
        except RuntimeError as e:  # gloo refuses to post to a peer whose connection is gone
            raise self.failed(c, "posting failed", e) from e
        watch = None if self.device.type == "cuda" else self.completions.watch(self._peer(c), work)
        return Posted(i, c, work, buf, staged, posted, watch)

    def poll(self, f: Posted) -> bool:
        # GPUs: finishing only queues a stream wait, and the completion mark is a device event anyway
        return f.watch is None or f.watch.seen.is_set()

    def finish(self, f: Posted, rec) -> bool:
        c, timeout = f.chunk, self.setup.transfer.timeout_s
        try:
            if f.watch is None:
                f.work.wait()  # a timeout here would block the host; NCCL's watchdog enforces transfer.timeout_s
            else:
                if not f.watch.seen.wait(timeout + 1.0):  # the completion thread's wait has the deadline
                    raise RuntimeError("no completion seen")
                if f.watch.error is not None:
                    raise f.watch.error
        except RuntimeError as e:
            raise self.failed(c, f"not done within {timeout:g} s or peer gone", e) from e
        rec.wire.append((f.posted, f.watch.done if f.watch is not None else self.ctx.clock.mark()))
        if not self.sending:
            self.ctx.faults.flip(f.index, f.buf)
            if f.staged:
                self.staging.copy(c, f.buf, rec)
            self.ctx.faults.reuse(self.ctx, f.index, c)  # fault injection: once the bytes have landed
        if f.staged:
            self.staging.put(f.buf)
        return not f.staged

    def abandon(self, f: Posted) -> None:
        if f.staged:
            self.staging.put(f.buf)

    def close(self) -> None:
        self.completions.close()
