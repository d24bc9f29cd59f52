#!/bin/bash
# Nineteenth run, call 3 (one H200): installs the vllm-c part, then on the kernels alone (commit in
# .snap/GIT_SHA: exact tiles scored and weighted with fp16 operands for bf16 models too) the
# values-only windows GPU test (its K/V rounded to bf16 for the reference) and the fast path's
# tests, and the kernel bench for values-only windows and keys too.
bash .gpu/vllm-c/install.sh | tail -1
cd .snap/packages/kvarn-kernels && export PYTHONPATH=$PWD/../kvarn-math/src:$PWD/src
export KVARN_GIT_SHA=$(cat ../../GIT_SHA)
mkdir -p $OUT/k
timeout 170 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -k "fast_decode or values_only" > $OUT/k/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; grep -i "relative RMS\|passed\|failed" $OUT/k/gpu_tests.log | tail -6
for W in values keys; do
  timeout 80 python3 -m kvarn_kernels.bench --quick --no-vllm --key-frame auto --windows $W --out $OUT/k/$W.json > $OUT/k/$W.log 2>&1
  echo "$W rc=$?"; grep "^| kvarn" $OUT/k/$W.log | sort -u | cut -d'|' -f4-6,13-14
done
