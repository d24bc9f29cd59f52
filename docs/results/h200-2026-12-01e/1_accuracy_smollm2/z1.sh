#!/bin/bash
# Seventeenth-session call Z1 (one H200): served accuracy with the per-preset exact-window default
# (4-bit keys: values only; 2- and 3-bit keys: keys too), SmolLM2-135M.
#   s: perplexity through vLLM, 128-token chunks, 8 x 1024 tokens of WikiText-2
#   y: greedy fidelity after a 768-token passage, 100 prompts, 64 tokens (noise row: bf16@FLASH_ATTN)
source "$(dirname "$0")/setup.sh"
R=$(cd ../.gpurun && pwd)
T=$R/wiki.txt
mkdir -p $OUT/s $OUT/y $OUT/k
START=$SECONDS
( timeout 340 python3 -m kvarn_eval.cli bench --suites vllm_greedy --greedy-model $GGUF --text $T --vllm-greedy-context 768 \
  --greedy-caches bf16@TRITON_ATTN,kvarn_k4v2_g128,kvarn_k4v2_g128+keys,kvarn_k4v4_g128,kvarn_k2v2_g128,bf16@FLASH_ATTN \
  --noise-max-num-seqs 0 --max-seconds 335 --no-plot --out $OUT/y > $OUT/y/log 2>&1; echo rc=$? >> $OUT/y/log
  echo "greedy done at $((SECONDS-START)) s" >> $OUT/times ) &
GPID=$!
timeout 360 python3 -m kvarn_eval.cli bench --suites vllm_perplexity --greedy-model $GGUF --text $T \
  --ppl-caches bf16@TRITON_ATTN,kvarn_k4v2_g128,kvarn_k2v2_g128,kvarn_k4v2_g128+keys,kvarn_k2v2_g128+values \
  --max-seconds 355 --no-plot --out $OUT/s > $OUT/s/log 2>&1; echo rc=$? >> $OUT/s/log
echo "ppl done at $((SECONDS-START)) s" >> $OUT/times
wait $GPID
rm -rf $OUT/s/runs $OUT/y/runs $OUT/s/results.md $OUT/y/results.md
cat $OUT/times
for d in s y; do echo "== $d"; grep "starting (\|\[ok\]\|skipped\|failed\|exact tiles" $OUT/$d/log | cut -c1-140; grep -A12 "┏" $OUT/$d/log | cut -c1-200; done
