"""What staging costs per request slot, and the KV tokens a memory budget then holds.

Arithmetic only (no torch, no vLLM): the byte counts are the ones the plugin allocates
(:func:`kvarn_vllm.staging.allocate_layer_staging`, ``kvarn_kernels.staging_shape``, the
dense-context workspace of :mod:`kvarn_vllm.dense`; tests compare them with real allocations),
and the pool follows vLLM 0.26's sizing: the KV cache gets what is left of
``gpu_memory_utilization x total memory`` after the weights, the activation peak of the profiling
run and non-torch memory; everything kvarn allocates at model build (staging, the workspace)
counts as weights, so it comes out of the pool first.

Run ``python -m kvarn_vllm.capacity`` for the table of projections (docs/capacity.md). These are
**projections**, not measurements: the non-KV memory of a budget is the one measured for bf16 on
the H200 (below), assumed equal on other cards.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace

from kvarn_math.layout import PRESETS, get_preset, tile_layout

from kvarn_vllm.config import KvarnConfig, default_window_keys

__all__ = [
    "BUDGETS",
    "LLAMA_3_1_8B",
    "Budget",
    "ModelShape",
    "Projection",
    "default_config",
    "dense_workspace_bytes",
    "main",
    "project",
    "staging_breakdown",
]

GIB = 2**30
BF16_BLOCK = 16  # vLLM's block size for a bf16 cache (tokens)
DENSE_CONTEXT_WORKSPACE_BYTES = 256 * 2**20  # kvarn_vllm.dense's (a test checks they agree)


@dataclass(frozen=True)
class ModelShape:
    """The attention shape of a model: what its KV cache and staging scale with.

    Attributes:
        name: a label.
        num_layers: attention layers with a KV cache of their own.
        num_heads: query heads (frame queries, speculative decoding only).
        num_kv_heads: KV heads per layer.
        head_dim: channels per head.
        dtype_bytes: bytes of the model dtype (2: bf16), which staging is kept in.
    """

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def bf16_bytes_per_token(self) -> int:
        """K and V of one token in every layer, in the model dtype."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


LLAMA_3_1_8B = ModelShape("llama-3.1-8b", num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128)


@dataclass(frozen=True)
class Budget:
    """A card's memory as vLLM sees it.

    Attributes:
        name: a label.
        total_gib: the card's total memory (what vLLM logs as ``Free memory on device (x/TOTAL
            GiB)``).
        utilization: ``gpu_memory_utilization``.
        non_kv_gib: weights, activation peak and non-torch memory of a bf16 engine (no kvarn).
    """

    name: str
    total_gib: float
    utilization: float
    non_kv_gib: float

    @property
    def kv_bytes(self) -> int:
        """What vLLM gives a bf16 KV cache."""
        return int((self.utilization * self.total_gib - self.non_kv_gib) * GIB)


# Llama-3.1-8B shape, dummy weights, bf16@FLASH_ATTN, vLLM 0.26 on the H200 (2026-11-30,
# docs/results/h200-2026-11-30f/bursts/tp/p4k/runs/throughput/llama-3.1-8b_tp1_bf16_FLASH_ATTN.log):
# "15.0 GiB for weight, 1.78 GiB for peak activation, 0.22 GiB for non-torch memory", 108.81 GiB
# of KV cache, 891,392 tokens, "139.29/139.8 GiB".
LLAMA_NON_KV_GIB = 15.0 + 1.78 + 0.22
# The H100 80GB HBM3 as torch reports it ("a total capacity of 79.18 GiB",
# docs/results/h100-2026-12-06/1_kernels/mla_bench.json).
H100_TOTAL_GIB = 79.18
H200_TOTAL_GIB = 139.8
BUDGETS: tuple[Budget, ...] = (
    Budget("H100 80 GB, 0.9", H100_TOTAL_GIB, 0.9, LLAMA_NON_KV_GIB),
    Budget("H200 141 GB, 0.9", H200_TOTAL_GIB, 0.9, LLAMA_NON_KV_GIB),
    Budget("24 GiB (H100 at 0.303)", H100_TOTAL_GIB, 0.303, LLAMA_NON_KV_GIB),
)


def default_config(preset: str, **settings: object) -> KvarnConfig:
    """The serving defaults of ``preset`` without speculative decoding (exact first tile on,
    one recent tile, values-only windows for 4-bit keys), overridden by ``settings``."""
    p = get_preset(preset)
    base = KvarnConfig(preset=p, sink=True, recent_tiles=1, window_keys=default_window_keys(p))
    return replace(base, **settings)  # type: ignore[arg-type]


def staging_breakdown(
    config: KvarnConfig, shape: ModelShape, window_dtype_bytes: int | None = None
) -> dict[str, int]:
    """Bytes of staging per request slot, all layers, by part: the open tiles' keys and values
    (``S`` tiles), the recent tiles' (``R``), the exact first tile's, and the frame queries
    (speculative decoding with auto key frames). A window keeps its keys only with
    ``config.window_keys``. The sum is what ``allocate_layer_staging`` allocates per slot and
    layer, times the layers.

    ``window_dtype_bytes``: bytes per element of the exact windows (sink, recent tiles) if they
    were kept in another dtype than the model's (1: fp8; a what-if, the plugin keeps the model
    dtype); None: the model dtype."""
    g = config.preset.group_size
    tile = g * shape.num_kv_heads * shape.head_dim * shape.dtype_bytes * shape.num_layers
    window = tile
    if window_dtype_bytes is not None:
        window = tile * window_dtype_bytes // shape.dtype_bytes
    s, r, sink = config.staging_tiles, config.recent_tiles, int(config.sink)
    keys = config.window_keys
    frame_tiles = config.staging_tiles if not keys else config.ring_tiles + sink
    frame = shape.num_heads * shape.head_dim * shape.dtype_bytes * shape.num_layers  # per tile
    return {
        "open_keys": s * tile,
        "open_values": s * tile,
        "recent_keys": r * window if keys else 0,
        "recent_values": r * window,
        "sink_keys": sink * window if keys else 0,
        "sink_values": sink * window,
        "frame_queries": frame_tiles * frame if config.frame_queries else 0,
    }


def dense_workspace_bytes(shape: ModelShape, max_model_len: int) -> int:
    """The dense-context workspace (one per process): ``2 x T x num_kv_heads x head_dim`` in
    the model dtype, ``T`` the most tokens that fit 256 MiB, a multiple of 128, at most
    ``4 x max_model_len`` (rounded up to 128), at least 128."""
    per_token = 2 * shape.num_kv_heads * shape.head_dim * shape.dtype_bytes
    tokens = DENSE_CONTEXT_WORKSPACE_BYTES // per_token // 128 * 128
    if max_model_len:
        tokens = min(tokens, -(-4 * max_model_len // 128) * 128)
    return max(tokens, 128) * per_token


@dataclass(frozen=True)
class Projection:
    """One preset's projected capacity on one budget.

    Attributes:
        slot_bytes: staging per request slot (all layers).
        fixed_bytes: staging of every slot plus the workspace: what is reserved today.
        bf16_tokens: the bf16 pool.
        kvarn_tokens: the kvarn pool with today's reservation (0 if it does not fit: vLLM then
            refuses to start).
        byte_limit: the bf16 page bytes per token over kvarn's (4.82 for k4v2 at head_dim 128).
        pool_tokens: the kvarn pool with nothing reserved but the workspace: what a pool holds
            when each request's staging is drawn from it only while the request runs.
        slot_tokens: what one running request's staging takes from such a pool (whole blocks).
        group_size: tokens per block (the tile ``G``).
    """

    preset: str
    budget: str
    slots: int
    slot_bytes: int
    fixed_bytes: int
    bf16_tokens: int
    kvarn_tokens: int
    byte_limit: float
    pool_tokens: int
    slot_tokens: int
    group_size: int

    @property
    def vs_bf16(self) -> float:
        return self.kvarn_tokens / self.bf16_tokens if self.bf16_tokens else 0.0

    @property
    def of_limit(self) -> float:
        """``vs_bf16`` as a share of the byte limit."""
        return self.vs_bf16 / self.byte_limit

    def live_vs_bf16(self, running: int) -> float:
        """Pool tokens left to records with ``running`` requests' staging drawn from the pool,
        against bf16's tokens."""
        left = max(self.pool_tokens - running * self.slot_tokens, 0)
        return left / self.bf16_tokens if self.bf16_tokens else 0.0

    def filled(self, context: int) -> tuple[int, float]:
        """A per-live pool filled with requests of ``context`` tokens each (at most ``slots``
        of them, each holding its records and its staging): how many run, and the pool tokens
        left to records against bf16's tokens."""
        records = -(-context // self.group_size) * self.group_size  # whole tiles
        running = min(self.slots, self.pool_tokens // (records + self.slot_tokens))
        return running, self.live_vs_bf16(running)

    def running_within(self, share: float = 0.97) -> int:
        """The most running requests for which a per-live pool keeps ``share`` of the byte
        limit (0 if even an idle pool does not)."""
        target = share * self.byte_limit * self.bf16_tokens
        spare = self.pool_tokens - target
        return max(int(spare // self.slot_tokens), 0) if self.slot_tokens else 0


def project(
    config: KvarnConfig,
    shape: ModelShape,
    budget: Budget,
    slots: int,
    max_model_len: int = 5376,
    window_dtype_bytes: int | None = None,
) -> Projection:
    """``config``'s capacity on ``budget`` with ``slots`` request slots (``max_num_seqs``).

    ``max_model_len`` sizes the workspace (5,376: the capacity suite's at 4K prompts);
    ``window_dtype_bytes`` as :func:`staging_breakdown`'s.
    """
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    g = config.preset.group_size
    block = tile_layout(config.preset, shape.head_dim).page_bytes(shape.num_kv_heads)
    block *= shape.num_layers  # one block of every layer: G tokens
    slot_bytes = sum(staging_breakdown(config, shape, window_dtype_bytes).values())
    workspace = dense_workspace_bytes(shape, max_model_len)
    fixed = slots * slot_bytes + workspace
    kv = budget.kv_bytes
    bf16_block = BF16_BLOCK * shape.bf16_bytes_per_token
    return Projection(
        preset=config.name,
        budget=budget.name,
        slots=slots,
        slot_bytes=slot_bytes,
        fixed_bytes=fixed,
        bf16_tokens=max(kv, 0) // bf16_block * BF16_BLOCK,
        kvarn_tokens=max(kv - fixed, 0) // block * g,
        byte_limit=shape.bf16_bytes_per_token * g / block,
        pool_tokens=max(kv - workspace, 0) // block * g,
        slot_tokens=math.ceil(slot_bytes / block) * g,
        group_size=g,
    )


def table(projections: list[Projection], running: int, context: int) -> str:
    """A Markdown table of ``projections``: today's fixed reservation, then a per-live pool idle,
    with ``running`` requests, and filled with ``context``-token requests (shares of the byte
    limit), and how many running requests keep it within 3%."""
    head = (
        "| budget | preset | staging MiB/slot | reserved GiB | bf16 tokens | kvarn tokens | "
        f"vs bf16 | of byte limit | per-live pool, idle | per-live pool, {running} running | "
        f"per-live pool filled with {context:,}-token requests | running within 3% |\n"
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
    )
    rows = []
    for p in projections:
        n, share = p.filled(context)
        rows.append(
            f"| {p.budget} | {p.preset} | {p.slot_bytes / 2**20:.0f} | {p.fixed_bytes / GIB:.2f} | "
            f"{p.bf16_tokens:,} | {p.kvarn_tokens:,} | {p.vs_bf16:.2f}x (limit "
            f"{p.byte_limit:.2f}x) | {p.of_limit:.1%} | {p.live_vs_bf16(0) / p.byte_limit:.1%} | "
            f"{p.live_vs_bf16(running) / p.byte_limit:.1%} | {share / p.byte_limit:.1%} ({n} "
            f"running) | {p.running_within():,} |"
        )
    return head + "\n".join(rows)


def breakdown_table(shape: ModelShape) -> str:
    """Staging per request slot by part for every preset's defaults (MiB, all layers)."""
    parts = list(staging_breakdown(default_config(next(iter(PRESETS))), shape))
    head = "| preset | " + " | ".join(parts) + " | total |\n"
    head += "| --- |" + " ---: |" * (len(parts) + 1) + "\n"
    rows = []
    for name in PRESETS:
        b = staging_breakdown(default_config(name), shape)
        cells = " | ".join(f"{b[k] / 2**20:g}" for k in parts)
        rows.append(f"| {name} | {cells} | {sum(b.values()) / 2**20:g} |")
    return head + "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvarn_vllm.capacity``: the staging breakdown and the projected capacity of
    every preset on each budget (Llama-3.1-8B shape), as Markdown."""
    parser = argparse.ArgumentParser(prog="python -m kvarn_vllm.capacity", description=__doc__)
    parser.add_argument("--slots", type=int, default=256, help="max_num_seqs (default 256)")
    parser.add_argument("--recent", type=int, default=1, help="KVARN_VLLM_RECENT_TILES")
    parser.add_argument("--no-sink", action="store_true", help="KVARN_VLLM_EXACT_SINK=0")
    parser.add_argument(
        "--fp8-windows",
        action="store_true",
        help="what if the exact windows were kept in fp8 (not a setting: the plugin keeps bf16)",
    )
    parser.add_argument(
        "--running", type=int, default=None, help="running requests (default: --slots)"
    )
    parser.add_argument(
        "--context", type=int, default=16384, help="tokens per request of a filled pool"
    )
    args = parser.parse_args(argv)
    shape = LLAMA_3_1_8B
    print(f"Staging per request slot, {shape.name} shape, serving defaults (MiB):\n")
    print(breakdown_table(shape))
    settings = {"recent_tiles": args.recent, "sink": not args.no_sink}
    projections = [
        project(
            default_config(name, **settings),
            shape,
            budget,
            args.slots,
            window_dtype_bytes=1 if args.fp8_windows else None,
        )
        for budget in BUDGETS
        for name in PRESETS
    ]
    running = args.slots if args.running is None else args.running
    print(f"\nProjected capacity (planner arithmetic, not a measurement), {args.slots} slots:\n")
    print(table(projections, running, args.context))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
