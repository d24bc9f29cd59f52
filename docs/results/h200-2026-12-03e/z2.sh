#!/bin/bash
# Twenty-seventh run (one H200): EAGLE stress (dummy SmolLM2-shaped target + dummy one-layer EAGLE
# draft, CUDA graphs, prefix caching, 32 prompts x 256 tokens, logprobs checked finite) on the
# presets of the argument list (kvarn_k4v4_g64, the last preset without a speculative GPU run).
source "$(dirname "$0")/setup.sh"
START=$SECONDS
run() {  # run DTYPE LIMIT
  local d=$1 t=$2
  mkdir -p $OUT/$d
  timeout $t python3 packages/kvarn-vllm/scripts/e2e_spec.py --phase stress \
    --gguf $GGUF --converted-dir /tmp/smollm2-hf --dtypes $d --stress-prompts 32 \
    --stress-tokens 256 --run-timeout $((t - 10)) --out $OUT/$d > $OUT/$d.log 2>&1
  echo "$d rc=$? at $((SECONDS-START)) s (limit $t)"
  python3 ../.gpurun/spec_summary.py $OUT/$d | cut -c1-250 | grep -v "^complete\|^spec_"
  grep -h "Error\|Traceback" $OUT/$d/runs/*.log | cut -c1-220 | tail -3
  grep -h "compiled the kernels" $OUT/$d/runs/*.log | cut -c1-220 | tail -2
  pkill -f "internal-run" ; sleep 2
  rm -rf $OUT/$d/runs/*.spec.json $OUT/$d/runs/*.result.json $OUT/$d/eagle-draft
}
for d in "$@"; do run $d ${LIMIT:-180}; done
