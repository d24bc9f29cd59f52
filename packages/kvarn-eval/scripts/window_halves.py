"""Exact windows that keep only the values exact: what a staging-lighter layout would cost (CPU).

The serving path keeps two complete tiles of each request exact in staging besides their
records, keys and values: the first tile (the attention sink) and the tile before a query's own
(the recent window), 2 x 2 x G rows per request slot and layer on top of the open tile's.
Reading a window's keys from its record and only its values exact halves that window's staging.
This measures the cost under pseudo-decode (WikiText-2, blocks of 128, reference bf16; the
open tile is always exact): for each window, ``kv`` (keys and values exact, the default),
``v`` (values exact, keys read quantized) or ``none`` (read quantized). Each variant's change
against bf16 and against the default (``sink=kv,recent=kv``), paired chunk by chunk.

It replaces the pseudo-decode attention with one that concatenates three copies of the keys and
values, quantized, exact, and quantized keys with exact values, and gives every query exactly
one copy of each key it sees.

    python packages/kvarn-eval/scripts/window_halves.py [--model gemma3-270m --tokens 512]
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from pathlib import Path
from typing import Any

BLOCK = 128
REPO = Path(__file__).resolve().parents[3]
VARIANTS = (
    "sink=kv,recent=kv",
    "sink=kv,recent=v",
    "sink=v,recent=kv",
    "sink=v,recent=v",
    "sink=kv,recent=none",
)


def parse_variant(text: str) -> tuple[str, str]:
    """``"sink=A,recent=B"`` -> ``(A, B)``, each ``kv``, ``v`` or ``none``."""
    parts = dict(p.split("=", 1) for p in text.split(","))
    if set(parts) != {"sink", "recent"} or not set(parts.values()) <= {"kv", "v", "none"}:
        raise ValueError(f"variant {text!r}: expected sink=kv|v|none,recent=kv|v|none")
    return parts["sink"], parts["recent"]


def window_masks(
    seq_len: int, offset: int, sink: str, recent: str, window: int | None
) -> tuple[Any, Any, Any]:
    """Masks ``[T_q, T]`` of the quantized, exact and values-exact copies; disjoint, and their
    union is the causal (windowed) mask."""
    import torch

    pos = torch.arange(seq_len)
    qpos = pos[offset:]
    q_block = (qpos // BLOCK)[:, None]
    k_block = (pos // BLOCK)[None, :]
    causal = pos[None, :] <= qpos[:, None]
    if window is not None:
        causal = causal & (qpos[:, None] - pos[None, :] < window)
    own = k_block == q_block
    in_sink = k_block == 0
    in_recent = (k_block == q_block - 1) & ~own
    exact = own | (in_sink & (sink == "kv")) | (in_recent & (recent == "kv"))
    values = ~exact & ((in_sink & (sink == "v")) | (in_recent & (recent == "v")))
    quantized = ~exact & ~values
    return causal & quantized, causal & exact, causal & values


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m or gemma3-270m")
    parser.add_argument("--presets", default="kvarn_k4v2_g128,kvarn_k2v2_g128")
    parser.add_argument("--variants", default=";".join(VARIANTS), help="';'-separated")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "cpu-2026-12-01d")
    args = parser.parse_args()
    variants = [v for v in args.variants.split(";") if v]
    for v in variants:
        parse_variant(v)

    import torch
    import torch.nn.functional as F
    from kvarn_eval.accuracy import evaluate_perplexity, install, select_methods
    from kvarn_eval.accuracy.summary import paired_change
    from kvarn_eval.data import find_wikitext
    from kvarn_eval.models import load_model
    from kvarn_eval.suites import text_chunks

    pd = importlib.import_module("kvarn_eval.accuracy.pseudo_decode")
    mode = {"sink": "kv", "recent": "kv"}

    def attention(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=0.0,
        scaling=None,
        sliding_window=None,
        **kwargs,
    ):  # type: ignore[no-untyped-def]
        config = pd._ACTIVE.get()
        q_len, seq_len = query.shape[2], key.shape[2]
        offset = seq_len - q_len
        window = (
            sliding_window
            if sliding_window is not None
            else getattr(module, "sliding_window", None)
        )
        gqa = query.shape[1] != key.shape[1]
        if config.method is None or seq_len <= BLOCK:
            return pd.pseudo_decode_attention(
                module,
                query,
                key,
                value,
                attention_mask,
                dropout,
                scaling,
                sliding_window,
                **kwargs,
            )
        k_hat, v_hat = pd.quantize_kv(key, value, config, query)  # block 0 too: sink 0
        quantized, exact, values = window_masks(
            seq_len, offset, mode["sink"], mode["recent"], window
        )
        out = F.scaled_dot_product_attention(
            query,
            torch.cat([k_hat.to(key.dtype), key, k_hat.to(key.dtype)], dim=2),
            torch.cat([v_hat.to(value.dtype), value, value], dim=2),
            attn_mask=torch.cat([quantized, exact, values], dim=1),
            scale=scaling,
            enable_gqa=gqa,
        )
        return out.transpose(1, 2).contiguous(), None

    pd.pseudo_decode_attention = attention  # install() registers the module's name
    started = time.time()
    lm = load_model(args.model)
    install(lm.model)
    text, source = find_wikitext()
    chunks = text_chunks(lm.tokenizer, text, args.chunks, args.tokens)
    methods = select_methods("bf16," + args.presets, BLOCK)
    rows: dict[str, dict] = {}
    for variant in variants:
        mode["sink"], mode["recent"] = parse_variant(variant)
        result = evaluate_perplexity(
            lm.model,
            chunks,
            methods,
            head_dim=lm.head_dim,
            block_size=BLOCK,
            sink_tokens=0,  # every complete block is quantized; the masks pick the copies
            suite="wikitext",
            source=source,
        )
        for row in result.rows:
            if row.method == "bf16":
                continue
            rows[f"{variant}/{row.method}"] = {
                "delta_pct": row.delta_pct,
                "delta_se_pct": row.delta_se_pct,
                "kl": row.kl,
                "top1": row.top1,
                "chunk_nll": row.chunk_nll,
            }
            print(
                f"{variant} {row.method}: {row.delta_pct:+.2f}% ± {row.delta_se_pct:.2f}",
                flush=True,
            )
    base_variant = variants[0]
    for key, row in rows.items():
        variant, preset = key.split("/")
        base = rows[f"{base_variant}/{preset}"]["chunk_nll"]
        if variant != base_variant:
            row["vs_first_pct"], row["vs_first_se_pct"] = paired_change(row["chunk_nll"], base)
            print(
                f"{key} vs {base_variant}: {row['vs_first_pct']:+.2f}% ± "
                f"{row['vs_first_se_pct']:.2f}"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"window_halves_{args.model}.json"
    payload = {
        "command": "python packages/kvarn-eval/scripts/window_halves.py "
        f"--model {args.model} --presets {args.presets} --variants '{args.variants}' "
        f"--chunks {args.chunks} --tokens {args.tokens}",
        "source": source,
        "rows": rows,
        "seconds": time.time() - started,
    }
    path.write_text(json.dumps(payload, indent=1))
    print(f"wrote {path} ({payload['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
