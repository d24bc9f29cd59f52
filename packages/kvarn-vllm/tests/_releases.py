"""What a vLLM worker does with a layer's KV cache spec and cache, on each served release.

The forward-path tests build an ``Attention`` layer and a cache themselves; these helpers
do it the way the installed vLLM's worker does, so the same tests run on every release:

* vLLM 0.26: the layer's (patched) ``get_kv_cache_spec``; the cache is allocated in the
  backend's ``get_kv_cache_shape``.
* vLLM 0.29-0.33: the layer's own spec through the backend's ``customize_spec`` (0.32+:
  ``customize_attention_spec``); the cache is a ``[B, H, N, C]`` view that vLLM's
  ``create_kv_cache_views`` cuts from one flat int8 buffer in the resolved layout.
"""

from __future__ import annotations

from typing import Any

import torch
from kvarn_vllm import compat, releases


def needs(entry: str) -> Any:
    """Skip unless the installed release's adapter applies ledger entry ``entry``."""
    import pytest

    adapter = releases.current()
    return pytest.mark.skipif(
        adapter is None or entry not in adapter.patches,
        reason=f"vLLM {releases.vllm_version()} does without the {entry!r} ledger entry",
    )


def worker_spec(layer: Any, vllm_config: Any) -> Any:
    """The layer's KV cache spec as the worker hands it to the planner and the builder."""
    spec = layer.get_kv_cache_spec(vllm_config)
    if "kv-cache-spec" in releases.check_supported().patches:
        return spec
    try:  # vLLM 0.32+: one helper
        from vllm.v1.worker.utils import customize_attention_spec
    except ImportError:  # 0.29-0.31: the worker calls the backend itself
        return layer.attn_backend.customize_spec(spec)
    return customize_attention_spec(layer.attn_backend, spec)


def layer_cache(backend: Any, spec: Any, num_blocks: int) -> torch.Tensor:
    """A zeroed cache of ``num_blocks`` blocks for one layer, as vLLM binds it to the layer
    (before kvarn's :func:`kvarn_vllm.compat.cache_records` views it as records)."""
    if hasattr(backend, "get_kv_cache_shape") and not hasattr(spec, "state_content_bytes"):
        shape = backend.get_kv_cache_shape(
            num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size
        )
        return torch.zeros(shape, dtype=spec.dtype)
    from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views

    layout = backend.supported_kv_cache_layouts()[0]
    page = spec.page_size_bytes
    raw = torch.zeros(page * num_blocks, dtype=torch.int8)
    tensor = KVCacheTensor(
        size=raw.numel(), layers=["layer"], layer_stride=page * num_blocks, block_stride=page
    )
    (view,) = create_kv_cache_views(raw, spec, num_blocks, layout, tensor)
    return view


def records(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, num_kv_heads, tile_bytes]``: what kvarn's kernels read."""
    return compat.cache_records(kv_cache)
