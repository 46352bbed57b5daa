"""Every wait of the transfer path, under one policy: poll, spin briefly, then sleep between polls,
never past the deadline, and fail with the reason named.

A wait polls a condition (a NIXL state, a CUDA event, a chunk's completion); it never blocks in a
call that has no deadline of its own. On GPUs the first ``SPIN_S`` of a wait only yield the core
between polls (a sleep's wake-up, 60-100 us, would add to every chunk; the cores are not the
ranks' bottleneck there); after that, and from the start on CPUs, where two busy ranks on two
cores would starve the one moving bytes, it sleeps ``POLL_S`` between polls.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

POLL_S = 50e-6  # between polls, once spinning is over
SPIN_S = 2e-3  # on GPUs: polls without sleep at the start of a wait


def spin_for(device) -> float:
    """How long a wait on ``device``'s work spins before it sleeps."""
    return SPIN_S if getattr(device, "type", device) == "cuda" else 0.0


class Backoff:
    """Between two polls of one wait: yield the core for the first ``spin_s``, then sleep ``poll_s``."""

    def __init__(self, spin_s: float, poll_s: float = POLL_S):
        self.until = time.perf_counter() + spin_s
        self.poll_s = poll_s

    def __call__(self) -> None:
        if time.perf_counter() < self.until:
            os.sched_yield()
        else:
            time.sleep(self.poll_s)


def wait_until(done: Callable[[], bool], deadline: float, fail: Callable[[], BaseException], *,
               spin_s: float = 0.0, poll_s: float = POLL_S, between: Callable[[], None] | None = None) -> None:
    """Return once ``done()`` is true; raise ``fail()`` once ``time.time()`` passes ``deadline`` first.
    ``between`` runs after every unsuccessful poll (a heartbeat, polls of other work in flight)."""
    wait = Backoff(spin_s, poll_s)
    while not done():
        if time.time() > deadline:
            raise fail()
        if between is not None:
            between()
        wait()


def call_within(fn: Callable, *args, timeout_s: float, what: str):
    """``fn(*args)`` on a thread of its own, waited for at most ``timeout_s``: for calls without a deadline of
    their own (a store request to a host that is frozen, not gone, never returns: its connection stays open).
    TimeoutError names ``what``; the call, if it ever returns, is dropped."""
    box: dict = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 -- raised on the caller's thread
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name=f"within: {what}", daemon=True).start()
    if not done.wait(timeout_s):
        raise TimeoutError(f"{what} did not return within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")
