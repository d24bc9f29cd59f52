"""The MLA attention backend over a KVarN latent cache, its page and its selection (vLLM 0.26).

On an MLA layer (``MLAAttention``: one latent ``c_kv`` of ``L = kv_lora_rank`` channels and one
RoPE key of ``R`` channels per token, shared by every head) a ``kvarn_*`` cache dtype selects
:class:`KvarnMLABackend` for the MLA preset :func:`kvarn_vllm.mla_config.mla_preset_for` maps it
to. One vLLM block is one tile of ``G`` tokens: one record of
``kvarn_math.mla.mla_layout(preset, L, R).tile_bytes`` bytes (42,240 for ``kvarn_mla_l4_g128`` at
512 + 64, 330 bytes a token instead of bf16's 1,152). The layer's cache is ``[num_blocks,
tile_bytes]`` uint8.

vLLM 0.26 sizes an MLA page from ``head_size`` and the dtype (``MLAAttention.get_kv_cache_spec``);
the ``mla-kv-cache-spec`` ledger entry (:mod:`kvarn_vllm.patches`) answers it with
:func:`make_mla_spec` for kvarn layers. Each (preset, L, R) gets its own backend subclass, since
vLLM asks the class (no layer at hand) for its block sizes and cache shape; every one reports
``get_name() == "CUSTOM"`` like the dense backends (``AttentionBackendEnum.CUSTOM`` pickles by
value, so spawned workers are safe).

What it does not serve is refused at start-up by :func:`select_mla_backend`, naming the layer,
the reason and what to use instead.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import replace
from typing import Any, ClassVar

from kvarn_math.mla import MLA_PRESETS, MLAPreset, get_mla_preset, mla_layout

from kvarn_vllm import releases
from kvarn_vllm.mla_config import mla_preset_for, split_head_size

__all__ = [
    "MLA_FALLBACK",
    "make_mla_spec",
    "mla_backend_class",
    "mla_spec_class",
    "mla_unserved_reasons",
    "select_mla_backend",
]

logger = logging.getLogger("vllm.kvarn")  # inherits vLLM's handler and level
BACKEND_NAME = "CUSTOM"
_announced: set[str] = set()
MLA_FALLBACK = (
    "To serve this model, use --kv-cache-dtype auto (bf16) or fp8 (fp8_ds_mla on sparse, "
    "DeepSeek-V3.2-style models), or change the setting named above."
)
"""What a refusal tells the user to do instead."""
SERVED_RELEASE = "vllm-0.26"
"""The release adapter whose MLA layer this binding follows (its cache spec and prefill)."""


def _class_name(preset: MLAPreset, latent_dim: int, rope_dim: int) -> str:
    return f"KvarnMLABackend_{preset.name.removeprefix('kvarn_mla_')}_{latent_dim}_{rope_dim}"


def _model_kv_lora_rank(vllm_config: Any) -> int | None:
    model_config = getattr(vllm_config, "model_config", None)
    text = getattr(model_config, "hf_text_config", None)
    rank = getattr(text, "kv_lora_rank", None)
    return rank if isinstance(rank, int) else None


def mla_unserved_reasons(cfg: Any, preset: MLAPreset, vllm_config: Any = None) -> list[str]:
    """Why the MLA backend cannot serve a layer (empty when it can).

    Args:
        cfg: vLLM's ``AttentionSelectorConfig`` of the layer (``use_mla`` set).
        preset: the MLA preset the cache dtype selects.
        vllm_config: the engine's config when one is being built (None in bare tests).
    """
    import torch

    reasons = []
    adapter = releases.check_supported()
    if adapter.name != SERVED_RELEASE:
        reasons.append(
            f"the MLA latent cache follows vLLM 0.26's MLA layer (its cache spec and prefill "
            f"context path); installed: vLLM {releases.vllm_version()} ({adapter.name}); "
            "served on vLLM 0.26.x"
        )
    if cfg.use_sparse:
        reasons.append(
            "it is sparse MLA (an indexer picks the top-k tokens, DeepSeek-V3.2); the latent "
            "cache serves dense MLA"
        )
    try:
        split_head_size(cfg.head_size, _model_kv_lora_rank(vllm_config))
    except ValueError as exc:
        reasons.append(str(exc))
    if cfg.dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"the model dtype is {cfg.dtype}; supported: float16, bfloat16")
    if cfg.block_size is not None and cfg.block_size != preset.group_size:
        reasons.append(
            f"--block-size {cfg.block_size} conflicts with {preset.name}, whose tile is "
            f"{preset.group_size} tokens (one vLLM block is one tile); drop --block-size or "
            f"pass --block-size {preset.group_size}"
        )
    if vllm_config is None:
        return reasons
    if getattr(vllm_config, "speculative_config", None) is not None:
        reasons.append(
            "speculative decoding (MTP, EAGLE, n-gram) with the latent cache is not tested yet"
        )
    parallel = getattr(vllm_config, "parallel_config", None)
    for field, what in (
        ("decode_context_parallel_size", "decode context parallelism"),
        ("prefill_context_parallel_size", "prefill context parallelism"),
    ):
        if getattr(parallel, field, 1) > 1:
            reasons.append(f"{what} is enabled (the context gather is not adapted to it)")
    cache_config = getattr(vllm_config, "cache_config", None)
    if getattr(cache_config, "kv_cache_dtype_skip_layers", None):
        reasons.append("--kv-cache-dtype-skip-layers (mixed page formats in one pool)")
    if getattr(getattr(vllm_config, "model_config", None), "is_hybrid", False):
        reasons.append(
            "the model is hybrid (MLA beside linear attention or Mamba); its page alignment "
            "is not adapted to latent records"
        )
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        reasons.append("a KV connector is configured (it would move raw latent records)")
    return reasons


def select_mla_backend(selected_backend: Any, cfg: Any, layer: str) -> type:
    """The backend of an MLA layer whose cache dtype is ``kvarn_*``.

    Raises:
        ValueError: naming ``layer``, every reason it cannot be served and what to use
            instead (:data:`MLA_FALLBACK`).
    """
    from vllm.config.vllm import get_current_vllm_config_or_none

    try:
        preset = mla_preset_for(cfg.kv_cache_dtype)
    except ValueError as exc:
        raise ValueError(f"attention layer {layer!r}: {exc}") from None
    name = getattr(selected_backend, "name", selected_backend)
    if selected_backend is not None and name != BACKEND_NAME:
        raise ValueError(
            f"MLA attention layer {layer!r}: kv_cache_dtype={cfg.kv_cache_dtype} is read only "
            f"by the kvarn MLA backend, but --attention-backend {name} was requested. Drop "
            "--attention-backend (kvarn selects its backend itself) or pass CUSTOM."
        )
    vllm_config = get_current_vllm_config_or_none()
    reasons = mla_unserved_reasons(cfg, preset, vllm_config)
    if reasons:
        raise ValueError(
            f"kvarn-vllm cannot serve attention layer {layer!r} (MLA latent cache, "
            f"kv_cache_dtype={cfg.kv_cache_dtype} -> {preset.name}): {'; '.join(reasons)}. "
            + MLA_FALLBACK
        )
    latent, rope = split_head_size(cfg.head_size, _model_kv_lora_rank(vllm_config))
    cls = mla_backend_class(preset.name, latent, rope)
    layout = mla_layout(preset, latent, rope)
    if cls.__name__ in _announced:
        return cls
    _announced.add(cls.__name__)
    logger.info(
        "kvarn: MLA layers use %s (kv_cache_dtype=%s: %s, %g bytes a token against bf16's %d)",
        cls.__name__,
        cfg.kv_cache_dtype,
        preset.name,
        layout.bytes_per_token,
        layout.bf16_bytes_per_token,
    )
    return cls


@functools.cache
def _base_class() -> type:
    import torch
    from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend

    class KvarnMLABackend(MLACommonBackend):
        """MLA over a KVarN latent cache (``[num_blocks, tile_bytes]`` uint8, one record a block)."""

        mla_preset: ClassVar[MLAPreset]
        latent_dim: ClassVar[int]
        rope_dim: ClassVar[int]
        supported_dtypes: ClassVar[list] = [torch.float16, torch.bfloat16]

        @staticmethod
        def get_name() -> str:
            return BACKEND_NAME

        @staticmethod
        def get_impl_cls():
            from kvarn_vllm.mla_impl import KvarnMLAImpl

            return KvarnMLAImpl

        @staticmethod
        def get_builder_cls():
            from kvarn_vllm.mla_impl import KvarnMLAMetadataBuilder

            return KvarnMLAMetadataBuilder

        @classmethod
        def tile_bytes(cls) -> int:
            """Bytes of one record (one block of ``G`` tokens of one layer)."""
            return mla_layout(cls.mla_preset, cls.latent_dim, cls.rope_dim).tile_bytes

        @classmethod
        def get_supported_kernel_block_sizes(cls, kv_cache_spec: Any = None) -> list:
            return [cls.mla_preset.group_size]

        @classmethod
        def get_preferred_block_size(cls, default_block_size: int) -> int:
            return cls.mla_preset.group_size

        @classmethod
        def supports_block_size(cls, block_size: int | None) -> bool:
            return block_size is None or block_size == cls.mla_preset.group_size

        @classmethod
        def get_kv_cache_shape(
            cls,
            num_blocks: int,
            block_size: int,
            num_kv_heads: int,
            head_size: int,
            cache_dtype_str: str = "auto",
        ) -> tuple[int, ...]:
            if block_size != cls.mla_preset.group_size:
                raise ValueError(
                    f"block_size must be the {cls.mla_preset.name} tile size "
                    f"{cls.mla_preset.group_size}, got {block_size}"
                )
            if head_size != cls.latent_dim + cls.rope_dim:
                raise ValueError(
                    f"head_size must be {cls.latent_dim} + {cls.rope_dim} for {cls.__name__}, "
                    f"got {head_size}"
                )
            return (num_blocks, cls.tile_bytes())

        @staticmethod
        def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple:
            # identity; with a layers axis the identity says cross-layer allocation is unsupported
            return (0, 1, 2) if include_num_layers_dimension else (0, 1)

        @classmethod
        def get_supported_head_sizes(cls) -> list[int]:
            return [cls.latent_dim + cls.rope_dim]

        @classmethod
        def supports_kv_cache_dtype(cls, kv_cache_dtype: Any) -> bool:
            try:
                return mla_preset_for(kv_cache_dtype) == cls.mla_preset
            except (ValueError, TypeError):
                return False

        @classmethod
        def supports_compute_capability(cls, capability: Any) -> bool:
            return True

        @classmethod
        def supports_kv_connector(cls) -> bool:
            return False

    KvarnMLABackend.__module__ = __name__
    KvarnMLABackend.__qualname__ = "KvarnMLABackend"
    return KvarnMLABackend


@functools.cache
def mla_backend_class(preset: str, latent_dim: int = 512, rope_dim: int = 64) -> type:
    """The backend class of one MLA preset at one latent shape (created once per process).

    Raises:
        ValueError: for an unknown preset or a shape the format does not store.
    """
    p = get_mla_preset(preset)
    mla_layout(p, latent_dim, rope_dim)  # validates the shape
    name = _class_name(p, latent_dim, rope_dim)
    attrs = {
        "mla_preset": p,
        "latent_dim": latent_dim,
        "rope_dim": rope_dim,
        "__module__": __name__,
        "__qualname__": name,
    }
    cls = type(name, (_base_class(),), attrs)
    globals()[name] = cls
    return cls


@functools.cache
def mla_spec_class() -> type:
    """``KvarnMLASpec``, built on first use (it subclasses vLLM's ``MLAAttentionSpec``)."""
    from dataclasses import dataclass

    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    @dataclass(frozen=True, kw_only=True)
    class KvarnMLASpec(MLAAttentionSpec):
        """An MLA layer over KVarN latent records: ``tile_bytes`` per block of ``G`` tokens."""

        kvarn_mla_preset: str = ""
        latent_dim: int = 512

        @property
        def real_page_size_bytes(self) -> int:
            if not self.kvarn_mla_preset:  # a bare instance built by vLLM's merge()
                return super().real_page_size_bytes
            rope = self.head_size - self.latent_dim
            layout = mla_layout(self.kvarn_mla_preset, self.latent_dim, rope)
            return (self.storage_block_size // layout.group_size) * layout.tile_bytes

        @classmethod
        def merge(cls, specs):
            merged = super().merge(specs)
            kinds = {(s.kvarn_mla_preset, s.latent_dim) for s in specs}
            if len(kinds) != 1:
                raise ValueError(f"one KV cache group mixes KVarN MLA formats {sorted(kinds)}")
            preset, latent = kinds.pop()
            return replace(merged, kvarn_mla_preset=preset, latent_dim=latent)

    KvarnMLASpec.__module__ = __name__
    KvarnMLASpec.__qualname__ = "KvarnMLASpec"
    globals()["KvarnMLASpec"] = KvarnMLASpec
    return KvarnMLASpec


def make_mla_spec(layer: Any, vllm_config: Any) -> Any:
    """``MLAAttention.get_kv_cache_spec`` for a layer on a kvarn MLA backend; else None.

    Raises:
        ValueError: when vLLM's block size is not the preset's tile, naming the layer.
    """
    import torch
    from vllm.v1.kv_cache_interface import KVQuantMode

    found = getattr(layer, "attn_backend", None)
    if not (isinstance(found, type) and issubclass(found, _base_class())):
        return None
    backend: Any = found  # a KvarnMLABackend subclass (its class attributes below)
    preset = backend.mla_preset
    block_size = vllm_config.cache_config.block_size
    if block_size != preset.group_size:
        raise ValueError(
            f"MLA attention layer {layer.layer_name!r} ({layer.kv_cache_dtype} -> "
            f"{preset.name}): block_size must be the tile size {preset.group_size} (one vLLM "
            f"block is one latent record), got {block_size}; drop --block-size or pass "
            f"--block-size {preset.group_size}"
        )
    return mla_spec_class()(
        block_size=block_size,
        num_kv_heads=1,
        head_size=layer.head_size,
        dtype=torch.uint8,
        cache_dtype_str=layer.kv_cache_dtype,
        kv_quant_mode=KVQuantMode.NONE,
        kvarn_mla_preset=preset.name,
        latent_dim=backend.latent_dim,
    )


_NAME = re.compile(r"KvarnMLABackend_l(\d+)_g(\d+)_(\d+)_(\d+)")


def __getattr__(name: str) -> Any:
    # Resolvable by import path (vLLM's resolve_obj_by_qualname, pickling) before first use.
    if name == "KvarnMLABackend":
        return _base_class()
    if name == "KvarnMLASpec":
        return mla_spec_class()
    match = _NAME.fullmatch(name)
    if match:
        bits, group, latent, rope = (int(g) for g in match.groups())
        preset = f"kvarn_mla_l{bits}_g{group}"
        if preset in MLA_PRESETS:
            return mla_backend_class(preset, latent, rope)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
