"""Repeats and the highest rate within an SLO (kvlab.analysis.spread, kvlab.analysis.capacity, their
kvlab.analysis.sweeps entry points)
on run directories written as `kvlab run -m` writes them, with made-up TTFTs: the medians and ranges over
repeats, the capacity rule (every lower rate met too), the plots' error bars and panels."""
from __future__ import annotations

import json

import matplotlib
import numpy as np
import pandas as pd
import pytest
import yaml

matplotlib.use("Agg")

from kvlab.analysis import capacity
from kvlab.analysis import sweeps as analysis  # noqa: E402


def write_run(d, overrides: dict, ttfts: list[float | None], slo_ms: float | None = None, strategy="chunked"):
    """A run directory with one row per TTFT (None: a failed request)."""
    (d / ".hydra" / "rank0").mkdir(parents=True)
    (d / ".hydra" / "rank0" / "overrides.yaml").write_text(yaml.safe_dump([f"{k}={v}" for k, v in overrides.items()]))
    rows = [{"request": i, "verified": t is not None, "ttft_s": t, "schema": 2} for i, t in enumerate(ttfts)]
    (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"strategy": strategy, "requests": len(rows), "verified": None not in ttfts, "schema": 2,
               "repeat": overrides.get("repeat", 0), "slo": {"ttft_ms": slo_ms} if slo_ms else {},
               "serving": {"ttft_s": {"p90": float(np.percentile([t for t in ttfts if t is not None], 90))}}}
    (d / "summary.json").write_text(json.dumps(summary))


# strategy -> repeat -> rate -> TTFTs (s): chunked holds 0.1 s up to 20 req/s in repeats 0 and 1, to 10 in 2;
# layerwise up to 40, except at 20 in repeat 1 (so 40 there does not count)
TTFT = {
    "chunked": {0: {10: [0.05] * 10, 20: [0.08] * 10, 40: [0.5] * 10},
                1: {10: [0.05] * 10, 20: [0.09] * 9 + [None], 40: [0.5] * 10},
                2: {10: [0.05] * 10, 20: [0.2] * 5 + [0.05] * 5, 40: [0.5] * 10}},
    "layerwise": {0: {10: [0.04] * 10, 20: [0.05] * 10, 40: [0.09] * 10},
                  1: {10: [0.04] * 10, 20: [0.3] * 10, 40: [0.09] * 10},
                  2: {10: [0.04] * 10, 20: [0.05] * 10, 40: [0.08] * 9 + [0.3]}},
}


@pytest.fixture
def rate_sweep(tmp_path):
    root = tmp_path / "multirun" / "2026-01-01_00-00-00"
    job = 0
    for s, reps in TTFT.items():
        for rep, rates in reps.items():
            for rate, ttfts in rates.items():
                write_run(root / str(job), {"transfer": s, "workload.rate": float(rate), "repeat": rep}, ttfts,
                          slo_ms=100.0, strategy=s)
                job += 1
    return root


def test_the_highest_rate_within_the_slo_with_spread_over_repeats(rate_sweep, capsys):
    table = analysis.max_rate_under_slo(rate_sweep)
    out = capsys.readouterr().out
    assert list(table.index) == ["chunked", "layerwise"]
    c, lw = table.loc["chunked"], table.loc["layerwise"]
    assert c["per_repeat"] == [20.0, 20.0, 10.0]  # repeat 1: 9 of 10 within it (one failed) still meets 90%
    assert (c["max_rate"], c["max_rate_min"], c["max_rate_max"], c["repeats"]) == (20.0, 10.0, 20.0, 3)
    assert lw["per_repeat"] == [40.0, 10.0, 40.0]  # repeat 1 misses at 20: its 40 does not count
    assert "chunked: 20 req/s (median of 3 repeats, range 10-20) within TTFT <= 100 ms for 90% of requests" in out
    # 40 is the highest rate swept and layerwise meets it: its capacity is only known to be at least that
    assert not c["at_least"] and lw["at_least"] and lw["highest_rate"] == 40.0
    assert ("layerwise: >= 40 req/s (median of 3 repeats, range 10-40) within TTFT <= 100 ms for 90% of requests; "
            "40 req/s is the highest rate swept and meets it: sweep higher to find the limit") in out


def test_another_slo_and_target_from_the_same_rows(rate_sweep):
    loose = analysis.max_rate_under_slo(rate_sweep, ttft_ms=600, target=0.95, show=False)
    assert loose.loc["chunked", "per_repeat"] == [40.0, 10.0, 40.0]  # the failed request meets no SLO
    assert loose.loc["chunked", "slo_ttft_ms"] == [600.0]
    lax = analysis.max_rate_under_slo(rate_sweep, ttft_ms=100, target=0.5, show=False)
    assert lax.loc["chunked", "per_repeat"] == [20.0, 20.0, 20.0]
    tight = analysis.max_rate_under_slo(rate_sweep, ttft_ms=30, show=False)
    assert np.isnan(tight.loc["chunked", "max_rate"]) and all(np.isnan(tight.loc["chunked", "per_repeat"]))
    said = capacity.describe(tight)
    # by how much the lowest rate missed: its attainment and TTFT p90 (chunked at 10 req/s: 0.05 s every request)
    assert ("chunked: no rate swept meets TTFT <= 30 ms for 90% of requests (at the lowest, 10 req/s: 0% met, "
            "TTFT p90 50 ms; sweep lower rates)") in said, said


def test_runs_without_an_slo_need_one_named(tmp_path):
    write_run(tmp_path / "0", {"workload.rate": 1.0}, [0.1])
    write_run(tmp_path / "1", {"workload.rate": 2.0}, [0.1])
    with pytest.raises(ValueError, match="no serving.slo.ttft_ms; pass ttft_ms="):
        analysis.max_rate_under_slo(tmp_path, show=False)
    assert analysis.max_rate_under_slo(tmp_path, ttft_ms=200, show=False)["per_repeat"].iloc[0] == [2.0]
    with pytest.raises(ValueError, match="target=1.5"):
        analysis.max_rate_under_slo(tmp_path, ttft_ms=200, target=1.5)


def test_capacity_rule():
    assert capacity.capacity([1, 2, 4], [1.0, 0.95, 0.5], 0.9) == 2
    assert capacity.capacity([4, 1, 2], [1.0, 1.0, 0.2], 0.9) == 1  # order of the input does not matter
    assert np.isnan(capacity.capacity([1, 2], [0.1, 1.0], 0.9))
    assert np.isnan(capacity.capacity([1, 2], [np.nan, 1.0], 0.9))  # a point that served nothing misses


def test_over_repeats_and_the_load_plot(rate_sweep):
    df = analysis.load_sweep(rate_sweep)
    assert "repeat" in df.attrs["swept"] and analysis.point_columns(df) == ["transfer", "workload.rate"]
    m = analysis.over_repeats(df, "serving.ttft_s.p90", ["strategy", "workload.rate"])
    row = m[(m["strategy"] == "layerwise") & (m["workload.rate"] == 20.0)].iloc[0]
    want = [np.percentile(TTFT["layerwise"][r][20], 90) for r in range(3)]
    assert (row["serving.ttft_s.p90"], row["serving.ttft_s.p90_min"], row["serving.ttft_s.p90_max"], row["n"]) == \
        pytest.approx((np.median(want), min(want), max(want), 3))
    ax = analysis.plot_load(df, by="none").axes[0]
    (lw,) = [c for c in ax.containers if c.get_label().startswith("layerwise")]
    assert "median of 3 runs" in lw.get_label()
    assert list(lw.lines[0].get_ydata()) == pytest.approx(
        [1e3 * np.median([np.percentile(TTFT["layerwise"][r][x], 90) for r in range(3)]) for x in (10, 20, 40)])
    seg = lw.lines[2][0].get_segments()[1]  # the error bar at 20 req/s: the range over the repeats
    assert (seg[0][1], seg[1][1]) == pytest.approx((1e3 * min(want), 1e3 * max(want)))
    with pytest.raises(KeyError, match="no such column"):
        analysis.over_repeats(df, "nothing", ["strategy"])


def test_timeline_draws_one_panel_per_ctx_rank():
    rows = [dict(request=0, rank=r, layer=layer, prefill_done_s=0.002 * (layer + 1),
                 transfer_done_s=0.002 * (layer + 1) + 0.001 * (r + 1)) for r in (0, 1) for layer in range(3)]
    fig = analysis.plot_timeline(pd.DataFrame(rows))
    assert len(fig.axes) == 2
    for ax, r in zip(fig.axes, (0, 1)):
        compute, transfer = ax.containers
        assert len(compute) == 3 and [b.get_width() for b in transfer] == pytest.approx([r + 1.0] * 3)
        assert ax.get_title().startswith(f"ctx{r}: ")
    one = analysis.plot_timeline(pd.DataFrame(rows), rank=1)
    assert len(one.axes) == 1 and one.axes[0].get_title().startswith("ctx1: ")
    with pytest.raises(ValueError, match="rank=5"):
        analysis.plot_timeline(pd.DataFrame(rows), rank=5)


def test_memory_plot_keeps_equal_strategies_apart():
    df = pd.DataFrame({"strategy": ["chunked", "layerwise", "zerocopy", "naive"], "workload.isl": [4096] * 4,
                       "peak_extra_device_bytes": [2**20] * 3 + [2**24]})
    ax = analysis.plot_memory(df, x="workload.isl").axes[0]
    xs = {line.get_label(): line.get_xdata()[0] for line in ax.get_lines()}
    assert len({xs["chunked"], xs["layerwise"], xs["zerocopy"]}) == 3 and xs["naive"] == 4096
    assert any("chunked, layerwise, zerocopy: 1 MiB" in t.get_text() for t in ax.texts)
