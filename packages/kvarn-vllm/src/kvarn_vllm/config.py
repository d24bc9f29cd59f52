"""Preset parsing: a ``--kv-cache-dtype`` string to a frozen :class:`KvarnConfig`.

The cache format itself (bits, tile size, record bytes) is owned by
:mod:`kvarn_math.layout`; this module only maps vLLM's ``kv_cache_dtype`` string onto a
preset and carries the serving-side settings that go with it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvarn_math.layout import DEFAULT_PRESET, PRESETS, SUPPORTED_HEAD_DIMS, Preset, get_preset
from kvarn_math.tile import KEY_FRAMES

from kvarn_vllm.settings import VllmSettings

__all__ = [
    "INVARIANT_ENV",
    "KEY_FRAME_ENV",
    "KVARN_PREFIX",
    "RECENT_ENV",
    "SERVED_HEAD_DIMS",
    "SINK_ENV",
    "WINDOW_KEYS_ENV",
    "KvarnConfig",
    "default_window_keys",
    "env_flag",
    "is_kvarn_dtype",
    "parse_kv_cache_dtype",
    "preset_names",
]

KVARN_PREFIX = "kvarn_"
SINK_ENV = "KVARN_VLLM_EXACT_SINK"
"""Environment variable: ``0`` quantizes every request's first tile too (more capacity: the
sink rows cost ``G`` staging tokens per request and layer); default ``1`` keeps it exact."""
RECENT_ENV = "KVARN_VLLM_RECENT_TILES"
"""Environment variable: complete tiles before the open one that attention reads exact from
staging besides their records (default ``1``; ``0`` gives their staging to the KV cache)."""
INVARIANT_ENV = "KVARN_KERNELS_BATCH_INVARIANT"
"""Environment variable: ``1`` runs attention in batch-invariant mode (a token's output bits
do not depend on the batch, CUDA-graph padding or speculative verify); default ``0``. It makes
two runs agree only when both use it (EAGLE in this mode against a plain run in the default
launch agreed on 93.0% of greedy tokens, H200; both in it: 99.9%)."""
VERIFY_AS_DECODE_ENV = "KVARN_VLLM_VERIFY_AS_DECODE"
"""Environment variable: ``1`` runs the verify blocks of speculative decoding (at most 16 query
tokens per request) as decode rows, one per token, in the default launch: a verify token is
then computed by the kernel and launch that decode it without speculation, instead of the
multi-query kernel (only the split layout still follows the batch). ``0`` sends them through
the multi-query kernel, which reads the context once per block. Unset: on with speculative
decoding. H200, 2026-12-04 (thirty-second and thirty-third runs): n-gram agreement with no
speculation (SmolLM2) 94.4-96.4% with it, 87.0-88.7% without, bf16 93.0-96.0%; a verify step of 5 tokens per request at the Llama-3.1-8B
shape (``python -m kvarn_kernels.bench --verify 4``) took 0.28-0.45x the multi-query time
where the Gluon kernel decodes (kvarn_k4v2), 2.1-2.5x on the Triton kernel alone (kvarn_k2v2).
Batch-invariant mode does this where the Gluon kernel decodes."""
KEY_FRAME_ENV = "KVARN_VLLM_KEY_FRAME"
"""Environment variable: ``auto`` (default) stores each tile's keys Hadamard-rotated or in their
own channels, whichever loses less of the attention scores of the step's queries (the record
says which); ``rotated`` always rotates them (the plain format; attention then skips the flag)."""
WINDOW_KEYS_ENV = "KVARN_VLLM_WINDOW_KEYS"
"""Environment variable: ``1`` keeps the keys of the exact windows (the first tile, the recent
tiles) exact too; ``0`` keeps only their values exact and reads their keys from the records,
which halves their staging (kvarn_math.quantize_sequence(window_keys=False)). Unset: the
preset's default, :func:`default_window_keys`."""
WINDOW_KEYS_BELOW_KEY_BITS = 4
"""Presets with fewer key bits than this keep their windows' keys exact by default. Measured on
CPU (docs/results/cpu-2026-12-01d): values-only windows add 0.1 (SmolLM2) to 0.4 (Gemma-3)
percentage points to kvarn_k4v2's perplexity change, but 11 to kvarn_k2v2's."""
# kvarn-math defines records for 512 as well; the dense backend serves these (issue 5).
SERVED_HEAD_DIMS: tuple[int, ...] = tuple(d for d in SUPPORTED_HEAD_DIMS if d <= 256)


def preset_names() -> tuple[str, ...]:
    """Every preset name vLLM should accept as ``kv_cache_dtype``, default first."""
    rest = sorted(name for name in PRESETS if name != DEFAULT_PRESET)
    return (DEFAULT_PRESET, *rest)


def is_kvarn_dtype(kv_cache_dtype: object) -> bool:
    """True when ``kv_cache_dtype`` names a KVarN format (known or not)."""
    return isinstance(kv_cache_dtype, str) and kv_cache_dtype.startswith(KVARN_PREFIX)


@dataclass(frozen=True)
class KvarnConfig:
    """The serving configuration of one KVarN cache.

    Attributes:
        preset: the cache format (bits and tile size ``G``).
        staging_tiles: open tiles of staging per request ``S`` (1 without speculative
            decoding; a verify step can spill into the next tile otherwise).
        sink: keep each request's first tile (the attention sink) exact in ``G`` staging
            rows besides its quantized record, which prefix-cache hits read.
        recent_tiles: ``R``, complete tiles before the tile a step starts in kept exact in
            staging besides their records (attention reads them there; prefix-cache hits read
            the records), from :data:`RECENT_ENV`.
        batch_invariant: attention in the kernels' batch-invariant mode (split-K at fixed
            positions), from :data:`INVARIANT_ENV`.
        key_frame: ``"auto"`` or ``"rotated"``, from :data:`KEY_FRAME_ENV` (the dataclass
            default is the plain format, ``"rotated"``; the environment's default is
            ``"auto"``).
        verify_as_decode: verify blocks as decode rows in the default launch too, from
            :data:`VERIFY_AS_DECODE_ENV`.
        window_keys: the exact windows (sink, recent tiles) keep their keys exact too;
            ``False``: only their values, and the keys get a ring of the ``staging_tiles``
            open tiles, from :data:`WINDOW_KEYS_ENV` (the dataclass default keeps them; the
            environment's default depends on the preset, :func:`default_window_keys`).
    """

    preset: Preset
    staging_tiles: int = 1
    sink: bool = True
    batch_invariant: bool = False
    recent_tiles: int = 0
    key_frame: str = "rotated"
    window_keys: bool = True
    verify_as_decode: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.preset, Preset):
            raise ValueError(f"preset must be a kvarn_math Preset, got {self.preset!r}")
        if not isinstance(self.staging_tiles, int) or self.staging_tiles < 1:
            raise ValueError(f"staging_tiles must be an int >= 1, got {self.staging_tiles!r}")
        if not isinstance(self.recent_tiles, int) or self.recent_tiles < 0:
            raise ValueError(f"recent_tiles must be an int >= 0, got {self.recent_tiles!r}")
        if self.key_frame not in KEY_FRAMES:
            raise ValueError(f"key_frame must be one of {KEY_FRAMES}, got {self.key_frame!r}")

    @property
    def mixed_key_frames(self) -> bool:
        """Records may hold keys in their own channels (attention reads each tile's flag)."""
        return self.key_frame == "auto"

    @property
    def frame_queries(self) -> bool:
        """The store stages the query of each tile's last position (``store_kv(frame_queries=)``):
        with ``auto`` key frames under speculative decoding, where a step can commit a tile
        whose tokens were all staged (accepted drafts), so that it is judged by the same query
        as without speculation."""
        return self.mixed_key_frames and self.staging_tiles > 1

    @property
    def name(self) -> str:
        """The ``kv_cache_dtype`` string, e.g. ``kvarn_k4v2_g128``."""
        return self.preset.name

    @property
    def block_size(self) -> int:
        """vLLM block size in tokens: one block is one tile, ``G``."""
        return self.preset.group_size

    @property
    def ring_tiles(self) -> int:
        """Tiles of the staging ring per request: the open ones and the recent ones, ``S + R``
        (the kernels' ``staging_tiles``)."""
        return self.staging_tiles + self.recent_tiles

    @property
    def ring_tokens(self) -> int:
        """Staging tokens per request and layer in the ring, ``(S + R) * G``."""
        return self.ring_tiles * self.preset.group_size

    @property
    def key_tiles(self) -> int | None:
        """The key ring's tiles with values-only windows (the open tiles ``S``), else None:
        the kernels' ``key_tiles``."""
        return None if self.window_keys else self.staging_tiles

    @property
    def staging_tokens(self) -> int:
        """Tokens of staging per request and layer (a token: its key and value),
        ``(S + R + sink) * G``; with values-only windows ``(S + (S + R + sink) / 2) * G``
        (the keys of the open tiles, the values of every staged tile)."""
        rows = 2 * (self.ring_tiles + int(self.sink))  # key and value rows
        if not self.window_keys:
            rows = self.staging_tiles + self.ring_tiles + int(self.sink)
        return rows * self.preset.group_size // 2

    @property
    def sink_rows(self) -> int:
        """Staging rows in front of the ring that keep tile 0 (``G``, or 0 without sink)."""
        return self.preset.group_size if self.sink else 0

    def check_head_dim(self, head_dim: int) -> None:
        """Raise ValueError unless the dense backend serves ``head_dim``."""
        if head_dim not in SERVED_HEAD_DIMS:
            raise ValueError(
                f"head_dim must be one of {SERVED_HEAD_DIMS} for {self.name}, got {head_dim}"
            )


def staging_tiles_for(num_speculative_tokens: int | None, group_size: int) -> int:
    """``S``: tiles of staging a request needs, given the speculative tokens per step.

    Staging holds ``[quantized_len, seq_len)``. A tile is quantized in the first step in
    which all its tokens are committed (accepted), so after a step the committed length
    is at least the step's first position + 1 and staging spans less than ``G`` committed
    positions plus the step's ``k`` drafts. A drafter's decode steps (EAGLE, MTP) then
    write up to ``k - 1`` more draft positions past the accepted ones, for less than
    ``G + 2k`` positions in all: ``S = 1 + ceil(2k / G)`` (2 for ``k <= G / 2``).
    """
    k = num_speculative_tokens or 0
    if k < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0, got {k}")
    return 1 + -(-2 * k // group_size)


def env_flag(name: str, default: bool) -> bool:
    """A ``0``/``1`` environment variable (unset or blank: ``default``), parsed as
    :class:`VllmSettings` parses its flags: for modules that still read their one variable
    themselves (``KVARN_VLLM_WARMUP``, ``KVARN_VLLM_DENSE_CONTEXT``).

    Raises:
        ValueError: any other value, naming the variable.
    """
    raw = os.environ.get(name, "").strip() or ("1" if default else "0")
    if raw not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {raw!r}")
    return raw == "1"


SPEC_GRAPHS_ENV = "KVARN_VLLM_SPEC_FULL_GRAPHS"


def spec_full_graphs() -> bool:
    """The :data:`SPEC_GRAPHS_ENV` setting (default ``1``): with speculative decoding, declare
    full CUDA graphs for uniform batches of any query length (vLLM's ``UNIFORM_BATCH``), so
    that a speculative engine keeps full graphs for its verify steps (``1 + k`` tokens per
    request) and its drafter's steps instead of falling back to piecewise graphs with kvarn's
    attention eager between them. ``0`` declares single-token decodes only, as before
    2026-12-03 (H200, SmolLM2-shaped DFlash, 32 x 256 tokens: 1,456.4 tokens/s with it,
    349.3 without, the same greedy output)."""
    return VllmSettings.from_env().spec_full_graphs


def sink_from_env() -> bool:
    """The :data:`SINK_ENV` setting: ``0`` turns the exact first tile off, ``1`` (default) on."""
    return VllmSettings.from_env().exact_sink


def recent_from_env() -> int:
    """The :data:`RECENT_ENV` setting: an int in ``[0, MAX_RECENT_TILES]``, default 1.

    Raises:
        ValueError: anything else, naming the variable.
    """
    return VllmSettings.from_env().recent_tiles


def key_frame_from_env() -> str:
    """The :data:`KEY_FRAME_ENV` setting: ``auto`` (default) or ``rotated``.

    Raises:
        ValueError: anything else, naming the variable.
    """
    return VllmSettings.from_env().key_frame


def default_window_keys(preset: Preset | str) -> bool:
    """Whether ``preset``'s exact windows keep their keys by default: for keys of fewer than
    :data:`WINDOW_KEYS_BELOW_KEY_BITS` bits (2-bit keys need their recent keys exact, as
    measured; 3-bit keys, not measured, are treated alike). 4-bit keys read them from the
    records and give half the windows' staging to the cache."""
    return get_preset(preset).key_bits < WINDOW_KEYS_BELOW_KEY_BITS


def window_keys_from_env(preset: Preset | str) -> bool:
    """The :data:`WINDOW_KEYS_ENV` setting: ``0`` values-only windows, ``1`` keys too, unset
    :func:`default_window_keys` of ``preset``."""
    value = VllmSettings.from_env().window_keys
    return default_window_keys(preset) if value is None else value


def invariant_from_env() -> bool:
    """The :data:`INVARIANT_ENV` setting (kvarn-kernels' ``KernelSettings.batch_invariant``,
    read afresh): ``1`` on, ``0`` (default) off. Parsed here with :func:`env_flag` as
    ``KernelSettings`` parses it (a test checks they agree): importing kvarn_kernels would
    import Triton, and :func:`parse_kv_cache_dtype` runs in every process vLLM starts, through
    the plugin's ``register()``."""
    return env_flag(INVARIANT_ENV, False)


def verify_as_decode_from_env(speculative: bool) -> bool:
    """The :data:`VERIFY_AS_DECODE_ENV` setting: ``1`` on, ``0`` off; unset, on with
    speculative decoding (``speculative``)."""
    value = VllmSettings.from_env().verify_as_decode
    return speculative if value is None else value


def parse_kv_cache_dtype(
    kv_cache_dtype: str, *, num_speculative_tokens: int | None = None
) -> KvarnConfig:
    """Parse a ``kvarn_*`` ``kv_cache_dtype`` into a :class:`KvarnConfig`.

    The exact first tile follows :data:`SINK_ENV` (on unless it is ``0``); the recent exact
    tiles :data:`RECENT_ENV` (1 unless set); batch-invariant attention follows
    :data:`INVARIANT_ENV` (off unless it is ``1``); the key frame :data:`KEY_FRAME_ENV`
    (``auto`` unless set); the windows' keys :data:`WINDOW_KEYS_ENV` (unless set: kept for
    2- and 3-bit keys, values only for 4-bit keys, :func:`default_window_keys`); verify blocks
    as decode rows :data:`VERIFY_AS_DECODE_ENV` (unless set: on with speculative tokens).

    Raises:
        ValueError: when the string is not a kvarn preset, naming the presets accepted.
    """
    if not is_kvarn_dtype(kv_cache_dtype):
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(preset_names())} for KVarN, "
            f"got {kv_cache_dtype!r}"
        )
    try:
        preset = get_preset(kv_cache_dtype)
    except ValueError:
        raise ValueError(
            f"unknown KVarN kv_cache_dtype {kv_cache_dtype!r}; expected one of "
            f"{', '.join(preset_names())}"
        ) from None
    env = VllmSettings.from_env()
    speculative = bool(num_speculative_tokens)
    return KvarnConfig(
        preset=preset,
        staging_tiles=staging_tiles_for(num_speculative_tokens, preset.group_size),
        sink=env.exact_sink,
        batch_invariant=invariant_from_env(),
        recent_tiles=env.recent_tiles,
        key_frame=env.key_frame,
        window_keys=default_window_keys(preset) if env.window_keys is None else env.window_keys,
        verify_as_decode=speculative if env.verify_as_decode is None else env.verify_as_decode,
    )
