"""Quantizer variants KVARN.md proposes to test, against the plain preset (perplexity, CPU).

KVARN.md lists ideas "worth testing (each costs bytes or time; keep the ones that pay)". Two of
them change only how a tile is quantized, not its bytes, and are measured here under
pseudo-decode (WikiText-2, 8 x 1024 tokens, blocks of 128, first block exact, reference bf16;
SmolLM2, or Gemma-3 with ``--model gemma3-270m --tokens 512``), each paired chunk by chunk
against the plain preset:

* ``clip`` / ``clip_v``: "clipping chosen to minimise error rather than min/max range".
  kvarn-math's experimental ``clip_ratios`` also tries each row's RTN range shrunk about its
  midpoint by each ratio and keeps the candidate with the least squared error; on keys and
  values, or on values only (the 2-bit half of k4v2).
* ``signsN``: "random-sign Hadamard", ``diag(s) H`` with ``s = kvarn_math.random_signs(D, N)``
  instead of ``H`` (applied as a sign flip of the channels before the preset's own rotation and
  after its inverse; the flips are orthogonal, so attention is unchanged by them).
* ``kXvY``: other key / value bits at the same tile; ``k3v3`` stores exactly k4v2's bytes, so
  it could replace k4v2 in any layer without changing the page size ("more bits for the few
  layers or heads that are most sensitive, at the same average").
* ``log8``: the balancing factors (``k_token_scale`` per token, ``v_channel_scale`` per channel)
  in one byte each instead of fp16: ``2^(n/16 - 1)``, steps of 4.4%, rounded before the rows
  are quantized, so the codes adapt to the rounded factors. ``G + D`` bytes less per record (256
  at G = D = 128: 108 -> 106 bytes per token and head), a format change if it costs nothing.

    python packages/kvarn-eval/scripts/recipe_sweep.py [--model M] [--variants clip,signs0]
"""

from __future__ import annotations

import argparse
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

BLOCK = 128
REPO = Path(__file__).resolve().parents[3]


def log8(c):  # type: ignore[no-untyped-def]
    """Positive factors rounded to ``2^(n/16 - 1)``, ``n`` in 0..255 (one byte)."""
    import numpy as np

    n = np.clip(np.rint(16.0 * np.log2(c)) + 16.0, 0.0, 255.0)
    return np.exp2(n / 16.0 - 1.0).astype(np.float32)


def balanced_rtn(x, bits: int):  # type: ignore[no-untyped-def]
    """kvarn-math's tile encoding of ``x`` ``[..., R, C]`` (rows quantized, columns balanced),
    with the column factors log8-rounded before the rows are quantized; returns the decoded
    tile as the record would give it (row scale and zero as fp16)."""
    import numpy as np
    from kvarn_math.rtn import quantize_rows
    from kvarn_math.varnorm import variance_normalize

    b = variance_normalize(x)
    cq = log8(b.col_scale)
    q = quantize_rows(x / (b.row_scale[..., None] * cq[..., None, :]), bits)
    fp16 = np.float16
    scale = (q.step * b.row_scale).astype(fp16).astype(np.float32)
    zero = (q.lo * b.row_scale).astype(fp16).astype(np.float32)
    return (q.codes * scale[..., None] + zero[..., None]) * cq[..., None, :]


def log8_roundtrip(k, v, preset, group: int):  # type: ignore[no-untyped-def]
    """``(k_hat, v_hat)`` ``[T, H, D]`` of the preset with log8 balancing factors."""
    import numpy as np
    from kvarn_math.hadamard import rotate, unrotate

    ka, va = np.asarray(k, np.float32), np.asarray(v, np.float32)
    t, h, d = ka.shape

    def tiles(x):  # type: ignore[no-untyped-def]
        return rotate(x.reshape(t // group, group, h, d).transpose(0, 2, 1, 3), axis=-1)

    def untiles(x):  # type: ignore[no-untyped-def]
        return unrotate(x, axis=-1).transpose(0, 2, 1, 3).reshape(t, h, d).astype(np.float32)

    k_dg = balanced_rtn(np.swapaxes(tiles(ka), -1, -2), preset.key_bits)  # rows: channels
    v_gd = balanced_rtn(tiles(va), preset.value_bits)  # rows: tokens
    return untiles(np.swapaxes(k_dg, -1, -2)), untiles(v_gd)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m or gemma3-270m")
    parser.add_argument("--preset", default="kvarn_k4v2_g128")
    parser.add_argument("--ratios", default="0.95,0.9,0.85,0.8,0.75,0.7", help="for clip*")
    parser.add_argument("--variants", default="clip,clip_v,signs0,signs1,signs2")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--tag", default="recipe_sweep", help="output file: TAG_MODEL.json")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "cpu-2026-11-30")
    args = parser.parse_args()
    ratios = tuple(float(r) for r in args.ratios.split(","))

    from kvarn_eval.accuracy import evaluate_perplexity, install, select_methods
    from kvarn_eval.accuracy.summary import paired_change
    from kvarn_eval.data import find_wikitext
    from kvarn_eval.models import load_model
    from kvarn_eval.suites import _text_chunks
    from kvarn_math.baselines import KVarN, Method
    from kvarn_math.hadamard import random_signs
    from kvarn_math.layout import Preset

    plain = KVarN.of(args.preset)
    clipped = KVarN.of(args.preset, clip_ratios=ratios)

    @dataclass(frozen=True)
    class ValuesClipped(Method):
        """Keys as the plain preset, values with the clip search (records are per half)."""

        name: str = f"{args.preset}+clip_v"

        def bytes_per_token_per_head(self, head_dim: int) -> float:
            return plain.bytes_per_token_per_head(head_dim)

        def roundtrip(self, k, v):  # type: ignore[no-untyped-def]
            return plain.roundtrip(k, v)[0], clipped.roundtrip(k, v)[1]

    @dataclass(frozen=True)
    class RandomSigns(Method):
        """The plain preset behind a seeded channel sign flip: diag(s) H instead of H."""

        name: str = f"{args.preset}+signs0"
        seed: int = 0

        def bytes_per_token_per_head(self, head_dim: int) -> float:
            return plain.bytes_per_token_per_head(head_dim)

        def roundtrip(self, k, v):  # type: ignore[no-untyped-def]
            s = random_signs(k.shape[-1], self.seed).astype("float32")
            k_hat, v_hat = plain.roundtrip(k * s, v * s)
            return k_hat * s, v_hat * s

    @dataclass(frozen=True)
    class OtherBits(KVarN):
        """KVarN with other key / value bit widths at the preset's tile (``kXvY``), e.g. k3v3,
        which has exactly k4v2's bytes (3 + 3 = 4 + 2 bits, the same scales)."""

        key_bits: int = 4
        value_bits: int = 2

        @property
        def preset(self) -> Preset:
            return Preset.from_bits(self.key_bits, self.value_bits, self.group_size)

    @dataclass(frozen=True)
    class Log8Balance(Method):
        """The plain preset with one-byte log-coded balancing factors (``log8`` above)."""

        name: str = f"{args.preset}+log8"

        def bytes_per_token_per_head(self, head_dim: int) -> float:
            g = plain.group_size
            return plain.bytes_per_token_per_head(head_dim) - (g + head_dim) / g

        def roundtrip(self, k, v):  # type: ignore[no-untyped-def]
            return log8_roundtrip(k, v, plain.preset, plain.group_size)

    variants: list[Method] = []
    for name in filter(None, (v.strip() for v in args.variants.split(","))):
        if name == "clip":
            variants.append(clipped)
        elif name == "clip_v":
            variants.append(ValuesClipped())
        elif re.fullmatch(r"k[1-8]v[1-8]", name):
            kb, vb = int(name[1]), int(name[3])
            variants.append(
                OtherBits(
                    name=f"{args.preset}+{name}",
                    group_size=plain.group_size,
                    key_bits=kb,
                    value_bits=vb,
                )
            )
        elif name.startswith("signs") and name[5:].isdigit():
            variants.append(RandomSigns(name=f"{args.preset}+{name}", seed=int(name[5:])))
        elif name == "log8":
            variants.append(Log8Balance())
        else:
            parser.error(f"unknown variant {name!r}: expected clip, clip_v, signsN, kXvY or log8")

    started = time.time()
    lm = load_model(args.model)
    install(lm.model)
    text, source = find_wikitext()
    chunks = _text_chunks(lm.tokenizer, text, args.chunks, args.tokens)
    methods = [*select_methods("bf16", BLOCK), plain, *variants]
    result = evaluate_perplexity(
        lm.model,
        chunks,
        methods,
        head_dim=lm.head_dim,
        block_size=BLOCK,
        sink_tokens=BLOCK,
        suite="wikitext",
        source=source,
    )
    rows: dict[str, dict] = {}
    for row in result.rows:
        if row.method == "bf16":
            continue
        rows[row.method] = {
            "delta_pct": row.delta_pct,
            "delta_se_pct": row.delta_se_pct,
            "kl": row.kl,
            "top1": row.top1,
            "chunk_nll": row.chunk_nll,
        }
        print(f"{row.method}: {row.delta_pct:+.2f}% ± {row.delta_se_pct:.2f}, KL {row.kl:.5f}")
    base = rows[plain.name]["chunk_nll"]
    for name, row in rows.items():
        if name != plain.name:
            row["vs_plain_pct"], row["vs_plain_se_pct"] = paired_change(row["chunk_nll"], base)
            print(
                f"{name} vs {plain.name}: {row['vs_plain_pct']:+.2f}% ± {row['vs_plain_se_pct']:.2f}"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.tag}_{args.model}.json"
    payload = {
        "command": "python packages/kvarn-eval/scripts/recipe_sweep.py "
        f"--model {args.model} --preset {args.preset} --ratios {args.ratios} "
        f"--variants {args.variants} --chunks {args.chunks} --tokens {args.tokens} "
        f"--tag {args.tag}",
        "source": source,
        "ratios": ratios,
        "variants": args.variants,
        "rows": rows,
        "seconds": time.time() - started,
    }
    path.write_text(json.dumps(payload, indent=1))
    print(f"wrote {path} ({payload['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
