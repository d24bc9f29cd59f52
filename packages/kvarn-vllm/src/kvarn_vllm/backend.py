"""The attention backend classes, one per preset.

vLLM 0.26 asks a backend class, with no layer or config at hand, for its kernel block
sizes (``get_supported_kernel_block_sizes``), its preferred block size and its cache
shape (``get_kv_cache_shape``, whose ``cache_dtype_str`` is ``"auto"`` for a dtype vLLM
does not know). Each preset therefore gets its own small subclass that knows its tile:
``kvarn_k4v2_g128`` is served by ``KvarnAttentionBackend_k4v2_g128`` and so on.

Every subclass reports ``get_name() == "CUSTOM"``: ``Attention.__init__`` looks the name
up in ``AttentionBackendEnum``, and ``CUSTOM`` is the member vLLM reserves for
out-of-tree backends (it pickles by value, so spawned workers are safe).
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

from kvarn_math.layout import PRESETS, Preset, get_preset, tile_layout

from kvarn_vllm.config import SERVED_HEAD_DIMS, parse_kv_cache_dtype

__all__ = ["BACKEND_NAME", "backend_class", "backend_class_path", "unsupported_reasons"]

BACKEND_NAME = "CUSTOM"


def _class_name(preset: Preset) -> str:
    return "KvarnAttentionBackend_" + preset.name.removeprefix("kvarn_")


def backend_class_path(kv_cache_dtype: str) -> str:
    """Import path of the backend class serving ``kv_cache_dtype``."""
    preset = parse_kv_cache_dtype(kv_cache_dtype).preset
    return f"{__name__}.{_class_name(preset)}"


def unsupported_reasons(cfg: Any, preset: Preset, non_causal_ok: bool = False) -> list[str]:
    """Why the dense backend cannot serve a layer, from vLLM's ``AttentionSelectorConfig``.

    Empty when it can. Each reason says what was found; the caller adds the layer and
    what to do. ``non_causal_ok``: the layer is a DFlash drafter's, whose non-causal blocks
    kvarn attends (``multi_query_attention(causal=False)``).
    """
    import torch

    reasons = []
    if cfg.use_mla:
        reasons.append(
            "it is an MLA (latent) attention layer; kvarn-vllm serves dense/GQA layers only so far"
        )
    if cfg.use_sparse:
        reasons.append("it uses sparse attention")
    if cfg.attn_type != "decoder":
        reasons.append(
            f"its attention type is {cfg.attn_type!r}; only decoder self-attention is served"
        )
    if cfg.head_size not in SERVED_HEAD_DIMS:
        reasons.append(f"its head_dim is {cfg.head_size}; supported: {SERVED_HEAD_DIMS}")
    if cfg.dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"the model dtype is {cfg.dtype}; supported: float16, bfloat16")
    if cfg.has_sink:
        reasons.append("it has attention sinks")
    if cfg.use_mm_prefix:
        reasons.append("it uses bidirectional multimodal-prefix attention")
    if cfg.use_non_causal and not non_causal_ok:
        from kvarn_vllm.speculative import SPEC_METHODS

        served = ", ".join(m for methods in SPEC_METHODS.values() for m in methods)
        reasons.append(
            "it is non-causal (kvarn-vllm attends non-causal blocks only in a DFlash "
            f"drafter; it serves the speculative methods {served})"
        )
    if cfg.use_per_head_quant_scales:
        reasons.append("the checkpoint carries per-head KV quantization scales")
    if cfg.use_pcp:
        reasons.append("prefill context parallelism is enabled")
    # Fields vLLM 0.33 added to the selector's config (absent on 0.26).
    if getattr(cfg, "use_dcp", False):
        reasons.append("decode context parallelism is enabled")
    if getattr(cfg, "use_rswa", False):
        reasons.append("it uses the model's rswa window")
    if getattr(cfg, "use_adaptive_verification", False):
        reasons.append(
            "adaptive verification is on (it trims drafts on the device; kvarn plans "
            "from the host's query lengths)"
        )
    if cfg.block_size is not None and cfg.block_size != preset.group_size:
        reasons.append(
            f"--block-size {cfg.block_size} conflicts with {preset.name}, whose tile is "
            f"{preset.group_size} tokens (one vLLM block is one tile); drop --block-size "
            f"(it is set automatically) or pass --block-size {preset.group_size}"
        )
    return reasons


@functools.cache
def _base_class() -> type:
    import torch
    from vllm.v1.attention.backend import AttentionBackend, AttentionType

    class KvarnAttentionBackend(AttentionBackend):
        """Dense/GQA attention over a KVarN cache (``[num_blocks, num_kv_heads, tile_bytes]``)."""

        preset: ClassVar[Preset]
        # The store (quantize-on-write) runs inside forward: it needs the step's plan,
        # which vLLM 0.26 hands to forward but not to do_kv_cache_update.
        forward_includes_kv_cache_update: bool = True
        supported_dtypes: ClassVar[list] = [torch.float16, torch.bfloat16]

        @staticmethod
        def get_name() -> str:
            return BACKEND_NAME

        @staticmethod
        def get_impl_cls():
            from kvarn_vllm.impl import KvarnAttentionImpl

            return KvarnAttentionImpl

        @staticmethod
        def get_builder_cls():
            from kvarn_vllm.builder import KvarnMetadataBuilder

            return KvarnMetadataBuilder

        @classmethod
        def get_supported_kernel_block_sizes(cls, kv_cache_spec: Any = None) -> list:
            # kv_cache_spec: passed from vLLM 0.31 on; one kernel block is one tile anyway
            return [cls.preset.group_size]

        @classmethod
        def customize_spec(cls, spec: Any) -> Any:
            """The page of one block from the tile layout (vLLM 0.28+ calls this, and 0.33's
            adapter relies on it; 0.26 has the ``kv-cache-spec`` ledger entry instead):
            :func:`kvarn_vllm.spec.packed_spec`."""
            from kvarn_vllm.spec import packed_spec

            return packed_spec(parse_kv_cache_dtype(cls.preset.name), spec)

        @classmethod
        def supported_kv_cache_layouts(cls) -> tuple:
            # Layer-outermost layouts: each layer's records are one [blocks, heads, tile]
            # array, as the kernels read them (vLLM 0.29+).
            from vllm.v1.kv_cache_layout import (  # type: ignore[import-not-found]
                KVCacheLayout,  # vLLM 0.29+ only
            )

            return (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC)

        @classmethod
        def supports_device_cpu_query_lens_mismatch(cls) -> bool:
            # kvarn plans each step's stores from the host's query lengths (vLLM 0.33)
            return False

        @classmethod
        def get_preferred_block_size(cls, default_block_size: int) -> int:
            return cls.preset.group_size

        @classmethod
        def get_kv_cache_shape(
            cls,
            num_blocks: int,
            block_size: int,
            num_kv_heads: int,
            head_size: int,
            cache_dtype_str: str = "auto",
        ) -> tuple[int, ...]:
            if block_size != cls.preset.group_size:
                raise ValueError(
                    f"block_size must be the {cls.preset.name} tile size "
                    f"{cls.preset.group_size}, got {block_size}"
                )
            tile_bytes = tile_layout(cls.preset, head_size).tile_bytes
            return (num_blocks, num_kv_heads, tile_bytes)

        @classmethod
        def get_supported_head_sizes(cls) -> list[int]:
            return list(SERVED_HEAD_DIMS)

        @classmethod
        def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
            return kv_cache_dtype == cls.preset.name

        @classmethod
        def supports_sliding_window(cls) -> bool:
            return True

        @classmethod
        def supports_attn_type(cls, attn_type: str) -> bool:
            return attn_type == AttentionType.DECODER

        @classmethod
        def supports_kv_connector(cls) -> bool:
            # A connector would move raw pages between engines; untested with tile records
            # and the per-request staging, so refuse rather than corrupt.
            return False

    KvarnAttentionBackend.__module__ = __name__
    KvarnAttentionBackend.__qualname__ = "KvarnAttentionBackend"
    return KvarnAttentionBackend


@functools.cache
def backend_class(kv_cache_dtype: str | Preset) -> type:
    """The backend class of one preset (created once per process)."""
    preset = (
        get_preset(kv_cache_dtype)
        if isinstance(kv_cache_dtype, Preset)
        else (parse_kv_cache_dtype(kv_cache_dtype).preset)
    )
    name = _class_name(preset)
    cls = type(
        name, (_base_class(),), {"preset": preset, "__module__": __name__, "__qualname__": name}
    )
    globals()[name] = cls
    return cls


def __getattr__(name: str) -> Any:
    # Resolvable by import path (vLLM's resolve_obj_by_qualname, pickling) before use.
    if name == "KvarnAttentionBackend":
        return _base_class()
    for preset in PRESETS.values():
        if name == _class_name(preset):
            return backend_class(preset)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
