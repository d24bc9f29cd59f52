#!/bin/bash
# Twenty-seventh run (one H200): n-gram in the default launch with split_batch (decode and
# multi-query calls size their split-K layout for the step's request count, rounded up to a power
# of two) and KVARN_VLLM_VERIFY_AS_DECODE=1: agreement with no speculation and tokens/s,
# kvarn_k4v2_g128, SmolLM2-135M real weights, 100 repetitive prompts behind ~580 tokens,
# 64 greedy tokens, k = 4, CUDA graphs, each engine warmed up.
source "$(dirname "$0")/setup.sh"
mkdir -p $OUT/n
START=$SECONDS
KVARN_VLLM_VERIFY_AS_DECODE=${VAD:-1} timeout ${LIMIT:-560} python3 packages/kvarn-vllm/scripts/e2e_spec.py --phase agreement \
  --graphs --gguf $GGUF --converted-dir /tmp/smollm2-hf --run-timeout 250 --dtypes kvarn_k4v2_g128 \
  --methods ngram --out $OUT/n > $OUT/n.log 2>&1
echo "rc=$? at $((SECONDS-START)) s" >> $OUT/n.log
rm -rf $OUT/n/runs/*.spec.json $OUT/n/runs/*.result.json
grep "^\[\|rc=" $OUT/n.log | cut -c1-200
python3 ../.gpurun/spec_summary.py $OUT/n | cut -c1-300
grep -h "JIT compilation during inference\|FULL)\|Graph capturing finished\|compiled the kernels" $OUT/n/runs/*.log | cut -c1-200 | tail -6
