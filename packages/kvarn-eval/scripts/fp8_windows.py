"""Exact windows kept in fp8: what halving their staging would cost in accuracy (CPU).

kvarn-vllm keeps two complete tiles of each request exact in bf16 staging besides their
records: the first tile (the attention sink) and the tile before a query's own (the recent
window); their values only for 4-bit keys, keys and values for 2- and 3-bit keys. They are half
to two thirds of the staging per request slot (docs/capacity.md). Keeping them in fp8 (e4m3,
no scale, as vLLM's fp8 KV cache with its default scale of 1.0) would halve that part. This
measures the cost under pseudo-decode (WikiText-2, blocks of 128, reference bf16; the open
tile, the query's own, is always exact bf16): each preset with its serving default windows,
``bf16`` (as served) against ``fp8``, change against bf16 and paired against the served windows.

Attention concatenates three copies of the keys and values (quantized; exact; the windows'
copy, keys from the records unless the preset's windows keep keys) and gives every query
exactly one copy of each key it sees.

    python packages/kvarn-eval/scripts/fp8_windows.py [--model gemma3-270m --tokens 512]
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
WINDOW_KEYS_BELOW_KEY_BITS = 4  # kvarn_vllm.config's default: windows keep keys below 4 bits


def window_masks(seq_len: int, offset: int, window: int | None) -> tuple[Any, Any, Any]:
    """Masks ``[T_q, T]`` of the quantized, exact (the query's own tile) and window (tile 0
    and the tile before the query's own) copies; disjoint, their union the causal (windowed)
    mask."""
    import torch

    pos = torch.arange(seq_len)
    qpos = pos[offset:]
    q_block = (qpos // BLOCK)[:, None]
    k_block = (pos // BLOCK)[None, :]
    causal = pos[None, :] <= qpos[:, None]
    if window is not None:
        causal = causal & (qpos[:, None] - pos[None, :] < window)
    own = k_block == q_block
    windows = ~own & ((k_block == 0) | (k_block == q_block - 1))
    return causal & ~own & ~windows, causal & own, causal & windows


def to_fp8(x: Any) -> Any:
    """``x`` rounded to fp8 e4m3 and back (no scale)."""
    import torch

    return x.to(torch.float8_e4m3fn).to(x.dtype)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m or gemma3-270m")
    parser.add_argument("--presets", default="kvarn_k4v2_g128,kvarn_k2v2_g128")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "cpu-2026-12-06f")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F
    from kvarn_eval.accuracy import evaluate_perplexity, install, select_methods
    from kvarn_eval.accuracy.summary import paired_change
    from kvarn_eval.data import find_wikitext
    from kvarn_eval.models import load_model
    from kvarn_eval.suites import text_chunks
    from kvarn_math.layout import get_preset

    pd = importlib.import_module("kvarn_eval.accuracy.pseudo_decode")
    mode = {"windows": "bf16"}

    def attention(  # type: ignore[no-untyped-def]
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=0.0,
        scaling=None,
        sliding_window=None,
        **kwargs,
    ):
        config = pd._ACTIVE.get()
        q_len, seq_len = query.shape[2], key.shape[2]
        window = (
            sliding_window
            if sliding_window is not None
            else getattr(module, "sliding_window", None)
        )
        if config.method is None or seq_len <= BLOCK:
            return pd.pseudo_decode_attention(
                module, query, key, value, attention_mask, dropout, scaling, sliding_window,
                **kwargs,
            )  # fmt: skip
        k_hat, v_hat = pd.quantize_kv(key, value, config, query)  # block 0 too
        k_hat, v_hat = k_hat.to(key.dtype), v_hat.to(value.dtype)
        name = config.method.name
        keys_exact = (  # bf16's round trip is exact: its windows do not matter
            name.startswith("kvarn_") and get_preset(name).key_bits < WINDOW_KEYS_BELOW_KEY_BITS
        )
        k_win, v_win = (key if keys_exact else k_hat), value
        if mode["windows"] == "fp8":
            k_win, v_win = (to_fp8(key) if keys_exact else k_hat), to_fp8(value)
        quantized, own, windows = window_masks(seq_len, seq_len - q_len, window)
        out = F.scaled_dot_product_attention(
            query,
            torch.cat([k_hat, key, k_win], dim=2),
            torch.cat([v_hat, value, v_win], dim=2),
            attn_mask=torch.cat([quantized, own, windows], dim=1),
            scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        )
        return out.transpose(1, 2).contiguous(), None

    pd.pseudo_decode_attention = attention  # install() registers the module's name
    started = time.time()
    lm = load_model(args.model)
    install(lm.model)
    text, source = find_wikitext()
    chunks = text_chunks(lm.tokenizer, text, args.chunks, args.tokens)
    methods = select_methods("bf16," + args.presets, BLOCK)
    rows: dict[str, dict[str, Any]] = {}
    for windows in ("bf16", "fp8"):
        mode["windows"] = windows
        result = evaluate_perplexity(
            lm.model, chunks, methods, head_dim=lm.head_dim, block_size=BLOCK, sink_tokens=0,
            suite="wikitext", source=source,
        )  # fmt: skip
        for row in result.rows:
            if row.method == "bf16":
                continue
            rows[f"{windows}/{row.method}"] = {
                "delta_pct": row.delta_pct,
                "delta_se_pct": row.delta_se_pct,
                "kl": row.kl,
                "top1": row.top1,
                "chunk_nll": row.chunk_nll,
            }
            print(f"{windows} windows {row.method}: {row.delta_pct:+.2f}% ± {row.delta_se_pct:.2f}")
    for key, row in rows.items():
        windows, preset = key.split("/")
        if windows == "fp8":
            base = rows[f"bf16/{preset}"]["chunk_nll"]
            row["vs_bf16_windows_pct"], row["vs_bf16_windows_se_pct"] = paired_change(
                row["chunk_nll"], base
            )
            print(
                f"{preset}: fp8 windows vs bf16 windows {row['vs_bf16_windows_pct']:+.3f}% ± "
                f"{row['vs_bf16_windows_se_pct']:.3f}"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"fp8_windows_{args.model}.json"
    payload = {
        "command": "python packages/kvarn-eval/scripts/fp8_windows.py "
        f"--model {args.model} --presets {args.presets} --chunks {args.chunks} "
        f"--tokens {args.tokens}",
        "source": source,
        "rows": rows,
        "seconds": time.time() - started,
    }
    path.write_text(json.dumps(payload, indent=1))
    print(f"wrote {path} ({payload['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
