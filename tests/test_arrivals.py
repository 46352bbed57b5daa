"""Arrivals and traces: a pure function of the config; the shipped samples read whole; bad traces,
rates and time scales stop with one line naming the field, the value (the line, for a bad row)
and what works, before anything is allocated."""
from __future__ import annotations

import json
import re
import statistics

import pytest
import torch

from kvlab.cli.commands import check_overrides
from kvlab.config.schema import build, compose
from kvlab.config.workload import make_requests
from kvlab.core import arrivals, traces
from kvlab.core.errors import ConfigError
from kvlab.model.spec import WorkloadSpec


def requests(*overrides):
    return make_requests(build(compose(list(overrides))))


def test_burst_is_everything_at_zero_and_unchanged_lengths():
    rs = requests("workload.isl_list=[100,200,300]", "workload.requests=5")
    assert [r.arrival_s for r in rs] == [0.0] * 5
    assert [r.isl for r in rs] == [100, 200, 300, 100, 200]


def test_poisson_rate_and_determinism():
    spec = WorkloadSpec(arrival="poisson", rate=50.0, seed=3)
    t = arrivals.times(spec, 4000)
    assert t == arrivals.times(spec, 4000)  # every rank derives the same timeline
    assert t != arrivals.times(WorkloadSpec(arrival="poisson", rate=50.0, seed=4), 4000)
    assert t[0] == 0.0 and all(a <= b for a, b in zip(t, t[1:]))
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert abs(statistics.mean(gaps) - 1 / 50) < 0.1 / 50  # 4000 draws: within 10% of 1/rate
    # exponential: the standard deviation equals the mean
    assert abs(statistics.stdev(gaps) / statistics.mean(gaps) - 1) < 0.1
    half = arrivals.times(WorkloadSpec(arrival="poisson", rate=50.0, time_scale=0.5, seed=3), 4000)
    assert half == pytest.approx([x * 0.5 for x in t])


@pytest.mark.parametrize("burstiness", [0.25, 4.0, 1e6])
def test_burstiness_shapes_the_gaps_and_keeps_their_mean(burstiness):
    """vLLM's serving benchmark's knob: gamma gaps of shape ``burstiness`` and mean 1/rate, so their coefficient of
    variation is 1/sqrt(burstiness); 1 is the Poisson process, drawn as before the knob existed."""
    spec = WorkloadSpec(arrival="poisson", rate=50.0, seed=3, burstiness=burstiness)
    t = arrivals.times(spec, 4000)
    assert t == arrivals.times(spec, 4000) and t[0] == 0.0 and all(a <= b for a, b in zip(t, t[1:]))
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert abs(statistics.mean(gaps) - 1 / 50) < 0.1 / 50
    assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(burstiness ** -0.5, rel=0.1)
    assert arrivals.times(WorkloadSpec(arrival="poisson", rate=50.0, seed=3, burstiness=1.0), 100) == \
        arrivals.times(WorkloadSpec(arrival="poisson", rate=50.0, seed=3), 100)


@pytest.mark.parametrize("overrides,line", [
    (["workload.arrival=poisson", "workload.burstiness=0"],
     "workload.burstiness=0.0: must be in [0.001, 1e+06] (1 a Poisson process, below 1 burstier, above 1 more even)"),
    (["workload.arrival=poisson", "workload.burstiness=nan"], "workload.burstiness=nan: must be a finite number"),
    (["workload.burstiness=4"], "workload.burstiness=4.0: shapes the gaps of workload.arrival=poisson only (now "
                                "burst); set workload.arrival=poisson or leave it at 1"),
])
def test_bad_burstiness_is_one_line(overrides, line):
    msg = check_overrides(overrides)
    assert msg and msg.startswith(line), msg
    with pytest.raises(ConfigError, match="workload.burstiness"):
        WorkloadSpec(arrival="poisson", burstiness=float("nan"))


def test_poisson_through_the_config_keeps_prompt_lengths():
    a = requests("workload.arrival=poisson", "workload.rate=20", "workload.distribution=uniform",
                 "workload.requests=50")
    b = requests("workload.distribution=uniform", "workload.requests=50")
    assert [r.isl for r in a] == [r.isl for r in b]  # arrivals draw from their own stream
    assert a[-1].arrival_s > 0 and sorted(r.arrival_s for r in a) == [r.arrival_s for r in a]


@pytest.mark.parametrize("name,rows,first,last_arrival", [
    ("mooncake_conversation_300.jsonl", 300, 6758, 102.0),
    ("azure_code_2023_300.csv", 300, 4808, 216.838238),
])
def test_shipped_samples_read_whole(name, rows, first, last_arrival):
    t = traces.read(name)
    assert len(t) == rows and t[0].input_tokens == first and t[0].arrival_s == 0.0
    assert t[-1].arrival_s == pytest.approx(last_arrival)
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(t, t[1:]))


def test_mooncake_preset_replays_the_trace():
    rs = requests("workload=mooncake")
    t = traces.read("mooncake_conversation_300.jsonl")
    w = compose(["workload=mooncake"]).workload
    assert len(rs) == w.requests
    assert [r.isl for r in rs] == [min(x.input_tokens, w.isl_max) for x in t[:w.requests]]
    assert [r.arrival_s for r in rs] == pytest.approx([x.arrival_s * w.time_scale for x in t[:w.requests]])


def test_azure_preset_and_time_scale():
    rs = requests("workload=azure_code", "workload.time_scale=1")
    assert rs[1].arrival_s == pytest.approx(0.052)  # 18:17:04.0319600 - 18:17:03.9799600
    assert [r.isl for r in rs[:3]] == [4808, 3180, 110]


def test_long_prompts_clipped_or_refused():
    # row 18 of the Mooncake sample is the first above 32768 tokens
    t = traces.read("mooncake_conversation_300.jsonl")
    line = next(x.line for x in t if x.input_tokens > 32768)
    rs = requests("workload=mooncake", "workload.isl_max=32768", "workload.requests=300")
    assert max(r.isl for r in rs) == 32768
    assert sum(r.isl == 32768 for r in rs) == sum(x.input_tokens >= 32768 for x in t)
    msg = check_overrides(["workload=mooncake", "workload.isl_max=32768", "workload.requests=300",
                           "workload.long_prompts=refuse"])
    assert f"line {line}:" in msg and "workload.trace=mooncake_conversation_300.jsonl" in msg
    assert "workload.long_prompts=clip" in msg
    # the cache's capacity is a limit too, named as such
    rs = requests("workload=mooncake", "cache.capacity_tokens=65536", "workload.concurrency=1")
    assert max(r.isl for r in rs) <= 65536


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def mooncake_row(ts, n):
    return json.dumps({"timestamp": ts, "input_length": n, "output_length": 10, "hash_ids": [0]})


@pytest.mark.parametrize("name,text,fragments", [
    ("empty.jsonl", "", ["holds no requests"]),
    ("blank.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n", ["holds no requests"]),
    ("bad.jsonl", mooncake_row(0, 10) + "\n" + mooncake_row(5, 20) + "\n{not json\n", ["line 3:", "not JSON"]),
    ("keys.jsonl", mooncake_row(0, 10) + '\n{"time": 1}\n', ["line 2:", "timestamp and input_length"]),
    ("neg.jsonl", mooncake_row(-4, 10) + "\n", ["line 1:", "timestamp=-4"]),
    ("len.jsonl", mooncake_row(0, 10) + "\n" + mooncake_row(9, "many") + "\n", ["line 2:", "input_length='many'"]),
    ("zero.jsonl", mooncake_row(0, 0) + "\n", ["line 1:", "0 tokens"]),
    ("header.csv", "time,tokens\n1,2\n", ["line 1:", "TIMESTAMP,ContextTokens,GeneratedTokens"]),
    ("fields.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9,10,1\n2023-11-16 18:17:04,5\n",
     ["line 3:", "2 fields"]),
    ("stamp.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,10,1\n", ["line 2:", "TIMESTAMP='yesterday'"]),
    ("format.txt", "hello\n", ["unknown format '.txt'"]),
    # values that parse and would crash the ranks later (a wait too long for the clock)
    ("inf.jsonl", mooncake_row(0, 10) + '\n{"timestamp": Infinity, "input_length": 5}\n', ["line 2:", "timestamp=inf"]),
    ("nan.jsonl", '{"timestamp": NaN, "input_length": 5}\n', ["line 1:", "timestamp=nan"]),
    ("far.jsonl", mooncake_row(0, 10) + "\n" + mooncake_row(1e15, 10) + "\n",
     ["line 2:", "arrives 1e+12 s", "30 days"]),
    ("deep.jsonl", mooncake_row(0, 10) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n", ["line 2:", "nested too deep"]),
    ("ages.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n0001-01-01 00:00:00.0000000,10,1\n"
                 "9999-12-31 23:59:59.9999999,10,1\n", ["line 3:", "arrives 3.16e+11 s", "30 days"]),
    ("digit.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9,1\u00b2,1\n",
     ["line 2:", "ContextTokens='1\u00b2'"]),
])
def test_bad_trace_one_line(tmp_path, name, text, fragments):
    path = _write(tmp_path, name, text)
    msg = check_overrides(["workload.arrival=trace", f"workload.trace={path}"])
    assert msg and "\n" not in msg and msg.startswith(f"workload.trace={path}: ")
    for frag in fragments:
        assert frag in msg, (frag, msg)


@pytest.mark.parametrize("overrides,field", [
    (["workload=mooncake", "workload.time_scale=1e300"], "workload.time_scale=1e+300"),
    (["workload.arrival=poisson", "workload.rate=1e-300"], "workload.rate=1e-300"),
    (["workload.arrival=poisson", "workload.time_scale=1e300"], "workload.time_scale=1e+300"),
])
def test_arrivals_later_than_a_run_can_wait_are_one_line(overrides, field):
    msg = check_overrides(overrides)
    assert msg and "\n" not in msg and msg.startswith(f"{field}: ") and "30 days" in msg, msg


def test_a_drawn_arrival_too_late_is_refused_where_it_is_drawn():
    rate = 2 / arrivals.MAX_ARRIVAL_S  # the mean gap is half the limit: the fields pass, some draws do not
    refused = 0
    for seed in range(40):
        w = WorkloadSpec(arrival="poisson", requests=2, rate=rate, seed=seed)
        try:
            assert max(arrivals.times(w, 2)) <= arrivals.MAX_ARRIVAL_S
        except ConfigError as e:
            refused += 1
            assert re.match(r"workload\.rate=.*: request 1 would arrive after [\d.e+]+ s .*30 days", str(e)), e
    assert 0 < refused < 40


def test_workload_spec_refuses_bad_arrivals_directly():
    with pytest.raises(ConfigError, match="workload.rate"):
        WorkloadSpec(arrival="poisson", rate=float("nan"))
    with pytest.raises(ConfigError, match="workload.time_scale"):
        WorkloadSpec(time_scale=float("inf"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_prefill_gpu_without_gpu():
    msg = check_overrides(["prefill=gpu"])
    assert msg == "prefill=gpu: no CUDA device is visible here; use prefill=sim (the default)"
