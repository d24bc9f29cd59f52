#!/bin/bash
# Twenty-fourth run, second machine, call 5 (one H200): the EAGLE stress phase (dummy
# SmolLM2-shaped target + dummy one-layer EAGLE draft, CUDA graphs with full graphs for uniform
# verify batches, prefix caching, 32 prompts x 256 tokens, 16 at a time, logprobs checked
# finite), kvarn_k4v2_g128, three engines one after the other: (b) the torch store planner
# (KVARN_KERNELS_TORCH_PLANNER=1; the first engine also takes vLLM's own first-use JIT
# compilations), (a) the Triton planner, (b2) the torch planner again.
source "$(dirname "$0")/setup.sh"
START=$SECONDS
run() {  # run DIR
  local d=$1 t=$(( (575 - (SECONDS - START)) / $2 ))
  mkdir -p $OUT/$d
  timeout $t python3 packages/kvarn-vllm/scripts/e2e_spec.py --phase stress \
    --gguf $GGUF --converted-dir /tmp/smollm2-hf --dtypes kvarn_k4v2_g128 --stress-prompts 32 \
    --stress-tokens 256 --run-timeout $((t - 15)) --out $OUT/$d > $OUT/$d.log 2>&1
  echo "$d rc=$? at $((SECONDS-START)) s (limit $t)"
  python3 ../.gpurun/spec_summary.py $OUT/$d | cut -c1-250 | grep -v "^complete\|^spec_"
  grep -h "JIT compilation during inference\|Graph capturing finished\|init engine" $OUT/$d/runs/*.log | cut -c1-220 | tail -4
  pkill -f "internal-run" ; sleep 2
  rm -rf $OUT/$d/runs/*.spec.json $OUT/$d/runs/*.result.json $OUT/$d/eagle-draft $OUT/$d.log
}
export KVARN_KERNELS_TORCH_PLANNER=1; run b 3
unset KVARN_KERNELS_TORCH_PLANNER; run a 2
export KVARN_KERNELS_TORCH_PLANNER=1; run b2 1
