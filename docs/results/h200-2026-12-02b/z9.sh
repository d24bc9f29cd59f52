#!/bin/bash
# Nineteenth run, call 7 (one H200): (1) the n-gram agreement of call 6 for kvarn_k4v2_g128 with
# both runs in kvarn's batch-invariant mode (KVARN_KERNELS_BATCH_INVARIANT=1: split layout fixed
# whatever the batch), to separate kernel arithmetic from speculation; (2) one 4K burst that
# fills the cache (Llama-3.1-8B shape, 256 slots, 1024 tokens out, values-only windows), the
# third measurement of the eighteenth run's setting.
source "$(dirname "$0")/setup.sh"
mkdir -p $OUT/spec_bi $OUT/q4
START=$SECONDS
KVARN_KERNELS_BATCH_INVARIANT=1 timeout 200 python3 packages/kvarn-vllm/scripts/e2e_spec.py --phase agreement \
  --gguf $GGUF --converted-dir /tmp/smollm2-hf --run-timeout 95 --dtypes kvarn_k4v2_g128 \
  --out $OUT/spec_bi > $OUT/spec_bi.log 2>&1
echo "spec rc=$? at $((SECONDS-START)) s"
rm -rf $OUT/spec_bi/runs
grep "^\[" $OUT/spec_bi.log | cut -c1-200
python3 -c "
import json, os
d = json.load(open(os.path.join(os.environ['OUT'], 'spec_bi', 'spec_agreement.json')))
for k, r in d['comparison'].items():
    print(k, r.get('agreement_with_no_spec'), r.get('spec_decode'))
"
LEFT=$((470 - (SECONDS - START)))
timeout $LEFT python3 -m kvarn_eval.cli bench --suites throughput --gpu-models llama-3.1-8b \
  --output-len 1024 --fill 1.0 --max-num-seqs 256 --prompt-lens 4096 \
  --caches kvarn_k4v2_g128 --max-seconds $((LEFT - 5)) --no-plot --out $OUT/q4 > $OUT/q4/log 2>&1
echo "burst rc=$? at $((SECONDS-START)) s"
rm -rf $OUT/q4/runs $OUT/q4/results.md $OUT/q4/models
grep "starting (\|\[ok\]\|skipped\|failed\|Error\|error\|tokens:" $OUT/q4/log | cut -c1-200 | tail -6; grep -A5 "┏" $OUT/q4/log | cut -c1-260
