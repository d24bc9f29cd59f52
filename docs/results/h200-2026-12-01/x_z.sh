#!/bin/bash
# Eleventh run, call B (one H200): the whole kernel GPU suite in the background; SmolLM2 with 128-token
# chunks (k4v2, k2v2), then Gemma-3 k2v2 with the window and without (+recent0).
source "$(dirname "$0")/setup.sh"
R=$(cd ../.gpurun && pwd)
T=$R/wiki.txt
GEMMA=$KVARN_GPU_FILES/gemma-3-270m-q4_k_m.gguf
mkdir -p $OUT/p $OUT/s $OUT/g $OUT/k
START=$SECONDS
(cd packages/kvarn-kernels && timeout 500 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests > $OUT/k/tests.log 2>&1; echo rc=$? >> $OUT/k/tests.log) &
KPID=$!
( timeout 230 python3 $R/gemma_prep.py $GEMMA $R/gemma_tok.tar.xz > $OUT/p/prep.log 2>&1; echo rc=$? >> $OUT/p/prep.log ) &
PREP=$!
timeout 255 python3 -m kvarn_eval.cli bench --suites vllm_perplexity --greedy-model $GGUF --text $T \
  --ppl-caches bf16@TRITON_ATTN,kvarn_k4v2_g128,kvarn_k2v2_g128 \
  --max-seconds 250 --no-plot --out $OUT/s > $OUT/s/log 2>&1; echo rc=$? >> $OUT/s/log
echo "smol done at $((SECONDS-START)) s" >> $OUT/times
wait $PREP
LEFT=$((545 - (SECONDS - START)))
timeout $LEFT python3 -m kvarn_eval.cli bench --suites vllm_perplexity --greedy-model $GEMMA --text $T --vllm-ppl-tokens 512 \
  --ppl-caches bf16@TRITON_ATTN,kvarn_k2v2_g128,kvarn_k2v2_g128+recent0 \
  --max-seconds $((LEFT - 5)) --no-plot --out $OUT/g > $OUT/g/log 2>&1; echo rc=$? >> $OUT/g/log
echo "gemma ppl done at $((SECONDS-START)) s" >> $OUT/times
wait $KPID
echo "kernels done at $((SECONDS-START)) s" >> $OUT/times
rm -rf $OUT/s/runs $OUT/g/runs
cat $OUT/times; tail -1 $OUT/p/prep.log | cut -c1-200; tail -4 $OUT/k/tests.log
for d in s g; do echo "== $d"; grep "starting (\|\[ok\]\|skipped\|failed" $OUT/$d/log | cut -c1-120; grep -A10 "┏" $OUT/$d/log | cut -c1-150; done
