"""Hybrid models (Mamba-2 or gated-delta-net layers beside full attention) over a KVarN cache.

Only the attention layers get a KVarN cache; the recurrent layers keep vLLM's own state
specs and backends. What needs care is the page arithmetic.

vLLM keeps one block pool for every KV cache group of a model: a block id names one page of
the same size in one layer of each group, so an attention block of one layer must take as
many bytes as one recurrent state of one layer (``Platform._align_hybrid_block_size`` makes
them equal, and pads the state page up to the attention page). vLLM derives the attention
block from bytes per token of the dtype (bf16: ``2 * num_kv_heads * head_dim * 2``); a KVarN
page holds whole tiles of ``G`` tokens whose record is about 4.8x smaller, so this module
computes the block from the tile record instead:

    unit      = lcm(G, kernel alignment, mamba chunk where states are kept per block)
    unit_page = unit / G * num_kv_heads * tile_bytes
    block     = unit * ceil(mamba_page / unit_page)                  (tokens)
    page      = block / G * num_kv_heads * tile_bytes = padded mamba page (bytes)

A block therefore takes about the bytes of bf16's block (both are one recurrent state,
rounded up to their alignment) and holds about 4.8x its tokens. That is not a choice: a
block smaller than one recurrent state cannot exist in vLLM's pool. What follows from it:

* memory: a request of ``T`` tokens takes ``ceil(T / block)`` attention blocks per attention
  group, never more than under bf16 (the blocks weigh the same, kvarn's hold more), plus its
  recurrent-state blocks, the same under both. Requests shorter than bf16's block gain
  nothing; long ones approach the bytes ratio on their attention part.
* prefix caching: hits land on block boundaries (the recurrent state exists only there),
  so they are about 4.8x coarser.

The functions here are the same for vLLM 0.26 (reached through the ledger entry
``hybrid-block-size`` in :mod:`kvarn_vllm.patches`) and 0.33, whose alignment calls the
backend's ``customize_spec`` on a one-token spec: a tile-based page has no whole number of
bytes per token (``kvarn_k4v2_g128`` at head_dim 128: 106.125), so 0.33 needs the same hook.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from kvarn_math.layout import tile_layout

from kvarn_vllm.config import is_kvarn_dtype, parse_kv_cache_dtype

__all__ = [
    "HybridBlock",
    "align_hybrid_block_size",
    "check_hybrid_drafter",
    "hybrid_page_mismatch",
    "mamba_page_bytes",
    "plan_hybrid_block",
    "tile_page_bytes",
]

logger = logging.getLogger("vllm.kvarn")


@dataclass(frozen=True)
class HybridBlock:
    """The attention block of a hybrid model and the pages it must match.

    Attributes:
        block_size: tokens per attention block (a whole number of tiles).
        tile_tokens: ``G``, tokens per tile.
        attention_page_bytes: one block of one attention layer; the page every group of the
            pool uses, recurrent states padded up to it.
        mamba_page_bytes: one recurrent state of one layer, before padding.
    """

    block_size: int
    tile_tokens: int
    attention_page_bytes: int
    mamba_page_bytes: int

    @property
    def tiles_per_block(self) -> int:
        """Tiles (kernel blocks of ``G`` tokens) per attention block."""
        return self.block_size // self.tile_tokens

    @property
    def mamba_padding_bytes(self) -> int:
        """Bytes each recurrent-state page is padded by."""
        return self.attention_page_bytes - self.mamba_page_bytes


def tile_page_bytes(kv_cache_dtype: str, num_kv_heads: int, head_size: int) -> int:
    """Bytes of one tile (``G`` tokens) of one attention layer: ``num_kv_heads * tile_bytes``.

    Raises:
        ValueError: for an unknown preset, a head size the format does not serve or
            ``num_kv_heads < 1``.
    """
    if num_kv_heads < 1:
        raise ValueError(f"num_kv_heads must be >= 1, got {num_kv_heads}")
    config = parse_kv_cache_dtype(kv_cache_dtype)
    config.check_head_dim(head_size)
    return tile_layout(config.preset, head_size).page_bytes(num_kv_heads)


def plan_hybrid_block(
    *,
    tile_tokens: int,
    tile_page: int,
    mamba_page: int,
    alignment: int = 1,
    chunk_size: int | None = None,
    min_block_size: int = 0,
) -> HybridBlock:
    """The smallest attention block whose page covers one recurrent state.

    Args:
        tile_tokens: ``G``.
        tile_page: bytes of one tile of one layer (:func:`tile_page_bytes`).
        mamba_page: bytes of one recurrent state of one layer (:func:`mamba_page_bytes`).
        alignment: tokens the block must be a multiple of besides ``G`` (kernel blocks,
            vLLM's current block size, prefill checkpoints).
        chunk_size: in vLLM's ``mamba_cache_mode="all"``, the Mamba chunk the block must be
            a multiple of (states are kept at every block boundary); else None.
        min_block_size: the block is never smaller than this (vLLM keeps a larger block
            size it already chose).

    Raises:
        ValueError: for a non-positive size.
    """
    for name, value in (
        ("tile_tokens", tile_tokens),
        ("tile_page", tile_page),
        ("mamba_page", mamba_page),
        ("alignment", alignment),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    unit = math.lcm(tile_tokens, alignment, chunk_size or 1)
    unit_page = unit // tile_tokens * tile_page
    block = unit * max(-(-mamba_page // unit_page), -(-min_block_size // unit), 1)
    return HybridBlock(
        block_size=block,
        tile_tokens=tile_tokens,
        attention_page_bytes=block // tile_tokens * tile_page,
        mamba_page_bytes=mamba_page,
    )


def mamba_page_bytes(vllm_config: Any) -> int:
    """Bytes of the largest recurrent state of one layer of the configured model (0 if none).

    Read from the model class as vLLM's own alignment reads it:
    ``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config`` (every
    release), or ``get_mamba_specs_from_config`` where a model has several state layouts
    (vLLM 0.33).
    """
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.kv_cache_interface import MambaSpec

    model_config = vllm_config.model_config
    model_cls, _ = ModelRegistry.resolve_model_cls(
        model_config.architecture, model_config=model_config
    )
    if hasattr(model_cls, "get_mamba_specs_from_config"):
        specs = model_cls.get_mamba_specs_from_config(vllm_config)
        return max((spec.page_size_bytes for spec in specs), default=0)
    return MambaSpec(
        # classmethods of vLLM's Mamba models (IsHybrid), absent from the ModelRegistry type
        shapes=model_cls.get_mamba_state_shape_from_config(vllm_config),  # type: ignore[attr-defined]
        dtypes=model_cls.get_mamba_state_dtype_from_config(vllm_config),  # type: ignore[attr-defined]
        block_size=-1,
    ).page_size_bytes


def _min_kernel_block(backend_cls: Any) -> int:
    from vllm.v1.attention.backend import MultipleOf

    sizes = backend_cls.get_supported_kernel_block_sizes()
    return min(s.base if isinstance(s, MultipleOf) else s for s in sizes)


def _checkpoint_alignment(vllm_config: Any) -> int:
    """Tokens a block must be a multiple of for Mamba's prefill checkpoints in the ``align``
    cache mode: vLLM 0.33 declares them per layer; 0.26 has none (1)."""
    try:
        from vllm.model_executor.layers.mamba.abstract import (  # type: ignore[attr-defined]
            get_mamba_prefill_checkpoint_alignment,  # vLLM 0.33 only
        )
    except ImportError:
        return 1
    return get_mamba_prefill_checkpoint_alignment(vllm_config) or 1


def check_hybrid_drafter(vllm_config: Any) -> None:
    """Refuses, at start-up, a hybrid model's EAGLE/MTP drafter that vLLM would run on its V1
    model runner, naming the switch.

    kvarn drafts EAGLE, EAGLE-3, MTP and DFlash on vLLM's V2 model runner only (the draft
    steps send their tokens to staging and commit nothing; :mod:`kvarn_vllm.speculative`).
    vLLM 0.26 runs hybrid models on V1 unless ``VLLM_USE_V2_MODEL_RUNNER=1``, and logs no
    reason for it; V2 keeps the recurrent states of hybrids, drafts included
    (``model_states/mamba_hybrid.py``). The drafter's attention layers take the target's
    kvarn spec and block (same KV heads and head_dim: Qwen3-Next's MTP layer is one of its
    full-attention layers), so their pages match the aligned page.

    Raises:
        ValueError: for a V2-only method on the V1 runner, naming the method, the runner
            and ``VLLM_USE_V2_MODEL_RUNNER=1`` (or the alternatives).
    """
    spec_cfg = getattr(vllm_config, "speculative_config", None)
    if spec_cfg is None:
        return
    from kvarn_vllm.speculative import SPEC_METHODS

    method = getattr(spec_cfg, "method", None)
    if method not in SPEC_METHODS["v2"] or getattr(vllm_config, "use_v2_model_runner", True):
        return
    model = vllm_config.model_config.model
    raise ValueError(
        f"{vllm_config.cache_config.cache_dtype} on hybrid model {model!r} with speculative "
        f"method {method!r}: kvarn-vllm drafts {method!r} on vLLM's V2 model runner, and "
        "vLLM runs hybrid (Mamba / linear-attention) models on its V1 runner unless told "
        "otherwise. Set VLLM_USE_V2_MODEL_RUNNER=1 (V2 keeps the recurrent states of hybrids, "
        "drafts included), or serve without speculative decoding, or use kv_cache_dtype "
        "auto/fp8 for speculative decoding on V1"
    )


def align_hybrid_block_size(
    vllm_config: Any, backend_cls: Any, backends: list[Any] | None = None
) -> HybridBlock | None:
    """vLLM's hybrid block alignment, computed from the KVarN tile; None for other dtypes.

    Sets ``cache_config.block_size`` (raised to the block), ``mamba_block_size`` (in the
    ``align`` and ``all`` cache modes, as vLLM does) and ``mamba_page_size_padded`` (the
    attention page), in place, the way ``Platform._align_hybrid_block_size`` does for bf16.

    Args:
        vllm_config: the engine's ``VllmConfig`` (``model_config.is_hybrid``).
        backend_cls: the first non-recurrent layer's backend (kvarn's).
        backends: every non-recurrent backend of the model (vLLM 0.33 aligns the block to
            each one's smallest kernel block); None: ``[backend_cls]``.

    Raises:
        ValueError: when the block exceeds ``max_num_batched_tokens`` in the ``align``
            cache mode (vLLM would stop on an assertion), naming both and the fix; for an
            EAGLE/MTP drafter on vLLM's V1 runner (:func:`check_hybrid_drafter`).
    """
    from vllm.config.vllm import set_current_vllm_config

    cache_config = vllm_config.cache_config
    model_config = vllm_config.model_config
    if not is_kvarn_dtype(cache_config.cache_dtype):
        return None
    config = parse_kv_cache_dtype(cache_config.cache_dtype)
    mamba_page = mamba_page_bytes(vllm_config)
    if mamba_page == 0:
        return None
    check_hybrid_drafter(vllm_config)
    group = config.preset.group_size
    tile_page = tile_page_bytes(
        config.name,
        model_config.get_num_kv_heads(vllm_config.parallel_config),
        model_config.get_head_size(),
    )
    with set_current_vllm_config(vllm_config):
        kernel = max(_min_kernel_block(backend_cls), cache_config.block_size or group)
        others = [_min_kernel_block(b) for b in (backends or [backend_cls])]
    mode = cache_config.mamba_cache_mode
    checkpoints = _checkpoint_alignment(vllm_config) if mode == "align" else 1
    alignment = math.lcm(kernel, checkpoints, *others)
    chunk = None
    if mode == "all":
        user_mamba_block = cache_config.user_specified_mamba_block_size
        chunk = (cache_config.mamba_block_size if user_mamba_block else None) or (
            model_config.get_mamba_chunk_size()
        )
    plan = plan_hybrid_block(
        tile_tokens=group,
        tile_page=tile_page,
        mamba_page=mamba_page,
        alignment=alignment,
        chunk_size=chunk,
        min_block_size=cache_config.block_size or 0,
    )
    if mode == "align" and plan.block_size > vllm_config.scheduler_config.max_num_batched_tokens:
        raise ValueError(
            f"{config.name} on hybrid model {model_config.model!r}: one attention block must "
            f"hold one recurrent state ({mamba_page:,} bytes), which takes "
            f"{plan.block_size} tokens of this cache, but prefix caching in Mamba's 'align' "
            "mode schedules whole blocks and max_num_batched_tokens is "
            f"{vllm_config.scheduler_config.max_num_batched_tokens}. Pass "
            f"--max-num-batched-tokens {plan.block_size} or more, or "
            "--no-enable-prefix-caching"
        )
    if cache_config.block_size != plan.block_size:
        logger.info(
            "kvarn: hybrid model: attention block %d tokens (%d tiles of %d) so that one "
            "attention page (%s bytes) holds one recurrent state (%s bytes, padded by %.2f%%)",
            plan.block_size,
            plan.tiles_per_block,
            group,
            f"{plan.attention_page_bytes:,}",
            f"{mamba_page:,}",
            100 * plan.mamba_padding_bytes / mamba_page,
        )
    cache_config.block_size = plan.block_size
    if mode in ("align", "all"):
        cache_config.mamba_block_size = plan.block_size
    cache_config.mamba_page_size_padded = plan.attention_page_bytes
    return plan


def hybrid_page_mismatch(vllm_config: Any, page_bytes: int) -> str | None:
    """Why an attention layer's KVarN page cannot share a hybrid model's pool, or None.

    vLLM pads every recurrent state to ``cache_config.mamba_page_size_padded``, which
    :func:`align_hybrid_block_size` sets to the KVarN attention page. A page that differs
    (the alignment did not run, or ran from another dtype's bytes) would make vLLM pad the
    attention pages back up to the state's size, giving the saving away, or refuse.
    None for models that are not hybrid.
    """
    model_config = vllm_config.model_config
    if model_config is None or not getattr(model_config, "is_hybrid", False):
        return None
    cache_config = vllm_config.cache_config
    padded = cache_config.mamba_page_size_padded
    if padded == page_bytes:
        return None
    if padded is None:
        return (
            "the model is hybrid (recurrent layers beside attention) but vLLM's hybrid "
            "block alignment (Platform._align_hybrid_block_size, which kvarn-vllm computes "
            f"from the tile) has not run: block_size {cache_config.block_size} gives an "
            f"attention page of {page_bytes:,} bytes and no recurrent-state page to match"
        )
    return (
        f"its page of {page_bytes:,} bytes (block_size {cache_config.block_size}) differs from "
        f"the {padded:,} bytes the recurrent states are padded to; the hybrid block alignment "
        "ran with another page (a platform that overrides Platform._align_hybrid_block_size?)"
    )
