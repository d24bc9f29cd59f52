#!/bin/bash
# Eleventh run (one H200): the recent window counted from the step's first new token (6e70e3d).
# 128-token chunks through vLLM (a chunk now reads the tile before its own exact): SmolLM2, then
# Gemma-3 (converted in the background meanwhile), then Gemma-3 greedy fidelity with a working tokenizer.
source "$(dirname "$0")/setup.sh"
R=$(cd ../.gpurun && pwd)
T=$R/wiki.txt
GEMMA=$KVARN_GPU_FILES/gemma-3-270m-q4_k_m.gguf
mkdir -p $OUT/p $OUT/s $OUT/g $OUT/x
START=$SECONDS
( timeout 230 python3 $R/gemma_prep.py $GEMMA $R/gemma_tok.tar.xz > $OUT/p/prep.log 2>&1; echo rc=$? >> $OUT/p/prep.log ) &
PREP=$!
timeout 175 python3 -m kvarn_eval.cli bench --suites vllm_perplexity --greedy-model $GGUF --text $T \
  --ppl-caches bf16@TRITON_ATTN,kvarn_k4v2_g128,kvarn_k2v2_g128 \
  --max-seconds 170 --no-plot --out $OUT/s > $OUT/s/log 2>&1; echo rc=$? >> $OUT/s/log
echo "smol done at $((SECONDS-START)) s" >> $OUT/times
wait $PREP
echo "prep done at $((SECONDS-START)) s" >> $OUT/times
timeout 185 python3 -m kvarn_eval.cli bench --suites vllm_perplexity --greedy-model $GEMMA --text $T --vllm-ppl-tokens 512 \
  --ppl-caches bf16@TRITON_ATTN,kvarn_k4v2_g128,kvarn_k2v2_g128 \
  --max-seconds 180 --no-plot --out $OUT/g > $OUT/g/log 2>&1; echo rc=$? >> $OUT/g/log
echo "gemma ppl done at $((SECONDS-START)) s" >> $OUT/times
LEFT=$((530 - (SECONDS - START)))
timeout $LEFT python3 -m kvarn_eval.cli bench --suites vllm_greedy --greedy-model $GEMMA \
  --greedy-caches bf16@TRITON_ATTN,kvarn_k4v2_g128,kvarn_k4v4_g128 --max-seconds $((LEFT - 5)) --no-plot --out $OUT/x > $OUT/x/log 2>&1; echo rc=$? >> $OUT/x/log
echo "greedy done at $((SECONDS-START)) s" >> $OUT/times
cat $OUT/times; tail -1 $OUT/p/prep.log | cut -c1-200
for d in s g x; do echo "== $d"; grep -A10 "┏" $OUT/$d/log | cut -c1-150; tail -2 $OUT/$d/log | cut -c1-200; done
