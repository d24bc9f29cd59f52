"""Benchmark of the kernels on a GPU: decode attention and quantize-on-write.

    python -m kvarn_kernels.bench --out results.json [--quick]

Measures, in one run: the HBM bandwidth of a large device-to-device copy; decode attention over
the quantized paged cache (time, bytes read, GB/s, fraction of the measured bandwidth) for the
Llama-3-8B attention shape (32 query heads, 8 KV heads, head_dim 128) and a head_dim 64 shape,
batch x context; fp16 baselines over a cache of the same token count (torch SDPA on a dense
contiguous cache, and vLLM's Triton paged decode kernel when vLLM is importable); the
quantize-on-write cost per completed tile and per decode step at batch 256.  Writes JSON (GPU,
versions, git SHA, every measurement) and prints a markdown table.  Needs CUDA; nothing else
beyond torch, triton, numpy and kvarn-math.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import triton  # type: ignore[import-untyped]
from kvarn_math.layout import get_preset, tile_layout

from kvarn_kernels import settings

__all__ = ["main", "measure_hbm_bandwidth"]

_GIB = 1 << 30


def _time_ms(fn: Callable[[], object], quick: bool, device: torch.device | None = None) -> float:
    """Median milliseconds of ``fn`` (CUDA events through triton.testing.do_bench).

    On the CPU (``--dry-run``, interpreter) a plain wall-clock median of three runs.
    """
    if device is not None and device.type == "cpu":
        fn()
        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return float(np.median(times))
    return float(
        triton.testing.do_bench(
            fn, warmup=10 if quick else 25, rep=40 if quick else 100, return_mode="median"
        )
    )


def _graph_ms(fn: Callable[[], object], quick: bool) -> float | None:
    """Median milliseconds of ``fn`` replayed from a CUDA graph (no host launch overhead), or
    None where ``fn`` cannot be captured.  ``fn`` must have run once already (compilation and
    autotuning cannot happen inside a capture)."""
    try:
        torch.cuda.synchronize()
        ms = triton.testing.do_bench_cudagraph(fn, rep=20 if quick else 50, return_mode="median")
        return float(ms)
    except Exception:  # a capture failure leaves the eager number standing
        torch.cuda.synchronize()
        return None


def _best_ms(fn: Callable[[], object], quick: bool, device: torch.device) -> dict[str, Any]:
    """Eager (do_bench) and CUDA-graph times; ``ms`` is the graph time when available.

    Small decode steps are dominated by the Python launch path in eager mode, which an engine
    running CUDA graphs does not pay; both are reported.
    """
    eager = _time_ms(fn, quick, device)
    graph = _graph_ms(fn, quick) if device.type == "cuda" else None
    return {"eager_ms": eager, "graph_ms": graph, "ms": graph if graph is not None else eager}


def measure_hbm_bandwidth(device: torch.device, quick: bool) -> float:
    """GB/s of a large device-to-device copy (bytes read + bytes written)."""
    n = (1 if quick else 4) * _GIB if device.type == "cuda" else 1 << 24
    src = torch.empty(n, dtype=torch.uint8, device=device)
    src.random_(0, 255)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), quick, device)
    src = dst = torch.empty(0, device=device)  # release the buffers before the next allocation
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3) / 1e9


def _git_sha() -> str | None:
    """``HEAD`` of the checkout holding this file; ``$KVARN_GIT_SHA`` wins when set (code run
    from an exported tree, as kvarn-eval's ``report.git_sha``)."""
    if sha := settings.current().git_sha:
        return sha
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _versions() -> dict[str, str | None]:
    import kvarn_math

    import kvarn_kernels

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "numpy": np.__version__,
        "kvarn_math": kvarn_math.__version__,
        "kvarn_kernels": kvarn_kernels.__version__,
    }


def _template_records(
    preset: str,
    head_dim: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    device: torch.device,
    count: int = 64,
    mixed: bool = False,
) -> torch.Tensor:
    """``count`` records ``[count, Hkv, tile_bytes]`` quantized by the kernel from random K/V
    (``mixed``: every other record's keys in their own channels)."""
    from kvarn_kernels.quantize import quantize_tiles

    g = get_preset(preset).group_size
    gen = torch.Generator(device=device).manual_seed(0)
    k = torch.randn((count, num_kv_heads, g, head_dim), generator=gen, device=device).to(dtype)
    v = torch.randn((count, num_kv_heads, g, head_dim), generator=gen, device=device).to(dtype)
    raw = (torch.arange(count * num_kv_heads, device=device) % 2 == 1).view(count, num_kv_heads)
    return quantize_tiles(k, v, preset, raw_keys=raw if mixed else False)


_LAUNCH_ENV = (
    "KVARN_KERNELS_FAST_DECODE",
    "KVARN_KERNELS_FAST_PREFETCH",
    "KVARN_KERNELS_ATTN_LAUNCH",
    "KVARN_KERNELS_STAGED_SPLITS",
    "KVARN_KERNELS_AUTOTUNE",
    "KVARN_KERNELS_INVARIANT_SPLIT_TILES",
    "KVARN_KERNELS_STORE_WARPS",
)

SHAPES = {128: ("llama3-8b", 32, 8, 128), 64: ("hd64", 32, 8, 64), 256: ("hd256", 16, 8, 256)}
"""The attention shapes per head_dim (``--head-dims``): name, query heads, KV heads, head_dim
(head_dim 256 as Gemma-2-9B's 16 query and 8 KV heads)."""

WINDOWS = ("open", "keys", "values")
"""The staging a decode case reads besides the records (``--windows``): ``open``, only the open
tile (half full); ``keys``, also the exact first tile (sink rows) and the recent tile, keys and
values, as kvarn-vllm stages 2-bit keys; ``values``, the same windows with only their values
staged and their keys read from the records (kvarn-vllm's default for 4-bit keys)."""

_WINDOWS_TEXT = {
    "open": "the open tile",
    "keys": "the exact first, recent and open tiles",
    "values": "the values of the exact first and recent tiles, the open tile",
}


class _Case:
    """One paged cache (quantized) plus its fp16 twin for the baselines."""

    def __init__(
        self,
        preset: str,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        batch: int,
        context: int,
        dtype: torch.dtype,
        device: torch.device,
        template: torch.Tensor,
        raw_keys: bool = False,
        windows: str = "open",
    ) -> None:
        from kvarn_kernels.cache import allocate_staging

        if windows not in WINDOWS:
            raise ValueError(f"windows must be one of {WINDOWS}, got {windows!r}")
        self.raw_keys, self.windows = raw_keys, windows
        p = get_preset(preset)
        g = p.group_size
        if windows != "open" and context < 2 * g:
            raise ValueError(
                f"windows={windows!r} needs a context of 2 tiles or more, got {context}"
            )
        self.layout = tile_layout(p, head_dim)
        self.preset, self.dtype, self.device = preset, dtype, device
        self.hq, self.hkv, self.d, self.b = num_q_heads, num_kv_heads, head_dim, batch
        self.open_tokens = g // 2
        self.quantized = context
        self.seq_len = context + self.open_tokens
        tiles = context // g
        num_blocks = batch * tiles
        reps = -(-num_blocks // template.shape[0])
        self.kv_cache = template.repeat(reps, 1, 1)[:num_blocks].contiguous()
        gen = torch.Generator(device="cpu").manual_seed(1)
        perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
        self.block_table = perm.view(batch, tiles).to(device)
        exact = windows != "open"
        self.key_tiles = 1 if windows == "values" else None
        self.staging = allocate_staging(
            batch, num_kv_heads, head_dim, p, dtype, device,
            staging_tiles=2 if exact else 1, sink=exact, key_tiles=self.key_tiles,
        )  # fmt: skip
        self.staging.normal_()
        self.seq_lens = torch.full((batch,), self.seq_len, dtype=torch.int32, device=device)
        # attention reads staging from read_len on: the recent tile too with the windows
        self.read_len = context - g if exact else context
        self.qlens = torch.full((batch,), self.read_len, dtype=torch.int32, device=device)
        self.sink_lens = (
            torch.full((batch,), g, dtype=torch.int32, device=device) if exact else None
        )
        # values-only windows: keys come from the records up to the open tile
        self.key_lens = self.qlens + g if self.key_tiles else None
        self.slots = torch.arange(batch, dtype=torch.int32, device=device)
        self.query = torch.randn((batch, num_q_heads, head_dim), dtype=dtype, device=device)
        self.out = torch.empty_like(self.query)
        self.scale = 1.0 / math.sqrt(head_dim)

    def bytes_quantized(self) -> int:
        """Bytes attention reads: the records it reads (whole, also where only their keys are
        needed), the staged key and value rows, the queries and outputs, the block table."""
        g = self.layout.group_size
        tiles = self.quantized // g
        windows = 0 if self.windows == "open" else 2 * g  # sink and recent tile rows
        records = tiles - (2 if self.windows == "keys" else 0)
        key_rows = self.open_tokens + (windows if self.windows == "keys" else 0)
        value_rows = self.open_tokens + windows
        per_seq = self.hkv * (
            records * self.layout.tile_bytes
            + (key_rows + value_rows) * self.d * self.staging.element_size()
        )
        io = 2 * self.hq * self.d * self.query.element_size()
        return self.b * (per_seq + io + 4 * tiles)

    def bytes_fp16(self) -> int:
        return self.b * (self.hkv * self.seq_len * 2 * self.d * 2 + 2 * self.hq * self.d * 2)

    def run(self, num_splits: int | None = None) -> torch.Tensor:
        from kvarn_kernels.attention import decode_attention

        return decode_attention(
            self.query,
            self.kv_cache,
            self.staging,
            self.block_table,
            self.seq_lens,
            self.qlens,
            self.slots,
            self.preset,
            self.scale,
            out=self.out,
            num_splits=num_splits,
            sink_lens=self.sink_lens,
            raw_keys=self.raw_keys,
            key_lens=self.key_lens,
            key_tiles=self.key_tiles,
        )

    def verify(self, num_spec: int, as_decode: bool) -> torch.Tensor:
        """A speculative verify step: every sequence's last ``1 + num_spec`` positions as one
        block of queries. ``as_decode=False``: the multi-query kernel with the block's own K/V
        (``fresh_kv``, the block's staged tokens), as kvarn-vllm runs it with
        ``KVARN_VLLM_VERIFY_AS_DECODE=0``; ``True``: the block as decode rows, one per token,
        reading its own tokens from staging (kvarn-vllm's default under speculative decoding).
        Both compute the same attention."""
        from kvarn_kernels.attention import multi_query_attention

        n = 1 + num_spec
        if getattr(self, "_verify_n", None) != n:
            rows = self.b * n
            self._verify_n = n
            self.v_query = torch.randn(
                (rows, self.hq, self.d), dtype=self.dtype, device=self.device
            )
            self.v_out = torch.empty_like(self.v_query)
            # The block's own K/V: what staging holds at its positions (the store put it there).
            pos = torch.arange(self.seq_len - n, self.seq_len, device=self.device)
            ks, vs, key_rows, value_rows = self._staging_rows(pos)
            self.v_own = (
                ks[:, key_rows].reshape(rows, self.hkv, self.d).contiguous(),
                vs[:, value_rows].reshape(rows, self.hkv, self.d).contiguous(),
            )
            self.v_qsl = torch.arange(0, rows + 1, n, dtype=torch.int32, device=self.device)
        return multi_query_attention(
            self.v_query,
            self.v_qsl,
            self.kv_cache,
            self.staging,
            self.block_table,
            self.seq_lens,
            self.qlens,
            self.slots,
            self.preset,
            self.scale,
            out=self.v_out,
            max_query_len=n,
            sink_lens=self.sink_lens,
            fresh_kv=None if as_decode else self.v_own,
            raw_keys=self.raw_keys,
            key_lens=self.key_lens,
            key_tiles=self.key_tiles,
            verify_as_decode=as_decode,
            split_batch=self.b,
        )

    def _staging_rows(
        self, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every slot's key and value rows of the staging (``[slots, rows, Hkv, D]`` each) and
        the rows that hold positions ``pos`` in them."""
        from kvarn_kernels.cache import staging_rows

        g = self.layout.group_size
        sink = 0 if self.windows == "open" else g
        if self.key_tiles is None:
            ks, vs = self.staging[:, 0], self.staging[:, 1]
            rows = staging_rows(pos, ks.shape[1] - sink, sink)
            return ks, vs, rows, rows
        key_ring = self.key_tiles * g
        ks, vs = self.staging[:, :key_ring], self.staging[:, key_ring:]
        return ks, vs, pos % key_ring, staging_rows(pos, vs.shape[1] - sink, sink)

    def staged_kv(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sequence 0's staged keys and values, ``[T, Hkv, D]`` each over positions
        ``[0, seq_len)`` (zeros where not staged), and the masks ``[T]`` of the positions
        attention reads keys and values from staging."""
        g = self.layout.group_size
        pos = torch.arange(self.seq_len, device=self.device)
        sink = 0 if self.windows == "open" else g
        ks, vs, key_rows, value_rows = self._staging_rows(pos)
        from_values = (pos >= self.read_len) | (pos < sink)
        from_keys = from_values if self.key_lens is None else pos >= self.read_len + g
        return ks[0, key_rows].float(), vs[0, value_rows].float(), from_keys, from_values


def _check_against_dequantized(case: _Case) -> float:
    """Relative RMS error of the kernel against SDPA over the dequantized cache (first sequence)."""
    from kvarn_kernels.dequantize import dequantize
    from kvarn_kernels.rotation import rotate, unrotate

    out = case.run().float()
    k, v = dequantize(
        case.kv_cache, case.block_table[0].contiguous(), case.preset, case.d, dtype=torch.float32
    )
    sk, sv, from_keys, from_values = case.staged_kv()
    k = torch.cat([k, sk[k.shape[0] :]])  # the open tile's positions exist only in staging
    v = torch.cat([v, sv[v.shape[0] :]])
    k = torch.where(from_keys[:, None, None], sk, k).transpose(0, 1)[None]  # [1, Hkv, T, D]
    v = torch.where(from_values[:, None, None], sv, v).transpose(0, 1)[None]
    q = rotate(case.query[:1].float())[:, :, None, :]  # [1, Hq, 1, D]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, scale=case.scale, enable_gqa=True
    )
    ref = unrotate(ref[:, :, 0, :])
    return float((out[:1] - ref).norm() / ref.norm())


def _sdpa_baseline(case: _Case, quick: bool) -> float | None:
    """fp16 decode over a dense contiguous cache of the same token count (flash/efficient SDPA)."""
    shape = (case.b, case.hkv, case.seq_len, case.d)
    k = torch.randn(shape, dtype=torch.float16, device=case.device)
    v = torch.randn(shape, dtype=torch.float16, device=case.device)
    q = torch.randn((case.b, case.hq, 1, case.d), dtype=torch.float16, device=case.device)
    f = torch.nn.functional.scaled_dot_product_attention
    return _best_ms(lambda: f(q, k, v, scale=case.scale, enable_gqa=True), quick, case.device)["ms"]


def _vllm_baseline(case: _Case, quick: bool) -> tuple[float | None, str | None]:
    """vLLM's Triton paged decode kernel (page size 16) over an fp16 cache, best of a few splits.

    Imported lazily and only here: the kernels package itself never imports vLLM.
    """
    try:
        from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd
    except Exception as exc:  # vLLM absent or broken: the SDPA baseline still stands
        return None, f"vLLM decode kernel not importable: {type(exc).__name__}: {exc}"
    page = 16
    pages = -(-case.seq_len // page)
    shape = (case.b * pages, page, case.hkv, case.d)
    try:
        k = torch.randn(shape, dtype=torch.float16, device=case.device)
        v = torch.randn(shape, dtype=torch.float16, device=case.device)
        table = (
            torch.randperm(case.b * pages, device=case.device).to(torch.int32).view(case.b, pages)
        )
        q = torch.randn((case.b, case.hq, case.d), dtype=torch.float16, device=case.device)
        o = torch.empty_like(q)
        lse = torch.empty((case.b, case.hq), dtype=torch.float32, device=case.device)
        one = torch.ones((), dtype=torch.float32, device=case.device)  # no allocation in capture
        best = None
        for splits in (4, 8, 16, 32):
            logits = torch.empty(
                (case.b, case.hq, splits, case.d + 1), dtype=torch.float32, device=case.device
            )

            def fn(splits: int = splits, logits: torch.Tensor = logits) -> None:
                decode_attention_fwd(
                    q,
                    k,
                    v,
                    o,
                    lse,
                    table,
                    case.seq_lens,
                    logits,
                    splits,
                    case.scale,
                    page,
                    k_scale=one,
                    v_scale=one,
                )

            ms = _best_ms(fn, quick, case.device)["ms"]
            best = ms if best is None else min(best, ms)
        return best, None
    except Exception as exc:
        return None, f"vLLM decode kernel failed: {type(exc).__name__}: {exc}"


def _store_cost(
    preset: str,
    num_kv_heads: int,
    head_dim: int,
    batch: int,
    dtype: torch.dtype,
    device: torch.device,
    quick: bool,
    key_frame: str = "rotated",
    num_q_heads: int = 0,
    iterations: int | None = None,
) -> dict[str, Any]:
    """store_kv time for a decode step of ``batch`` requests: typical (batch/G tiles complete),
    worst (every request completes a tile), and per completed tile; and for a prefill chunk of
    ``8 G`` tokens of each of 8 requests (per tile). ``key_frame="auto"``: each tile's key frame
    chosen from ``num_q_heads`` random queries per token, plus a speculative commit step
    (:func:`_commit_cost`). ``iterations``: normalization sweeps (default kvarn-math's)."""
    from kvarn_kernels.cache import allocate_cache, allocate_staging
    from kvarn_kernels.plan import StorePlan, plan_store
    from kvarn_kernels.quantize import store_kv

    p = get_preset(preset)
    g = p.group_size
    sweeps: dict[str, Any] = {} if iterations is None else {"iterations": iterations}
    cache = allocate_cache(batch * 2, num_kv_heads, head_dim, p, device)
    staging = allocate_staging(batch, num_kv_heads, head_dim, p, dtype, device)
    staging.normal_()
    key = torch.randn((batch, num_kv_heads, head_dim), dtype=dtype, device=device)
    value = torch.randn_like(key)
    auto = key_frame == "auto"
    query = torch.randn((batch, num_q_heads, head_dim), dtype=dtype, device=device)
    table = np.arange(batch * 2, dtype=np.int32).reshape(batch, 2)
    result: dict[str, Any] = {"key_frame": key_frame}
    typical = max(1, round(batch / g))
    for name, completing in (("typical", typical), ("worst", batch), ("none", 0)):
        cached = [g - 1 if i < completing else g // 2 for i in range(batch)]
        plan = plan_store(cached, [1] * batch, None, list(range(batch)), table, p).to(device)

        def step(plan: StorePlan = plan) -> None:
            store_kv(key, value, cache, staging, plan, p, key_frame=key_frame,
                     query=query if auto else None, **sweeps)  # fmt: skip

        ms = _best_ms(step, quick, device)["ms"]
        result[f"store_step_{name}_ms"] = ms
        result[f"store_step_{name}_tiles"] = completing
    result["store_per_tile_us"] = (
        (result["store_step_worst_ms"] - result["store_step_none_ms"])
        * 1e3
        / (batch * num_kv_heads)
    )
    if auto:
        result.update(
            _commit_cost(key, value, cache, query, table, p, batch, sweeps, quick, device)
        )
    # A prefill chunk: 8 requests x 8 tiles, every tile quantized from the batch's own rows.
    reqs, tiles = 8, 8
    n = reqs * tiles * g
    big = allocate_cache(reqs * tiles, num_kv_heads, head_dim, p, device)
    pk = torch.randn((n, num_kv_heads, head_dim), dtype=dtype, device=device)
    pq = torch.randn((n, num_q_heads, head_dim), dtype=dtype, device=device)
    ptable = np.arange(reqs * tiles, dtype=np.int32).reshape(reqs, tiles)
    pplan = plan_store([0] * reqs, [tiles * g] * reqs, None, list(range(reqs)), ptable, p)
    pplan = pplan.to(device)

    def prefill() -> None:
        store_kv(pk, pk, big, staging, pplan, p, key_frame=key_frame,
                 query=pq if auto else None, **sweeps)  # fmt: skip

    ms = _best_ms(prefill, quick, device)["ms"]
    result["store_prefill_ms"] = ms
    result["store_prefill_per_tile_us"] = ms * 1e3 / (reqs * tiles * num_kv_heads)
    return result


# (key frame, normalization sweeps, warps per program or None for the default) of --store-sweep:
# what the key-frame choice, the sweeps and the program's width each cost.
STORE_VARIANTS = (
    ("rotated", 0, None),
    ("rotated", 2, None),
    ("auto", 0, None),
    ("auto", 2, None),
    ("auto", 2, "16"),
    ("auto", 2, "32"),
)


def _commit_cost(
    key: torch.Tensor,
    value: torch.Tensor,
    cache: torch.Tensor,
    query: torch.Tensor,
    table: np.ndarray,
    p: Any,
    batch: int,
    sweeps: dict[str, Any],
    quick: bool,
    device: torch.device,
) -> dict[str, float]:
    """A speculative step in which every request commits a tile whose tokens were all staged
    (``key_frame="auto"``): judged by the step's first query, and by the query staged with the
    tile's last position (``frame_queries``, what kvarn-vllm passes under speculation)."""
    from kvarn_kernels.cache import allocate_frame_queries, allocate_staging
    from kvarn_kernels.plan import plan_store
    from kvarn_kernels.quantize import store_kv

    g, num_q_heads, head_dim = p.group_size, query.shape[1], query.shape[2]
    staging = allocate_staging(batch, key.shape[1], head_dim, p, key.dtype, device, 2)
    staging.normal_()
    fq = allocate_frame_queries(batch, num_q_heads, head_dim, p, key.dtype, device, 2).normal_()
    # Tile 0's G tokens are staged; one new token is committed with it.
    plan = plan_store(
        [g] * batch, [1] * batch, [g + 1] * batch, list(range(batch)), table, p,
        staging_tiles=2, num_quantized=[0] * batch,
    ).to(device)  # fmt: skip
    out = {}
    for label, staged in (("", None), ("_frame_queries", fq)):

        def step(staged: torch.Tensor | None = staged) -> None:
            store_kv(key, value, cache, staging, plan, p, key_frame="auto", query=query,
                     frame_queries=staged, **sweeps)  # fmt: skip

        out[f"store_step_commit{label}_ms"] = _best_ms(step, quick, device)["ms"]
    return out


def _store_sweep(
    preset: str,
    shape: tuple[str, int, int, int],
    dtype: torch.dtype,
    device: torch.device,
    quick: bool,
    batch: int,
) -> list[dict[str, Any]]:
    """The store's decode-step and prefill costs (:func:`_store_cost`) at ``shape`` (name,
    query heads, KV heads, head_dim) for each of :data:`STORE_VARIANTS`; a variant that fails
    (e.g. out of registers) is recorded with its error and the sweep goes on."""
    rows = []
    for key_frame, iters, warps in STORE_VARIANTS:
        name, hq, hkv, d = shape
        row: dict[str, Any] = {"preset": preset, "shape": name, "key_frame": key_frame}
        row["iterations"] = iters
        row["warps"] = warps or "default"
        try:
            with settings.override(store_warps=int(warps) if warps else None):
                row.update(
                    _store_cost(preset, hkv, d, batch, dtype, device, quick, key_frame, hq, iters)
                )
        except Exception as exc:  # a variant that does not compile or run is a result too
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


# Launches timed by ``--sweep verify`` for the multi-query kernel: (SUB, warps), one stage. SUB
# below 32 cannot run the 4-bit-key path (its dots need 16 tokens per nibble phase); SUB 128
# gave NaN (4 warps) and an illegal memory access on 64-row blocks (H200, 2026-12-04), so
# multi-query blocks stay at SUB <= 64 (kernel.default_launch).
_MQ_LAUNCHES = ((64, 2), (64, 4), (64, 8), (32, 2), (32, 4), (32, 8))


def _launch_configs(verify: int) -> list[dict[str, int]]:
    """Launch parameters a sweep times: every autotune config for decode (``verify`` 0), else
    :data:`_MQ_LAUNCHES` for the multi-query kernel."""
    from kvarn_kernels.attention import kernel as attn_kernel

    if verify:
        return [{"SUB": s, "num_warps": w, "num_stages": 1} for s, w in _MQ_LAUNCHES]
    out = []
    for cfg in attn_kernel._configs():
        params = {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        if cfg.maxnreg is not None:
            params["maxnreg"] = cfg.maxnreg
        out.append(params)
    return out


def _sweep(
    preset: str,
    dtype: torch.dtype,
    device: torch.device,
    quick: bool,
    verify: int = 0,
    key_frame: str = "rotated",
    windows: str = "open",
) -> list[dict]:
    """Every autotune config of the attention kernel, timed one by one at a few sizes.

    The autotuner keys on the kernel's shape constants, not on the batch or context, so it
    picks once (at the first size it meets) for all of them; this shows what each config
    does where it matters, to choose the defaults. ``verify`` > 0 times the multi-query
    kernel instead, on a verify block of ``1 + verify`` tokens per sequence with the block's
    own K/V (``KVARN_VLLM_VERIFY_AS_DECODE=0``; a block of 16 tokens is also the shape of a
    prefill chunk's query block), over :data:`_MQ_LAUNCHES`; its error is against the same
    block as decode rows in the default launch.
    """
    from kvarn_kernels.attention import launch

    if device.type == "cuda":
        sizes = [("llama3-8b", 32, 8, 128, 16, 16384), ("llama3-8b", 32, 8, 128, 64, 16384)]
        sizes += [("hd64", 32, 8, 64, 64, 16384)]
        # head_dim 256 (Gemma-3-12B: 16 query / 8 KV heads)
        sizes += [("hd256", 16, 8, 256, 64, 16384)]
    else:  # --dry-run: checks the script in Triton's interpreter
        sizes = [("tiny", 4, 2, 64, 2, 512)]
    rows: list[dict[str, Any]] = []
    saved = launch.default_launch
    auto = key_frame == "auto"
    try:
        for shape_name, hq, hkv, d, b, ctx in sizes:
            template = _template_records(preset, d, hkv, dtype, device, mixed=auto)
            case = _Case(preset, hq, hkv, d, b, ctx, dtype, device, template, auto, windows)
            reference = case.verify(verify, True).float().clone() if verify else None
            for params in _launch_configs(verify):
                if params["SUB"] > get_preset(preset).group_size:
                    continue

                def fixed(
                    decode: bool = True,
                    head_dim: int = 128,
                    group_size: int = 128,
                    bits: tuple[int, int] | None = None,
                    params: dict[str, int] = params,
                ) -> dict[str, int]:
                    return dict(params)

                launch.default_launch = fixed
                row: dict[str, Any] = {
                    "preset": preset,
                    "shape": shape_name,
                    "batch": b,
                    "context": ctx,
                    **params,
                }
                try:
                    if reference is not None:
                        row["verify_tokens"] = 1 + verify

                        def step(c: _Case = case) -> torch.Tensor:
                            return c.verify(verify, False)

                        out = step().float()
                        row["rel_error_vs_decode_rows"] = float(
                            (out - reference).norm() / reference.norm()
                        )
                        ms = _best_ms(step, quick, device)["ms"]
                        row["time_us"] = ms * 1e3
                    else:
                        case.run()
                        ms = _best_ms(case.run, quick, device)["ms"]
                        row["time_us"] = ms * 1e3
                        # Each config checked too: software pipelining must not change the result.
                        row["rel_error_vs_dequantized_sdpa"] = _check_against_dequantized(case)
                    row["gbps"] = case.bytes_quantized() / (ms * 1e-3) / 1e9
                except Exception as exc:  # a config that does not compile is a result too
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                print(json.dumps(row), flush=True)
                rows.append(row)
            del case
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        launch.default_launch = saved
    return rows


def _fits(bytes_needed: float, device: torch.device) -> bool:
    if device.type != "cuda":
        return bytes_needed < 1 << 28
    free, _ = torch.cuda.mem_get_info(device)
    return bytes_needed < 0.8 * free


def _positive_int(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {raw!r}")
    return value


def _verify_drafts(raw: str) -> int:
    """``--verify K``: drafts per verify block, so that ``1 + K`` tokens run as decode rows
    (``0``, the default: no verify step is timed)."""
    from kvarn_kernels.attention.launch import VERIFY_AS_DECODE_MAX_QUERY

    k = int(raw)
    if not 0 <= k < VERIFY_AS_DECODE_MAX_QUERY:
        raise argparse.ArgumentTypeError(
            f"--verify takes 0 to {VERIFY_AS_DECODE_MAX_QUERY - 1} drafts (blocks of at most "
            f"{VERIFY_AS_DECODE_MAX_QUERY} tokens run as decode rows), got {k}"
        )
    return k


def run(args: argparse.Namespace) -> dict[str, Any]:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    quick = args.quick
    if args.dry_run:
        # The whole pipeline on tiny sizes in Triton's interpreter: checks the script, not speed.
        device = torch.device("cpu")
        shapes = [("tiny", 4, 2, 64)]
        batches, contexts, store_batch = [1, 2], [256], 4
    else:
        if not torch.cuda.is_available():
            raise SystemExit(
                "kvarn_kernels.bench needs a CUDA GPU (or --dry-run with TRITON_INTERPRET=1)"
            )
        device = torch.device("cuda")
        dims = getattr(args, "head_dims", None) or ([128] if quick else [128, 64])
        shapes = [SHAPES[d] for d in dims]
        batches = args.batches or ([16, 64] if quick else [1, 16, 64, 256])
        contexts = args.contexts or ([4096, 16384] if quick else [4096, 16384, 65536])
        store_batch = 256
    presets = args.presets
    if args.autotune:
        # the environment too, so that launch_env below records it
        os.environ["KVARN_KERNELS_AUTOTUNE"] = "1"
        settings.reload()
    from kvarn_kernels.attention.launch import batch_invariant, fast_prefetch

    t0 = time.time()
    hbm = measure_hbm_bandwidth(device, quick)
    cuda = device.type == "cuda"
    report: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(device) if cuda else "cpu (dry run, Triton interpreter)",
        "sm_count": torch.cuda.get_device_properties(device).multi_processor_count
        if cuda
        else None,
        "versions": _versions(),
        "git_sha": _git_sha(),
        "dtype": args.dtype,
        "quick": quick,
        "key_frame": args.key_frame,
        "windows": args.windows,
        "batch_invariant": batch_invariant(),
        "fast_prefetch": fast_prefetch(),  # tiles ahead the Gluon decode kernel prefetches
        # the measurement settings of the environment, as read by the launcher
        "launch_env": {k: os.environ.get(k) for k in _LAUNCH_ENV if os.environ.get(k)},
        "hbm_copy_gbps": hbm,
        "attention": [],
        "store": [],
        "notes": [],
    }
    mode = ", batch-invariant attention" if report["batch_invariant"] else ""
    print(f"# {report['gpu']}: device-to-device copy {hbm:.0f} GB/s{mode}", flush=True)
    for preset in [] if args.skip_grid else presets:
        for shape_name, hq, hkv, d in shapes:
            auto = args.key_frame == "auto"
            template = _template_records(preset, d, hkv, dtype, device, mixed=auto)
            checked = False
            for ctx in contexts:
                for b in batches:
                    lay = tile_layout(preset, d)
                    q_bytes = b * hkv * (ctx // lay.group_size) * lay.tile_bytes
                    fp16_bytes = b * hkv * (ctx + lay.group_size) * 4 * d
                    if not _fits(q_bytes * 1.2, device):
                        report["notes"].append(
                            f"skipped {preset} {shape_name} b={b} ctx={ctx}: memory"
                        )
                        continue
                    case = _Case(
                        preset, hq, hkv, d, b, ctx, dtype, device, template, auto, args.windows
                    )
                    row: dict[str, Any] = {
                        "preset": preset,
                        "shape": shape_name,
                        "num_q_heads": hq,
                        "num_kv_heads": hkv,
                        "head_dim": d,
                        "batch": b,
                        "context": ctx,
                    }
                    if not checked:
                        row["rel_error_vs_dequantized_sdpa"] = _check_against_dequantized(case)
                        checked = True
                    timing = _best_ms(case.run, quick, device)
                    ms = timing["ms"]
                    row["eager_us"] = timing["eager_ms"] * 1e3
                    row["graph_us"] = (
                        None if timing["graph_ms"] is None else timing["graph_ms"] * 1e3
                    )
                    nbytes = case.bytes_quantized()
                    row.update(
                        time_us=ms * 1e3,
                        bytes_read=nbytes,
                        gbps=nbytes / (ms * 1e-3) / 1e9,
                        num_splits=_splits(case),
                        fast_decode=_fast(case),
                    )
                    row["hbm_fraction"] = row["gbps"] / hbm
                    row["decode_kernels"] = _kernels(case)
                    if getattr(args, "legacy", False) and row["decode_kernels"] != "Triton":
                        # The single-kernel Triton path the tiles kernel replaced, same process.
                        from kvarn_kernels.attention import launch as _launch

                        was = _launch._TILES_DECODE
                        _launch.set_tiles_decode(False)
                        try:
                            legacy_ms = _best_ms(case.run, quick, device)["ms"]
                        finally:
                            _launch.set_tiles_decode(was)
                        row["legacy_us"] = legacy_ms * 1e3
                        row["legacy_hbm_fraction"] = nbytes / (legacy_ms * 1e-3) / 1e9 / hbm
                        row["speedup_vs_legacy"] = legacy_ms / ms
                    row["fp16_bytes"] = case.bytes_fp16()
                    row["fp16_ideal_us"] = case.bytes_fp16() / (hbm * 1e9) * 1e6
                    if _fits(fp16_bytes * 2.2 + q_bytes, device):
                        sdpa = _sdpa_baseline(case, quick)
                        row["sdpa_fp16_us"] = None if sdpa is None else sdpa * 1e3
                        row["speedup_vs_sdpa"] = None if sdpa is None else sdpa / ms
                        if not args.no_vllm and cuda:
                            vms, err = _vllm_baseline(case, quick)
                            row["vllm_triton_fp16_us"] = None if vms is None else vms * 1e3
                            row["speedup_vs_vllm_triton"] = None if vms is None else vms / ms
                            if err and err not in report["notes"]:
                                report["notes"].append(err)
                    else:
                        row["sdpa_fp16_us"] = None
                        report["notes"].append(
                            f"no fp16 baseline for {shape_name} b={b} ctx={ctx}: memory"
                        )
                    if args.verify:
                        for key, as_decode in (("multi_query", False), ("as_decode", True)):

                            def step(c: _Case = case, a: bool = as_decode) -> torch.Tensor:
                                return c.verify(args.verify, a)

                            row[f"verify_{key}_us"] = _best_ms(step, quick, device)["ms"] * 1e3
                        # How far apart the two launches' outputs are (the same attention).
                        mq = case.verify(args.verify, False).float()
                        dec = case.verify(args.verify, True).float()
                        row["verify_rel_diff"] = float((mq - dec).norm() / dec.norm())
                        row["verify_differing"] = float((mq != dec).float().mean())
                        row["verify_tokens"] = 1 + args.verify
                    report["attention"].append(row)
                    print(_row_line(row), flush=True)
                    if getattr(args, "out", None) is not None:
                        # What is measured so far survives a call cut short by its time limit.
                        args.out.parent.mkdir(parents=True, exist_ok=True)
                        args.out.write_text(json.dumps(report, indent=2))
                    del case
                    if cuda:
                        torch.cuda.empty_cache()
            if getattr(args, "no_store", False):
                continue
            store = _store_cost(
                preset, hkv, d, store_batch, dtype, device, quick, args.key_frame, hq
            )
            store.update(preset=preset, shape=shape_name, batch=store_batch)
            for r in report["attention"]:
                if r["preset"] == preset and r["shape"] == shape_name and r["batch"] == store_batch:
                    store[f"typical_fraction_of_attention_ctx{r['context']}"] = (
                        store["store_step_typical_ms"] * 1e3 / r["time_us"]
                    )
            report["store"].append(store)
            print(json.dumps(store), flush=True)
    report["autotune_choices"] = _autotune_choices()
    if args.sweep:
        os.environ["KVARN_KERNELS_AUTOTUNE"] = "0"
        settings.reload()
        verify = args.verify if args.sweep == "verify" else 0
        report["sweep"] = [
            r
            for p in presets
            for r in _sweep(p, dtype, device, quick, verify, args.key_frame, args.windows)
        ]
    if args.store_sweep:
        report["store_sweep"] = [
            r
            for p in presets
            for r in _store_sweep(p, shapes[0], dtype, device, quick, store_batch)
        ]
    report["elapsed_s"] = time.time() - t0
    return report


def _autotune_choices() -> dict[str, str]:
    """The attention config the autotuner picked per key (empty without autotuning)."""
    from kvarn_kernels.attention.kernel import attention_partial_kernel_autotuned

    cache = getattr(attention_partial_kernel_autotuned, "cache", {}) or {}
    return {str(k): str(v) for k, v in cache.items()}


def _fast(case: _Case) -> bool:
    """Whether ``decode_attention`` runs ``case``'s quantized tiles through the Gluon kernel."""
    from kvarn_kernels.attention.launch import fast_decode_applies

    return fast_decode_applies(case.query, case.layout, case.hkv, None)


def _kernels(case: _Case) -> str:
    """The kernels ``decode_attention`` runs for ``case``: the Gluon or the Triton tiles kernel
    over the records beside the Triton kernel's staged pass, or the Triton kernel alone."""
    from kvarn_kernels.attention.launch import tiles_decode_applies

    if _fast(case):
        return "Gluon + Triton"
    if tiles_decode_applies(case.query, case.layout, case.hkv):
        return "tiles + Triton"
    return "Triton"


def _splits(case: _Case) -> int:
    """The split count the launcher uses for ``case`` (the batch-invariant plan when on; with
    the fast path, the Gluon kernel's splits plus the Triton kernel's, one per staged tile)."""
    from kvarn_kernels.attention.launch import batch_invariant, fast_path_splits, launch_splits
    from kvarn_kernels.cache import staging_view

    g = case.layout.group_size
    invariant = batch_invariant()
    kernels = _kernels(case)
    if kernels != "Triton":
        tiles = (case.d, case.layout.preset.key_bits) if kernels.startswith("tiles") else None
        staged, fast_splits, _ = fast_path_splits(
            case.staging, g, case.sink_lens is not None, case.key_tiles, case.b, case.hkv,
            case.block_table.shape[1], case.device, invariant, True, tiles,
        )  # fmt: skip
        return staged + fast_splits
    sv = staging_view(case.staging, g, case.sink_lens is not None, case.key_tiles)
    chunks = case.block_table.shape[1] + (sv.ring + sv.sink) // g  # as the launcher counts
    return launch_splits(case.b, case.hkv, chunks, case.d, g, case.device, invariant)[1]


def _fmt(x: object, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _row_line(r: dict[str, Any]) -> str:
    return (
        f"| {r['preset']} | {r['shape']} | {r['batch']} | {r['context']} | {r['time_us']:.1f} | "
        f"{r['gbps']:.0f} | {100 * r['hbm_fraction']:.1f}% | "
        f"{_fmt(r.get('sdpa_fp16_us'), '.1f')} | "
        f"{_fmt(r.get('speedup_vs_sdpa'), '.2f')} | {_fmt(r.get('vllm_triton_fp16_us'), '.1f')} | "
        f"{_fmt(r.get('speedup_vs_vllm_triton'), '.2f')} | {r['num_splits']} | "
        f"{r.get('decode_kernels', 'Gluon + Triton' if r.get('fast_decode') else 'Triton')}"
        + (
            ""
            if r.get("legacy_us") is None
            else f" (Triton alone {r['legacy_us']:.1f} us, {100 * r['legacy_hbm_fraction']:.1f}%)"
        )
        + " | "
        f"{_fmt(r.get('eager_us'), '.1f')} |"
    )


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"GPU: {report['gpu']}; copy bandwidth {report['hbm_copy_gbps']:.0f} GB/s; "
        f"git {report['git_sha']}; {report['versions']}"
        + "".join(f"; {k}={v}" for k, v in report.get("launch_env", {}).items()),
        "",
        f"Decode attention; key frames {report.get('key_frame', 'rotated')}; staging read "
        f"besides the records: {report.get('windows', 'open')} ({_WINDOWS_TEXT[report.get('windows', 'open')]}).",
        "",
        "| preset | shape | batch | context | time (us) | GB/s | of HBM | SDPA fp16 (us) | "
        "x SDPA | "
        "vLLM Triton fp16 (us) | x vLLM | splits | kernels | eager (us) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- "
        "| ---: |",
    ]
    lines += [_row_line(r) for r in report["attention"]]
    lines += [
        "",
        f"Store, key frame {report.get('key_frame', 'rotated')}:",
        "",
        "| preset | shape | store typical step (us) | tiles | worst step (us) | per tile (us) "
        "| prefill per tile (us) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in report["store"]:
        lines.append(
            f"| {s['preset']} | {s['shape']} | {1e3 * s['store_step_typical_ms']:.1f} | "
            f"{s['store_step_typical_tiles']} | {1e3 * s['store_step_worst_ms']:.1f} | "
            f"{s['store_per_tile_us']:.2f} | {s.get('store_prefill_per_tile_us', float('nan')):.2f} |"
        )
        if "store_step_commit_ms" in s:
            lines.append(
                f"|  | speculative commit step, every request a staged tile: "
                f"{1e3 * s['store_step_commit_ms']:.1f} us with the step's first queries, "
                f"{1e3 * s['store_step_commit_frame_queries_ms']:.1f} us with frame queries "
                "| | | | |"
            )
        fr = {k: v for k, v in s.items() if k.startswith("typical_fraction")}
        if fr:
            lines.append(
                "|  | fraction of attention time: "
                + ", ".join(f"{k[-8:]} {100 * v:.2f}%" for k, v in fr.items())
                + " | | | | |"
            )
    verify = [r for r in report["attention"] if "verify_multi_query_us" in r]
    if verify:
        lines += [
            "",
            f"Speculative verify step, {verify[0]['verify_tokens']} tokens per sequence:",
            "",
            "| preset | shape | batch | context | decode step (us) | multi-query, own K/V (us) "
            "| as decode rows (us) | as decode / multi-query | outputs: rel. diff | differing |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in verify:
            mq, dec = r["verify_multi_query_us"], r["verify_as_decode_us"]
            lines.append(
                f"| {r['preset']} | {r['shape']} | {r['batch']} | {r['context']} | "
                f"{r['time_us']:.1f} | {mq:.1f} | {dec:.1f} | {dec / mq:.2f}x | "
                f"{r['verify_rel_diff']:.1e} | {100 * r['verify_differing']:.1f}% |"
            )
    if report.get("sweep"):
        tokens = report["sweep"][0].get("verify_tokens")
        lines += [
            "",
            f"Multi-query launches, a verify block of {tokens} tokens per sequence with its own "
            "K/V (rel. error against the block as decode rows):"
            if tokens
            else "Decode launches (rel. error against SDPA over the dequantized cache):",
            "",
            "| preset | shape | batch | context | SUB | warps | stages | maxnreg | time (us) "
            "| GB/s | rel. error |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in report["sweep"]:
            err = r.get("rel_error_vs_dequantized_sdpa", r.get("rel_error_vs_decode_rows"))
            t = (
                f"{r['time_us']:.1f} | {r['gbps']:.0f} | {_fmt(err, '.1e')}"
                if "time_us" in r
                else r["error"] + " | |"
            )
            lines.append(
                f"| {r.get('preset', '-')} | {r['shape']} | {r['batch']} | {r['context']} | "
                f"{r['SUB']} | {r['num_warps']} | {r.get('num_stages', 1)} | "
                f"{r.get('maxnreg', '-')} | {t} |"
            )
    if report.get("store_sweep"):
        lines += [
            "",
            "Store variants:",
            "",
            "| preset | shape | key frame | sweeps | warps | typical step (us) | worst step (us) "
            "| prefill chunk (us) | prefill per tile (us) | spec. commit step (us) | with frame "
            "queries (us) |",
            "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in report["store_sweep"]:
            head = (
                f"| {r['preset']} | {r['shape']} | {r['key_frame']} | {r['iterations']} | "
                f"{r['warps']} | "
            )
            if "error" in r:
                lines.append(head + f"{r['error']} | | | | | |")
                continue
            commit = " | ".join(
                f"{1e3 * r[k]:.1f}" if k in r else "-"
                for k in ("store_step_commit_ms", "store_step_commit_frame_queries_ms")
            )
            lines.append(
                head + f"{1e3 * r['store_step_typical_ms']:.1f} | "
                f"{1e3 * r['store_step_worst_ms']:.1f} | {1e3 * r['store_prefill_ms']:.1f} | "
                f"{r['store_prefill_per_tile_us']:.2f} | {commit} |"
            )
    if report["notes"]:
        lines += ["", *[f"- {n}" for n in report["notes"]]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvarn_kernels.bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    parser.add_argument("--quick", action="store_true", help="few sizes (< 2 minutes)")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--presets", nargs="+", default=["kvarn_k4v2_g128"])
    parser.add_argument(
        "--batches",
        nargs="+",
        type=_positive_int,
        help="decode batch sizes of the grid (default 16 64 with --quick, else 1 16 64 256)",
    )
    parser.add_argument(
        "--contexts",
        nargs="+",
        type=_positive_int,
        help="context lengths of the grid (default 4096 16384 with --quick, else also 65536)",
    )
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM Triton baseline")
    parser.add_argument(
        "--head-dims",
        nargs="+",
        type=int,
        choices=sorted(SHAPES),
        help="attention shapes by head_dim (default 128 with --quick, else 128 64): "
        + ", ".join(
            f"{d}: {n} ({hq} query / {hkv} KV heads)" for d, (n, hq, hkv, _) in SHAPES.items()
        ),
    )
    parser.add_argument(
        "--legacy",
        action="store_true",
        help="also time each case whose records the Triton tiles kernel reads with the single "
        "Triton kernel it replaced (attention_partial_kernel alone), in the same process",
    )
    parser.add_argument(
        "--no-store", action="store_true", help="skip the store cost (decode attention only)"
    )
    parser.add_argument(
        "--key-frame",
        choices=("rotated", "auto"),
        default="rotated",
        help="auto: the store chooses each tile's key frame from the queries, half the records "
        "read by attention hold unrotated keys (kvarn-vllm's default); rotated: the plain format",
    )
    parser.add_argument(
        "--windows",
        choices=WINDOWS,
        default="open",
        help="what decode attention reads from staging besides the records: open (the open "
        "tile only), keys (also the exact first and recent tiles, keys and values: kvarn-vllm "
        "with 2-bit keys), values (those tiles' values only, their keys from the records: "
        "kvarn-vllm's default with 4-bit keys)",
    )
    parser.add_argument(
        "--autotune",
        action="store_true",
        help="autotune the attention kernel (it tunes once per shape constants, at the first "
        "batch and context it meets; default: the untuned defaults an engine runs)",
    )
    parser.add_argument(
        "--sweep",
        nargs="?",
        const="decode",
        choices=("decode", "verify"),
        help="also time launch configs of the attention kernel at four sizes: decode (the "
        "default) every autotune config of the decode step; verify the multi-query kernel's "
        "launches on a verify block of 1 + K tokens (needs --verify K; K = 15 is the shape of a "
        "prefill chunk's 16-token query block)",
    )
    parser.add_argument(
        "--store-sweep",
        action="store_true",
        help="also time the store (decode step and prefill chunk) with each key frame, 0 and 2 "
        "normalization sweeps, and 16 or 32 warps per program besides the default (KVARN_KERNELS_STORE_WARPS)",
    )
    parser.add_argument(
        "--verify",
        type=_verify_drafts,
        default=0,
        metavar="K",
        help="also time a speculative verify step of 1 + K tokens per sequence at each grid "
        "size: the multi-query kernel with the block's own K/V (KVARN_VLLM_VERIFY_AS_DECODE=0) "
        "and the block as decode rows (kvarn-vllm's default under speculative decoding); "
        "0, the default, leaves it out",
    )
    parser.add_argument(
        "--skip-grid",
        action="store_true",
        help="skip the batch x context grid (with --sweep: only the sweep)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny sizes on the CPU in Triton's interpreter (checks the script)",
    )
    args = parser.parse_args(argv)
    if args.sweep == "verify" and not args.verify:
        parser.error(
            "--sweep verify times a verify block of 1 + K tokens: give --verify K (K >= 1)"
        )
    report = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print()
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
