#!/bin/bash
# Twenty-third run, call 1 (one H200): installs the vllm-c part; the kernels' GPU tests for the
# warm-up (nothing compiles after it) and the L2 prefetch (no bit changes), as a regression check.
bash .gpu/vllm-c/install.sh | tail -1
cd .snap/packages/kvarn-kernels && export PYTHONPATH=$PWD/../kvarn-math/src:$PWD/src
mkdir -p $OUT/k
START=$SECONDS
timeout 120 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -k "prefetch or fast_decode" \
  -p no:cacheprovider > $OUT/k/tests.log 2>&1
echo "tests rc=$? at $((SECONDS-START)) s"; tail -4 $OUT/k/tests.log
