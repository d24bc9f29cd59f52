#!/bin/bash
# Eighteenth run, call 5 (one H200): 4K bursts that fill each cache, 1024 tokens out,
# Llama-3.1-8B shape: kvarn_k4v2_g128 with its defaults (values-only exact windows), then bf16 on
# FlashAttention-3 in the same run.
source "$(dirname "$0")/setup.sh"
mkdir -p $OUT/q4 $OUT/b
START=$SECONDS
timeout 300 python3 -m kvarn_eval.cli bench --suites throughput --gpu-models llama-3.1-8b \
  --output-len 1024 --fill 1.0 --max-num-seqs 256 --prompt-lens 4096 \
  --caches kvarn_k4v2_g128 --max-seconds 295 --no-plot --out $OUT/q4 > $OUT/q4/log 2>&1
echo rc=$? >> $OUT/q4/log
echo "kvarn 4K done at $((SECONDS-START)) s"
LEFT=$((560 - (SECONDS - START)))
timeout $LEFT python3 -m kvarn_eval.cli bench --suites throughput --gpu-models llama-3.1-8b \
  --output-len 1024 --fill 1.0 --max-num-seqs 256 --prompt-lens 4096 \
  --caches bf16@FLASH_ATTN --max-seconds $((LEFT - 5)) --no-plot --out $OUT/b > $OUT/b/log 2>&1
echo rc=$? >> $OUT/b/log
echo "bf16 4K done at $((SECONDS-START)) s"
for d in q4 b; do rm -rf $OUT/$d/runs $OUT/$d/results.md $OUT/$d/models; echo "== $d"; grep "starting (\|\[ok\]\|skipped\|failed\|staging\|exact tiles\|Error\|error" $OUT/$d/log | cut -c1-200 | tail -8; grep -A8 "┏" $OUT/$d/log | cut -c1-220; done
