"""Where a rank runs and what carries its bytes: the one place that decides the device and the backends.

``device=auto`` puts the ranks on GPUs when CUDA is visible, else on CPUs. On GPUs the default
group (control objects: handshake, results) is gloo on CPU tensors and NCCL on CUDA ones, and
every ctx/gen pair group is NCCL; on CPUs everything is gloo. The cost model places ranks and
picks its rates from the same decisions (kvlab.cost).
"""
from __future__ import annotations

import os

import torch

from kvlab.config import Setup
from kvlab.errors import ConfigError


def uses_cuda(setup: Setup) -> bool:
    return setup.device != "cpu" and torch.cuda.is_available()


def default_backend(device: torch.device) -> str:
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def pair_backend(setup: Setup) -> str:
    """The backend of the ctx/gen pair groups, which carry the cache bytes."""
    return "nccl" if uses_cuda(setup) else "gloo"


def gpu_index(setup: Setup, world_rank: int, local_rank: int, local_world: int, n_gpus: int) -> int:
    """The GPU of a rank. With a GPU per local rank: its own. With fewer GPUs than ranks on one host:
    ctx ranks share the first half of the GPUs and gen ranks the second, so that every ctx/gen pair
    group spans two GPUs (NCCL refuses a communicator with two ranks on one GPU)."""
    if n_gpus >= local_world or n_gpus < 2 or local_world != setup.world_size:
        return local_rank % n_gpus
    side, rank = setup.side_of(world_rank)
    half = n_gpus // 2
    return rank % half if side.name == "ctx" else half + rank % (n_gpus - half)


def choose(setup: Setup, world_rank: int) -> torch.device:
    """This rank's device; on GPUs it becomes the current one."""
    if setup.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", setup.device, "no CUDA device is visible here; use device=cpu or device=auto")
    if uses_cuda(setup):
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", setup.world_size))
        dev = torch.device("cuda", gpu_index(setup, world_rank, local_rank, local_world, torch.cuda.device_count()))
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")
