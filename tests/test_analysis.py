import functools
import json
import re

import matplotlib
import numpy as np
import pandas as pd
import pytest
import yaml
from omegaconf import OmegaConf, open_dict

matplotlib.use("Agg")

from matplotlib.figure import Figure  # noqa: E402

from kvlab.analysis import sweeps as analysis  # noqa: E402
from kvlab.cli.plan_cmd import summarize  # noqa: E402
from kvlab.config.schema import build, compose, to_container  # noqa: E402
from kvlab.sizing.cost import predict  # noqa: E402

MiB = 2**20


@functools.cache
def _composed(groups: tuple[str, ...]):
    return compose(list(groups))


def _resolved(overrides: tuple[str, ...]) -> dict:
    """Group choices composed (once each: ~0.15 s), plain keys set on the result."""
    cfg = _composed(tuple(o for o in overrides if "." not in o.split("=")[0])).copy()
    for o in overrides:
        key, value = o.split("=", 1)
        if "." in key:
            with open_dict(cfg):
                OmegaConf.update(cfg, key.lstrip("+"), yaml.safe_load(value))
    return to_container(cfg)


def make_run(d, overrides=(), *, gbps=1.0, slot_bytes=64 * MiB, layers=4, with_summary=True, failed=0):
    """A run directory as ``kvlab run`` writes it, with made-up timings."""
    cfg = _resolved(tuple(overrides))
    d.mkdir(parents=True)
    (d / ".hydra" / "rank0").mkdir(parents=True)
    (d / ".hydra" / "rank0" / "overrides.yaml").write_text(yaml.safe_dump(list(overrides)))
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    strategy = cfg["transfer"]["strategy"]["name"]
    w = cfg["workload"]
    isl = w["isl"]
    req_bytes = isl * 4 * 6 * 16 * 2 * 2  # tiny_gqa: 4 layers, 6 heads of 16 bf16 K and V
    results, timeline = [], []
    for r in range(w["requests"]):
        secs = req_bytes / (gbps * 1e9)
        results.append(dict(request=r, isl=isl, ctx_dp=0, gen_dp=0, bytes=req_bytes, chunks=4, in_place_chunks=0,
                            seconds=secs, gbps=gbps, pack_s=secs / 4, wire_s=secs / 2, unpack_s=secs / 4,
                            exposed_s=secs / layers, verified=r >= failed, error=None if r >= failed else "boom"))
        for layer in range(layers):
            timeline.append(dict(request=r, layer=layer, prefill_done_s=0.002 * (layer + 1),
                                 transfer_done_s=0.002 * (layer + 1) + 0.001))
    (d / "results.jsonl").write_text("".join(json.dumps(x) + "\n" for x in results))
    if strategy == "layerwise":
        (d / "timeline.jsonl").write_text("".join(json.dumps(x) + "\n" for x in timeline))
    if with_summary:
        n = w["requests"]
        summary = dict(total_bytes=n * req_bytes, verified=failed == 0, gbps=gbps, seconds=n * req_bytes / gbps / 1e9,
                       peak_staging_bytes=slot_bytes, peak_extra_device_bytes=req_bytes if strategy == "naive"
                       else slot_bytes, requests=n, failed_requests=list(range(failed)), errors=[],
                       strategy=strategy, model="tiny_gqa",
                       isl_mean=isl, isl_max=isl, slot_bytes=slot_bytes, slots=4,
                       ctx=dict(tp=cfg["ctx"]["tp"], pp=1, dp=1, tokens_per_block=32, layout="block_major"),
                       gen=dict(tp=cfg["gen"]["tp"], pp=1, dp=1, tokens_per_block=32, layout="block_major"),
                       world_size=cfg["ctx"]["tp"] + cfg["gen"]["tp"], backend="gloo", device="cpu",
                       kernels="torch", torch="2.13.0", date="2025-01-01", predicted_s=None,
                       link_gbps=2 * gbps, link={"gbps": 2 * gbps, "gbps_min": 1.5 * gbps, "gbps_max": 2.5 * gbps})
        (d / "summary.json").write_text(json.dumps(summary))
    return d


@pytest.fixture
def sweep(tmp_path):
    """A 2 x 2 strategy x prompt-length sweep laid out as Hydra's multirun does."""
    root = tmp_path / "multirun" / "2025-01-01_10-00-00"
    job = 0
    for strategy, gbps in (("naive", 0.5), ("layerwise", 1.0)):
        for isl in (1024, 4096):
            make_run(root / str(job), (f"transfer={strategy}", f"workload.isl={isl}", "workload.requests=2"),
                     gbps=gbps * isl / 1024)
            job += 1
    (root / "multirun.yaml").write_text("hydra: {}\n")
    return root


def test_load_run_has_summary_and_overrides(tmp_path):
    d = make_run(tmp_path / "run", ("transfer=naive", "ctx.tp=2", "+cost.alpha_us=20"))
    row = analysis.load_run(d)
    assert row["strategy"] == "naive" and row["transfer"] == "naive"
    assert row["ctx.tp"] == 2 and row["gen.tp"] == 1  # flattened from the summary
    assert row["cost.alpha_us"] == 20  # typed, with the + prefix gone
    assert row["status"] == "ok" and row["run_dir"] == str(d)
    with pytest.raises(FileNotFoundError):
        analysis.load_run(tmp_path)


def test_load_sweep_one_row_per_job_in_job_order(sweep):
    # job 10 must sort after job 9, not after job 1
    for j in range(4, 11):
        make_run(sweep / str(j), ("transfer=chunked", f"workload.isl={512 * (j + 1)}", "workload.requests=1"))
    df = analysis.load_sweep(sweep)
    assert len(df) == 11
    assert [int(p.rsplit("/", 1)[1]) for p in df["run_dir"]] == list(range(11))
    assert set(df.attrs["swept"]) == {"transfer", "workload.isl", "workload.requests"}
    assert df.loc[0, "workload.isl"] == 1024 and df.loc[3, "transfer"] == "layerwise"
    assert df["total_bytes"].dtype.kind == "i"


def test_a_job_without_summary_still_shows_up(sweep):
    make_run(sweep / "4", ("transfer=zerocopy", "workload.isl=1024"), with_summary=False)
    make_run(sweep / "5", ("transfer=chunked", "workload.isl=1024"), failed=1)
    df = analysis.load_sweep(sweep)
    assert list(df["status"]) == ["ok"] * 4 + ["no summary", "failed requests"]
    assert df.loc[4, "transfer"] == "zerocopy"


@pytest.mark.parametrize("text,why", [
    ('{"total_bytes": 1, "verif', "JSONDecodeError"),  # a run killed while it wrote the file
    ("[1, 2, 3]", "a JSON list, not an object"),
    ('{"rows": []}', "none of its fields"),
    ("\xff", "not a kvlab summary"),
])
def test_a_corrupt_summary_marks_its_run_and_the_sweep_goes_on(sweep, text, why):
    make_run(sweep / "4", ("transfer=chunked", "workload.isl=1024"))
    bad = sweep / "4" / "summary.json"
    bad.write_bytes(text.encode("latin-1"))
    with pytest.warns(UserWarning, match=re.escape(str(bad))):
        df = analysis.load_sweep(sweep)
    assert list(df["status"][:4]) == ["ok"] * 4 and df.loc[4, "transfer"] == "chunked"
    assert df.loc[4, "status"].startswith(f"corrupt summary: {bad}: not a kvlab summary") and why in df.loc[4, "status"]
    assert pd.isna(df.loc[4, "total_bytes"])  # no figure of its own, not zeros


def test_results_and_timeline_carry_the_run_columns(sweep):
    res = analysis.load_results(sweep)
    assert len(res) == 8
    assert set(res["strategy"]) == {"naive", "layerwise"}
    assert sorted(res["workload.isl"].unique()) == [1024, 4096]
    one = analysis.load_results(sweep / "0")
    assert len(one) == 2 and (one["isl"] == 1024).all()
    tl = analysis.load_timeline(sweep)
    assert len(tl) == 2 * 2 * 4  # layerwise jobs only: 2 runs x 2 requests x 4 layers
    assert set(tl["transfer"]) == {"layerwise"}


def test_predictions_come_from_each_runs_config(sweep):
    df = analysis.add_predictions(analysis.load_sweep(sweep))
    assert df["predicted_s"].notna().all()
    for _, row in df.iterrows():
        isl = row["workload.isl"]
        s = build(compose([f"transfer={row['strategy']}", f"workload.isl={isl}", "workload.requests=2"]))
        p = predict(s, [row["workload.isl"]] * 2, backend="gloo", with_prefill=True)
        assert row["predicted_s"] == pytest.approx(p.seconds)
    # runs with four times the prompt take longer
    for s in ("naive", "layerwise"):
        d = df[df["strategy"] == s].sort_values("workload.isl")
        assert d["predicted_s"].is_monotonic_increasing


def _texts(fig):
    ax = fig.axes[0]
    return [t.get_text() for t in ax.texts] + [ax.get_title()]


def test_plot_bandwidth_and_memory(sweep):
    df = analysis.load_sweep(sweep)
    fig = analysis.plot_bandwidth(df)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    lines = {c.get_label(): c.lines[0] for c in ax.containers}
    assert list(lines) == ["naive", "naive: its runs' link", "layerwise", "layerwise: its runs' link"]
    naive = lines["naive"]
    assert list(naive.get_xdata()) == [1024, 4096] and list(naive.get_ydata()) == [0.5, 2.0]
    # the link each run measured (its summary's link_gbps), not a model of it
    assert list(lines["naive: its runs' link"].get_ydata()) == [1.0, 4.0]
    fig = analysis.plot_memory(df)
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    naive_mem = lines["naive"].get_ydata()
    assert naive_mem[1] == pytest.approx(4 * naive_mem[0])
    assert list(lines["layerwise"].get_ydata()) == [64, 64]
    fig.savefig(sweep / "mem.png")
    assert (sweep / "mem.png").stat().st_size > 1000


def test_plot_timeline(sweep):
    tl = analysis.load_timeline(sweep)
    fig = analysis.plot_timeline(tl, request=1)
    ax = fig.axes[0]
    compute, transfer = ax.containers
    assert len(compute) == len(transfer) == 4
    assert [b.get_width() for b in transfer] == pytest.approx([1.0] * 4)  # 1 ms after each layer
    assert "1.00 ms exposed" in ax.get_title()
    assert all(float(t).is_integer() for t in ax.get_yticks())  # a tick per layer, none at half layers
    with pytest.raises(ValueError, match="layerwise"):
        analysis.plot_timeline(tl.iloc[0:0])


def test_parallel_heatmap(tmp_path):
    root = tmp_path / "m"
    job = 0
    for c in (1, 2, 3):
        for g in (1, 2, 3):
            make_run(root / str(job), (f"ctx.tp={c}", f"gen.tp={g}"), gbps=c * 10 + g)
            job += 1
    df = analysis.load_sweep(root)
    fig = analysis.plot_parallel_heatmap(df)
    img = fig.axes[0].images[0].get_array()
    assert img.shape == (3, 3)
    assert img[2, 0] == 31 and img[0, 2] == 13  # rows ctx.tp, columns gen.tp
    assert "31" in _texts(fig)


def test_plot_plan_from_setup_summary_and_file(tmp_path):
    s = build(compose(["ctx.tp=3", "gen.tp=2", "workload.isl=1024"]))
    summary = summarize(s)
    (tmp_path / "plan.json").write_text(json.dumps(summary))
    for src in (s, summary, tmp_path, tmp_path / "plan.json"):
        fig = analysis.plot_plan(src)
        ax = fig.axes[0]
        labels = [t for t in _texts(fig) if "MiB\n" in t]
        assert len(labels) == len(summary["pairs"]) == 4  # ctx1 splits its heads over both gen ranks
        names = {t.get_text() for t in ax.texts}
        assert {"ctx0", "ctx1", "ctx2", "gen0", "gen1"} <= names
        widths = sorted(line.get_linewidth() for line in ax.get_lines())
        assert widths[-1] == pytest.approx(6.5) and widths[0] < widths[-1]


def test_plot_prediction(sweep):
    df = analysis.load_sweep(sweep)
    fig = analysis.plot_prediction(df)
    ax = fig.axes[0]
    pts = [c.get_offsets() for c in ax.collections]
    assert sum(len(p) for p in pts) == 4
    assert "median ratio" in ax.get_title()


def test_old_and_new_summaries_share_their_columns(sweep):
    """A sweep that mixes summaries written before schema 2 (``seconds``, rows' ``wire_s``) with current ones
    reads as one table with the current names; ``schema`` says what each run's GB/s were over."""
    new = sweep / "4"
    make_run(new, ("transfer=chunked", "workload.isl=1024", "workload.requests=2"))
    s = json.loads((new / "summary.json").read_text())
    s.update(schema=2, makespan_s=s.pop("seconds"), busy_s=0.001)
    (new / "summary.json").write_text(json.dumps(s))
    df = analysis.load_sweep(sweep)
    assert "seconds" not in df and df["makespan_s"].notna().all() and df["makespan_s"].gt(0).all()
    assert list(df["schema"]) == [0, 0, 0, 0, 2]
    assert df["busy_s"].isna().sum() == 4  # not measured before schema 2: absent, not zero
    res = analysis.load_results(sweep)
    assert "wire_s" not in res and res["busy_s"].notna().all()
    assert "median ratio" in analysis.plot_prediction(df).axes[0].get_title()  # measured: makespan_s


def test_figures_lists_the_table():
    table = analysis.figures()
    assert table.loc["gbps", "unit"] == "GB/s" and table.loc["gbps", "run"] == "gbps"
    assert table.loc["bytes", "run"] == "total_bytes" and table.loc["bytes", "reduction"] == "sum"
    assert table.loc["makespan_s", "was"] == "seconds" and not table.loc["makespan_s", "request"]
    assert table.loc["slot_wait_s", "needs"] == "slots" and table.loc["ttft_s", "percentiles"]
    assert table["meaning"].str.len().gt(0).all()


def test_plot_load_scales_each_figure_by_its_unit(tmp_path):
    import pandas as pd

    df = pd.DataFrame({"strategy": ["chunked"] * 2, "workload.rate": [5, 25],
                       "serving.ttft_s.p90": [0.1, 0.2], "serving.prefill_slowdown.p90": [1.1, 1.4]})
    ax = analysis.plot_load(df).axes[0]
    assert list(ax.get_lines()[0].get_ydata()) == pytest.approx([100, 200]) and "(ms)" in ax.get_ylabel()
    ax = analysis.plot_load(df, "serving.prefill_slowdown").axes[0]
    assert list(ax.get_lines()[0].get_ydata()) == pytest.approx([1.1, 1.4]) and "(x)" in ax.get_ylabel()
    held = analysis.plot_load(df.assign(**{"slo.ttft_ms": [150.0, 150.0]})).axes[0]  # the SLO on its figure
    assert "TTFT SLO (150 ms)" in [t.get_text() for t in held.get_legend().get_texts()]
    assert held.get_xlabel() == "arrival rate (req/s)"


def test_plots_label_their_axes_with_units_and_mark_link_ratios_above_one(sweep):
    """Paper-ready: labels from the figure table with their units, never a raw field name; a link_ratio above 1
    (the reference was no ceiling) marked and said in the legend; no legend entry for a line with nothing to draw."""
    from kvlab.analysis.labels import label

    assert label("gbps") == "delivered (GB/s)" and label("serving.ttft_s.p90") == "TTFT p90 (ms)"
    assert label("workload.rate") == "arrival rate (req/s)" and label("ctx.tp") == "ctx TP"
    df = analysis.load_sweep(sweep)
    ax = analysis.plot_bandwidth(df).axes[0]
    assert ax.get_ylabel() == "delivered (GB/s)" and ax.get_xlabel() == "prompt length (tokens)" and ax.get_title()
    df = df.assign(link_ratio=[0.5, 1.2, 0.8, 0.9][: len(df)])
    ax = analysis.plot_link_ratio(df).axes[0]
    marked = [c for c in ax.collections if "above the raw link" in str(c.get_label())]
    assert len(marked) == 1 and len(marked[0].get_offsets()) == 1 and marked[0].get_offsets()[0][1] == 1.2
    assert any("above the raw link (1 runs" in t.get_text() for t in ax.get_legend().get_texts())
    df["link_gbps"] = np.nan  # no run measured its link: no dashed line, no legend entry for it
    ax = analysis.plot_bandwidth(df).axes[0]
    assert not any("its runs' link" in t.get_text() for t in ax.get_legend().get_texts())
    ax = analysis.plot_prediction(analysis.load_sweep(sweep)).axes[0]
    assert ax.get_xlabel() == "measured run span (ms)" and ax.get_ylabel() == "predicted run span (ms)"
