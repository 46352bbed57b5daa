#!/usr/bin/env bash
# The GPU check, in one call: carried wheels, GPU tests, benchmarks, tables. On one GPU the tests that
# need two skip and only the ipc benchmark runs (ctx and gen on the same GPU); on two, bench.py too.
#   bash scripts/gpu_check.sh [--serving] [--no-tests] [--no-bench] [--jobs N] [--quick]   (from the repository root)
# --serving: also scripts/serving_bench.py, alone and under a CUDA MPS daemon
# --mooncake: also scripts/mooncake_bench.py --gpu (Mooncake's CUDA-13 wheel in .whl/, without NIXL's: carry limit)
# --kernels: also scripts/rect_bench.py (copy_rect over engine layout pairs on the span kernel and gen fp8, each with
#   a layer per work item and with layers grouped), into rect_bench_h200.json
# --fp8: also scripts/rect_bench.py on the gen fp8 cases alone (the converting copy), over rows in flight and cp.async
#   ring slots (KVLAB_FP8_SWEEP="--convert-rows 4 2 --convert-ring 0 4 6" by default), each beside its ceilings (one
#   contiguous buffer, and for DeepSeek-V3.2 the pair's own scattered pattern), into rect_bench_fp8_h200.json
# --ceilings: also scripts/rect_bench.py --ceilings over the engine pairs on both kernels and gen fp8: each pair beside
#   what scattered pieces of 256 B-32 KiB give (no layout: the memory's own ceiling), into rect_bench_ceilings_h200.json
# --gemma: also scripts/ipc_bench.py --gemma (Gemma-3-27B ctx TP2 -> gen TP1 layer_major tpb 64, 32k, 6 requests, 3 runs),
#   into gemma_h200.json
# --engines: also scripts/ipc_bench.py --engines (vLLM NHD ctx -> TensorRT-LLM gen, bf16 and gen fp8), into engines_h200.json
# --apart: --gemma and --engines with arrivals 2 s apart (poisson at 0.5/s, burstiness 1e6: all but constant gaps),
#   longer than a 32k prefill, so no ctx process's prefill runs beside a pull, into *_apart_h200.json; --apart-only:
#   those alone (--engines alone comes near its 500 s limit: give each set a call of its own)
# --mps: --gemma and --engines (and --apart) again with every process a client of a CUDA MPS daemon of this script's
#   own (quit before the script ends, whatever happens), into *_mps_h200.json; --mps-only: those under MPS alone
# --caches: this year's caches on the GPU (hybrid state, context parallelism, prefill=model): check=decode of each,
#   then Qwen3-Next TP2 -> TP1 and Llama CP2 -> DCP2 at 32k over ipc beside the in-run copy_, into caches_h200.json
# --model-prefill: prefill=model (the transformers model on the clock) decode-checked over ipc: Llama-3.1-8B TP1 -> TP1
#   at 8k-32k layer-wise and chunked, the issue's command (the default ctx TP2 -> gen TP1) at 16k, DeepSeek-V3.2 into gen PP2 layer-wise, and prefill=gpu
#   on the same 32k shapes (the approximation's prefill against the model's), into model_prefill_h200.json
#   (about 10 minutes on one H200; KVLAB_MPREFILL="name ..." runs only those)
# --decode: also check=decode on the GPU for the six families (transformers' wheel in .whl/), into decode_h200.json
# KVLAB_GPU_TESTS="tests/a.py tests/b.py": only those test files (all of tests/ by default)
# --jobs N: the GPU tests in N pytest-xdist workers (the image has it), then the failed ones again alone
# A GPU machine without a package index gets the pure-Python wheels its image lacks from .whl/, made
# beforehand on a machine with one:  pip wheel --no-deps -w .whl hydra-core omegaconf "antlr4-python3-runtime==4.9.*"
# and, for the nixl tests and scripts/nixl_bench.py, NIXL's wheel for the GPU machine's Python (without it they skip):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl nixl-cu13
set -uo pipefail
serving=0; mooncake=0; decode=0; engines=0; kernels=0; fp8=0; caches=0; mprefill=0; ceilings=0; gemma=0; apart=0
usemps=0; mpsonly=0; apartonly=0; rest=()
for a in "$@"; do
  case "$a" in --serving) serving=1;; --mooncake) mooncake=1;; --decode) decode=1;; --engines) engines=1;; --kernels) kernels=1;; --fp8) fp8=1;; --caches) caches=1;; --model-prefill) mprefill=1;; --ceilings) ceilings=1;; --gemma) gemma=1;; --apart) apart=1;; --apart-only) apart=1; apartonly=1;; --mps) usemps=1;; --mps-only) usemps=1; mpsonly=1;; *) rest+=("$a");; esac
done
set -- "${rest[@]}"
out=${OUT:-/tmp/kvlab-gpu}
mkdir -p "$out"
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl || exit 1
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1
nvidia-smi -L; nvidia-smi topo -m | head -4
python3 -c 'import torch, cuda.core; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "cuda.core", cuda.core.__version__)'
tests=1; [ "${1:-}" = "--no-tests" ] && { tests=0; shift; }
bench=1; [ "${1:-}" = "--no-bench" ] && { bench=0; shift; }
jobs=(); [ "${1:-}" = "--jobs" ] && { jobs=(-n "$2" --dist load); shift 2; }  # load: not the GPU tests' one group
if [ $tests = 1 ]; then
  python3 -m pytest -q -p no:cacheprovider -rf "${jobs[@]}" -m "gpu or gpu2" ${KVLAB_GPU_TESTS:-tests/} 2>&1 | tee "$out/gpu_tests.log" | tail -25
  failed=$(grep -o '^FAILED [^ ]*' "$out/gpu_tests.log" | cut -d' ' -f2 | sort -u)
  # workers share one GPU and 16 cores: a failure under that load is run again alone before it counts
  [ ${#jobs[@]} -gt 0 ] && [ -n "$failed" ] && python3 -m pytest -q -p no:cacheprovider $failed 2>&1 \
    | tee "$out/gpu_tests_again.log" | tail -25
fi
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
[ $bench = 1 ] && [ "$gpus" -ge 2 ] && python3 scripts/bench.py --out "$out/bench.json" "$@" 2>&1 | tee "$out/bench.log"
[ $bench = 1 ] && python3 scripts/ipc_bench.py --out "$out/ipc.json" "$@" 2>&1 | tee "$out/ipc.log"
true
# with_mps CMD...: CMD with every CUDA process it starts a client of a CUDA MPS daemon of this script's own, quit when
# CMD ends, whatever happens
with_mps() {
  local mps=/usr/local/nvidia/bin/nvidia-cuda-mps-control
  [ -x $mps ] || mps=$(command -v nvidia-cuda-mps-control) || { echo "no nvidia-cuda-mps-control here: $1 skipped"; return 1; }
  export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
  # the daemon keeps none of this script's output open (a reader of it would wait for the daemon), and its quit
  # is bounded: a call under MPS once ran to its limit after its last figure was written
  trap "echo quit | timeout 60 $mps" EXIT
  if $mps -d </dev/null >"$CUDA_MPS_LOG_DIRECTORY/start.out" 2>&1; then "$@"
  else echo "nvidia-cuda-mps-control -d failed, $1 skipped: $(cat "$CUDA_MPS_LOG_DIRECTORY/start.out")"; fi
  echo quit | timeout 60 $mps; trap - EXIT
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
# the serving timeline (scripts/serving_bench.py), then its Mooncake cases again with ctx and gen as clients
# of a CUDA MPS daemon of this script's own (quit before the script ends, whatever happens)
if [ $serving = 1 ]; then
  python3 scripts/serving_bench.py --out "$out/serving.json" 2>&1 | tee "$out/serving.log"
  # an earlier checkout unpacked in build/before (git archive REV kvlab conf kernels traces): the same Mooncake
  # cases before a change, on the same GPU in the same call
  [ -d build/before ] && python3 scripts/serving_bench.py --out "$out/serving_before.json" --tag before \
    --root build/before --only mooncake-layerwise mooncake-chunked 2>&1 | tee "$out/serving_before.log"
  with_mps python3 scripts/serving_bench.py --out "$out/serving_mps.json" --tag mps \
    --only mooncake-layerwise mooncake-chunked 2>&1 | tee "$out/serving_mps.log"
fi
true
[ $kernels = 1 ] && timeout 420 python3 scripts/rect_bench.py --out "$out/rect_bench_h200.json" --pairs engines \
  --fp8-pairs 3 --paths span --layer-passes 0 4 --convert-rows 4 8 2>&1 | tee "$out/rect_bench.log" | grep "^|"
true
[ $fp8 = 1 ] && timeout 420 python3 scripts/rect_bench.py --out "$out/rect_bench_fp8_h200.json" --paths --fp8-pairs 3 \
  --repeats 3 ${KVLAB_FP8_SWEEP:---convert-rows 4 2 --convert-ring 0 4 6} 2>&1 | tee "$out/rect_bench_fp8.log" | grep "^|"
true
[ $ceilings = 1 ] && timeout 420 python3 scripts/rect_bench.py --out "$out/rect_bench_ceilings_h200.json" --ceilings \
  --pairs engines --fp8-pairs 3 --repeats 3 2>&1 | tee "$out/rect_bench_ceilings.log" | grep "^|"
true
# the end-to-end sets: TAG (the files' suffix) and ipc_bench's extra arguments; then again under MPS with --mps
e2e() {
  local tag=$1; shift
  [ $gemma = 1 ] && timeout 400 python3 scripts/ipc_bench.py --gemma --no-handoff --requests 6 --repeats 3 "$@" \
    --out "$out/gemma${tag}_h200.json" 2>&1 | tee "$out/gemma${tag}.log" | tail -6
  [ $engines = 1 ] && timeout 500 python3 scripts/ipc_bench.py --engines --no-handoff --requests 6 --repeats 3 "$@" \
    --out "$out/engines${tag}_h200.json" 2>&1 | tee "$out/engines${tag}.log" | tail -12
  true
}
apart_set=(--set workload.arrival=poisson workload.rate=0.5 workload.burstiness=1e6)
if [ $mpsonly = 0 ]; then [ $apartonly = 0 ] && e2e ""; [ $apart = 1 ] && e2e _apart "${apart_set[@]}"; fi
e2e_mps() { [ $apartonly = 0 ] && e2e _mps; [ $apart = 1 ] && e2e _apart_mps "${apart_set[@]}"; true; }
[ $usemps = 1 ] && with_mps e2e_mps
true
[ $mooncake = 1 ] && timeout 400 python3 scripts/mooncake_bench.py --gpu --out "$out/mooncake_h200.json" 2>&1 \
  | tee "$out/mooncake.log" | tail -30
true
# check=decode with the models on the GPU in bf16 (ipc, ctx TP2 -> gen TP1 and PP2 for DeepSeek-V3.2 as in the
# README's run, TP2 -> TP1 for the others): tokens equal and the largest logit difference per family
if [ $decode = 1 ]; then
  export KVLAB_DECODE_CACHE=$(mktemp -d)
  for m in llama3_8b qwen3_235b deepseek_v3 deepseek_v32 gpt_oss_120b gemma3_27b; do
    extra=(); [ $m = deepseek_v32 ] && extra=(gen.pp=2 transfer=layerwise)
    timeout 240 python3 -m kvlab run check=decode device=cuda transport=ipc model=$m ctx.tp=2 gen.tp=1 \
      workload.requests=4 logger=quiet "hydra.run.dir=$out/decode/$m" "${extra[@]}" 2>&1 | grep -E "check=decode|error" \
      | sed "s/^/$m: /"
  done
  python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = {}
for d in sorted((out / "decode").iterdir()):
    s = json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else {}
    rows[d.name] = {k: s.get(k) for k in ("verified", "requests", "decode_tokens", "decode_tokens_equal",
                                          "decode_max_logit_diff", "decode_first_divergent", "byte_check_failures")}
    rows[d.name]["device"] = s.get("provenance", {}).get("gpu") or s.get("device")
(out / "decode_h200.json").write_text(json.dumps(rows, indent=1))
print(json.dumps(rows, indent=1))
PY
fi
true
# this year's caches: check=decode of the hybrids over TP pairs that split the state differently, CP -> DCP, and
# prefill=model (the transformers model on the clock), then the 32k transfers against the in-run copy_ reference
if [ $caches = 1 ]; then
  export KVLAB_DECODE_CACHE=$(mktemp -d)
  run() {  # NAME SECONDS OVERRIDES...: one kvlab run into $out/caches/NAME, its check and figure lines
    local name=$1 limit=$2; shift 2
    timeout "$limit" python3 -m kvlab run device=cuda transport=ipc logger=quiet "hydra.run.dir=$out/caches/$name" "$@" \
      2>&1 | grep -E "check=decode|kvlab: error|verified|link_ratio|GB/s|Error" | head -8 | sed "s/^/$name: /"
  }
  run qwen3_next_tp2_tp1 120 model=qwen3_next_80b ctx.tp=2 gen.tp=1 check=decode workload.requests=4
  run nemotron_h_tp1_tp2 120 model=nemotron_h ctx.tp=1 gen.tp=2 check=decode workload.requests=4
  run llama_cp2_dcp2 120 model=llama3_8b ctx.cp=2 gen.dcp=2 check=decode workload.requests=4
  run llama_prefill_model 200 model=llama3_8b prefill=model check=decode transfer=layerwise workload.isl=16384 \
    workload.requests=2
  run qwen3_next_32k 120 model=qwen3_next_80b ctx.tp=2 gen.tp=1 workload.isl=32768 workload.requests=6
  run llama_cp2_dcp2_32k 120 model=llama3_8b ctx.cp=2 gen.dcp=2 workload.isl=32768 workload.requests=6
  python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = {}
for d in sorted((out / "caches").iterdir()):
    if (d / "summary.json").exists():  # every scalar figure of the run, and its exposed transfer's percentiles
        s = json.loads((d / "summary.json").read_text())
        rows[d.name] = {k: v for k, v in s.items() if not isinstance(v, (list, dict))}
        rows[d.name].update(exposed=s.get("serving", {}).get("exposed_s"), link=s.get("link"))
(out / "caches_h200.json").write_text(json.dumps(rows, indent=1))
print(json.dumps(rows, indent=1))
PY
fi
true
# prefill=model on the clock, decoded by the same run (issue: the model itself as the prefill)
if [ $mprefill = 1 ]; then
  export KVLAB_DECODE_CACHE=$(mktemp -d)
  mrun() {  # NAME SECONDS OVERRIDES...: the run's whole output kept beside it (logger=quiet leaves run_cmd.log empty)
    local name=$1 limit=$2; shift 2
    mkdir -p "$out/model_prefill/$name"
    timeout "$limit" python3 -m kvlab run device=cuda transport=ipc logger=quiet "hydra.run.dir=$out/model_prefill/$name" \
      "$@" > "$out/model_prefill/$name/output.txt" 2>&1
    grep -E "check=decode|kvlab:|Error|exposed" "$out/model_prefill/$name/output.txt" | head -8 | cut -c1-400 | sed "s/^/$name: /"
  }
  # KVLAB_MPREFILL="name ..." runs only those (the whole set takes about 10 minutes on one H200)
  want() { [ -z "${KVLAB_MPREFILL:-}" ] || [[ " $KVLAB_MPREFILL " == *" $1 "* ]]; }
  # the issue's command as written: the default layout, ctx TP2 -> gen TP1 (two ctx ranks on the one GPU)
  want llama_tp2_16k_layerwise && mrun llama_tp2_16k_layerwise 240 model=llama3_8b prefill=model check=decode transfer=layerwise workload.isl=16384
  want llama_tp1_16k_layerwise && mrun llama_tp1_16k_layerwise 240 model=llama3_8b prefill=model check=decode transfer=layerwise ctx.tp=1 workload.isl=16384
  want llama_tp1_8k_layerwise && mrun llama_tp1_8k_layerwise 200 model=llama3_8b prefill=model check=decode transfer=layerwise ctx.tp=1 workload.isl=8192 workload.requests=3
  want llama_tp1_32k_layerwise && mrun llama_tp1_32k_layerwise 240 model=llama3_8b prefill=model check=decode transfer=layerwise ctx.tp=1 workload.isl=32768 workload.requests=2
  want llama_tp1_32k_chunked && mrun llama_tp1_32k_chunked 240 model=llama3_8b prefill=model check=decode transfer=chunked ctx.tp=1 workload.isl=32768 workload.requests=2
  want llama_tp1_32k_gpu && mrun llama_tp1_32k_gpu 90 model=llama3_8b prefill=gpu transfer=layerwise ctx.tp=1 workload.isl=32768 workload.requests=2
  # the depth left to kvlab: the largest prefix of DeepSeek-V3.2's layers that fits beside the pools, said in one line
  # (at 8k tokens transformers' indexer scores alone take 32 GiB per forward: 4k, and one ctx rank)
  want dsv32_pp2_4k_layerwise && mrun dsv32_pp2_4k_layerwise 240 model=deepseek_v32 prefill=model check=decode transfer=layerwise ctx.tp=1 gen.pp=2 workload.isl=4096 workload.requests=2
  want dsv32_pp2_4k_gpu && mrun dsv32_pp2_4k_gpu 80 model=deepseek_v32 prefill=gpu transfer=layerwise ctx.tp=1 gen.pp=2 workload.isl=4096 workload.requests=2
  want dsv32_pp2_4k_16layers && mrun dsv32_pp2_4k_16layers 180 model=deepseek_v32 prefill=model check=decode transfer=layerwise ctx.tp=1 gen.pp=2 workload.isl=4096 workload.requests=2 model.run_layers=16
  python3 - "$out" <<'PY'
import json, pathlib, statistics, sys
import yaml
out = pathlib.Path(sys.argv[1])
rows = {}
for d in sorted((out / "model_prefill").iterdir()):
    if not (d / "summary.json").exists():
        rows[d.name] = {"ended": "no summary"}
        continue
    s = json.loads((d / "summary.json").read_text())
    reqs = [json.loads(x) for x in (d / "results.jsonl").read_text().splitlines() if x.strip()] \
        if (d / "results.jsonl").exists() else []
    pre = [r["prefill_s"] for r in reqs if isinstance(r, dict) and r.get("prefill_s") is not None]
    rows[d.name] = {k: s.get(k) for k in ("verified", "requests", "completed", "decode_tokens", "decode_tokens_equal",
                                          "decode_max_logit_diff", "byte_check_failures", "gbps", "link_ratio")}
    cfg = yaml.safe_load((d / "config.yaml").read_text())
    layers = cfg["model"].get("run_layers") or cfg["model"]["num_layers"]
    med = statistics.median(pre) if pre else None
    rows[d.name].update(exposed=s.get("serving", {}).get("exposed_s"), prefill_s_median=med, layers=layers,
                        prefill_s_per_layer=med / layers if med else None)
# what prefill=gpu's approximation is off by: its per-layer time over the model's, on the same shapes
for gpu, model in (("llama_tp1_32k_gpu", "llama_tp1_32k_layerwise"), ("dsv32_pp2_4k_gpu", "dsv32_pp2_4k_layerwise"),
                   ("dsv32_pp2_4k_gpu", "dsv32_pp2_4k_16layers")):
    a, b = rows.get(gpu, {}).get("prefill_s_per_layer"), rows.get(model, {}).get("prefill_s_per_layer")
    if a and b:
        rows[f"{gpu}_over_{model}"] = {"per_layer_ratio": a / b}
(out / "model_prefill_h200.json").write_text(json.dumps(rows, indent=1))
print(json.dumps(rows, indent=1))
PY
fi
true
