"""The records a request's tiles hold in the paged cache, checked against kvarn-math.

The kernels and NumPy may round a tile's balancing factor to neighbouring log8 codes (another
summation order picks another, equally balanced normalization iteration): two equally good
quantizations, whose attention outputs differ by up to the quantization error itself. Tests of
attention therefore read the cache's own records, after checking that those encode exactly the
tokens they should: their reconstruction error equals that of kvarn-math's records of the same
tokens, in the key frame each record says it holds (the store chooses it from the queries). A
record holding another token (a rejected draft, a stale write) is off by the size of the token.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch


def cached_records(kv_cache, block_row, kf, vf, seq, preset, head_dim, drift=0.05):
    """``seq`` (a kvarn-math ``QuantizedSequence`` of ``kf``/``vf``) with its records replaced
    by the ones the cache holds in the blocks of ``block_row``, after the check above.

    ``seq.records`` covers the tiles after an exact first tile, or from tile 0 otherwise.
    """
    from kvarn_math import dequantize_tiles, quantize_tiles, read_fields
    from kvarn_math.metrics import relative_error

    n, heads = seq.records.shape[:2]
    if n == 0:
        return seq
    g = seq.preset.group_size
    first = seq.first_record // g  # an exact whole tile 0 (keys too) has no record read
    blocks = torch.as_tensor(block_row[first : first + n]).long()
    got = kv_cache[blocks].numpy().reshape(seq.records.shape)
    tiles = []
    for x in (kf, vf):
        exact = np.asarray(x[first * g : (first + n) * g], np.float32)
        tiles.append(exact.reshape(n, g, heads, head_dim).transpose(0, 2, 1, 3))
    raw = read_fields(got, preset, head_dim).raw_keys
    ref = quantize_tiles(tiles[0], tiles[1], preset, raw_keys=raw) if raw.any() else seq.records
    for i, exact in enumerate(tiles):
        e_got = relative_error(exact, dequantize_tiles(got, preset, head_dim)[i])
        e_ref = relative_error(exact, dequantize_tiles(ref, preset, head_dim)[i])
        assert abs(e_got - e_ref) <= drift * e_ref, ("KV"[i], e_got, e_ref)
    return dataclasses.replace(seq, records=got)
