#!/bin/bash
# Twenty-fifth run, call 7 (one H200): the mtp phase, kvarn_k4v2_g128 (dummy MiMo target of
# SmolLM2's shape drafting with its own MTP layer, vLLM's V2 runner, CUDA graphs, prefix caching,
# 32 prompts x 128 tokens, logprobs checked finite, greedy agreement with no speculation).
source "$(dirname "$0")/setup.sh"
START=$SECONDS
ph=mtp
mkdir -p $OUT/$ph
timeout 560 python3 packages/kvarn-vllm/scripts/e2e_spec.py --phase $ph \
  --gguf $GGUF --converted-dir /tmp/smollm2-hf --dtypes kvarn_k4v2_g128 --stress-prompts 32 \
  --stress-tokens 128 --run-timeout 260 --out $OUT/$ph > $OUT/$ph.log 2>&1
echo "$ph rc=$? at $((SECONDS-START)) s"
grep "^\[\|Error" $OUT/$ph.log | cut -c1-300 | head -12
python3 ../.gpurun/spec_summary.py $OUT/$ph | cut -c1-300
for f in $OUT/$ph/runs/*.log; do echo "== $f"; grep -i "error\|Traceback" $f | tail -6; done 2>/dev/null | cut -c1-300 | head -30
rm -rf $OUT/$ph/runs/*.spec.json $OUT/$ph/runs/*.result.json $OUT/$ph/mtp-target
