"""Which MLA latent preset a ``kvarn_*`` ``--kv-cache-dtype`` selects on an MLA model.

An MLA layer (DeepSeek-V2/V3, GLM-4.7-Flash, Kimi) caches one latent ``c_kv`` and one RoPE
key per token, shared by every head, not separate keys and values; its format is
:mod:`kvarn_math.mla` (presets ``kvarn_mla_l{bits}_g{G}``). Two kinds of names select it:

* an MLA preset name itself, e.g. ``--kv-cache-dtype kvarn_mla_l2_g128``;
* any dense preset name (``kvarn_k4v2_g128``, the one a user tries first): its tile ``G`` is
  kept and its key bits pick the latent bits, 2-bit keys giving the 2-bit latent and every
  other preset the 4-bit one (the latent is the key and the value at once, and 4 bits is the
  default the accuracy evidence supports). So ``kvarn_k4v2_g128``, ``kvarn_k4v4_g128`` and
  ``kvarn_k3v2_g128`` serve ``kvarn_mla_l4_g128``; ``kvarn_k4v2_g64`` and ``kvarn_k4v4_g64``
  serve ``kvarn_mla_l4_g64``; ``kvarn_k2v2_g128`` serves ``kvarn_mla_l2_g128``.

An MLA preset name on a dense layer is refused (it names no key and value bits).
Nothing here imports vLLM, torch or Triton.
"""

from __future__ import annotations

from kvarn_math.layout import PRESETS
from kvarn_math.mla import (
    DEFAULT_MLA_PRESET,
    MLA_LATENT_DIMS,
    MLA_PRESETS,
    MLA_ROPE_DIMS,
    MLAPreset,
    get_mla_preset,
)

__all__ = [
    "DEFAULT_ROPE_DIM",
    "MLA_PREFIX",
    "is_mla_dtype",
    "mla_preset_for",
    "mla_preset_names",
    "split_head_size",
]

MLA_PREFIX = "kvarn_mla_"
DEFAULT_ROPE_DIM = 64
"""The RoPE width of every MLA model served so far (DeepSeek-V2/V3, GLM-4.7-Flash, Kimi), used
to split a cache head size when no model config says otherwise."""


def mla_preset_names() -> tuple[str, ...]:
    """The MLA preset names accepted as ``kv_cache_dtype``, default first."""
    rest = sorted(name for name in MLA_PRESETS if name != DEFAULT_MLA_PRESET)
    return (DEFAULT_MLA_PRESET, *rest)


def is_mla_dtype(kv_cache_dtype: object) -> bool:
    """True when ``kv_cache_dtype`` names an MLA preset (known or not): ``kvarn_mla_*``."""
    return isinstance(kv_cache_dtype, str) and kv_cache_dtype.startswith(MLA_PREFIX)


def mla_preset_for(kv_cache_dtype: str) -> MLAPreset:
    """The MLA preset ``kv_cache_dtype`` selects on an MLA layer (see the module docstring).

    Raises:
        ValueError: for a name that is neither an MLA preset nor a dense kvarn preset,
            naming both lists.
    """
    if is_mla_dtype(kv_cache_dtype):
        return get_mla_preset(kv_cache_dtype)
    dense = PRESETS.get(kv_cache_dtype)
    if dense is None:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} is no KVarN preset; on an MLA model use one "
            f"of {', '.join(mla_preset_names())} (or a dense preset name: "
            f"{', '.join(sorted(PRESETS))})"
        )
    bits = 2 if dense.key_bits == 2 else 4
    return get_mla_preset(MLAPreset.from_bits(bits, dense.group_size).name)


def split_head_size(head_size: int, kv_lora_rank: int | None = None) -> tuple[int, int]:
    """``(latent_dim, rope_dim)`` of an MLA cache row of ``head_size`` channels.

    ``kv_lora_rank``: the model's latent width when known (then the rest is RoPE); otherwise
    the RoPE part is taken as :data:`DEFAULT_ROPE_DIM`.

    Raises:
        ValueError: when the split is not a latent width and a RoPE width the format has
            (:data:`kvarn_math.mla.MLA_LATENT_DIMS`, :data:`kvarn_math.mla.MLA_ROPE_DIMS`).
    """
    latent = kv_lora_rank if kv_lora_rank is not None else head_size - DEFAULT_ROPE_DIM
    rope = head_size - latent
    if latent not in MLA_LATENT_DIMS or rope not in MLA_ROPE_DIMS:
        raise ValueError(
            f"its latent cache row is {head_size} wide (kv_lora_rank {latent} + "
            f"qk_rope_head_dim {rope}); the KVarN latent format stores kv_lora_rank in "
            f"{MLA_LATENT_DIMS} and qk_rope_head_dim in {MLA_ROPE_DIMS}"
        )
    return latent, rope
