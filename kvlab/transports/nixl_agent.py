"""NIXL agents: loading the optional package, one agent per process, metadata through a store.

NIXL (``pip install -e ".[nixl]"``) moves registered memory between agents with one-sided
WRITEs; its UCX backend picks the path (cross-memory attach or shared memory between
processes on one host, CUDA IPC between GPUs of one node, RDMA across nodes). An agent
learns a peer from the peer's metadata blob, which kvlab passes through the
torch.distributed store: no listener thread, no extra port.
"""
from __future__ import annotations

import ctypes
import glob
import os

import torch

from kvlab.core.errors import ConfigError

EXTRA = 'pip install -e ".[nixl]"'


def api():
    """The ``nixl_agent`` module, or a ConfigError naming the extra to install."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # not two INFO lines per agent in every rank's output
    try:
        from nixl import _api
    except ImportError:
        try:  # the CUDA-13 build alone, without the meta package that picks it
            from nixl_cu13 import _api
        except ImportError:
            raise ConfigError("transport", "nixl", f"the NIXL package is not installed; {EXTRA}") from None
    return _api


def agent(name: str, progress_thread: bool = False):
    """An agent with the UCX backend. Without a progress thread (the default) kvlab polls its transfers and
    notifications itself: an idle progress thread costs a quarter of a core (measured), which a CPU run cannot
    spare. With one, NIXL completes WRITEs and sends their notifications while the rank's thread is busy."""
    _api = api()
    return _api.nixl_agent(name, _api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"]))


def mem_type(t: torch.Tensor) -> str:
    return "VRAM" if t.device.type == "cuda" else "DRAM"


def device_id(t: torch.Tensor) -> int:
    return (t.device.index or 0) if t.device.type == "cuda" else 0


def register(ag, tensors: list[torch.Tensor]) -> list:
    """Register each tensor once (the registrations live as long as the agent)."""
    return [ag.register_memory(t) for t in tensors]


def connect(ag, store, key: str, peers: list[str]) -> dict[str, str]:
    """Publish this agent's metadata under ``key/<name>`` and load every peer's; returns name -> agent name."""
    store.set(f"{key}/{ag.name}", ag.get_agent_metadata())
    out = {}
    for p in peers:
        store.wait([f"{key}/{p}"])
        got = ag.add_remote_agent(store.get(f"{key}/{p}"))
        out[p] = got.decode() if isinstance(got, bytes) else got
    return out


def versions() -> dict[str, str]:
    """NIXL's and its bundled UCX's versions, for benchmark records."""
    from importlib import metadata

    out = {}
    for dist in ("nixl-cu13", "nixl-cu12", "nixl"):
        try:
            out["nixl"] = metadata.version(dist)
            break
        except metadata.PackageNotFoundError:
            continue
    mod = api()
    libs = glob.glob(os.path.join(os.path.dirname(os.path.dirname(mod.__file__)), "nixl_cu*.libs", "libucp-*.so*"))
    if libs:
        ucp = ctypes.CDLL(libs[0])
        ucp.ucp_get_version_string.restype = ctypes.c_char_p
        out["ucx"] = ucp.ucp_get_version_string().decode()
    return out
