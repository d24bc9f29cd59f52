"""Hypothesis strategies for KV data shaped like real keys and values.

Arrays are drawn from a seed and a distribution name, then generated with NumPy: hypothesis
shrinks the seed and the shape, not millions of floats.

Distributions:

* ``gaussian``: i.i.d. N(0, 1).
* ``heavy_tailed``: Student-t with 3 degrees of freedom.
* ``outlier_channels``: like post-RoPE keys: a few channels with a large offset and scale
  (x20), per-channel scales spread over two decades.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from kvarn_math.layout import PRESETS, SUPPORTED_HEAD_DIMS, Preset

__all__ = [
    "DISTRIBUTIONS",
    "KVSample",
    "make_kv",
    "kv_tiles",
    "kv_sequences",
    "presets",
    "register_profiles",
]

DISTRIBUTIONS = ("gaussian", "heavy_tailed", "outlier_channels")


def make_kv(
    shape: tuple[int, ...], distribution: str, seed: int, scale: float = 1.0
) -> npt.NDArray[np.float32]:
    """Draw a float32 array ``shape`` (channels on the last axis) from ``distribution``."""
    rng = np.random.default_rng(seed)
    d = shape[-1]
    if distribution == "gaussian":
        x = rng.standard_normal(shape)
    elif distribution == "heavy_tailed":
        x = rng.standard_t(3, size=shape)
    elif distribution == "outlier_channels":
        channel_scale = 10.0 ** rng.uniform(-1.0, 1.0, size=d)
        offsets = rng.normal(0.0, 1.0, size=d)
        outliers = rng.choice(d, size=max(1, d // 32), replace=False)
        channel_scale[outliers] *= 20.0
        offsets[outliers] += rng.choice([-30.0, 30.0], size=outliers.size)
        x = rng.standard_normal(shape) * channel_scale + offsets
    else:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
    return (x * scale).astype(np.float32)


@dataclass(frozen=True)
class KVSample:
    """A drawn K/V pair with how it was made (shown by hypothesis on failure)."""

    k: npt.NDArray[np.float32]
    v: npt.NDArray[np.float32]
    distribution: str
    seed: int


def presets() -> st.SearchStrategy[Preset]:
    """Any registered preset."""
    return st.sampled_from(list(PRESETS.values()))


@st.composite
def kv_tiles(
    draw: st.DrawFn,
    group_size: int | st.SearchStrategy[int] = 128,
    head_dim: int | st.SearchStrategy[int] = st.sampled_from(SUPPORTED_HEAD_DIMS[:3]),
    batch: int | st.SearchStrategy[int] = st.integers(1, 3),
) -> KVSample:
    """Tiles ``k, v`` ``[batch, G, D]`` of a random distribution and magnitude."""

    def value(x: int | st.SearchStrategy[int]) -> int:
        return draw(x) if isinstance(x, st.SearchStrategy) else x

    g, d, b = value(group_size), value(head_dim), value(batch)
    dist = draw(st.sampled_from(DISTRIBUTIONS))
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(st.sampled_from([1e-2, 1.0, 30.0]))
    k = make_kv((b, g, d), dist, seed, scale)
    v = make_kv((b, g, d), "gaussian" if dist == "outlier_channels" else dist, seed + 1, scale)
    return KVSample(k, v, dist, seed)


@st.composite
def kv_sequences(
    draw: st.DrawFn,
    max_tokens: int = 300,
    head_dim: int | st.SearchStrategy[int] = st.sampled_from((64, 128)),
    num_kv_heads: int | st.SearchStrategy[int] = st.integers(1, 2),
) -> KVSample:
    """Sequences ``k, v`` ``[T, H_kv, D]`` with ``1 <= T <= max_tokens``."""

    def value(x: int | st.SearchStrategy[int]) -> int:
        return draw(x) if isinstance(x, st.SearchStrategy) else x

    t = draw(st.integers(1, max_tokens))
    h, d = value(num_kv_heads), value(head_dim)
    dist = draw(st.sampled_from(DISTRIBUTIONS))
    seed = draw(st.integers(0, 2**32 - 1))
    return KVSample(
        make_kv((t, h, d), dist, seed), make_kv((t, h, d), "gaussian", seed + 1), dist, seed
    )


def register_profiles() -> None:
    """Register the ``ci`` (derandomized, few examples) and ``nightly`` (wide) profiles.

    The profile in ``HYPOTHESIS_PROFILE`` is loaded (default ``ci``).
    """
    common = dict(
        deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
    )
    settings.register_profile("ci", max_examples=25, derandomize=True, print_blob=True, **common)  # type: ignore[arg-type]
    settings.register_profile("dev", max_examples=50, **common)  # type: ignore[arg-type]
    settings.register_profile("nightly", max_examples=1000, **common)  # type: ignore[arg-type]
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
