#!/bin/bash
# Twenty-ninth run (one H200): 4K bursts that fill the cache, 1024 tokens out,
# Llama-3.1-8B shape (dummy weights), 256 slots, one engine per cache in turn
# (arguments CACHE:LIMIT_SECONDS).
source "$(dirname "$0")/setup.sh"
# threads for the kernel warm-up if call 1 showed the threaded warm-up compiles the same variants
[ -f /tmp/kvarn-threads-ok ] && export KVARN_KERNELS_WARMUP_THREADS=4
echo "KVARN_KERNELS_WARMUP_THREADS=${KVARN_KERNELS_WARMUP_THREADS:-unset}"
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
  rm -rf $OUT/$n/results.md $OUT/$n/models $OUT/$n/runs/*.json; for f in $OUT/$n/runs/*/*.log $OUT/$n/runs/*.log; do [ -f "$f" ] && { grep -i "init engine\|Graph capturing\|kvarn.*warm\|compilation\|KV cache size\|Model loading took\|took .* s" "$f" | cut -c1-250 | head -30; tail -c 1500 "$f"; }; done > $OUT/$n/engine_tail.log 2>/dev/null; rm -rf $OUT/$n/runs
  grep "\[ok\]\|skipped\|failed\|Error\|rc=" $OUT/$n/log | cut -c1-200 | tail -4; grep -A5 "┏" $OUT/$n/log | cut -c1-240
done
