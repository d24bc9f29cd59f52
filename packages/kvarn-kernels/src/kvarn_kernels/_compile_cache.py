"""Where Triton keeps the kernels it compiles, for a block of compiles (:func:`compile_cache`).

Triton caches each compiled kernel on disk under ``TRITON_CACHE_DIR`` (default
``~/.triton/cache``), keyed by the kernel's source, its compile-time constants, the target and
Triton's version, so a later process that needs the same variant loads it instead of compiling
it again. An engine may point ``TRITON_CACHE_DIR`` elsewhere for its own reasons: vLLM 0.26 sets
it to a folder of its torch.compile cache, one per engine configuration
(``vllm/compilation/compiler_interface.py``), so every new configuration (another KV cache
dtype, ``max_num_seqs``, model) starts with an empty folder and compiles these kernels again.
Compiling them under one folder that stays the same lets every engine on a machine reuse them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["compile_cache", "default_cache_dir"]


def default_cache_dir() -> str:
    """Triton's own default cache folder (``$TRITON_HOME/.triton/cache``, home by default),
    whatever ``TRITON_CACHE_DIR`` says now."""
    import triton  # type: ignore[import-untyped,import-not-found]

    return str(triton.knobs.cache.get_triton_dir("cache"))


@contextlib.contextmanager
def compile_cache(path: str | None = None) -> Iterator[str | None]:
    """Compile under ``path`` (``None``: :func:`default_cache_dir`) inside the block, then put
    ``TRITON_CACHE_DIR`` back as it was.

    Kernels compiled in the block stay in their in-memory caches afterwards, so launches after
    it do not look at the disk again. A folder that cannot be created or written leaves the
    cache where it was (a read-only home must not stop an engine). Yields the folder used, or
    ``None`` when nothing was changed.
    """
    import triton  # type: ignore[import-untyped,import-not-found]

    folder = os.path.abspath(os.path.expanduser(path or default_cache_dir()))
    try:
        os.makedirs(folder, exist_ok=True)
        writable = os.access(folder, os.W_OK | os.X_OK)
    except OSError:
        writable = False
    if not writable:
        yield None
        return
    knobs = triton.knobs.cache
    with knobs.scope():
        knobs.dir = folder
        yield folder
