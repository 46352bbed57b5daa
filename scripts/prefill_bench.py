"""prefill=gpu against the prefill time model on one GPU: for each preset and prompt length, the
measured seconds of a whole prefill (kvlab.rank.prefill_gpu, nothing else on the GPU) and what
prefill=sim predicts at its stated MFU, and the MFU the kernels reached (modelled FLOPs over the
measured time, over the peak). Writes JSON (``--out``) and prints a table.

    python scripts/prefill_bench.py --out results/prefill_h200.json
"""
from __future__ import annotations

import argparse
import datetime
import json

import torch

from kvlab.config.schema import build, compose
from kvlab.model.prefill import layer_flops, layer_seconds
from kvlab.rank.prefill_gpu import GpuPrefill

CASES = [("llama3_8b", 8192), ("llama3_8b", 32768), ("qwen3_235b", 8192), ("deepseek_v3", 8192),
         ("gpt_oss_120b", 8192), ("gemma3_27b", 8192)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="prefill_bench.json")
    ap.add_argument("--quick", action="store_true", help="the first two cases only")
    args = ap.parse_args()
    rows = []
    for model, n in CASES[:2] if args.quick else CASES:
        s = build(compose([f"model={model}", "parallel=same", "device=cuda"]))
        g = GpuPrefill(s.model, 1, torch.device("cuda"))
        measured = g.alone_s(n)
        sim = sum(layer_seconds(s.model, s.prefill, 1, n))
        flops = sum(layer_flops(s.model, layer, n) for layer in range(s.model.num_layers))
        if s.model.dims.indexer_heads:  # modelled, not run on the GPU
            flops -= s.model.num_layers * 2.0 * s.model.dims.indexer_heads * 128 * n * (n + 1) / 2
        rows.append({"model": model, "tokens": n, "measured_s": measured, "sim_s": sim,
                     "sim_over_measured": sim / measured, "mfu": flops / measured / (s.prefill.tflops * 1e12)})
        print(f"{model:14s} {n:6d}  measured {measured * 1e3:9.1f} ms  sim {sim * 1e3:9.1f} ms  "
              f"sim/measured {sim / measured:5.2f}  MFU {rows[-1]['mfu']:.3f}", flush=True)
        del g
        torch.cuda.empty_cache()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "peak_tflops": 989.0, "sim_mfu": 0.5, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
