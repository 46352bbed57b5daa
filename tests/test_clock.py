"""The benchmarks' timer (kvlab.core.clock.launches_s): every call it times is made, warm-ups apart; a rank's clock
(Clock) puts its marks where the host saw them."""
import time

import pytest
import torch

from kvlab.core import clock as clock_module
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


class _Timer:
    """A device timer's event: ``t`` seconds on the host's clock, read by a timer that runs at ``speed``."""

    def __init__(self, t: float, speed: float):
        self.t, self.speed = t, speed

    def elapsed_time(self, other: "_Timer") -> float:
        return (other.t - self.t) * self.speed * 1e3


@pytest.mark.parametrize("speed", [1 - 30e-6, 1.0, 1 + 80e-6])
@pytest.mark.parametrize("set_meanwhile", [False, True], ids=["steady", "wall clock set"])
def test_settling_reads_marks_at_the_timer_s_rate_against_the_host(speed, set_meanwhile, monkeypatch):
    # the arithmetic of Clock.settle on any machine: a timer 30 ppm slow (one H100's) read at its own rate
    # put a mark 5 s on 150 us early; settled, it is where the host saw it. A wall clock stepped by a second
    # between the brackets is no rate: the timer's own is kept.
    brackets = iter([(2e-5, 100.0, _Timer(100.0, speed)),
                     (3e-5, 160.0 + (1.0 if set_meanwhile else 0.0), _Timer(160.0, speed))])
    monkeypatch.setattr(clock_module, "_bracketed", lambda device: next(brackets))
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: pytest.fail("a mark is made in this test, not taken"))
    c = Clock(torch.device("cuda"))
    marks = [_Timer(t, speed) for t in (100.0, 105.0, 130.0, 159.9)]
    c.settle()
    for m in marks:
        if set_meanwhile:
            assert c.rate == 1.0 and c.bracket_s == 2e-5
            assert c.seconds(m) == pytest.approx(100.0 + (m.t - 100.0) * speed, abs=1e-9)
        else:
            assert c.seconds(m) == pytest.approx(m.t, abs=1e-9) and c.bracket_s == 3e-5
