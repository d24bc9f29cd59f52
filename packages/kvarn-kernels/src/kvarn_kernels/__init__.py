"""kvarn-kernels: Triton kernels for KVarN quantize-on-write and attention over a quantized cache.

Importing this package never initializes CUDA and never imports vLLM.
"""

from kvarn_kernels._compile_cache import compile_cache
from kvarn_kernels._format import FORMAT_VERSION, check_format_version
from kvarn_kernels.attention import (
    AttentionPlan,
    choose_num_splits,
    decode_attention,
    multi_query_attention,
    plan_attention,
)
from kvarn_kernels.attention.launch import VERIFY_AS_DECODE_MAX_QUERY
from kvarn_kernels.cache import (
    allocate_cache,
    allocate_frame_queries,
    allocate_staging,
    cache_shape,
    frame_query_shape,
    staging_bytes,
    staging_rows,
    staging_shape,
)
from kvarn_kernels.dequantize import decode_tiles, dequantize, dequantize_tiles
from kvarn_kernels.mla import (
    allocate_mla_cache,
    dequantize_latent,
    mla_cache_shape,
    mla_decode_attention,
    store_latent,
)
from kvarn_kernels.plan import (
    StorePlan,
    key_window_start,
    plan_draft_device,
    plan_store,
    plan_store_device,
    window_start,
)
from kvarn_kernels.quantize import encode_tiles, quantize_tiles, store_kv
from kvarn_kernels.rotation import rotate, unrotate
from kvarn_kernels.warmup import compiled_variants, warmup

__version__ = "0.1.0"

__all__ = [
    "AttentionPlan",
    "FORMAT_VERSION",
    "StorePlan",
    "VERIFY_AS_DECODE_MAX_QUERY",
    "__version__",
    "allocate_cache",
    "allocate_frame_queries",
    "allocate_staging",
    "cache_shape",
    "check_format_version",
    "choose_num_splits",
    "compile_cache",
    "compiled_variants",
    "decode_attention",
    "decode_tiles",
    "dequantize",
    "dequantize_tiles",
    "encode_tiles",
    "frame_query_shape",
    "key_window_start",
    "multi_query_attention",
    "plan_attention",
    "plan_draft_device",
    "plan_store",
    "plan_store_device",
    "quantize_tiles",
    "rotate",
    "staging_bytes",
    "staging_rows",
    "staging_shape",
    "store_kv",
    "unrotate",
    "warmup",
    "window_start",
    "allocate_mla_cache",
    "dequantize_latent",
    "mla_cache_shape",
    "mla_decode_attention",
    "store_latent",
]
