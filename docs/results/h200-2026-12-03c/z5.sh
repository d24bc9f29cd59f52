#!/bin/bash
# Twenty-fifth run, call 9 (one H200): the EAGLE stress phase as in call 8, kvarn_k4v2_g128 only,
# with the rest of the session's device time (call 8's engine ran past its 146 s limit).
source "$(dirname "$0")/setup.sh"
START=$SECONDS
d=kvarn_k4v2_g128
mkdir -p $OUT/$d
timeout 235 python3 packages/kvarn-vllm/scripts/e2e_spec.py --phase stress \
  --gguf $GGUF --converted-dir /tmp/smollm2-hf --dtypes $d --stress-prompts 32 \
  --stress-tokens 256 --run-timeout 225 --out $OUT/$d > $OUT/$d.log 2>&1
echo "$d rc=$? at $((SECONDS-START)) s"
python3 ../.gpurun/spec_summary.py $OUT/$d | cut -c1-250 | grep -v "^complete\|^spec_"
grep -h "Error\|Traceback\|init engine\|Graph capturing finished" $OUT/$d/runs/*.log | cut -c1-220 | tail -4
rm -rf $OUT/$d/runs/*.spec.json $OUT/$d/runs/*.result.json $OUT/$d/eagle-draft
