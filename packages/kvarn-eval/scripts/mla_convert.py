"""MLA evidence from real weights: convert a model to MLA form, measure latent recipes and presets.

1. Perplexity of the original model (float32, exact attention) on WikiText-2 chunks.
2. Conversion (:mod:`kvarn_eval.accuracy.mla`) calibrated on chunks from the *end* of the text
   (disjoint from the scored ones); the converted model's perplexity with a bf16 latent cache.
3. ``--sweep``: the real latents and RoPE keys of every layer on the first scored chunk, through
   each candidate recipe (:mod:`kvarn_math.mla_recipes`): relative RMS error of the latent and
   of the RoPE key, and the bytes a token would take at the real MLA shape (512 + 64).
4. Pseudo-decode (128-token blocks, first block exact): perplexity change, KL and top-1 against
   the converted model's bf16 latent cache, for the presets and the baselines.

The latent is zero-padded to the next supported width (256) for the recipes and presets: the
padding channels are exactly zero, and the up-projections never read them.

    python packages/kvarn-eval/scripts/mla_convert.py --out DIR [--chunks 4] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from kvarn_eval.accuracy.mla import (
    LatentQuantization,
    MLAAttention,
    MLAConversion,
    collected_latents,
    convert_model,
    latent_quantization,
)
from kvarn_eval.data import find_wikitext
from kvarn_eval.models import load_model
from kvarn_math.mla_recipes import Bf16Latent, Fp8DsMla, LatentRecipe

PAD_TO = 256


class Padded:
    """A latent method applied to the latent zero-padded to ``width`` channels."""

    def __init__(self, method: Any, width: int = PAD_TO) -> None:
        self.method, self.width = method, width
        self.name, self.group_size = method.name, method.group_size

    def roundtrip(self, latent: np.ndarray, rope: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        t, w = latent.shape
        pad = np.zeros((t, self.width), np.float32)
        pad[:, :w] = latent
        back, back_pe = self.method.roundtrip(pad, rope)
        return back[:, :w], back_pe


def sweep_recipes() -> list[Any]:
    """The candidates: rotation, normalization, group axis and width, scale precision, RoPE.

    Per-token groups are given as groups a token (``g1`` = the whole row, ``g2`` = two halves:
    256 channels each at the real width 512), so the converted model's narrower latent is
    quantized with the parameter budget of the real shape."""
    r = LatentRecipe
    out: list[Any] = [Bf16Latent(), Fp8DsMla()]
    for rope in ("bf16", "fp8", "int8"):
        out.append(r(f"rtn4_g1_{rope}", groups=1, rope=rope))
    for n in (2, 4, 8):
        for scales in ("fp16", "log8"):
            out.append(r(f"rtn4_g{n}_{scales}", groups=n, scales=scales, rope="int8"))
    out += [
        r("rtn4_g2_had", groups=2, rope="int8", rotate=True),
        r("rtn4_g2_varnorm", groups=2, rope="int8", varnorm=True),
        r("rtn4_g4_log8_had", groups=4, scales="log8", rope="int8", rotate=True),
        r("rtn4_g1_had", groups=1, rope="int8", rotate=True),
        r("kivi4_t128_fp16", axis="channel", tile=128, rope="int8"),
        r("kivi4_t128_log8", axis="channel", tile=128, scales="log8", rope="int8"),
        r("kivi4_t64_log8", axis="channel", tile=64, scales="log8", rope="int8"),
        r("kivi4_t128_log8_had", axis="channel", tile=128, scales="log8", rope="int8", rotate=True),
        r("rtn2_g2", bits=2, groups=2, rope="int8"),
        r("rtn2_g8_log8", bits=2, groups=8, scales="log8", rope="int8"),
        r("rtn2_g2_had", bits=2, groups=2, rope="int8", rotate=True),
        r("kivi2_t128_log8", bits=2, axis="channel", tile=128, scales="log8", rope="int8"),
        r("rtn3_g4_log8", bits=3, groups=4, scales="log8", rope="int8"),
    ]
    return out


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30))


def run_sweep(latents: list[tuple[int, np.ndarray, np.ndarray]], block: int) -> list[dict]:
    rows = []
    for method in sweep_recipes():
        m = Padded(method)
        errs, pe_errs = [], []
        for _, lat, pe in latents:
            t = (lat.shape[0] // block) * block
            back, back_pe = m.roundtrip(lat[:t], pe[:t])
            errs.append(_rel(lat[:t], back))
            pe_errs.append(_rel(pe[:t], back_pe))
        rows.append(
            {
                "recipe": method.name,
                "latent_rel_rms": float(np.mean(errs)),
                "rope_rel_rms": float(np.mean(pe_errs)),
                "bytes_512_64": method.bytes_per_token(512, 64),
            }
        )
        print(
            f"| {method.name} | {rows[-1]['bytes_512_64']:g} | {rows[-1]['latent_rel_rms']:.4f}"
            f" | {rows[-1]['rope_rel_rms']:.4f} |",
            flush=True,
        )
    return rows


def chunk_logits(model: Any, chunks: list[list[int]], method: Any | None) -> list[torch.Tensor]:
    """Log-probabilities ``[T - 1, V]`` per chunk with earlier blocks read through ``method``."""
    out = []
    config = LatentQuantization(method, 128, 128)
    with torch.no_grad(), latent_quantization(config):
        for ids in chunks:
            out.append(model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1))
    return out


def score(ref: list[torch.Tensor], got: list[torch.Tensor], chunks: list[list[int]]) -> dict:
    nll = kl = top1 = 0.0
    n = 0
    for r, g, ids in zip(ref, got, chunks, strict=True):
        target = torch.tensor(ids[1:])
        nll += float(-g.gather(1, target[:, None]).sum())
        kl += float((r.exp() * (r - g)).sum())
        top1 += float((r.argmax(-1) == g.argmax(-1)).sum())
        n += len(ids) - 1
    return {"ppl": math.exp(nll / n), "kl": kl / n, "top1": top1 / n}


def pseudo_decode_methods() -> list[Any]:
    """The presets (as recipes with their real-shape budget: ``kvarn_mla_l4_g128`` is 2
    groups a token, fp16 step and zero, int8 RoPE) and the baselines."""
    r = LatentRecipe
    return [
        r("kvarn_mla_l4_g128", groups=2, rope="int8"),
        r("rtn4_g1_int8", groups=1, rope="int8"),
        r("rtn4_g1_fp8", groups=1, rope="fp8"),
        Fp8DsMla(),
        r("kvarn_mla_l2_g128", bits=2, groups=2, rope="int8"),
        r("rtn4_g2_had", groups=2, rope="int8", rotate=True),
        r("kivi4_t128_log8", axis="channel", tile=128, scales="log8", rope="int8"),
        r("rtn2_g8_log8", bits=2, groups=8, scales="log8", rope="int8"),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--calib-chunks", type=int, default=4)
    parser.add_argument("--rank", type=int, default=256)
    parser.add_argument("--rope-pairs", type=int, default=32)
    parser.add_argument("--nope-freqs", type=int, default=12)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--no-decode", action="store_true", help="skip the pseudo-decode")
    parser.add_argument("--methods", nargs="*", help="only these pseudo-decode methods")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    lm = load_model(args.model, threads=args.threads)
    text, source = find_wikitext()
    ids = list(lm.tokenizer(text, add_special_tokens=False)["input_ids"])
    t = args.tokens
    chunks = [ids[i * t : (i + 1) * t] for i in range(args.chunks)]
    calib = [ids[len(ids) - (i + 1) * t : len(ids) - i * t] for i in range(args.calib_chunks)]
    report: dict[str, Any] = {
        "model": args.model,
        "text": source,
        "args": vars(args) | {"out": str(args.out)},
    }
    start = time.time()
    orig = chunk_logits(lm.model, chunks, None)
    report["original"] = score(orig, orig, chunks)
    print("original", report["original"], f"{time.time() - start:.0f}s", flush=True)
    settings = MLAConversion(args.rank, args.rope_pairs, args.nope_freqs)
    saved = args.out / "converted.pt"
    if saved.exists():  # a conversion of the same settings, kept by an earlier run
        kept = torch.load(saved)
        if kept["settings"] != vars(settings):
            raise SystemExit(f"{saved} holds another conversion ({kept['settings']})")
        heads = lm.model.config.num_attention_heads
        for layer, buffers in zip(lm.model.model.layers, kept["buffers"], strict=True):
            layer.self_attn = MLAAttention(layer.self_attn, buffers, heads)
        stats = kept["stats"]
    else:
        stats = convert_model(lm.model, calib, settings)
        buffers = [dict(layer.self_attn.named_buffers()) for layer in lm.model.model.layers]
        torch.save({"settings": vars(settings), "buffers": buffers, "stats": stats}, saved)
    report["conversion"] = {k: float(np.mean([s[k] for s in stats])) for k in stats[0]}
    report["latent_width"] = int(lm.model.model.layers[0].self_attn.w_dkv.shape[0])
    report["rope_width"] = 2 * args.rope_pairs
    print("conversion", report["conversion"], report["latent_width"], flush=True)
    ref = chunk_logits(lm.model, chunks, Padded(Bf16Latent()))
    # perplexity of the converted model with a bf16 latent cache; KL and top-1 against the
    # original model
    report["converted_bf16"] = score(orig, ref, chunks)
    print("converted bf16", report["converted_bf16"], flush=True)
    if args.sweep:
        with torch.no_grad(), collected_latents() as seen:
            lm.model(torch.tensor([chunks[0]]))
        arrays = {f"latent_{i}": s[1] for i, s in enumerate(seen)}
        arrays |= {f"rope_{i}": s[2] for i, s in enumerate(seen)}
        np.savez_compressed(args.out / "latents.npz", **arrays)
        print("| recipe | bytes/token at 512+64 | latent rel. RMS | RoPE rel. RMS |")
        print("| --- | ---: | ---: | ---: |")
        report["sweep"] = run_sweep(seen, 128)
    if not args.no_decode:
        report["pseudo_decode"] = []
        base = report["converted_bf16"]["ppl"]
        for method in pseudo_decode_methods():
            if args.methods and method.name not in args.methods:
                continue
            got = chunk_logits(lm.model, chunks, Padded(method))
            row = {"method": method.name, "bytes_512_64": method.bytes_per_token(512, 64)}
            row |= score(ref, got, chunks)
            row["ppl_change"] = row["ppl"] / base - 1
            report["pseudo_decode"].append(row)
            print(
                f"| {row['method']} | {row['bytes_512_64']:g} | {row['ppl']:.3f} | "
                f"{row['ppl_change']:+.2%} | {row['kl']:.5f} | {row['top1']:.4f} |",
                flush=True,
            )
    (args.out / "mla_report.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
