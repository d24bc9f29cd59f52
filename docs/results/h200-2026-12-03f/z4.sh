#!/bin/bash
# Twenty-seventh run, second machine (one H200): 4K bursts that fill the cache, 1024 tokens out,
# Llama-3.1-8B shape (dummy weights), 256 slots: kvarn_k4v2_g128 with the changed store, then
# the caches after it (arguments CACHE:LIMIT_SECONDS).
source "$(dirname "$0")/setup.sh"
START=$SECONDS
for arg in "$@"; do
  c=${arg%%:*}; t=${arg##*:}
  n=$(echo $c | tr '@+' '__')
  mkdir -p $OUT/$n
  timeout $t python3 -m kvarn_eval.cli bench --suites throughput --gpu-models llama-3.1-8b \
    --output-len 1024 --fill 1.0 --max-num-seqs 256 --prompt-lens 4096 \
    --caches $c --max-seconds $((t - 10)) --no-plot --out $OUT/$n > $OUT/$n/log 2>&1
  echo rc=$? >> $OUT/$n/log
  echo "$c done at $((SECONDS-START)) s"
  rm -rf $OUT/$n/runs $OUT/$n/results.md $OUT/$n/models
  grep "\[ok\]\|skipped\|failed\|Error\|rc=" $OUT/$n/log | cut -c1-200 | tail -4; grep -A5 "┏" $OUT/$n/log | cut -c1-240
done
