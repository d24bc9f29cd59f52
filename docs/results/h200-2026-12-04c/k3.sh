#!/bin/bash
# Thirty-first run, call 2 (one H200): decode attention with KVARN_KERNELS_DECODE_SPLITS=batch
# (the default) and =fixed, batches that do not fill the GPU (1-32) and 64, 4K and 16K,
# kvarn_k4v2_g128 (Gluon kernel + staged Triton pass) and kvarn_k2v2_g128 (Triton kernel).
cd .snap/packages/kvarn-kernels && export PYTHONPATH=$PWD/../kvarn-math/src:$PWD/src
export KVARN_GIT_SHA=$(cat ../../GIT_SHA)
mkdir -p $OUT/k
START=$SECONDS
for MODE in batch fixed; do
  KVARN_KERNELS_DECODE_SPLITS=$MODE timeout 270 python3 -m kvarn_kernels.bench --quick --no-vllm \
    --presets kvarn_k4v2_g128 kvarn_k2v2_g128 --key-frame auto --windows values \
    --batches 1 4 16 32 64 --contexts 4096 16384 --out $OUT/k/$MODE.json > $OUT/k/$MODE.log 2>&1
  echo "$MODE rc=$? at $((SECONDS-START)) s"; grep "^| kvarn" $OUT/k/$MODE.log | sort -u | cut -d'|' -f2-7,13-14
done
