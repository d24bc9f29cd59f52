#!/bin/bash
# Twenty-fifth run, call 8 (one H200): the EAGLE stress phase (dummy SmolLM2-shaped target + dummy
# one-layer EAGLE draft, CUDA graphs with full graphs for verify batches, prefix caching, 32 prompts
# x 256 tokens, logprobs checked finite) with the drafter planner in Triton (new in 820ac8c), for
# kvarn_k4v2_g128, then the presets no speculative run had covered: kvarn_k2v2_g128,
# kvarn_k4v2_g64.
source "$(dirname "$0")/setup.sh"
START=$SECONDS
run() {  # run DTYPE LEFT_RUNS
  local d=$1 t=$(( (440 - (SECONDS - START)) / $2 ))
  mkdir -p $OUT/$d
  timeout $t python3 packages/kvarn-vllm/scripts/e2e_spec.py --phase stress \
    --gguf $GGUF --converted-dir /tmp/smollm2-hf --dtypes $d --stress-prompts 32 \
    --stress-tokens 256 --run-timeout $((t - 10)) --out $OUT/$d > $OUT/$d.log 2>&1
  echo "$d rc=$? at $((SECONDS-START)) s (limit $t)"
  python3 ../.gpurun/spec_summary.py $OUT/$d | cut -c1-250 | grep -v "^complete\|^spec_"
  grep -h "Error\|Traceback" $OUT/$d/runs/*.log | cut -c1-220 | tail -3
  pkill -f "internal-run" ; sleep 2
  rm -rf $OUT/$d/runs/*.spec.json $OUT/$d/runs/*.result.json $OUT/$d/eagle-draft $OUT/$d.log $OUT/$d/runs/*.log
}
run kvarn_k4v2_g128 3
run kvarn_k2v2_g128 2
run kvarn_k4v2_g64 1
