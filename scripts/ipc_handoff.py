"""The hand-off inside every one-GPU ``transport=ipc`` figure: how long after one process's stream
writes a counter does another process's stream, waiting for it (``cuStreamWaitValue64``), run
its next kernel? The same question is asked of two streams of one process, where no context
switch stands between them: the difference is what two processes time-slicing one GPU cost.

Both sides stamp the GPU's global timer (``%globaltimer``, one clock for every context) in a
one-thread kernel: the producer right before its counter write, the consumer right after its
wait. ``busy`` variants put a ``copy_`` of ``--busy-mib`` on the producer's stream first, as a
prefill's writes come before a ctx rank's counter; ``idle`` ones have nothing before it.

    python scripts/ipc_handoff.py            # prints one JSON line; scripts/ipc_bench.py includes it
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import multiprocessing as mp
import statistics
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STAMP = r"""
extern "C" __global__ void stamp(unsigned long long* out) {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  *out = t;
}
"""


class Stamper:
    """``stamp(out)`` queues a write of the global timer (ns) into the int64 tensor element ``out``."""

    def __init__(self):
        from cuda.core import Device, Program, ProgramOptions

        from kvlab.memory.ops.cuda import device_arch

        dev = torch.cuda.current_device()
        Device(dev).set_current()
        obj = Program(STAMP, "c++", options=ProgramOptions(arch=device_arch(dev))).compile("cubin")
        self.kernel = obj.get_kernel("stamp")
        # loaded now: a first launch loads the module lazily, and that load waits for the device, where a
        # stream may already wait for a counter that only a later launch's stream writes
        scratch = torch.zeros(1, dtype=torch.int64, device="cuda")
        self(scratch)
        torch.cuda.synchronize()

    def __call__(self, out: torch.Tensor) -> None:
        from cuda.core import LaunchConfig, Stream, launch

        launch(Stream.from_handle(torch.cuda.current_stream().cuda_stream), LaunchConfig(grid=1, block=1),
               self.kernel, out.data_ptr())


def _busy(mib: int):
    if not mib:
        return lambda: None
    a = torch.zeros(mib << 20, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return lambda: b.copy_(a)


def _child(role: str, conn, *args) -> None:
    """A child's body (``role``: producer or consumer); its traceback goes to the parent instead of dying
    silently."""
    try:
        {"producer": _producer, "consumer": _consumer}[role](conn, *args)
    except BaseException:  # noqa: BLE001 - the parent raises it
        conn.send(("error", traceback.format_exc()))


def _recv(conn, procs, what: str, timeout: float = 30.0):
    """The next message from a child, or an error naming ``what``: never a wait without end."""
    if not conn.poll(timeout):
        raise RuntimeError(f"ipc_handoff: no {what} within {timeout:g} s (children alive: "
                           f"{[p.is_alive() for p in procs]})")
    got = conn.recv()
    if isinstance(got, tuple) and got and got[0] == "error":
        raise RuntimeError(f"ipc_handoff: a child failed while sending {what}:\n{got[1]}")
    return got


def _producer(conn, n: int, busy_mib: int) -> None:
    from kvlab.transports import cuda_ipc

    torch.cuda.set_device(0)
    stamp, busy = Stamper(), _busy(busy_mib)
    flag = torch.zeros(1, dtype=torch.int64, device="cuda")
    ts = torch.zeros(n, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    conn.send(cuda_ipc.export(flag))
    stream = torch.cuda.current_stream().cuda_stream
    for i in range(1, n + 1):
        conn.recv()  # the consumer's wait for i is queued
        busy()
        stamp(ts[i - 1])
        cuda_ipc.write_value(stream, flag.data_ptr(), i)
        torch.cuda.synchronize()
    conn.send(ts.tolist())
    conn.recv()  # the consumer closed its mapping: the flag may be freed


def _consumer(conn, n: int) -> None:
    from kvlab.transports import cuda_ipc

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    stamp = Stamper()
    handle, offset = conn.recv()
    base = cuda_ipc.open_handle(handle, dev)
    ptr = base + offset
    ts = torch.zeros(n, dtype=torch.int64, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    for i in range(1, n + 1):
        cuda_ipc.wait_value(stream, ptr, i)
        stamp(ts[i - 1])
        conn.send(i)
        torch.cuda.synchronize()
    conn.send(ts.tolist())
    cuda_ipc.close(base)
    conn.send("closed")


def two_processes(n: int, busy_mib: int) -> list[float]:
    ctx = mp.get_context("spawn")
    p_end, p_peer = ctx.Pipe()
    c_end, c_peer = ctx.Pipe()
    procs = [ctx.Process(target=_child, args=("producer", p_peer, n, busy_mib), daemon=True),
             ctx.Process(target=_child, args=("consumer", c_peer, n), daemon=True)]
    for p in procs:
        p.start()
    try:
        c_end.send(_recv(p_end, procs, "handle", 120))  # the children import torch and compile first
        for i in range(n):
            p_end.send(_recv(c_end, procs, f"wait {i + 1}"))
        produced, consumed = _recv(p_end, procs, "producer stamps"), _recv(c_end, procs, "consumer stamps")
        p_end.send(_recv(c_end, procs, "close"))
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return [(b - a) / 1e3 for a, b in zip(produced, consumed)]


def one_process(n: int, busy_mib: int) -> list[float]:
    from kvlab.transports import cuda_ipc

    stamp, busy = Stamper(), _busy(busy_mib)
    flag = torch.zeros(1, dtype=torch.int64, device="cuda")
    a_ts, b_ts = (torch.zeros(n, dtype=torch.int64, device="cuda") for _ in range(2))
    torch.cuda.synchronize()
    sa, sb = torch.cuda.Stream(), torch.cuda.Stream()
    for i in range(1, n + 1):
        with torch.cuda.stream(sb):
            cuda_ipc.wait_value(sb.cuda_stream, flag.data_ptr(), i)
            stamp(b_ts[i - 1])
        with torch.cuda.stream(sa):
            busy()
            stamp(a_ts[i - 1])
            cuda_ipc.write_value(sa.cuda_stream, flag.data_ptr(), i)
        torch.cuda.synchronize()
    return [(b - a) / 1e3 for a, b in zip(a_ts.tolist(), b_ts.tolist())]


def summary(us: list[float]) -> dict:
    us = us[2:]  # the first hand-offs load modules and warm the paths
    q = statistics.quantiles(us, n=10)
    return {"n": len(us), "median_us": statistics.median(us), "p10_us": q[0], "p90_us": q[-1], "max_us": max(us)}


def measure(n: int = 24, busy_mib: int = 512) -> dict:
    out = {}
    for busy in (0, busy_mib):
        name = "busy" if busy else "idle"
        out[f"one_process_{name}"] = summary(one_process(n, busy))
        out[f"two_processes_{name}"] = summary(two_processes(n, busy))
    out["busy_mib"] = busy_mib
    return out


def main() -> None:
    faulthandler.dump_traceback_later(110, exit=True)  # a hang in this process (one_process) ends with stacks
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=24)
    ap.add_argument("--busy-mib", type=int, default=512)
    a = ap.parse_args()
    print(json.dumps(measure(a.n, a.busy_mib)))


if __name__ == "__main__":
    main()
