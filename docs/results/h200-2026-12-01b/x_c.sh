#!/bin/bash
# Twelfth run, call C (one H200): SmolLM2 perplexity with the default (auto) store beside Gemma-3
# greedy fidelity on prompts that read records (a 768-token passage before each prompt).
source "$(dirname "$0")/setup.sh"
R=$(cd ../.gpurun && pwd)
T=$R/wiki.txt
GEMMA=$KVARN_GPU_FILES/gemma-3-270m-q4_k_m.gguf
mkdir -p $OUT/p $OUT/s $OUT/x
START=$SECONDS
( timeout 400 python3 -m kvarn_eval.cli bench --suites vllm_perplexity --greedy-model $GGUF --text $T \
  --ppl-caches bf16@TRITON_ATTN,kvarn_k2v2_g128,kvarn_k4v2_g128 \
  --max-seconds 395 --no-plot --out $OUT/s > $OUT/s/log 2>&1; echo rc=$? >> $OUT/s/log; echo "smol ppl done at $((SECONDS-START)) s" >> $OUT/times ) &
SPID=$!
timeout 200 python3 $R/gemma_prep.py $GEMMA $R/gemma_tok.tar.xz > $OUT/p/prep.log 2>&1; echo rc=$? >> $OUT/p/prep.log
LEFT=$((440 - (SECONDS - START)))
timeout $LEFT python3 -m kvarn_eval.cli bench --suites vllm_greedy --greedy-model $GEMMA --text $T --vllm-greedy-context 768 \
  --greedy-caches bf16@TRITON_ATTN,kvarn_k4v2_g128,kvarn_k4v2_g128+rotated,kvarn_k2v2_g128 --noise-max-num-seqs 0 \
  --max-seconds $((LEFT - 5)) --no-plot --out $OUT/x > $OUT/x/log 2>&1; echo rc=$? >> $OUT/x/log
echo "gemma greedy done at $((SECONDS-START)) s" >> $OUT/times
wait $SPID
rm -rf $OUT/s/runs $OUT/x/runs $OUT/s/results.md $OUT/x/results.md
cat $OUT/times
for d in s x; do echo "== $d"; grep "starting (\|\[ok\]\|skipped\|failed\|need" $OUT/$d/log | cut -c1-120; grep -A10 "┏" $OUT/$d/log | cut -c1-150; done
