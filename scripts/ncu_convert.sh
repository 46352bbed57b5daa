#!/usr/bin/env bash
# Nsight Compute on one kv_convert_rect launch of scripts/rect_bench.py's gen fp8 cases (where the image has ncu and
# the hardware counters are readable): throughput, warp stalls, issue slots, occupancy and memory per tuning.
#   bash scripts/ncu_convert.sh MODEL ROWS RING [more rect_bench args]   (from the repository root)
set -uo pipefail
model=$1 rows=$2 ring=$3; shift 3
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl || exit 1
export PYTHONPATH="$site:$PWD"
ncu --clock-control none -k regex:kv_convert_rect --launch-skip 2 --launch-count 1 --section SpeedOfLight \
  --section WarpStateStats --section SchedulerStats --section Occupancy --section MemoryWorkloadAnalysis \
  --section LaunchStats ${KVLAB_NCU_SECTIONS:-} python3 scripts/rect_bench.py --out "$(mktemp)" --paths --fp8-pairs 1 --models "$model" \
  --repeats 1 --iters 1 --convert-rows "$rows" --convert-ring "$ring" "$@" 2>&1 | grep -v "^{" | grep -v "^|" \
  | grep -E "Throughput|Stall|Issue|Warp Cycles|Eligible|Active Warps|Occupancy|Registers|Shared Memory Config|Hit Rate|Duration|Elapsed|Block Limit|Bank|Executed Ipc|ERR|rror|Mem Pipes|L1/TEX|No Eligible|One or More|Pipe|pipe|Executed Instructions|Issued Instructions|Utilization|stalled|inst_executed_pipe"
