"""The vLLM releases kvarn-vllm serves, one small named adapter per API generation.

An :class:`Adapter` says how kvarn plugs into the vLLM releases it covers: the public
extension points it calls and the entries of :data:`kvarn_vllm.patches.LEDGER` it applies
(every other entry stays unapplied on those releases). :func:`current` picks the adapter of
the installed vLLM; on a release no adapter covers, :func:`current` is None and
:func:`kvarn_vllm.plugin.register` logs :func:`unsupported_message` and changes nothing.

Nothing here imports vLLM at module import time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata

__all__ = [
    "ADAPTERS",
    "Adapter",
    "UnsupportedVllmVersion",
    "check_supported",
    "current",
    "parse_version",
    "supported_releases",
    "unsupported_message",
    "vllm_version",
]


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is a release no :class:`Adapter` covers."""


def parse_version(version: str) -> tuple[int, int, int]:
    """``"0.26.2.dev5+gabc"`` -> ``(0, 26, 2)``; a pre-release counts as its release."""
    parts = []
    for piece in version.split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits or "0"))
        if not piece.isdigit():
            break
    while len(parts) < 3:
        parts.append(0)
    return parts[0], parts[1], parts[2]


def vllm_version() -> str:
    """The installed vLLM version, read from package metadata (no vLLM import)."""
    return metadata.version("vllm")


@dataclass(frozen=True)
class Adapter:
    """How kvarn plugs into one generation of vLLM's internals.

    Attributes:
        name: e.g. ``"vllm-0.26"``.
        series: the ``(major, minor)`` release series it covers; every patch release of a
            covered series is served.
        checked: the releases whose installed sources and CPU tests it was checked against.
        patches: names of the :data:`kvarn_vllm.patches.LEDGER` entries it applies.
        public: the public vLLM extension points it calls, as ``module.symbol`` (for the
            docs and the tests; :attr:`register_public` does the calling).
        register_public: registers kvarn through those extension points (idempotent).
    """

    name: str
    series: tuple[tuple[int, int], ...]
    checked: tuple[str, ...]
    patches: tuple[str, ...]
    public: tuple[str, ...] = ()
    register_public: Callable[[], None] = field(default=lambda: None, repr=False)

    def covers(self, version: str) -> bool:
        return parse_version(version)[:2] in self.series

    def register_process(self) -> None:
        """Everything ``register()`` does in every vLLM process on these releases."""
        from kvarn_vllm import patches

        self.register_public()
        patches.apply_process_patches()

    def applied(self) -> frozenset[str]:
        from kvarn_vllm import patches

        return patches.applied()


_V026_PATCHES = (
    "kv-cache-dtype-values",
    "default-max-num-seqs",
    "backend-selection",
    "kv-cache-spec",
    "hybrid-block-size",
    "request-rows",
    "request-ids-v1",
    "draft-steps",
    "dflash-context-store",
)

VLLM_026 = Adapter(
    name="vllm-0.26",
    series=((0, 26),),
    checked=("0.26.0",),
    patches=_V026_PATCHES,
    public=("vllm.v1.attention.backends.registry.register_backend",),
)

ADAPTERS: tuple[Adapter, ...] = (VLLM_026,)
"""Every adapter, oldest release first."""


def supported_releases() -> str:
    """The served release series in words, e.g. ``"0.26.x"``."""
    series = [s for adapter in ADAPTERS for s in adapter.series]
    return ", ".join(f"{major}.{minor}.x" for major, minor in series)


def current(version: str | None = None) -> Adapter | None:
    """The adapter of ``version`` (default: the installed vLLM), or None if none covers it."""
    version = vllm_version() if version is None else version
    for adapter in ADAPTERS:
        if adapter.covers(version):
            return adapter
    return None


def unsupported_message(version: str | None = None) -> str:
    """What the plugin logs on a release no adapter covers (and what a kvarn preset then
    fails with): the installed release, the served ones and what still works."""
    version = vllm_version() if version is None else version
    try:
        own = metadata.version("kvarn-vllm")
    except metadata.PackageNotFoundError:
        own = "(not installed)"
    return (
        f"kvarn: kvarn-vllm {own} serves vLLM {supported_releases()}; found vLLM {version}. "
        "The plugin changed nothing: vLLM runs as without it, every other kv_cache_dtype "
        "works, and kv_cache_dtype kvarn_* is not available (vLLM rejects the name). "
        f"Install a vLLM release in {supported_releases()} or a kvarn-vllm release made for "
        f"vLLM {version}."
    )


def check_supported(version: str | None = None) -> Adapter:
    """The adapter of ``version``; raises :class:`UnsupportedVllmVersion` if none covers it."""
    adapter = current(version)
    if adapter is None:
        raise UnsupportedVllmVersion(unsupported_message(version))
    return adapter
