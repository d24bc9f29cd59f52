#!/bin/bash
# Twenty-sixth run, call 5 (one H200): 4K bursts that fill the cache, 1024 tokens out,
# Llama-3.1-8B shape (dummy weights), 256 slots, kvarn_k4v2_g128: the default launch, then
# batch-invariant (KVARN_KERNELS_BATCH_INVARIANT=1, split length from the caller's
# KVARN_KERNELS_INVARIANT_SPLIT_TILES) -- the price of the mode that makes speculative verify rows
# agree with decode.
source "$(dirname "$0")/setup.sh"
START=$SECONDS
burst() {  # burst NAME LIMIT [ENV...]
  local n=$1 t=$2; shift 2
  mkdir -p $OUT/$n
  env "$@" timeout $t python3 -m kvarn_eval.cli bench --suites throughput --gpu-models llama-3.1-8b \
    --output-len 1024 --fill 1.0 --max-num-seqs 256 --prompt-lens 4096 \
    --caches kvarn_k4v2_g128 --max-seconds $((t - 10)) --no-plot --out $OUT/$n > $OUT/$n/log 2>&1
  echo rc=$? >> $OUT/$n/log
  echo "$n done at $((SECONDS-START)) s"
  grep -h "compiled the kernels" $OUT/$n/runs/*.log 2>/dev/null | cut -c1-250 | tail -2
  rm -rf $OUT/$n/runs $OUT/$n/results.md $OUT/$n/models
  grep "\[ok\]\|skipped\|failed\|staging\|Error\|rc=" $OUT/$n/log | cut -c1-200 | tail -5; grep -A5 "┏" $OUT/$n/log | cut -c1-240
}
burst q4 265 KVARN_KERNELS_BATCH_INVARIANT=0
burst q4bi 265 KVARN_KERNELS_BATCH_INVARIANT=1
