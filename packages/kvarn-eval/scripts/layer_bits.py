"""Per-layer choice between k4v2 and k3v3, two recipes with the same bytes (perplexity, CPU).

recipe_sweep.py found k3v3 (3 + 3 bits, exactly kvarn_k4v2_g128's bytes and page size) better
than k4v2 on SmolLM2 and no better on Gemma-3. This asks whether a per-layer choice beats both,
without tuning on the text it is judged on:

1. calibration: WikiText-2 chunks after the ones the benchmark uses (``--calib-chunks``); one
   method per layer L, "k4v2 everywhere, k3v3 at L", paired against plain k4v2; the layers
   whose k3v3 lowers the calibration NLL form the mix;
2. validation: the benchmark's own chunks (the first ``--chunks``), plain k4v2, k3v3
   everywhere and the mix, each paired against plain k4v2.

    python packages/kvarn-eval/scripts/layer_bits.py [--model gemma3-270m --tokens 512]
    # the chosen mix again, on 16 chunks of text after the calibration chunks:
    python packages/kvarn-eval/scripts/layer_bits.py --layers 0,2,3 --skip 12 --chunks 16
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

BLOCK = 128
REPO = Path(__file__).resolve().parents[3]
_LAYER = {"index": -1}  # the attention layer running now (set by forward pre-hooks)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m or gemma3-270m")
    parser.add_argument("--chunks", type=int, default=8, help="validation chunks (the first)")
    parser.add_argument("--calib-chunks", type=int, default=4, help="calibration chunks (after)")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument(
        "--layers",
        default=None,
        help="skip calibration: these k3v3 layers (comma-separated), judged on --chunks chunks "
        "taken after --skip chunks (a replication on other text)",
    )
    parser.add_argument("--skip", type=int, default=0, help="with --layers: chunks to skip first")
    parser.add_argument(
        "--tag",
        default=None,
        help="output file TAG_MODEL.json (layer_bits, or layer_bits_replication with --layers)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "cpu-2026-11-30")
    args = parser.parse_args()
    if args.tag is None:
        args.tag = "layer_bits" if args.layers is None else "layer_bits_replication"

    from kvarn_eval.accuracy import evaluate_perplexity, install, select_methods
    from kvarn_eval.accuracy.summary import paired_change
    from kvarn_eval.data import find_wikitext
    from kvarn_eval.models import load_model
    from kvarn_eval.suites import text_chunks
    from kvarn_math.baselines import KVarN, Method
    from kvarn_math.layout import Preset

    plain = KVarN.of("kvarn_k4v2_g128")

    @dataclass(frozen=True)
    class K3V3(KVarN):
        @property
        def preset(self) -> Preset:
            return Preset.from_bits(3, 3, self.group_size)

    k3v3 = K3V3(name="kvarn_k3v3_g128", group_size=128)

    @dataclass(frozen=True)
    class PerLayer(Method):
        """k3v3 in the layers of ``k3v3_layers``, k4v2 elsewhere (same bytes everywhere)."""

        name: str = "mix"
        k3v3_layers: frozenset[int] = field(default_factory=frozenset)

        def bytes_per_token_per_head(self, head_dim: int) -> float:
            return plain.bytes_per_token_per_head(head_dim)

        def roundtrip(self, k, v):  # type: ignore[no-untyped-def]
            chosen = k3v3 if _LAYER["index"] in self.k3v3_layers else plain
            return chosen.roundtrip(k, v)

    started = time.time()
    lm = load_model(args.model)
    install(lm.model)
    layers = lm.model.model.layers
    for i, layer in enumerate(layers):
        layer.self_attn.register_forward_pre_hook(
            lambda _m, _a, i=i: _LAYER.__setitem__("index", i)
        )
    text, source = find_wikitext()
    if args.layers is None:
        every = text_chunks(lm.tokenizer, text, args.chunks + args.calib_chunks, args.tokens)
        valid, calib = every[: args.chunks], every[args.chunks :]
    else:
        valid = text_chunks(lm.tokenizer, text, args.skip + args.chunks, args.tokens)[args.skip :]
    bf16 = select_methods("bf16", BLOCK)

    def run(chunks, methods):  # type: ignore[no-untyped-def]
        result = evaluate_perplexity(
            lm.model,
            chunks,
            [*bf16, *methods],
            head_dim=lm.head_dim,
            block_size=BLOCK,
            sink_tokens=BLOCK,
            suite="wikitext",
            source=source,
        )
        return {r.method: r for r in result.rows if r.method != "bf16"}

    def vs(rows, name, base):  # type: ignore[no-untyped-def]
        return paired_change(rows[name].chunk_nll, rows[base].chunk_nll)

    # 1. calibration: one layer at a time
    per_layer: dict[int, dict[str, float]] = {}
    if args.layers is None:
        singles = [
            PerLayer(name=f"k3v3@{i}", k3v3_layers=frozenset({i})) for i in range(len(layers))
        ]
        calib_rows = run(calib, [PerLayer(name="k4v2", k3v3_layers=frozenset()), *singles])
        for i, method in enumerate(singles):
            d, se = vs(calib_rows, method.name, "k4v2")
            per_layer[i] = {"vs_k4v2_pct": d, "se_pct": se}
            print(f"layer {i:2d}: k3v3 there {d:+.3f}% ± {se:.3f} (calibration)")
        chosen = frozenset(i for i, r in per_layer.items() if r["vs_k4v2_pct"] < 0)
    else:
        chosen = frozenset(int(x) for x in args.layers.split(",") if x.strip())
    print(f"k3v3 layers: {sorted(chosen)} ({len(chosen)} of {len(layers)})")

    # 2. validation on the benchmark's chunks
    mix = PerLayer(name="mix", k3v3_layers=chosen)
    rows = run(valid, [plain, k3v3, mix])
    validation = {}
    for name, row in rows.items():
        validation[name] = {
            "delta_pct": row.delta_pct,
            "delta_se_pct": row.delta_se_pct,
            "kl": row.kl,
            "top1": row.top1,
        }
        line = f"{name}: {row.delta_pct:+.2f}% ± {row.delta_se_pct:.2f}, KL {row.kl:.5f}"
        if name != plain.name:
            d, se = vs(rows, name, plain.name)
            validation[name].update(vs_k4v2_pct=d, vs_k4v2_se_pct=se)
            line += f"; vs k4v2 {d:+.2f} ± {se:.2f}"
        print(line)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.tag}_{args.model}.json"
    payload = {
        "command": "python packages/kvarn-eval/scripts/layer_bits.py "
        f"--model {args.model} --chunks {args.chunks} --calib-chunks {args.calib_chunks} "
        f"--tokens {args.tokens} --tag {args.tag}"
        + ("" if args.layers is None else f" --layers {args.layers} --skip {args.skip}"),
        "source": source,
        "calibration": per_layer,
        "k3v3_layers": sorted(chosen),
        "validation": validation,
        "seconds": time.time() - started,
    }
    path.write_text(json.dumps(payload, indent=1))
    print(f"wrote {path} ({payload['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
