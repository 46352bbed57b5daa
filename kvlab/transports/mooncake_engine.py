"""Mooncake Transfer Engines: loading the optional package, one engine per process, session ids through a store.

The Mooncake Transfer Engine (``pip install -e ".[mooncake]"``; SGLang's default disaggregation backend)
moves registered memory between engines with one-sided writes. kvlab starts every engine with
``P2PHANDSHAKE``: no metadata server; an engine is addressed by its session id ``host:rpc_port``, which
kvlab passes through the torch.distributed store, and learns a peer's registered buffers from the peer
itself at the first write.

The engine picks its wire when it starts, from the environment, not from ``initialize``'s protocol
argument (which only picks its allocator): ``MC_FORCE_TCP`` installs TCP alone (GPU buffers bounced
through the host), ``MC_INTRANODE_NVLINK`` the intra-node NVLink transport (CUDA IPC), which only the
CUDA wheels carry (``mooncake.engine.SUPPORT_INTRA_NVLINK``). The CPU wheel
(``mooncake-transfer-engine-non-cuda``) links ``libibverbs`` and ``libnl`` even for TCP: on Debian
``apt-get install libibverbs1 libnl-3-200 libnl-route-3-200``.
"""
from __future__ import annotations

import contextlib
import math
import os
import socket
import sys
import tempfile

from kvlab.core.errors import ConfigError, install_hint

LIBS = "libibverbs1 libnl-3-200 libnl-route-3-200"
PROTOCOLS = ("auto", "tcp", "nvlink_intra")


def api():
    """The ``mooncake.engine`` module, or a ConfigError naming what to install."""
    # read by the engine when it starts: without it every rank logs each connection at INFO (MC_LOG_LEVEL=INFO
    # shows them); errors, such as a peer's connection breaking, still go to stderr
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        from mooncake import engine
    except ImportError as e:
        missing = str(e)
        if "libibverbs" in missing or "libnl" in missing or "cannot open shared object" in missing:
            raise ConfigError("transport", "mooncake", f"the Mooncake Transfer Engine cannot load its system "
                              f"libraries ({missing.split(':')[0]}); apt-get install {LIBS}") from None
        raise ConfigError("transport", "mooncake", install_hint("mooncake", "the Mooncake Transfer Engine")
                          + f" and apt-get install {LIBS}") from None
    return engine


def protocol(choice: str, device: str) -> str:
    """The wire for ``transport.protocol=choice`` on ranks of ``device`` (cpu or cuda): ``auto`` is
    ``nvlink_intra`` on GPUs where the wheel has it, else ``tcp``."""
    if choice == "auto":
        return "nvlink_intra" if device == "cuda" and api().SUPPORT_INTRA_NVLINK else "tcp"
    return choice


def local_host() -> str:
    """The address the other ranks reach this one at: the interface this host uses towards the store's host
    (``MASTER_ADDR``), loopback on one machine."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, 9))  # no packet leaves: a UDP connect only picks the route
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def engine(wire: str, timeout_s: float):
    """An initialized engine on ``wire`` and its session id. The engine's own blocking calls give up after
    ``MC_TRANSFER_TIMEOUT`` (read when it is created; at least 5 s): kvlab polls everything itself with
    ``transfer.timeout_s``, and the engine's bound is set no lower."""
    mc = api()
    env = {"MC_TRANSFER_TIMEOUT": str(max(5, math.ceil(timeout_s)))}
    if wire == "tcp":
        env["MC_FORCE_TCP"] = "1"
    else:
        env["MC_INTRANODE_NVLINK"] = "1"
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        te = mc.TransferEngine()
        host = local_host()
        with _stderr_kept() as said:
            rc = te.initialize(host, "P2PHANDSHAKE", wire, "")
        if rc != 0:
            why = said()[-1:] or ["no reason given"]
            raise RuntimeError(f"mooncake: the transfer engine did not start on {wire} at {host}: {why[0]}")
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return te, f"{host}:{te.get_rpc_port()}"


@contextlib.contextmanager
def _stderr_kept():
    """The process's stderr (fd 2) held in a file meanwhile; yields a function returning its lines. The engine
    logs an error at every start ("Local segment descriptor not found", before its own segment exists),
    before MC_LOG_LEVEL applies: it is shown only when the start fails."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 2)
        lines: list[str] = []
        try:
            yield lambda: lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            lines += [x.strip() for x in f.read().decode(errors="replace").splitlines() if x.strip()]


def register(te, addr: int, nbytes: int) -> None:
    if te.register_memory(addr, nbytes) != 0:
        raise RuntimeError(f"mooncake: registering {nbytes} B at {addr:#x} failed")


def versions() -> dict[str, str]:
    """The installed wheel's name and version, for benchmark records."""
    from importlib import metadata

    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine-cuda13",
                 "mooncake-transfer-engine"):
        try:
            return {"mooncake": f"{dist} {metadata.version(dist)}"}
        except metadata.PackageNotFoundError:
            continue
    return {}
