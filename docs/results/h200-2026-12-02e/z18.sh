#!/bin/bash
# Twenty-second run, call 6 (one H200): n-gram speculation with CUDA graphs, both runs (no
# speculation, ngram) batch-invariant (KVARN_KERNELS_BATCH_INVARIANT=1), now with each engine's
# warm-up (16 prompts, two waves) and the key_lens alignment fix (7bdaa63): agreement and
# tokens/s for kvarn_k4v2_g128 beside bf16 (bf16 ignores the variable); SmolLM2-135M real
# weights, 100 repetitive prompts behind ~580 tokens of notes, 64 greedy tokens, k = 4.
source "$(dirname "$0")/setup.sh"
mkdir -p $OUT/i
START=$SECONDS
KVARN_KERNELS_BATCH_INVARIANT=1 timeout 560 python3 packages/kvarn-vllm/scripts/e2e_spec.py --phase agreement \
  --graphs --gguf $GGUF --converted-dir /tmp/smollm2-hf --run-timeout 150 --dtypes kvarn_k4v2_g128 auto \
  --methods ngram --out $OUT/i > $OUT/i.log 2>&1
echo "rc=$? at $((SECONDS-START)) s" >> $OUT/i.log
rm -rf $OUT/i/runs/*.spec.json $OUT/i/runs/*.result.json
grep "^\[\|rc=" $OUT/i.log | cut -c1-200
python3 ../.gpurun/spec_summary.py $OUT/i
grep -h "JIT compilation during inference" $OUT/i/runs/*.log | cut -c1-200 | head
