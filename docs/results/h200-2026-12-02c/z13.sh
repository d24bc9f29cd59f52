#!/bin/bash
# Twentieth run, call 5 (one H200): call 4 ran out of time after kvarn_k4v2_g128/none (CUDA-graph
# engines take ~100 s to start): kvarn_k4v2_g128 again without speculation, with ngram and with
# ngram_gpu; then vLLM's fp8 cache, without speculation and with ngram, as the reference for what
# quantizing the cache does to agreement between serving modes (same settings as call 4).
source "$(dirname "$0")/setup.sh"
mkdir -p $OUT/k $OUT/f
START=$SECONDS
timeout 350 python3 packages/kvarn-vllm/scripts/e2e_spec.py --phase agreement --graphs --gguf $GGUF \
  --converted-dir /tmp/smollm2-hf --run-timeout 150 --dtypes kvarn_k4v2_g128 \
  --methods ngram ngram_gpu --out $OUT/k > $OUT/k.log 2>&1
echo "k4v2 rc=$? at $((SECONDS-START)) s" >> $OUT/k.log
LEFT=$((560 - (SECONDS - START)))
timeout $LEFT python3 packages/kvarn-vllm/scripts/e2e_spec.py --phase agreement --graphs --gguf $GGUF \
  --converted-dir /tmp/smollm2-hf --run-timeout 120 --dtypes fp8 --methods ngram --out $OUT/f > $OUT/f.log 2>&1
echo "fp8 rc=$? at $((SECONDS-START)) s" >> $OUT/f.log
for d in k f; do
  rm -rf $OUT/$d/runs/*.spec.json $OUT/$d/runs/*.result.json
  grep "^\[\|rc=" $OUT/$d.log | cut -c1-200
  python3 ../.gpurun/spec_summary.py $OUT/$d
done
