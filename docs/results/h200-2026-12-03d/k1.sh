#!/bin/bash
# Twenty-sixth run, call 1 (one H200): installs the vllm-c part; kernel GPU tests: kernel warm-up
# compiled into one Triton cache folder that a new process reuses (compile_cache), the accept/reject
# proof on every preset, the store and drafter planners; then the kernel bench (Llama-3.1-8B shape,
# values-only windows, key frames per tile) at batch 64 and 256 x 4K and 16K in the default launch
# and batch-invariant with splits of 8, 16 and 32 tiles (KVARN_KERNELS_INVARIANT_SPLIT_TILES).
bash .gpu/vllm-c/install.sh | tail -1
cd .snap/packages/kvarn-kernels && export PYTHONPATH=$PWD/../kvarn-math/src:$PWD/src
export KVARN_GIT_SHA=$(cat ../../GIT_SHA)
mkdir -p $OUT/k
START=$SECONDS
timeout 170 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py tests/test_kernels_warmup.py \
  tests/test_kernels_speculative.py -k "compile_cache or accept_reject or planner" \
  -p no:cacheprovider > $OUT/k/tests.log 2>&1
echo "tests rc=$? at $((SECONDS-START)) s"; tail -4 $OUT/k/tests.log | cut -c1-300
for MODE in default bi8 bi16 bi32; do
  unset KVARN_KERNELS_BATCH_INVARIANT KVARN_KERNELS_INVARIANT_SPLIT_TILES
  if [ $MODE != default ]; then
    export KVARN_KERNELS_BATCH_INVARIANT=1 KVARN_KERNELS_INVARIANT_SPLIT_TILES=${MODE#bi}
  fi
  timeout 90 python3 -m kvarn_kernels.bench --quick --no-vllm --key-frame auto --windows values \
    --batches 64 256 --contexts 4096 16384 --out $OUT/k/$MODE.json > $OUT/k/$MODE.log 2>&1
  echo "$MODE rc=$? at $((SECONDS-START)) s"; grep "^| kvarn" $OUT/k/$MODE.log | sort -u | cut -d'|' -f4-6,13-14
done
