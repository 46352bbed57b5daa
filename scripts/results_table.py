"""Markdown tables of a bench JSON (scripts/bench.py), for the README: numbers are never copied by hand.

    python scripts/results_table.py results/bench_h200x2.json
"""
from __future__ import annotations

import json
import sys

MiB, GiB = 2**20, 2**30


def transfers(report: dict) -> str:
    lines = [f"{report['device']} x{report['gpus']}, torch {report['torch']}, NCCL {report['nccl']}, CUDA "
             f"{report['cuda']}, {report['date'][:10]}; ctx on GPU0, gen on GPU1; one request per run, verified.",
             "",
             "| transfer | GiB | GB/s | raw NCCL GB/s (same bytes) | ratio | staging MiB | extra MiB | "
             "extra / staging | exposed after prefill ms | verified |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in report["transfers"]:
        s = r["summary"]
        exposed = s.get("exposed_s")
        ratio = r.get("extra_over_staging")
        lines.append(
            f"| {r['name'].replace('transfer.', '')} | {s['total_bytes'] / GiB:.2f} | {s['gbps']:.1f} | "
            f"{r['raw_nccl_gbps']:.1f} | {r['ratio_to_raw']:.3f} | {s['peak_staging_bytes'] / MiB:,.0f} | "
            f"{s['peak_extra_device_bytes'] / MiB:,.0f} | {'' if ratio is None else f'{ratio:.2f}'} | "
            f"{'' if exposed is None else f'{exposed * 1e3:.2f}'} | {'yes' if s['verified'] else 'NO'} |")
    return "\n".join(lines)


def kernels(report: dict) -> str:
    k = report.get("kernels") or {}
    best = k.get("best_le_32_ctas") or {}
    if not best:
        return ""
    copy = k.get("copy_gbps", {})
    lines = ["| op | chunk | CTAs | GB/s (read + written) | d2d copy GB/s | ratio |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for name, b in best.items():
        op, size = name.split()[0], name.split()[1]
        lines.append(f"| {op} | {size} MiB {b['case']} | {b['ctas']} | {b['gbps']:.0f} | "
                     f"{copy.get(size, float('nan')):.0f} | {b['ratio']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    rep = json.loads(open(sys.argv[1]).read())
    print(transfers(rep))
    print()
    print(kernels(rep))
