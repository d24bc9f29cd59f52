"""KV cache specs whose page size comes from kvarn-math's tile layout.

One vLLM block is one tile of ``G`` tokens of one sequence for every KV head of a layer:
``num_kv_heads`` records of ``tile_bytes`` each (see :mod:`kvarn_math.layout`). The spec
declares ``dtype=torch.uint8`` and that page size; the backend's ``get_kv_cache_shape``
gives the matching ``[num_blocks, num_kv_heads, tile_bytes]`` view.

The classes are defined lazily (they subclass vLLM's spec dataclasses, and importing
vLLM is not cheap); :func:`spec_classes` returns them.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

from kvarn_math.layout import tile_layout

from kvarn_vllm.config import KvarnConfig

__all__ = ["kvarn_page_bytes", "make_layer_spec", "packed_spec", "spec_classes"]


def kvarn_page_bytes(
    config: KvarnConfig, block_size: int, num_kv_heads: int, head_size: int
) -> int:
    """Bytes of one vLLM block of ``block_size`` tokens for one layer.

    Raises:
        ValueError: if ``block_size`` is not a whole number of tiles.
    """
    group = config.preset.group_size
    if block_size < 1 or block_size % group:
        raise ValueError(
            f"block_size must be a positive multiple of the {config.name} tile ({group} "
            f"tokens), got {block_size}"
        )
    layout = tile_layout(config.preset, head_size)
    return (block_size // group) * layout.page_bytes(num_kv_heads)


@functools.cache
def spec_classes() -> tuple[type, type]:
    """``(KvarnFullAttentionSpec, KvarnSlidingWindowSpec)``, built on first use."""
    from dataclasses import dataclass

    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    def _page(spec: Any) -> int:
        layout = tile_layout(spec.kvarn_preset, spec.head_size)
        tiles = spec.block_size // layout.group_size
        return tiles * spec.num_kv_heads * layout.tile_bytes

    def _states(spec: Any) -> None:
        # vLLM 0.28+ sizes pages and views from (num_heads, num_states, state bytes): one
        # state of G tokens per head, one tile record each (0.26 reads real_page_size_bytes).
        if spec.kvarn_preset and getattr(spec, "state_content_bytes", False) is None:
            layout = tile_layout(spec.kvarn_preset, spec.head_size)
            object.__setattr__(spec, "state_content_bytes", layout.tile_bytes)
            object.__setattr__(spec, "tokens_per_state", layout.group_size)

    @dataclass(frozen=True, kw_only=True)
    class KvarnFullAttentionSpec(FullAttentionSpec):
        """Full attention over a KVarN cache: ``num_kv_heads * tile_bytes`` per tile."""

        kvarn_preset: str = ""

        def __post_init__(self) -> None:
            super().__post_init__()
            _states(self)

        @property
        def real_page_size_bytes(self) -> int:
            return _page(self)

        @classmethod
        def merge(cls, specs):
            merged = super().merge(specs)
            presets = {s.kvarn_preset for s in specs}
            if len(presets) != 1:
                raise ValueError(f"one KV cache group mixes KVarN presets {sorted(presets)}")
            return replace(merged, kvarn_preset=specs[0].kvarn_preset)

    @dataclass(frozen=True, kw_only=True)
    class KvarnSlidingWindowSpec(SlidingWindowSpec):
        """Sliding-window attention over a KVarN cache (same page as full attention)."""

        kvarn_preset: str = ""

        def __post_init__(self) -> None:
            super().__post_init__()
            _states(self)

        @property
        def real_page_size_bytes(self) -> int:
            return _page(self)

    # Pickled across processes (engine core <- workers): give them importable names.
    for cls in (KvarnFullAttentionSpec, KvarnSlidingWindowSpec):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
        globals()[cls.__name__] = cls
    return KvarnFullAttentionSpec, KvarnSlidingWindowSpec


def __getattr__(name: str) -> Any:
    # Unpickling in a fresh process looks the classes up by name before anything built them.
    if name in ("KvarnFullAttentionSpec", "KvarnSlidingWindowSpec"):
        full, sliding = spec_classes()
        return full if name == "KvarnFullAttentionSpec" else sliding
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_layer_spec(
    config: KvarnConfig,
    *,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    head_size_v: int,
    sliding_window: int | None,
    hybrid: bool = False,
) -> Any:
    """The spec of one decoder attention layer served from a KVarN cache.

    ``hybrid``: the model has recurrent layers too; its blocks hold whole tiles, as many as
    :mod:`kvarn_vllm.hybrid` aligned them to (one kernel block is still one tile).

    Raises:
        ValueError: for a head size the format does not serve, K and V head sizes that
            differ, or a ``block_size`` other than the preset's tile (a multiple of it when
            ``hybrid``).
    """
    import torch

    config.check_head_dim(head_size)
    if head_size_v != head_size:
        raise ValueError(
            f"{config.name} stores K and V tiles of one head_dim; got head_size {head_size} "
            f"and head_size_v {head_size_v}"
        )
    if hybrid:
        kvarn_page_bytes(config, block_size, num_kv_heads, head_size)  # whole tiles only
    elif block_size != config.block_size:
        raise ValueError(
            f"block_size must equal the {config.name} tile size {config.block_size} "
            f"(one vLLM block is one tile), got {block_size}"
        )
    full_cls, sliding_cls = spec_classes()
    common = dict(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        head_size_v=head_size_v,
        dtype=torch.uint8,
        kvarn_preset=config.name,
    )
    if sliding_window is not None:
        return sliding_cls(sliding_window=sliding_window, **common)
    return full_cls(**common)


def packed_spec(config: KvarnConfig, spec: Any) -> Any:
    """vLLM 0.28+'s ``AttentionBackend.customize_spec`` for a kvarn layer.

    ``spec`` is the ``FullAttentionSpec`` / ``SlidingWindowSpec`` vLLM built from the layer.
    A block of ``k * G`` tokens becomes ``KvarnFullAttentionSpec`` / ``KvarnSlidingWindowSpec``
    holding ``k`` states of ``G`` tokens per KV head (``tokens_per_state=G``), each a
    ``tile_bytes`` record: vLLM then views a layer's cache as ``[num_blocks, num_kv_heads, k,
    tile_bytes]`` uint8. vLLM also sizes probe specs of fewer tokens than a tile (one token,
    for sliding-window block sizes and hybrid alignment); those keep their class and get the
    record's bytes per token, rounded up.

    Raises:
        ValueError: for a head size the format does not serve, or K and V head sizes that
            differ.
    """
    import dataclasses

    import torch

    config.check_head_dim(spec.head_size)
    if spec.head_size_v != spec.head_size:
        raise ValueError(
            f"{config.name} stores K and V tiles of one head_dim; got head_size "
            f"{spec.head_size} and head_size_v {spec.head_size_v}"
        )
    layout = tile_layout(config.preset, spec.head_size)
    group = config.preset.group_size
    if spec.block_size % group:
        per_token = -(-layout.tile_bytes // group)
        return dataclasses.replace(
            spec, dtype=torch.uint8, state_content_bytes=per_token, tokens_per_state=1
        )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    full_cls, sliding_cls = spec_classes()
    if isinstance(spec, SlidingWindowSpec):
        target = sliding_cls
    elif isinstance(spec, FullAttentionSpec):
        target = full_cls
    else:
        raise ValueError(
            f"{config.name} serves full and sliding-window attention, got {type(spec).__name__}"
        )
    kwargs = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}
    kwargs.update(
        dtype=torch.uint8,
        state_content_bytes=layout.tile_bytes,
        tokens_per_state=group,
        kvarn_preset=config.name,
    )
    return target(**kwargs)
