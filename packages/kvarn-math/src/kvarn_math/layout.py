"""The cache format: presets and the byte layout of a tile record.

This module is the single source of truth for the KVarN cache format; kernels and the
vLLM plugin read offsets and sizes from here and never restate them.

A *tile* is ``G`` consecutive tokens of one KV head with ``D`` channels.  Its *record* is
one contiguous run of ``tile_bytes`` bytes holding, in this order::

    field            dtype    shape                 bytes
    k_codes          uint8    [D, G * kb / 8]       D * G * kb / 8   K tile [D, G], packed per channel
    k_scale          float16  [D]                   2 * D            per-channel RTN step x row scale
    k_zero           float16  [D]                   2 * D            per-channel RTN min  x row scale
    k_token_scale    uint8    [G]                   G                per-token normalization factor, log8
    v_codes          uint8    [G, D * vb / 8]       G * D * vb / 8   V tile [G, D], packed per token
    v_channel_scale  uint8    [D]                   D                per-channel normalization factor, log8
    v_scale          float16  [G]                   2 * G            per-token RTN step x row scale
    v_zero           float16  [G]                   2 * G            per-token RTN min  x row scale
    flags            uint8    [16]                  16               byte 0 bit 0: KEYS_UNROTATED;
                                                                     the rest zero (reserved)

Reconstruction in the frame the record holds (one multiply more than plain RTN)::

    K[t, d] = (k_code[d, t] * k_scale[d] + k_zero[d]) * log8(k_token_scale[t])
    V[t, d] = (v_code[t, d] * v_scale[t] + v_zero[t]) * log8(v_channel_scale[d])

V is always in the rotated frame (Hadamard over channels). K is too, unless the record's
``KEYS_UNROTATED`` flag is set: then its keys were quantized in their own channels, the frame
the store chose for that tile because it loses less of the attention scores
(:func:`kvarn_math.tile.choose_key_frames`). Readers score such a tile with the un-rotated query.

``log8(n) = 2^(n/16 - 1)`` (:mod:`kvarn_math.log8`): the balancing factors take one byte each,
rounded before the rows are quantized, so the codes absorb the rounding.

Every field starts on a 16-byte boundary and nothing is padded: the record is exactly the
sum of its fields (the published fork rounds per-token slots up to a power of two).
A paged cache block holds one record per KV head: ``[num_kv_heads, tile_bytes]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import TypeVar, cast

from kvarn_math.packing import packed_size
from kvarn_math.rtn import check_bits

__all__ = [
    "FORMAT_VERSION",
    "KEYS_UNROTATED",
    "FLAGS_BYTES",
    "SUPPORTED_HEAD_DIMS",
    "SUPPORTED_GROUP_SIZES",
    "FIELD_ALIGNMENT",
    "DEFAULT_PRESET",
    "Preset",
    "PRESETS",
    "Field",
    "TileLayout",
    "get_preset",
    "lookup_preset",
    "tile_layout",
    "format_table",
]

P = TypeVar("P")

FORMAT_VERSION = 3
"""Version of the record byte format; records of one version cannot be read as another.

1: balancing factors as float16. 2 (2026-11-30): balancing factors as one-byte log8 codes.
3 (2026-12-01): a 16-byte ``flags`` field at the end; ``KEYS_UNROTATED`` marks a tile whose keys
are stored in their own channels.
A KV cache lives only as long as its engine, but anything that persists or ships records
(offloading, a custom engine's cache files) should store this number beside them.
"""
KEYS_UNROTATED = 1
"""Bit of the record's first ``flags`` byte: the tile's keys are stored in their own channels
(not Hadamard-rotated)."""
FLAGS_BYTES = 16
SUPPORTED_HEAD_DIMS = (64, 128, 256, 512)
SUPPORTED_GROUP_SIZES = (64, 128)
FIELD_ALIGNMENT = 16
_FP16_BYTES = 2


@dataclass(frozen=True)
class Preset:
    """A cache format preset: key bits, value bits and tile size.

    Attributes:
        name: ``kvarn_k{key_bits}v{value_bits}_g{group_size}``.
        key_bits: bits per key code (per-channel quantization over the tile's tokens).
        value_bits: bits per value code (per-token quantization over channels).
        group_size: tokens per tile ``G``.
    """

    name: str
    key_bits: int
    value_bits: int
    group_size: int

    def __post_init__(self) -> None:
        check_bits(self.key_bits, "key_bits")
        check_bits(self.value_bits, "value_bits")
        if self.group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(
                f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {self.group_size}"
            )
        expected = f"kvarn_k{self.key_bits}v{self.value_bits}_g{self.group_size}"
        if self.name != expected:
            raise ValueError(
                f"preset name must be {expected!r} for its settings, got {self.name!r}"
            )

    @classmethod
    def from_bits(cls, key_bits: int, value_bits: int, group_size: int) -> Preset:
        """Build a (possibly unregistered) preset from its settings."""
        return cls(
            f"kvarn_k{key_bits}v{value_bits}_g{group_size}", key_bits, value_bits, group_size
        )


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset.from_bits(4, 2, 128),
        Preset.from_bits(4, 4, 128),
        Preset.from_bits(4, 2, 64),
        Preset.from_bits(4, 4, 64),
        Preset.from_bits(2, 2, 128),
        Preset.from_bits(3, 2, 128),
    )
}
DEFAULT_PRESET = "kvarn_k4v2_g128"


def lookup_preset(preset: str | P, presets: Mapping[str, P], cls: type[P], what: str) -> P:
    """``preset`` itself when it is a ``cls``, else ``presets[preset]``: the lookup of
    :func:`get_preset` and ``kvarn_math.mla.get_mla_preset``.

    Raises:
        ValueError: naming the unknown ``what`` and listing the supported ones.
    """
    if isinstance(preset, cls):
        return preset
    try:
        return presets[cast(str, preset)]
    except (KeyError, TypeError):
        raise ValueError(f"unknown {what} {preset!r}; supported: {', '.join(presets)}") from None


def get_preset(preset: str | Preset) -> Preset:
    """Look up a preset by name (a :class:`Preset` passes through).

    Raises:
        ValueError: naming the unknown preset and listing the supported ones.
    """
    return lookup_preset(preset, PRESETS, Preset, "KVarN preset")


@dataclass(frozen=True)
class Field:
    """One field of a tile record.

    Attributes:
        name: field name (see the module docstring).
        offset: byte offset from the start of the record.
        nbytes: size in bytes.
        dtype: numpy dtype name of the stored elements (``uint8`` or ``float16``).
        shape: element shape of the field.
    """

    name: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def end(self) -> int:
        """Byte offset one past the field."""
        return self.offset + self.nbytes


@dataclass(frozen=True)
class TileLayout:
    """The byte layout of one tile record for a preset and head dimension.

    Attributes:
        preset: the preset.
        head_dim: channels ``D``.
        fields: the fields in storage order, contiguous and 16-byte aligned.
    """

    preset: Preset
    head_dim: int
    fields: tuple[Field, ...]

    @property
    def group_size(self) -> int:
        """Tokens per tile ``G``."""
        return self.preset.group_size

    @property
    def tile_bytes(self) -> int:
        """Bytes of one record (one tile of one KV head)."""
        return self.fields[-1].end

    @property
    def bytes_per_token_per_head(self) -> float:
        """``tile_bytes / G``."""
        return self.tile_bytes / self.group_size

    @property
    def fp16_bytes_per_token_per_head(self) -> int:
        """Bytes of K plus V in fp16 for one token of one head: ``4 * D``."""
        return 2 * _FP16_BYTES * self.head_dim

    @property
    def ratio_to_fp16(self) -> float:
        """Compression against an fp16/bf16 cache."""
        return self.fp16_bytes_per_token_per_head / self.bytes_per_token_per_head

    @property
    def bits_per_element(self) -> float:
        """Average stored bits per K or V element, scales included."""
        return 8 * self.bytes_per_token_per_head / (2 * self.head_dim)

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

    def page_bytes(self, num_kv_heads: int) -> int:
        """Bytes of one paged-cache block (one tile for every KV head) of one layer."""
        if num_kv_heads < 1:
            raise ValueError(f"num_kv_heads must be >= 1, got {num_kv_heads}")
        return num_kv_heads * self.tile_bytes


@cache
def _layout(preset: Preset, head_dim: int) -> TileLayout:
    d, g = head_dim, preset.group_size
    specs: list[tuple[str, str, tuple[int, ...], int]] = [
        (
            "k_codes",
            "uint8",
            (d, packed_size(g, preset.key_bits)),
            d * packed_size(g, preset.key_bits),
        ),
        ("k_scale", "float16", (d,), _FP16_BYTES * d),
        ("k_zero", "float16", (d,), _FP16_BYTES * d),
        ("k_token_scale", "uint8", (g,), g),
        (
            "v_codes",
            "uint8",
            (g, packed_size(d, preset.value_bits)),
            g * packed_size(d, preset.value_bits),
        ),
        ("v_channel_scale", "uint8", (d,), d),
        ("v_scale", "float16", (g,), _FP16_BYTES * g),
        ("v_zero", "float16", (g,), _FP16_BYTES * g),
        ("flags", "uint8", (FLAGS_BYTES,), FLAGS_BYTES),
    ]
    fields = []
    offset = 0
    for name, dtype, shape, nbytes in specs:
        if offset % FIELD_ALIGNMENT:  # pragma: no cover - guarded by the supported sizes
            raise AssertionError(f"field {name} would start unaligned at byte {offset}")
        fields.append(Field(name, offset, nbytes, dtype, shape))
        offset += nbytes
    return TileLayout(preset=preset, head_dim=head_dim, fields=tuple(fields))


def tile_layout(preset: str | Preset, head_dim: int) -> TileLayout:
    """The :class:`TileLayout` of ``preset`` at ``head_dim``.

    Raises:
        ValueError: for an unknown preset or a head_dim outside ``SUPPORTED_HEAD_DIMS``.
    """
    p = get_preset(preset)
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS} for KVarN, got {head_dim}")
    return _layout(p, head_dim)


def format_table(head_dims: tuple[int, ...] = SUPPORTED_HEAD_DIMS) -> str:
    """A markdown table of every preset's sizes at ``head_dims`` (used by the docs)."""
    rows = [
        "| preset | head_dim | K bits | V bits | G | tile bytes | bytes/token/head | bits/element | vs fp16 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in PRESETS.values():
        for d in head_dims:
            lay = tile_layout(p, d)
            rows.append(
                f"| `{p.name}` | {d} | {p.key_bits} | {p.value_bits} | {p.group_size} | "
                f"{lay.tile_bytes:,} | {lay.bytes_per_token_per_head:g} | "
                f"{lay.bits_per_element:.3f} | {lay.ratio_to_fp16:.2f}x |"
            )
    return "\n".join(rows)


def format_fields(preset: str | Preset, head_dim: int) -> str:
    """A markdown table of one record's fields (used by the docs)."""
    lay = tile_layout(preset, head_dim)
    rows = [
        f"`{lay.preset.name}`, head_dim {head_dim}: {lay.tile_bytes:,} bytes per record",
        "",
        "| field | dtype | shape | offset | bytes |",
        "| --- | --- | --- | ---: | ---: |",
    ]
    for f in lay.fields:
        rows.append(f"| `{f.name}` | {f.dtype} | {list(f.shape)} | {f.offset:,} | {f.nbytes:,} |")
    return "\n".join(rows)
