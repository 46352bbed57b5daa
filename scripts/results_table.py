"""Markdown tables of a bench JSON (scripts/bench.py), for the results pages (docs/results/): numbers are
never copied by hand.

    python scripts/results_table.py results/bench_h200x2.json        # transfers
    python scripts/results_table.py results/kernel_bench_h200.json   # pack/unpack kernels
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvlab.results.records import BenchReport, from_dict  # noqa: E402

MiB, GiB = 2**20, 2**30


def transfers(report: BenchReport) -> str:
    lines = [f"{report.device} x{report.gpus}, torch {report.torch}, NCCL {report.nccl}, CUDA "
             f"{report.cuda}, {(report.date or '')[:10]}; ctx on GPU0, gen on GPU1; one request per run, verified.",
             "",
             "| transfer | GiB | GB/s | raw NCCL GB/s (same bytes) | ratio | staging MiB | extra MiB | "
             "extra / staging | exposed after prefill ms | verified |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in report.transfers:
        s = r.summary
        exposed, ratio = s.exposed_s, r.extra_over_staging
        lines.append(
            f"| {r.name.replace('transfer.', '')} | {s.total_bytes / GiB:.2f} | {s.gbps:.1f} | "
            f"{r.raw_nccl_gbps:.1f} | {r.ratio_to_raw:.3f} | {s.peak_staging_bytes / MiB:,.0f} | "
            f"{s.peak_extra_device_bytes / MiB:,.0f} | {'' if ratio is None else f'{ratio:.2f}'} | "
            f"{'' if exposed is None else f'{exposed * 1e3:.2f}'} | {'yes' if s.verified else 'NO'} |")
    return "\n".join(lines)


def kernels(report: dict, kernel: str = "warp 1024x8", ctas: tuple[int, ...] = (16, 32, 132)) -> str:
    """Pack/unpack GB/s (read + written) and the ratio to the d2d copy, per pool case and CTA count."""
    rows = [r for r in report.get("rows", []) if r["kernel"] == kernel]
    if not rows:
        return ""
    head = " | ".join(f"{c} CTAs" for c in ctas)
    lines = [f"| pool, chunk | op | {head} |", "| --- | --- |" + " ---: |" * len(ctas)]
    seen = {}
    for r in rows:
        seen.setdefault((r["case"], r["chunk_mib"], r["op"]), {})[r["ctas"]] = r
    for (case, mib, op), by in seen.items():
        cells = " | ".join(f"{by[c]['gbps']:.0f} ({by[c]['ratio']:.2f})" if c in by else "" for c in ctas)
        lines.append(f"| {case}, {mib} MiB | {op} | {cells} |")
    copy = report.get("copy_gbps", {})
    lines.append("")
    lines.append("d2d copy (torch `copy_`, whole GPU): "
                 + ", ".join(f"{v:.0f} GB/s at {k} MiB" for k, v in copy.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    rep = json.loads(open(sys.argv[1]).read())
    print(kernels(rep) if "rows" in rep else transfers(from_dict(BenchReport, rep)))
