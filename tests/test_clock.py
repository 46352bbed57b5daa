"""The benchmarks' timer (kvlab.core.clock.launches_s): every call it times is made, warm-ups apart."""
from kvlab.core.clock import launches_s, median_launches_s


def test_the_timer_makes_every_call_and_reports_per_call():
    calls = []
    per_call = launches_s(lambda: calls.append(1), iters=7)
    assert len(calls) == 7 and per_call >= 0
    calls.clear()
    median_launches_s(lambda: calls.append(1), iters=3, trials=5, warmup=2)
    assert len(calls) == 2 + 3 * 5
