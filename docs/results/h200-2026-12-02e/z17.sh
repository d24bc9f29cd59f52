#!/bin/bash
# Twenty-second run, call 5 (one H200): DFlash speculative decoding over the kvarn cache, on
# vLLM's V2 runner, for the first time on a GPU: dummy SmolLM2-shaped target + a dummy 2-layer
# DFlash drafter (e2e_spec.py dflash_draft_dir), CUDA graphs, prefix caching, 64 prompts x 256
# tokens, every sampled logprob checked finite, beside no speculation; bf16 and kvarn_k4v2_g128.
source "$(dirname "$0")/setup.sh"
mkdir -p $OUT/d
START=$SECONDS
timeout 520 python3 packages/kvarn-vllm/scripts/e2e_spec.py --phase dflash --gguf $GGUF \
  --converted-dir /tmp/smollm2-hf --dtypes kvarn_k4v2_g128 auto --stress-prompts 64 \
  --stress-tokens 256 --run-timeout 150 --out $OUT/d > $OUT/d.log 2>&1
echo "rc=$? at $((SECONDS-START)) s" >> $OUT/d.log
grep "^\[\|rc=\|Error\|error" $OUT/d.log | cut -c1-300 | head -40
python3 ../.gpurun/spec_summary.py $OUT/d
for f in $OUT/d/runs/*.log; do echo "== $f"; grep -i "error\|Traceback\|nan\|kvarn" $f | grep -v "^INFO.*kvarn_vllm\] [A-Z]" | head -15; done 2>/dev/null | cut -c1-300 | head -60
