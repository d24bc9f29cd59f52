"""Quantize tiles of K and V into records, and back.

The two frames are explicit:

* :func:`encode_tiles` / :func:`decode_tiles` work in the **rotated** frame (what the cache
  stores and what attention kernels read).
* :func:`quantize_tiles` / :func:`dequantize_tiles` take and return the **original** frame:
  they rotate with the Hadamard transform before encoding and un-rotate after decoding.

A tile's keys may be stored in their own channels instead (``raw_keys``; the record's
``KEYS_UNROTATED`` flag): per-channel quantization over tokens then isolates outlier channels
that the rotation would spread. :func:`choose_key_frames` picks the frame per tile from the
queries that read it (an estimate of :func:`key_frame_errors`); :func:`decode_tiles` still
returns every tile's keys in the rotated frame and :func:`dequantize_tiles` in the original one.

Encoding one tile (``k``, ``v``: ``[G, D]`` rotated)::

    K = k.T                                   # [D, G]: rows are channels
    b = variance_normalize(K)                 # K ~ B * r[:, None] * c[None, :]
    n = encode_log8(c); cq = decode_log8(n)   # the column factors as the record holds them
    q = quantize_rows(K / (r[:, None] * cq[None, :]), key_bits)  # per channel over tokens
    k_scale = fp16(q.step * r); k_zero = fp16(q.lo * r); k_token_scale = n

    (v the same way with rows = tokens: v_scale, v_zero per token, v_channel_scale = n)

The column factors are rounded to their one-byte log code *before* the rows are quantized,
so the codes absorb that rounding.  Row scales are stored as float16; a tile whose folded row
scales pass fp16's range moves powers of two from them into the column codes, and a tile too
large even for that (past about 1e9) raises, or is saturated with ``overflow="saturate"`` as
the kernels do (:mod:`kvarn_math.ranges`). Decoders check records first and name the record
and field that cannot be this format's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvarn_math.hadamard import rotate, unrotate
from kvarn_math.layout import KEYS_UNROTATED, Preset, TileLayout, get_preset, tile_layout
from kvarn_math.log8 import decode_log8, encode_log8
from kvarn_math.packing import pack, unpack
from kvarn_math.ranges import (
    check_input_bound,
    check_records,
    fit_row_scales,
    pow2,
    prescale_exponent,
)
from kvarn_math.rtn import quantize_rows
from kvarn_math.varnorm import DEFAULT_ITERATIONS, variance_normalize

__all__ = [
    "TileFields",
    "check_finite",
    "encode_tiles",
    "decode_tiles",
    "quantize_tiles",
    "dequantize_tiles",
    "KEY_FRAMES",
    "key_frame_errors",
    "key_frame_estimates",
    "choose_key_frames",
    "FRAME_QUERY_ROWS",
    "frame_query_rows",
    "read_fields",
]

KEY_FRAMES = ("auto", "rotated")
"""How a store may treat tiles' keys: ``"auto"`` chooses each tile's frame from the queries
(:func:`choose_key_frames`), ``"rotated"`` rotates every tile (the plain format). The kernels'
``store_kv``, kvarn-vllm's ``KVARN_VLLM_KEY_FRAME`` and :class:`kvarn_math.baselines.KVarN` take
these names."""

F32 = npt.NDArray[np.float32]


def check_finite(x: npt.NDArray[np.floating], name: str) -> None:
    """Raise ``ValueError`` naming the tile and position of the first NaN or Inf in ``x``.

    Args:
        x: ``[..., G, D]`` tiles (token-major).
        name: what ``x`` is, for the message (``"k"`` or ``"v"``).
    """
    bad = ~np.isfinite(x)
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        *tile, token, channel = index
        value = x[index]
        where = f"tile {tuple(tile)}" if tile else "the tile"
        raise ValueError(
            f"{name} {where} holds {value} at token {token}, channel {channel}; "
            "KVarN tiles must be finite"
        )


def _check_tiles(
    k: npt.ArrayLike, v: npt.ArrayLike, lay_preset: Preset, overflow: str
) -> tuple[F32, F32, TileLayout]:
    k_arr = np.asarray(k, dtype=np.float32)
    v_arr = np.asarray(v, dtype=np.float32)
    if k_arr.shape != v_arr.shape or k_arr.ndim < 2:
        raise ValueError(
            f"k and v must both be [..., G, D] of one shape, got {k_arr.shape} and {v_arr.shape}"
        )
    g, d = k_arr.shape[-2:]
    if g != lay_preset.group_size:
        raise ValueError(
            f"{lay_preset.name} tiles hold {lay_preset.group_size} tokens, got {g} (shape {k_arr.shape})"
        )
    lay = tile_layout(lay_preset, d)
    check_finite(k_arr, "k")
    check_finite(v_arr, "v")
    return check_input_bound(k_arr, "k", overflow), check_input_bound(v_arr, "v", overflow), lay


def _raw_mask(raw_keys: npt.ArrayLike, lead: tuple[int, ...]) -> npt.NDArray[np.bool_]:
    arr = np.asarray(raw_keys)
    if arr.dtype != np.bool_:
        raise ValueError(f"raw_keys must be bool (a scalar or one per tile), got {arr.dtype}")
    try:
        return np.broadcast_to(arr, lead)
    except ValueError:
        raise ValueError(
            f"raw_keys must be a scalar or one flag per tile {lead}, got shape {arr.shape}"
        ) from None


def _balance(x: F32, row_scale: F32, col_codes: npt.NDArray[np.uint8]) -> F32:
    """``x / (row_scale[:, None] * log8(col_codes)[None, :])`` in float32: the tile the rows
    are quantized from, balanced with the column factors as the record stores them."""
    scale = row_scale[..., :, None] * decode_log8(col_codes)[..., None, :]
    out: F32 = (x / scale).astype(np.float32)
    return out


def _encode_rows(
    x: F32, bits: int, iterations: int, clip_ratios: tuple[float, ...], name: str, overflow: str
) -> tuple[
    npt.NDArray[np.uint8], npt.NDArray[np.float16], npt.NDArray[np.float16], npt.NDArray[np.uint8]
]:
    """One half of a record from tiles ``x`` ``[..., R, C]`` (rows quantized):
    ``(codes [..., R, C], scale fp16 [..., R], zero fp16 [..., R], column codes [..., C])``,
    fitted into the record's range as :mod:`kvarn_math.ranges` says."""
    prescale = prescale_exponent(x)
    if prescale.any():
        x = (x * pow2(-prescale)[..., None, None]).astype(np.float32)
    bal = variance_normalize(x, iterations)
    col = encode_log8(bal.col_scale)
    q = quantize_rows(_balance(x, bal.row_scale, col), bits, clip_ratios)
    step = (q.step * bal.row_scale).astype(np.float32)
    lo = (q.lo * bal.row_scale).astype(np.float32)
    scale, zero, col, over = fit_row_scales(step, lo, col, prescale)
    if over.any() and overflow == "raise":
        tile = tuple(int(i) for i in np.argwhere(over)[0])
        amax = float(np.abs(x[tile]).max()) * 2.0 ** int(prescale[tile])
        raise ValueError(
            f"{name} tile {tile} (largest magnitude {amax:.4g}) is past what a KVarN record "
            "holds (its fp16 row scales times its log8 factors); overflow='saturate' stores it "
            "saturated, as the kernels do (docs/reliability.md)"
        )
    return q.codes, scale, zero, col


def encode_tiles(
    k_rot: npt.ArrayLike,
    v_rot: npt.ArrayLike,
    preset: str | Preset,
    iterations: int = DEFAULT_ITERATIONS,
    clip_ratios: tuple[float, ...] = (),
    raw_keys: npt.ArrayLike = False,
    overflow: str = "raise",
) -> npt.NDArray[np.uint8]:
    """Encode rotated tiles into records.

    Args:
        k_rot: ``[..., G, D]`` keys in the rotated frame (any float dtype), or in their own
            channels for the tiles ``raw_keys`` marks.
        v_rot: ``[..., G, D]`` values in the rotated frame.
        preset: preset name or :class:`Preset`; ``G`` must equal its group size.
        iterations: variance-normalization sweeps.
        clip_ratios: experimental range clipping searched per row (see
            :func:`kvarn_math.rtn.quantize_rows`); ``()`` (the format's definition) is plain RTN.
            Records stay in the same byte format either way.
        raw_keys: bool, scalar or ``[...]``: tiles whose ``k_rot`` is given unrotated; their
            records get the ``KEYS_UNROTATED`` flag. The encoding itself is the same.
        overflow: ``"raise"`` or ``"saturate"``: what to do with a tile no record can hold
            (magnitudes past about 1e9, :mod:`kvarn_math.ranges`); ``"saturate"`` stores what
            the kernels store.

    Returns:
        ``[..., tile_bytes]`` uint8 records laid out as :mod:`kvarn_math.layout` says.

    Raises:
        ValueError: on shapes that do not match the preset, a NaN/Inf anywhere, or (with
            ``overflow="raise"``) a tile too large for a record.
    """
    p = get_preset(preset)
    k, v, lay = _check_tiles(k_rot, v_rot, p, overflow)
    lead = k.shape[:-2]
    raw = _raw_mask(raw_keys, lead)
    out = np.zeros((*lead, lay.tile_bytes), dtype=np.uint8)
    # keys as [..., D, G] (rows are channels), values as [..., G, D] (rows are tokens)
    k_codes, k_scale, k_zero, k_col = _encode_rows(
        np.swapaxes(k, -1, -2), p.key_bits, iterations, clip_ratios, "k", overflow
    )
    v_codes, v_scale, v_zero, v_col = _encode_rows(
        v, p.value_bits, iterations, clip_ratios, "v", overflow
    )

    values: dict[str, npt.NDArray[np.generic]] = {
        "k_codes": pack(k_codes, p.key_bits),
        "k_scale": k_scale,
        "k_zero": k_zero,
        "k_token_scale": k_col,
        "v_codes": pack(v_codes, p.value_bits),
        "v_channel_scale": v_col,
        "v_scale": v_scale,
        "v_zero": v_zero,
        "flags": np.concatenate(
            [
                np.where(raw, KEYS_UNROTATED, 0).astype(np.uint8)[..., None],
                np.zeros((*lead, lay.field("flags").nbytes - 1), dtype=np.uint8),
            ],
            axis=-1,
        ),
    }
    for f in lay.fields:
        out[..., f.offset : f.end] = (
            np.ascontiguousarray(values[f.name]).view(np.uint8).reshape(*lead, f.nbytes)
        )
    return out


@dataclass(frozen=True)
class TileFields:
    """The fields of records, decoded to arrays (leading axes ``[...]`` of the records).

    Attributes:
        k_codes: ``[..., D, G]`` uint8.
        k_scale, k_zero: ``[..., D]`` float16.
        k_token_scale: ``[..., G]`` float32, decoded from the record's log8 byte.
        v_codes: ``[..., G, D]`` uint8.
        v_channel_scale: ``[..., D]`` float32, decoded from the record's log8 byte.
        v_scale, v_zero: ``[..., G]`` float16.
        raw_keys: ``[...]`` bool, the ``KEYS_UNROTATED`` flag: keys in their own channels.
    """

    k_codes: npt.NDArray[np.uint8]
    k_scale: npt.NDArray[np.float16]
    k_zero: npt.NDArray[np.float16]
    k_token_scale: npt.NDArray[np.float32]
    v_codes: npt.NDArray[np.uint8]
    v_channel_scale: npt.NDArray[np.float32]
    v_scale: npt.NDArray[np.float16]
    v_zero: npt.NDArray[np.float16]
    raw_keys: npt.NDArray[np.bool_]


def read_fields(records: npt.ArrayLike, preset: str | Preset, head_dim: int) -> TileFields:
    """Split records ``[..., tile_bytes]`` into their fields (codes unpacked)."""
    p = get_preset(preset)
    lay = tile_layout(p, head_dim)
    rec = np.asarray(records)
    if rec.dtype != np.uint8 or rec.ndim < 1 or rec.shape[-1] != lay.tile_bytes:
        raise ValueError(
            f"records must be uint8 [..., {lay.tile_bytes}] for {p.name} at head_dim {head_dim}, "
            f"got {rec.dtype} {rec.shape}"
        )
    lead = rec.shape[:-1]
    g, d = p.group_size, head_dim

    def raw(name: str) -> npt.NDArray[np.uint8]:
        f = lay.field(name)
        return np.ascontiguousarray(rec[..., f.offset : f.end])

    def half(name: str) -> npt.NDArray[np.float16]:
        f = lay.field(name)
        return raw(name).view(np.float16).reshape(*lead, *f.shape)

    def factor(name: str) -> npt.NDArray[np.float32]:
        f = lay.field(name)
        return decode_log8(raw(name).reshape(*lead, *f.shape))

    return TileFields(
        k_codes=unpack(raw("k_codes").reshape(*lead, *lay.field("k_codes").shape), p.key_bits, g),
        k_scale=half("k_scale"),
        k_zero=half("k_zero"),
        k_token_scale=factor("k_token_scale"),
        v_codes=unpack(raw("v_codes").reshape(*lead, *lay.field("v_codes").shape), p.value_bits, d),
        v_channel_scale=factor("v_channel_scale"),
        v_scale=half("v_scale"),
        v_zero=half("v_zero"),
        raw_keys=(raw("flags")[..., 0] & KEYS_UNROTATED) != 0,
    )


def _decode_stored(
    records: npt.ArrayLike, preset: str | Preset, head_dim: int
) -> tuple[F32, F32, npt.NDArray[np.bool_]]:
    """``(k, v_rot, raw_keys)``: keys in the frame the record holds them in; records that fail
    :func:`kvarn_math.ranges.check_records` raise ``ValueError`` naming the record and field."""
    check_records(records, preset, head_dim)
    f = read_fields(records, preset, head_dim)
    f32 = np.float32
    k_dg = (
        f.k_codes.astype(f32) * f.k_scale.astype(f32)[..., :, None]
        + f.k_zero.astype(f32)[..., :, None]
    ) * f.k_token_scale.astype(f32)[..., None, :]
    v = (
        f.v_codes.astype(f32) * f.v_scale.astype(f32)[..., :, None]
        + f.v_zero.astype(f32)[..., :, None]
    ) * f.v_channel_scale.astype(f32)[..., None, :]
    return np.swapaxes(k_dg, -1, -2).astype(f32), v.astype(f32), f.raw_keys


def decode_tiles(records: npt.ArrayLike, preset: str | Preset, head_dim: int) -> tuple[F32, F32]:
    """Decode records to K and V in the rotated frame.

    Args:
        records: ``[..., tile_bytes]`` uint8.
        preset: the preset the records were written with.
        head_dim: ``D``.

    Returns:
        ``(k_rot, v_rot)``, each ``[..., G, D]`` float32::

            K[t, d] = (k_code[d, t] * k_scale[d] + k_zero[d]) * log8(k_token_scale[t])
            V[t, d] = (v_code[t, d] * v_scale[t] + v_zero[t]) * log8(v_channel_scale[d])

        Keys of a record flagged ``KEYS_UNROTATED`` are decoded in their own channels and then
        rotated, so every tile comes back in the one frame.

    Raises:
        ValueError: naming the record and field, for records that cannot be this format's
            (:func:`kvarn_math.ranges.check_records`: non-finite or negative scales, reserved
            flag bits set).
    """
    k, v, raw = _decode_stored(records, preset, head_dim)
    if raw.any():
        k = np.where(raw[..., None, None], rotate(k, axis=-1), k).astype(np.float32)
    return k, v


def quantize_tiles(
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    preset: str | Preset,
    iterations: int = DEFAULT_ITERATIONS,
    clip_ratios: tuple[float, ...] = (),
    raw_keys: npt.ArrayLike = False,
    overflow: str = "raise",
) -> npt.NDArray[np.uint8]:
    """Rotate (Hadamard over channels) and encode tiles in the original frame.

    Args:
        k: ``[..., G, D]`` original-frame keys (after RoPE).
        v: ``[..., G, D]`` original-frame values.
        preset: preset name or :class:`Preset`.
        iterations: variance-normalization sweeps.
        clip_ratios: experimental, see :func:`encode_tiles`.
        raw_keys: bool, scalar or ``[...]``: tiles whose keys are stored in their own channels
            (not rotated; e.g. :func:`choose_key_frames`'s choice). Values are always rotated.
        overflow: ``"raise"`` or ``"saturate"``, see :func:`encode_tiles`.

    Returns:
        ``[..., tile_bytes]`` uint8 records.
    """
    p = get_preset(preset)
    k_arr, v_arr, _ = _check_tiles(k, v, p, overflow)
    raw = _raw_mask(raw_keys, k_arr.shape[:-2])
    k_stored = rotate(k_arr, axis=-1)
    if raw.any():
        k_stored = np.where(raw[..., None, None], k_arr, k_stored)
    return encode_tiles(k_stored, rotate(v_arr, axis=-1), p, iterations, clip_ratios, raw, overflow)


def dequantize_tiles(
    records: npt.ArrayLike, preset: str | Preset, head_dim: int
) -> tuple[F32, F32]:
    """Decode records and un-rotate: ``(k, v)`` ``[..., G, D]`` float32 in the original frame
    (keys flagged ``KEYS_UNROTATED`` are already in it)."""
    k, v_rot, raw = _decode_stored(records, preset, head_dim)
    k_orig = unrotate(k, axis=-1)
    if raw.any():
        k_orig = np.where(raw[..., None, None], k, k_orig)
    return k_orig.astype(np.float32), unrotate(v_rot, axis=-1).astype(np.float32)


def _check_frame_inputs(k_arr: F32, q_arr: F32) -> None:
    check_finite(k_arr, "k")
    check_finite(q_arr, "q")
    if k_arr.ndim < 2 or q_arr.ndim != k_arr.ndim or q_arr.shape[:-2] != k_arr.shape[:-2]:
        raise ValueError(
            f"k must be [..., G, D] and q [..., M, D] with the same leading dims, got "
            f"{k_arr.shape} and {q_arr.shape}"
        )
    d = k_arr.shape[-1]
    if q_arr.shape[-1] != d or q_arr.shape[-2] < 1:
        raise ValueError(f"q must be [..., M >= 1, D={d}], got {q_arr.shape}")


def key_frame_errors(
    k: npt.ArrayLike,
    q: npt.ArrayLike,
    preset: str | Preset,
    iterations: int = DEFAULT_ITERATIONS,
) -> tuple[F32, F32]:
    """Attention-score error of tiles' keys stored Hadamard-rotated and stored in their own
    channels (what :func:`choose_key_frames` estimates).

    The error of a reconstruction ``k_hat`` is ``sum_{i,j} (q_i . (k_hat_j - k_j))^2`` over the
    queries ``q_i`` that read the tile and its keys ``k_j``: what attention's logits lose. Keys
    whose channels carry outliers can lose less unrotated (per-channel quantization over tokens
    isolates them) while others need the rotation; the key reconstruction error alone does not
    tell which, the queries do (``docs/benchmarks.md``, "The key frame chosen per head").

    Args:
        k: ``[..., G, D]`` original-frame keys of tiles (after RoPE).
        q: ``[..., M, D]`` original-frame queries reading each tile (e.g. the queries of the
            tile's own positions in the KV head's query group), ``M >= 1``.
        preset: preset name or :class:`Preset` (its key bits and ``G``).
        iterations: variance-normalization sweeps.

    Returns:
        ``(rotated, raw)``: ``[...]`` float32 errors with the preset's rotation and without it.

    Raises:
        ValueError: shapes that disagree, or non-finite input.
    """
    k_arr = np.asarray(k, dtype=np.float32)
    q_arr = np.asarray(q, dtype=np.float32)
    _check_frame_inputs(k_arr, q_arr)
    d = k_arr.shape[-1]
    # values do not touch the keys' quantization: encode the keys in both slots
    rotated = dequantize_tiles(quantize_tiles(k_arr, k_arr, preset, iterations), preset, d)[0]
    raw = dequantize_tiles(
        quantize_tiles(k_arr, k_arr, preset, iterations, raw_keys=True), preset, d
    )[0]

    def score_error(k_hat: F32) -> F32:
        logits = q_arr @ np.swapaxes(k_hat - k_arr, -1, -2)  # [..., M, G]
        total: F32 = np.asarray(
            (logits.astype(np.float64) ** 2).sum(axis=(-1, -2)), dtype=np.float32
        )
        return total

    return score_error(rotated), score_error(raw)


def key_frame_estimates(k: npt.ArrayLike, q: npt.ArrayLike) -> tuple[F32, F32]:
    """What :func:`key_frame_errors` measures, estimated without quantizing: the keys are
    quantized per channel over the tile's tokens, so channel ``d``'s rounding error grows with
    its range ``r_d = max_t k[t, d] - min_t k[t, d]``, and a query ``q`` sees it weighted by
    ``q_d^2``. The estimate of each frame is ``sum_d (sum_i q_i[d]^2) r_d^2``, with ``k`` and the
    queries rotated for the rotated frame (the common factor ``G / (12 (2^bits - 1)^2)`` of
    uniform rounding noise is left out: it does not change which frame is smaller). A store
    computes it from what it holds anyway: the tile and the step's queries.

    Args:
        k: ``[..., G, D]`` original-frame keys of tiles.
        q: ``[..., M, D]`` original-frame queries reading each tile, ``M >= 1``.

    Returns:
        ``(rotated, raw)``: ``[...]`` float32 estimates.
    """
    k_arr = np.asarray(k, dtype=np.float32)
    q_arr = np.asarray(q, dtype=np.float32)
    _check_frame_inputs(k_arr, q_arr)

    def estimate(keys: F32, queries: F32) -> F32:
        spread = keys.max(axis=-2) - keys.min(axis=-2)  # [..., D]
        energy = (queries.astype(np.float64) ** 2).sum(axis=-2)  # [..., D]
        out: F32 = np.asarray((energy * spread.astype(np.float64) ** 2).sum(axis=-1), np.float32)
        return out

    rotated = estimate(rotate(k_arr, axis=-1), rotate(q_arr, axis=-1))
    return rotated, estimate(k_arr, q_arr)


FRAME_QUERY_ROWS = 1
"""A store judges a tile's key frame by the queries of this many of its fresh positions
(:func:`frame_query_rows`): one, the last. A tile is stored in the step that commits its last
token, so without speculative decoding that step holds the token at the tile's last position
whatever the chunking or batching, and the record then depends on the tile's own tokens only.
Until 2026-12-04 a prefill chunk's tile was judged by 16 of its fresh positions spread evenly
(before 2026-12-03, by all of them), while a decode step had only its one: the same tokens
could then be stored in different frames by a chunk and by decode steps. On CPU the last
position alone gave the accuracy of the 16 (docs/results/cpu-2026-12-04/)."""


def frame_query_rows(num_rows: int) -> npt.NDArray[np.int64]:
    """Which of a tile's ``num_rows`` fresh positions (``0 .. num_rows - 1``, in order) a store
    takes the queries of to choose the tile's key frame (:func:`choose_key_frames`): the last,
    ``[num_rows - 1]`` (:data:`FRAME_QUERY_ROWS`). When none of the tile's positions is fresh
    (under speculative decoding, a tile whose last token was an accepted draft of an earlier
    step), a store keeps that position's query from the step that wrote it
    (kvarn-kernels' ``store_kv(frame_queries=)``), so the tile is judged by the same query.

    Raises:
        ValueError: ``num_rows`` is not an int >= 1.
    """
    if isinstance(num_rows, bool) or not isinstance(num_rows, (int, np.integer)) or num_rows < 1:
        raise ValueError(f"num_rows must be an int >= 1, got {num_rows!r}")
    return np.array([int(num_rows) - 1], dtype=np.int64)


def choose_key_frames(k: npt.ArrayLike, q: npt.ArrayLike) -> npt.NDArray[np.bool_]:
    """Which tiles store their keys in their own channels: those whose estimated
    attention-score error (:func:`key_frame_estimates`) is smaller unrotated than rotated. No
    calibration: the queries are those at hand when the tile is stored (a serving engine's
    store takes the query at the tile's last position, :func:`frame_query_rows`, kept from the
    step that wrote it when that step was an earlier one).
    :func:`key_frame_errors` is the exact error it estimates.

    Args:
        k: ``[..., G, D]`` original-frame keys of tiles.
        q: ``[..., M, D]`` original-frame queries, ``M >= 1``.

    Returns:
        ``[...]`` bool: the ``raw_keys`` to pass to :func:`quantize_tiles`.
    """
    rotated, raw = key_frame_estimates(k, q)
    out: npt.NDArray[np.bool_] = np.asarray(raw < rotated)
    return out
