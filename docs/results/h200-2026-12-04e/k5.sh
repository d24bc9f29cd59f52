#!/bin/bash
# Next run: the cost of KVARN_VLLM_VERIFY_AS_DECODE=1 at long contexts (a verify step of 1 + 4
# tokens per sequence through the multi-query kernel with its own K/V, and as decode rows) and how
# far apart the two launches' outputs are, Llama-3.1-8B shape, k4v2 (Gluon decode) and k2v2 (Triton).
cd .snap/packages/kvarn-kernels && export PYTHONPATH=$PWD/../kvarn-math/src:$PWD/src
export KVARN_GIT_SHA=$(cat ../../GIT_SHA)
mkdir -p $OUT/k
START=$SECONDS
timeout ${BLIM:-400} python3 -m kvarn_kernels.bench --quick --no-vllm --presets kvarn_k4v2_g128 \
  kvarn_k2v2_g128 --key-frame auto --windows values --verify 4 --batches 16 64 \
  --contexts 4096 16384 --out $OUT/k/verify.json > $OUT/k/verify.log 2>&1
echo "bench rc=$? at $((SECONDS-START)) s"; grep -A8 "Speculative verify step" $OUT/k/verify.log
