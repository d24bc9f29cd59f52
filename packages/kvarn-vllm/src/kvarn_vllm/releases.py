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
from typing import Any

__all__ = [
    "ADAPTERS",
    "NOT_SERVED",
    "VLLM_026",
    "VLLM_027",
    "VLLM_029",
    "VLLM_033",
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
        checked: the releases its public calls and ledger entries were checked against.
        public: the public vLLM extension points it calls, as ``module.symbol`` (for the
            docs and the tests; :attr:`register_public` does the calling).
        register_public: registers kvarn through those extension points (idempotent).
        unserved_in: ``unserved_in(vllm_config)`` lists what kvarn does not serve on these
            releases for that configuration (each reason says where it is served); the
            backend selection refuses a ``kvarn_*`` layer with them at start-up
            (:meth:`unserved`).
    """

    name: str
    series: tuple[tuple[int, int], ...]
    checked: tuple[str, ...]
    public: tuple[str, ...] = ()
    register_public: Callable[[], None] = field(default=lambda: None, repr=False)
    unserved_in: Callable[[Any], list[str]] = field(default=lambda config: [], repr=False)

    def covers(self, version: str) -> bool:
        return parse_version(version)[:2] in self.series

    def series_names(self) -> frozenset[str]:
        """``{"0.26"}``: the names the ledger's ``releases`` fields use."""
        return frozenset(f"{major}.{minor}" for major, minor in self.series)

    @property
    def patches(self) -> tuple[str, ...]:
        """The ledger entries applied on these releases."""
        from kvarn_vllm.patches import LEDGER

        names = self.series_names()
        return tuple(p.name for p in LEDGER if not names.isdisjoint(p.releases))

    def register_process(self) -> None:
        """Everything ``register()`` does in every vLLM process on these releases."""
        from kvarn_vllm import patches

        self.register_public()
        patches.apply_process_patches()

    def applied(self) -> frozenset[str]:
        """The ledger entries applied in this process so far."""
        from kvarn_vllm import patches

        return patches.applied()

    def unserved(self, vllm_config: Any = None) -> list[str]:
        """What kvarn does not serve here for ``vllm_config`` (default: vLLM's current one)."""
        if vllm_config is None:
            from vllm.config import vllm as config_module

            current = getattr(config_module, "get_current_vllm_config_or_none", None)
            vllm_config = current() if current is not None else None
            if vllm_config is None:  # outside an engine (0.33 asserts in the plain getter)
                return []
        return self.unserved_in(vllm_config)


def _use_v2_runner(vllm_config: Any) -> bool:
    """Whether ``vllm_config`` runs vLLM's V2 model runner (False where it cannot tell)."""
    try:
        return bool(vllm_config.use_v2_model_runner)
    except Exception:  # a partial config (tests) or a release without the property
        return False


def _unserved_multi_module_mtp(vllm_config: Any) -> list[str]:
    """0.27+: MTP with several modules (``num_nextn_predict_layers`` > 1) drafts mixed
    prefill/decode query layouts through one metadata build, which kvarn's draft steps
    (one query shape per step) do not plan."""
    spec = getattr(vllm_config, "speculative_config", None)
    use = getattr(spec, "use_multi_module_mtp", None)
    if spec is not None and use is not None and use():
        return [
            "multi-module MTP (several MTP modules draft mixed prefill/decode query layouts "
            "in one metadata build, vLLM 0.27+; kvarn's draft steps plan one query shape "
            "per step), served nowhere yet; single-module MTP is served on 0.26.x and 0.27.x"
        ]
    return []


VLLM_026 = Adapter(
    name="vllm-0.26",
    series=((0, 26),),
    checked=("0.26.0",),
    public=("vllm.v1.attention.backends.registry.register_backend",),
)

VLLM_027 = Adapter(
    name="vllm-0.27",
    series=((0, 27),),
    checked=("0.27.0", "0.27.1"),
    public=("vllm.v1.attention.backends.registry.register_backend",),
    unserved_in=_unserved_multi_module_mtp,
)
"""0.27 keeps 0.26's internals (no ``customize_spec``, ``get_kv_cache_shape`` allocation),
so every 0.26 ledger entry applies; its drafter metadata method gained arguments kvarn
passes through. New in 0.27: multi-module MTP, refused. 0.27.1 differs from 0.27.0 only in
a model file (``qwen3_dspark.py``) and the version."""

_SPEC_REFUSED_030 = (
    "speculative decoding with a drafter model (EAGLE, EAGLE-3, MTP, DFlash): kvarn marks a "
    "drafter's steps through DraftModelSpeculator._build_draft_attn_metadata, not checked on "
    "0.29 and gone from 0.30, whose drafters build their steps' metadata through "
    "_build_attn_metadata(step=...) into every builder's plain build(); nothing public "
    "(build_for_drafting is not called there) tells kvarn a step's tokens are all drafts, "
    "which must not commit tiles. Served on vLLM 0.26.x and 0.27.x"
)


def _applied_on(entry: str, series: str) -> bool:
    """Whether ledger entry ``entry`` lists release series ``series`` (e.g. ``"0.33"``)."""
    from kvarn_vllm.patches import LEDGER

    return any(p.name == entry and series in p.releases for p in LEDGER)


def _unserved_customize_spec(vllm_config: Any, series: str) -> list[str]:
    """What the adapters on ``customize_spec`` releases (0.29+) refuse for ``vllm_config``;
    ``series``: one release series of the adapter (its ledger is the same on each)."""
    reasons = []
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is not None:
        method = getattr(spec, "method", None)
        if method not in ("ngram", "ngram_gpu"):
            reasons.append(_SPEC_REFUSED_030)
        elif _use_v2_runner(vllm_config):
            reasons.append(
                f"speculative method {method!r} on vLLM's V2 model runner (n-gram is served "
                "on the V1 runner, whose per-request hooks kvarn has: set "
                "VLLM_USE_V2_MODEL_RUNNER=0)"
            )
    cache_config = getattr(vllm_config, "cache_config", None)
    if cache_config is not None and cache_config.kv_cache_dtype_skip_layers:
        reasons.append(
            "--kv-cache-dtype-skip-layers (vLLM 0.29+ sizes the shared page of the kvarn and "
            "the skipped layers per token through the kvarn backend's customize_spec on a "
            "one-token spec; a tile record has no whole bytes per token, so the pages would "
            "not match; served nowhere yet: 0.26.x and 0.27.x refuse it per layer)"
        )
    model_config = getattr(vllm_config, "model_config", None)
    hybrid = model_config is not None and getattr(model_config, "is_hybrid", False)
    if hybrid and not _applied_on("hybrid-block-size", series):
        reasons.append(
            "hybrid (Mamba/linear-attention) models (vLLM's hybrid alignment sizes the "
            "attention page per token through customize_spec, which a tile record cannot "
            "give exactly; kvarn's own alignment, ledger entry hybrid-block-size, is not "
            "applied on these releases), served on vLLM 0.26.x, 0.27.x and 0.33.x"
        )
    return reasons


VLLM_029 = Adapter(
    name="vllm-0.29",
    series=((0, 29), (0, 30), (0, 31), (0, 32)),
    checked=("0.29.0", "0.30.0", "0.31.0", "0.32.0"),
    public=(
        "vllm.v1.attention.backends.registry.register_backend",
        "vllm.v1.attention.backend.AttentionBackend.customize_spec",
        "vllm.v1.attention.backend.AttentionBackend.supported_kv_cache_layouts",
    ),
    unserved_in=lambda config: _unserved_customize_spec(config, "0.29"),
)
"""0.29-0.32: the backend sizes its page with ``customize_spec`` and vLLM views every
layer's cache as ``[B, H, N, C]`` (no ``get_kv_cache_shape``), as on 0.33; but the cache
dtype is still a closed Literal, so ``kv-cache-dtype-values`` stays. 0.28 has
``customize_spec`` without ``tokens_per_state`` and still allocates through
``get_kv_cache_shape``: a third page API that no adapter serves."""


def _register_cache_dtypes_033() -> None:
    """``--kv-cache-dtype kvarn_*`` through vLLM 0.33's public ``register_kv_cache_dtype``:
    each preset stores ``torch.uint8`` records. Its quant mode is ``KVQuantMode.NONE``, as
    every unknown name was on 0.26: kvarn's backend dispatches its own kernels, and 0.33's
    ``KVQuantMode.CUSTOM`` shares its value with ``OCTAVE_K3V4`` (an alias, so code asking
    ``is_octave`` would answer True)."""
    import torch
    from vllm.config.cache import (  # type: ignore[attr-defined]  # vLLM 0.33 only
        get_kv_cache_dtype_handler,
        register_kv_cache_dtype,
    )
    from vllm.v1.kv_cache_interface import KVQuantMode

    from kvarn_vllm.config import preset_names

    def torch_dtype(self: Any) -> torch.dtype:
        return torch.uint8

    def quant_mode(self: Any) -> KVQuantMode:
        return KVQuantMode.NONE

    for name in preset_names():
        if get_kv_cache_dtype_handler(name) is None:
            members = {"name": name, "torch_dtype": torch_dtype, "quant_mode": quant_mode}
            register_kv_cache_dtype(name)(type("KvarnCacheDType", (), members))


VLLM_033 = Adapter(
    name="vllm-0.33",
    series=((0, 33),),
    checked=("0.33.0",),
    public=(
        "vllm.v1.attention.backends.registry.register_backend",
        "vllm.config.cache.register_kv_cache_dtype",
        "vllm.v1.attention.backend.AttentionBackend.customize_spec",
        "vllm.v1.attention.backend.AttentionBackend.supported_kv_cache_layouts",
    ),
    register_public=_register_cache_dtypes_033,
    unserved_in=lambda config: _unserved_customize_spec(config, "0.33"),
)

ADAPTERS: tuple[Adapter, ...] = (VLLM_026, VLLM_027, VLLM_029, VLLM_033)
"""Every adapter, oldest release first."""

NOT_SERVED: dict[tuple[int, int], str] = {
    (0, 28): (
        "vLLM 0.28 sizes pages through AttentionBackend.customize_spec but has no "
        "tokens_per_state (a page is bytes per token times tokens, and a tile record has "
        "no whole bytes per token) and still allocates through get_kv_cache_shape, a page "
        "API between 0.27's and 0.29's that no adapter covers"
    ),
    (0, 34): (
        "vLLM 0.34 removed the V1 model runner whose request rows kvarn's speculative and "
        "prefix-cache hooks read; no adapter has been written and checked against it yet "
        "(its register_kv_cache_dtype and customize_spec remain, read from the wheel only)"
    ),
}
"""Release series inside the served range that no adapter covers, and why."""


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
    why = NOT_SERVED.get(parse_version(version)[:2])
    return (
        f"kvarn: kvarn-vllm {own} serves vLLM {supported_releases()}; found vLLM {version}"
        f"{f' ({why})' if why else ''}. "
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
