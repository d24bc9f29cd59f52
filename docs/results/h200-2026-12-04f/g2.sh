#!/bin/bash
# Thirty-fourth run: Gemma-3-270M (head_dim 256, sliding window 512 on 5 of 6 layers) served
# with the per-preset window default (values-only windows for 4-bit keys) against keeping the
# windows' keys (+keys): perplexity through vLLM (8 x 512 tokens, 128-token chunks) beside
# greedy fidelity on prompts that read records (a 768-token passage before each of 100 prompts).
GEMMA=$KVARN_GPU_FILES/gemma-3-270m-q4_k_m.gguf
R=$(cd ../.gpurun && pwd)
T=$R/wiki.txt
L=${LIMIT:-440}
mkdir -p $OUT/g $OUT/x
START=$SECONDS
( timeout $L python3 -m kvarn_eval.cli bench --suites vllm_perplexity --greedy-model $GEMMA --text $T \
  --vllm-ppl-tokens 512 --ppl-caches bf16@TRITON_ATTN,kvarn_k4v2_g128,kvarn_k4v2_g128+keys \
  --max-seconds $((L - 5)) --no-plot --out $OUT/g > $OUT/g/log 2>&1; echo rc=$? >> $OUT/g/log
  echo "ppl done at $((SECONDS-START)) s" >> $OUT/times ) &
PID=$!
timeout $L python3 -m kvarn_eval.cli bench --suites vllm_greedy --greedy-model $GEMMA --text $T \
  --vllm-greedy-context 768 --greedy-caches bf16@TRITON_ATTN,kvarn_k4v2_g128,kvarn_k4v2_g128+keys \
  --noise-max-num-seqs 0 --max-seconds $((L - 5)) --no-plot --out $OUT/x > $OUT/x/log 2>&1
echo rc=$? >> $OUT/x/log; echo "greedy done at $((SECONDS-START)) s" >> $OUT/times
wait $PID
rm -rf $OUT/g/runs $OUT/x/runs
cat $OUT/times
for d in g x; do echo "== $d"; grep "starting (\|\[ok\]\|skipped\|failed\|need\|rc=" $OUT/$d/log | cut -c1-160; grep -A12 "┏" $OUT/$d/log | cut -c1-170; done
