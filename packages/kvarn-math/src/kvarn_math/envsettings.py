"""Settings read from environment variables: the field helper and the reader that every kvarn
package's frozen settings object is built with (``kvarn_kernels.settings``,
``kvarn_vllm.settings``).

It lives here, at the bottom of the layers and on the standard library alone, so that a package
can declare its settings without importing the packages above this one (kvarn-vllm's import
must not import Triton or the kernels).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import field, fields
from typing import Any

__all__ = ["parse_flag", "read_environment", "setting"]


def parse_flag(raw: str) -> bool:
    """``"0"`` or ``"1"`` to a bool; anything else raises ``ValueError``."""
    if raw not in ("0", "1"):
        raise ValueError(raw)
    return raw == "1"


def setting(
    env: str,
    default: Any,
    parse: Callable[[str], Any],
    allowed: str,
    doc: str,
    *,
    use: str = "engine",
) -> Any:
    """A settings field read from the environment variable ``env``.

    Args:
        env: the variable's name.
        default: the value when the variable is unset or empty.
        parse: the stripped text to the value; raises ``ValueError`` when it does not accept it.
        allowed: the accepted values in words, for errors and the docs table.
        doc: what it does and why its default is the default (measured), for the docs table.
        use: ``engine`` (a serving knob), ``measurement`` (benchmarks and diagnosis; an engine
            leaves it unset), ``legacy`` (keeps an older code path for comparison) or ``run``
            (where a run finds or records things).
    """
    meta = {"env": env, "parse": parse, "allowed": allowed, "doc": doc, "use": use}
    return field(default=default, metadata=meta)


def read_environment(cls: Any, environ: Mapping[str, str] | None = None) -> Any:
    """An instance of the settings dataclass ``cls`` from ``environ`` (default ``os.environ``):
    each field's variable when set and not blank, else the field's default.

    Raises:
        ValueError: a variable holds a value its field does not accept, naming the variable,
            what it accepts and what arrived.
    """
    env = os.environ if environ is None else environ
    values = {}
    for f in fields(cls):
        name = f.metadata["env"]
        raw = env.get(name)
        if raw is None or not raw.strip():
            continue
        try:
            values[f.name] = f.metadata["parse"](raw.strip())
        except ValueError:
            raise ValueError(f"{name} must be {f.metadata['allowed']}, got {raw!r}") from None
    return cls(**values)
