#!/bin/bash
# Twentieth run, call 6 (one H200): KV capacity (start-up only, eager engines, no kernel warm-up) on
# the Qwen3 shapes for bf16, every TurboQuant preset and kvarn_k4v2_g128 (values-only windows, the
# default since the fourteenth run), 256 slots, gpu_memory_utilization 0.9.
source "$(dirname "$0")/setup.sh"
mkdir -p $OUT/c
KVARN_VLLM_WARMUP=0 timeout 450 python3 -m kvarn_eval.cli bench --suites capacity --eager --max-num-seqs 256 \
  --caches bf16@FLASH_ATTN,turboquant,kvarn_k4v2_g128 --gpu-models qwen3-8b,qwen3-32b \
  --max-seconds 440 --no-plot --out $OUT/c > $OUT/c/log 2>&1
echo "capacity rc=$?"
rm -rf $OUT/c/runs $OUT/c/models
grep "\[ok\]\|skipped\|failed\|rror" $OUT/c/log | cut -c1-200 | tail -14
cat $OUT/c/results.md 2>/dev/null | head -30
