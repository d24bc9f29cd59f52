#!/bin/bash
# KV capacity of every kvarn preset against bf16 in the same run, on one GPU whose vLLM memory
# budget is set to BUDGET_GIB (gpu_memory_utilization = BUDGET_GIB / the card's total memory):
# 71.26 is an 80 GB H100 at vLLM's default 0.9 (0.9 x 79.18 GiB), 24 a 24 GiB budget; on an H100
# 71.26 is utilization 0.9 itself. Llama-3.1-8B shape, dummy weights, 256 slots, eager,
# max_model_len 5,376 (the capacity suite's short workload after each engine starts). Beside the
# measurement, the planner's projection for the same budget (python -m kvarn_vllm.capacity).
# Results under $OUT/capacity_<budget>/ (results.md, results.json, engine_tail.log, budget.txt,
# projection.md). docs/capacity.md explains the numbers.
#
# Usage, from the repository root copy after `source tools/gpu/setup.sh` (vLLM 0.26 installed):
#   BUDGET_GIB=71.26 LIMIT=230 bash packages/kvarn-vllm/scripts/capacity_budgets.sh
#   BUDGET_GIB=24    LIMIT=230 bash packages/kvarn-vllm/scripts/capacity_budgets.sh
# CACHES=... narrows the caches; a second call with the same BUDGET_GIB resumes (--resume).
set -u
B=${BUDGET_GIB:?set BUDGET_GIB, e.g. 71.26 or 24}
LIMIT=${LIMIT:-230}
CACHES=${CACHES:-bf16@TRITON_ATTN,kvarn_k4v2_g128,kvarn_k4v4_g128,kvarn_k4v2_g64,kvarn_k4v4_g64,kvarn_k2v2_g128,kvarn_k3v2_g128}
NAME=capacity_${B}
D=/tmp/$NAME
mkdir -p "$D" "$OUT/$NAME"
TOTAL=$(python3 -c "import torch; print(round(torch.cuda.mem_get_info()[1] / 2**30, 2))")
UTIL=$(python3 -c "print(round($B / $TOTAL, 4))")
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "card total $TOTAL GiB, budget $B GiB: gpu_memory_utilization $UTIL"
} | tee "$OUT/$NAME/budget.txt"
START=$SECONDS
KVARN_VLLM_WARMUP=0 timeout "$LIMIT" python3 -m kvarn_eval.cli bench --suites capacity \
  --gpu-models llama-3.1-8b --max-num-seqs 256 --prompt-lens 4096 --output-len 1024 --eager \
  --gpu-memory-utilization "$UTIL" --caches "$CACHES" --max-seconds $((LIMIT - 15)) \
  --no-plot --resume --out "$D" >> "$D/log" 2>&1
echo "rc=$? after $((SECONDS - START)) s" | tee -a "$D/log"
for f in "$D"/runs/*/*.log; do
  [ -f "$f" ] && {
    echo "== $f"
    grep -i "KV cache size\|init engine\|staging\|Available KV\|No available memory\|Error" "$f" \
      | cut -c1-300 | head -10
  }
done > "$OUT/$NAME/engine_tail.log" 2>/dev/null
cp "$D/results.json" "$D/results.md" "$D/log" "$OUT/$NAME/" 2>/dev/null
python3 -m kvarn_vllm.capacity > "$OUT/$NAME/projection.md"
grep "\[ok\]\|skipped\|failed\|rc=" "$D/log" | cut -c1-160 | tail -16
grep -A12 "^| model" "$D/results.md" | cut -c1-200
