"""The benchmarks' timer (kvlab.core.clock.launches_s): every call it times is made, warm-ups apart; a rank's clock
(Clock) puts its marks where the host saw them."""
import time

import pytest
import torch

from kvlab.core.clock import Clock, launches_s, median_launches_s


def test_the_timer_makes_every_call_and_reports_per_call():
    calls = []
    per_call = launches_s(lambda: calls.append(1), iters=7)
    assert len(calls) == 7 and per_call >= 0
    calls.clear()
    median_launches_s(lambda: calls.append(1), iters=3, trials=5, warmup=2)
    assert len(calls) == 2 + 3 * 5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_clock_places_its_marks_between_the_host_times_around_them():
    # two processes' marks are compared through their epochs: a mark's wall time must lie where the host saw it
    before = time.time()
    clock = Clock(torch.device("cuda"))
    assert before <= clock.epoch <= time.time() and clock.bracket_s >= 0
    for _ in range(20):
        torch.cuda.synchronize()
        t0 = time.time()
        m = clock.mark()
        torch.cuda.synchronize()
        t1 = time.time()
        assert t0 - clock.bracket_s / 2 - 1e-5 <= clock.seconds(m) <= t1 + clock.bracket_s / 2 + 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_settled_marks_seconds_apart_stay_where_the_host_saw_them():
    # the device's timer and the host's clock tick at rates that differ by tens of parts per million on some
    # cards (one H100: 30 us a second): over a run of seconds, a mark read at the timer's rate drifts off
    # the host times that a ctx rank's posts are compared with
    clock = Clock(torch.device("cuda"))
    seen = []
    for _ in range(12):
        time.sleep(0.4)
        torch.cuda.synchronize()
        t0 = time.time()
        m = clock.mark()
        torch.cuda.synchronize()
        seen.append((t0, m, time.time()))
    clock.settle()
    slack = clock.bracket_s / 2 + 2e-5
    off = [(t0 - clock.seconds(m), clock.seconds(m) - t1) for t0, m, t1 in seen]
    assert all(a <= slack and b <= slack for a, b in off), (clock.rate, clock.bracket_s, off)
