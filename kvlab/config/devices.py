"""Where a rank runs and what carries its bytes: the one place that decides the device and the backends,
and that refuses a transport this host's GPUs cannot place.

``device=auto`` puts the ranks on GPUs when CUDA is visible, else on CPUs. On GPUs the default
group (control objects: handshake, results) is gloo on CPU tensors and NCCL on CUDA ones, and
every ctx/gen pair group is NCCL; on CPUs everything is gloo. The cost model places ranks and
picks its rates from the same decisions (kvlab.sizing.cost).

``transport=auto`` (the default) is ``p2p``, except where p2p's NCCL pair groups cannot be placed:
NCCL refuses a communicator with two ranks on one GPU, so every ctx/gen pair needs its two ranks on
different GPUs of a host (``gpu_index``); with fewer GPUs (one GPU for a single-node run) auto is
``ipc``, which maps pools instead and runs with any number of ranks on one GPU. The config decides
it when it is built (``kvlab.config.schema.auto_transport``: this module builds on the config, not the
reverse); a run that names ``transport=p2p`` there is refused before any rank starts
(``check_placement``).
"""
from __future__ import annotations

import errno
import os
import socket
import stat
from pathlib import Path

import torch

from kvlab.config import schema as config
from kvlab.config.schema import AUTO_FALLBACK, P2P_CLASS, Setup, local_world_size
from kvlab.core.errors import ConfigError


def uses_cuda(setup: Setup) -> bool:
    return setup.device != "cpu" and torch.cuda.is_available()


def gpu_count(setup: Setup) -> int:
    """GPUs the ranks of this host share; 0 when they run on CPUs (kvlab.config.schema.visible_gpus)."""
    return config.visible_gpus(setup.device)


def mps_control() -> str | None:
    """The control endpoint of a live CUDA MPS daemon that this host's CUDA processes join when they start
    (``control`` under ``CUDA_MPS_PIPE_DIRECTORY``, else /tmp/nvidia-mps), where there is one. A daemon that
    ended uncleanly leaves its endpoint behind, and the processes then run without MPS: a named pipe that no
    process holds open for reading, or a socket that refuses a connection, is such a leftover. The probe
    opens and closes the endpoint without a word written, as a client that changed its mind.

    Only a refusal or a missing file counts as no daemon. A socket of another type than the probe's (the
    kernel answers EPROTOTYPE only where a socket is bound) or one whose queue is full (EAGAIN, or the
    probe's timeout) has a live daemon behind it. CUDA 13's daemon listens on a seqpacket socket (a stream
    connection gets EPROTOTYPE): on one H200 under a live daemon (copies at 0.906 of ``copy_`` against 0.731
    without it) a stream-only probe said there was none."""
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps") / "control"
    try:
        kind = pipe.stat().st_mode
        if stat.S_ISFIFO(kind):
            os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))  # ENXIO: nobody reads it
            return str(pipe)
        if not stat.S_ISSOCK(kind):
            return None
    except OSError:
        return None
    return str(pipe) if _listened(pipe) else None


def _listened(path: Path) -> bool:
    """Whether something is bound to the Unix socket at ``path``: a connection of any type it accepts, or an
    answer only a bound socket gives."""
    for kind in (socket.SOCK_STREAM, socket.SOCK_SEQPACKET):
        try:
            with socket.socket(socket.AF_UNIX, kind) as s:
                s.settimeout(1.0)
                s.connect(str(path))
            return True
        except (TimeoutError, BlockingIOError):
            return True
        except OSError as e:
            if e.errno != errno.EPROTOTYPE:
                return False
    return True  # bound, of a type neither probe speaks (datagrams)


def gpu_sharing(setup: Setup) -> dict:
    """How this host's ranks share its GPUs: the most ranks on one GPU (0 on CPUs) and whether they run as
    clients of a CUDA MPS daemon. Processes on one GPU without MPS take turns on it (time-slicing): a copy
    then waits for the turns of the other processes' kernels, a prefill's or a check's, and its figures hold
    them; under MPS they run side by side."""
    gpus = gpu_count(setup)
    if not gpus:
        return {"ranks_per_gpu": 0, "mps": None}
    return {"ranks_per_gpu": -(-local_world_size(setup) // gpus), "mps": mps_control() is not None}


def default_backend(device: torch.device) -> str:
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def pair_backend(setup: Setup) -> str:
    """The backend of the ctx/gen pair groups, which carry the cache bytes."""
    return "nccl" if uses_cuda(setup) else "gloo"


def gpu_index(setup: Setup, world_rank: int, local_rank: int, local_world: int, n_gpus: int) -> int:
    """The GPU of a rank (``Setup.gpu_index``: its config decides ``transport=auto`` from it too)."""
    return setup.gpu_index(world_rank, local_rank, local_world, n_gpus)


def choose(setup: Setup, world_rank: int) -> torch.device:
    """This rank's device; on GPUs it becomes the current one."""
    if setup.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", setup.device, "no CUDA device is visible here; use device=cpu or device=auto")
    if uses_cuda(setup):
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        local_world = local_world_size(setup)
        check_placement(setup, torch.cuda.device_count(), local_world)  # under torchrun no launcher checked it
        dev = torch.device("cuda", gpu_index(setup, world_rank, local_rank, local_world, torch.cuda.device_count()))
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


def check_placement(setup: Setup, gpus: int | None = None, local_world: int | None = None) -> None:
    """ConfigError when the run's transport is p2p over NCCL and its pair groups cannot be placed on this
    host's GPUs; called before any rank starts (and by every rank before it joins the others)."""
    bases = {f"{c.__module__}.{c.__qualname__}" for c in getattr(setup.transport.cls(), "__mro__", ())}
    if P2P_CLASS not in bases:
        return
    gpus = gpu_count(setup) if gpus is None else gpus
    local_world = local_world_size(setup) if local_world is None else local_world
    problem = setup.p2p_problem(gpus, local_world)
    if problem is not None:
        fix = f"use transport={AUTO_FALLBACK} (one node)" if local_world == setup.world_size else \
            "start fewer ranks per node or make more GPUs visible (ipc works within one node only)"
        raise ConfigError("transport", setup.transport.name, f"{problem}; {fix}")
