#!/bin/bash
# Thirty-third run, call 1: the multi-query kernel's launch for kvarn_k4v2_g128 verify blocks
# (5 tokens per sequence, batch 64, 16K context, Llama-3.1-8B shape): the default (SUB 64,
# 8 warps) against fixed launches through KVARN_KERNELS_ATTN_LAUNCH (which also sets the
# decode path's Triton part; the Gluon part is unchanged).
cd .snap/packages/kvarn-kernels && export PYTHONPATH=$PWD/../kvarn-math/src:$PWD/src
export KVARN_GIT_SHA=$(cat ../../GIT_SHA)
mkdir -p $OUT/k
START=$SECONDS
for L in default "SUB=128,num_warps=4" "SUB=64,num_warps=4" "SUB=32,num_warps=4"; do
  n=$(echo "$L" | tr ',=' '_-')
  if [ "$L" = default ]; then unset KVARN_KERNELS_ATTN_LAUNCH; else export KVARN_KERNELS_ATTN_LAUNCH="$L"; fi
  timeout 90 python3 -m kvarn_kernels.bench --quick --no-vllm --presets kvarn_k4v2_g128 \
    --key-frame auto --windows values --verify 4 --batches 64 --contexts 16384 \
    --out $OUT/k/launch_$n.json > $OUT/k/launch_$n.log 2>&1
  echo "$L rc=$? at $((SECONDS-START)) s"; grep "| kvarn_k" $OUT/k/launch_$n.log | tail -2
done
