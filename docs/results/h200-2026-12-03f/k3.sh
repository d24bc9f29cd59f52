#!/bin/bash
# Twenty-eighth run, call 1 (one H200): installs the vllm-c part; kernel GPU tests of the store
# (one-sided normalization sweeps, fused max/min) and of the saturating fp16 cast of exact K/V
# (adversarial tiles), nothing compiles after warm-up; then the store sweep to time the sweeps.
bash .gpu/vllm-c/install.sh | tail -1
cd .snap/packages/kvarn-kernels && export PYTHONPATH=$PWD/../kvarn-math/src:$PWD/src
export KVARN_GIT_SHA=$(cat ../../GIT_SHA)
mkdir -p $OUT/k
START=$SECONDS
timeout 230 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py tests/test_kernels_warmup.py \
  -k "quantize_tiles_matches or store_kv_chunked or adversarial or nothing_compiles or specialize" \
  -p no:cacheprovider > $OUT/k/tests.log 2>&1
echo "tests rc=$? at $((SECONDS-START)) s"; grep "^FAILED\|^E  \|passed\|failed" $OUT/k/tests.log | head -20 | cut -c1-300
timeout 150 python3 -m kvarn_kernels.bench --quick --no-vllm --skip-grid --store-sweep \
  --out $OUT/k/store.json > $OUT/k/store.log 2>&1
echo "store sweep rc=$? at $((SECONDS-START)) s"
python3 -c "
import json; r = json.load(open('$OUT/k/store.json'))
for x in r['store_sweep']:
    print(x['key_frame'], x['iterations'], x['warps'], x.get('error', ''), *[f'{k}={v:.4g}' for k, v in x.items() if isinstance(v, float)])"
