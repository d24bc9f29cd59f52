"""The MLA latent cache format: presets, the byte layout of a latent tile record, and back.

Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash, Kimi) caches per token and layer one
latent ``c_kv`` of ``L = kv_lora_rank`` channels (512 in those models) and one RoPE key ``k_pe``
of ``R`` channels (64), shared by every query head: 1,152 bytes a token in bf16. This module is the
single source of truth for kvarn's quantized form of that cache; the kernels read offsets and
sizes from here.

A *tile* is ``G`` consecutive tokens (``G`` = 128 or 64, the paged block size). Its *record* is
one contiguous run of ``tile_bytes`` bytes (one per block and layer; there is no head axis)::

    field          dtype    shape               bytes            meaning
    latent_codes   uint8    [G, L * b / 8]      G * L * b / 8    latent, packed per token
    latent_scale   float16  [G, L / W]          2 * G * L / W    RTN step of each channel group
    latent_zero    float16  [G, L / W]          2 * G * L / W    RTN minimum of each group
    rope_codes     int8     [G, R]              G * R            RoPE key, symmetric 8-bit
    rope_scale     float16  [G]                 2 * G            its step, per token

Reconstruction (no rotation, no normalization: both measured inert on real latents, see
``docs/mla.md``)::

    c_kv[t, j] = q[t, j] * latent_scale[t, j // W] + latent_zero[t, j // W]
    k_pe[t, r] = rope_codes[t, r] * rope_scale[t]

with ``W`` = 256 channels per group (:attr:`MLAPreset.channel_group`). Every row is quantized
from its own token only, so a record's bytes do not depend on how tokens were chunked, batched or
ordered, and a tile can be written token by token. At ``L = 512``, ``R = 64`` the default
``kvarn_mla_l4_g128`` takes 330 bytes a token (3.49x fewer than bf16), ``kvarn_mla_l2_g128`` 202.

Fields start on 16-byte boundaries; the record is exactly the sum of its fields.

Attention in latent space (absorbed weights, DeepSeek's decode): for head ``h`` the query's
no-RoPE part is absorbed through ``W_UK[h]`` (``q_lat = W_UK[h]^T q_nope``, ``[L]``), so::

    score[h, t] = scale * (q_lat[h] . c_kv[t] + q_pe[h] . k_pe[t])
    o_lat[h]    = sum_t softmax(score[h])[t] * c_kv[t]          (then W_UV[h] o_lat[h])

:func:`mla_reference_attention` computes that over quantized tiles plus an exact open tail.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import numpy.typing as npt

from kvarn_math.layout import FIELD_ALIGNMENT, Field, lookup_preset
from kvarn_math.packing import pack, packed_size, unpack
from kvarn_math.rtn import check_bits, quantize_rows

__all__ = [
    "MLA_FORMAT_VERSION",
    "MLA_GROUP_SIZES",
    "MLA_LATENT_DIMS",
    "MLA_ROPE_DIMS",
    "MLAPreset",
    "MLA_PRESETS",
    "DEFAULT_MLA_PRESET",
    "MLALayout",
    "get_mla_preset",
    "mla_layout",
    "encode_latent_tiles",
    "decode_latent_tiles",
    "roundtrip_latent",
    "mla_reference_attention",
    "mla_expanded_attention",
    "mla_format_table",
]

MLA_FORMAT_VERSION = 1
"""Version of the latent record byte format (independent of the dense ``FORMAT_VERSION``)."""
MLA_GROUP_SIZES = (64, 128)
MLA_LATENT_DIMS = (256, 512)
MLA_ROPE_DIMS = (32, 64, 128)
_FP16_MAX = float(np.finfo(np.float16).max)
F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class MLAPreset:
    """A latent cache preset.

    Attributes:
        name: ``kvarn_mla_l{latent_bits}_g{group_size}``.
        latent_bits: bits per latent code.
        group_size: tokens per tile ``G`` (the paged block size).
        channel_group: latent channels ``W`` sharing one step and zero point within a token.
    """

    name: str
    latent_bits: int
    group_size: int
    channel_group: int = 256

    def __post_init__(self) -> None:
        check_bits(self.latent_bits, "latent_bits")
        if self.latent_bits not in (2, 4, 8):
            raise ValueError(f"latent_bits must be 2, 4 or 8, got {self.latent_bits}")
        if self.group_size not in MLA_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {MLA_GROUP_SIZES}, got {self.group_size}")
        expected = f"kvarn_mla_l{self.latent_bits}_g{self.group_size}"
        if self.name != expected:
            raise ValueError(f"MLA preset name must be {expected!r}, got {self.name!r}")

    @classmethod
    def from_bits(cls, latent_bits: int, group_size: int) -> MLAPreset:
        """Build a (possibly unregistered) preset from its settings."""
        return cls(f"kvarn_mla_l{latent_bits}_g{group_size}", latent_bits, group_size)


MLA_PRESETS: dict[str, MLAPreset] = {
    p.name: p
    for p in (
        MLAPreset.from_bits(4, 128),
        MLAPreset.from_bits(4, 64),
        MLAPreset.from_bits(2, 128),
        MLAPreset.from_bits(8, 128),
    )
}
DEFAULT_MLA_PRESET = "kvarn_mla_l4_g128"


def get_mla_preset(preset: str | MLAPreset) -> MLAPreset:
    """Look up an MLA preset by name (an :class:`MLAPreset` passes through).

    Raises:
        ValueError: naming the unknown preset and listing the supported ones.
    """
    return lookup_preset(preset, MLA_PRESETS, MLAPreset, "KVarN MLA preset")


@dataclass(frozen=True)
class MLALayout:
    """The byte layout of one latent tile record.

    Attributes:
        preset: the preset.
        latent_dim: ``L`` (``kv_lora_rank``).
        rope_dim: ``R`` (``qk_rope_head_dim``).
        fields: the fields in storage order, contiguous and 16-byte aligned.
    """

    preset: MLAPreset
    latent_dim: int
    rope_dim: int
    fields: tuple[Field, ...]

    @property
    def group_size(self) -> int:
        """Tokens per tile ``G``."""
        return self.preset.group_size

    @property
    def groups(self) -> int:
        """Channel groups per token ``L / W``."""
        return self.latent_dim // self.preset.channel_group

    @property
    def tile_bytes(self) -> int:
        """Bytes of one record."""
        return self.fields[-1].end

    @property
    def bytes_per_token(self) -> float:
        """``tile_bytes / G``."""
        return self.tile_bytes / self.group_size

    @property
    def bf16_bytes_per_token(self) -> int:
        """``2 * (L + R)``."""
        return 2 * (self.latent_dim + self.rope_dim)

    @property
    def ratio_to_bf16(self) -> float:
        """Compression against a bf16 latent cache."""
        return self.bf16_bytes_per_token / self.bytes_per_token

    def field(self, name: str) -> Field:
        """The field called ``name``."""
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"no field {name!r}; fields: {[f.name for f in self.fields]}")

    @property
    def offsets(self) -> dict[str, int]:
        """Field name to byte offset."""
        return {f.name: f.offset for f in self.fields}


@cache
def _layout(preset: MLAPreset, latent_dim: int, rope_dim: int) -> MLALayout:
    g, b, w = preset.group_size, preset.latent_bits, preset.channel_group
    row = packed_size(latent_dim, b)
    specs = [
        ("latent_codes", "uint8", (g, row), g * row),
        ("latent_scale", "float16", (g, latent_dim // w), 2 * g * (latent_dim // w)),
        ("latent_zero", "float16", (g, latent_dim // w), 2 * g * (latent_dim // w)),
        ("rope_codes", "int8", (g, rope_dim), g * rope_dim),
        ("rope_scale", "float16", (g,), 2 * g),
    ]
    fields, offset = [], 0
    for name, dtype, shape, nbytes in specs:
        if offset % FIELD_ALIGNMENT:  # pragma: no cover - guarded by the supported sizes
            raise AssertionError(f"field {name} would start unaligned at byte {offset}")
        fields.append(Field(name, offset, nbytes, dtype, shape))
        offset += nbytes
    return MLALayout(preset, latent_dim, rope_dim, tuple(fields))


def mla_layout(preset: str | MLAPreset, latent_dim: int = 512, rope_dim: int = 64) -> MLALayout:
    """The :class:`MLALayout` of ``preset`` at ``latent_dim`` (``L``) and ``rope_dim`` (``R``).

    Raises:
        ValueError: for an unknown preset or sizes outside the supported ones.
    """
    p = get_mla_preset(preset)
    if latent_dim not in MLA_LATENT_DIMS:
        raise ValueError(f"latent_dim must be one of {MLA_LATENT_DIMS}, got {latent_dim}")
    if rope_dim not in MLA_ROPE_DIMS:
        raise ValueError(f"rope_dim must be one of {MLA_ROPE_DIMS}, got {rope_dim}")
    return _layout(p, latent_dim, rope_dim)


def _fp16(x: npt.NDArray[np.floating]) -> npt.NDArray[np.float16]:
    out: npt.NDArray[np.float16] = np.clip(x, -_FP16_MAX, _FP16_MAX).astype(np.float16)
    return out


def _check(latent: npt.ArrayLike, rope: npt.ArrayLike, p: MLAPreset) -> tuple[F32, F32]:
    lat = np.asarray(latent, dtype=np.float32)
    pe = np.asarray(rope, dtype=np.float32)
    if lat.ndim < 2 or pe.shape[:-1] != lat.shape[:-1]:
        raise ValueError(
            f"latent [..., G, L] and rope [..., G, R] must share leading axes, got "
            f"{lat.shape} and {pe.shape}"
        )
    if lat.shape[-2] != p.group_size:
        raise ValueError(f"{p.name} tiles hold {p.group_size} tokens, got shape {lat.shape}")
    for name, arr in (("latent", lat), ("rope", pe)):
        if not np.isfinite(arr).all():
            index = tuple(int(i) for i in np.argwhere(~np.isfinite(arr))[0])
            raise ValueError(f"{name} holds {arr[index]} at {index}; latent tiles must be finite")
    return lat, pe


def _quantize_rope(pe: F32) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float16]]:
    """Symmetric 8-bit per token: ``step = fp16(max|x| / 127)``, ``q = clip(rint(x / step))``."""
    step = _fp16(np.abs(pe).max(axis=-1) / np.float32(127))
    safe = np.where(step > 0, step.astype(np.float32), np.float32(1))
    codes = np.clip(np.rint(pe / safe[..., None]), -127, 127).astype(np.int8)
    return codes, step


def encode_latent_tiles(
    latent: npt.ArrayLike, rope: npt.ArrayLike, preset: str | MLAPreset
) -> npt.NDArray[np.uint8]:
    """Encode tiles into records.

    Args:
        latent: ``[..., G, L]`` latent ``c_kv`` (any float dtype; computed in float32).
        rope: ``[..., G, R]`` RoPE key ``k_pe`` (after RoPE, as the model caches it).
        preset: an MLA preset name or :class:`MLAPreset`.

    Returns:
        ``[..., tile_bytes]`` uint8 records laid out as :func:`mla_layout` says.

    Raises:
        ValueError: on shapes that do not match the preset, or a NaN/Inf anywhere.
    """
    p = get_mla_preset(preset)
    lat, pe = _check(latent, rope, p)
    lead, g, width = lat.shape[:-2], lat.shape[-2], lat.shape[-1]
    lay = mla_layout(p, width, pe.shape[-1])
    rows = lat.reshape(*lead, g, lay.groups, p.channel_group)
    # the step and minimum are rounded to fp16 first, so the codes absorb the rounding
    q = quantize_rows(rows, p.latent_bits)
    step = _fp16(q.step).astype(np.float32)
    lo = _fp16(q.lo).astype(np.float32)
    safe = np.where(step > 0, step, np.float32(1))[..., None]
    levels = 2**p.latent_bits - 1
    codes = np.clip(np.rint((rows - lo[..., None]) / safe), 0, levels)
    codes = np.where(step[..., None] > 0, codes, 0).astype(np.uint8).reshape(*lead, g, width)
    rope_codes, rope_step = _quantize_rope(pe)
    values = {
        "latent_codes": pack(codes, p.latent_bits),
        "latent_scale": step.astype(np.float16),
        "latent_zero": lo.astype(np.float16),
        "rope_codes": rope_codes,
        "rope_scale": rope_step,
    }
    out = np.zeros((*lead, lay.tile_bytes), dtype=np.uint8)
    for f in lay.fields:
        out[..., f.offset : f.end] = (
            np.ascontiguousarray(values[f.name]).view(np.uint8).reshape(*lead, f.nbytes)
        )
    return out


def _field(records: npt.NDArray[np.uint8], f: Field) -> npt.NDArray[np.generic]:
    lead = records.shape[:-1]
    raw = np.ascontiguousarray(records[..., f.offset : f.end])
    return raw.view(np.dtype(f.dtype)).reshape(*lead, *f.shape)


def decode_latent_tiles(
    records: npt.ArrayLike, preset: str | MLAPreset, latent_dim: int = 512, rope_dim: int = 64
) -> tuple[F32, F32]:
    """Records ``[..., tile_bytes]`` back to ``(latent [..., G, L], rope [..., G, R])`` float32."""
    p = get_mla_preset(preset)
    lay = mla_layout(p, latent_dim, rope_dim)
    rec = np.asarray(records, dtype=np.uint8)
    if rec.shape[-1:] != (lay.tile_bytes,):
        raise ValueError(
            f"{p.name} records at L={latent_dim}, R={rope_dim} are {lay.tile_bytes} bytes, "
            f"got last axis {rec.shape[-1:]}"
        )
    lead, g = rec.shape[:-1], p.group_size
    codes = unpack(_field(rec, lay.field("latent_codes")), p.latent_bits, latent_dim)
    codes = codes.reshape(*lead, g, lay.groups, p.channel_group).astype(np.float32)
    step = _field(rec, lay.field("latent_scale")).astype(np.float32)
    lo = _field(rec, lay.field("latent_zero")).astype(np.float32)
    lat = (codes * step[..., None] + lo[..., None]).reshape(*lead, g, latent_dim)
    pe_codes = _field(rec, lay.field("rope_codes")).astype(np.float32)
    pe_step = _field(rec, lay.field("rope_scale")).astype(np.float32)
    return lat.astype(np.float32), (pe_codes * pe_step[..., None]).astype(np.float32)


def roundtrip_latent(
    latent: npt.ArrayLike, rope: npt.ArrayLike, preset: str | MLAPreset
) -> tuple[F32, F32]:
    """``decode(encode(...))`` of ``[T, L]`` / ``[T, R]`` (``T`` a multiple of ``G``)."""
    p = get_mla_preset(preset)
    lat = np.asarray(latent, dtype=np.float32)
    pe = np.asarray(rope, dtype=np.float32)
    t, g = lat.shape[0], p.group_size
    if t % g:
        raise ValueError(f"tokens must be a multiple of {g}, got {t}")
    rec = encode_latent_tiles(lat.reshape(t // g, g, -1), pe.reshape(t // g, g, -1), p)
    back_lat, back_pe = decode_latent_tiles(rec, p, lat.shape[-1], pe.shape[-1])
    return back_lat.reshape(t, -1), back_pe.reshape(t, -1)


def mla_reference_attention(
    q_latent: npt.ArrayLike,
    q_rope: npt.ArrayLike,
    records: npt.ArrayLike,
    tail_latent: npt.ArrayLike,
    tail_rope: npt.ArrayLike,
    preset: str | MLAPreset,
    scale: float,
) -> F32:
    """Absorbed-weight MLA decode for one sequence, in float64 (the kernels' reference).

    Args:
        q_latent: ``[H, L]`` query no-RoPE part absorbed into latent space.
        q_rope: ``[H, R]`` query RoPE part (after RoPE).
        records: ``[n, tile_bytes]`` the sequence's quantized tiles, in order.
        tail_latent: ``[m, L]`` the exact open tail (the staged tokens after the tiles).
        tail_rope: ``[m, R]``.
        preset: the MLA preset.
        scale: softmax scale (``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)`` in DeepSeek).

    Returns:
        ``[H, L]`` float32 attention output in latent space (before ``W_UV``).
    """
    ql = np.asarray(q_latent, dtype=np.float64)
    qr = np.asarray(q_rope, dtype=np.float64)
    width, rdim = ql.shape[-1], qr.shape[-1]
    rec = np.asarray(records, dtype=np.uint8)
    lat, pe = decode_latent_tiles(rec, preset, width, rdim)
    keys_lat = np.concatenate([lat.reshape(-1, width), np.asarray(tail_latent).reshape(-1, width)])
    keys_pe = np.concatenate([pe.reshape(-1, rdim), np.asarray(tail_rope).reshape(-1, rdim)])
    if keys_lat.shape[0] == 0:
        raise ValueError("attention needs at least one key (tiles or tail)")
    return _attend(ql, qr, keys_lat.astype(np.float64), keys_pe.astype(np.float64), scale)


def _attend(ql: np.ndarray, qr: np.ndarray, lat: np.ndarray, pe: np.ndarray, scale: float) -> F32:
    scores = scale * (ql @ lat.T + qr @ pe.T)  # [H, T]
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    out: F32 = (p @ lat).astype(np.float32)
    return out


def mla_expanded_attention(
    q_nope: npt.ArrayLike,
    q_rope: npt.ArrayLike,
    latent: npt.ArrayLike,
    rope: npt.ArrayLike,
    w_uk: npt.ArrayLike,
    w_uv: npt.ArrayLike,
    scale: float,
) -> F32:
    """Un-absorbed MLA (keys and values up-projected per head), float64, for checking the
    absorbed form: ``q_nope [H, Dn]``, ``q_rope [H, R]``, ``latent [T, L]``, ``rope [T, R]``,
    ``w_uk [H, Dn, L]``, ``w_uv [H, Dv, L]``; returns ``[H, Dv]``."""
    qn = np.asarray(q_nope, dtype=np.float64)
    lat = np.asarray(latent, dtype=np.float64)
    k_nope = np.einsum("hdl,tl->htd", np.asarray(w_uk, dtype=np.float64), lat)
    v = np.einsum("hdl,tl->htd", np.asarray(w_uv, dtype=np.float64), lat)
    scores = scale * (
        np.einsum("hd,htd->ht", qn, k_nope)
        + np.asarray(q_rope, dtype=np.float64) @ np.asarray(rope, dtype=np.float64).T
    )
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    out: F32 = np.einsum("ht,htd->hd", p, v).astype(np.float32)
    return out


def mla_format_table(latent_dim: int = 512, rope_dim: int = 64) -> str:
    """A markdown table of every MLA preset's sizes (used by the docs)."""
    rows = [
        "| preset | latent bits | G | tile bytes | bytes/token | vs bf16 |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in MLA_PRESETS.values():
        lay = mla_layout(p, latent_dim, rope_dim)
        rows.append(
            f"| `{p.name}` | {p.latent_bits} | {p.group_size} | {lay.tile_bytes:,} | "
            f"{lay.bytes_per_token:g} | {lay.ratio_to_bf16:.2f}x |"
        )
    return "\n".join(rows)
