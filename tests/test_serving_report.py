"""The serving report (kvlab.core.serving, the serving figures of kvlab.core.figures) on synthetic parts: SLO
attainment per request, goodput and request throughput over the serving span, the percentiles a user asks
for with mean and std, the SLO fields' checks, and the traces' output lengths carried into the requests."""
from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from rich.console import Console
from test_figures import SLOTS, runs

from kvlab.config import workload
from kvlab.config.schema import build, compose
from kvlab.core import figures, serving, traces
from kvlab.core.errors import ConfigError
from kvlab.results import metrics
from kvlab.results.records import Env, Peak, Summary


def _merged(parts, order, slo_ms=None, failures=None, percentiles=None):
    over = ["logger=quiet"] + ([f"serving.slo.ttft_ms={slo_ms}"] if slo_ms is not None else []) \
        + ([f"serving.percentiles=[{','.join(map(str, percentiles))}]"] if percentiles else [])
    setup = build(compose(over))
    rows, _ = metrics.merge(parts, failures or {}, {}, {}, False, SLOTS, order, setup.serving.slo)
    summary = metrics.summarize(rows, parts, setup, [Peak()], Env(), [], None, [], None, SLOTS, order)
    return rows, summary


@settings(max_examples=30, deadline=None)
@given(runs())
def test_goodput_counts_the_requests_within_the_slo(run):
    parts, order = run
    rows, _ = _merged(parts, order)
    ttfts = sorted(r.ttft_s for r in rows)
    slo_ms = ttfts[len(ttfts) // 2] * 1e3  # about half the requests within it
    failed = {rows[0].request: "lost"}
    rows, s = _merged(parts, order, slo_ms, failed)
    for r in rows:
        assert r.slo_met == (r.verified and r.ttft_s * 1e3 <= slo_ms)
    assert not rows[0].slo_met  # a failed request meets no SLO, however early its bytes landed
    good = sum(bool(r.slo_met) for r in rows)
    duration = max(r.last_chunk_s for r in rows) - min(r.arrival_s for r in rows)
    assert (s.completed, s.failed, s.good_requests) == (len(rows) - 1, 1, good)
    assert s.duration_s == pytest.approx(duration)
    assert s.request_throughput == pytest.approx(s.completed / duration)
    assert s.goodput == pytest.approx(good / duration)
    assert s.slo_attainment == pytest.approx(good / len(rows))
    assert s.slo == {"ttft_ms": slo_ms}


@settings(max_examples=10, deadline=None)
@given(runs())
def test_without_an_slo_its_figures_are_absent(run):
    parts, order = run
    rows, s = _merged(parts, order)
    assert all(r.slo_met is None for r in rows)
    assert (s.good_requests, s.goodput, s.slo_attainment, s.slo) == (None, None, None, {})
    assert s.completed == len(rows) and s.request_throughput == pytest.approx(len(rows) / s.duration_s)
    assert not any("goodput" in line for line in serving.report_lines(s))


@settings(max_examples=10, deadline=None)
@given(runs())
def test_the_percentiles_asked_for_with_mean_and_std(run):
    parts, order = run
    rows, s = _merged(parts, order, percentiles=[25, 50, 99.9])
    xs = np.array([r.ttft_s for r in rows])
    got = s.serving["ttft_s"]
    assert set(got) == {"p25", "p50", "p99.9", "mean", "std", "n"}
    assert got["p25"] == pytest.approx(np.percentile(xs, 25)) and got["p99.9"] == pytest.approx(np.percentile(xs, 99.9))
    assert got["mean"] == pytest.approx(xs.mean()) and got["std"] == pytest.approx(xs.std())
    assert serving.summary_line(s.serving).startswith("ms p25 / p50 / p99.9:")


def test_the_terminal_shows_the_serving_report():
    stats = {"ttft_s": serving.stats([0.1, 0.2, 0.4], (50, 99))}
    s = Summary(requests=4, completed=3, failed=1, duration_s=2.0, request_throughput=1.5, good_requests=2,
                goodput=1.0, slo_attainment=0.5, slo={"ttft_ms": 250.0}, serving=stats, arrival="poisson",
                prefill="sim", ctx={"tp": 1, "pp": 1, "dp": 1}, gen={"tp": 1, "pp": 1, "dp": 1}, verified=False)
    out = io.StringIO()
    metrics.print_table([], s, Console(file=out, width=200))
    text = " ".join(out.getvalue().split())
    assert "3 completed, 1 failed; duration 2,000.0 ms; request throughput 1.500 req/s" in text
    assert "goodput 1.000 req/s under TTFT <= 250 ms: 2 of 4 requests met it (attainment 0.500)" in text
    assert "p50" in text and "p99" in text and "std" in text and "233.3" in text  # the mean of TTFT, in ms


def _table(rows, summary, width: int) -> list[str]:
    out = io.StringIO()
    metrics.print_table(rows, summary, Console(file=out, width=width))
    return out.getvalue().splitlines()


def test_the_table_leaves_out_empty_columns_fits_the_terminal_and_names_a_known_device():
    from kvlab.results.records import RequestRow

    rows = [RequestRow(request=i, isl=64, verified=True, bytes=2**20, busy_s=0.01, gbps=0.1, ttft_s=0.2,
                       decode_tokens=4, decode_tokens_equal=4, decode_max_logit_diff=0.0, byte_check_failures=0)
            for i in range(2)]
    s = Summary(requests=2, completed=2, verified=True, total_bytes=2**21, device=None,
                ctx={"tp": 1, "pp": 1, "dp": 1}, gen={"tp": 1, "pp": 1, "dp": 1}, model="m", strategy="chunked")
    wide = _table(rows, s, 200)
    head = next(line for line in wide if "request" in line)
    assert "SLO" not in head  # no request has slo_met: no SLO was set
    assert "TTFT" in head and "decoded" in head
    assert not any(line.rstrip().endswith(", None") for line in wide)  # a device nobody recorded is left out
    narrow = _table(rows, s, 90)  # the decode check's columns on a narrow terminal: folded, not cut
    assert max(len(line) for line in narrow) <= 90
    assert "…" not in "".join(narrow)
    assert any("verified" in line for line in narrow)  # a header's words kept whole
    assert any("the checks, per request" in line for line in narrow)  # the checks' columns in a table of their own
    assert not any("the checks, per request" in line for line in wide)


def test_the_prediction_beside_the_measured_span_says_when_it_drifted():
    near = Summary(predicted_s=0.3, makespan_s=0.2)
    assert metrics.prediction_line(near) == ("cost model: predicted 300.0 ms against the measured 200.0 ms makespan "
                                             "(predicted/measured 1.50)")
    far = metrics.prediction_line(Summary(predicted_s=0.05, makespan_s=0.2))
    assert far.startswith("cost model: predicted 50.0 ms") and "(predicted/measured 0.25); more than 2x apart" in far
    assert metrics.prediction_line(Summary(predicted_s=None, makespan_s=0.2)) is None


@pytest.mark.parametrize("override, words", [
    ("serving.slo.tpot_ms=20", "serving.slo.tpot_ms=20.0: kvlab runs no decode step"),
    ("serving.slo.ttft_ms=0", "serving.slo.ttft_ms=0.0: must be a time > 0 in ms"),
    ("serving.percentiles=[50,120]", "serving.percentiles=[50.0, 120.0]: must be a non-empty list of percentiles"),
    ("serving.percentiles=[]", "serving.percentiles=[]: must be a non-empty list"),
    ("workload.osl=-3", "workload.osl=-3: must be a token count >= 0"),
])
def test_bad_serving_fields_name_the_field(override, words):
    with pytest.raises(ConfigError) as e:
        build(compose([override]))
    assert str(e.value).startswith(words) and "\n" not in str(e.value)


def test_requests_carry_the_traces_output_lengths():
    setup = build(compose(["workload=mooncake", "workload.requests=5"]))
    got = [r.osl for r in workload.make_requests(setup)]
    assert got == [t.output_tokens for t in traces.read("mooncake_conversation_300.jsonl")[:5]]
    assert len(set(got)) > 1  # the sample's decode lengths differ: not one value copied around
    azure = build(compose(["workload=azure_code", "workload.requests=4"]))
    want = [t.output_tokens for t in traces.read(azure.workload.trace)[:4]]
    assert [r.osl for r in workload.make_requests(azure)] == want
    assert [r.osl for r in workload.make_requests(build(compose(["workload.osl=128"])))] == [128] * 4
    assert {r.osl for r in workload.make_requests(build(compose([])))} == {None}


def test_every_serving_figure_is_in_the_table():
    for name in ("slo_met", "duration_s", "completed", "failed", "request_throughput", "good_requests", "goodput",
                 "slo_attainment"):
        f = figures.BY_NAME[name]
        assert f.meaning.endswith(".") and f.unit in figures.DISPLAY
