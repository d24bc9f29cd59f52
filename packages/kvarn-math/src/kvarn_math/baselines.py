"""Comparison methods, each with its bytes per token, sharing one interface.

Every method maps exact K/V ``[T, H, D]`` (``T`` a multiple of its group when it has one)
to their reconstruction (fake quantization, float32, original frame) and states its
storage cost in bytes per token per head, scales included:

* ``PerTokenRTN`` (like vLLM's ``int4_per_token_head``): asymmetric RTN per token and head
  over channels, fp16 scale and zero per token.
* ``KIVI``: K per channel over groups of ``G`` tokens, V per token; no rotation.
* ``HadamardRTN``: the KVarN tile without variance normalization (rotate, K per channel over
  the tile, V per token).
* ``FP8``: float8 e4m3 rounding (round to nearest even, saturating at 448), scale 1.
* ``KVarN``: a :mod:`kvarn_math.layout` preset through the real record format.
* ``Exact``: no quantization (bf16/fp16 storage, 2 bytes per element).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvarn_math.hadamard import rotate, unrotate
from kvarn_math.layout import Preset, get_preset, tile_layout
from kvarn_math.rtn import check_bits, quantize_rows
from kvarn_math.tile import (
    KEY_FRAMES,
    choose_key_frames,
    dequantize_tiles,
    frame_query_rows,
    quantize_tiles,
)
from kvarn_math.varnorm import DEFAULT_ITERATIONS

__all__ = [
    "Method",
    "Exact",
    "PerTokenRTN",
    "KIVI",
    "HadamardRTN",
    "FP8",
    "KVarN",
    "fp8_e4m3_round",
    "standard_methods",
]

F32 = npt.NDArray[np.float32]
_FP16_BYTES = 2


def _fp16_round(x: npt.NDArray[np.floating]) -> F32:
    fmax = float(np.finfo(np.float16).max)
    out: F32 = np.clip(x, -fmax, fmax).astype(np.float16).astype(np.float32)
    return out


def _rtn_fp16(x: F32, bits: int) -> F32:
    """RTN per row of ``x`` ``[..., R, C]`` with the step and minimum stored as fp16."""
    q = quantize_rows(x, bits)
    step = _fp16_round(q.step)
    lo = _fp16_round(q.lo)
    return (q.codes.astype(np.float32) * step[..., None] + lo[..., None]).astype(np.float32)


def _check_kv(k: npt.ArrayLike, v: npt.ArrayLike, group: int = 1) -> tuple[F32, F32]:
    ka = np.asarray(k, dtype=np.float32)
    va = np.asarray(v, dtype=np.float32)
    if ka.shape != va.shape or ka.ndim != 3:
        raise ValueError(f"k and v must be [T, H, D] of one shape, got {ka.shape}, {va.shape}")
    if ka.shape[0] % group:
        raise ValueError(f"T must be a multiple of the group size {group}, got {ka.shape[0]}")
    for name, x in (("k", ka), ("v", va)):
        bad = ~np.isfinite(x)
        if bad.any():
            t, h, c = (int(i) for i in np.argwhere(bad)[0])
            raise ValueError(
                f"{name} holds {x[t, h, c]} at token {t}, head {h}, channel {c}; K/V must be finite"
            )
    return ka, va


def _check_rotatable(name: str, head_dim: int) -> None:
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(
            f"head_dim must be a power of two for {name} (a Hadamard rotation), got {head_dim}"
        )


def _tiles(x: F32, group: int) -> F32:
    """``[T, H, D]`` -> ``[T / G, H, G, D]``."""
    t, h, d = x.shape
    return x.reshape(t // group, group, h, d).transpose(0, 2, 1, 3)


def _untiles(x: F32) -> F32:
    n, h, g, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(n * g, h, d)


@dataclass(frozen=True)
class Method:
    """Base class: a KV-cache quantization method.

    Attributes:
        name: short identifier used in tables.
        group_size: tokens that must be quantized together (1: any token count).
    """

    name: str
    group_size: int = 1

    def bytes_per_token_per_head(self, head_dim: int) -> float:
        """Stored bytes of K plus V for one token of one head, scales included."""
        raise NotImplementedError

    def bits_per_element(self, head_dim: int) -> float:
        """Average bits per K or V element."""
        return 8 * self.bytes_per_token_per_head(head_dim) / (2 * head_dim)

    def roundtrip(self, k: npt.ArrayLike, v: npt.ArrayLike) -> tuple[F32, F32]:
        """Quantize and reconstruct ``k, v`` ``[T, H, D]``; returns float32 of the same shape."""
        raise NotImplementedError


@dataclass(frozen=True)
class Exact(Method):
    """No quantization: 16-bit storage (values rounded to bf16 when ``bf16``)."""

    name: str = "bf16"
    bf16: bool = True

    def bytes_per_token_per_head(self, head_dim: int) -> float:
        return 2 * _FP16_BYTES * head_dim

    def roundtrip(self, k: npt.ArrayLike, v: npt.ArrayLike) -> tuple[F32, F32]:
        ka, va = _check_kv(k, v)
        if not self.bf16:
            return _fp16_round(ka), _fp16_round(va)
        return _bf16_round(ka), _bf16_round(va)


def _bf16_round(x: F32) -> F32:
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


@dataclass(frozen=True)
class PerTokenRTN(Method):
    """Asymmetric RTN per token and head over channels (fp16 step and zero)."""

    name: str = "int4_per_token"
    key_bits: int = 4
    value_bits: int = 4

    def __post_init__(self) -> None:
        check_bits(self.key_bits, "key_bits")
        check_bits(self.value_bits, "value_bits")

    def bytes_per_token_per_head(self, head_dim: int) -> float:
        return (self.key_bits + self.value_bits) * head_dim / 8 + 4 * _FP16_BYTES

    def roundtrip(self, k: npt.ArrayLike, v: npt.ArrayLike) -> tuple[F32, F32]:
        ka, va = _check_kv(k, v)
        return _rtn_fp16(ka, self.key_bits), _rtn_fp16(va, self.value_bits)


@dataclass(frozen=True)
class KIVI(Method):
    """KIVI-style: K per channel over ``G``-token groups, V per token; no rotation."""

    name: str = "kivi_k4v2"
    group_size: int = 128
    key_bits: int = 4
    value_bits: int = 2

    def __post_init__(self) -> None:
        check_bits(self.key_bits, "key_bits")
        check_bits(self.value_bits, "value_bits")

    def bytes_per_token_per_head(self, head_dim: int) -> float:
        key = self.key_bits * head_dim / 8 + 2 * head_dim * _FP16_BYTES / self.group_size
        value = self.value_bits * head_dim / 8 + 2 * _FP16_BYTES
        return key + value

    def roundtrip(self, k: npt.ArrayLike, v: npt.ArrayLike) -> tuple[F32, F32]:
        ka, va = _check_kv(k, v, self.group_size)
        k_tiles = _tiles(ka, self.group_size)  # [N, H, G, D]
        k_hat = np.swapaxes(_rtn_fp16(np.swapaxes(k_tiles, -1, -2), self.key_bits), -1, -2)
        return _untiles(k_hat), _rtn_fp16(va, self.value_bits)


@dataclass(frozen=True)
class HadamardRTN(KIVI):
    """Rotate, then K per channel over the tile and V per token (KVarN minus normalization)."""

    name: str = "hadamard_rtn_k4v2"

    def roundtrip(self, k: npt.ArrayLike, v: npt.ArrayLike) -> tuple[F32, F32]:
        ka, va = _check_kv(k, v, self.group_size)
        _check_rotatable(self.name, ka.shape[-1])
        k_hat, v_hat = super().roundtrip(rotate(ka, axis=-1), rotate(va, axis=-1))
        return (
            unrotate(k_hat, axis=-1).astype(np.float32),
            unrotate(v_hat, axis=-1).astype(np.float32),
        )


def fp8_e4m3_round(x: npt.ArrayLike) -> F32:
    """Round to the nearest float8 e4m3fn value (ties to even), saturating at +-448.

    e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; normals from 2^-6, subnormals in
    steps of 2^-9.
    """
    a = np.asarray(x, dtype=np.float64)
    mag = np.minimum(np.abs(a), 448.0)
    exp = np.floor(np.log2(np.maximum(mag, 2.0**-6)))
    step = 2.0 ** (exp - 3)
    rounded = np.rint(mag / step) * step
    out: F32 = (np.sign(a) * np.minimum(rounded, 448.0)).astype(np.float32)
    return out


@dataclass(frozen=True)
class FP8(Method):
    """float8 e4m3 with a scale of 1 (vLLM's default ``fp8`` KV cache without calibration)."""

    name: str = "fp8_e4m3"

    def bytes_per_token_per_head(self, head_dim: int) -> float:
        return 2 * head_dim

    def roundtrip(self, k: npt.ArrayLike, v: npt.ArrayLike) -> tuple[F32, F32]:
        ka, va = _check_kv(k, v)
        return fp8_e4m3_round(ka), fp8_e4m3_round(va)


@dataclass(frozen=True)
class KVarN(Method):
    """A KVarN preset through the real record format (quantize, write records, read back).

    ``key_frame="auto"`` stores each tile's keys in the frame
    :func:`kvarn_math.tile.choose_key_frames` picks from the queries of the tile's last
    position (:func:`kvarn_math.tile.frame_query_rows`), as kvarn-vllm's store does by default;
    the method then asks for them (``reads_queries``) and, given none, keeps the keys rotated
    (``"rotated"``, the default here).
    """

    name: str = "kvarn_k4v2_g128"
    group_size: int = 128
    clip_ratios: tuple[float, ...] = ()
    iterations: int = DEFAULT_ITERATIONS
    key_frame: str = "rotated"

    def __post_init__(self) -> None:
        if self.key_frame not in KEY_FRAMES:
            raise ValueError(f"key_frame must be one of {KEY_FRAMES}, got {self.key_frame!r}")

    @property
    def reads_queries(self) -> bool:
        """Whether :meth:`roundtrip` takes the queries of the stored positions."""
        return self.key_frame == "auto"

    @property
    def preset(self) -> Preset:
        """The :class:`~kvarn_math.layout.Preset` this method stores (``name`` up to a ``+``)."""
        return get_preset(self.name.split("+")[0])

    @classmethod
    def of(
        cls, preset: str | Preset, clip_ratios: tuple[float, ...] = (), key_frame: str = "rotated"
    ) -> KVarN:
        """The method for ``preset``; with ``clip_ratios`` the experimental clip search
        (named ``<preset>+clip``, same bytes)."""
        p = get_preset(preset)
        name = f"{p.name}+clip" if clip_ratios else p.name
        return cls(
            name=name,
            group_size=p.group_size,
            clip_ratios=tuple(clip_ratios),
            key_frame=key_frame,
        )

    def bytes_per_token_per_head(self, head_dim: int) -> float:
        return tile_layout(self.preset, head_dim).bytes_per_token_per_head

    def roundtrip(
        self, k: npt.ArrayLike, v: npt.ArrayLike, queries: npt.ArrayLike | None = None
    ) -> tuple[F32, F32]:
        """Round trip through records; ``queries`` ``[T, H_q, D]`` (``H_q`` a multiple of
        ``H``, each KV head's query heads adjacent) choose the key frames with ``"auto"``."""
        ka, va = _check_kv(k, v, self.group_size)
        t, h, d = ka.shape
        k_tiles = _tiles(ka, self.group_size)
        raw: npt.NDArray[np.bool_] | bool = False
        if queries is not None and self.key_frame == "auto":
            qa = np.asarray(queries, dtype=np.float32)
            if qa.ndim != 3 or qa.shape[0] != t or qa.shape[2] != d or qa.shape[1] % h:
                raise ValueError(
                    f"queries must be [{t}, a multiple of {h}, {d}], got {list(qa.shape)}"
                )
            g = self.group_size
            # per tile and KV head: the queries of the position a store judges a tile by
            # (frame_query_rows of its G: the last), in the head's query group
            q_tiles = qa.reshape(t // g, g, h, -1, d).transpose(0, 2, 1, 3, 4)
            q_tiles = q_tiles[:, :, frame_query_rows(g)]
            raw = choose_key_frames(k_tiles, q_tiles.reshape(t // g, h, -1, d))
        records = quantize_tiles(
            k_tiles,
            _tiles(va, self.group_size),
            self.preset,
            iterations=self.iterations,
            clip_ratios=self.clip_ratios,
            raw_keys=raw,
        )
        k_hat, v_hat = dequantize_tiles(records, self.preset, d)
        return _untiles(k_hat), _untiles(v_hat)


def standard_methods(group_size: int = 128) -> list[Method]:
    """The comparison set used by the report and kvarn-eval: every preset and the baselines.

    The presets choose each tile's key frame from the queries when the caller passes them
    (kvarn-eval's pseudo-decode does; the synthetic report has none and keeps keys rotated)."""
    from kvarn_math.layout import PRESETS

    methods: list[Method] = [Exact(), FP8(), PerTokenRTN()]
    # as kvarn-vllm serves them: each tile's key frame from the queries where a caller has them
    methods += [KVarN.of(p, key_frame="auto") for p in PRESETS.values()]
    methods += [
        KIVI(name="kivi_k4v2", group_size=group_size, key_bits=4, value_bits=2),
        KIVI(name="kivi_k2v2", group_size=group_size, key_bits=2, value_bits=2),
        HadamardRTN(name="hadamard_rtn_k4v2", group_size=group_size, key_bits=4, value_bits=2),
        HadamardRTN(name="hadamard_rtn_k2v2", group_size=group_size, key_bits=2, value_bits=2),
    ]
    return methods
