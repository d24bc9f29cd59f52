#!/bin/bash
# Twenty-seventh run, call 1 (one H200): installs the vllm-c part; kernel GPU tests of what the
# twenty-sixth session added on the CPU (split_batch at real sizes, nothing compiles after warm-up
# with the Gluon split layout unspecialized, verify-as-decode); the store sweep (key frame x
# normalization sweeps x warps per program); batch-invariant split lengths at small batches.
bash .gpu/vllm-c/install.sh | tail -1
cd .snap/packages/kvarn-kernels && export PYTHONPATH=$PWD/../kvarn-math/src:$PWD/src
export KVARN_GIT_SHA=$(cat ../../GIT_SHA)
mkdir -p $OUT/k
START=$SECONDS
timeout 200 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py tests/test_kernels_warmup.py \
  -k "split_batch or nothing_compiles or verify_as_decode or specialize" \
  -p no:cacheprovider > $OUT/k/tests.log 2>&1
echo "tests rc=$? at $((SECONDS-START)) s"; tail -4 $OUT/k/tests.log | cut -c1-300
timeout 240 python3 -m kvarn_kernels.bench --quick --no-vllm --skip-grid --store-sweep \
  --out $OUT/k/store.json > $OUT/k/store.log 2>&1
echo "store sweep rc=$? at $((SECONDS-START)) s"; grep '^{' $OUT/k/store.log | cut -c1-400
for MODE in default bi8 bi32; do
  unset KVARN_KERNELS_BATCH_INVARIANT KVARN_KERNELS_INVARIANT_SPLIT_TILES
  if [ $MODE != default ]; then
    export KVARN_KERNELS_BATCH_INVARIANT=1 KVARN_KERNELS_INVARIANT_SPLIT_TILES=${MODE#bi}
  fi
  timeout 80 python3 -m kvarn_kernels.bench --quick --no-vllm --key-frame auto --windows values \
    --batches 1 4 16 --contexts 4096 16384 --out $OUT/k/$MODE.json > $OUT/k/$MODE.log 2>&1
  echo "$MODE rc=$? at $((SECONDS-START)) s"; grep "^| kvarn" $OUT/k/$MODE.log | sort -u | cut -d'|' -f4-6,13-14
done
