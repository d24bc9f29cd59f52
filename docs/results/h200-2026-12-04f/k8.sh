#!/bin/bash
# Thirty-fourth run, call 1: the multi-query kernel's launches on a 16-token query block (the
# shape of a prefill chunk's block at GQA 4, 64 rows; a verify step of 1 + 15 tokens), 4-bit
# keys (k4v2) and the generic path (k2v2), at four sizes (Llama-3.1-8B 16 and 64 x 16K, head_dim
# 64 and 256 at 64 x 16K). One process per preset, every launch of --sweep verify.
cd .snap/packages/kvarn-kernels && export PYTHONPATH=$PWD/../kvarn-math/src:$PWD/src
export KVARN_GIT_SHA=$(cat ../../GIT_SHA)
mkdir -p $OUT/k
START=$SECONDS
for P in ${PRESETS:-kvarn_k4v2_g128 kvarn_k2v2_g128}; do
  timeout ${LIMIT:-230} python3 -m kvarn_kernels.bench --quick --no-vllm --skip-grid --sweep verify \
    --verify 15 --presets $P --key-frame auto --windows values \
    --out $OUT/k/mq_$P.json > $OUT/k/mq_$P.log 2>&1
  echo "$P rc=$? at $((SECONDS-START)) s"
  grep "^| kvarn" $OUT/k/mq_$P.log
done
