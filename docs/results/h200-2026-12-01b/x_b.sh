#!/bin/bash
# Twelfth run, call B (one H200): the whole kernel GPU suite beside greedy fidelity on prompts that
# read records (a 1024-token passage before each prompt), auto against rotated, and Gemma-3 k2v2
# perplexity with every tile's keys rotated (+rotated) for the paired comparison.
source "$(dirname "$0")/setup.sh"
R=$(cd ../.gpurun && pwd)
T=$R/wiki.txt
GEMMA=$KVARN_GPU_FILES/gemma-3-270m-q4_k_m.gguf
mkdir -p $OUT/k $OUT/x $OUT/y $OUT/r
START=$SECONDS
(cd packages/kvarn-kernels && timeout 540 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests > $OUT/k/tests.log 2>&1; echo rc=$? >> $OUT/k/tests.log) &
KPID=$!
mkdir -p $OUT/p
timeout 200 python3 $R/gemma_prep.py $GEMMA $R/gemma_tok.tar.xz > $OUT/p/prep.log 2>&1; echo rc=$? >> $OUT/p/prep.log
echo "gemma prep done at $((SECONDS-START)) s" >> $OUT/times
timeout 200 python3 -m kvarn_eval.cli bench --suites vllm_greedy --greedy-model $GEMMA --text $T --vllm-greedy-context 1024 \
  --greedy-caches bf16@TRITON_ATTN,kvarn_k4v2_g128,kvarn_k4v2_g128+rotated,kvarn_k2v2_g128 --noise-max-num-seqs 0 \
  --max-seconds 195 --no-plot --out $OUT/x > $OUT/x/log 2>&1; echo rc=$? >> $OUT/x/log
echo "gemma greedy done at $((SECONDS-START)) s" >> $OUT/times
timeout 170 python3 -m kvarn_eval.cli bench --suites vllm_perplexity --greedy-model $GEMMA --text $T --vllm-ppl-tokens 512 \
  --ppl-caches bf16@TRITON_ATTN,kvarn_k2v2_g128+rotated \
  --max-seconds 165 --no-plot --out $OUT/r > $OUT/r/log 2>&1; echo rc=$? >> $OUT/r/log
echo "gemma rotated done at $((SECONDS-START)) s" >> $OUT/times
LEFT=$((565 - (SECONDS - START)))
timeout $LEFT python3 -m kvarn_eval.cli bench --suites vllm_greedy --greedy-model $GGUF --text $T --vllm-greedy-context 1024 \
  --greedy-caches bf16@TRITON_ATTN,kvarn_k4v2_g128,kvarn_k4v2_g128+rotated --noise-max-num-seqs 0 \
  --max-seconds $((LEFT - 5)) --no-plot --out $OUT/y > $OUT/y/log 2>&1; echo rc=$? >> $OUT/y/log
echo "smol greedy done at $((SECONDS-START)) s" >> $OUT/times
wait $KPID
echo "kernels done at $((SECONDS-START)) s" >> $OUT/times
rm -rf $OUT/x/runs $OUT/y/runs $OUT/r/runs
cat $OUT/times; tail -4 $OUT/k/tests.log
for d in x r y; do echo "== $d"; grep "starting (\|\[ok\]\|skipped\|failed" $OUT/$d/log | cut -c1-120; grep -A10 "┏" $OUT/$d/log | cut -c1-150; done
