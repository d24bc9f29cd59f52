"""The kernels together, as an engine drives them: plan -> store -> attend, step after step."""

from __future__ import annotations

import kvarn_kernels as kk
import numpy as np
import pytest
import torch
from kernel_testing import nan_like_staging, unwritten_cache
from kvarn_math import (
    QuantizedSequence,
    get_preset,
    quantize_sequence,
    reference_attention,
    step_sequence,
)
from kvarn_math.testing import assert_close_rms, make_kv

pytestmark = pytest.mark.interpreter


@pytest.mark.parametrize(
    ("sink", "recent", "window_keys", "preset"),
    [
        (False, 0, True, "kvarn_k4v2_g64"),
        (True, 0, True, "kvarn_k4v2_g64"),
        (False, 1, True, "kvarn_k4v2_g64"),
        (True, 1, True, "kvarn_k4v2_g64"),
        (True, 0, False, "kvarn_k4v2_g64"),
        (False, 1, False, "kvarn_k4v2_g64"),
        (True, 1, False, "kvarn_k4v2_g64"),
        # 2-bit keys from the records: the generic (not nibble-split) window step
        (True, 1, False, "kvarn_k2v2_g128"),
    ],
)
def test_prefill_then_decode_matches_reference(
    sink: bool, recent: int, window_keys: bool, preset: str
) -> None:
    """Two requests: chunked prefill, then decode steps across a tile boundary.

    With ``sink`` the first tile stays exact in the staging's sink rows (attention reads it
    there) while its quantized record is still written, identical to the no-sink record.
    With ``recent`` the complete tile before the step's token stays in the ring too and
    attention reads it there (the plan's ``attention_lens``), its record written all the same.
    Without ``window_keys`` those windows keep only their values (their keys are read from
    the records; the key ring holds the open tile): the continuation chunk (multi-query, its
    own tokens exact) and every decode step match kvarn_math's ``window_keys=False``.
    """
    d, h, hq = 64, 2, 4
    g = get_preset(preset).group_size
    lens = [2 * g - 4, 30]  # request 0 crosses into its third tile while decoding
    total = [t + 8 for t in lens]
    seqs = [
        (make_kv((t, h, d), "outlier_channels", i), make_kv((t, h, d), "gaussian", 7 + i))
        for i, t in enumerate(total)
    ]
    lay = kk.cache_shape(8, h, d, preset)
    cache = unwritten_cache(*lay, "cpu")
    s_tiles = 1 + recent
    key_tiles = None if window_keys else s_tiles - recent
    staging = nan_like_staging(
        kk.staging_shape(3, h, d, preset, staging_tiles=s_tiles, sink=sink, key_tiles=key_tiles),
        torch.float32,
        "cpu",
    )
    table = np.array([[6, 2, 5], [0, 7, 3]], dtype=np.int32)
    sink_lens = torch.tensor([g, g], dtype=torch.int32) if sink else None
    slots = [2, 0]
    bt = torch.from_numpy(table)
    cached = [0, 0]
    steps = [[50, 30], [lens[0] - 50, 0]] + [[1, 1]] * 8
    for new in steps:
        keys = torch.cat(
            [torch.from_numpy(k[c : c + n]) for (k, _), c, n in zip(seqs, cached, new, strict=True)]
        )
        vals = torch.cat(
            [torch.from_numpy(v[c : c + n]) for (_, v), c, n in zip(seqs, cached, new, strict=True)]
        )
        plan = kk.plan_store(
            cached,
            new,
            None,
            slots,
            table,
            preset,
            staging_tiles=s_tiles,
            sink=sink,
            recent_tiles=recent,
            exact_start=[0, 0],
            window_keys=window_keys,
        )
        assert plan.key_tiles == key_tiles
        kk.store_kv(keys, vals, cache, staging, plan, preset)
        before = cached
        cached = [c + n for c, n in zip(cached, new, strict=True)]
        windows = dict(key_lens=plan.key_read_lens, key_tiles=key_tiles)
        if before[0] and new[0] > 1:
            # the continuation chunk of request 0 (request 1 adds nothing): its own K/V exact
            n0 = new[0]
            q = make_kv((n0, hq, d), "gaussian", 99)
            out = kk.multi_query_attention(
                torch.from_numpy(q),
                torch.tensor([0, n0, n0], dtype=torch.int32),
                cache,
                staging,
                bt,
                plan.seq_lens,
                plan.attention_lens,
                torch.tensor(slots, dtype=torch.int32),
                preset,
                d**-0.5,
                max_query_len=n0,
                sink_lens=sink_lens,
                fresh_kv=(kk.rotate(keys[:n0]), kk.rotate(vals[:n0])),
                **windows,
            )
            k, v = seqs[0]
            ref = step_sequence(
                k[: cached[0]],
                v[: cached[0]],
                preset,
                before[0],
                recent_tiles=recent,
                ring_tiles=s_tiles,
                keep_first_tile=sink and cached[0] >= g,
                window_keys=window_keys,
            )
            exact = (k[before[0] : cached[0]], v[before[0] : cached[0]])
            want = reference_attention(q, ref, d**-0.5, exact_kv=exact)
            assert_close_rms(want, out[:n0].numpy(), 1e-4, what=f"chunk {before} -> {cached}")
        if new == [1, 1]:
            q = make_kv((2, hq, d), "gaussian", sum(cached))
            out = kk.decode_attention(
                torch.from_numpy(q),
                cache,
                staging,
                bt,
                plan.seq_lens,
                plan.attention_lens,
                torch.tensor(slots, dtype=torch.int32),
                preset,
                d**-0.5,
                num_splits=2,
                sink_lens=sink_lens,
                **windows,
            )
            for b, (k, v) in enumerate(seqs):
                ref = step_sequence(
                    k[: cached[b]],
                    v[: cached[b]],
                    preset,
                    cached[b] - 1,
                    recent_tiles=recent,
                    ring_tiles=s_tiles,
                    keep_first_tile=sink and cached[b] >= g,
                    window_keys=window_keys,
                )
                want = reference_attention(q[b : b + 1], ref, d**-0.5)
                assert_close_rms(want, out[b : b + 1].numpy(), 1e-4, what=f"step {cached}, seq {b}")
    # Every completed tile has its record, sink or not (prefix-cache hits read tile 0 quantized).
    k0, v0 = seqs[0]
    records = quantize_sequence(k0[: 2 * g], v0[: 2 * g], preset).records
    from kvarn_math import read_fields

    for t, blk in enumerate(table[0, :2]):
        got, want = read_fields(cache[blk].numpy(), preset, d), read_fields(records[t], preset, d)
        assert (got.k_codes == want.k_codes).mean() >= 0.999, f"tile {t}"
        assert (got.v_codes == want.v_codes).mean() >= 0.999, f"tile {t}"


def test_speculative_verify_then_commit() -> None:
    """Verify step with 4 drafts (S=2 staging), MQA over them, then keep 2 and continue."""
    preset, d, h, hq = "kvarn_k4v2_g64", 64, 1, 2
    g = get_preset(preset).group_size
    t0 = g - 2  # the drafts complete the first tile, which must stay unquantized (uncommitted)
    k = make_kv((t0 + 10, h, d), "heavy_tailed", 1)
    v = make_kv((t0 + 10, h, d), "gaussian", 2)
    cache = unwritten_cache(*kk.cache_shape(4, h, d, preset), "cpu")
    staging = nan_like_staging(
        kk.staging_shape(1, h, d, preset, staging_tiles=2), torch.float32, "cpu"
    )
    table = np.array([[3, 1]], dtype=np.int32)
    kt, vt = torch.from_numpy(k), torch.from_numpy(v)
    plan = kk.plan_store([0], [t0], None, [0], table, preset, staging_tiles=2)
    kk.store_kv(kt[:t0], vt[:t0], cache, staging, plan, preset)
    # verify: last sampled token + 4 drafts (positions t0 .. t0+4); only the first is committed
    drafts = torch.from_numpy(make_kv((4, h, d), "gaussian", 9))
    keys, vals = torch.cat([kt[t0 : t0 + 1], drafts]), torch.cat([vt[t0 : t0 + 1], drafts])
    plan = kk.plan_store(
        [t0], [5], [t0 + 1], [0], table, preset, staging_tiles=2, num_quantized=[0]
    )
    kk.store_kv(keys, vals, cache, staging, plan, preset)
    assert plan.quantized_lens.tolist() == [0]  # tile 0 is full but not committed
    q = make_kv((5, hq, d), "gaussian", 3)
    out = kk.multi_query_attention(
        torch.from_numpy(q),
        torch.tensor([0, 5], dtype=torch.int32),
        cache,
        staging,
        torch.from_numpy(table),
        plan.seq_lens,
        plan.quantized_lens,
        torch.tensor([0], dtype=torch.int32),
        preset,
        d**-0.5,
        max_query_len=5,
    )
    k_all = torch.cat([kt[: t0 + 1], drafts]).numpy()
    v_all = torch.cat([vt[: t0 + 1], vals[1:]]).numpy()
    ref = QuantizedSequence(
        get_preset(preset),
        d,
        np.zeros((0, h, kk.cache_shape(1, h, d, preset)[2]), np.uint8),
        k_all,
        v_all,
    )
    assert_close_rms(reference_attention(q, ref, d**-0.5), out.numpy(), 1e-4)
    # One draft accepted: its K/V (drafts[0], computed in the verify step) stays in staging and
    # is now committed; the 3 rejected drafts' positions are overwritten by the next tokens.
    cached = t0 + 1 + 1
    keys = kt[cached : cached + 3]
    vals = vt[cached : cached + 3]
    plan = kk.plan_store(
        [cached],
        [3],
        None,
        [0],
        table,
        preset,
        staging_tiles=2,
        num_quantized=plan.quantized_lens.tolist(),
    )
    kk.store_kv(keys, vals, cache, staging, plan, preset)
    assert plan.quantized_lens.tolist() == [g]
    seq_k = np.concatenate([k[: t0 + 1], drafts[:1].numpy(), k[cached : cached + 3]])
    seq_v = np.concatenate([v[: t0 + 1], drafts[:1].numpy(), v[cached : cached + 3]])
    want = quantize_sequence(seq_k, seq_v, preset).records[0]
    got = cache[3].numpy()
    from kvarn_math import read_fields

    fg, fw = read_fields(got, preset, d), read_fields(want, preset, d)
    assert (fg.k_codes == fw.k_codes).mean() >= 0.999 and (fg.v_codes == fw.v_codes).mean() >= 0.999
