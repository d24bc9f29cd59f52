"""The KV caches a serving benchmark compares: a ``--kv-cache-dtype`` and, optionally, a backend.

A cache is written ``DTYPE`` or ``DTYPE@BACKEND``: ``bf16@FLASH_ATTN`` is vLLM's default cache
(``kv_cache_dtype="auto"``, bf16 for bf16 models) on FlashAttention, ``bf16@TRITON_ATTN`` the same
cache on vLLM's Triton backend, ``fp8@TRITON_ATTN`` vLLM's fp8 cache, ``turboquant_4bit_nc`` a
TurboQuant preset (vLLM picks its backend), ``kvarn_k4v2_g128`` a KVarN preset (the kvarn-vllm
plugin picks its backend; naming one is an error). A kvarn preset may carry serving settings,
each after a ``+``: ``kvarn_k4v2_g128+recent0`` reads no complete tile exact from staging
(``KVARN_VLLM_RECENT_TILES=0`` in its engine's environment; ``recentN`` for N = 0-4), ``+mqa``
runs continuation chunks through the multi-query kernel instead of dequantizing the context for
FlashAttention (``KVARN_VLLM_DENSE_CONTEXT=0``), ``+rotated`` stores every tile's keys rotated
instead of choosing each tile's key frame from the queries (``KVARN_VLLM_KEY_FRAME=rotated``),
``+keys`` keeps the exact tiles' keys exact too instead of their values only
(``KVARN_VLLM_WINDOW_KEYS=1``, the default of 2- and 3-bit keys), ``+values`` keeps only their
values exact (``KVARN_VLLM_WINDOW_KEYS=0``, the default of 4-bit keys), ``+invariant`` runs
attention batch-invariant (``KVARN_KERNELS_BATCH_INVARIANT=1``) and ``+splitN`` sets its fixed
split length on the Gluon decode kernel to N tiles (``KVARN_KERNELS_INVARIANT_SPLIT_TILES=N``, a
power of two 1-256), so that one table compares the two launches. Names are
checked here, without importing vLLM, against the values vLLM 0.26 accepts (a test compares with
vLLM's own list).

Bytes per token and KV head, for tables and plots, come from each format's definition: kvarn from
kvarn-math's tile layout, TurboQuant from vLLM 0.26's ``TurboQuantConfig`` formula (K and V
slots with their norms and scales, rounded up to even), whose first and last two layers vLLM keeps
in bf16 (averaged in when the number of layers is known).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvarn_math.layout import PRESETS, tile_layout

__all__ = [
    "ATTENTION_BACKENDS",
    "DEFAULT_CACHES",
    "TURBOQUANT_PRESETS",
    "VLLM_CACHE_DTYPES",
    "CacheSpec",
    "parse_cache",
    "parse_caches",
]

# vLLM 0.26's vllm.config.cache.CacheDType, in its order
VLLM_CACHE_DTYPES: tuple[str, ...] = (
    "auto",
    "float16",
    "bfloat16",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    "fp8_inc",
    "fp8_ds_mla",
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
    "int4_per_token_head",
    "int8_per_token_head",
    "fp8_per_token_head",
    "nvfp4",
)
# vLLM 0.26's TQ_PRESETS: (key bits, value bits); key bits 8 means fp8 keys
TURBOQUANT_PRESETS: dict[str, tuple[int, int]] = {
    "turboquant_k8v4": (8, 4),
    "turboquant_4bit_nc": (4, 4),
    "turboquant_k3v4_nc": (3, 4),
    "turboquant_3bit_nc": (3, 3),
}
TURBOQUANT_BF16_BOUNDARY_LAYERS = 2  # at each end (TurboQuantConfig.get_boundary_skip_layers)
# backends a bf16 or fp8 cache may be pinned to (vLLM's AttentionBackendEnum names)
ATTENTION_BACKENDS: tuple[str, ...] = ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "FLEX_ATTENTION")
_ALIASES = {"bf16": "auto", "fp16": "auto"}
# kvarn serving settings a cache label may carry after "+": pattern -> (environment variable,
# its value; None: the pattern's group)
_KVARN_SETTINGS: dict[str, tuple[str, str | None]] = {
    r"recent([0-4])": ("KVARN_VLLM_RECENT_TILES", None),
    r"mqa": ("KVARN_VLLM_DENSE_CONTEXT", "0"),
    r"rotated": ("KVARN_VLLM_KEY_FRAME", "rotated"),
    r"keys": ("KVARN_VLLM_WINDOW_KEYS", "1"),
    r"values": ("KVARN_VLLM_WINDOW_KEYS", "0"),
    r"invariant": ("KVARN_KERNELS_BATCH_INVARIANT", "1"),
    r"split(1|2|4|8|16|32|64|128|256)": ("KVARN_KERNELS_INVARIANT_SPLIT_TILES", None),
}

DEFAULT_CACHES: tuple[str, ...] = (
    "bf16@FLASH_ATTN",
    "bf16@TRITON_ATTN",
    "fp8@TRITON_ATTN",
    *TURBOQUANT_PRESETS,
    *PRESETS,
)


@dataclass(frozen=True)
class CacheSpec:
    """One KV cache configuration of vLLM.

    Attributes:
        label: what tables show (the text it was parsed from, normalized).
        kv_cache_dtype: the value of vLLM's ``kv_cache_dtype``.
        backend: attention backend name, or ``None`` to let vLLM (or the plugin) choose.
        env: environment variables of the engine (a kvarn setting after ``+``), as pairs.
    """

    label: str
    kv_cache_dtype: str
    backend: str | None = None
    env: tuple[tuple[str, str], ...] = ()

    @property
    def family(self) -> str:
        """``bf16``, ``fp8``, ``turboquant``, ``kvarn`` or ``other`` (plot colours, grouping)."""
        dtype = self.kv_cache_dtype
        if dtype in ("auto", "bfloat16", "float16"):
            return "bf16"
        if dtype.startswith("fp8"):
            return "fp8"
        if dtype.startswith("turboquant_"):
            return "turboquant"
        if dtype.startswith("kvarn_"):
            return "kvarn"
        return "other"

    @property
    def is_reference(self) -> bool:
        """An unquantized (16-bit) cache."""
        return self.family == "bf16"

    def bytes_per_token_per_head(self, head_dim: int, num_layers: int | None = None) -> float:
        """K plus V bytes per token and KV head, averaged over layers when ``num_layers`` is given.

        Args:
            head_dim: channels per head.
            num_layers: decoder layers (TurboQuant keeps some in bf16); ``None``: quantized
                layers only.

        Returns:
            ``nan`` for formats whose size is not modelled here.
        """
        dtype = self.kv_cache_dtype
        bf16 = 2.0 * 2 * head_dim
        if self.family == "bf16":
            return bf16
        if dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
            return 2.0 * head_dim
        if dtype in TURBOQUANT_PRESETS:
            key_bits, value_bits = TURBOQUANT_PRESETS[dtype]
            key = head_dim if key_bits == 8 else math.ceil(head_dim * key_bits / 8) + 2
            value = math.ceil(head_dim * value_bits / 8) + 4
            slot = key + value + (key + value) % 2
            if num_layers is None:
                return float(slot)
            kept = min(2 * TURBOQUANT_BF16_BOUNDARY_LAYERS, 2 * (num_layers // 2))
            return ((num_layers - kept) * slot + kept * bf16) / num_layers
        if dtype in PRESETS:
            return float(tile_layout(dtype, head_dim).bytes_per_token_per_head)
        return math.nan

    def bits_per_element(self, head_dim: int, num_layers: int | None = None) -> float:
        """Stored bits per K or V element, scales included (see :meth:`bytes_per_token_per_head`).

        Args:
            head_dim: channels per head.
            num_layers: decoder layers, or ``None``.
        """
        return 8 * self.bytes_per_token_per_head(head_dim, num_layers) / (2 * head_dim)

    def llm_kwargs(self) -> dict[str, object]:
        """The ``vllm.LLM`` keyword arguments selecting this cache."""
        kwargs: dict[str, object] = {"kv_cache_dtype": self.kv_cache_dtype}
        if self.backend is not None:
            kwargs["attention_config"] = {"backend": self.backend}
        return kwargs


def parse_cache(text: str) -> CacheSpec:
    """Parse ``DTYPE``, ``DTYPE@BACKEND`` or ``KVARN_PRESET+SETTING[+SETTING...]``.

    Args:
        text: e.g. ``bf16@FLASH_ATTN``, ``fp8``, ``turboquant_4bit_nc``, ``kvarn_k4v2_g128``,
            ``kvarn_k4v2_g128+recent0``, ``kvarn_k4v2_g128+recent0+mqa``.

    Raises:
        ValueError: an unknown dtype, backend or setting, a backend named for a kvarn or
            TurboQuant cache (they bring their own), or a setting on a cache that is not kvarn.
    """
    name, _, backend = text.strip().partition("@")
    name, *settings = name.split("+")
    env: dict[str, str] = {}
    if settings and name not in PRESETS:
        raise ValueError(f"{text!r}: only a kvarn preset takes a '+' setting")
    for setting in settings:
        for pattern, (var, value) in _KVARN_SETTINGS.items():
            match = re.fullmatch(pattern, setting)
            if match:
                if var in env:
                    raise ValueError(f"{text!r} sets {var} twice")
                env[var] = match.group(1) if value is None else value
                break
        else:
            raise ValueError(
                f"unknown kvarn setting {setting!r} in {text!r}; expected recentN (N = 0-4: "
                "complete tiles read exact from staging), mqa (continuation chunks through "
                "the multi-query kernel), rotated (every tile's keys rotated), keys (the exact "
                "tiles keep their keys), values (the exact tiles keep only their values), "
                "invariant (batch-invariant attention) or splitN (its split length in tiles, N "
                "a power of two 1-256)"
            )
    dtype = _ALIASES.get(name, name)
    known = (*VLLM_CACHE_DTYPES, *PRESETS)
    if dtype not in known:
        raise ValueError(
            f"unknown KV cache {name!r}; expected bf16, one of vLLM 0.26's "
            f"--kv-cache-dtype values ({', '.join(VLLM_CACHE_DTYPES)}) or a kvarn preset "
            f"({', '.join(PRESETS)}), optionally followed by @BACKEND"
        )
    if backend:
        backend = backend.upper()
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"unknown attention backend {backend!r} in {text!r}; expected one of "
                f"{', '.join(ATTENTION_BACKENDS)}"
            )
        if dtype in PRESETS or dtype in TURBOQUANT_PRESETS:
            raise ValueError(
                f"{text!r}: {dtype} chooses its own attention backend; drop '@{backend}'"
            )
    label = ("bf16" if dtype == "auto" else dtype) + (f"@{backend}" if backend else "")
    label += "".join(f"+{setting}" for setting in settings)
    return CacheSpec(
        label=label, kv_cache_dtype=dtype, backend=backend or None, env=tuple(env.items())
    )


def parse_caches(spec: str) -> list[CacheSpec]:
    """Comma-separated caches; ``default`` (or ``all``) expands to :data:`DEFAULT_CACHES`,
    ``kvarn`` to every kvarn preset, ``turboquant`` to every TurboQuant preset.

    Args:
        spec: e.g. ``bf16@FLASH_ATTN,kvarn`` or ``default``.

    Raises:
        ValueError: an unknown cache (see :func:`parse_cache`), or none selected.
    """
    groups = {
        "default": DEFAULT_CACHES,
        "all": DEFAULT_CACHES,
        "kvarn": tuple(PRESETS),
        "turboquant": tuple(TURBOQUANT_PRESETS),
    }
    chosen: list[CacheSpec] = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        for text in groups.get(item, (item,)):
            cache = parse_cache(text)
            if cache not in chosen:
                chosen.append(cache)
    if not chosen:
        raise ValueError(f"no KV cache selected by {spec!r}")
    return chosen
