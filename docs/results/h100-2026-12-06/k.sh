#!/bin/bash
# Kernels on the GPU (no vLLM needed): MLA and reliability GPU tests, the existing GPU kernel tests,
# the MLA decode micro-benchmark. Run from the repository root copy; packages from .snap.
set -o pipefail
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt; cat $OUT/gpu.txt
cd .snap
export PYTHONPATH=$PWD/packages/kvarn-math/src:$PWD/packages/kvarn-kernels/src PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
echo "snapshot $(cat GIT_SHA)"
START=$SECONDS
timeout ${T1:-230} python3 -m pytest -q -p no:cacheprovider -m gpu -x --durations=8 \
  packages/kvarn-kernels/tests/test_kernels_mla_gpu.py packages/kvarn-kernels/tests/test_kernels_reliability.py \
  ${EXTRA_TESTS:-} > $OUT/kernels_gpu.log 2>&1; echo "tests rc=$? at $((SECONDS-START)) s"; tail -25 $OUT/kernels_gpu.log
timeout ${T2:-150} python3 -m kvarn_kernels.mla.bench --out $OUT/mla_bench.json > $OUT/mla_bench.log 2>&1; echo "bench rc=$? at $((SECONDS-START)) s"; tail -40 $OUT/mla_bench.log
timeout ${T3:-150} python3 -m pytest -q -p no:cacheprovider -m gpu packages/kvarn-kernels/tests/test_kernels_gpu.py packages/kvarn-kernels/tests/test_kernels_store.py > $OUT/kernels_gpu_rest.log 2>&1; echo "rest rc=$? at $((SECONDS-START)) s"; tail -8 $OUT/kernels_gpu_rest.log
