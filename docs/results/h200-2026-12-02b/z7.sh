#!/bin/bash
# Nineteenth run, call 6 (one H200): n-gram (prompt lookup) speculation over the kvarn cache, now
# that kvarn serves vLLM's V1 model runner (d81c4cb): e2e_spec.py's agreement phase, SmolLM2-135M
# real weights, eager engines, 100 repetitive prompts each behind ~580 tokens of its own notes
# (decoding reads quantized tiles), 64 greedy tokens, k = 4 drafts: bf16, kvarn_k4v2_g128 and
# kvarn_k4v4_g128, each without speculation and with n-gram.
source "$(dirname "$0")/setup.sh"
mkdir -p $OUT/spec
START=$SECONDS
timeout 520 python3 packages/kvarn-vllm/scripts/e2e_spec.py --phase agreement --gguf $GGUF \
  --converted-dir /tmp/smollm2-hf --run-timeout 150 --out $OUT/spec > $OUT/spec.log 2>&1
echo "rc=$? at $((SECONDS-START)) s" >> $OUT/spec.log
rm -rf $OUT/spec/runs/*.spec.json
grep "^\[\|rc=" $OUT/spec.log | cut -c1-200
python3 - <<'PY'
import json, os
p = os.path.join(os.environ["OUT"], "spec", "spec_agreement.json")
d = json.load(open(p))
for k, r in d["runs"].items():
    print(k, r.get("ok"), r.get("model_runner"), r.get("kv_cache_tokens"), r.get("tokens_per_second"), r.get("spec_decode"), (r.get("error") or "")[-300:])
for k, r in d["comparison"].items():
    a = r.get("agreement_with_no_spec") or {}
    print(k, {x: a.get(x) for x in list(a)[:6]}, r.get("tokens_per_second"), r.get("tokens_per_second_no_spec"))
PY
