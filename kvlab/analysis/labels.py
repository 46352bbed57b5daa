"""Axis labels a paper can print: a column's name as a reader says it, with its unit, from the figure table
(kvlab.core.figures: ``line`` or ``name``, and the unit DISPLAY shows it in) and for the config keys sweeps vary.

``label("gbps")`` is "delivered (GB/s)", ``label("serving.ttft_s.p90")`` "TTFT p90 (ms)" (with ``scale``,
what to multiply the column by for that unit), ``label("workload.rate")`` "arrival rate (req/s)"; a column neither
knows is its own name.
"""
from __future__ import annotations

from kvlab.core import figures

# the config keys sweeps vary, as a reader says them
KEYS = {
    "workload.rate": ("arrival rate", "req/s"), "workload.isl": ("prompt length", "tokens"),
    "isl_mean": ("prompt length", "tokens"), "isl": ("prompt length", "tokens"),
    "workload.concurrency": ("concurrency", "requests"), "transfer.slots": ("staging slots", ""),
    "transfer.slot_mib": ("slot size", "MiB"), "ctx.tp": ("ctx TP", ""), "gen.tp": ("gen TP", ""),
    "ctx.pp": ("ctx PP", ""), "gen.pp": ("gen PP", ""), "ctx.dp": ("ctx DP", ""), "gen.dp": ("gen DP", ""),
    "link_gbps": ("raw link", "GB/s"),
}
# figures whose short name reads better than the table's name or its summary line
SAID = {"gbps": "delivered", "link_ratio": "delivered / raw link", "makespan_s": "run span",
        "peak_extra_device_bytes": "extra device memory per rank"}


def scaled(column: str) -> tuple[str, float]:
    """(the label, the factor from the column's values to the label's unit)."""
    if column in KEYS:
        name, unit = KEYS[column]
        return (f"{name} ({unit})" if unit else name), 1.0
    parts = column.split(".")
    q = parts[-1] if len(parts) > 1 and parts[-1][:1] == "p" and parts[-1][1:].replace(".", "").isdigit() else None
    name = parts[-2] if q else parts[-1]
    f = figures.BY_NAME.get(name)
    if f is None:
        return column, 1.0
    scale, _, unit = figures.DISPLAY[f.unit]
    unit = "" if unit == "x" else unit
    said = SAID.get(name) or f.line or name
    said = f"{said} {q}" if q else said
    return (f"{said} ({unit})" if unit else said), scale


def label(column: str) -> str:
    return scaled(column)[0]
