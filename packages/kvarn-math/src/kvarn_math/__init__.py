"""kvarn-math: the NumPy reference of KVarN KV-cache quantization and its cache format.

Modules, in the order of the algorithm: :mod:`~kvarn_math.hadamard` (rotation),
:mod:`~kvarn_math.varnorm` (variance normalization), :mod:`~kvarn_math.rtn` (round to nearest),
:mod:`~kvarn_math.packing` (bit packing), :mod:`~kvarn_math.log8` (one-byte balancing factors),
:mod:`~kvarn_math.layout` (presets and the record format), :mod:`~kvarn_math.ranges`
(what a record holds, record checks), :mod:`~kvarn_math.tile`
(quantize/dequantize tiles), :mod:`~kvarn_math.attention` (reference attention),
:mod:`~kvarn_math.baselines` and :mod:`~kvarn_math.metrics`.
"""

from kvarn_math.attention import (
    QuantizedSequence,
    dense_attention,
    dense_kv,
    key_window_start,
    quantize_sequence,
    recent_window_start,
    reference_attention,
    step_sequence,
)
from kvarn_math.hadamard import fwht, hadamard_matrix, random_signs, rotate, unrotate
from kvarn_math.layout import (
    DEFAULT_PRESET,
    FORMAT_VERSION,
    KEYS_UNROTATED,
    PRESETS,
    SUPPORTED_GROUP_SIZES,
    SUPPORTED_HEAD_DIMS,
    Field,
    Preset,
    TileLayout,
    get_preset,
    tile_layout,
)
from kvarn_math.log8 import decode_log8, encode_log8
from kvarn_math.mla import (
    DEFAULT_MLA_PRESET,
    MLA_PRESETS,
    MLAPreset,
    decode_latent_tiles,
    encode_latent_tiles,
    get_mla_preset,
    mla_layout,
    mla_reference_attention,
)
from kvarn_math.packing import pack, packed_size, unpack
from kvarn_math.ranges import OVERFLOW_MODES, check_records
from kvarn_math.rtn import RowQuantized, dequantize_rows, quantize_rows
from kvarn_math.tile import (
    FRAME_QUERY_ROWS,
    TileFields,
    choose_key_frames,
    decode_tiles,
    dequantize_tiles,
    encode_tiles,
    frame_query_rows,
    quantize_tiles,
    read_fields,
)
from kvarn_math.varnorm import Balanced, imbalance, variance_normalize

__version__ = "0.1.0"

__all__ = [
    "Balanced",
    "DEFAULT_PRESET",
    "FORMAT_VERSION",
    "Field",
    "KEYS_UNROTATED",
    "PRESETS",
    "Preset",
    "QuantizedSequence",
    "RowQuantized",
    "SUPPORTED_GROUP_SIZES",
    "SUPPORTED_HEAD_DIMS",
    "TileFields",
    "TileLayout",
    "__version__",
    "choose_key_frames",
    "check_records",
    "OVERFLOW_MODES",
    "FRAME_QUERY_ROWS",
    "frame_query_rows",
    "decode_log8",
    "decode_tiles",
    "dense_attention",
    "dense_kv",
    "dequantize_rows",
    "dequantize_tiles",
    "encode_log8",
    "encode_tiles",
    "fwht",
    "get_preset",
    "hadamard_matrix",
    "imbalance",
    "pack",
    "packed_size",
    "quantize_rows",
    "quantize_sequence",
    "quantize_tiles",
    "random_signs",
    "read_fields",
    "key_window_start",
    "recent_window_start",
    "reference_attention",
    "step_sequence",
    "rotate",
    "tile_layout",
    "unpack",
    "unrotate",
    "variance_normalize",
    "DEFAULT_MLA_PRESET",
    "MLA_PRESETS",
    "MLAPreset",
    "decode_latent_tiles",
    "encode_latent_tiles",
    "get_mla_preset",
    "mla_layout",
    "mla_reference_attention",
]
