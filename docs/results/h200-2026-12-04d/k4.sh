#!/bin/bash
# Thirty-second run (one H200): the store's frame queries (commit 7937068+). Kernel GPU tests of
# the store and speculation (accept/reject schedules with auto key frames, records byte-identical
# to storing the accepted tokens once), nothing compiles after a warm-up with frame queries; then
# the store timed with both key frames, including a speculative commit step with and without
# frame queries (--store-sweep --key-frame auto).
cd .snap/packages/kvarn-kernels && export PYTHONPATH=$PWD/../kvarn-math/src:$PWD/src
export KVARN_GIT_SHA=$(cat ../../GIT_SHA)
mkdir -p $OUT/k
START=$SECONDS
timeout ${TLIM:-240} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_speculative.py \
  tests/test_kernels_warmup.py tests/test_kernels_gpu.py \
  -k "accept_reject or nothing_compiles or store_kv_chunked or quantize_tiles_matches or large_cache" \
  > $OUT/k/tests.log 2>&1
echo "tests rc=$? at $((SECONDS-START)) s"; grep "^FAILED\|passed\|failed" $OUT/k/tests.log | head -12 | cut -c1-300
timeout ${BLIM:-200} python3 -m kvarn_kernels.bench --quick --no-vllm --skip-grid --store-sweep \
  --key-frame auto --out $OUT/k/store.json > $OUT/k/store.log 2>&1
echo "bench rc=$? at $((SECONDS-START)) s"; grep -A12 "Store variants" $OUT/k/store.log | cut -c1-250
