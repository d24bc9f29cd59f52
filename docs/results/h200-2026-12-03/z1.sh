#!/bin/bash
# Twenty-third run, call 5 (one H200): DFlash over the kvarn cache with KVARN_VLLM_SPEC_FULL_GRAPHS=1
# (full CUDA graphs for uniform verify batches, opt-in since 2026-12-02): dummy SmolLM2-shaped
# target + dummy 2-layer DFlash drafter, prefix caching, 32 prompts x 256 tokens, logprobs
# checked finite, beside no speculation; kvarn_k4v2_g128 (bf16 was measured in the twenty-second run).
source "$(dirname "$0")/setup.sh"
mkdir -p $OUT/d
START=$SECONDS
KVARN_VLLM_SPEC_FULL_GRAPHS=1 timeout 470 python3 packages/kvarn-vllm/scripts/e2e_spec.py --phase dflash \
  --gguf $GGUF --converted-dir /tmp/smollm2-hf --dtypes kvarn_k4v2_g128 --stress-prompts 32 \
  --stress-tokens 256 --run-timeout 220 --out $OUT/d > $OUT/d.log 2>&1
echo "rc=$? at $((SECONDS-START)) s" >> $OUT/d.log
grep "^\[\|rc=\|Error\|error" $OUT/d.log | cut -c1-300 | head -30
python3 ../.gpurun/spec_summary.py $OUT/d
for f in $OUT/d/runs/*.log; do echo "== $f"; grep -i "error\|Traceback\|nan\|cudagraph\|CUDAGraphMode\|kvarn" $f | grep -v "^INFO.*kvarn_vllm\] [A-Z]" | head -15; done 2>/dev/null | cut -c1-300 | head -50
rm -rf $OUT/d/runs/*.spec.json $OUT/d/runs/*.result.json $OUT/d/dflash-draft
