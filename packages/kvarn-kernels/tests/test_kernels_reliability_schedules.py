"""Random schedules of the host planner and the store: chunked prefill, prefix-cache hits,
preemption and recompute, speculative steps accepting any number of drafts. The records
written equal, byte for byte, those of storing each accepted token once (the dense tiles)."""

from __future__ import annotations

import kvarn_kernels as kk
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_testing import examples, nan_like_staging, unwritten_cache
from kvarn_math import rotate, tile_layout
from kvarn_math.testing import make_kv

pytestmark = pytest.mark.interpreter

PRESET, D, G, H = "kvarn_k4v2_g64", 64, 64, 1
T = 2 * G + 5  # two records and an open tile
STEP = st.one_of(
    st.tuples(st.just("chunk"), st.sampled_from([1, 5, 63, 64, 70])),
    # a verify step: the next token and `drafts` drafts, of which the first `accepted` are right
    st.integers(1, 4).flatmap(lambda n: st.tuples(st.just("spec"), st.just(n), st.integers(0, n))),
    # preempted: recomputed later into other blocks and another slot, keeping the first
    # `keep` complete tiles through the prefix cache
    st.tuples(st.just("preempt"), st.integers(0, 1)),
)


@examples(6)
@given(st.integers(0, 1), st.lists(STEP, min_size=1, max_size=8), st.integers(0, 2**31))
def test_random_schedules_store_each_accepted_token_once(
    hit: int, steps: list[tuple], seed: int
) -> None:
    k = make_kv((T, H, D), "outlier_channels", seed % 1000)
    v = make_kv((T, H, D), "gaussian", seed % 1000 + 1)
    kt, vt = torch.from_numpy(k), torch.from_numpy(v)
    dense = kk.quantize_tiles(
        kt[: 2 * G].reshape(2, G, H, D).transpose(1, 2),
        vt[: 2 * G].reshape(2, G, H, D).transpose(1, 2),
        PRESET,
    )  # fmt: skip  [2 tiles, H, tile_bytes]
    lay = tile_layout(PRESET, D)
    cache = unwritten_cache(16, H, lay.tile_bytes, "cpu")
    staging = nan_like_staging(kk.staging_shape(4, H, D, PRESET, staging_tiles=2), torch.float32, "cpu")  # fmt: skip
    rng = np.random.default_rng(seed)
    table = rng.permutation(16)[:4].astype(np.int32)[None]
    slot = int(rng.integers(0, 4))
    # a prefix-cache hit: another request wrote tile 0's record; this one starts after it
    if hit:
        cache[table[0, 0]] = dense[0]
    cached = quant = hit * G

    def store(num_new: int, committed: int | None, keys: torch.Tensor, vals: torch.Tensor) -> int:
        plan = kk.plan_store(
            [cached], [num_new], None if committed is None else [committed], [slot], table,
            PRESET, staging_tiles=2, num_quantized=[quant],
        )  # fmt: skip
        kk.store_kv(keys, vals, cache, staging, plan, PRESET)
        return int(plan.quantized_lens[0])

    for step in [*steps, ("chunk", T)]:
        if step[0] == "preempt":
            keep = min(step[1], quant // G)
            fresh = [b for b in rng.permutation(16) if b not in table[0, :keep]]
            table = np.concatenate([table[0, :keep], fresh[: 4 - keep]]).astype(np.int32)[None]
            slot = (slot + 1) % 4
            staging[slot] = float("nan")
            cached = quant = keep * G
            continue
        if step[0] == "chunk":
            n = min(step[1], T - cached)
            if n <= 0:
                continue
            quant = store(n, None, kt[cached : cached + n], vt[cached : cached + n])
            cached += n
            continue
        drafts = min(step[1], T - cached - 1)
        if drafts < 1:
            continue
        accepted = min(step[2], drafts)
        real = slice(cached, cached + 1 + accepted)
        junk = torch.from_numpy(make_kv((drafts - accepted, H, D), "gaussian", cached) * 50)
        keys, vals = torch.cat([kt[real], junk]), torch.cat([vt[real], junk])
        quant = store(1 + drafts, cached + 1, keys, vals)
        cached += 1 + accepted
    assert cached == T
    assert quant == 2 * G
    for i in range(2):
        torch.testing.assert_close(cache[table[0, i]], dense[i], rtol=0, atol=0)
    staged = staging[slot, 0, : T - 2 * G].float().numpy()
    np.testing.assert_array_equal(staged[:, 0], rotate(k[2 * G :, 0], axis=-1))
