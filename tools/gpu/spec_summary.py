"""Prints the runs and comparison rows of e2e_spec.py's JSON of any phase (argument: its folder)."""

import json
import sys
from pathlib import Path

f = sorted(Path(sys.argv[1]).glob("spec_*.json"))[0]
print(f.name)
d = json.loads(f.read_text())
print("complete:", d.get("complete"))
for k, r in d["runs"].items():
    print(
        k,
        r.get("ok"),
        r.get("model_runner"),
        r.get("kv_cache_tokens"),
        r.get("tokens_per_second"),
        r.get("seconds"),
        r.get("spec_decode"),
        r.get("captured_graphs"),
        (r.get("error") or "")[-300:],
    )
for k, r in d["comparison"].items():
    a = r.get("agreement_with_no_spec") or {}
    print(
        k,
        {x: a.get(x) for x in list(a)[:6]},
        r.get("tokens_per_second"),
        r.get("tokens_per_second_no_spec"),
        r.get("error"),
    )
for k, r in d["runs"].items():
    t = r.get("profile_table")
    if t:
        print("== profile", k)
        print("\n".join(t.splitlines()[:45]))
