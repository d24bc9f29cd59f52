"""Which half of the exact first tile matters: keys or values (perplexity, CPU).

The serving path keeps tile 0 (the attention sink) exact, keys and values, at ``2 * G`` staging
rows per request slot. This measures two halves of that under pseudo-decode (WikiText-2,
8 x 1024 tokens, blocks of 128, reference bf16, SmolLM2): ``k_exact`` (tile 0's keys exact, its
values read from the quantized record), ``v_exact`` (the reverse) and ``full`` (both exact, the
default), for kvarn_k4v2_g128 and kvarn_k4v4_g128, with each variant's change against ``full``
paired chunk by chunk. It patches ``pseudo_decode.quantize_kv`` for the two half variants.

    python packages/kvarn-eval/scripts/sink_kv_split.py [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from pathlib import Path

BLOCK = 128
REPO = Path(__file__).resolve().parents[3]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "cpu-2026-11-30")
    args = parser.parse_args()

    from kvarn_eval.accuracy import evaluate_perplexity, install, select_methods
    from kvarn_eval.accuracy.summary import paired_change
    from kvarn_eval.data import find_wikitext
    from kvarn_eval.models import load_model
    from kvarn_eval.suites import text_chunks

    pd = importlib.import_module("kvarn_eval.accuracy.pseudo_decode")
    original = pd.quantize_kv
    mode = {"name": "full"}

    def patched(key, value, config):  # type: ignore[no-untyped-def]
        k_hat, v_hat = original(key, value, config)
        if config.method is not None and config.sink == 0:  # tile 0 was quantized: restore half
            if mode["name"] == "k_exact":
                k_hat[:, :, :BLOCK] = key[:, :, :BLOCK]
            elif mode["name"] == "v_exact":
                v_hat[:, :, :BLOCK] = value[:, :, :BLOCK]
        return k_hat, v_hat

    pd.quantize_kv = patched
    started = time.time()
    lm = load_model("smollm2-135m")
    install(lm.model)
    text, source = find_wikitext()
    chunks = text_chunks(lm.tokenizer, text, 8, 1024)
    methods = select_methods("bf16,kvarn_k4v2_g128,kvarn_k4v4_g128", BLOCK)
    rows: dict[str, dict] = {}
    for name, sink in (("k_exact", 0), ("v_exact", 0), ("full", BLOCK)):
        mode["name"] = name
        result = evaluate_perplexity(
            lm.model,
            chunks,
            methods,
            head_dim=lm.head_dim,
            block_size=BLOCK,
            sink_tokens=sink,
            suite="wikitext",
            source=source,
        )
        for row in result.rows:
            if row.method != "bf16":
                rows[f"{name}/{row.method}"] = {
                    "delta_pct": row.delta_pct,
                    "delta_se_pct": row.delta_se_pct,
                    "kl": row.kl,
                    "top1": row.top1,
                    "chunk_nll": row.chunk_nll,
                }
                print(f"{name} {row.method}: {row.delta_pct:+.2f}% ± {row.delta_se_pct:.2f}")
    for key, row in rows.items():
        name, preset = key.split("/")
        if name != "full":
            row["vs_full_pct"], row["vs_full_se_pct"] = paired_change(
                row["chunk_nll"], rows[f"full/{preset}"]["chunk_nll"]
            )
            print(f"{key} vs full: {row['vs_full_pct']:+.2f}% ± {row['vs_full_se_pct']:.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "sink_kv_split.json"
    payload = {
        "command": "python packages/kvarn-eval/scripts/sink_kv_split.py",
        "source": source,
        "rows": rows,
        "seconds": time.time() - started,
    }
    path.write_text(json.dumps(payload, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
