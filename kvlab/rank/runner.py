"""One rank of a run, from its config to its part of the results (kvlab.cli.run_cmd starts the ranks).

    build specs -> init torch.distributed -> handshake (cache states) -> pair groups
    -> the run plan: requests, segments, prefill timeline, global order (kvlab.config.workload.RunPlan:
       pure, identical everywhere, built once and passed to what needs it)
    -> checks that need the plan (kvlab.sizing.preflight) -> cache + staging allocated once
    -> barrier -> executor -> canaries
    -> its part: parts/rank<N>.json and the store (kvlab.rank.report: no collective after the transfers)
    -> rank 0 merges every part it gets (kvlab.rank.report.finalize): results.jsonl, timeline.jsonl,
       summary.json, table

A rank that fails a chunk (timeout, lost peer) fails the requests it has open, frees their
blocks and stops its loop; rank 0 reports every request that did not arrive whole, with the
reason, and the ranks that fell silent. Exit codes: 0 verified, 1 failures, 2 bad config,
3 killed by fault injection (kvlab.config.faults).
"""
from __future__ import annotations

import contextlib
import functools
import os
import resource
import signal
import socket
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from kvlab import transports
from kvlab.config import faults
from kvlab.config.schema import build
from kvlab.config.workload import RunPlan, plan_run
from kvlab.core.clock import Clock
from kvlab.core.errors import ConfigError
from kvlab.core.interrupt import AtOnce, ignore, ready
from kvlab.memory.cache import PagedCache
from kvlab.memory.ops import get_ops
from kvlab.model.plan import plan
from kvlab.model.state import CacheState
from kvlab.rank import control as transport
from kvlab.rank import linkcurve, linkrate, report
from kvlab.rank.executor import Executor, Stopped
from kvlab.rank.progress import Progress
from kvlab.rank.wandb_sink import WandbSink
from kvlab.results import metrics
from kvlab.results.records import Env, PartFile, Peak, marked_dead, read_part, write_part, write_refusal
from kvlab.results.rundir import say_once
from kvlab.sizing import budget
from kvlab.sizing.cost import predict_run
from kvlab.sizing.preflight import preflight

ALONE_LENGTHS = 4  # prompt lengths whose prefill=gpu runs alone first, as the reference of the slowdown
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class _Stop:
    """The stop signals' handler: raises Stopped, saying which peers the launcher had found dead (it
    stops a rank still waiting on a dead peer; the rank's requests then name the cause, not the signal).
    That stop does not cut short ``local_work``."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.setup = None  # names the dead ranks once built
        self.settled = False  # the rank's outcome is decided: a signal now has nothing left to stop
        self.local = False  # within ``local_work``
        self.deferred: str | None = None  # the stop local_work raises as it ends
        self.taken = False  # a stop after a death was raised: the next one is not put off

    def __call__(self, signum, frame) -> None:
        if self.settled:  # raising now would escape the code that catches Stopped: a traceback, a lost exit code
            return
        # the launcher's SIGTERM after a death is meant for a rank still waiting on the dead peer: the requests that
        # landed whole are still checked, not failed "before verification" (kvlab.rank.executor)
        after_death = signum == signal.SIGTERM and not _orphaned() and bool(self.died())
        if after_death and self.local and self.deferred is None and not self.taken:  # checking: it waits on nobody
            self.deferred = f"stopped by {signal.Signals(signum).name}{self.dead()}"
            return
        _quiet()
        self.taken = self.taken or after_death
        raise Stopped(f"stopped by {signal.Signals(signum).name}{_orphaned() or self.dead()}", after_death=after_death)

    @contextlib.contextmanager
    def local_work(self):
        """Work that waits on no peer (checking the requests that landed, after the loop). A SIGTERM in it, once a
        peer is marked dead, is the launcher's stop after that death: it takes effect (Stopped) as the work ends.
        Only one is put off: a second SIGTERM (the launcher's deadline, a user's stop after the group's), or a
        SIGINT, stops the work at once, also where the launcher's stop came before it (it was raised then, and the
        handlers were quiet since)."""
        rearmed = self.taken and not self.settled
        if rearmed:
            for s in STOP_SIGNALS:
                signal.signal(s, self)
        self.local = True
        try:
            yield
        finally:
            self.local = False
            if rearmed:
                _quiet()
        if self.deferred is not None:
            _quiet()
            raise Stopped(self.deferred, after_death=True)

    def dead(self) -> str:
        gone = self.died()
        return f" after {gone} died" if gone else ""

    def died(self) -> str:
        return "" if self.setup is None else _died(self.setup, self.run_dir)


def _quiet() -> None:
    """After the stop this rank acts on: one is enough, let it write what it knows (a no-op handler, not SIG_IGN: a
    signal already pending would otherwise raise "ignored due to race")."""
    for s in STOP_SIGNALS:
        signal.signal(s, ignore)


def _died(setup, run_dir: Path) -> str:
    """The first rank the launcher marked dead, as "ctx1 (rank 1)"; "" while none is."""
    gone = [w for w in range(setup.world_size) if marked_dead(run_dir, w)]
    return "".join(f"{report.rank_name(setup, w)} (rank {w})" for w in gone[:1])


def _orphaned() -> str:
    """' (its launcher, pid N, died)' where the local launcher that started this rank is gone (its death is
    what sends this rank SIGTERM: kvlab.core.interrupt.die_with_parent), else ''."""
    parent = os.environ.get("KVLAB_PARENT")
    return f" (its launcher, pid {parent}, died)" if parent is not None and os.getppid() != int(parent) else ""


def _parent_merges() -> bool:
    """Whether the local launcher that started this rank is alive to merge the part files itself."""
    parent = os.environ.get("KVLAB_PARENT")
    return parent is not None and os.getppid() == int(parent)


def say_for_host(run_dir: Path, key: str, line: str) -> None:
    """A line every rank of a host would print alike (the same sources, the same compiler): its first local rank
    says it, once per sweep (kvlab.results.rundir.say_once); each rank's records keep what it did."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        say_once(run_dir, key, line)


def worker_main(cfg: DictConfig, run_dir: Path) -> int:
    """One rank; returns its exit code (0: every request verified; 1: failures; 2: bad config).

    SIGTERM or SIGINT (Ctrl-C, the local launcher stopping the run, or torchrun's agent after another
    rank failed) ends the transfers like a lost peer, so that this rank still writes its part file;
    stopped before its transfers, it writes an empty one."""
    stop = _Stop(run_dir)
    previous = {}
    world_rank = int(os.environ.get("RANK", 0))

    def last_words(signame: str) -> None:
        if read_part(run_dir, world_rank) is None:
            write_part(run_dir, PartFile(rank=world_rank, side="", side_rank=-1, errors=[
                f"rank {world_rank}: stopped by {signame}{_orphaned() or stop.dead()} before its transfers"]))

    def refused(e: ConfigError) -> int:  # most meet every rank alike (a value, a full run directory): one says it
        if _parent_merges():  # one only this rank meets (its disk): kvlab run's launcher says it, once
            write_refusal(run_dir, world_rank, str(e))
        if world_rank == 0:
            print(f"kvlab: error: {e}", file=sys.stderr)
        return 2

    at_once = AtOnce(last_words)
    ready()
    at_once.start()
    try:
        # only inside the try, which catches what they raise: until here the start's handlers end the rank
        previous.update((s, signal.signal(s, stop)) for s in STOP_SIGNALS)
        try:
            setup = stop.setup = build(cfg)
            setup.check_installed()
            world_rank, device = transport.init(setup, setup.transfer.timeout_s)
        except ConfigError as e:
            return refused(e)
        try:
            return _worker(setup, run_dir, world_rank, device, at_once, stop)
        except ConfigError as e:
            return refused(e)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    except (Stopped, dist.DistError) as e:  # stopped, or a peer gone while joining: an empty part says so
        stop.settled = True
        if read_part(run_dir, world_rank) is None:
            said = (str(e).strip().splitlines() or [""])[0][:200]  # which wait failed, e.g. a store key's
            why = e if isinstance(e, Stopped) else f"lost the others ({type(e).__name__}{': ' * bool(said)}{said})"
            # the start-up's guard ends when the clock starts: a peer lost later (the decode check's exchange after
            # the loop) is not lost before the transfers
            when = "before its transfers" if at_once.active.is_set() else "after its transfers began"
            try:
                write_part(run_dir, PartFile(rank=world_rank, side="", side_rank=-1, errors=[
                    f"rank {world_rank}: {why} {when}"]))
            except ConfigError as full:
                return refused(full)
        return 1
    finally:
        stop.settled = True  # before anything here can run a handler (signal.signal runs a pending one first)
        at_once.end()
        for s, h in previous.items():
            signal.signal(s, h)


def prefix_skipped(setup, run_plan: RunPlan, gen_rank: int) -> dict[int, int]:
    """Bytes of each request gen rank ``gen_rank`` did not need moved: its plan without the prefix hit, less
    with it (``run_plan``'s segments: the same pure plan both sides follow)."""
    out = {}
    for r in run_plan.requests:
        if r.prefix is not None and r.prefix.hit:
            full = plan(setup.model, setup.ctx, setup.gen, replace(r, prefix=None), setup.fault.window_trim)
            out[r.id] = sum(s.nbytes for s in full if s.dst == gen_rank) - \
                sum(s.nbytes for s in run_plan.segments[r.id] if s.dst == gen_rank)
    return out


def _worker(setup, run_dir: Path, world_rank: int, device: torch.device, at_once: AtOnce, stop: _Stop) -> int:
    side_spec, rank = setup.side_of(world_rank)
    side = side_spec.name
    state = CacheState(setup.model, side_spec, rank)
    try:
        transport.handshake(state)
    except RuntimeError as e:  # gloo's 'Connection reset by peer': a rank gone during the handshake
        if isinstance(e, (dist.DistError, Stopped)):
            raise
        raise dist.DistNetworkError(f"a peer left during the handshake ({str(e).splitlines()[0][:200]})") from None
    mover = transports.create(setup, side, rank, world_rank, device)
    at_once.cleanups.append(mover.leave)
    try:
        return _transfer(setup, run_dir, world_rank, device, side, rank, state, mover, at_once, stop)
    finally:
        mover.close()  # unmapped and unlinked also after a failure


def _transfer(setup, run_dir: Path, world_rank: int, device: torch.device, side: str, rank: int,
              state: CacheState, mover, at_once: AtOnce, stop: _Stop) -> int:

    run_plan = plan_run(setup)
    needed = preflight(setup, run_plan, world_rank)  # the same checks on every rank: all stop or none
    if device.type == "cuda":  # the host's memory was checked before the ranks started; the GPUs only here
        problem = budget.device_problem(setup, world_rank, torch.cuda.device_count(),
                                        torch.cuda.mem_get_info(device)[0],
                                        int(os.environ.get("LOCAL_WORLD_SIZE", setup.world_size)))
        problems: list = [None] * setup.world_size
        dist.all_gather_object(problems, problem)  # every rank stops, or none
        if any(problems):
            raise ConfigError(*next(p for p in problems if p))
    mine = run_plan.chunks_of(world_rank)

    ops = get_ops(setup.kernels, device.type, say=functools.partial(say_for_host, run_dir, "kernels-auto"))
    cache = PagedCache(state, needed, setup.cache.spare_blocks, setup.cache.fragmentation,
                       setup.workload.seed + 17 * world_rank, device, mover.pool_storage)
    gpu_prefill, alone = None, {}
    if side == "ctx" and setup.prefill.kind == "gpu":
        from kvlab.rank.prefill_gpu import GpuPrefill

        # before the baseline: its weights are the model's, not the transfer's; the prefill alone (nothing
        # else on the GPU) is the reference of the same prefill under transfers, for a few prompt lengths
        gpu_prefill = GpuPrefill(setup.model, setup.ctx.tp, device, setup.workload.seed + world_rank)
        # the same layers each followed by the same cache write as in the run, on a request of each length (its
        # blocks taken for the measure and given back: before the run opens any)
        first = {}  # prompt length -> the first request of that length this rank sends
        sends = {c.request for c in mine}
        for r in run_plan.requests:
            if r.id in sends:
                first.setdefault(r.isl, r)
        alone = {n: gpu_prefill.alone_with_cache_s(first[n], cache, ops) for n in sorted(first)[:ALONE_LENGTHS]}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base_alloc = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        free0 = torch.cuda.mem_get_info(device)[0]
    progress = Progress(run_plan.bytes_of(world_rank), world_rank == 0 and setup.logger.progress)
    board = report.Board(dist.distributed_c10d._get_default_store(), world_rank, setup.world_size,
                         report.stale_s(setup))
    board.gone = lambda r: marked_dead(run_dir, r)
    cache.tick = board.beat
    if setup.check.decode:  # the decode model's own cache instead of the hash fill; before the clock
        from kvlab.rank.decode_check import DecodeCheck

        decode_check = DecodeCheck(setup, side, rank, run_plan.requests, dist.distributed_c10d._get_default_store())
        decode_check.prepare(cache, board.beat)
    executor = Executor(setup, run_plan, side, rank, world_rank, device, cache, mover, ops, None, progress,
                        faults.for_rank(setup.fault, world_rank, mine), board.beat,
                        functools.partial(_died, setup, run_dir), stop.local_work)
    if side == "ctx" and setup.prefill.kind == "model":  # the model built before the clock, run on it
        from kvlab.rank.prefill_model import ModelPrefill

        executor.model_prefill = (ModelPrefill(setup, device), decode_check)
    if side == "gen" and setup.gen.prefix_cache_tokens:  # prefix reuse: which blocks it shares, what it saves
        cache.share(run_plan.requests)
        executor.skipped = prefix_skipped(setup, run_plan, rank)
    executor.connect()  # after the baseline: what the transport allocates (slots, NCCL's buffers) is extra
    if os.environ.get(linkcurve.ENV):  # kvlab link: the curve over message sizes instead of the transfers
        return linkcurve.run(setup, mover, world_rank, run_plan.order, run_dir, device)
    link = linkrate.measure(setup, mover, world_rank, run_plan.order) if setup.transfer.baseline else None
    if device.type == "cuda":
        # the baseline's own buffers are freed by now: keep them out of the transfer's peak, which still
        # starts from everything connect allocated (slots, the transport's buffers)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    executor.gpu_prefill, executor.prefill_alone = gpu_prefill, alone
    dist.barrier()
    at_once.end()  # the loop returns to Python between its waits: a signal from here on is Stopped there
    clock = executor.clock = Clock(device)  # started right after the barrier: one epoch for every rank
    board.watch()

    records = executor.run()
    failures = dict(executor.failures)
    errors = [executor.error] if executor.error else []
    progress.close()
    staging = mover.peak_staging_bytes
    peak = Peak(staging=staging, extra=staging, cache=cache.nbytes,
                max_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # host memory, Linux KiB
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        # staging is allocated after the baseline, so the allocator's peak growth includes it
        peak.extra = max(0, max(executor.transfer_peak, executor.tracked_peak()) - base_alloc)
        torch.cuda.empty_cache()  # cached blocks of fill/verify are not the transfer's
        peak.free_drop = free0 - torch.cuda.mem_get_info(device)[0]
    errors += cache.check_canaries()  # after the peak: its temporaries are not the transfer's
    for rec in records:
        if rec.end is None:
            rec.end = clock.mark()
    clock.settle()  # after every mark above: they lie between its two brackets
    parts = [metrics.resolve(r, clock, setup.model.num_layers) for r in records]
    if setup.check.decode:
        decode_check.finish(parts, board.beat)

    part = PartFile(
        rank=world_rank, side=side, side_rank=rank, parts=parts, failures=failures, errors=errors,
        error_at=executor.error_at, peak=peak, host=socket.gethostname(), link=link,
        held_blocks=sum(len(t.host) for ts in cache.tables.values() for t in ts.values()),  # 0: all freed
        node=os.environ.get("GROUP_RANK"),
        env=Env(backend=dist.get_backend(), kernels=ops.name,
                device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"))
    try:
        write_part(run_dir, part)  # before any exchange: what this rank knows survives it
    except ConfigError as e:
        board.refuse(e)
        raise
    if executor.stopped and world_rank != 0:
        return 1
    summary = None
    if world_rank == 0:
        why = f"dead, or silent for more than {board.stale_s:g} s"
        try:
            if executor.stopped:
                raise Stopped()
            board.post(part)
            gathered, silent = board.collect()
        except Stopped:
            if _parent_merges():  # kvlab run's launcher merges once every rank has written its part
                return 1
            # torchrun's agent stops every rank once one has died: the others are writing their part
            # files right now (those blocked in a transfer within transfer.timeout_s); merge what lands
            board.broken, why = "stopped", "dead, or stopped before it could report"
            gathered, silent = report.wait_for_parts(run_dir, range(1, setup.world_size),
                                                     min(setup.transfer.timeout_s + 2.0, 20.0))
        gathered[0] = part
        for r in list(silent):  # a shared run dir may hold what the store could not bring
            late = read_part(run_dir, r)
            if late is not None:
                gathered[r] = late
                silent.remove(r)
        sink = WandbSink.create(setup, run_dir, world_rank)  # its warnings before the results line
        # with the launcher dead, no one else says the run was interrupted: the summary does
        summary = report.finalize(setup, run_dir, run_plan, gathered, silent, why,
                                  predict_run(setup, run_plan.requests),
                                  f"SIGTERM{_orphaned()}" if _orphaned() else None)
        if executor.stopped or board.broken == "stopped":
            return 1
        board.publish({"verified": summary.verified}, sorted(set(gathered) - {0, *silent}))
        verified = summary.verified
    else:
        board.post(part)
        verdict = board.await_verdict()
        # without rank 0's verdict this rank can only vouch for itself
        verified = verdict["verified"] if verdict else not (failures or errors or any(p.errors for p in parts))
    board.stop()
    if summary is not None:  # one wandb run per job: rank 0's, with the merged results
        sink.log_summary(summary)
        sink.finish()
    return 0 if verified else 1


