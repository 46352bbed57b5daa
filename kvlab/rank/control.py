"""The control plane: where each rank runs, the process group, and the handshake.

World ranks: ctx ranks first (side-local order), then gen ranks. The default group uses
gloo for control objects (handshake, results) and its store for small messages; how the
bytes of a chunk move is a transport's (kvlab.transports: ``transport=p2p``, ``ipc``, ``nixl``, or
``auto``, the default, which kvlab.config.schema.auto_transport resolves to ``p2p`` or ``ipc``).
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from kvlab.config import devices
from kvlab.config.schema import Setup
from kvlab.core.errors import ConfigError
from kvlab.model.state import CacheState, check_compatible


def init(setup: Setup, timeout_s: float) -> tuple[int, torch.device]:
    """Join the process group started by torchrun; returns (world rank, device)."""
    world = int(os.environ["WORLD_SIZE"])
    if world != setup.world_size:
        raise ConfigError("WORLD_SIZE", world, f"the config needs {setup.ctx.size} ctx + {setup.gen.size} gen = "
                          f"{setup.world_size} ranks; start that many (or use `kvlab run`, which does)")
    device = devices.choose(setup, int(os.environ["RANK"]))
    dist.init_process_group(devices.default_backend(device), timeout=datetime.timedelta(seconds=max(timeout_s, 30)))
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
