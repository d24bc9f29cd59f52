"""What a record can hold: fitting large tiles into its fp16 scales, and checking records.

A record reconstructs ``K[t, d] = (q * k_scale[d] + k_zero[d]) * log8(k_token_scale[t])``
(values the same way): the row scales are float16 (at most 65504) and the column factors one
log8 byte each (``2^(n/16 - 1)``, at most ``2^14.94``). The normalization folds a tile's whole
magnitude into the row scales, so a tile whose folded row scales pass fp16's range would not
fit. The encoder then moves a power of two ``2^s`` from every row scale into every column
factor (``n += 16 s``): the product is unchanged and exact, and the records of every tile
that fitted before are unchanged (``s = 0``)::

    M     = max over rows of max(step * r, |lo * r|)             # the folded row scales, fp32
    s     = max(0, floor(log2 M) - 15)                          # fp16 holds M / 2^s < 2^16
    room  = (255 - max(n)) // 16                                # the column codes' headroom
    if s <= room:  row scales / 2^s, n + 16 s                   # stored within the format's error
    else:          overflow: s = room, and each row still past fp16 is scaled down to 65504
                   (its reconstruction shrinks toward zero, keeping its sign pattern)

Tiles up to about ``2^30`` (1e9) in magnitude fit (the exact bound depends on the tile: the
measurements are in docs/reliability.md); past that a record cannot hold them. The reference
raises ``ValueError`` there by default (``overflow="raise"``); ``overflow="saturate"`` stores
the saturated record, bit for bit what the kernels store (a serving kernel cannot raise; the
store counts such tiles). Inputs past ``INPUT_BOUND`` (``2^100``) are clipped to it before
anything else in saturate mode (the rotation's fp32 sums would overflow near fp32's maximum),
and rejected in raise mode; NaN and infinities are always rejected by the reference.

To keep the fp32 arithmetic of the normalization finite for any bf16 value (a tile's sum of
squares overflows float32 from about 2^56), a tile whose largest magnitude reaches ``2^49`` is
first multiplied by ``2^-p`` (exact; ``p = floor(log2 max|x|) - 48``) and ``p`` is added to
``s``'s budget: the encoding is exactly scale-equivariant under powers of two, so this changes
nothing but the exponent.

:func:`check_records` is the cheap plausibility check of records that the decoders run: the
fp16 scales and zero points finite, the scales not negative, the reserved flag bits zero.
Random bytes fail it with near certainty, and it names the record and the field.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvarn_math.layout import FORMAT_VERSION, KEYS_UNROTATED, Preset, get_preset, tile_layout

__all__ = [
    "OVERFLOW_MODES",
    "INPUT_BOUND",
    "PRESCALE_FROM",
    "SHIFT_FROM",
    "float_exponent",
    "pow2",
    "prescale_exponent",
    "fit_row_scales",
    "check_input_bound",
    "check_records",
]

OVERFLOW_MODES = ("raise", "saturate")
"""What an encoder does with a tile no record can hold: raise ``ValueError`` (the reference's
default) or store it saturated (what the kernels always do)."""
INPUT_BOUND = 2.0**100
"""Inputs are clipped to ``+-INPUT_BOUND`` in saturate mode (rejected in raise mode): far past
anything a record holds, and small enough that a Hadamard rotation of up to 512 channels
stays finite in float32."""
PRESCALE_FROM = 48
"""Tiles with ``max|x| >= 2^(PRESCALE_FROM + 1)`` are encoded from ``x * 2^-p``,
``p = floor(log2 max|x|) - PRESCALE_FROM``."""
SHIFT_FROM = 15
"""Folded row scales below ``2^(SHIFT_FROM + 1)`` are stored as they are."""
F32 = npt.NDArray[np.float32]
_FP16_MAX = float(np.finfo(np.float16).max)
_MAX_CODE = 255
_STEPS_PER_OCTAVE = 16


def float_exponent(x: npt.ArrayLike) -> npt.NDArray[np.int32]:
    """``floor(log2 |x|)`` of float32 values read from their exponent field: exact for
    normal numbers, -127 for zeros and subnormals (what the kernels' bit test gives)."""
    arr = np.asarray(x, dtype=np.float32)
    bits = np.ascontiguousarray(arr).view(np.int32).reshape(arr.shape)
    out: npt.NDArray[np.int32] = ((bits >> 23) & 0xFF) - 127
    return out


def pow2(e: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """``2^e`` as float32 for integers ``e`` in ``[-126, 127]``, built from the exponent bits."""
    arr = np.asarray(e, dtype=np.int32)
    if arr.size and (arr.min() < -126 or arr.max() > 127):
        raise ValueError(f"pow2 takes exponents in [-126, 127], got {arr.min()}..{arr.max()}")
    bits = np.ascontiguousarray((arr + 127) << 23)
    out: npt.NDArray[np.float32] = bits.view(np.float32).reshape(arr.shape)
    return out


def prescale_exponent(x: npt.NDArray[np.float32]) -> npt.NDArray[np.int32]:
    """``p`` ``[...]`` of tiles ``x`` ``[..., R, C]``: ``max(0, floor(log2 max|x|) - 48)``."""
    amax = np.abs(x).max(axis=(-2, -1)) if x.size else np.zeros(x.shape[:-2], np.float32)
    out: npt.NDArray[np.int32] = np.maximum(0, float_exponent(amax) - PRESCALE_FROM)
    return out


def fit_row_scales(
    step: npt.NDArray[np.float32],
    lo: npt.NDArray[np.float32],
    col_codes: npt.NDArray[np.uint8],
    prescale: npt.NDArray[np.int32],
) -> tuple[
    npt.NDArray[np.float16], npt.NDArray[np.float16], npt.NDArray[np.uint8], npt.NDArray[np.bool_]
]:
    """Fit folded row scales into fp16 by moving powers of two into the column codes.

    Args:
        step: ``[..., R]`` float32 folded RTN steps (``step * row_scale``) of tiles encoded
            from ``x * 2^-prescale``.
        lo: ``[..., R]`` float32 folded minima (``lo * row_scale``), same tiles.
        col_codes: ``[..., C]`` uint8 log8 codes of the column factors.
        prescale: ``[...]`` int32, the tiles' ``p`` (:func:`prescale_exponent`).

    Returns:
        ``(scale fp16 [..., R], zero fp16 [..., R], col_codes uint8 [..., C], overflow bool
        [...])``: the record's fields, and which tiles had to be saturated.
    """
    f32 = np.float32
    mag = np.maximum(step, np.abs(lo)).astype(f32)  # [..., R]
    peak = mag.max(axis=-1) if mag.shape[-1] else np.zeros(mag.shape[:-1], f32)
    need = np.maximum(0, prescale + float_exponent(peak) - SHIFT_FROM)
    top = col_codes.max(axis=-1).astype(np.int32) if col_codes.shape[-1] else need * 0
    room = (_MAX_CODE - top) // _STEPS_PER_OCTAVE
    overflow = need > room
    shift = np.minimum(need, room)
    factor = pow2(prescale - shift)[..., None]  # [..., 1]
    with np.errstate(over="ignore"):
        past = overflow[..., None] & (mag * factor > f32(_FP16_MAX))
    safe = np.where(mag > 0, mag, f32(1.0))
    mult = np.where(past, f32(_FP16_MAX) / safe, factor).astype(f32)
    codes = (col_codes.astype(np.int32) + _STEPS_PER_OCTAVE * shift[..., None]).astype(np.uint8)
    return _fp16(step * mult), _fp16(lo * mult), codes, overflow


def _fp16(x: npt.NDArray[np.floating]) -> npt.NDArray[np.float16]:
    out: npt.NDArray[np.float16] = np.clip(x, -_FP16_MAX, _FP16_MAX).astype(np.float16)
    return out


def check_input_bound(x: npt.NDArray[np.float32], name: str, overflow: str) -> F32:
    """Check ``overflow`` and apply :data:`INPUT_BOUND` to ``x`` ``[..., G, D]``: clipped in
    saturate mode, ``ValueError`` naming the tile, token and channel in raise mode."""
    if overflow not in OVERFLOW_MODES:
        raise ValueError(f"overflow must be one of {OVERFLOW_MODES}, got {overflow!r}")
    big = np.abs(x) > INPUT_BOUND
    if not big.any():
        return x
    if overflow == "saturate":
        out: F32 = np.clip(x, -INPUT_BOUND, INPUT_BOUND).astype(np.float32)
        return out
    *tile, token, channel = (int(i) for i in np.argwhere(big)[0])
    raise ValueError(
        f"{name} tile {tuple(tile)} holds {x[(*tile, token, channel)]:.4g} at token {token}, "
        f"channel {channel}: past what a KVarN record holds (about 1e9); "
        "overflow='saturate' stores it saturated, as the kernels do"
    )


def check_records(records: npt.ArrayLike, preset: str | Preset, head_dim: int) -> None:
    """Raise ``ValueError`` naming the first implausible record and field.

    Checks what is cheap and always true of a record this format version wrote: the float16
    fields (``k_scale``, ``k_zero``, ``v_scale``, ``v_zero``) finite, the scales not negative,
    the flag bits other than ``KEYS_UNROTATED`` zero. Codes and log8 bytes take every value.

    Args:
        records: ``[..., tile_bytes]`` uint8.
        preset: the preset the records claim to be written with.
        head_dim: ``D``.
    """
    p = get_preset(preset)
    lay = tile_layout(p, head_dim)
    rec = np.asarray(records)
    if rec.dtype != np.uint8 or rec.ndim < 1 or rec.shape[-1] != lay.tile_bytes:
        raise ValueError(
            f"records must be uint8 [..., {lay.tile_bytes}] for {p.name} at head_dim {head_dim}, "
            f"got {rec.dtype} {rec.shape}"
        )
    lead = rec.shape[:-1]
    where = f"{p.name} at head_dim {head_dim}, format {FORMAT_VERSION}"
    for name in ("k_scale", "k_zero", "v_scale", "v_zero"):
        f = lay.field(name)
        vals = np.ascontiguousarray(rec[..., f.offset : f.end]).view(np.float16)
        bad = ~np.isfinite(vals)
        if name.endswith("scale"):
            bad |= vals < 0
        if bad.any():
            *tile, i = (int(j) for j in np.argwhere(bad.reshape(*lead, -1))[0])
            raise ValueError(
                f"record {tuple(tile)} is not a valid {where} record: {name}[{i}] holds "
                f"{vals.reshape(*lead, -1)[(*tile, i)]} (expected finite"
                f"{' and >= 0' if name.endswith('scale') else ''}); corrupt or foreign bytes?"
            )
    f = lay.field("flags")
    flags = rec[..., f.offset : f.end].copy()
    flags[..., 0] &= np.uint8(0xFF ^ KEYS_UNROTATED)
    if flags.any():
        *tile, i = (int(j) for j in np.argwhere(flags)[0])
        raise ValueError(
            f"record {tuple(tile)} is not a valid {where} record: flags byte {i} is "
            f"{int(rec[(*tile, f.offset + i)])} where its reserved bits must be zero; "
            "corrupt or foreign bytes?"
        )
