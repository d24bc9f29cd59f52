#!/bin/bash
# Twenty-third run, call 6 (one H200): (1) the EAGLE stress phase with KVARN_VLLM_SPEC_FULL_GRAPHS=1
# (dummy target + dummy EAGLE draft, CUDA graphs, 32 prompts x 256 tokens, logprobs finite);
# (2) one 4K burst that fills the cache with the L2 prefetch on (default since 7cb21ae):
# Llama-3.1-8B shape, 256 slots, 1024 tokens out, kvarn_k4v2_g128.
source "$(dirname "$0")/setup.sh"
mkdir -p $OUT/e $OUT/q4
START=$SECONDS
KVARN_VLLM_SPEC_FULL_GRAPHS=1 timeout 200 python3 packages/kvarn-vllm/scripts/e2e_spec.py --phase stress \
  --gguf $GGUF --converted-dir /tmp/smollm2-hf --dtypes kvarn_k4v2_g128 --stress-prompts 32 \
  --stress-tokens 256 --run-timeout 190 --out $OUT/e > $OUT/e.log 2>&1
echo "stress rc=$? at $((SECONDS-START)) s"
python3 ../.gpurun/spec_summary.py $OUT/e
rm -rf $OUT/e/runs/*.spec.json $OUT/e/runs/*.result.json $OUT/e/eagle-draft
LEFT=$((560 - (SECONDS - START)))
timeout $LEFT python3 -m kvarn_eval.cli bench --suites throughput --gpu-models llama-3.1-8b \
  --output-len 1024 --fill 1.0 --max-num-seqs 256 --prompt-lens 4096 \
  --caches kvarn_k4v2_g128 --max-seconds $((LEFT - 5)) --no-plot --out $OUT/q4 > $OUT/q4/log 2>&1
echo "burst rc=$? at $((SECONDS-START)) s"
rm -rf $OUT/q4/runs $OUT/q4/results.md $OUT/q4/models
grep "starting (\|\[ok\]\|skipped\|failed\|Error\|error\|tokens:" $OUT/q4/log | cut -c1-200 | tail -6; grep -A5 "┏" $OUT/q4/log | cut -c1-260
