"""``kvlab run``: the whole pipeline, from config to verified figures.

Outside torchrun the Hydra app resolves the config once, writes it to the run directory
and starts the ranks (kvlab.launch); under torchrun every process composes the same
config and is one rank; the run directory is named by TORCHELASTIC_RUN_ID, which all
ranks of a job share (conf/config.yaml), so they never race on it. Each rank:

    build specs -> init torch.distributed -> handshake (cache states) -> pair groups
    -> requests, plans, schedules, global order (pure, identical everywhere)
    -> cache + staging allocated once -> barrier -> executor -> canaries
    -> its part: parts/rank<N>.json and the store (kvlab.report: no collective after the transfers)
    -> rank 0 merges every part it gets: results.jsonl, timeline.jsonl, summary.json, table

A rank that fails a chunk (timeout, lost peer) fails the requests it has open, frees their
blocks and stops its loop; rank 0 reports every request that did not arrive whole, with the
reason, and the ranks that fell silent. Exit codes: 0 verified, 1 failures, 2 bad config,
3 killed by fault injection (kvlab.faults).
"""
from __future__ import annotations

import math
import os
import resource
import signal
import socket
import sys
import time
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from kvlab import faults, metrics, report, transport, transports
from kvlab.cache import PagedCache, blocks_for
from kvlab.clock import Clock
from kvlab.config import CONF_DIR, build, compose
from kvlab.cost import predict_run
from kvlab.errors import ConfigError
from kvlab.executor import Executor, Stopped
from kvlab.launch import launch_local, under_torchrun
from kvlab.ops import get_ops
from kvlab.plan import plan
from kvlab.records import Env, PartFile, Peak, read_part, write_part
from kvlab.schedule import Chunk, schedule
from kvlab.state import CacheState
from kvlab.workload import chunks_of, interleave, make_requests


def peak_blocks(state: CacheState, mine: list[Chunk], isl: dict[int, int], window: int) -> dict[str, int]:
    """Blocks per pool held at the worst moment: a request is open from its first chunk on this rank
    until ``window`` chunks after its last (completion lags posting by up to the window)."""
    first, last = {}, {}
    for i, c in enumerate(mine):
        first.setdefault(c.request, i)
        last[c.request] = i + window
    events = sorted([(i, 1, r) for r, i in first.items()] + [(i, -1, r) for r, i in last.items()],
                    key=lambda e: (e[0], -e[1]))
    out = {}
    for pool in state.pools():
        cur = peak = 0
        for _, sign, r in events:
            cur += sign * blocks_for(pool, isl[r])
            peak = max(peak, cur)
        out[pool.name] = peak
    return out


class _Progress:
    """A progress bar over this rank's bytes, shown only once the run has lasted a few seconds."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.done = total, enabled, 0
        self.t0, self.bar, self.task = time.time(), None, None

    def __call__(self, nbytes: int) -> None:
        self.done += nbytes
        if not self.enabled:
            return
        if self.bar is None and time.time() - self.t0 > 3:
            from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn
            self.bar = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                                TransferSpeedColumn(), TimeRemainingColumn(), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("transfer (rank 0)", total=self.total)
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _sink(setup, run_dir: Path, rank: int, side: str):
    from kvlab.wandb_sink import WandbSink

    return WandbSink.create(setup.to_dict(), run_dir, rank, side)


def _stop(signum, frame) -> None:
    signal.signal(signum, signal.SIG_IGN)  # one is enough: let this rank write what it knows
    raise Stopped(f"stopped by {signal.Signals(signum).name}")


def worker_main(cfg: DictConfig, run_dir: Path) -> int:
    """One rank; returns its exit code (0: every request verified; 1: failures; 2: bad config).

    SIGTERM (the local launcher's grace ran out, or torchrun's agent saw another rank fail) ends
    the transfers like a lost peer, so that this rank still writes its part file."""
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        setup = build(cfg)
        world_rank, device = transport.init(setup, setup.transfer.timeout_s)
    except ConfigError as e:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"kvlab: error: {e}", file=sys.stderr)
        return 2
    try:
        return _worker(setup, run_dir, world_rank, device)
    except ConfigError as e:
        if world_rank == 0:
            print(f"kvlab: error: {e}", file=sys.stderr)
        return 2
    except Stopped:
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        if dist.is_initialized():
            dist.destroy_process_group()


def _worker(setup, run_dir: Path, world_rank: int, device: torch.device) -> int:
    side_spec, rank = setup.side_of(world_rank)
    side = side_spec.name
    state = CacheState(setup.model, side_spec, rank)
    transport.handshake(state)
    mover = transports.create(setup, side, rank, world_rank, device)
    try:
        return _transfer(setup, run_dir, world_rank, device, side, rank, state, mover)
    finally:
        mover.close()  # unmapped and unlinked also after a failure


def _transfer(setup, run_dir: Path, world_rank: int, device: torch.device, side: str, rank: int,
              state: CacheState, mover) -> int:

    requests, segments, order = plan_run(setup)
    needed = preflight(setup, requests, order, world_rank)  # the same checks on every rank: all stop or none
    mine = chunks_of(order, setup, world_rank)

    ops = get_ops(setup.kernels, device.type)
    cache = PagedCache(state, needed, setup.cache.spare_blocks, setup.cache.fragmentation,
                       setup.workload.seed + 17 * world_rank, device, mover.pool_storage)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base_alloc = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        free0 = torch.cuda.mem_get_info(device)[0]
    progress = _Progress(sum(c.nbytes for c in mine), world_rank == 0 and setup.logger.progress)
    board = report.Board(dist.distributed_c10d._get_default_store(), world_rank, setup.world_size,
                         stale_s(setup))
    cache.tick = board.beat
    executor = Executor(setup, side, rank, world_rank, device, cache, mover, ops, None, progress,
                        faults.for_rank(setup.fault, world_rank, mine), board.beat)
    executor.connect()  # after the baseline: what the transport allocates (slots, NCCL's buffers) is extra
    dist.barrier()
    clock = executor.clock = Clock(device)  # started right after the barrier: one epoch for every rank
    board.watch()

    records = executor.run(order, {r.id: r for r in requests}, segments)
    failures = dict(executor.failures)
    errors = [executor.error] if executor.error else []
    progress.close()
    staging = mover.peak_staging_bytes
    peak = Peak(staging=staging, extra=staging, cache=cache.nbytes,
                max_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # host memory, Linux KiB
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        # staging is allocated after the baseline, so the allocator's peak growth includes it
        peak.extra = max(executor.transfer_peak, torch.cuda.max_memory_allocated(device)) - base_alloc
        torch.cuda.empty_cache()  # cached blocks of fill/verify are not the transfer's
        peak.free_drop = free0 - torch.cuda.mem_get_info(device)[0]
    errors += cache.check_canaries()  # after the peak: its temporaries are not the transfer's
    for rec in records:
        if rec.end is None:
            rec.end = clock.mark()
    parts = [metrics.resolve(r, clock, setup.model.num_layers) for r in records]

    part = PartFile(
        rank=world_rank, side=side, side_rank=rank, parts=parts, failures=failures, errors=errors,
        error_at=executor.error_at, peak=peak, host=socket.gethostname(),
        held_blocks=sum(len(t.host) for ts in cache.tables.values() for t in ts.values()),  # 0: all freed
        node=os.environ.get("GROUP_RANK"),
        env=Env(backend=dist.get_backend(), kernels=ops.name,
                device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"))
    write_part(run_dir, part)  # before any exchange: what this rank knows survives it
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
        summary = report.finalize(setup, run_dir, requests, order, gathered, silent, why,
                                  predict_run(setup, requests))
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
    sink = _sink(setup, run_dir, world_rank, side)
    if sink is not None:
        for p in parts:
            sink.log_request(p)
        if summary is not None:
            sink.log_summary(summary)
        sink.finish()
    return 0 if verified else 1


def stale_s(setup) -> float:
    """Silence after which a rank counts as dead or stalled: a healthy rank completes or fails a chunk
    within the transfer timeout, and shows progress between chunks (kvlab.report)."""
    return setup.transfer.timeout_s + 5.0


def grace_s(setup) -> float:
    """How long the local launcher lets the other ranks report after one failed: a timeout to notice,
    the silence rank 0 waits out, and a margin."""
    return setup.transfer.timeout_s + stale_s(setup) + 10.0


def plan_run(setup) -> tuple[list, dict, list[Chunk]]:
    """(requests, segments by request, global chunk order): pure, the same on every rank."""
    requests = make_requests(setup)
    segments = {r.id: plan(setup.model, setup.ctx, setup.gen, r) for r in requests}
    schedules = [schedule(setup.model, setup.ctx, setup.gen, segments[r.id], setup.transfer.strategy,
                          setup.transfer.slot_bytes) for r in requests]
    return requests, segments, interleave(schedules, setup.workload.concurrency)


def preflight(setup, requests=None, order=None, rank: int | None = None) -> dict[str, int] | None:
    """Checks that need the plan, before anything is allocated; returns the blocks per pool that world
    rank ``rank`` allocates. With ``cache.capacity_tokens`` every pool holds that many tokens, and the
    requests in flight at the worst moment must fit on every rank (checked for all of them, so that
    every rank stops or none does): kvlab has no admission control for cache blocks."""
    if requests is None:
        requests, _, order = plan_run(setup)
    faults.check(setup, order)
    isl = {r.id: r.isl for r in requests}
    cap = setup.cache.capacity_tokens
    out = None
    for w in range(setup.world_size) if cap else ([] if rank is None else [rank]):
        side, side_rank = setup.side_of(w)
        state = CacheState(setup.model, side, side_rank)
        need = peak_blocks(state, chunks_of(order, setup, w), isl, setup.transfer.slots)
        if cap:
            for pool in state.pools():
                have = math.ceil(cap / pool.tokens_per_block)
                if need[pool.name] > have:
                    tokens = need[pool.name] * pool.tokens_per_block
                    raise ConfigError("cache.capacity_tokens", cap,
                                      f"the requests {side.name}{side_rank} holds at once need {need[pool.name]} "
                                      f"blocks ({tokens} tokens) of pool {pool.name}; raise it to >= {tokens} or "
                                      "lower workload.concurrency (0 sizes the cache to the workload)")
            need = {pool.name: math.ceil(cap / pool.tokens_per_block) for pool in state.pools()}
        if w == rank:
            out = need
    return out


def _launch(setup, run_dir: Path) -> int:
    names = [report.rank_name(setup, w) for w in range(setup.world_size)]
    rc = launch_local(run_dir, setup.world_size, grace_s=grace_s(setup), names=names)
    if rc not in (0, 2) and not (run_dir / "summary.json").exists():
        requests, _, order = plan_run(setup)
        report.finalize_from_files(setup, run_dir, requests, order, predict_run(setup, requests))
    return rc


def _prepare(cfg: DictConfig, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))


def run_transfer(overrides: list[str] | tuple[str, ...] = (), run_dir: str | Path = "outputs/api") -> dict:
    """Run a transfer from Python (a notebook, a test): starts the ranks, returns the summary."""
    import json

    cfg = compose(list(overrides))
    setup = build(cfg)
    if setup.needs_preflight:
        preflight(setup)
    run_dir = Path(run_dir)
    _prepare(cfg, run_dir)
    rc = _launch(setup, run_dir)
    summary_path = run_dir / "summary.json"
    if rc == 2 or not summary_path.exists():
        raise RuntimeError(f"kvlab run failed with exit code {rc}; see the output above")
    return json.loads(summary_path.read_text())


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def hydra_main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if under_torchrun():
        if int(os.environ["RANK"]) == 0:
            _prepare(cfg, run_dir)
        rc = worker_main(cfg, run_dir)
    else:
        setup = build(cfg)
        try:
            if setup.needs_preflight:
                preflight(setup)
        except ConfigError as e:  # multirun skips the CLI's checks; Hydra would print a traceback
            print(f"kvlab: error: {e}", file=sys.stderr)
            rc = 2
        else:
            _prepare(cfg, run_dir)
            rc = _launch(setup, run_dir)
    if rc and not HydraConfig.get().mode.name == "MULTIRUN":
        sys.exit(rc)
