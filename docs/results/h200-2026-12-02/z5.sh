#!/bin/bash
# Eighteenth run, call 9 (one H200): 4K bursts that fill the cache, 1024 tokens out, Llama-3.1-8B
# shape, kvarn_k4v2_g128 with its defaults (values-only exact windows), with the staged pass at
# num_stages=1: first at 256 request slots (as every earlier 4K burst), then at 512, where the
# kvarn burst is not capped by the slots (bf16 4K: call 5 of this run, 17,674 tok/s).
source "$(dirname "$0")/setup.sh"
mkdir -p $OUT/q4 $OUT/q4s512
START=$SECONDS
timeout 250 python3 -m kvarn_eval.cli bench --suites throughput --gpu-models llama-3.1-8b \
  --output-len 1024 --fill 1.0 --max-num-seqs 256 --prompt-lens 4096 \
  --caches kvarn_k4v2_g128 --max-seconds 245 --no-plot --out $OUT/q4 > $OUT/q4/log 2>&1
echo rc=$? >> $OUT/q4/log
echo "kvarn 4K (256 slots) done at $((SECONDS-START)) s"
LEFT=$((555 - (SECONDS - START)))
timeout $LEFT python3 -m kvarn_eval.cli bench --suites throughput --gpu-models llama-3.1-8b \
  --output-len 1024 --fill 1.0 --max-num-seqs 512 --prompt-lens 4096 \
  --caches kvarn_k4v2_g128 --max-seconds $((LEFT - 5)) --no-plot --out $OUT/q4s512 > $OUT/q4s512/log 2>&1
echo rc=$? >> $OUT/q4s512/log
echo "kvarn 4K (512 slots) done at $((SECONDS-START)) s"
for d in q4 q4s512; do rm -rf $OUT/$d/runs $OUT/$d/results.md $OUT/$d/models; echo "== $d"; grep "starting (\|\[ok\]\|skipped\|failed\|staging\|exact tiles\|Error\|error\|tokens:" $OUT/$d/log | cut -c1-200 | tail -8; grep -A5 "┏" $OUT/$d/log | cut -c1-220; done
