"""Candidate latent-cache recipes for MLA, compared by measurement (not a storage format).

The stored format is :mod:`kvarn_math.mla`; this module simulates the candidates the format was
chosen from, on ``[T, L]`` latents and ``[T, R]`` RoPE keys (float32), tile by tile:

* ``rotate``: Hadamard over the latent channels before quantizing (undone after).
* ``varnorm``: KVarN's variance normalization of each ``[G, L]`` tile (row and column factors,
  the column factors kept as one log8 byte per channel per tile).
* ``axis``: ``"token"``: groups of ``group`` channels of one token share one step and zero
  (``groups``, when set, fixes the number of groups a token instead, so a narrower latent keeps
  the parameter budget of the real shape);
  ``"channel"``: each channel of a tile shares one step and zero over the tile's ``G`` tokens
  (KIVI's key axis).
* ``scales``: ``"fp16"`` step and zero; ``"log8"``: step rounded *up* to a 2^(1/16) grid (a one-byte log code)
  and the zero point an integer number of steps (one signed byte), 2 bytes a group.
* ``rope``: ``"bf16"``, ``"fp8"`` (e4m3, scale 1, as vLLM's fp8 cache) or ``"int8"``
  (symmetric 8-bit per token, one fp16 step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvarn_math.baselines import fp8_e4m3_round
from kvarn_math.hadamard import rotate, unrotate
from kvarn_math.log8 import decode_log8, encode_log8
from kvarn_math.mla import get_mla_preset, mla_layout, roundtrip_latent
from kvarn_math.rtn import check_bits, dequantize_rows, quantize_rows
from kvarn_math.varnorm import variance_normalize

__all__ = [
    "ROPE_MODES",
    "Bf16Latent",
    "Fp8DsMla",
    "LatentRecipe",
    "MLAFormat",
    "bf16_round",
    "fp16_round",
    "rope_bytes",
    "rope_roundtrip",
]

F32 = npt.NDArray[np.float32]
ROPE_MODES = ("bf16", "fp8", "int8")
_SCALES = ("fp16", "log8")
_AXES = ("token", "channel")


def bf16_round(x: npt.ArrayLike) -> F32:
    """Round float32 to the nearest bfloat16 (ties to even), returned as float32."""
    a = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    bits = a.view(np.uint32).astype(np.uint64)
    rounded = (bits + np.uint64(0x7FFF) + ((bits >> np.uint64(16)) & np.uint64(1))) & np.uint64(
        0xFFFF0000
    )
    return rounded.astype(np.uint32).view(np.float32)


def fp16_round(x: npt.ArrayLike) -> F32:
    """Round to float16 (saturating at +-65504), returned as float32."""
    lim = float(np.finfo(np.float16).max)
    return np.clip(np.asarray(x, dtype=np.float32), -lim, lim).astype(np.float16).astype(np.float32)


def rope_roundtrip(rope: npt.ArrayLike, mode: str) -> F32:
    """The RoPE key ``[..., R]`` as a cache of ``mode`` (see :data:`ROPE_MODES`) reads it back."""
    r = np.asarray(rope, dtype=np.float32)
    if mode == "bf16":
        return bf16_round(r)
    if mode == "fp8":
        return fp8_e4m3_round(r)
    if mode == "int8":
        step = fp16_round(np.abs(r).max(axis=-1) / 127)
        safe = np.where(step > 0, step, np.float32(1))[..., None]
        out: F32 = (np.clip(np.rint(r / safe), -127, 127) * safe).astype(np.float32)
        return out
    raise ValueError(f"rope mode must be one of {ROPE_MODES}, got {mode!r}")


def rope_bytes(width: int, mode: str) -> float:
    """Bytes per token of a RoPE key of ``width`` channels stored as ``mode``."""
    return {"bf16": 2.0 * width, "fp8": 1.0 * width, "int8": width + 2.0}[mode]


def _log8_rows(x: F32, bits: int) -> F32:
    """Rows quantized with a log8 step (rounded up) and an integer zero point, read back."""
    levels = 2**bits - 1
    lo, hi = x.min(axis=-1), x.max(axis=-1)
    step = np.maximum((hi - lo) / levels, np.float32(2.0**-20))
    # a 2^(1/16) grid, rounded up so the range still fits (the byte's offset is a format
    # choice; the simulation assumes one that covers the data)
    step_q = np.exp2(np.ceil(np.float32(16) * np.log2(step)) / np.float32(16)).astype(np.float32)
    zero = np.clip(np.floor(lo / step_q), -128, 127)
    lo_q = zero * step_q
    q = np.clip(np.rint((x - lo_q[..., None]) / step_q[..., None]), 0, levels)
    out: F32 = (q * step_q[..., None] + lo_q[..., None]).astype(np.float32)
    return out


@dataclass(frozen=True)
class LatentRecipe:
    """One candidate recipe (see the module docstring); ``name`` labels it in tables."""

    name: str
    bits: int = 4
    axis: str = "token"
    group: int = 512
    tile: int = 128
    rotate: bool = False
    varnorm: bool = False
    scales: str = "fp16"
    rope: str = "fp8"
    groups: int = 0

    def __post_init__(self) -> None:
        check_bits(self.bits)
        if self.axis not in _AXES:
            raise ValueError(f"axis must be one of {_AXES}, got {self.axis!r}")
        if self.scales not in _SCALES:
            raise ValueError(f"scales must be one of {_SCALES}, got {self.scales!r}")
        if self.rope not in ROPE_MODES:
            raise ValueError(f"rope must be one of {ROPE_MODES}, got {self.rope!r}")

    @property
    def group_size(self) -> int:
        """Tokens per tile (the pseudo-decode block must be a multiple)."""
        return self.tile

    def bytes_per_token(self, latent: int, rope: int) -> float:
        """Stored bytes per token at latent width ``latent`` and RoPE width ``rope``."""
        per_group = 4.0 if self.scales == "fp16" else 2.0
        if self.axis == "token":
            params = per_group * (self.groups or latent / self.group)
        else:
            params = per_group * latent / self.tile
        norm = latent / self.tile + 1.0 if self.varnorm else 0.0  # column bytes + row factor
        return latent * self.bits / 8 + params + norm + rope_bytes(rope, self.rope)

    def roundtrip(self, latent: npt.ArrayLike, rope: npt.ArrayLike) -> tuple[F32, F32]:
        """``latent`` ``[T, L]`` and ``rope`` ``[T, R]`` (``T`` a multiple of ``tile``) as
        this recipe's cache reads them back."""
        x = np.asarray(latent, dtype=np.float32)
        t, width = x.shape
        if t % self.tile:
            raise ValueError(f"latent tokens must be a multiple of {self.tile}, got {t}")
        if self.rotate:
            x = rotate(x, axis=-1).astype(np.float32)
        tiles = x.reshape(t // self.tile, self.tile, width)
        col = np.ones((t // self.tile, 1, width), dtype=np.float32)
        row = np.ones((t // self.tile, self.tile, 1), dtype=np.float32)
        if self.varnorm:
            bal = variance_normalize(tiles)
            col = decode_log8(encode_log8(bal.col_scale))[:, None, :]
            row = fp16_round(bal.row_scale)[:, :, None]
            tiles = tiles / (row * col)
        out = self._quantize(tiles) * row * col
        y = out.reshape(t, width)
        if self.rotate:
            y = unrotate(y, axis=-1).astype(np.float32)
        return y.astype(np.float32), rope_roundtrip(rope, self.rope)

    def _quantize(self, tiles: F32) -> F32:
        n, g, width = tiles.shape
        if self.axis == "channel":
            rows = np.swapaxes(tiles, -1, -2)  # [n, L, G]
        else:
            w = width // self.groups if self.groups else min(self.group, width)
            rows = tiles.reshape(n, g, width // w, w)
        if self.scales == "log8":
            back = _log8_rows(rows, self.bits)
        else:
            q = quantize_rows(rows, self.bits)
            back = dequantize_rows(
                type(q)(codes=q.codes, step=fp16_round(q.step), lo=fp16_round(q.lo), bits=q.bits)
            )
        if self.axis == "channel":
            return np.swapaxes(back, -1, -2).astype(np.float32)
        return back.reshape(n, g, width).astype(np.float32)


@dataclass(frozen=True)
class Bf16Latent:
    """The bf16 latent cache (vLLM's default ``auto`` on a bf16 model): 2 (L + R) bytes."""

    name: str = "bf16"
    group_size: int = 1

    def bytes_per_token(self, latent: int, rope: int) -> float:
        return 2.0 * (latent + rope)

    def roundtrip(self, latent: npt.ArrayLike, rope: npt.ArrayLike) -> tuple[F32, F32]:
        return bf16_round(latent), bf16_round(rope)


@dataclass(frozen=True)
class Fp8DsMla:
    """vLLM's ``fp8_ds_mla`` layout: the latent in float8 e4m3 with one float32 scale per 128
    channels (``max|x| / 448``), the RoPE key in bf16: 656 bytes a token at 512 + 64."""

    name: str = "fp8_ds_mla"
    group_size: int = 1
    tile: int = 128

    def bytes_per_token(self, latent: int, rope: int) -> float:
        return latent + 4.0 * latent / self.tile + 2.0 * rope

    def roundtrip(self, latent: npt.ArrayLike, rope: npt.ArrayLike) -> tuple[F32, F32]:
        x = np.asarray(latent, dtype=np.float32)
        groups = x.reshape(*x.shape[:-1], -1, self.tile)
        scale = np.abs(groups).max(axis=-1, keepdims=True) / np.float32(448)
        scale = np.where(scale > 0, scale, np.float32(1))
        back = (fp8_e4m3_round(groups / scale) * scale).reshape(x.shape).astype(np.float32)
        return back, bf16_round(rope)


@dataclass(frozen=True)
class MLAFormat:
    """A :mod:`kvarn_math.mla` preset as a method (its records encoded and decoded)."""

    preset: str

    @property
    def name(self) -> str:
        return self.preset

    @property
    def group_size(self) -> int:
        return get_mla_preset(self.preset).group_size

    def bytes_per_token(self, latent: int, rope: int) -> float:
        return mla_layout(self.preset, latent, rope).bytes_per_token

    def roundtrip(self, latent: npt.ArrayLike, rope: npt.ArrayLike) -> tuple[F32, F32]:
        return roundtrip_latent(latent, rope, self.preset)
