#!/bin/bash
# Thirtieth run, call 1 (one H200): installs the vllm-c part; kernel GPU tests of the Gluon decode
# kernel on 4-bit values (kvarn_k4v4_g128 against the Triton kernel and the reference, default launch
# and batch-invariant; the L2 prefetch changes no bit), then k4v2 as regression; then the kernel
# bench (Llama-3.1-8B shape, values-only windows, key frames per tile) for kvarn_k4v4_g128 with the
# Gluon kernel (KVARN_KERNELS_FAST_DECODE=1) and without (=0), and kvarn_k4v2_g128, at batch 64 and
# 256 x 4K and 16K.
bash .gpu/vllm-c/install.sh | tail -1
cd .snap/packages/kvarn-kernels && export PYTHONPATH=$PWD/../kvarn-math/src:$PWD/src
export KVARN_GIT_SHA=$(cat ../../GIT_SHA)
mkdir -p $OUT/k
START=$SECONDS
timeout 150 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py \
  -k "(fast_decode_matches or prefetch_changes) and k4v4" -p no:cacheprovider > $OUT/k/tests_k4v4.log 2>&1
rc=$?
echo "k4v4 tests rc=$rc at $((SECONDS-START)) s"; grep "^FAILED\|passed\|failed" $OUT/k/tests_k4v4.log | head -12 | cut -c1-300
[ $rc = 0 ] && touch /tmp/kvarn-k4v4-ok
timeout 100 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py \
  -k "(fast_decode_matches or prefetch_changes) and k4v2 and bfloat16 or prefetch_changes and k4v2" \
  -p no:cacheprovider > $OUT/k/tests_k4v2.log 2>&1
echo "k4v2 tests rc=$? at $((SECONDS-START)) s"; grep "^FAILED\|passed\|failed" $OUT/k/tests_k4v2.log | head -8 | cut -c1-300
for MODE in k4v4_fast k4v4_triton k4v2_fast; do
  P=kvarn_${MODE%_*}_g128
  F=1; [ ${MODE#*_} = triton ] && F=0
  KVARN_KERNELS_FAST_DECODE=$F timeout 80 python3 -m kvarn_kernels.bench --quick --no-vllm \
    --presets $P --key-frame auto --windows values \
    --batches 64 256 --contexts 4096 16384 --out $OUT/k/$MODE.json > $OUT/k/$MODE.log 2>&1
  echo "$MODE rc=$? at $((SECONDS-START)) s"; grep "^| kvarn" $OUT/k/$MODE.log | sort -u | cut -d'|' -f2-7,13-14
done
