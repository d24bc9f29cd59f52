#!/bin/bash
# Eighteenth run, call 1 (one H200): installs the vllm-c part, then times decode attention with the
# staged splits (kernel bench, Llama-3.1-8B shape, key frames per tile) for each windows mode, and
# the values-only windows on the Triton kernel alone.
bash .gpu/vllm-c/install.sh | tail -1
cd packages/kvarn-kernels && export PYTHONPATH=$PWD/../kvarn-math/src:$PWD/src
mkdir -p $OUT/k
for W in values keys open; do
  timeout 100 python3 -m kvarn_kernels.bench --quick --no-vllm --key-frame auto --windows $W --out $OUT/k/$W.json > $OUT/k/$W.log 2>&1
  echo "$W rc=$?"
done
KVARN_KERNELS_FAST_DECODE=0 timeout 100 python3 -m kvarn_kernels.bench --quick --no-vllm --key-frame auto --windows values --out $OUT/k/triton_values.json > $OUT/k/triton_values.log 2>&1
echo "triton values rc=$?"
for f in $OUT/k/*.log; do echo "== $f"; grep -B2 -A14 "┏\|decode" $f | grep "│\|decode" | head -24; done
