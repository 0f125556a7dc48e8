#!/bin/bash
# The GPU timings of docs/precision.md, in one short script for a lent GPU machine.
#
# usage: benchmarks/gpu_speed.sh DATA_DIR OUT_DIR [SECONDS]
#
# DATA_DIR holds cifar10.npz (on the workplace's device machine it arrives in parts and is
# rejoined first: see results/machines/gpu-h200/gpu.sh). Within SECONDS (default 540) it runs, in turn,
# until the time runs out:
#   0. the Triton attention kernel against the streaming op on real shapes, every kernel,
#      float32 and bfloat16 stores, with both paths' times (benchmarks/check_triton.py;
#      a failed check stops the script: nothing after it would time the right thing),
#      after the traffic model's floors for this GPU (benchmarks/triton_traffic.py, no
#      device time) to set the times against;
# and then, each as one `rcdl reproduce cifar10-1epoch` at full scale (50 000 / 10 000 images,
# batch 16, the paper's protocol) with --no-checkpoint:
#   1. a profile of gws training steps at 50 000 entries per layer (host reads, top kernels);
#   2. gws, float32 stores            (the authors' notebook: 19.7 s on an H200);
#   3. gws, bfloat16 stores;
#   4. gauge and rbf, float32 stores;
#   5. the hybrid (tau 50)            (authors: 108.5 s);
#   6. gws, gauge and rbf for seeds 1 and 2 (three seeds with step 2 and 4: mean ± sd).
# Each run folder's summary.json has train_seconds and eval_seconds; OUT_DIR/gpu_speed.log
# the whole output. Checkpoints are never written (they are not part of the timed work).
set -u -o pipefail  # a run's status is its command's, not tee's
DATA=${1:?usage: gpu_speed.sh DATA_DIR OUT_DIR [SECONDS]}
OUT=${2:?usage: gpu_speed.sh DATA_DIR OUT_DIR [SECONDS]}
SECONDS_LEFT=${3:-540}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
mkdir -p "$OUT"
start=$(date +%s)
run() {  # run one command if time remains; its output goes to the log
  local left=$(( SECONDS_LEFT - ($(date +%s) - start) ))
  if [ $left -le 10 ]; then echo "SKIPPED (no time left): $*" | tee -a "$OUT/gpu_speed.log"; return; fi
  echo "=== $*  (${left}s left)" | tee -a "$OUT/gpu_speed.log"
  timeout $left "$@" 2>&1 | tee -a "$OUT/gpu_speed.log"
}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee -a "$OUT/gpu_speed.log"
C10="python3 -m rcdl reproduce cifar10-1epoch --data-dir $DATA --device cuda --no-progress --no-checkpoint"
GPU_MODEL=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -qi h200 && echo h200 || echo h100)
run python3 benchmarks/triton_traffic.py --gpu "$GPU_MODEL"
run python3 benchmarks/check_triton.py --entries 50000 --width 3072 \
  || { echo "the Triton kernel disagrees with the streaming op: stopped" | tee -a "$OUT/gpu_speed.log"; exit 1; }
run python3 benchmarks/profile_step.py --model gws --entries 50000 --device cuda
run $C10 --models gws --out "$OUT/gws-fp32"
run $C10 --models gws --store-dtype bfloat16 --out "$OUT/gws-bf16"
run $C10 --models gauge rbf --out "$OUT/gauge-rbf-fp32"
run $C10 --models hybrid --out "$OUT/hybrid-fp32"
run $C10 --models gws gauge rbf --seeds 1 2 --out "$OUT/seeds-1-2"
python3 - "$OUT" <<'PY' | tee -a "$OUT/gpu_speed.log"
import json, pathlib, sys
for summary in sorted(pathlib.Path(sys.argv[1]).glob("*/summary.json")):
    for run in json.loads(summary.read_text())["runs"]:
        print(f"{summary.parent.name:16} {run['model']:8} seed {run['seed']}: "
              f"{100 * run['test_acc']:.2f} %, train {run['train_seconds']:.1f} s, "
              f"eval {run['eval_seconds']:.1f} s")
PY
