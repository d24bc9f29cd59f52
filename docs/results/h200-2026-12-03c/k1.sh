#!/bin/bash
# Twenty-fifth run, call 1 (one H200): installs the vllm-c part; kernel GPU tests: the drafter
# step planner (plan_draft_device, new) and the store planner against their torch twins on CUDA
# tensors, verify-as-decode at real sizes.
bash .gpu/vllm-c/install.sh | tail -1
cd .snap/packages/kvarn-kernels && export PYTHONPATH=$PWD/../kvarn-math/src:$PWD/src
mkdir -p $OUT/k
START=$SECONDS
timeout 150 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -k "planner or verify_as_decode" \
  -p no:cacheprovider > $OUT/k/tests.log 2>&1
echo "tests rc=$? at $((SECONDS-START)) s"; tail -15 $OUT/k/tests.log | cut -c1-300
