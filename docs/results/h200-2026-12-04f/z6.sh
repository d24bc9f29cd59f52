#!/bin/bash
# Thirty-first and thirty-second runs (TAG: a suffix for a repeated MODE's folder): n-gram agreement with no speculation (e2e_spec.py --phase agreement, SmolLM2
# real weights, 100 repetitive prompts behind ~580 tokens, 64 greedy tokens, k = 4, CUDA graphs,
# each engine warmed up). MODE=fixed: kvarn_k4v2_g128 in the default launch with
# KVARN_KERNELS_DECODE_SPLITS=fixed and KVARN_VLLM_VERIFY_AS_DECODE=1; MODE=invariant:
# kvarn_k4v4_g128 with KVARN_KERNELS_BATCH_INVARIANT=1 in both runs.
source "$(dirname "$0")/setup.sh"
# MODE=vad: the twenty-seventh run's setting again (KVARN_VLLM_VERIFY_AS_DECODE=1 alone);
# MODE=default: nothing set (since the thirty-third run verify blocks run as decode rows by
# default); MODE=k4v4: the same for kvarn_k4v4_g128; MODE=off: KVARN_VLLM_VERIFY_AS_DECODE=0.
# MODE=rotated: every tile's keys rotated (KVARN_VLLM_KEY_FRAME=rotated);
# MODE=fixedrot: that plus MODE=fixed's settings.
D=kvarn_k4v2_g128
case "$MODE" in
  fixed) export KVARN_KERNELS_DECODE_SPLITS=fixed KVARN_VLLM_VERIFY_AS_DECODE=1 ;;
  invariant) export KVARN_KERNELS_BATCH_INVARIANT=1; D=kvarn_k4v4_g128 ;;
  vad) export KVARN_VLLM_VERIFY_AS_DECODE=1 ;;
  default) ;;
  k4v4) D=kvarn_k4v4_g128 ;;
  off) export KVARN_VLLM_VERIFY_AS_DECODE=0 ;;
  bf16) D=auto ;;
  rotated) export KVARN_VLLM_KEY_FRAME=rotated ;;
  fixedrot) export KVARN_VLLM_KEY_FRAME=rotated KVARN_KERNELS_DECODE_SPLITS=fixed KVARN_VLLM_VERIFY_AS_DECODE=1 ;;
esac
OUT=$OUT/$MODE${TAG:-}; mkdir -p $OUT
env | grep "^KVARN_" | sort
mkdir -p $OUT/n
START=$SECONDS
timeout ${LIMIT:-560} python3 packages/kvarn-vllm/scripts/e2e_spec.py --phase agreement \
  --graphs --gguf $GGUF --converted-dir /tmp/smollm2-hf --run-timeout 250 --dtypes $D \
  --methods ngram --out $OUT/n > $OUT/n.log 2>&1
echo "rc=$? at $((SECONDS-START)) s" >> $OUT/n.log
rm -rf $OUT/n/runs/*.spec.json $OUT/n/runs/*.result.json
grep "^\[\|rc=" $OUT/n.log | cut -c1-200
python3 ../.gpurun/spec_summary.py $OUT/n | cut -c1-300
grep -h "JIT compilation during inference\|FULL)\|Graph capturing finished\|compiled the kernels" $OUT/n/runs/*.log | cut -c1-200 | tail -6
