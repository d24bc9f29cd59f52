"""Launchers of the MLA latent-cache kernels (format: :mod:`kvarn_math.mla`).

* :func:`store_latent`: quantize-on-write of token rows into their records (``slot_mapping``
  as vLLM's ``concat_and_cache_mla``; a slot ``< 0`` is padding and writes nothing).
* :func:`mla_decode_attention`: one query token per sequence, absorbed-weight MLA in latent
  space over the quantized tiles plus the exact open tail in a staging ring; split over the
  context with a combine kernel; fixed grid and no host synchronization (CUDA-graph safe).
* :func:`dequantize_latent`: whole tiles back to ``[latent | rope]`` rows in the model dtype,
  for prefill continuation chunks and prefix-cache hits.
"""

from __future__ import annotations

import torch
import triton.language as tl  # type: ignore[import-untyped]
from kvarn_math.mla import MLALayout, MLAPreset, get_mla_preset, mla_layout

from kvarn_kernels import settings
from kvarn_kernels._guards import check_tensor
from kvarn_kernels._triton import INTERPRET, PRECISE_MATH
from kvarn_kernels.mla.decode import field_asm, mla_combine_kernel, mla_decode_kernel
from kvarn_kernels.mla.kernel import mla_dequantize_kernel, mla_stage_kernel, mla_store_kernel
from kvarn_kernels.mla.verified import launch_verified

__all__ = [
    "mla_cache_shape",
    "allocate_mla_cache",
    "store_latent",
    "stage_latent",
    "dequantize_latent",
    "mla_decode_attention",
    "choose_mla_splits",
    "default_heads_per_program",
]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_DOT_TYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_H100_SMS = 132
_MAX_SPLITS = 64
_MIN_TILES = 4  # tiles a split at least (a split's partials cost about one tile's bytes)


def _layout(preset: str | MLAPreset, latent_dim: int, rope_dim: int) -> MLALayout:
    return mla_layout(get_mla_preset(preset), latent_dim, rope_dim)


def _offsets(lay: MLALayout) -> dict[str, int]:
    o = lay.offsets
    return {
        "OFF_CODES": o["latent_codes"],
        "OFF_SCALE": o["latent_scale"],
        "OFF_ZERO": o["latent_zero"],
        "OFF_ROPE": o["rope_codes"],
        "OFF_ROPE_SCALE": o["rope_scale"],
    }


def mla_cache_shape(
    num_blocks: int, preset: str | MLAPreset, latent_dim: int = 512, rope_dim: int = 64
) -> tuple[int, int]:
    """``(num_blocks, tile_bytes)``: one record per paged block (one layer)."""
    return (num_blocks, _layout(preset, latent_dim, rope_dim).tile_bytes)


def allocate_mla_cache(
    num_blocks: int,
    preset: str | MLAPreset,
    latent_dim: int = 512,
    rope_dim: int = 64,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """A zeroed uint8 cache of :func:`mla_cache_shape`."""
    shape = mla_cache_shape(num_blocks, preset, latent_dim, rope_dim)
    return torch.zeros(shape, dtype=torch.uint8, device=device)


def _check_cache(cache: torch.Tensor, lay: MLALayout) -> None:
    check_tensor("cache", cache, dtype=torch.uint8, ndim=2, shape=(None, lay.tile_bytes))
    if cache.stride(1) != 1 or cache.stride(0) % 2:
        raise ValueError(
            f"cache rows must be contiguous with an even row stride, got strides {cache.stride()}"
        )


def store_latent(
    latent: torch.Tensor,
    rope: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    preset: str | MLAPreset,
) -> None:
    """Quantize token rows into the cache (in place).

    Args:
        latent: ``[T, L]`` fp16/bf16/fp32 latent ``c_kv`` (after its norm).
        rope: ``[T, R]`` RoPE key ``k_pe`` after RoPE, same dtype.
        cache: uint8 ``[num_blocks, tile_bytes]``.
        slot_mapping: int32/int64 ``[T]``: token ``t`` goes to row ``slot % G`` of block
            ``slot // G``; ``< 0`` skips the token.
        preset: the MLA preset.
    """
    check_tensor("latent", latent, dtype=_FLOATS, ndim=2, last_dim_contiguous=True)
    t, width = latent.shape
    check_tensor(
        "rope", rope, dtype=latent.dtype, ndim=2, shape=(t, None), last_dim_contiguous=True
    )
    lay = _layout(preset, width, rope.shape[1])
    _check_cache(cache, lay)
    check_tensor("slot_mapping", slot_mapping, dtype=(torch.int32, torch.int64), shape=(t,))
    if t == 0:
        return
    p = lay.preset
    mla_store_kernel[(t,)](
        latent,
        latent.stride(0),
        rope,
        rope.stride(0),
        slot_mapping,
        cache,
        cache.view(torch.float16),
        cache.view(torch.int8),
        cache.stride(0),
        L=width,
        R=rope.shape[1],
        G=p.group_size,
        BITS=p.latent_bits,
        W=p.channel_group,
        PRECISE=PRECISE_MATH,
        **_offsets(lay),
        num_warps=4,
    )


def stage_latent(
    latent: torch.Tensor,
    rope: torch.Tensor,
    staging: torch.Tensor,
    staging_slots: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """Copy token rows into the staging ring (exact, in staging's dtype), where
    :func:`mla_decode_attention` reads the open tile: ``staging[slot, p % (S * G)] =
    [latent | rope]``. One program per token, no host sync (CUDA-graph safe).

    Args:
        latent: ``[T, L]``; rope: ``[T, R]`` (any float dtype, last dim contiguous).
        staging: ``[num_slots, S * G, L + R]``, last dim contiguous.
        staging_slots: int ``[T]``: each token's slot (its sequence's), ``< 0`` skips it.
        positions: int ``[T]``: each token's position in its sequence.
    """
    check_tensor("latent", latent, dtype=_FLOATS, ndim=2, last_dim_contiguous=True)
    t, width = latent.shape
    check_tensor("staging", staging, dtype=_FLOATS, ndim=3, last_dim_contiguous=True)
    check_tensor(
        "rope", rope, dtype=_FLOATS, shape=(t, staging.shape[2] - width), last_dim_contiguous=True
    )
    check_tensor("staging_slots", staging_slots, dtype=(torch.int32, torch.int64), shape=(t,))
    check_tensor("positions", positions, dtype=(torch.int32, torch.int64), shape=(t,))
    if t == 0:
        return
    mla_stage_kernel[(t,)](
        latent,
        latent.stride(0),
        rope,
        rope.stride(0),
        staging_slots,
        positions,
        staging,
        staging.stride(0),
        staging.stride(1),
        staging.shape[1],
        L=width,
        R=rope.shape[1],
        num_warps=4,
    )


def dequantize_latent(
    cache: torch.Tensor,
    block_ids: torch.Tensor,
    preset: str | MLAPreset,
    latent_dim: int = 512,
    rope_dim: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tiles ``block_ids`` (int32 ``[N]``) to ``[N * G, L + R]`` rows ``[latent | rope]``."""
    lay = _layout(preset, latent_dim, rope_dim)
    _check_cache(cache, lay)
    check_tensor("block_ids", block_ids, dtype=(torch.int32, torch.int64), ndim=1)
    g, n = lay.group_size, block_ids.shape[0]
    if out is None:
        out = torch.empty((n * g, latent_dim + rope_dim), dtype=dtype, device=cache.device)
    check_tensor(
        "out", out, dtype=_FLOATS, shape=(n * g, latent_dim + rope_dim), last_dim_contiguous=True
    )
    if n == 0:
        return out
    p = lay.preset
    block_t = 32
    mla_dequantize_kernel[(n, g // block_t)](
        cache,
        cache.view(torch.float16),
        cache.view(torch.int8),
        cache.stride(0),
        block_ids,
        out,
        out.stride(0),
        L=latent_dim,
        R=rope_dim,
        G=g,
        BITS=p.latent_bits,
        W=p.channel_group,
        BLOCK_T=block_t,
        **_offsets(lay),
        num_warps=4,
    )
    return out


def choose_mla_splits(
    batch: int,
    head_blocks: int,
    max_tiles: int,
    num_sms: int = _H100_SMS,
    min_tiles: int = _MIN_TILES,
    programs_per_sm: int = 2,
) -> int:
    """Split-K factor from host sizes only (so a captured graph keeps it): as many programs as
    the GPU runs at once (``programs_per_sm * num_sms`` over ``batch * head_blocks``, rounded
    down: one wave, not a second one almost empty) for a context of ``max_tiles`` tiles (the
    block table's width); splits of at least ``min_tiles`` tiles (each split writes ``HB x L``
    fp32 partials, worth a few tiles of records), at most 64, and none left empty by rounding
    (``ceil(max_tiles / per_split)``). The kernel shares each sequence's own tiles out over the
    splits, so shorter sequences get shorter splits."""
    want = max(1, programs_per_sm * num_sms // max(1, batch * head_blocks))
    tiles = max(1, max_tiles)
    per_split = max(-(-tiles // min(want, _MAX_SPLITS)), min_tiles, 1)
    return -(-tiles // per_split)


def _sm_count(device: torch.device) -> int:
    """SMs of ``device`` (a host query, no synchronization); 132 (an H100) off the GPU."""
    if device.type != "cuda":
        return _H100_SMS
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def default_heads_per_program(heads: int) -> int:
    """Query heads sharing one unpacked chunk: 16 or 32 (more heads: several head blocks,
    whose reads of the same chunk meet in L2)."""
    return 16 if heads <= 16 else 32


def _decode_config(hb: int, bits: int, group_size: int) -> dict[str, int]:
    """Record rows a chunk, warps, pipeline stages and programs an SM holds (shared memory) of
    the decode kernel for ``hb`` heads: sized (``ptxas`` for sm_90) to keep the accumulators in
    registers without spilling, and at 16 heads to fit two programs in an SM."""
    if hb <= 16:
        cfg = {"block_tokens": 32, "num_warps": 4, "num_stages": 2, "programs_per_sm": 2}
    else:
        block_t = 64 if bits < 8 else 32
        cfg = {"block_tokens": block_t, "num_warps": 8, "num_stages": 2, "programs_per_sm": 1}
    cfg["block_tokens"] = min(cfg["block_tokens"], group_size)
    return cfg


def _codes_as_floats(dot_t: torch.dtype, bits: int) -> tuple[int, float, str, str]:
    """``(MAGIC, OFF, ASM, ASM_C)``: the bits OR-ed into a code to read it as ``OFF + code`` in
    the dot dtype (bf16 128 for codes below 128, on the GPU; fp16 1024; else ``(0, 0)``: an
    exact conversion), and the PTX that does it two codes a register (not in the interpreter, not
    for 8-bit codes, not with ``KVARN_KERNELS_NO_ASM=1``)."""
    if dot_t == torch.bfloat16 and bits <= 4 and not INTERPRET:  # (no bf16 constants there)
        magic, offset = 0x4300, 128.0
    elif dot_t == torch.float16:
        magic, offset = 0x6400, 1024.0
    else:
        return 0, 0.0, "", ""
    if INTERPRET or bits == 8 or settings.current().no_asm:
        return magic, offset, "", ""
    return (magic, offset, *field_asm(bits, magic))


def mla_decode_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    staging: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    quantized_lens: torch.Tensor,
    staging_slots: torch.Tensor,
    preset: str | MLAPreset,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    heads_per_program: int | None = None,
    block_tokens: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    min_tiles: int | None = None,
    tokens_on_m: bool = False,
) -> torch.Tensor:
    """Absorbed-weight MLA decode over the quantized latent cache plus the staged tail.

    Two kernels, chosen by ``KVARN_KERNELS_MLA_DECODE`` (:mod:`kvarn_kernels.settings`, read
    at each call): ``verified`` (the default, :mod:`kvarn_kernels.mla.verified`: each chunk
    dequantized before the dots; passed the GPU tests) or ``fast`` (:mod:`kvarn_kernels.mla.
    decode`: the codes into the dots; faster, but it failed 7 of 32 GPU tests on 2026-12-06;
    its codes are centred since, a fix not yet run on a GPU).
    The verified kernel takes ``num_splits`` and ``heads_per_program`` and ignores
    ``block_tokens``, ``num_warps``, ``num_stages``, ``min_tiles`` and ``tokens_on_m`` (the
    fast kernel's tuning knobs).

    Args:
        q_latent: ``[B, H, L]`` the query's no-RoPE part absorbed through ``W_UK`` (fp16, bf16
            or fp32; the dots take this dtype's operands, fp32 accumulation).
        q_rope: ``[B, H, R]`` the query's RoPE part after RoPE, same dtype.
        cache: uint8 ``[num_blocks, tile_bytes]``.
        staging: ``[num_slots, S * G, L + R]`` exact rows ``[latent | rope]``: position ``p``
            of a sequence at ``staging[slot, p % (S * G)]``.
        block_table: int32 ``[B, max_blocks]``.
        seq_lens: int32 ``[B]`` keys of each sequence (the query's own token included).
        quantized_lens: int32 ``[B]``, multiples of ``G``: positions read from records; the
            rest ``[quantized_len, seq_len)`` are read from staging.
        staging_slots: int32 ``[B]``.
        preset: the MLA preset.
        scale: softmax scale.
        out: optional ``[B, H, L]`` output in q's dtype.
        num_splits: split-K factor (``None``: :func:`choose_mla_splits`).
        heads_per_program: query heads sharing one unpacked chunk (power of two >= 16;
            ``None``: :func:`default_heads_per_program`).
        block_tokens: record rows a chunk (power of two >= 16 dividing ``G``); ``num_warps``,
            ``num_stages``: Triton launch settings. ``None``: the defaults for ``H`` and the
            preset (tuning knobs for the benchmark; the results do not depend on them beyond
            float rounding).
        min_tiles: tiles a split at least (``None``: 4): a sequence of ``n`` tiles is shared
            out ``max(ceil(n / splits), min_tiles)`` a split, so short ones use fewer splits.
        tokens_on_m: the dots transposed, tokens on their M side (``wgmma`` on sm_90; an
            alternative measured by the benchmark's sweep, not the default).

    Returns:
        ``[B, H, L]`` attention output in latent space (multiply by ``W_UV`` per head).
    """
    check_tensor("q_latent", q_latent, dtype=_FLOATS, ndim=3, last_dim_contiguous=True)
    bsz, heads, width = q_latent.shape
    check_tensor(
        "q_rope", q_rope, dtype=q_latent.dtype, shape=(bsz, heads, None), last_dim_contiguous=True
    )
    rdim = q_rope.shape[2]
    lay = _layout(preset, width, rdim)
    _check_cache(cache, lay)
    g = lay.group_size
    check_tensor(
        "staging",
        staging,
        dtype=_FLOATS,
        ndim=3,
        shape=(None, None, width + rdim),
        last_dim_contiguous=True,
    )
    if staging.shape[1] % g or staging.shape[1] == 0:
        raise ValueError(f"staging rows must be a positive multiple of G={g}, got {staging.shape}")
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, shape=(bsz, None))
    for name, t in (
        ("seq_lens", seq_lens),
        ("quantized_lens", quantized_lens),
        ("staging_slots", staging_slots),
    ):
        check_tensor(name, t, dtype=torch.int32, shape=(bsz,), contiguous=True)
    if out is None:
        out = torch.empty_like(q_latent)
    check_tensor(
        "out", out, dtype=q_latent.dtype, shape=(bsz, heads, width), last_dim_contiguous=True
    )
    if bsz == 0:
        return out
    p = lay.preset
    hb = heads_per_program or default_heads_per_program(heads)
    if hb < 16 or hb & (hb - 1):
        raise ValueError(f"heads_per_program must be a power of two >= 16, got {hb}")
    if settings.current().mla_decode == "verified":
        return launch_verified(
            q_latent, q_rope, cache, staging, block_table, seq_lens, quantized_lens,
            staging_slots, scale, out, _offsets(lay), p.latent_bits, p.channel_group, g,
            _DOT_TYPES[q_latent.dtype], num_splits, hb,
        )  # fmt: skip
    if width % p.channel_group or width // p.channel_group > 2:
        raise ValueError(
            f"the decode kernel takes 1 or 2 channel groups a row, got latent_dim={width} with "
            f"channel_group={p.channel_group}"
        )
    cfg = _decode_config(hb, p.latent_bits, g)
    block_t = block_tokens or cfg["block_tokens"]
    if block_t < 16 or block_t & (block_t - 1) or g % block_t:
        raise ValueError(
            f"block_tokens must be a power of two >= 16 dividing G={g}, got {block_tokens}"
        )
    head_blocks = -(-heads // hb)
    max_tiles = block_table.shape[1]
    least = _MIN_TILES if min_tiles is None else min_tiles
    if least < 1:
        raise ValueError(f"min_tiles must be at least 1, got {min_tiles}")
    splits = num_splits or choose_mla_splits(
        bsz,
        head_blocks,
        max_tiles,
        num_sms=_sm_count(cache.device),
        min_tiles=least,
        programs_per_sm=cfg["programs_per_sm"],
    )
    ws_acc = torch.empty((bsz, heads, splits, width), dtype=torch.float32, device=cache.device)
    ws_ml = torch.empty((bsz, heads, splits, 2), dtype=torch.float32, device=cache.device)
    magic, offset, asm, asm_c = _codes_as_floats(q_latent.dtype, p.latent_bits)
    mla_decode_kernel[(head_blocks, splits, bsz)](
        q_latent,
        q_rope,
        q_latent.stride(0),
        q_latent.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        cache,
        cache.view(torch.float16),
        cache.view(torch.int8),
        cache.stride(0),
        staging,
        staging.stride(0),
        staging.stride(1),
        block_table,
        block_table.stride(0),
        seq_lens,
        quantized_lens,
        staging_slots,
        ws_acc,
        ws_ml,
        least,
        float(scale),
        heads,
        staging.shape[1],
        L=width,
        R=rdim,
        G=g,
        BITS=p.latent_bits,
        W=p.channel_group,
        HB=hb,
        BLOCK_T=block_t,
        MAGIC=magic,
        OFF=offset,
        HALF=float(1 << (p.latent_bits - 1)),
        DOT_T=_DOT_TYPES[q_latent.dtype],
        ASM=asm,
        ASM_C=asm_c,
        TOKENS_M=tokens_on_m,
        **_offsets(lay),
        num_warps=num_warps or cfg["num_warps"],
        num_stages=num_stages or cfg["num_stages"],
    )
    mla_combine_kernel[(bsz, heads)](
        ws_acc,
        ws_ml,
        out,
        out.stride(0),
        out.stride(1),
        heads,
        splits,
        L=width,
        SPLITS_P2=max(2, 1 << (splits - 1).bit_length()),
        num_warps=4,
    )
    return out
