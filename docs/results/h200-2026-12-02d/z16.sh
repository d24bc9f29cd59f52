#!/bin/bash
# Twenty-first run, call 6 (one H200): KV capacity (start-up only, eager engines, no kernel warm-up)
# on the Qwen3 shapes for every TurboQuant preset, now with the FlashAttention-2 part that vLLM
# 0.26 forces for turboquant_* caches (the twentieth run lacked it; every engine failed), 256
# slots, gpu_memory_utilization 0.9; bf16 and kvarn_k4v2_g128 were measured in the twentieth run.
source "$(dirname "$0")/setup.sh"
mkdir -p $OUT/c
KVARN_VLLM_WARMUP=0 timeout 500 python3 -m kvarn_eval.cli bench --suites capacity --eager --max-num-seqs 256 \
  --caches turboquant --gpu-models qwen3-8b,qwen3-32b \
  --max-seconds 490 --no-plot --out $OUT/c > $OUT/c/log 2>&1
echo "capacity rc=$?"
rm -rf $OUT/c/runs $OUT/c/models
grep "\[ok\]\|skipped\|failed\|rror" $OUT/c/log | cut -c1-200 | tail -14
cat $OUT/c/results.md 2>/dev/null | head -30
