#!/bin/bash
# Twelfth run, call E (one H200, nothing but torch and triton): the kernel bench again after the
# store's query rows went into blocks of 16, rotated and auto.
export PYTHONPATH=$PWD/packages/kvarn-math/src:$PWD/packages/kvarn-kernels/src
mkdir -p $OUT/b
for kf in rotated auto; do
  timeout 100 python3 -m kvarn_kernels.bench --quick --no-vllm --key-frame $kf --out $OUT/b/$kf.json > $OUT/b/$kf.log 2>&1; echo rc=$? >> $OUT/b/$kf.log
  tail -12 $OUT/b/$kf.log | cut -c1-200
done
