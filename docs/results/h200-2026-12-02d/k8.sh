#!/bin/bash
# Twenty-first run, call 1 (one H200): installs the vllm-c part, then on the kernels alone (commit in
# .snap/GIT_SHA): (1) the GPU tests of the fast decode path, values-only windows and batch-invariant
# mode (8cc64b3: the Gluon kernel with splits at fixed positions, verify blocks as decode rows);
# (2) the kernel bench for values-only windows in the default launch and with
# KVARN_KERNELS_BATCH_INVARIANT=1, the price of the mode that makes verify rows agree with decode.
bash .gpu/vllm-c/install.sh | tail -1
cd .snap/packages/kvarn-kernels && export PYTHONPATH=$PWD/../kvarn-math/src:$PWD/src
export KVARN_GIT_SHA=$(cat ../../GIT_SHA)
mkdir -p $OUT/k
START=$SECONDS
timeout 240 python3 -m pytest -q -x -m gpu tests/test_kernels_gpu.py \
  -k "fast_decode or values_only or batch_invariant or multi_query" -p no:cacheprovider \
  > $OUT/k/tests.log 2>&1
echo "tests rc=$? at $((SECONDS-START)) s"; tail -5 $OUT/k/tests.log
for MODE in default invariant; do
  [ $MODE = invariant ] && export KVARN_KERNELS_BATCH_INVARIANT=1
  timeout 110 python3 -m kvarn_kernels.bench --quick --no-vllm --key-frame auto --windows values \
    --out $OUT/k/$MODE.json > $OUT/k/$MODE.log 2>&1
  echo "$MODE rc=$? at $((SECONDS-START)) s"; grep "^| kvarn" $OUT/k/$MODE.log | sort -u | cut -d'|' -f4-6,13-14
done
