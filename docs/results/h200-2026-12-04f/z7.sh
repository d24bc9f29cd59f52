#!/bin/bash
# Next run: where an n-gram engine's step goes, kvarn against bf16 (thirty-third run: 1,475-1,994
# tokens/s with n-gram for kvarn_k4v2_g128 against 6,172-7,683 for bf16 on SmolLM2, ~95 against
# ~25 ms per verify step). vLLM's torch profiler over 30 engine steps after the first 5 of each
# timed run (prefill chunks and verify steps), tables into spec_agreement.json (profile_table).
source "$(dirname "$0")/setup.sh"
OUT=$OUT/profile${TAG:-}; mkdir -p $OUT/n
START=$SECONDS
timeout ${LIMIT:-560} python3 packages/kvarn-vllm/scripts/e2e_spec.py --phase agreement \
  --graphs --gguf $GGUF --converted-dir /tmp/smollm2-hf --run-timeout 250 \
  --dtypes ${DTYPES:-kvarn_k4v2_g128 auto} --methods ngram --profile 30 --profile-skip 5 \
  --out $OUT/n > $OUT/n.log 2>&1
echo "rc=$? at $((SECONDS-START)) s" >> $OUT/n.log
rm -rf $OUT/n/runs/*.spec.json $OUT/n/runs/*.result.json
grep "^\[\|rc=" $OUT/n.log | cut -c1-200
python3 - "$OUT/n/spec_agreement.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for name, r in d["runs"].items():
    print("==", name, r.get("tokens_per_second"))
    print("\n".join((r.get("profile_table") or "").splitlines()[:28]))
PY
