"""kvarn-kernels' settings: every ``KVARN_KERNELS_*`` environment variable in one frozen object.

:class:`KernelSettings` is read from the environment and validated once, on the first call of
:func:`current` (when ``kvarn_kernels`` is imported: ``_triton`` reads ``no_asm``); a bad value raises ``ValueError`` naming the variable,
the values it accepts and what arrived. A process that changes the environment afterwards
calls :func:`reload`; :func:`override` replaces fields for a block of code (benchmarks).
``docs/settings.md`` is generated from the fields' metadata (``python docs/gen_tables.py``).

This module imports the standard library and kvarn_math.envsettings only, so that the docs build
reads it without torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from kvarn_math.envsettings import parse_flag, read_environment, setting

__all__ = [
    "KernelSettings",
    "current",
    "override",
    "parse_flag",
    "read_environment",
    "reload",
    "setting",
]


def _int_in(allowed: Callable[[int], bool]) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        if not raw.isdigit() or not allowed(int(raw)):
            raise ValueError(raw)
        return int(raw)

    return parse


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in allowed:
            raise ValueError(raw)
        return raw

    return parse


_LAUNCH_KEYS = ("SUB", "num_warps", "num_stages", "maxnreg")


def _parse_launch(raw: str) -> tuple[tuple[str, int], ...]:
    out = []
    for item in raw.split(","):
        key, _, value = item.partition("=")
        if key.strip() not in _LAUNCH_KEYS or not value.strip().isdigit():
            raise ValueError(raw)
        out.append((key.strip(), int(value)))
    return tuple(out)


@dataclass(frozen=True)
class KernelSettings:
    """The kernels' environment settings (``docs/settings.md`` lists them)."""

    batch_invariant: bool = setting(
        "KVARN_KERNELS_BATCH_INVARIANT",
        False,
        parse_flag,
        "0 or 1",
        "`1`: a token's attention output does not depend on the batch, CUDA-graph padding or "
        "speculative verify (split-K at fixed positions; the kernels' `batch_invariant=None` "
        "reads it, kvarn-vllm reads it when an engine starts). Two runs agree only if both use "
        "it: EAGLE and a plain run both in this mode agree on 99.9% of greedy tokens (bf16: "
        "96.8%), both in the default launch on 93.3%, EAGLE in this mode against a plain "
        "default run on 93.0%; n-gram 99.8% (H200, SmolLM2). Up to `c6976e9` it ran the "
        "Triton kernel only: decode attention 1.5-2.1x the default launch's time at batch "
        "16-64, 4K-16K (H200, twentieth run). Since `8cc64b3` it keeps the Gluon decode kernel "
        "with fixed splits and runs verify blocks as decode rows there: 0.96-1.16x the default "
        "launch's time at batch 16-64, 4K-16K (H200, twenty-first run); see "
        "[Kernels](kernels.md). Opt-in",
    )
    invariant_split_tiles: int = setting(
        "KVARN_KERNELS_INVARIANT_SPLIT_TILES",
        8,
        _int_in(lambda n: n in {1 << i for i in range(9)}),
        "a power of two from 1 to 256",
        "tiles per split of the Gluon decode kernel in batch-invariant mode (1024 positions "
        "at G = 128; its query rows come prepared, so a split costs little besides its "
        "partial: 0.96-1.16x the default launch's time at 16-64 x 4K-16K, H200, twenty-first "
        "run). With `32`: 1.00-1.02x the default launch at batch 64-256, 4K-16K, and a "
        "4K burst that fills the cache decodes 1.9% slower (H200, twenty-sixth run); 32-tile "
        "splits cost 1.4-3x at batch 1-4. Runs that must agree use one value",
    )
    fast_decode: bool = setting(
        "KVARN_KERNELS_FAST_DECODE",
        True,
        parse_flag,
        "0 or 1",
        "`0` keeps decode attention on the Triton kernel; by default `kvarn_k4v2_g128` and "
        "`kvarn_k4v4_g128` at head_dim 128 (GQA up to 8, no sliding window) read their "
        "records through the Gluon kernel, 1.24-1.81x faster for k4v2 (thirteenth run) and "
        "1.9-2.2x for k4v4 (thirtieth run; H200). `0` keeps the Triton path for comparison",
        use="legacy",
    )
    fast_prefetch: int = setting(
        "KVARN_KERNELS_FAST_PREFETCH",
        1,
        _int_in(lambda n: n <= 4),
        "an integer 0..4",
        "tiles ahead of the one it reads whose record the Gluon decode kernel prefetches into "
        "L2 (no output bit changes): one tile ahead ran 2.8-8.5% faster than none at batch "
        "16-256 x 4K-16K (2.5-5.4% batch-invariant), two a little less (H200, Llama-3.1-8B "
        "shape, values-only windows, 2026-12-02)",
    )
    warmup_threads: int = setting(
        "KVARN_KERNELS_WARMUP_THREADS",
        4,
        _int_in(lambda n: n >= 1),
        "a positive integer",
        "threads `warmup()` compiles from after the store (Triton releases the GIL while "
        "compiling) when its `threads` argument is None. A cold warm-up took 29.4 s from 4 "
        "threads against 72.0 s from 1, compiling the same variants (H200, 2026-12-04, "
        "[results](results/h200-2026-12-04/README.md)); in the engine 21.5 s against 55.3 s. "
        "Forced to 1 off CUDA, under the interpreter and with autotuning",
    )
    torch_planner: bool = setting(
        "KVARN_KERNELS_TORCH_PLANNER",
        False,
        parse_flag,
        "0 or 1",
        "`1`: speculative steps make their store plans on the device with torch operations, "
        "as before `09454fb` (about 80 launches per verify step and 35 per drafter step, "
        "instead of two Triton launches and one); the plans are the same element for element. "
        "EAGLE stress: 1,858.4 tokens/s with the Triton planner against 1,630.9 and 1,390.4 "
        "with the torch one (H200, twenty-fourth run)",
        use="legacy",
    )
    autotune: bool = setting(
        "KVARN_KERNELS_AUTOTUNE",
        False,
        parse_flag,
        "0 or 1",
        "`1` tunes the attention kernel on its first call per shape (benchmarks configs on "
        "the device, which must not happen inside a CUDA graph capture: an engine must warm "
        "every shape up first). It tunes at the first batch and context it meets; the config "
        "picked at batch 1 ran large batches at half the default's speed",
        use="measurement",
    )
    attn_launch: tuple[tuple[str, int], ...] = setting(
        "KVARN_KERNELS_ATTN_LAUNCH",
        (),
        _parse_launch,
        f"comma-separated KEY=INT with KEY in {_LAUNCH_KEYS}",
        "fixed launch parameters of the untuned attention kernel (`SUB=128,num_warps=4`)",
        use="measurement",
    )
    staged_splits: int | None = setting(
        "KVARN_KERNELS_STAGED_SPLITS",
        None,
        _int_in(lambda n: n >= 1),
        "an integer >= 1",
        "a cap on the splits of the fast decode path's staged pass (one per staged tile by "
        "default; `1` walks the sink, recent and open tiles one after the other)",
        use="measurement",
    )
    store_warps: int | None = setting(
        "KVARN_KERNELS_STORE_WARPS",
        None,
        _int_in(lambda n: n in (4, 8, 16, 32)),
        "4, 8, 16 or 32",
        "warps per program of the tile quantization instead of the size-based choice "
        "(`python -m kvarn_kernels.bench --store-sweep`): 128x128 tiles took 0.788 ms with 8 "
        "warps, 0.915 with 16, 1.095 with 32 (H200, 2026-12-03)",
        use="measurement",
    )
    no_asm: bool = setting(
        "KVARN_KERNELS_NO_ASM",
        False,
        parse_flag,
        "0 or 1",
        "`1`: unpack 4- and 2-bit codes with portable bit operations instead of inline PTX "
        "(the same results), to rule the assembly out when diagnosing a GPU failure (used so "
        "on 2026-12-03). Read once, when kvarn_kernels is imported",
        use="measurement",
    )
    mla_decode: str = setting(
        "KVARN_KERNELS_MLA_DECODE",
        "verified",
        _choice("verified", "fast"),
        "verified or fast",
        "the MLA latent decode kernel of `kvarn_kernels.mla_decode_attention`: `verified` "
        "dequantizes each chunk of records before its dots (all 26 MLA GPU tests passed, H100, "
        "2026-12-06, 67-194 GB/s at 16 heads); `fast` feeds the codes into the dots and scales "
        "the scores and weights by the steps and zeros (480-535 GB/s at 16 heads, but 7 of 32 "
        "MLA GPU tests failed on its errors: H100, 2026-12-06, "
        "[results](results/h100-2026-12-06b/README.md)); since `cd8f7d6` its codes are centred, "
        "which fixes those errors in a NumPy model of the GPU's rounding but has not run on a "
        "GPU ([MLA](mla.md#kernels)). Read at each call; an engine leaves it unset",
        use="measurement",
    )
    tiles_decode: bool = setting(
        "KVARN_KERNELS_TILES_DECODE",
        False,
        parse_flag,
        "0 or 1",
        "`1`: decode attention reads the records through the Triton tiles kernel "
        "(`kvarn_kernels.attention.tiles`, `c78c2d5`) where the Gluon kernel does not apply. "
        "Off by default: on an H100 (2026-12-06, "
        "[results](results/h100-2026-12-06b/README.md)) it read 518-694 GB/s at head_dim 64 "
        "(17-23% of the copy bandwidth, 0.74-1.04x SDPA over fp16 in the same run) and the run "
        "stopped with an illegal memory access at head_dim 256. Read when kvarn_kernels is imported",
        use="measurement",
    )
    git_sha: str | None = setting(
        "KVARN_GIT_SHA",
        None,
        str,
        "a commit id",
        "the commit `python -m kvarn_kernels.bench` records in its JSON, for code run from "
        "an exported tree (no `.git`); unset: `git rev-parse HEAD` of the checkout",
        use="run",
    )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KernelSettings:
        """The settings in ``environ`` (default ``os.environ``), validated, without keeping
        them (:func:`current` keeps the process's).

        Raises:
            ValueError: a variable holds a value it does not accept, naming it.
        """
        return read_environment(cls, environ)  # type: ignore[no-any-return]

    @property
    def launch_override(self) -> dict[str, int]:
        """:attr:`attn_launch` as a dict of launch parameters."""
        return dict(self.attn_launch)


_current: KernelSettings | None = None


def current() -> KernelSettings:
    """The process's settings: read from the environment on the first call, then kept."""
    global _current
    if _current is None:
        _current = KernelSettings.from_env()
    return _current


def reload(environ: Mapping[str, str] | None = None) -> KernelSettings:
    """Read the settings again (from ``environ``, default ``os.environ``) and keep them: for a
    process that changed its environment after the kernels first ran (tests, tools)."""
    global _current
    _current = KernelSettings.from_env(environ)
    return _current


@contextmanager
def override(**changes: Any) -> Iterator[KernelSettings]:
    """The current settings with ``changes`` (field names) for the ``with`` block, then the
    ones before: ``with override(autotune=True): ...``."""
    global _current
    before = current()
    _current = replace(before, **changes)
    try:
        yield _current
    finally:
        _current = before
