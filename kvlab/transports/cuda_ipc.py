"""CUDA IPC for ``transport=ipc`` on GPUs, through ``cuda.bindings``' driver API.

A pool is a plain device allocation (torch's caching allocator: cudaMalloc underneath). Its
exporter finds the allocation's base with ``cuMemGetAddressRange`` (a pool may start inside
a larger cached segment), and publishes the handle of the base and the pool's offset in it.
An importer opens the handle once with its own GPU current and lazy peer access (a mapping
opened in another device's context faults in this device's kernels), and closes it after
the run. The memory stays valid for an importer until it closes it, even if the exporter
dies; the exporter must not free it while importers still read.
"""
from __future__ import annotations

import ctypes
import sys

import torch

HANDLE_BYTES = 64  # sizeof(CUipcMemHandle)


def _ok(result, what: str):
    from cuda.bindings import driver

    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err.name if hasattr(err, 'name') else err}")
    return rest[0] if len(rest) == 1 else rest


def check_supported() -> None:
    """Raise with the reason when this machine cannot share device memory between processes."""
    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"CUDA IPC needs Linux, this is {sys.platform}")
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is visible")
    from cuda.bindings import driver  # noqa: F401 - the import is the check: the bindings are installed


class _Mapped:
    """A device pointer as a CUDA array, so that torch can view it without owning it."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                         "strides": None}


def export(t: torch.Tensor) -> tuple[str, int]:
    """(handle of the allocation holding ``t``, as hex; offset of ``t`` in it)."""
    from cuda.bindings import driver

    ptr = t.data_ptr()
    base, _size = _ok(driver.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
    handle = _ok(driver.cuIpcGetMemHandle(base), "cuIpcGetMemHandle")
    return ctypes.string_at(handle.getPtr(), HANDLE_BYTES).hex(), ptr - int(base)


def open_handle(handle_hex: str, device: torch.device) -> int:
    """Base pointer of another process's exported allocation, opened with ``device`` current (once per
    process and handle: a second open of the same handle fails); ``close`` it after the run."""
    from cuda.bindings import driver

    torch.cuda.set_device(device)
    torch.cuda.current_stream(device)  # makes sure this thread has the device's primary context current
    h = driver.CUipcMemHandle()
    raw = bytes.fromhex(handle_hex)
    ctypes.memmove(h.getPtr(), raw, HANDLE_BYTES)
    flags = driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    return int(_ok(driver.cuIpcOpenMemHandle(h, int(getattr(flags, "value", flags))), "cuIpcOpenMemHandle"))


def view(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` of mapped device memory at ``ptr``, not owning it."""
    return torch.as_tensor(_Mapped(ptr, nbytes), device=device)


def close(base: int) -> None:
    from cuda.bindings import driver

    _ok(driver.cuIpcCloseMemHandle(base), "cuIpcCloseMemHandle")


# -- device-side ordering: a ctx rank's counter, written by its stream, waited for by a gen rank's --------
RELEASE = 2**63 - 1  # the wait's >= compares signed: the largest int64 releases every waiter


def write_value(stream: int, ptr: int, value: int) -> None:
    """Queue a write of the int64 ``value`` at ``ptr`` on ``stream``, after the stream's earlier work and its
    memory writes (the default memory barrier)."""
    from cuda.bindings import driver

    flags = int(driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)
    _ok(driver.cuStreamWriteValue64(driver.CUstream(stream), driver.CUdeviceptr(ptr), value, flags),
        "cuStreamWriteValue64")


def wait_value(stream: int, ptr: int, value: int) -> None:
    """Make ``stream``'s later work wait until the int64 at ``ptr`` is >= ``value`` (no host involved)."""
    from cuda.bindings import driver

    flags = int(driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
    _ok(driver.cuStreamWaitValue64(driver.CUstream(stream), driver.CUdeviceptr(ptr), value, flags),
        "cuStreamWaitValue64")


def stream_ops_error(device: torch.device) -> str | None:
    """Why stream memory operations cannot order copies on ``device``, or None. Probed with a real write and
    wait: the capability attribute can read 0 where they work."""
    try:
        flag = torch.zeros(1, dtype=torch.int64, device=device)
        torch.cuda.synchronize(device)  # the zeroing is on another stream: it must not land after the write
        s = torch.cuda.Stream(device)
        write_value(s.cuda_stream, flag.data_ptr(), 1)
        wait_value(s.cuda_stream, flag.data_ptr(), 1)
        s.synchronize()
        return None if int(flag.item()) == 1 else "a probe's write did not land"
    except Exception as e:  # noqa: BLE001 - any failure means: order through the host instead
        return str(e)
