"""Goodput against the prefill:decode split of a fixed fleet, per strategy and model, on the Mooncake trace.

    python scripts/sim_fleet.py --trace PATH/mooncake_conversation_trace.jsonl --rate 12 \
        --out results/sim_fleet.json --plot docs/img/fleet_goodput.png

Every point is one ``kvlab sim`` (kvlab.sim.run) of the whole trace rescaled to ``--rate`` requests/s on
``--instances`` instances of 8 H200s (``cluster=h200_400g``: prefill and decode on separate nodes, one
400 Gb/s NIC per GPU), ``--instances - P`` of them decoding. Transfers are each request's own plan for
``transport=nixl`` (16 MiB chunks, staged or in place as the strategy says), costed with the one-H200 ipc
terms (``cost=h200_ipc_fit``, ``sim.terms=ipc``) and bounded by the NIC. The same points one at a time:
``kvlab sim model=... transfer=... cluster.ctx_instances=P cluster.gen_instances=N-P sim.rate=R``.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

MODELS = {  # (overrides, what they stand for)
    "llama3_70b": ["model=llama3_70b", "ctx.tp=8", "gen.tp=8"],
    # the full fp8 checkpoint is what a decode step of a large batch reads (every expert is touched)
    "deepseek_v32": ["model=deepseek_v32", "ctx.tp=8", "gen.tp=8", "cluster.decode.weights_gb=690"],
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default="mooncake_conversation_300.jsonl")
    p.add_argument("--requests", type=int, default=12031)
    p.add_argument("--rate", type=float, default=12.0)
    p.add_argument("--instances", type=int, default=16)
    p.add_argument("--ratios", default="2,4,6,8,10,12,14", help="prefill instances of each point")
    p.add_argument("--strategies", default="chunked,layerwise,zerocopy")
    p.add_argument("--models", default="llama3_70b,deepseek_v32")
    p.add_argument("--ttft-ms", type=float, default=2000.0)
    p.add_argument("--tpot-ms", type=float, default=50.0)
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None)
    a = p.parse_args()

    from kvlab.sim import plans
    from kvlab.sim.run import build_sim, compose_sim, requests, run, vary

    rows = []
    for model in a.models.split(","):
        for strategy in a.strategies.split(","):
            base = ["cluster=h200_400g", f"transfer={strategy}", "transport=nixl", "cost=h200_ipc_fit", "sim.terms=ipc",
                    "workload=mooncake", f"workload.trace={a.trace}", f"workload.requests={a.requests}",
                    "workload.isl_max=131072", f"sim.rate={a.rate}", f"sim.slo.ttft_ms={a.ttft_ms}",
                    f"sim.slo.tpot_ms={a.tpot_ms}", *MODELS[model]]
            s = build_sim(compose_sim(base))
            arr, isl, osl = requests(s)
            t0 = time.perf_counter()
            table = plans.build(s.setup, isl)
            t_table = time.perf_counter() - t0
            for P in (int(x) for x in a.ratios.split(",")):
                v = vary(s, cluster_ctx_instances=P, cluster_gen_instances=a.instances - P)
                r = run(v, arr, isl, osl, table)
                sm = r.summary
                row = {"model": model, "strategy": strategy, "ctx_instances": P, "gen_instances": a.instances - P,
                       "rate": a.rate, "requests": sm["requests"], "goodput": sm["goodput"],
                       "slo_attainment": sm["slo_attainment"], "ttft_p50_ms": sm["ttft_s"]["p50"] * 1e3,
                       "ttft_p90_ms": sm["ttft_s"]["p90"] * 1e3, "tpot_p90_ms": sm["tpot_s"]["p90"] * 1e3,
                       "exposed_p50_ms": sm["exposed_s"]["p50"] * 1e3, "exposed_p90_ms": sm["exposed_s"]["p90"] * 1e3,
                       "queue_p90_ms": sm["queue_s"]["p90"] * 1e3, "admit_wait_p90_ms": sm["admit_wait_s"]["p90"] * 1e3,
                       "nic_util": sm["nic_util"], "prefill_util": sm["prefill_util"], "decode_util": sm["decode_util"],
                       "events": sm["events"], "loop_s": sm["wall_s"], "plan_table_s": t_table}
                rows.append(row)
                print(json.dumps({k: (round(x, 3) if isinstance(x, float) else x) for k, x in row.items()}), flush=True)
    if a.out:
        args = dict(vars(a), trace=Path(a.trace).name)  # where the trace lies is the reader's own
        Path(a.out).write_text(json.dumps({"command": "python scripts/sim_fleet.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in args.items() if v is not None and k not in ("out", "plot")),
            "rows": rows}, indent=1))
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from kvlab.analysis.sweeps import STRATEGY_STYLE

        models = a.models.split(",")
        fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
        for ax, model in zip(axes[0], models):
            for strategy in a.strategies.split(","):
                pts = [r for r in rows if r["model"] == model and r["strategy"] == strategy]
                ax.plot([f"{r['ctx_instances']}:{r['gen_instances']}" for r in pts], [r["goodput"] for r in pts],
                        label=strategy, **STRATEGY_STYLE.get(strategy, {}))
            ax.set_title(f"{model}, {a.instances} x 8 H200, {a.rate:g} req/s")
            ax.set_xlabel("prefill : decode instances")
            ax.set_ylabel(f"goodput (req/s; TTFT <= {a.ttft_ms:g} ms, TPOT <= {a.tpot_ms:g} ms)")
            ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot, dpi=110)


if __name__ == "__main__":
    main()
