#!/bin/bash
# Twelfth run, call D (one H200): the noise rows of greedy fidelity on prompts that read records
# (bf16 on FLASH_ATTN against TRITON_ATTN), Gemma-3 beside SmolLM2 (with its k4v2), 768-token passages.
source "$(dirname "$0")/setup.sh"
R=$(cd ../.gpurun && pwd)
T=$R/wiki.txt
GEMMA=$KVARN_GPU_FILES/gemma-3-270m-q4_k_m.gguf
mkdir -p $OUT/x $OUT/y
START=$SECONDS
( timeout 300 python3 -m kvarn_eval.cli bench --suites vllm_greedy --greedy-model $GEMMA --text $T --vllm-greedy-context 768 \
  --greedy-caches bf16@TRITON_ATTN,bf16@FLASH_ATTN --noise-max-num-seqs 0 \
  --max-seconds 295 --no-plot --out $OUT/x > $OUT/x/log 2>&1; echo rc=$? >> $OUT/x/log; echo "gemma done at $((SECONDS-START)) s" >> $OUT/times ) &
GPID=$!
timeout 300 python3 -m kvarn_eval.cli bench --suites vllm_greedy --greedy-model $GGUF --text $T --vllm-greedy-context 768 \
  --greedy-caches bf16@TRITON_ATTN,kvarn_k4v2_g128,bf16@FLASH_ATTN --noise-max-num-seqs 0 \
  --max-seconds 295 --no-plot --out $OUT/y > $OUT/y/log 2>&1; echo rc=$? >> $OUT/y/log
echo "smol done at $((SECONDS-START)) s" >> $OUT/times
wait $GPID
rm -rf $OUT/x/runs $OUT/y/runs $OUT/x/results.md $OUT/y/results.md
cat $OUT/times
for d in x y; do echo "== $d"; grep "starting (\|\[ok\]\|skipped\|failed\|need" $OUT/$d/log | cut -c1-120; grep -A10 "┏" $OUT/$d/log | cut -c1-150; done
