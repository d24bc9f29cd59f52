#!/bin/bash
# Twenty-fourth run, call 1 (one H200): installs the vllm-c part; the kernels' GPU test of
# verify_as_decode at real sizes (head_dim 128 on the Gluon kernel, 64 on Triton) and the
# batch-invariant bit-for-bit tests, as a regression check; the Triton store planner against its
# torch twin on CUDA tensors.
bash .gpu/vllm-c/install.sh | tail -1
cd .snap/packages/kvarn-kernels && export PYTHONPATH=$PWD/../kvarn-math/src:$PWD/src
mkdir -p $OUT/k
START=$SECONDS
timeout 150 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -k "verify_as_decode or bit_for_bit or planner" \
  -p no:cacheprovider > $OUT/k/tests.log 2>&1
echo "tests rc=$? at $((SECONDS-START)) s"; tail -15 $OUT/k/tests.log | cut -c1-300
