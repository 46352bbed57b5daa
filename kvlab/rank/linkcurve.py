"""The link curve of a run's own ranks and transport over message sizes (``kvlab link``).

Each rank of the run is started as ``kvlab run`` starts it, up to the transport's ``connect``; then,
for every size of the ``link`` group (kvlab.core.link_spec), every ctx/gen pair the run would use moves
messages of that size, all pairs at once, with the in-run reference of the transport
(kvlab.rank.linkrate: raw messages over p2p's pair groups, raw NIXL WRITEs, or a local ``copy_`` for a
pulling transport): one untimed round, then ``link.repeats`` timed repeats, each from a barrier to the
last completion on any rank. Then one checked round: each ctx rank sends a pattern of its own
(p2p) and the gen rank counts the bytes that differ, nccl-tests' ``#wrong``; a reference that moves no
message between ranks checks nothing and says so (``None``). Rank 0 prints the table as nccl-tests
users read it and adds one ``kvlab.results.records.LinkPoint`` per size to ``link.jsonl`` as it is measured.

Columns: ``size`` one message (B); ``count`` messages per pair and repeat; ``time`` the median
repeat's time per message on a pair (us, all pairs at once); ``algbw`` one pair's GB/s (size / time);
``busbw`` every pair together (algbw x pairs, the bytes the link carried); the range of algbw over
the repeats; ``#wrong``.
"""
from __future__ import annotations

import statistics
from collections import namedtuple

import torch
import torch.distributed as dist

from kvlab.core.errors import ConfigError
from kvlab.model.parallel import label
from kvlab.rank import linkrate
from kvlab.results import records
from kvlab.transports.p2p import post

Msg = namedtuple("Msg", "request src dst nbytes")  # what linkrate reads of a chunk


def order_for(pairs: list[tuple[int, int]], nbytes: int) -> list[Msg]:
    """One message of ``nbytes`` per (ctx, gen) pair: the order linkrate's references take their pairs and
    message size from."""
    return [Msg(0, c, g, nbytes) for c, g in pairs]


def wrong_bytes(setup, transport, world_rank: int, pairs, nbytes: int) -> int | None:
    """One checked message per pair: the bytes that arrived different from what the ctx rank sent (every rank
    gets the total); None where the reference moves no message between ranks."""
    slots = transport.staging.slots if transport.link_reference == "p2p" else None
    if slots is None:
        return None
    wrong = torch.zeros(1, dtype=torch.int64)
    for i, (c, g) in enumerate(pairs):
        cw, gw = setup.world_rank("ctx", c), setup.world_rank("gen", g)
        if world_rank not in (cw, gw):
            continue
        buf = slots.get(i, nbytes)
        want = (torch.arange(nbytes, dtype=torch.int64) * 7 + 31 * cw + gw).remainder(251).to(torch.uint8)
        if world_rank == cw:
            buf.copy_(want.to(buf.device))
            post(buf, gw, transport.groups[(cw, gw)], send=True).wait()
        else:
            buf.fill_(0)
            post(buf, cw, transport.groups[(cw, gw)], send=False).wait()
            wrong += int((buf.cpu() != want).sum())
    dist.all_reduce(wrong)
    return int(wrong.item())


def measure(setup, transport, world_rank: int, pairs: list[tuple[int, int]], device: str,
            measured=lambda point: None) -> list[records.LinkPoint]:
    """Every rank calls this after ``transport.connect``; every rank returns the same points, and hands each to
    ``measured`` as soon as it has it."""
    out = []
    for size in setup.link.sizes(device):
        out.append(_point(setup, transport, world_rank, pairs, size))
        measured(out[-1])
    return out


def _point(setup, transport, world_rank: int, pairs: list[tuple[int, int]], size: int) -> records.LinkPoint:
    link = linkrate.measure(setup, transport, world_rank, order_for(pairs, size), setup.link.repeats)
    wrong = wrong_bytes(setup, transport, world_rank, pairs, size)
    if link is None or link.gbps is None:
        return records.LinkPoint(transport=setup.transport.name, reference=getattr(link, "reference", None),
                                 size=size, pairs=len(pairs), repeats=setup.link.repeats, wrong=wrong)
    per_pair = link.messages // max(1, len(pairs)) if link.reference != "copy" else link.messages
    n_pairs = len(pairs) if link.reference != "copy" else 1
    scale = 1 / max(1, n_pairs)  # one pair's share of the aggregate rate
    return records.LinkPoint(
        transport=setup.transport.name, reference=link.reference, size=size, count=per_pair, pairs=len(pairs),
        repeats=link.repeats, time_us=link.seconds / max(1, per_pair) * 1e6, algbw=link.gbps * scale,
        algbw_min=link.gbps_min * scale, algbw_max=link.gbps_max * scale, busbw=link.gbps,
        samples=[s * scale for s in link.samples], wrong=wrong)


def table(points: list[records.LinkPoint], title: str) -> str:
    """nccl-tests' layout: one line per size, '#' before the header lines."""
    lines = [f"# {title}",
             "#",
             f"# {'size':>12} {'count':>8} {'pairs':>5} {'time':>10} {'algbw':>8} {'busbw':>8} "
             f"{'algbw range':>15} {'#wrong':>7}",
             f"# {'(B)':>12} {'':>8} {'':>5} {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8} {'(GB/s)':>15} {'':>7}"]
    for p in points:
        if p.algbw is None:
            lines.append(f"  {p.size:>12} {'':>8} {p.pairs:>5} {'-':>10} {'-':>8} {'-':>8} {'-':>15} "
                         f"{'n/a' if p.wrong is None else p.wrong:>7}")
            continue
        spread = f"{p.algbw_min:.2f}-{p.algbw_max:.2f}"
        lines.append(f"  {p.size:>12} {p.count:>8} {p.pairs:>5} {p.time_us:>10.1f} {p.algbw:>8.2f} {p.busbw:>8.2f} "
                     f"{spread:>15} {'n/a' if p.wrong is None else p.wrong:>7}")
    busbw = [p.busbw for p in points if p.busbw is not None]
    if busbw:
        lines.append(f"# Avg bus bandwidth    : {statistics.mean(busbw):.3f} GB/s (mean over sizes of the median "
                     f"repeat)")
    return "\n".join(lines)


ENV = "KVLAB_LINK"  # set by kvlab link (kvlab.cli.link_cmd) for the ranks it starts


def run(setup, transport, world_rank: int, order, run_dir, device) -> int:
    """A rank of ``kvlab link``: the curve over the run's own (ctx, gen) pairs; rank 0 writes and prints it."""
    pairs = sorted({(c.src, c.dst) for c in order})
    refused = None

    def keep(point: records.LinkPoint) -> None:
        nonlocal refused
        if world_rank == 0 and refused is None:
            try:
                records.append_link(run_dir, point)
            except ConfigError as e:  # no room: raised after the last size and the barrier; raised here, it
                refused = e  # would leave the other ranks in the next size's collectives

    points = measure(setup, transport, world_rank, pairs, device.type, keep)
    if world_rank == 0 and refused is None:
        c, g = setup.ctx, setup.gen
        title = (f"kvlab link: transport={setup.transport.name} ({points[0].reference if points else '-'} reference), "
                 f"ctx {label(c)} -> gen {label(g)}, {len(pairs)} pairs at once, "
                 f"{device.type}, {setup.link.repeats} repeats after one untimed round")
        print(table(points, title), flush=True)
        print(f"results in {run_dir}", flush=True)
    dist.barrier()
    if refused is not None:
        raise refused
    return 0 if all(p.wrong in (0, None) for p in points) else 1
