"""The control plane: where each rank runs, the process group, and the handshake.

World ranks: ctx ranks first (side-local order), then gen ranks. The default group uses
gloo for control objects (handshake, results) and its store for small messages; how the
bytes of a chunk move is a transport's (kvlab.transports: ``transport=p2p``, ``ipc``).
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from kvlab.config import Setup
from kvlab.errors import ConfigError
from kvlab.state import CacheState, check_compatible


def gpu_index(setup: Setup, world_rank: int, local_rank: int, local_world: int, n_gpus: int) -> int:
    """The GPU of a rank. With a GPU per local rank: its own. With fewer GPUs than ranks on one host:
    ctx ranks share the first half of the GPUs and gen ranks the second, so that every ctx/gen pair
    group spans two GPUs (NCCL refuses a communicator with two ranks on one GPU)."""
    if n_gpus >= local_world or n_gpus < 2 or local_world != setup.world_size:
        return local_rank % n_gpus
    side, rank = setup.side_of(world_rank)
    half = n_gpus // 2
    return rank % half if side.name == "ctx" else half + rank % (n_gpus - half)


def choose_device(setup: Setup, world_rank: int) -> torch.device:
    want = setup.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", want, "no CUDA device is visible here; use device=cpu or device=auto")
    if want != "cpu" and torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", setup.world_size))
        dev = torch.device("cuda", gpu_index(setup, world_rank, local_rank, local_world, torch.cuda.device_count()))
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


def init(setup: Setup, timeout_s: float) -> tuple[int, torch.device]:
    """Join the process group started by torchrun; returns (world rank, device)."""
    world = int(os.environ["WORLD_SIZE"])
    if world != setup.world_size:
        raise ConfigError("WORLD_SIZE", world, f"the config needs {setup.ctx.size} ctx + {setup.gen.size} gen = "
                          f"{setup.world_size} ranks; start that many (or use `kvlab run`, which does)")
    device = choose_device(setup, int(os.environ["RANK"]))
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=max(timeout_s, 30)))
    return dist.get_rank(), device


def handshake(state: CacheState) -> list[dict]:
    """Exchange cache states; every rank raises the same ConfigError on a mismatch (no rank is left waiting)."""
    states: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(states, state.to_dict())
    ctx = [(r, s) for r, s in enumerate(states) if s["side"]["name"] == "ctx"]
    gen = [(r, s) for r, s in enumerate(states) if s["side"]["name"] == "gen"]
    if not ctx or not gen:
        raise ConfigError("ranks", f"{len(ctx)} ctx + {len(gen)} gen", "a transfer needs ranks on both sides")
    r0, s0 = ctx[0]
    for r, s in ctx[1:] + gen[:1]:
        check_compatible(s0, s, (f"ctx rank {r0}", f"{s['side']['name']} rank {r}"))
    for r, s in gen[1:]:
        check_compatible(gen[0][1], s, (f"gen rank {gen[0][0]}", f"gen rank {r}"))
    return states
