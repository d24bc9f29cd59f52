#!/bin/bash
# Nineteenth run, call 8 (one H200): bf16 on FlashAttention-3, then kvarn_k4v2_g128 again: the 4K
# burst of call 7 (256 slots, 1024 tokens out), so the ratio has its bf16 in the same session
# and the kvarn number a second measurement.
source "$(dirname "$0")/setup.sh"
START=$SECONDS
mkdir -p $OUT/b $OUT/q4
timeout 140 python3 -m kvarn_eval.cli bench --suites throughput --gpu-models llama-3.1-8b \
  --output-len 1024 --fill 1.0 --max-num-seqs 256 --prompt-lens 4096 \
  --caches bf16@FLASH_ATTN --max-seconds 135 --no-plot --out $OUT/b > $OUT/b/log 2>&1
echo "bf16 rc=$? at $((SECONDS-START)) s"
LEFT=$((310 - (SECONDS - START)))
timeout $LEFT python3 -m kvarn_eval.cli bench --suites throughput --gpu-models llama-3.1-8b \
  --output-len 1024 --fill 1.0 --max-num-seqs 256 --prompt-lens 4096 \
  --caches kvarn_k4v2_g128 --max-seconds $((LEFT - 5)) --no-plot --out $OUT/q4 > $OUT/q4/log 2>&1
echo "kvarn rc=$? at $((SECONDS-START)) s"
for d in b q4; do rm -rf $OUT/$d/runs $OUT/$d/results.md $OUT/$d/models; echo "== $d"; grep "tokens:\|\[ok\]\|failed\|rror" $OUT/$d/log | cut -c1-200 | tail -4; grep -A5 "┏" $OUT/$d/log | tail -1 | cut -c1-260; done
