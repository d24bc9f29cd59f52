#!/bin/bash
# Twentieth run, call 4 (one H200): n-gram speculation with CUDA graphs (vLLM's default mode), so
# that tokens/s measure the GPU: e2e_spec.py's agreement phase with --graphs, SmolLM2-135M real
# weights, 100 repetitive prompts behind ~580 tokens of notes, 64 greedy tokens, k = 4; bf16 and
# kvarn_k4v2_g128, each without speculation, with ngram (host drafts) and with ngram_gpu (GPU
# drafts, async scheduling; kvarn serves it from c6976e9).
source "$(dirname "$0")/setup.sh"
mkdir -p $OUT/g
START=$SECONDS
timeout 540 python3 packages/kvarn-vllm/scripts/e2e_spec.py --phase agreement --graphs --gguf $GGUF \
  --converted-dir /tmp/smollm2-hf --run-timeout 150 --dtypes auto kvarn_k4v2_g128 \
  --methods ngram ngram_gpu --out $OUT/g > $OUT/g.log 2>&1
echo "rc=$? at $((SECONDS-START)) s" >> $OUT/g.log
rm -rf $OUT/g/runs/*.spec.json
grep "^\[\|rc=" $OUT/g.log | cut -c1-200
python3 ../.gpurun/spec_summary.py $OUT/g
