"""Shared test helpers: building caches from kvarn-math records, NaN-filled buffers."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
from hypothesis import settings
from kvarn_math import QuantizedSequence, get_preset, quantize_sequence, rotate, tile_layout

UNWRITTEN_BYTE = 0xFF  # fp16 0xFFFF is NaN: a kernel reading an unwritten record field sees NaN


def nan_like_staging(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def unwritten_cache(
    num_blocks: int, num_kv_heads: int, tile_bytes: int, device: str
) -> torch.Tensor:
    return torch.full(
        (num_blocks, num_kv_heads, tile_bytes), UNWRITTEN_BYTE, dtype=torch.uint8, device=device
    )


@dataclass
class PagedBatch:
    """Sequences laid out in a paged cache + staging the way the plugin would."""

    kv_cache: torch.Tensor
    staging: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    quantized_lens: torch.Tensor
    staging_slots: torch.Tensor
    refs: list[QuantizedSequence]
    sink_lens: torch.Tensor | None = None


def build_paged(
    seqs: list[tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]],
    preset: str,
    dtype: torch.dtype,
    device: str,
    staging_tiles: int = 1,
    uncommitted: list[int] | None = None,
    seed: int = 0,
    sinks: list[bool] | None = None,
    raw_keys: bool = False,
) -> PagedBatch:
    """Quantize sequences with kvarn-math, scatter records into random blocks, stage the tails.

    ``uncommitted[b]`` tokens at the end of sequence b are kept out of the tiles (as speculative
    tokens would be), so the staging may hold more than G tokens when ``staging_tiles`` is 2.
    The references returned hold exactly the records / tail the kernel will read.
    ``sinks``: staging gets the G sink rows in front; ``sinks[b]`` keeps sequence b's first
    tile exact there (its block is allocated but left unwritten: reading it would give NaN).
    ``raw_keys``: a random half of the records (per tile and KV head) store their keys in their
    own channels (the ``KEYS_UNROTATED`` flag), as ``store_kv(key_frame="auto")`` may write.
    """
    p = get_preset(preset)
    g = p.group_size
    rng = np.random.default_rng(seed)
    d = seqs[0][0].shape[-1]
    h = seqs[0][0].shape[1]
    lay = tile_layout(p, d)
    sg = staging_tiles * g
    base = 0 if sinks is None else g
    refs = []
    tiles_needed = []
    for i, (k, v) in enumerate(seqs):
        hold = 0 if uncommitted is None else uncommitted[i]
        t = k.shape[0]
        n_tiles = (t - hold) // g
        keep = bool(sinks and sinks[i] and n_tiles > 0)
        n_records = n_tiles - int(keep)
        raw = rng.random((max(n_records, 0), h)) < 0.5 if raw_keys else False
        q = quantize_sequence(
            k[: n_tiles * g], v[: n_tiles * g], p, keep_first_tile=keep, raw_keys=raw
        )
        tail_k, tail_v = k[n_tiles * g :], v[n_tiles * g :]
        if t - max(n_tiles * g, base) > sg:
            raise ValueError("test setup: tail does not fit the staging")
        refs.append(
            QuantizedSequence(p, d, q.records, tail_k.copy(), tail_v.copy(), q.first_k, q.first_v)
        )
        tiles_needed.append(n_tiles)
    max_blocks = max(tiles_needed) + 2
    num_blocks = sum(tiles_needed) + 3
    perm = rng.permutation(num_blocks)
    cache = unwritten_cache(num_blocks, h, lay.tile_bytes, "cpu")
    table = np.full((len(seqs), max_blocks), -1, dtype=np.int32)
    slots = rng.permutation(len(seqs) + 2)[: len(seqs)].astype(np.int32)
    staging = nan_like_staging((len(seqs) + 2, 2, base + sg, h, d), dtype, "cpu")
    used = 0

    def row(p: int) -> int:
        return p if p < base else base + (p - base) % sg

    for i, ref in enumerate(refs):
        skip = 0 if ref.first_k is None else 1  # the sink's block stays unwritten
        for t in range(tiles_needed[i]):
            blk = int(perm[used])
            used += 1
            table[i, t] = blk
            if t >= skip:
                cache[blk] = torch.from_numpy(ref.records[t - skip])
        staged: list[tuple[int, np.ndarray, np.ndarray]] = []
        if ref.first_k is not None and ref.first_v is not None:
            staged += [(j, ref.first_k[j], ref.first_v[j]) for j in range(g)]
        start = tiles_needed[i] * g
        staged += [(start + j, ref.tail_k[j], ref.tail_v[j]) for j in range(ref.tail_k.shape[0])]
        for pos, kj, vj in staged:
            staging[slots[i], 0, row(pos)] = torch.from_numpy(rotate(kj, axis=-1)).to(dtype)
            staging[slots[i], 1, row(pos)] = torch.from_numpy(rotate(vj, axis=-1)).to(dtype)
    seq_lens = np.array([k.shape[0] for k, _ in seqs], dtype=np.int32)
    qlens = np.array(tiles_needed, dtype=np.int32) * g
    return PagedBatch(
        kv_cache=cache.to(device),
        staging=staging.to(device),
        block_table=torch.from_numpy(table).to(device),
        seq_lens=torch.from_numpy(seq_lens).to(device),
        quantized_lens=torch.from_numpy(qlens).to(device),
        staging_slots=torch.from_numpy(slots).to(device),
        refs=refs,
        sink_lens=None
        if sinks is None
        else torch.tensor(
            [g if sinks[i] else 0 for i in range(len(seqs))], dtype=torch.int32, device=device
        ),
    )


def as_dtype(x: npt.NDArray[np.float32], dtype: torch.dtype) -> npt.NDArray[np.float32]:
    """``x`` rounded to ``dtype`` (K/V as a model hands them to the cache), back in float32."""
    return torch.from_numpy(np.ascontiguousarray(x)).to(dtype).float().numpy()


def through_dtype(x: npt.NDArray[np.float32], dtype: torch.dtype) -> npt.NDArray[np.float32]:
    """Original-frame K/V as a kernel sees them: rotated, rounded to ``dtype``, un-rotated in
    float64."""
    if dtype == torch.float32:
        return x
    from kvarn_math import unrotate

    r = torch.from_numpy(rotate(x, axis=-1)).to(dtype).double().numpy()
    return unrotate(r, axis=-1).astype(np.float32)


def staged_reference(ref: QuantizedSequence, dtype: torch.dtype) -> QuantizedSequence:
    """The reference seeing the staged tail as rounded to ``dtype`` (then un-rotated in float64)."""
    if dtype == torch.float32:
        return ref

    def through(x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        return through_dtype(x, dtype)

    def maybe(x: npt.NDArray[np.float32] | None) -> npt.NDArray[np.float32] | None:
        return None if x is None else through(x)

    return QuantizedSequence(
        ref.preset,
        ref.head_dim,
        ref.records,
        through(ref.tail_k),
        through(ref.tail_v),
        maybe(ref.first_k),
        maybe(ref.first_v),
        maybe(ref.recent_k),
        maybe(ref.recent_v),
        ref.window_keys,
    )


def examples(ci_count: int) -> settings:
    """``ci_count`` hypothesis examples under the ``ci`` profile (25 by default), scaled with the
    loaded profile (``dev`` doubles it, ``nightly`` gives 40x), for tests slow in the interpreter."""
    return settings(max_examples=max(1, ci_count * settings.default.max_examples // 25))


def set_env(monkeypatch, name: str, value: str | None) -> None:
    """Set (``value``) or unset (None) the environment variable ``name`` for one test and
    re-read the kernels' settings (``kvarn_kernels.settings`` reads them once; conftest re-reads
    them again after the test, once monkeypatch has restored the environment)."""
    from kvarn_kernels import settings as kernel_settings

    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
    kernel_settings.reload()
