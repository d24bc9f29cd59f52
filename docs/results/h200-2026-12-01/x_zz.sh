#!/bin/bash
# Eleventh run, call C (one H200): Gemma-3 greedy fidelity, with bf16 on another attention backend
# (FLASH_ATTN) as a second noise reference beside the batch-size one.
source "$(dirname "$0")/setup.sh"
R=$(cd ../.gpurun && pwd)
GEMMA=$KVARN_GPU_FILES/gemma-3-270m-q4_k_m.gguf
mkdir -p $OUT/p $OUT/x
START=$SECONDS
timeout 200 python3 $R/gemma_prep.py $GEMMA $R/gemma_tok.tar.xz > $OUT/p/prep.log 2>&1; echo rc=$? >> $OUT/p/prep.log
LEFT=$((560 - (SECONDS - START)))
timeout $LEFT python3 -m kvarn_eval.cli bench --suites vllm_greedy --greedy-model $GEMMA \
  --greedy-caches bf16@TRITON_ATTN,bf16@FLASH_ATTN,kvarn_k4v2_g128 --max-seconds $((LEFT - 5)) --no-plot --out $OUT/x > $OUT/x/log 2>&1; echo rc=$? >> $OUT/x/log
echo "done at $((SECONDS-START)) s" >> $OUT/times
rm -rf $OUT/x/runs
cat $OUT/times; tail -1 $OUT/p/prep.log | cut -c1-200
grep "starting (\|\[ok\]\|skipped\|failed" $OUT/x/log | cut -c1-120; grep -A10 "┏" $OUT/x/log | cut -c1-170
