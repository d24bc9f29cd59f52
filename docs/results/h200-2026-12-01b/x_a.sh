#!/bin/bash
# Twelfth run, call A (one H200): the key frame chosen per tile from the queries (format 3).
# Kernel benches on the quiet GPU (store and decode, rotated vs auto), Gemma-3 converted meanwhile;
# then 128-token-chunk perplexity through vLLM on SmolLM2 and Gemma-3 with the default (auto) store.
source "$(dirname "$0")/setup.sh"
R=$(cd ../.gpurun && pwd)
T=$R/wiki.txt
GEMMA=$KVARN_GPU_FILES/gemma-3-270m-q4_k_m.gguf
mkdir -p $OUT/p $OUT/b $OUT/s $OUT/g
START=$SECONDS
( timeout 200 python3 $R/gemma_prep.py $GEMMA $R/gemma_tok.tar.xz > $OUT/p/prep.log 2>&1; echo rc=$? >> $OUT/p/prep.log ) &
PREP=$!
for kf in rotated auto; do
  timeout 100 python3 -m kvarn_kernels.bench --quick --no-vllm --key-frame $kf --out $OUT/b/$kf.json > $OUT/b/$kf.log 2>&1; echo rc=$? >> $OUT/b/$kf.log
  echo "bench $kf done at $((SECONDS-START)) s" >> $OUT/times
done
timeout 170 python3 -m kvarn_eval.cli bench --suites vllm_perplexity --greedy-model $GGUF --text $T \
  --ppl-caches bf16@TRITON_ATTN,kvarn_k2v2_g128,kvarn_k4v2_g128 \
  --max-seconds 165 --no-plot --out $OUT/s > $OUT/s/log 2>&1; echo rc=$? >> $OUT/s/log
echo "smol done at $((SECONDS-START)) s" >> $OUT/times
wait $PREP
LEFT=$((560 - (SECONDS - START)))
timeout $LEFT python3 -m kvarn_eval.cli bench --suites vllm_perplexity --greedy-model $GEMMA --text $T --vllm-ppl-tokens 512 \
  --ppl-caches bf16@TRITON_ATTN,kvarn_k2v2_g128,kvarn_k4v2_g128 \
  --max-seconds $((LEFT - 5)) --no-plot --out $OUT/g > $OUT/g/log 2>&1; echo rc=$? >> $OUT/g/log
echo "gemma done at $((SECONDS-START)) s" >> $OUT/times
rm -rf $OUT/s/runs $OUT/g/runs
cat $OUT/times; tail -1 $OUT/p/prep.log | cut -c1-200
for kf in rotated auto; do echo "== bench $kf"; tail -12 $OUT/b/$kf.log | cut -c1-200; done
for d in s g; do echo "== $d"; grep "starting (\|\[ok\]\|skipped\|failed" $OUT/$d/log | cut -c1-120; grep -A10 "┏" $OUT/$d/log | cut -c1-150; done
