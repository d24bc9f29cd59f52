"""The calls into kvarn-kernels, in one place (its README is the contract).

Imported lazily by the metadata builder and the attention implementation, so that
``import kvarn_vllm`` and ``register()`` do not import Triton or touch CUDA.
"""

from __future__ import annotations

import functools
from types import ModuleType

__all__ = [
    "allocate_frame_queries",
    "allocate_staging",
    "compile_cache",
    "decode_attention",
    "dequantize",
    "kernels_module",
    "key_window_start",
    "multi_query_attention",
    "plan_attention",
    "plan_draft_device",
    "plan_store",
    "plan_store_device",
    "rotate",
    "staging_bytes",
    "staging_rows",
    "store_kv",
    "unrotate",
    "verify_as_decode_max_query",
    "warmup",
    "window_start",
]

_REQUIRED = (
    "plan_draft_device",
    "plan_store",
    "plan_store_device",
    "store_kv",
    "decode_attention",
    "multi_query_attention",
    "plan_attention",
    "allocate_staging",
    "allocate_frame_queries",
    "staging_bytes",
    "dequantize",
    "rotate",
    "unrotate",
    "staging_rows",
    "warmup",
    "compile_cache",
    "window_start",
    "key_window_start",
    "VERIFY_AS_DECODE_MAX_QUERY",
)


@functools.cache
def kernels_module() -> ModuleType:
    """``kvarn_kernels``, checked for every entry point kvarn-vllm calls.

    Raises:
        ImportError: naming what is missing, when kvarn-kernels is absent or too old.
    """
    try:
        import kvarn_kernels
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "kvarn-vllm needs kvarn-kernels (pip install kvarn-kernels); "
            f"importing it failed: {exc}"
        ) from exc
    missing = [name for name in _REQUIRED if not hasattr(kvarn_kernels, name)]
    if missing:
        raise ImportError(
            f"kvarn-kernels {getattr(kvarn_kernels, '__version__', '?')} lacks {missing}, "
            "which kvarn-vllm calls; install a matching kvarn-kernels"
        )
    return kvarn_kernels


def plan_store(*args, **kwargs):
    """``kvarn_kernels.plan_store`` (host, once per step)."""
    return kernels_module().plan_store(*args, **kwargs)


def plan_draft_device(*args, **kwargs):
    """``kvarn_kernels.plan_draft_device`` (a drafter step's plan: one launch, no sync)."""
    return kernels_module().plan_draft_device(*args, **kwargs)


def plan_store_device(*args, **kwargs):
    """``kvarn_kernels.plan_store_device`` (device, once per step under speculation)."""
    return kernels_module().plan_store_device(*args, **kwargs)


def store_kv(*args, **kwargs):
    """``kvarn_kernels.store_kv`` (per layer)."""
    return kernels_module().store_kv(*args, **kwargs)


def decode_attention(*args, **kwargs):
    """``kvarn_kernels.decode_attention`` (per layer)."""
    return kernels_module().decode_attention(*args, **kwargs)


def multi_query_attention(*args, **kwargs):
    """``kvarn_kernels.multi_query_attention`` (per layer)."""
    return kernels_module().multi_query_attention(*args, **kwargs)


def plan_attention(*args, **kwargs):
    """``kvarn_kernels.plan_attention`` (once per step and kind of row; ``run`` per layer)."""
    return kernels_module().plan_attention(*args, **kwargs)


def allocate_staging(*args, **kwargs):
    """``kvarn_kernels.allocate_staging`` (once per layer, at model build)."""
    return kernels_module().allocate_staging(*args, **kwargs)


def allocate_frame_queries(*args, **kwargs):
    """``kvarn_kernels.allocate_frame_queries`` (once per layer, at model build, with
    speculative decoding and ``auto`` key frames)."""
    return kernels_module().allocate_frame_queries(*args, **kwargs)


def staging_bytes(*args, **kwargs):
    """``kvarn_kernels.staging_bytes``."""
    return kernels_module().staging_bytes(*args, **kwargs)


def dequantize(*args, **kwargs):
    """``kvarn_kernels.dequantize`` (dense-context prefill)."""
    return kernels_module().dequantize(*args, **kwargs)


def rotate(*args, **kwargs):
    """``kvarn_kernels.rotate``."""
    return kernels_module().rotate(*args, **kwargs)


def unrotate(*args, **kwargs):
    """``kvarn_kernels.unrotate``."""
    return kernels_module().unrotate(*args, **kwargs)


def staging_rows(*args, **kwargs):
    """``kvarn_kernels.staging_rows`` (position -> staging row, sink rows and ring)."""
    return kernels_module().staging_rows(*args, **kwargs)


def decode_rows(*args, **kwargs):
    """``kvarn_kernels.attention.launch.decode_rows``: a block's query tokens as decode rows."""
    kernels_module()
    from kvarn_kernels.attention import launch

    return launch.decode_rows(*args, **kwargs)


def row_tables(*args, **kwargs):
    """``kvarn_kernels.attention.launch.row_tables``: decode rows' per-sequence tables (a
    ``RowTables`` named tuple)."""
    kernels_module()
    from kvarn_kernels.attention import launch

    return launch.row_tables(*args, **kwargs)


def verify_as_decode_max_query() -> int:
    """``kvarn_kernels.VERIFY_AS_DECODE_MAX_QUERY``: batch-invariant multi-query calls of at
    most this many query tokens per row may run as decode rows."""
    return int(kernels_module().VERIFY_AS_DECODE_MAX_QUERY)


def compile_cache(path=None):
    """``kvarn_kernels.compile_cache``: compile under one folder that stays the same across
    engine configurations (a context manager)."""
    return kernels_module().compile_cache(path)


def warmup(*args, **kwargs):
    """``kvarn_kernels.warmup`` (once per process and shape, before serving)."""
    return kernels_module().warmup(*args, **kwargs)


def window_start(*args, **kwargs):
    """``kvarn_kernels.window_start`` (where a step's exact reads begin; device, no sync)."""
    return kernels_module().window_start(*args, **kwargs)


def key_window_start(*args, **kwargs):
    """``kvarn_kernels.key_window_start`` (where a step's exact keys begin with values-only
    windows; device, no sync)."""
    return kernels_module().key_window_start(*args, **kwargs)
