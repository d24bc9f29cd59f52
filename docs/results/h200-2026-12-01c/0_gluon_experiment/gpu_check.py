"""On an H100/H200: correctness of the Gluon decode kernel, then its time against decode_attention.

    python gpu_check.py --out DIR [--quick]

1. Correctness: random records (kvarn_kernels.quantize_tiles, keys rotated), queries rotated with
   kvarn_kernels.rotate, reference = decode_tiles (rotated frame) + fp32 softmax in torch. Every
   Gluon variant (FOLD on/off, maxnreg 128 or none, split 1 or several) is checked; a variant that
   fails to compile or to run is recorded with its error and the script goes on.
2. Timing, for (batch, context) in (16, 16384), (64, 16384), (256, 4096), (64, 4096), 32 query /
   8 KV heads, kvarn_k4v2_g128, fp16: the Gluon kernel (partial + combine launches) against
   kvarn_kernels.decode_attention on the same cache with seq_len = quantized_len = context (no
   staged tokens; it also rotates the query and un-rotates the output, which the Gluon path does
   not: a few microseconds). triton.testing.do_bench (median) and CUDA graphs where they capture.
   GB/s = record bytes read (batch * Hkv * tiles * tile_bytes) / time.

Writes DIR/gpu_check.json and DIR/gpu_check.md; prints the markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch
import triton

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

PRESET = "kvarn_k4v2_g128"
D = 128
G = 128
HQ, HKV = 32, 8
SHAPES = [(16, 16384), (64, 16384), (256, 4096), (64, 4096)]


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-4000:]}"


def make_case(batch: int, context: int, device: torch.device, template_count: int = 64, seed: int = 0):
    """A paged cache of ``batch`` sequences of ``context // G`` complete tiles (records repeated
    from ``template_count`` random ones, as kvarn_kernels.bench does), a shuffled block table,
    fp16 queries (original frame) and their rotated copy."""
    from kvarn_kernels import quantize_tiles, rotate

    gen = torch.Generator(device=device).manual_seed(seed)
    k = torch.randn((template_count, HKV, G, D), generator=gen, device=device).to(torch.float16)
    k = k + 2.0 * torch.randn((1, HKV, 1, D), generator=gen, device=device).to(torch.float16)
    v = torch.randn((template_count, HKV, G, D), generator=gen, device=device).to(torch.float16)
    template = quantize_tiles(k, v, PRESET, raw_keys=False)  # keys stored rotated
    tiles = context // G
    nblocks = batch * tiles
    reps = -(-nblocks // template.shape[0])
    cache = template.repeat(reps, 1, 1)[:nblocks].contiguous()
    perm = torch.randperm(nblocks, generator=torch.Generator().manual_seed(seed + 1)).to(torch.int32)
    block_table = perm.view(batch, tiles).to(device)
    num_tiles = torch.full((batch,), tiles, dtype=torch.int32, device=device)
    q = torch.randn((batch, HQ, D), generator=gen, device=device).to(torch.float16)
    q_rot = rotate(q)  # fp16, the frame of the stored keys
    return cache, block_table, num_tiles, q, q_rot


def reference(cache, block_table, num_tiles, q_rot, scale, rows: int) -> torch.Tensor:
    """fp32 softmax attention over decode_tiles (rotated frame), first ``rows`` sequences."""
    from kvarn_kernels import decode_tiles

    outs = []
    group = HQ // HKV
    for b in range(rows):
        recs = cache[block_table[b, : int(num_tiles[b])].long()]  # [n, Hkv, tb]
        k, v = decode_tiles(recs, PRESET, D)  # [n, Hkv, G, D] fp32
        k = k.permute(1, 0, 2, 3).reshape(HKV, -1, D)
        v = v.permute(1, 0, 2, 3).reshape(HKV, -1, D)
        qq = q_rot[b].float().view(HKV, group, D)
        s = torch.einsum("hgd,htd->hgt", qq, k) * scale
        p = torch.softmax(s, dim=-1)
        outs.append(torch.einsum("hgt,htd->hgd", p, v).reshape(HQ, D))
    return torch.stack(outs)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    e = (got.float() - ref.float()).abs()
    return {
        "max_rel": float(e.max() / ref.abs().max()),
        "rms_rel": float((e.pow(2).mean() / ref.pow(2).mean()).sqrt()),
    }


VARIANTS = [
    {"fold_k": True, "fold_v": True, "maxnreg": 128},
    {"fold_k": True, "fold_v": True, "maxnreg": None},
    {"fold_k": False, "fold_v": False, "maxnreg": None},
]


def _gluon(q_rot, cache, bt, nt, scale, variant, num_splits=None):
    from gluon_decode import gluon_decode_attention

    return gluon_decode_attention(
        q_rot, cache, bt, nt, scale, num_splits=num_splits, fold_k=variant["fold_k"],
        fold_v=variant["fold_v"], maxnreg=variant["maxnreg"],
    )


def _vname(v) -> str:
    return f"fold_k={int(v['fold_k'])},fold_v={int(v['fold_v'])},maxnreg={v['maxnreg']}"


def correctness(device, results):
    scale = 1.0 / math.sqrt(D)
    cache, bt, nt, q, q_rot = make_case(4, 8 * G, device, template_count=16)
    nt = torch.tensor([8, 5, 1, 3], dtype=torch.int32, device=device)  # uneven lengths
    ref = reference(cache, bt, nt, q_rot, scale, rows=4)
    # decode_attention on the same records, for scale (original frame -> un-rotated back)
    try:
        from kvarn_kernels import rotate
        from kvarn_kernels.attention import decode_attention
        from kvarn_kernels.cache import allocate_staging

        staging = allocate_staging(4, HKV, D, PRESET, torch.float16, device)
        lens = nt * G
        slots = torch.arange(4, dtype=torch.int32, device=device)
        out = decode_attention(q, cache, staging, bt, lens, lens, slots, PRESET, scale, raw_keys=False)
        results["correctness"]["triton decode_attention"] = _rel(rotate(out.float()), ref)
    except Exception as exc:
        results["correctness"]["triton decode_attention"] = {"error": _err(exc)}
    for variant in VARIANTS:
        for splits in (1, 3):
            name = f"gluon {_vname(variant)} splits={splits}"
            try:
                got = _gluon(q_rot, cache, bt, nt, scale, variant, num_splits=splits)
                torch.cuda.synchronize()
                results["correctness"][name] = _rel(got, ref)
            except Exception as exc:
                results["correctness"][name] = {"error": _err(exc)}
            print(name, results["correctness"][name] if "error" not in results["correctness"][name]
                  else results["correctness"][name]["error"][:300], flush=True)


def _time(fn, quick: bool) -> dict[str, float | None]:
    fn()
    torch.cuda.synchronize()
    eager = triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=40 if quick else 100,
                                    return_mode="median")
    try:
        graph = triton.testing.do_bench_cudagraph(fn, rep=20 if quick else 50, return_mode="median")
    except Exception:
        torch.cuda.synchronize()
        graph = None
    return {"eager_us": eager * 1e3, "graph_us": None if graph is None else graph * 1e3}


def timing(device, results, quick: bool):
    from kvarn_kernels.attention import decode_attention
    from kvarn_kernels.cache import allocate_staging
    from kvarn_math import tile_layout

    tb = tile_layout(PRESET, D).tile_bytes
    scale = 1.0 / math.sqrt(D)
    for batch, context in SHAPES:
        row = {"batch": batch, "context": context}
        try:
            cache, bt, nt, q, q_rot = make_case(batch, context, device)
        except Exception as exc:
            row["error"] = _err(exc)
            results["timing"].append(row)
            continue
        nbytes = batch * HKV * (context // G) * tb
        row["record_bytes"] = nbytes
        staging = allocate_staging(batch, HKV, D, PRESET, torch.float16, device)
        lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        slots = torch.arange(batch, dtype=torch.int32, device=device)
        out = torch.empty_like(q)

        def tri():
            return decode_attention(q, cache, staging, bt, lens, lens, slots, PRESET, scale,
                                    out=out, raw_keys=False)

        try:
            row["triton"] = _time(tri, quick)
        except Exception as exc:
            row["triton"] = {"error": _err(exc)}
        for variant in VARIANTS:
            name = _vname(variant)
            try:
                from gluon_decode import default_splits

                sms = torch.cuda.get_device_properties(device).multi_processor_count
                splits = default_splits(batch, HKV, context // G, sms)
                row.setdefault("gluon_splits", splits)
                row[f"gluon {name}"] = _time(
                    lambda v=variant, s=splits: _gluon(q_rot, cache, bt, nt, scale, v, s), quick
                )
            except Exception as exc:
                row[f"gluon {name}"] = {"error": _err(exc)}
        for key, val in list(row.items()):
            if isinstance(val, dict) and "eager_us" in val:
                us = val["graph_us"] if val["graph_us"] is not None else val["eager_us"]
                val["us"] = us
                val["GBps"] = nbytes / (us * 1e-6) / 1e9
        results["timing"].append(row)
        print(json.dumps(row)[:2000], flush=True)
        del cache
        torch.cuda.empty_cache()


def markdown(results) -> str:
    lines = ["## Correctness (relative to decode_tiles + fp32 softmax, rotated frame)", "",
             "| kernel | max rel | rms rel |", "| --- | ---: | ---: |"]
    for name, r in results["correctness"].items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'].splitlines()[0][:120]} | |")
        else:
            lines.append(f"| {name} | {r['max_rel']:.2e} | {r['rms_rel']:.2e} |")
    lines += ["", "## Time (us, CUDA graph where it captured, else do_bench median) and GB/s of records", ""]
    names = ["triton"] + [f"gluon {_vname(v)}" for v in VARIANTS]
    lines.append("| batch | context | splits (gluon) | " + " | ".join(names) + " |")
    lines.append("| ---: | ---: | ---: | " + " | ".join("---:" for _ in names) + " |")
    for row in results["timing"]:
        cells = []
        for n in names:
            v = row.get(n, {})
            if not v or "error" in v:
                cells.append("error" if v else "-")
            else:
                cells.append(f"{v['us']:.1f} ({v['GBps']:.0f} GB/s)")
        lines.append(f"| {row['batch']} | {row['context']} | {row.get('gluon_splits', '-')} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    results = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "correctness": {},
        "timing": [],
    }
    try:
        correctness(device, results)
    except Exception as exc:
        results["correctness"]["setup"] = {"error": _err(exc)}
    (out / "gpu_check.json").write_text(json.dumps(results, indent=1))
    if not args.skip_timing:
        timing(device, results, args.quick)
    md = markdown(results)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=1))
    (out / "gpu_check.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
