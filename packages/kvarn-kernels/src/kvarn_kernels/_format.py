"""The cache format these kernels implement, checked against kvarn-math's at import."""

from __future__ import annotations

import kvarn_math

__all__ = ["FORMAT_VERSION", "check_format_version"]

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


check_format_version(getattr(kvarn_math, "FORMAT_VERSION", 1))
