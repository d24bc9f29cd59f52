"""kvarn-vllm: serve vLLM models from a KVarN-quantized KV cache.

``pip install kvarn-vllm`` next to vLLM 0.26, then ``--kv-cache-dtype kvarn_k4v2_g128``
(or ``LLM(..., kv_cache_dtype="kvarn_k4v2_g128")``). vLLM loads the plugin through the
``vllm.general_plugins`` entry point (:func:`kvarn_vllm.plugin.register`).

Importing this package is cheap: it does not import vLLM, Triton or the kernels and
never initializes CUDA.
"""

from kvarn_vllm.config import KvarnConfig, is_kvarn_dtype, parse_kv_cache_dtype, preset_names
from kvarn_vllm.plugin import register

__version__ = "0.1.0"

__all__ = [
    "KvarnConfig",
    "__version__",
    "is_kvarn_dtype",
    "parse_kv_cache_dtype",
    "preset_names",
    "register",
]
