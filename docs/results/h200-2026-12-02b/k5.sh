#!/bin/bash
# Nineteenth run, call 1 (one H200): installs the vllm-c part (the first of the vLLM parts), then
# on the kernels alone (commit in .snap/GIT_SHA): the fast decode path's GPU tests, the kernel
# bench for values-only windows and keys too (Llama-3.1-8B shape, key frames per tile), and the
# per-kernel profile with the staged splits uncapped and capped at 1 (prof2.py).
bash .gpu/vllm-c/install.sh | tail -1
cd packages/kvarn-kernels && export PYTHONPATH=$PWD/../kvarn-math/src:$PWD/src
export KVARN_GIT_SHA=$(cat ../../.snap/GIT_SHA)
mkdir -p $OUT/k
timeout 150 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -k "fast_decode or values_only" > $OUT/k/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -3 $OUT/k/gpu_tests.log
for W in values keys; do
  timeout 80 python3 -m kvarn_kernels.bench --quick --no-vllm --key-frame auto --windows $W --out $OUT/k/$W.json > $OUT/k/$W.log 2>&1
  echo "$W rc=$?"; grep "^| kvarn" $OUT/k/$W.log | sort -u | cut -d'|' -f4-6,13-14
done
timeout 120 python3 ../../.gpurun/prof2.py > $OUT/k/prof2.log 2>&1
echo "prof rc=$?"; grep "^launch" $OUT/k/prof2.log | cut -c1-330
