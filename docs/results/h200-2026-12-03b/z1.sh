#!/bin/bash
# Twenty-fourth run, call 5 (one H200): the EAGLE stress phase (dummy SmolLM2-shaped target +
# dummy one-layer EAGLE draft, CUDA graphs with full graphs for uniform verify batches (the
# default), prefix caching, 32 prompts x 256 tokens, 16 at a time, logprobs checked finite),
# kvarn_k4v2_g128: (a) with the Triton store planner (two launches per plan), (b) with the torch
# planner (KVARN_KERNELS_TORCH_PLANNER=1, about 80 operations per plan, as before), (c) (a) again
# under vLLM's torch profiler for 20 engine steps after 50: where a speculative step's time goes.
source "$(dirname "$0")/setup.sh"
mkdir -p $OUT/a $OUT/b $OUT/c
START=$SECONDS
run() {  # run DIR TIMEOUT [extra args]
  local d=$1 t=$2; shift 2
  timeout $t python3 packages/kvarn-vllm/scripts/e2e_spec.py --phase stress \
    --gguf $GGUF --converted-dir /tmp/smollm2-hf --dtypes kvarn_k4v2_g128 --stress-prompts 32 \
    --stress-tokens 256 --run-timeout $((t - 10)) --out $OUT/$d "$@" > $OUT/$d.log 2>&1
  echo "$d rc=$? at $((SECONDS-START)) s" | tee -a $OUT/$d.log
  python3 ../.gpurun/spec_summary.py $OUT/$d | cut -c1-250
  rm -rf $OUT/$d/runs/*.spec.json $OUT/$d/runs/*.result.json $OUT/$d/eagle-draft $OUT/$d/profiles
}
run a 170
export KVARN_KERNELS_TORCH_PLANNER=1; run b 170; unset KVARN_KERNELS_TORCH_PLANNER
run c $((570 - (SECONDS - START))) --profile 20
