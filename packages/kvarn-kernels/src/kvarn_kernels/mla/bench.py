"""Benchmark of the MLA latent-cache kernels on a GPU.

    python -m kvarn_kernels.mla.bench [--out mla_bench.json] [--quick] [--sweep]

Measures in one run: the HBM bandwidth of a device-to-device copy; decode attention in latent
space (latent 512, RoPE 64; 16 and 128 query heads) over the quantized paged cache, batch x
context, eager and replayed from a CUDA graph: time, GB/s of the cache bytes read (records plus
the staged tail) and their fraction of the measured copy bandwidth; beside it, over the same
tokens as a dense bf16 latent (1,152 bytes a token), (a) the same absorbed decode in torch (two
cuBLAS batched matmuls and a softmax: ``bf16_torch``) and (b) vLLM's TritonMLA decode kernel
(``decode_attention_fwd``, 64-token pages: ``bf16_vllm_triton``) when vLLM imports; the
quantize-on-write cost and the dequantize/gather throughput. ``--sweep`` instead times other
launch settings (chunk rows, warps, heads a program, the dots transposed, splits, the portable
unpack) beside the default at batch 16, context 16K, first preset only. Writes JSON (``--out``, default ``$OUT/mla_bench.json`` when ``$OUT`` is set)
and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton  # type: ignore[import-untyped]
from kvarn_math.mla import get_mla_preset, mla_layout

from kvarn_kernels import settings
from kvarn_kernels.bench import measure_hbm_bandwidth
from kvarn_kernels.mla.launch import (
    _decode_config,
    _sm_count,
    allocate_mla_cache,
    choose_mla_splits,
    default_heads_per_program,
    dequantize_latent,
    mla_decode_attention,
    store_latent,
)
from kvarn_kernels.mla.verified import verified_splits

__all__ = ["main", "run", "markdown"]

L, R = 512, 64
TAIL = 37  # staged tokens after the last complete tile
DTYPE = [torch.bfloat16]  # the model dtype of the run (--dtype)
VLLM_PAGE = 64
SWEEP_SHAPE = (16, 16384)  # batch, context of --sweep


def _best_ms(fn: Callable[[], object], quick: bool, device: torch.device) -> dict[str, Any]:
    """Median ms of ``fn`` eager and replayed from a CUDA graph (``ms``: the graph's when it
    captures); on the CPU (``--dry-run``) one wall-clock run."""
    if device.type == "cpu":
        start = time.perf_counter()
        fn()
        ms = (time.perf_counter() - start) * 1e3
        return {"eager_ms": ms, "graph_ms": None, "ms": ms}
    rep = 40 if quick else 100
    eager = float(triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median"))
    try:
        torch.cuda.synchronize()
        graph = float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))
    except Exception:  # a capture failure leaves the eager number standing
        torch.cuda.synchronize()
        graph = None
    return {"eager_ms": eager, "graph_ms": graph, "ms": graph if graph is not None else eager}


def _filled_cache(preset: str, tokens: int, device: torch.device) -> torch.Tensor:
    """A cache of ``tokens / G`` blocks written by :func:`store_latent` from random rows."""
    g = get_mla_preset(preset).group_size
    blocks = -(-tokens // g)
    cache = allocate_mla_cache(blocks, preset, L, R, device=device)
    step = 1 << 16
    for start in range(0, blocks * g, step):
        n = min(step, blocks * g - start)
        lat = torch.randn(n, L, device=device, dtype=DTYPE[0])
        pe = torch.randn(n, R, device=device, dtype=DTYPE[0])
        slots = torch.arange(start, start + n, device=device, dtype=torch.int64)
        store_latent(lat, pe, cache, slots, preset)
    return cache


def _vllm_decode() -> Callable[..., Any] | None:
    """vLLM's TritonMLA decode (``decode_attention_fwd``) when vLLM imports, else None."""
    try:
        from vllm.v1.attention.ops.triton_decode_attention import (  # type: ignore[import-not-found]
            decode_attention_fwd,
        )
    except Exception:  # vLLM absent or a version without it
        return None
    return decode_attention_fwd  # type: ignore[no-any-return]


def _rate(row: dict[str, Any], key: str, ms: float, nbytes: int, hbm: float) -> None:
    row[f"{key}_ms"] = ms
    row[f"{key}_gbps"] = nbytes / (ms * 1e-3) / 1e9
    row[f"{key}_of_copy"] = row[f"{key}_gbps"] / hbm


def _baselines(
    row: dict[str, Any],
    dense: torch.Tensor,
    q: torch.Tensor,
    ours: torch.Tensor,
    scale: float,
    hbm: float,
    quick: bool,
) -> None:
    """bf16 baselines over ``dense`` ``[B, T, L + R]``: torch batched matmuls, vLLM's
    TritonMLA decode when it imports; time, GB/s of the bf16 cache read, error of ours."""
    batch, ctx, _ = dense.shape
    device = dense.device
    nbytes = dense.numel() * dense.element_size()

    def torch_bf16() -> torch.Tensor:
        scores = torch.bmm(q, dense.transpose(1, 2)).float() * scale  # [B, H, T]
        p = scores.softmax(-1).to(dense.dtype)
        return torch.bmm(p, dense[:, :, :L])

    try:
        ref = torch_bf16().float()
        _rate(row, "bf16_torch", _best_ms(torch_bf16, quick, device)["ms"], nbytes, hbm)
        row["rel_rms_err_vs_bf16_torch"] = float((ours.float() - ref).norm() / ref.norm())
    except RuntimeError as exc:  # out of memory at the largest sizes
        row["bf16_torch_error"] = str(exc)[:200]
        torch.cuda.empty_cache()
    fwd = _vllm_decode() if device.type == "cuda" else None
    if fwd is None:
        return
    pages = -(-ctx // VLLM_PAGE)
    paged = torch.zeros(batch * pages * VLLM_PAGE, L + R, device=device, dtype=dense.dtype)
    paged.view(batch, pages * VLLM_PAGE, L + R)[:, :ctx] = dense
    kv = paged.view(batch * pages, VLLM_PAGE, 1, L + R)
    table = torch.arange(batch * pages, device=device, dtype=torch.int32).view(batch, pages)
    lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
    heads = q.shape[1]
    splits = 16
    out = torch.empty(batch, heads, L, device=device, dtype=dense.dtype)
    lse = torch.empty(batch, heads, device=device, dtype=dense.dtype)
    logits = torch.empty(batch, heads, splits, L + 1, device=device, dtype=torch.float32)

    one = torch.ones((), device=device, dtype=torch.float32)

    def vllm_bf16() -> None:
        fwd(q, kv, kv[..., :L], out, lse, table, lens, logits, splits, scale, VLLM_PAGE,
            k_scale=one, v_scale=one, is_mla=True)  # fmt: skip

    try:
        vllm_bf16()
        _rate(row, "bf16_vllm_triton", _best_ms(vllm_bf16, quick, device)["ms"], nbytes, hbm)
        row["bf16_vllm_triton_splits"] = splits
    except Exception as exc:  # an API of another vLLM version
        row["bf16_vllm_triton_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"


def _sweep_settings(heads: int, splits: int) -> list[dict[str, Any]]:
    """Other launch settings to time beside the default at one shape."""
    if heads <= 16:
        alts: list[dict[str, Any]] = [
            {"block_tokens": 64, "num_warps": 8},
            {"block_tokens": 64, "num_warps": 4},
            {"block_tokens": 32, "num_warps": 4, "num_stages": 3},
            {"tokens_on_m": True, "block_tokens": 64, "num_warps": 4},
            {"tokens_on_m": True, "block_tokens": 128, "num_warps": 8},
        ]
    else:
        alts = [
            {"heads_per_program": 64, "block_tokens": 32, "num_warps": 8},
            {"tokens_on_m": True, "heads_per_program": 32, "block_tokens": 64, "num_warps": 8},
            {"heads_per_program": 32, "block_tokens": 32, "num_warps": 8},
            {"heads_per_program": 16, "block_tokens": 32, "num_warps": 4},
        ]
    alts += [{"num_splits": max(1, splits // 2)}, {"num_splits": min(64, 2 * splits)}]
    return [*alts, {"no_asm": True}]


def _decode_case(
    preset: str,
    heads: int,
    batch: int,
    ctx: int,
    device: torch.device,
    hbm: float,
    quick: bool,
    sweep: bool,
) -> dict[str, Any]:
    lay = mla_layout(preset, L, R)
    g = lay.group_size
    tiles = -(-ctx // g)
    qlen = ((ctx - TAIL) // g) * g
    cache = _filled_cache(preset, batch * tiles * g, device)
    table = torch.arange(batch * tiles, device=device, dtype=torch.int32).view(batch, tiles)
    table = table[:, torch.randperm(tiles, device=device)].contiguous()
    staging = torch.randn(batch, 2 * g, L + R, device=device, dtype=DTYPE[0])
    i32: dict[str, Any] = {"device": device, "dtype": torch.int32}
    seq_lens = torch.full((batch,), ctx, **i32)
    qlens = torch.full((batch,), qlen, **i32)
    slots = torch.arange(batch, **i32)
    q_lat = torch.randn(batch, heads, L, device=device, dtype=DTYPE[0]) / 16
    q_pe = torch.randn(batch, heads, R, device=device, dtype=DTYPE[0]) / 8
    out = torch.empty_like(q_lat)
    scale = 1 / math.sqrt(192)
    args = (q_lat, q_pe, cache, staging, table, seq_lens, qlens, slots, preset, scale)

    def run(**kw: Any) -> Callable[[], torch.Tensor]:
        return lambda: mla_decode_attention(*args, out=out, **kw)

    hb = default_heads_per_program(heads)
    cfg = _decode_config(hb, lay.preset.latent_bits, g)
    kernel = settings.current().mla_decode
    if kernel == "verified":  # its own splits; the launch settings below are the fast kernel's
        splits = verified_splits(batch, -(-heads // hb), tiles)
    else:
        splits = choose_mla_splits(
            batch,
            -(-heads // hb),
            tiles,
            num_sms=_sm_count(device),
            programs_per_sm=cfg["programs_per_sm"],
        )
    run()()
    t = _best_ms(run(), quick, device)
    cache_bytes = batch * (qlen // g) * lay.tile_bytes + batch * (ctx - qlen) * (L + R) * 2
    row: dict[str, Any] = {
        "kind": "decode",
        "kernel": kernel,
        "preset": preset,
        "heads": heads,
        "batch": batch,
        "context": ctx,
        "splits": splits,
        "heads_per_program": hb,
        **cfg,
        "eager_ms": t["eager_ms"],
        "graph_ms": t["graph_ms"],
        "bytes": cache_bytes,
    }
    _rate(row, "kvarn", t["ms"], cache_bytes, hbm)
    if sweep and device.type == "cuda":
        row["sweep"] = []
        for alt in _sweep_settings(heads, splits):
            kw = {k: v for k, v in alt.items() if k != "no_asm"}
            with settings.override(no_asm=bool(alt.get("no_asm"))):
                run(**kw)()
                ms = float(triton.testing.do_bench_cudagraph(run(**kw), rep=40))
            row["sweep"].append({**alt, "ms": ms, "of_copy": cache_bytes / (ms * 1e-3) / 1e9 / hbm})
    ours = run()().clone()
    # the same tokens as a dense bf16 latent cache
    dense = dequantize_latent(cache, table.view(-1), preset, L, R, dtype=DTYPE[0])
    dense = dense.view(batch, tiles * g, L + R)[:, :ctx].contiguous()
    ring = torch.arange(qlen, ctx, device=device) % (2 * g)
    dense[:, qlen:] = staging[:, ring]
    del cache
    _baselines(row, dense, torch.cat([q_lat, q_pe], -1), ours, scale, hbm, quick)
    for key in ("bf16_torch", "bf16_vllm_triton"):
        if f"{key}_ms" in row:
            row[f"speedup_vs_{key}"] = row[f"{key}_ms"] / row["kvarn_ms"]
    return row


def _store_cost(preset: str, tokens: int, device: torch.device, quick: bool) -> dict[str, Any]:
    lay = mla_layout(preset, L, R)
    g = lay.group_size
    cache = allocate_mla_cache(-(-tokens // g) + 1, preset, L, R, device=device)
    lat = torch.randn(tokens, L, device=device, dtype=DTYPE[0])
    pe = torch.randn(tokens, R, device=device, dtype=DTYPE[0])
    slots = torch.randperm(tokens, device=device)

    def run() -> None:
        store_latent(lat, pe, cache, slots, preset)

    run()
    t = _best_ms(run, quick, device)
    moved = tokens * ((L + R) * 2 + lay.bytes_per_token)
    return {"kind": "store", "preset": preset, "tokens": tokens, **t, "bytes": moved}


def _dequantize_cost(preset: str, tokens: int, device: torch.device, quick: bool) -> dict[str, Any]:
    lay = mla_layout(preset, L, R)
    n = tokens // lay.group_size
    cache = _filled_cache(preset, tokens, device)
    ids = torch.randperm(n, device=device).to(torch.int32)
    out = torch.empty(tokens, L + R, device=device, dtype=DTYPE[0])

    def run() -> None:
        dequantize_latent(cache, ids, preset, L, R, out=out)

    run()
    t = _best_ms(run, quick, device)
    moved = tokens * (lay.bytes_per_token + (L + R) * 2)
    return {"kind": "dequantize", "preset": preset, "tokens": tokens, **t, "bytes": moved}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """All measurements; returns the report (also written to ``args.out``)."""
    head_counts: tuple[int, ...]
    store_sizes: tuple[int, ...]
    if args.dry_run:  # the code paths on the CPU (TRITON_INTERPRET=1), tiny sizes
        device = torch.device("cpu")
        sizes, head_counts, store_sizes, gather = [(2, 300)], (16,), (64,), 256
    elif not torch.cuda.is_available():
        raise SystemExit("the MLA benchmark needs a CUDA GPU (or --dry-run on the CPU)")
    else:
        device = torch.device("cuda")
        # the first run's shapes (docs/results/h100-2026-12-06) and the target's (>= 16K, >= 16)
        sizes = [(1, 32768), (16, 8192), (16, 16384), (64, 4096), (32, 32768)]
        if args.quick:
            sizes = [(1, 32768), (16, 16384)]
        head_counts, store_sizes, gather = (16, 128), (256, 32768), 32768
        if args.sweep:  # the sweep's shape only, first preset, no store or dequantize rows
            sizes, store_sizes, args.presets = [SWEEP_SHAPE], (), args.presets[:1]
    DTYPE[0] = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    torch.manual_seed(0)
    hbm = measure_hbm_bandwidth(device, args.quick)
    print(f"copy bandwidth {hbm:.0f} GB/s", flush=True)
    rows: list[dict[str, Any]] = []
    report = {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "versions": {"torch": torch.__version__, "triton": triton.__version__},
        "vllm_triton_mla": _vllm_decode() is not None and device.type == "cuda",
        "hbm_copy_gbps": hbm,
        "dtype": args.dtype,
        "mla_decode": settings.current().mla_decode,
        "rows": rows,
    }

    def save() -> None:  # after every row: a run cut short by a time limit keeps its rows
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2))

    for i, preset in enumerate(args.presets):
        for heads in head_counts:
            # the first preset at every size, the others at the target's (>= 16K, >= 16)
            for batch, ctx in [s for s in sizes if i == 0 or (s[0] >= 16 and s[1] >= 16384)]:
                sweep = args.sweep and i == 0 and (batch, ctx) == SWEEP_SHAPE
                row = _decode_case(preset, heads, batch, ctx, device, hbm, args.quick, sweep)
                rows.append(row)
                print(_line(row), flush=True)
                save()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        costs = [_store_cost(preset, n, device, args.quick) for n in store_sizes]
        if not args.sweep:
            costs.append(_dequantize_cost(preset, gather, device, args.quick))
        for r in costs:
            r["gbps"] = r["bytes"] / (r["ms"] * 1e-3) / 1e9
            rows.append(r)
        save()
    return report


def _cell(r: dict[str, Any], key: str) -> str:
    if f"{key}_ms" not in r:
        return "n/a | | |"
    speed = f" ({r[f'speedup_vs_{key}']:.2f}x)" if f"speedup_vs_{key}" in r else ""
    return f"{r[f'{key}_ms']:.3f}{speed} | {r[f'{key}_gbps']:.0f} | {r[f'{key}_of_copy']:.0%} |"


def _line(r: dict[str, Any]) -> str:
    err = r.get("rel_rms_err_vs_bf16_torch")
    return (
        f"| `{r['preset']}` | {r['heads']} | {r['batch']} | {r['context']} | {r['splits']} | "
        + _cell(r, "kvarn")
        + " "
        + _cell(r, "bf16_torch")
        + " "
        + _cell(r, "bf16_vllm_triton")
        + (f" {err:.1e} |" if err is not None else " |")
    )


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown tables."""
    out = [
        f"GPU: {report['gpu']}; copy bandwidth {report['hbm_copy_gbps']:.0f} GB/s (same run); "
        f"dtype {report['dtype']}; decode kernel {report.get('mla_decode', '?')} "
        "(KVARN_KERNELS_MLA_DECODE); GB/s = cache bytes read / time (graph replay)",
        "",
        "| preset | H | B | T | splits | kvarn ms | GB/s | of copy | bf16 torch bmm ms "
        "(kvarn speedup) | GB/s | of copy | bf16 vLLM TritonMLA ms (kvarn speedup) | GB/s | "
        "of copy | rel. err |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | ---: |",
    ]
    out += [_line(r) for r in report["rows"] if r["kind"] == "decode"]
    sweeps = [r for r in report["rows"] if r.get("sweep")]
    if sweeps:
        out += [
            "",
            "| preset | H | B | T | setting | ms | of copy |",
            "| --- | ---: | ---: | ---: | --- | ---: | ---: |",
        ]
        for r in sweeps:
            shape = f"| `{r['preset']}` | {r['heads']} | {r['batch']} | {r['context']} |"
            out.append(f"{shape} default | {r['kvarn_ms']:.3f} | {r['kvarn_of_copy']:.0%} |")
            for s in r["sweep"]:
                name = ", ".join(f"{k}={v}" for k, v in s.items() if k not in ("ms", "of_copy"))
                out.append(f"{shape} {name} | {s['ms']:.3f} | {s['of_copy']:.0%} |")
    out += ["", "| op | preset | tokens | ms | GB/s |", "| --- | --- | ---: | ---: | ---: |"]
    for r in report["rows"]:
        if r["kind"] != "decode":
            out.append(
                f"| {r['kind']} | `{r['preset']}` | {r['tokens']} | {r['ms']:.3f} | "
                f"{r['gbps']:.0f} |"
            )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Benchmark the MLA latent-cache kernels.")
    default_out = Path(os.environ["OUT"]) / "mla_bench.json" if os.environ.get("OUT") else None
    parser.add_argument("--out", type=Path, default=default_out, help="JSON results file")
    parser.add_argument("--quick", action="store_true", help="two sizes per shape")
    parser.add_argument(
        "--sweep", action="store_true", help="only: other launch settings at batch 16 x 16K"
    )
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny sizes on the CPU (TRITON_INTERPRET=1)"
    )
    parser.add_argument("--presets", nargs="+", default=["kvarn_mla_l4_g128", "kvarn_mla_l2_g128"])
    args = parser.parse_args(argv)
    report = run(args)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
