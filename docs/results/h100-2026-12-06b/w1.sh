#!/bin/bash
# Window 1 (2026-12-06 evening): reshaped kvarn-vllm at HEAD on the GPU for the first time.
# (1) vLLM greedy + perplexity, SmolLM2, bf16 vs kvarn_k4v2 (sanity of the reshape);
# (2) hybrid capacity (Nemotron-H-8B, Qwen3-Next-80B shapes, dummy weights); (3) dense decode bench "before".
source tools/gpu/setup.sh
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt; cat $OUT/gpu.txt
START=$SECONDS
mkdir -p $OUT/g $OUT/hy
timeout ${T1:-170} python3 -m kvarn_eval.cli bench --suites vllm_greedy,vllm_perplexity --greedy-model $GGUF \
  --greedy-caches bf16@TRITON_ATTN,kvarn_k4v2_g128 --ppl-caches bf16@TRITON_ATTN,kvarn_k4v2_g128 \
  --text $(pwd)/../.gpurun/wiki.txt --max-seconds $((${T1:-170} - 10)) --no-plot --out /tmp/g > $OUT/g/log 2>&1
echo "greedy rc=$? at $((SECONDS-START)) s"
cp /tmp/g/results.json /tmp/g/results.md $OUT/g/ 2>/dev/null
grep "\[ok\]\|skipped\|failed\|Error" $OUT/g/log | cut -c1-200 | tail -8; head -40 /tmp/g/results.md 2>/dev/null | cut -c1-200
S=packages/kvarn-eval/scripts/hybrid_evidence.py
timeout ${T2:-150} python3 $S --out $OUT/hy/nemotron --shape nemotron-h-8b --phase capacity --caches auto kvarn_k4v2_g128 --timeout 70 > $OUT/hy/nemotron.log 2>&1
echo "nemotron rc=$? at $((SECONDS-START)) s"; tail -12 $OUT/hy/nemotron.log | cut -c1-220
timeout ${T3:-150} python3 $S --out $OUT/hy/qwen3next --shape qwen3-next-80b --phase capacity --caches auto kvarn_k4v2_g128 --timeout 70 > $OUT/hy/qwen3next.log 2>&1
echo "qwen3next rc=$? at $((SECONDS-START)) s"; tail -12 $OUT/hy/qwen3next.log | cut -c1-220
export PYTHONPATH=$PWD/packages/kvarn-math/src:$PWD/packages/kvarn-kernels/src
timeout ${T4:-90} python3 -m kvarn_kernels.bench --out $OUT/kbench_before.json --presets kvarn_k4v2_g128 kvarn_k2v2_g128 \
  --batches 16 64 --contexts 16384 32768 > $OUT/kbench_before.log 2>&1
echo "kbench rc=$? at $((SECONDS-START)) s"; tail -30 $OUT/kbench_before.log | cut -c1-200
