#!/bin/bash
# Thirty-first run, call 1 (one H200): installs the vllm-c part; the kernel GPU tests that the
# thirtieth run's limit cut: kvarn_k4v4_g128's batch-invariant cases of
# test_fast_decode_matches_the_triton_kernel and its prefetch test, plus the new
# test_fixed_decode_splits_bit_for_bit (KVARN_KERNELS_DECODE_SPLITS=fixed), node ids in k2_ids.txt.
bash .gpu/vllm-c/install.sh | tail -1
cd .snap/packages/kvarn-kernels && export PYTHONPATH=$PWD/../kvarn-math/src:$PWD/src
mkdir -p $OUT/k
START=$SECONDS
timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider $(cat ../../../.gpurun/k2_ids.txt) > $OUT/k/tests.log 2>&1
echo "tests rc=$? at $((SECONDS-START)) s"; grep "^FAILED\|passed\|failed" $OUT/k/tests.log | head -12 | cut -c1-300
head -c 300 $OUT/k/tests.log
