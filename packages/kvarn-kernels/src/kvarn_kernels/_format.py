"""The cache format these kernels implement, checked against kvarn-math's at import."""

from __future__ import annotations

import kvarn_math
from kvarn_math.layout import TileLayout

__all__ = ["FORMAT_VERSION", "check_format_version", "offset_constants"]

FORMAT_VERSION = 3
"""The record format (``kvarn_math.FORMAT_VERSION``) these kernels read and write."""


def check_format_version(found: object) -> None:
    """Raise ``ImportError`` unless kvarn-math's format ``found`` is the one these kernels
    implement (the packages are versioned separately; a mismatch would misread every record)."""
    if found != FORMAT_VERSION:
        raise ImportError(
            f"kvarn-kernels implements cache format {FORMAT_VERSION}, but the installed "
            f"kvarn-math defines format {found}: install matching versions "
            "(pip install -U kvarn-math kvarn-kernels)"
        )


_OFFSET_NAMES = {
    "OFF_KC": "k_codes",
    "OFF_KS": "k_scale",
    "OFF_KZ": "k_zero",
    "OFF_KT": "k_token_scale",
    "OFF_VC": "v_codes",
    "OFF_VCS": "v_channel_scale",
    "OFF_VS": "v_scale",
    "OFF_VZ": "v_zero",
    "OFF_FL": "flags",
}


def offset_constants(layout: TileLayout) -> dict[str, int]:
    """The byte offsets of a record's fields as the kernels' compile-time constants
    (``OFF_KC`` ... ``OFF_FL``), from kvarn-math's layout."""
    off = layout.offsets
    return {const: off[field] for const, field in _OFFSET_NAMES.items()}


check_format_version(getattr(kvarn_math, "FORMAT_VERSION", 1))
