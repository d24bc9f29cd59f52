#!/bin/bash
# Twenty-fifth run, call 6 (one H200): (1) the 32K burst for bf16 on FlashAttention-3 (same
# command as call 5's kvarn burst); (2) the eagle3 phase, kvarn_k4v2_g128 (dummy SmolLM2-shaped
# target + dummy one-layer EAGLE-3 draft, CUDA graphs, prefix caching, 32 prompts x 128 tokens,
# logprobs checked finite, greedy agreement with no speculation).
source "$(dirname "$0")/setup.sh"
mkdir -p $OUT/b32 $OUT/eagle3
START=$SECONDS
timeout 250 python3 -m kvarn_eval.cli bench --suites throughput --gpu-models llama-3.1-8b \
  --output-len 1024 --fill 1.0 --max-num-seqs 256 --prompt-lens 32768 \
  --caches bf16@FLASH_ATTN --max-seconds 245 --no-plot --out $OUT/b32 > $OUT/b32/log 2>&1
echo rc=$? >> $OUT/b32/log
echo "bf16 32K done at $((SECONDS-START)) s"
rm -rf $OUT/b32/runs $OUT/b32/results.md $OUT/b32/models
grep "starting (\|\[ok\]\|skipped\|failed\|Error\|error\|tokens:\|rc=" $OUT/b32/log | cut -c1-200 | tail -8; grep -A8 "┏" $OUT/b32/log | cut -c1-240
pkill -f "kvarn_eval" ; sleep 2
LEFT=$((575 - (SECONDS - START)))
timeout $LEFT python3 packages/kvarn-vllm/scripts/e2e_spec.py --phase eagle3 \
  --gguf $GGUF --converted-dir /tmp/smollm2-hf --dtypes kvarn_k4v2_g128 --stress-prompts 32 \
  --stress-tokens 128 --run-timeout $(( (LEFT - 20) / 2 )) --out $OUT/eagle3 > $OUT/eagle3.log 2>&1
echo "eagle3 rc=$? at $((SECONDS-START)) s"
grep "^\[\|Error" $OUT/eagle3.log | cut -c1-300 | head -12
python3 ../.gpurun/spec_summary.py $OUT/eagle3 | cut -c1-300
for f in $OUT/eagle3/runs/*.log; do echo "== $f"; grep -i "error\|Traceback" $f | tail -6; done 2>/dev/null | cut -c1-300 | head -30
rm -rf $OUT/eagle3/runs/*.spec.json $OUT/eagle3/runs/*.result.json $OUT/eagle3/eagle3-draft
