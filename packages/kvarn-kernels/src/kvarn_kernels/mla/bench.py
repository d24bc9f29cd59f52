"""Benchmark of the MLA latent-cache kernels on a GPU.

    python -m kvarn_kernels.mla.bench --out mla_bench.json [--quick]

Measures in one run: the HBM bandwidth of a device-to-device copy; decode attention in latent
space (latent 512, RoPE 64; 16 and 128 query heads) over the quantized paged cache, batch x
context, eager and replayed from a CUDA graph: time, bytes of records and staged rows read,
GB/s and the fraction of the measured bandwidth; beside it the same absorbed decode in torch
(two cuBLAS batched matmuls and a softmax) over a dense bf16 latent cache of the same tokens
(``[B, T, 576]``; the bf16 reference, not FlashMLA); the quantize-on-write cost (a 256-token
decode step, a 32K-token prefill) and the dequantize/gather throughput. Writes JSON and prints a
markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton  # type: ignore[import-untyped]
from kvarn_math.mla import get_mla_preset, mla_layout

from kvarn_kernels.bench import measure_hbm_bandwidth
from kvarn_kernels.mla.launch import (
    allocate_mla_cache,
    choose_mla_splits,
    dequantize_latent,
    mla_decode_attention,
    store_latent,
)

__all__ = ["main", "run"]

L, R = 512, 64
TAIL = 37  # staged tokens after the last complete tile
DTYPE = [torch.bfloat16]  # the model dtype of the run (--dtype)


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


def _decode_case(
    preset: str, heads: int, batch: int, ctx: int, device: torch.device, quick: bool
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

    def run() -> torch.Tensor:
        return mla_decode_attention(
            q_lat, q_pe, cache, staging, table, seq_lens, qlens, slots, preset, scale, out=out
        )

    run()
    t = _best_ms(run, quick, device)
    record_bytes = batch * (qlen // g) * lay.tile_bytes
    staged_bytes = batch * (ctx - qlen) * (L + R) * 2
    moved = record_bytes + staged_bytes + 2 * q_lat.numel() * 2 + q_pe.numel() * 2
    hb = min(max(16, 1 << (heads - 1).bit_length()), 32)
    row: dict[str, Any] = {
        "kind": "decode",
        "preset": preset,
        "heads": heads,
        "batch": batch,
        "context": ctx,
        "splits": choose_mla_splits(batch, -(-heads // hb), tiles),
        "heads_per_program": hb,
        **t,
        "bytes": moved,
        "gbps": moved / (t["ms"] * 1e-3) / 1e9,
    }
    # the same tokens as a dense bf16 latent cache, read by torch
    dense = dequantize_latent(cache, table.view(-1), preset, L, R, dtype=DTYPE[0])
    dense = dense.view(batch, tiles * g, L + R)
    dense = dense[:, :ctx].contiguous()
    ring = torch.arange(qlen, ctx, device=device) % (2 * g)
    dense[:, qlen:] = staging[:, ring]
    q = torch.cat([q_lat, q_pe], -1)  # [B, H, L + R]

    def bf16_torch() -> torch.Tensor:
        # absorbed MLA decode over the dense bf16 cache with cuBLAS batched matmuls
        scores = torch.bmm(q, dense.transpose(1, 2)).float() * scale  # [B, H, T]
        p = scores.softmax(-1).to(dense.dtype)
        return torch.bmm(p, dense[:, :, :L])

    try:
        bf16_torch()
        base = _best_ms(bf16_torch, quick, device)
        row["bf16_torch_ms"] = base["ms"]
        row["speedup_vs_bf16_torch"] = base["ms"] / t["ms"]
        ref = bf16_torch().float()
        row["rel_rms_err_vs_bf16_torch"] = float((run().float() - ref).norm() / ref.norm())
    except RuntimeError as exc:  # out of memory at the largest sizes
        row["bf16_torch_error"] = str(exc)[:200]
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
    return {
        "kind": "store",
        "preset": preset,
        "tokens": tokens,
        **t,
        "bytes": moved,
        "gbps": moved / (t["ms"] * 1e-3) / 1e9,
    }


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
    return {
        "kind": "dequantize",
        "preset": preset,
        "tokens": tokens,
        **t,
        "bytes": moved,
        "gbps": moved / (t["ms"] * 1e-3) / 1e9,
    }


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
        sizes = [(1, 32768), (16, 8192), (64, 4096), (32, 32768)]
        if args.quick:
            sizes = [(1, 32768), (32, 8192)]
        head_counts, store_sizes, gather = (16, 128), (256, 32768), 32768
    DTYPE[0] = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    torch.manual_seed(0)
    hbm = measure_hbm_bandwidth(device, args.quick)
    rows: list[dict[str, Any]] = []
    for preset in args.presets:
        for heads in head_counts:
            for batch, ctx in sizes:
                row = _decode_case(preset, heads, batch, ctx, device, args.quick)
                row["fraction_of_hbm"] = row["gbps"] / hbm
                rows.append(row)
                print(_line(row), flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        for tokens in store_sizes:
            rows.append(_store_cost(preset, tokens, device, args.quick))
            print(_line(rows[-1]), flush=True)
        rows.append(_dequantize_cost(preset, gather, device, args.quick))
        print(_line(rows[-1]), flush=True)
    report = {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "versions": {"torch": torch.__version__, "triton": triton.__version__},
        "hbm_copy_gbps": hbm,
        "dtype": args.dtype,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    return report


def _line(r: dict[str, Any]) -> str:
    if r["kind"] == "decode":
        base = r.get("bf16_torch_ms")
        return (
            f"| decode | `{r['preset']}` | H={r['heads']} B={r['batch']} T={r['context']} | "
            f"{r['ms']:.3f} | {r['gbps']:.0f} | {r['fraction_of_hbm']:.0%} | "
            + (
                f"{base:.3f} ({r['speedup_vs_bf16_torch']:.2f}x) | "
                f"{r['rel_rms_err_vs_bf16_torch']:.1e} |"
                if base is not None
                else "n/a | |"
            )
        )
    return (
        f"| {r['kind']} | `{r['preset']}` | {r['tokens']} tokens | {r['ms']:.3f} | "
        f"{r['gbps']:.0f} | | | |"
    )


def markdown(report: dict[str, Any]) -> str:
    """The report as a markdown table."""
    head = [
        f"GPU: {report['gpu']}; copy bandwidth {report['hbm_copy_gbps']:.0f} GB/s",
        "",
        "| op | preset | shape | ms | GB/s | of copy | bf16 torch ms (kvarn speedup) | rel. err |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    return "\n".join(head + [_line(r) for r in report["rows"]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Benchmark the MLA latent-cache kernels.")
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    parser.add_argument("--quick", action="store_true", help="two sizes per shape")
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
