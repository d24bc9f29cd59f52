#!/bin/bash
# Eleventh run, call D (one H200): k4v4 under EAGLE in the default launch (issue 6), and beside it on the
# same GPU SmolLM2 greedy fidelity with 512 generated tokens (long enough to read records).
source "$(dirname "$0")/setup.sh"
mkdir -p $OUT/spec $OUT/x
START=$SECONDS
( timeout 330 python3 -m kvarn_eval.cli bench --suites vllm_greedy --greedy-model $GGUF --vllm-greedy-tokens 512 \
    --greedy-caches bf16@TRITON_ATTN,bf16@FLASH_ATTN,kvarn_k4v2_g128,kvarn_k4v4_g128 --max-seconds 325 --no-plot \
    --out $OUT/x > $OUT/x/log 2>&1; echo rc=$? >> $OUT/x/log ) &
GPID=$!
timeout 300 python3 packages/kvarn-vllm/scripts/e2e_spec.py --phase repeat --eager --gguf $GGUF --run-timeout 130 \
  --dtypes kvarn_k4v4_g128 --converted-dir /tmp/smollm2-hf-2 --out $OUT/spec > $OUT/spec.log 2>&1
echo rc=$? >> $OUT/spec.log
echo "spec done at $((SECONDS-START)) s" >> $OUT/times
wait $GPID
echo "greedy done at $((SECONDS-START)) s" >> $OUT/times
rm -rf $OUT/x/runs
cat $OUT/times; tail -15 $OUT/spec.log | cut -c1-200
grep "starting (\|\[ok\]\|skipped\|failed" $OUT/x/log | cut -c1-120; grep -A10 "┏" $OUT/x/log | cut -c1-170
