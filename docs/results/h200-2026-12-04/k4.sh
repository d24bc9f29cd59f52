#!/bin/bash
# Twenty-ninth run, call 1 (one H200): installs the vllm-c part; kernel GPU tests of the threaded
# warm-up (a cold warm-up from 1 and 4 threads compiles the same variants; prints both times) and
# the row-slice warm-up tests; leaves /tmp/kvarn-threads-ok on the machine if the threaded test passed.
bash .gpu/vllm-c/install.sh | tail -1
cd .snap/packages/kvarn-kernels && export PYTHONPATH=$PWD/../kvarn-math/src:$PWD/src
export KVARN_GIT_SHA=$(cat ../../GIT_SHA)
mkdir -p $OUT/k
START=$SECONDS
timeout 200 python3 -m pytest -q -s -m gpu tests/test_kernels_warmup.py -k "threaded_warmup" \
  -p no:cacheprovider > $OUT/k/threaded.log 2>&1
rc=$?
echo "threaded rc=$rc at $((SECONDS-START)) s"; grep "cold warm-up\|^FAILED\|^E  \|passed\|failed" $OUT/k/threaded.log | head -20 | cut -c1-300
[ $rc = 0 ] && touch /tmp/kvarn-threads-ok
timeout 150 python3 -m pytest -q -m gpu tests/test_kernels_warmup.py -k "row_slices" \
  -p no:cacheprovider > $OUT/k/rows.log 2>&1
echo "row slices rc=$? at $((SECONDS-START)) s"; grep "^FAILED\|^E  \|passed\|failed" $OUT/k/rows.log | head -20 | cut -c1-300
