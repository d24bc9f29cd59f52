#!/bin/bash
# Long-context suite through vLLM 0.26 on SmolLM2-135M-Instruct (8K positions): retrieval at 2K/4K/8K,
# 100 questions per task and length, 16 x 4K passages continued 1,024 tokens; bf16 reference and noise run.
source tools/gpu/setup.sh
export PYTHONUNBUFFERED=1
mkdir -p $OUT/lc
timeout ${LIMIT:-500} python3 -m kvarn_eval.cli bench --suites longctx --greedy-model $GGUF \
  --longctx-caches ${CACHES:-bf16@TRITON_ATTN,kvarn_k4v2_g128,kvarn_k2v2_g128,fp8@TRITON_ATTN} \
  --longctx-lengths 2048,4096,8192 --text $(pwd)/../.gpurun/wiki.txt --max-seconds $((${LIMIT:-500} - 15)) --no-plot --out /tmp/lc > $OUT/lc/log 2>&1
echo rc=$? >> $OUT/lc/log
cp /tmp/lc/results.json /tmp/lc/results.md $OUT/lc/ 2>/dev/null
grep "\[ok\]\|skipped\|failed\|rc=\|Error" $OUT/lc/log | cut -c1-200 | tail -12
cat /tmp/lc/results.md 2>/dev/null | cut -c1-220 | head -60
