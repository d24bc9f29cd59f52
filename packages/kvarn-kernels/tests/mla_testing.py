"""Helpers shared by the MLA kernel tests (interpreter and GPU): sequences of records plus a
staging ring, and their kvarn-math reference."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from kvarn_math.mla import (
    encode_latent_tiles,
    get_mla_preset,
    mla_layout,
    mla_reference_attention,
)
from kvarn_math.testing import make_kv


@dataclass
class MLABatch:
    """A paged batch: ``cache`` records, ``staging`` ring, tables and lengths (torch, on
    ``device``) and the numpy pieces the reference reads."""

    cache: torch.Tensor
    staging: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    quantized_lens: torch.Tensor
    staging_slots: torch.Tensor
    records: list[np.ndarray]
    tails: list[tuple[np.ndarray, np.ndarray]]


def build_batch(
    preset: str,
    seq_lens: list[int],
    quantized_lens: list[int],
    ring_tiles: int,
    dist: str = "gaussian",
    latent_dim: int = 512,
    rope_dim: int = 64,
    seed: int = 0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> MLABatch:
    """Sequences of ``seq_lens`` keys, the first ``quantized_lens`` in records (blocks placed
    in a shuffled order), the rest staged in slot ``len(seq_lens) - 1 - b`` of a ring of
    ``ring_tiles`` tiles (positions ``p`` at ring row ``p % (ring_tiles * G)``)."""
    p = get_mla_preset(preset)
    g = p.group_size
    lay = mla_layout(p, latent_dim, rope_dim)
    rng = np.random.default_rng(seed)
    tiles = [q // g for q in quantized_lens]
    max_tiles = max(1, max(-(-s // g) for s in seq_lens))
    total = sum(tiles) + 1
    order = rng.permutation(total)
    cache = np.zeros((total, lay.tile_bytes), np.uint8)
    table = np.full((len(seq_lens), max_tiles), total - 1, np.int32)
    ring = ring_tiles * g
    staging = np.full((len(seq_lens), ring, latent_dim + rope_dim), np.nan, np.float32)
    records, tails, used = [], [], 0
    for b, (s, q) in enumerate(zip(seq_lens, quantized_lens, strict=True)):
        lat = make_kv((s, latent_dim), dist, seed + 10 * b)
        pe = make_kv((s, rope_dim), dist, seed + 10 * b + 1)
        n = q // g
        rec = encode_latent_tiles(
            lat[:q].reshape(n, g, latent_dim), pe[:q].reshape(n, g, rope_dim), p
        )
        for t in range(n):
            cache[order[used]] = rec[t]
            table[b, t] = order[used]
            used += 1
        slot = len(seq_lens) - 1 - b
        for pos in range(q, s):
            staging[slot, pos % ring] = np.concatenate([lat[pos], pe[pos]])
        records.append(rec)
        tails.append((_as(lat[q:], dtype), _as(pe[q:], dtype)))
    i32 = {"dtype": torch.int32, "device": device}
    return MLABatch(
        cache=torch.from_numpy(cache).to(device),
        staging=torch.from_numpy(staging).to(device=device, dtype=dtype),
        block_table=torch.from_numpy(table).to(device),
        seq_lens=torch.tensor(seq_lens, **i32),
        quantized_lens=torch.tensor(quantized_lens, **i32),
        staging_slots=torch.tensor([len(seq_lens) - 1 - b for b in range(len(seq_lens))], **i32),
        records=records,
        tails=tails,
    )


def _as(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """``x`` rounded through ``dtype`` (the staging's), as float32."""
    return torch.from_numpy(np.ascontiguousarray(x)).to(dtype).float().numpy()


def reference(batch: MLABatch, q_lat: np.ndarray, q_pe: np.ndarray, preset: str, scale: float):
    """kvarn-math's attention per sequence (zeros for a sequence without keys)."""
    out = np.zeros(q_lat.shape, np.float32)
    for b, rec in enumerate(batch.records):
        tail_lat, tail_pe = batch.tails[b]
        if rec.shape[0] + tail_lat.shape[0] == 0:
            continue
        out[b] = mla_reference_attention(q_lat[b], q_pe[b], rec, tail_lat, tail_pe, preset, scale)
    return out
