#!/bin/bash
# Twenty-first run, call 5 (one H200): n-gram speculation with CUDA graphs for kvarn_k4v2_g128 with
# both runs (no speculation, ngram) in batch-invariant mode (KVARN_KERNELS_BATCH_INVARIANT=1; since
# 8cc64b3 the Gluon kernel serves it and verify blocks run as decode rows); SmolLM2-135M real
# weights, 100 repetitive prompts behind ~580 tokens of notes, 64 greedy tokens, k = 4 (the
# twentieth run's settings, where the default launch agreed on 91.9% and bf16 on 96.8%).
source "$(dirname "$0")/setup.sh"
mkdir -p $OUT/i
START=$SECONDS
KVARN_KERNELS_BATCH_INVARIANT=1 timeout 540 python3 packages/kvarn-vllm/scripts/e2e_spec.py --phase agreement \
  --graphs --gguf $GGUF --converted-dir /tmp/smollm2-hf --run-timeout 170 --dtypes kvarn_k4v2_g128 kvarn_k4v4_g128 \
  --methods ngram --out $OUT/i > $OUT/i.log 2>&1
echo "rc=$? at $((SECONDS-START)) s" >> $OUT/i.log
rm -rf $OUT/i/runs/*.spec.json $OUT/i/runs/*.result.json
grep "^\[\|rc=" $OUT/i.log | cut -c1-200
python3 ../.gpurun/spec_summary.py $OUT/i
