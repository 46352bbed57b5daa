"""``kvlab run``: the whole pipeline, from config to verified figures.

Outside torchrun the Hydra app resolves the config once, writes it to the run directory
and starts the ranks (kvlab.launch); under torchrun every process composes the same
config and is one rank; the run directory is named by TORCHELASTIC_RUN_ID, which all
ranks of a job share (conf/config.yaml), so they never race on it. Each rank:

    build specs -> init torch.distributed -> handshake (cache states) -> pair groups
    -> requests, plans, schedules, global order (pure, identical everywhere)
    -> cache + staging allocated once -> barrier -> executor -> canaries
    -> rank 0 merges every rank's records: results.jsonl, timeline.jsonl, summary.json, table
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from kvlab import metrics, transport
from kvlab.cache import PagedCache, blocks_for
from kvlab.clock import Clock
from kvlab.config import CONF_DIR, build, compose, to_container
from kvlab.errors import ConfigError
from kvlab.executor import Executor, TransferTimeout
from kvlab.launch import launch_local, under_torchrun
from kvlab.ops import get_ops
from kvlab.plan import plan
from kvlab.schedule import Chunk, schedule
from kvlab.state import CacheState
from kvlab.workload import interleave, make_requests


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


def _sink(cfg: DictConfig, run_dir: Path, rank: int, side: str):
    try:
        from kvlab.wandb_sink import WandbSink
    except ImportError:
        return None
    return WandbSink.create(to_container(cfg), run_dir, rank, side)


def worker_main(cfg: DictConfig, run_dir: Path) -> int:
    """One rank; returns its exit code (0: every request verified; 1: failures; 2: bad config)."""
    try:
        setup = build(cfg)
        world_rank, device = transport.init(setup, setup.transfer.timeout_s)
    except ConfigError as e:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"kvlab: error: {e}", file=sys.stderr)
        return 2
    try:
        return _worker(setup, cfg, run_dir, world_rank, device)
    except ConfigError as e:
        if world_rank == 0:
            print(f"kvlab: error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _worker(setup, cfg, run_dir: Path, world_rank: int, device: torch.device) -> int:
    side_spec, rank = setup.side_of(world_rank)
    side = side_spec.name
    state = CacheState(setup.model, side_spec, rank)
    transport.handshake(state)
    groups = transport.pair_groups(setup)

    requests = make_requests(setup)
    segments = {r.id: plan(setup.model, setup.ctx, setup.gen, r) for r in requests}
    schedules = [schedule(setup.model, setup.ctx, setup.gen, segments[r.id], setup.transfer.strategy,
                          setup.transfer.slot_bytes) for r in requests]
    order = interleave(schedules, cfg.workload.concurrency)
    mine = [c for c in order if (c.src if side == "ctx" else c.dst) == rank]
    needed = peak_blocks(state, mine, {r.id: r.isl for r in requests}, setup.transfer.slots)

    ops = get_ops(cfg.kernels, device.type)
    cache = PagedCache(state, needed, cfg.cache.spare_blocks, cfg.cache.fragmentation,
                       cfg.workload.seed + 17 * world_rank, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base_alloc = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        free0 = torch.cuda.mem_get_info(device)[0]
    transport.warm_up(setup, groups, world_rank, device)  # after the baseline: NCCL's buffers count as extra
    progress = _Progress(sum(c.nbytes for c in mine), world_rank == 0 and cfg.logger.progress)
    clock = Clock(device)
    executor = Executor(setup, side, rank, world_rank, device, cache, groups, ops, clock, progress)
    dist.barrier()
    clock = executor.clock = Clock(device)

    failures: dict[int, str] = {}
    errors: list[str] = []
    try:
        records = executor.run(order, {r.id: r for r in requests}, segments)
    except TransferTimeout as e:
        errors.append(f"{side}{rank}: {e}")
        records = list(executor.records.values())
        for rec in records:
            if rec.end is None:
                failures[rec.request] = f"{side}{rank}: {e}"
    progress.close()
    staging = executor.staging.peak_bytes
    peak = {"staging": staging, "extra": staging, "cache": cache.nbytes}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        # staging is allocated after the baseline, so the allocator's peak growth includes it
        peak["extra"] = max(executor.transfer_peak, torch.cuda.max_memory_allocated(device)) - base_alloc
        torch.cuda.empty_cache()  # cached blocks of fill/verify are not the transfer's
        peak["free_drop"] = free0 - torch.cuda.mem_get_info(device)[0]
    errors += cache.check_canaries()  # after the peak: its temporaries are not the transfer's
    for rec in records:
        if rec.end is None:
            rec.end = clock.mark()
    parts = [metrics.resolve(r, clock, setup.model.num_layers) for r in records]

    gathered = [None] * dist.get_world_size() if world_rank == 0 else None
    dist.gather_object({"parts": parts, "failures": failures, "errors": errors, "peak": peak}, gathered, dst=0)
    verdict = [None]
    if world_rank == 0:
        all_parts = [p for g in gathered for p in g["parts"]]
        all_failures = {k: v for g in gathered for k, v in g["failures"].items()}
        all_errors = [e for g in gathered for e in g["errors"]]
        rows, timeline = metrics.merge(all_parts, all_failures, {r.id: r.ctx_dp for r in requests},
                                       {r.id: r.gen_dp for r in requests})
        env = {"backend": dist.get_backend(), "errors": all_errors, "kernels": ops.name,
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "predicted_s": _predict(setup, requests)}
        summary = metrics.summarize(rows, all_parts, setup, [g["peak"] for g in gathered], env)
        metrics.write(run_dir, rows, timeline, summary)
        metrics.print_table(rows, summary)
        for e in all_errors:
            print(f"kvlab: {e}", file=sys.stderr)
        print(f"results in {run_dir}")
        verdict = [summary]
    dist.broadcast_object_list(verdict, src=0)
    summary = verdict[0]
    sink = _sink(cfg, run_dir, world_rank, side)
    if sink is not None:
        for p in parts:
            sink.log_request(p)
        if world_rank == 0:
            sink.log_summary(summary)
        sink.finish()
    return 0 if summary["verified"] else 1


def _predict(setup, requests) -> float | None:
    try:
        from kvlab.cost import predict_run
    except ImportError:
        return None
    return predict_run(setup, requests)


def _prepare(cfg: DictConfig, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))


def run_transfer(overrides: list[str] | tuple[str, ...] = (), run_dir: str | Path = "outputs/api") -> dict:
    """Run a transfer from Python (a notebook, a test): starts the ranks, returns the summary."""
    import json

    cfg = compose(list(overrides))
    setup = build(cfg)
    run_dir = Path(run_dir)
    _prepare(cfg, run_dir)
    rc = launch_local(run_dir, setup.world_size)
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
        _prepare(cfg, run_dir)
        rc = launch_local(run_dir, setup.world_size)
    if rc and not HydraConfig.get().mode.name == "MULTIRUN":
        sys.exit(rc)
