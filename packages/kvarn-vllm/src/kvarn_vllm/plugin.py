"""The ``vllm.general_plugins`` entry point: ``kvarn = "kvarn_vllm.plugin:register"``.

vLLM calls :func:`register` once in every process it starts (API server, engine core,
GPU workers, the model-inspection subprocess), before it builds the argument parser or
any config. It must be idempotent and cheap: it imports only the vLLM modules the
patches touch, never Triton or the kernels, and never initializes CUDA.
"""

from __future__ import annotations

import logging
import os
import threading

__all__ = ["kernel_cache_dir", "register", "registered"]

logger = logging.getLogger("vllm.kvarn")  # inherits vLLM's handler and level

_lock = threading.Lock()
_done = False
_UNSET = object()
_triton_cache_dir: object = _UNSET


def kernel_cache_dir() -> str | None:
    """Where kvarn's kernels compile: ``TRITON_CACHE_DIR`` as this process found it when the
    plugin first registered, before vLLM pointed it at a folder of its torch.compile cache
    (one per engine configuration); ``None`` when it was unset (Triton's default folder).
    """
    value = _triton_cache_dir
    if value is _UNSET:  # register() has not run in this process: read it now
        value = os.environ.get("TRITON_CACHE_DIR")
    return value if isinstance(value, str) and value else None


def registered() -> bool:
    """True once :func:`register` has completed in this process."""
    return _done


def register() -> None:
    """Make ``--kv-cache-dtype kvarn_*`` work in this process (idempotent).

    Applies the ``process`` entries of :data:`kvarn_vllm.patches.LEDGER` and registers
    the kvarn backend as ``AttentionBackendEnum.CUSTOM`` unless another plugin already
    claimed it.
    """
    global _done, _triton_cache_dir
    if _done:
        return
    with _lock:
        if _done:
            return
        if _triton_cache_dir is _UNSET:
            _triton_cache_dir = os.environ.get("TRITON_CACHE_DIR")
        from kvarn_vllm import patches

        patches.apply_process_patches()
        _register_custom_backend()
        _done = True
        logger.debug("kvarn: registered (patches: %s)", sorted(patches.applied()))


def _register_custom_backend() -> None:
    from kvarn_math.layout import DEFAULT_PRESET
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from kvarn_vllm.backend import backend_class_path

    try:
        current = AttentionBackendEnum.CUSTOM.get_path()
    except ValueError:
        current = None
    if current is None:
        register_backend(AttentionBackendEnum.CUSTOM, backend_class_path(DEFAULT_PRESET))
    elif not current.startswith("kvarn_vllm."):
        logger.warning(
            "kvarn: AttentionBackendEnum.CUSTOM is already registered to %s; kvarn selects "
            "its backend for kvarn_* dtypes without it",
            current,
        )
