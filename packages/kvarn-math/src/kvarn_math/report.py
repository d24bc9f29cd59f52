"""``kvarn-math-report``: bytes and reconstruction error of every method on synthetic KV.

For each head_dim, every KVarN preset and every baseline quantize the same synthetic keys
(outlier channels, like post-RoPE keys) and values (Gaussian); the table gives bytes per
token per head, the ratio to fp16, SQNR of K and V, and the relative error of attention
outputs for random queries.  Synthetic data ranks methods on one distribution only; real
models are measured by kvarn-eval.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from kvarn_math.baselines import Method, standard_methods
from kvarn_math.metrics import attention_output_error, sqnr_db
from kvarn_math.testing_data import synthetic_kv

__all__ = ["Row", "measure", "format_report", "main"]

Row = dict[str, float | str | int]


def measure(
    head_dims: Sequence[int] = (64, 128, 256),
    tokens: int = 512,
    heads: int = 2,
    seed: int = 0,
    methods: Sequence[Method] | None = None,
) -> list[Row]:
    """Measure every method at every head_dim; returns one row per (method, head_dim)."""
    rows: list[Row] = []
    for d in head_dims:
        q, k, v = synthetic_kv(d, tokens, heads, seed)
        for m in methods if methods is not None else standard_methods():
            k_hat, v_hat = m.roundtrip(k, v)
            kt, vt = k.transpose(1, 0, 2), v.transpose(1, 0, 2)
            err = attention_output_error(
                q, kt, vt, k_hat.transpose(1, 0, 2), v_hat.transpose(1, 0, 2)
            )
            bpt = m.bytes_per_token_per_head(d)
            rows.append(
                {
                    "method": m.name,
                    "head_dim": d,
                    "bytes_per_token_per_head": bpt,
                    "bits_per_element": m.bits_per_element(d),
                    "ratio_to_fp16": 4 * d / bpt,
                    "sqnr_k_db": sqnr_db(k, k_hat),
                    "sqnr_v_db": sqnr_db(v, v_hat),
                    "attention_rel_error": err,
                }
            )
    return rows


def format_report(rows: Sequence[Row]) -> str:
    """Markdown table of :func:`measure`'s rows."""
    lines = [
        "| method | head_dim | bytes/token/head | bits/element | vs fp16 | SQNR K (dB) | SQNR V (dB) | attention rel. error |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| `{r['method']}` | {r['head_dim']} | {float(r['bytes_per_token_per_head']):g} | "
            f"{float(r['bits_per_element']):.2f} | {float(r['ratio_to_fp16']):.2f}x | "
            f"{float(r['sqnr_k_db']):.2f} | {float(r['sqnr_v_db']):.2f} | "
            f"{float(r['attention_rel_error']):.4f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the report (``kvarn-math-report --help`` for options)."""
    parser = argparse.ArgumentParser(prog="kvarn-math-report", description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--tokens", type=int, default=512, help="tokens per head (multiple of 128)")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.tokens <= 0 or args.tokens % 128:
        parser.error(f"--tokens must be a positive multiple of 128, got {args.tokens}")
    print(format_report(measure(args.head_dims, args.tokens, args.heads, args.seed)))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
