"""Shared test helpers: hypothesis strategies for KV tiles and assertion helpers.

Needs the ``testing`` extra (``pip install kvarn-math[testing]``).  kvarn-kernels reuses
these strategies so kernels and reference are tested on the same distributions.
"""

from kvarn_math.testing.assertions import assert_close_rms, code_agreement
from kvarn_math.testing.strategies import (
    DISTRIBUTIONS,
    kv_sequences,
    kv_tiles,
    make_kv,
    presets,
    register_profiles,
)

__all__ = [
    "DISTRIBUTIONS",
    "assert_close_rms",
    "code_agreement",
    "kv_sequences",
    "kv_tiles",
    "make_kv",
    "presets",
    "register_profiles",
]
