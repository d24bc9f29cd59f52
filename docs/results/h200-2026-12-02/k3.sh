#!/bin/bash
# Eighteenth run, call 11 (one H200): the staged Triton pass reads the fast kernel's prepared
# query rows (commit in .snap/GIT_SHA): kernel bench for values-only windows and keys too, the
# fast path's GPU tests, then the per-kernel profile (default launch, and a 168-register cap).
cd packages/kvarn-kernels && export PYTHONPATH=$PWD/../kvarn-math/src:$PWD/src
mkdir -p $OUT/k
for W in values keys; do
  timeout 50 python3 -m kvarn_kernels.bench --quick --no-vllm --key-frame auto --windows $W --out $OUT/k/$W.json > $OUT/k/$W.log 2>&1
  echo "$W rc=$?"; grep "^| kvarn" $OUT/k/$W.log | sort -u | cut -d'|' -f4-6,13-14
done
timeout 90 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -k "fast_decode or values_only" > $OUT/k/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -3 $OUT/k/gpu_tests.log
timeout 70 python3 ../../.gpurun/prof.py 2>&1 | grep "^launch" > $OUT/k/prof.log
cat $OUT/k/prof.log
