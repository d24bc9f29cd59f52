#!/bin/bash
# Thirty-seventh run: KV capacity of the Llama-3.1-8B shape for the caches in $CACHES (eager, 256
# slots, the 5,376-token max_model_len of the 4K bursts), kept in /tmp/$NAME on the machine so that
# a second call goes on with --resume; results come back under $OUT/$NAME.
# Usage (after setup.sh): CACHES=... NAME=... LIMIT=... bash ../.gpurun/c2.sh
D=/tmp/$NAME
mkdir -p $D $OUT/$NAME
START=$SECONDS
KVARN_VLLM_WARMUP=0 timeout $LIMIT python3 -m kvarn_eval.cli bench --suites capacity \
  --gpu-models ${MODELS:-llama-3.1-8b} --max-num-seqs 256 --prompt-lens 4096 --output-len 1024 --eager \
  --caches $CACHES --max-seconds $((LIMIT - 10)) --no-plot --resume --out $D >> $D/log 2>&1
echo rc=$? >> $D/log
echo "capacity done at $((SECONDS-START)) s"
for f in $D/runs/*/*.log; do
  [ -f "$f" ] && { echo "== $f"; grep -i "KV cache size\|init engine\|staging" "$f" | cut -c1-250 | head -8; }
done > $OUT/$NAME/engine_tail.log 2>/dev/null
cp $D/results.json $D/results.md $D/log $OUT/$NAME/ 2>/dev/null
grep "\[ok\]\|skipped\|failed\|rc=" $D/log | cut -c1-160 | tail -16
grep -A18 "^| model" $D/results.md | cut -c1-200
