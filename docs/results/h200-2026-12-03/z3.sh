#!/bin/bash
# Twenty-third run, call 7 (one H200): n-gram with CUDA graphs and KVARN_VLLM_SPEC_FULL_GRAPHS=1 in
# the default (not batch-invariant) launch: agreement with no speculation and tokens/s for
# kvarn_k4v2_g128 (SmolLM2-135M real weights, 100 repetitive prompts behind ~580 tokens, 64 greedy
# tokens, k = 4, each engine warmed up first).
source "$(dirname "$0")/setup.sh"
mkdir -p $OUT/n
START=$SECONDS
KVARN_VLLM_SPEC_FULL_GRAPHS=1 timeout 540 python3 packages/kvarn-vllm/scripts/e2e_spec.py --phase agreement \
  --graphs --gguf $GGUF --converted-dir /tmp/smollm2-hf --run-timeout 200 --dtypes kvarn_k4v2_g128 \
  --methods ngram --out $OUT/n > $OUT/n.log 2>&1
echo "rc=$? at $((SECONDS-START)) s" >> $OUT/n.log
rm -rf $OUT/n/runs/*.spec.json $OUT/n/runs/*.result.json
grep "^\[\|rc=" $OUT/n.log | cut -c1-200
python3 ../.gpurun/spec_summary.py $OUT/n
grep -h "JIT compilation during inference\|captured\|Graph capturing finished" $OUT/n/runs/*.log | cut -c1-200 | head
