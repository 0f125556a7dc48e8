#!/bin/bash
# Device-machine driver (not part of the package). usage: gpu.sh smoke|stash|main [seconds] [-- cmds]
# The CIFAR-10 copy (171 MB) exceeds one transfer (64 MiB), so it travels in three parts:
# p1 = test set + labels + train[0:10000], p2 = train[10000:30000], p3 = train[30000:50000].
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
D=/tmp/rcdl-data; R=/tmp/rcdl-runs; mkdir -p $D $R
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
pack() { tar czf $OUT/runs.tgz.tmp -C $R --exclude='*.pt' . 2>/dev/null && mv $OUT/runs.tgz.tmp $OUT/runs.tgz; }
assemble() {  # $1: small|full
python3 - "$1" <<'PY'
import sys, numpy as np, os
D = "/tmp/rcdl-data"; which = sys.argv[1]
p1 = np.load(f"{D}/p1.npz")
parts = [p1["x_train_0"]]
if which == "full":
    parts += [np.load(f"{D}/p2.npz")["x_train_1"], np.load(f"{D}/p3.npz")["x_train_2"]]
x_train = np.concatenate(parts)
os.makedirs(f"{D}/{which}", exist_ok=True)
np.savez(f"{D}/{which}/cifar10.npz", x_train=x_train, y_train=p1["y_train"][: len(x_train)],
         x_test=p1["x_test"], y_test=p1["y_test"], class_names=p1["class_names"],
         test_index_within_class=p1["test_index_within_class"])
print(which, x_train.shape)
PY
}
mode=$1; shift
case $mode in
smoke)
  cp .gpudata/p1.npz $D/ && assemble small
  nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv
  python3 -c "import torch, sys; print(sys.version, torch.__version__, torch.cuda.is_available())"
  secs=${1:-150}; shift
  timeout $secs python3 -m rcdl reproduce cifar10-1epoch --train-size 2000 --test-size 1000 \
     --eval-every 50 --data-dir $D/small --out $R/smoke --no-progress --no-checkpoint "$@" 2>&1 | tee $OUT/smoke.log
  pack ;;
stash)
  cp .gpudata/p2.npz $D/ && ls -la $D ;;
main)
  cp .gpudata/p3.npz $D/ && assemble full && rm -f $D/p2.npz $D/p3.npz
  secs=$1; shift; start=$(date +%s)
  ( while sleep 20; do pack; done ) & packer=$!
  # each argument after the time budget is one shell command, run in turn while time remains
  for cmd in "$@"; do
    left=$(( secs - ($(date +%s) - start) ))
    [ $left -le 5 ] && { echo "SKIPPED (no time): $cmd"; continue; }
    echo "=== $cmd  (${left}s left)"
    timeout $left bash -c "$cmd" 2>&1 | tee -a $OUT/main.log
  done
  kill $packer; pack; ls -la $OUT ;;
esac
