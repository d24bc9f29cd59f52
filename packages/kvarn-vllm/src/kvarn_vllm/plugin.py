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
from importlib import metadata

__all__ = ["kernel_cache_dir", "register", "registered"]

logger = logging.getLogger("vllm.kvarn")  # inherits vLLM's handler and level

_lock = threading.Lock()
_done = False
_attempted = False
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
    """True once :func:`register` has made ``kvarn_*`` cache dtypes work in this process."""
    return _done


def register() -> None:
    """Make ``--kv-cache-dtype kvarn_*`` work in this process (idempotent; never raises).

    On a supported vLLM release (:mod:`kvarn_vllm.releases`) it applies that release's
    adapter: its public registrations and the ``process`` entries of
    :data:`kvarn_vllm.patches.LEDGER` it needs, and registers the kvarn backend as
    ``AttentionBackendEnum.CUSTOM`` unless another plugin already claimed it.

    On any other release it logs one warning and changes nothing, so vLLM starts and serves
    every other cache dtype; asking for a ``kvarn_*`` one then fails in vLLM's own
    validation of ``kv_cache_dtype``, after that warning. vLLM calls its plugins without
    catching their errors (a raising plugin stops every vLLM process), so an unexpected
    error here is logged with its traceback and swallowed.
    """
    global _done, _attempted, _triton_cache_dir
    if _attempted:
        return
    with _lock:
        if _attempted:
            return
        _attempted = True  # one attempt per process, whatever it ends in
        if _triton_cache_dir is _UNSET:
            _triton_cache_dir = os.environ.get("TRITON_CACHE_DIR")
        try:
            from kvarn_vllm import releases

            adapter = releases.current()
            if adapter is None:
                logger.warning("%s", releases.unsupported_message())
                return
            adapter.register_process()
            _register_custom_backend()
        except Exception:
            logger.exception(
                "kvarn: registering kvarn-vllm %s failed on vLLM %s; vLLM runs without it "
                "(every other kv_cache_dtype works; kvarn_* ones may not). Please report this.",
                _own_version(),
                _vllm_version(),
            )
            return
        _done = True
        logger.debug(
            "kvarn: registered for vLLM %s (%s; patches: %s)",
            _vllm_version(),
            adapter.name,
            sorted(adapter.applied()),
        )


def _own_version() -> str:
    try:
        return metadata.version("kvarn-vllm")
    except metadata.PackageNotFoundError:
        return "(not installed)"


def _vllm_version() -> str:
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return "(not installed)"


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
