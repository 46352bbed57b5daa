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
import re
import subprocess
import sys
from functools import cache

import torch

from kvlab.core.errors import ConfigError, install_hint


def api():
    """The ``nixl_agent`` module, or a ConfigError naming the extra to install."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # not two INFO lines per agent in every rank's output
    try:
        from nixl import _api
    except ImportError:
        try:  # the CUDA-13 build alone, without the meta package that picks it
            from nixl_cu13 import _api
        except ImportError:
            raise ConfigError("transport", "nixl", install_hint("nixl", "the NIXL package")) from None
    return _api


@cache
def probe_ucx() -> None:
    """Where UCX is told how to run (a ``UCX_*`` variable set), whether NIXL's UCX backend starts under it: an
    agent made in a child process, else a ConfigError naming the variables and UCX's own complaint, before any
    rank starts (a backend that fails in the ranks prints UCX's and NIXL's C++ errors, a traceback per rank, and
    crashes each in NIXL's teardown). Free without such variables (UCX then picks its transports itself), and
    skipped in ranks the launcher started after probing."""
    ucx = {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")}
    if not ucx or os.environ.get("KVLAB_PARENT"):
        return
    code = "import os; from kvlab.transports import nixl_agent; nixl_agent.agent('probe'); os._exit(0)"
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return  # a slow machine is not a broken UCX: the ranks find out for themselves
    if p.returncode == 0:
        return
    said = [m.group(1).strip() for m in re.finditer(r"UCX\s+(?:ERROR|WARN)\s+(.*)", p.stdout + p.stderr)]
    why = "; ".join(dict.fromkeys(said)) or (p.stderr.strip().splitlines() or ["no output"])[-1]
    names = ", ".join(f"{k}={v}" for k, v in ucx.items())
    raise ConfigError(next(iter(ucx)), next(iter(ucx.values())),
                      f"NIXL's UCX backend does not start with {names} ({why}); unset it or name what UCX offers")


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
