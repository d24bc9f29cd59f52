#!/bin/bash
# Eighteenth run, call 2 (one H200): installs the vllm-c part, then times decode attention with the
# values-only exact windows' key steps scored by nibble halves (_window_step_phased), kernel
# bench, Llama-3.1-8B shape, key frames per tile.
bash .gpu/vllm-c/install.sh | tail -1
cd packages/kvarn-kernels && export PYTHONPATH=$PWD/../kvarn-math/src:$PWD/src
mkdir -p $OUT/k
for W in values keys; do
  timeout 100 python3 -m kvarn_kernels.bench --quick --no-vllm --key-frame auto --windows $W --out $OUT/k/$W.json > $OUT/k/$W.log 2>&1
  echo "$W rc=$?"
done
for f in $OUT/k/*.log; do echo "== $f"; grep "^| kvarn" $f | sort -u | cut -d'|' -f4-6,13-14; done
