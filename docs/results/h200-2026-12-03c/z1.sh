#!/bin/bash
# Twenty-fifth run, call 5 (one H200): a 32K burst that fills the cache, 1024 tokens out,
# Llama-3.1-8B shape (dummy weights), 256 slots, kvarn_k4v2_g128 (default settings).
source "$(dirname "$0")/setup.sh"
mkdir -p $OUT/q32
START=$SECONDS
timeout 560 python3 -m kvarn_eval.cli bench --suites throughput --gpu-models llama-3.1-8b \
  --output-len 1024 --fill 1.0 --max-num-seqs 256 --prompt-lens 32768 \
  --caches kvarn_k4v2_g128 --max-seconds 550 --no-plot --out $OUT/q32 > $OUT/q32/log 2>&1
echo rc=$? >> $OUT/q32/log
echo "kvarn 32K done at $((SECONDS-START)) s"
rm -rf $OUT/q32/runs $OUT/q32/results.md $OUT/q32/models
grep "starting (\|\[ok\]\|skipped\|failed\|staging\|Error\|error\|tokens:\|rc=" $OUT/q32/log | cut -c1-200 | tail -8; grep -A8 "┏" $OUT/q32/log | cut -c1-240
