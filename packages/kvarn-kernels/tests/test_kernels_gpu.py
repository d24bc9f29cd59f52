"""GPU tests (``pytest -m gpu``): the CPU properties at realistic sizes, plus adversarial tiles."""

from __future__ import annotations

from dataclasses import replace

import kvarn_kernels as kk
import numpy as np
import pytest
import torch
from kernel_testing import (
    as_dtype,
    build_paged,
    nan_like_staging,
    set_env,
    staged_reference,
    unwritten_cache,
)
from kvarn_math import PRESETS, encode_tiles, get_preset, reference_attention, rotate, tile_layout
from kvarn_math import decode_tiles as ref_decode_tiles
from kvarn_math import quantize_tiles as ref_quantize_tiles
from kvarn_math.testing import assert_close_rms, make_kv
from test_kernels_attention import _batch_args, decode_as_rows, run_fresh
from test_kernels_plan import (
    DRAFT_PLANNER_CASES,
    PLANNER_CASES,
    draft_planner_case,
    planner_case,
)
from test_kernels_store import assert_records_match

pytestmark = pytest.mark.gpu
DEV = "cuda"
# fp16/bf16: the tensor-core dots take fp16 operands, so a logit carries an error of about
# 2^-11 of its magnitude; the 2000-token outlier-channel sequences here have larger logits than
# the CPU tests' and measured 4.4e-3 to 4.9e-3 in fp16 on the H200 (2026-11-30).
TOL = {torch.float32: 1e-4, torch.float16: 6e-3, torch.bfloat16: 2.5e-2}


# head_dim 256 with 128-token tiles: the largest tile a dense model has (Gemma-3); its store once
# needed more shared memory than an SM has (found on the H200 through vLLM, 2026-11-30).
_QUANT_CASES = [(p, 128) for p in PRESETS] + [
    ("kvarn_k4v2_g128", 64),
    ("kvarn_k4v4_g64", 256),
    ("kvarn_k4v2_g128", 256),
    ("kvarn_k3v2_g128", 256),
]


@pytest.mark.parametrize(("preset", "head_dim"), _QUANT_CASES)
def test_quantize_tiles_matches_reference(preset: str, head_dim: int) -> None:
    g = get_preset(preset).group_size
    k = make_kv((16, g, head_dim), "outlier_channels", 1)
    v = make_kv((16, g, head_dim), "heavy_tailed", 2)
    got = (
        kk.quantize_tiles(torch.from_numpy(k).to(DEV), torch.from_numpy(v).to(DEV), preset)
        .cpu()
        .numpy()
    )
    assert_records_match(
        got,
        ref_quantize_tiles(k, v, preset),
        rotate(k, axis=-1),
        rotate(v, axis=-1),
        preset,
        head_dim,
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("d", "h"), [(128, 8), (256, 1)])
def test_store_kv_chunked_prefill_and_decode(dtype: torch.dtype, d: int, h: int) -> None:
    """Llama-like layer (8 KV heads, D=128) and Gemma-3-like (1 KV head, D=256), G=128;
    3 requests, chunked prefill then decode."""
    preset, g = "kvarn_k4v2_g128", 128
    lens = [1000, 300, 129]
    seqs = [
        (make_kv((t, h, d), "outlier_channels", i), make_kv((t, h, d), "gaussian", 10 + i))
        for i, t in enumerate(lens)
    ]
    lay = tile_layout(preset, d)
    cache = unwritten_cache(64, h, lay.tile_bytes, DEV)
    staging = nan_like_staging(kk.staging_shape(4, h, d, preset), dtype, DEV)
    table = np.arange(60, dtype=np.int32)[::-1].reshape(3, 20).copy()
    slots = [3, 0, 2]
    cached = [0, 0, 0]
    schedule = [[512, 100, 100], [488, 100, 28], [0, 100, 1], [0, 0, 0]]
    for step in schedule:
        new = [min(n, t - c) for n, t, c in zip(step, lens, cached, strict=True)]
        if not any(new):
            break
        keys = torch.cat(
            [torch.from_numpy(k[c : c + n]) for (k, _), c, n in zip(seqs, cached, new, strict=True)]
        )
        vals = torch.cat(
            [torch.from_numpy(v[c : c + n]) for (_, v), c, n in zip(seqs, cached, new, strict=True)]
        )
        plan = kk.plan_store(cached, new, None, slots, table, preset).to(DEV)
        kk.store_kv(keys.to(DEV, dtype), vals.to(DEV, dtype), cache, staging, plan, preset)
        cached = [c + n for c, n in zip(cached, new, strict=True)]
    assert cached == lens
    for i, (k, v) in enumerate(seqs):
        n = lens[i] // g
        got = cache[table[i, :n].tolist()].cpu().numpy()  # [n, h, tile_bytes]
        tk = (
            as_dtype(rotate(as_dtype(k[: n * g], dtype), axis=-1), dtype)
            .reshape(n, g, h, d)
            .transpose(0, 2, 1, 3)
        )
        tv = (
            as_dtype(rotate(as_dtype(v[: n * g], dtype), axis=-1), dtype)
            .reshape(n, g, h, d)
            .transpose(0, 2, 1, 3)
        )
        assert_records_match(got, encode_tiles(tk, tv, preset), tk, tv, preset, d)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "preset", ["kvarn_k4v2_g128", "kvarn_k4v4_g64", "kvarn_k3v2_g128", "kvarn_k2v2_g128"]
)
@pytest.mark.parametrize(("head_dim", "hq", "hkv"), [(128, 32, 8), (64, 16, 2), (256, 8, 1)])
def test_decode_attention_realistic(
    dtype: torch.dtype, preset: str, head_dim: int, hq: int, hkv: int
) -> None:
    g = get_preset(preset).group_size
    lens = [1, g - 1, g, 2000, 3 * g + 1]
    seqs = [
        (
            make_kv((t, hkv, head_dim), "outlier_channels", i),
            make_kv((t, hkv, head_dim), "gaussian", 9 + i),
        )
        for i, t in enumerate(lens)
    ]
    batch = build_paged(seqs, preset, dtype, DEV)
    q = make_kv((len(lens), hq, head_dim), "gaussian", 3)
    scale = head_dim**-0.5
    for window in (None, 700):
        out = torch.full((len(lens), hq, head_dim), float("nan"), dtype=dtype, device=DEV)
        kk.decode_attention(
            torch.from_numpy(q).to(DEV, dtype),
            batch.kv_cache,
            batch.staging,
            batch.block_table,
            batch.seq_lens,
            batch.quantized_lens,
            batch.staging_slots,
            preset,
            scale,
            sliding_window=window,
            out=out,
        )
        q_in = torch.from_numpy(q).to(dtype).float().numpy()
        for b, ref in enumerate(batch.refs):
            want = reference_attention(q_in[b : b + 1], staged_reference(ref, dtype), scale, window)
            assert_close_rms(
                want,
                out[b : b + 1].float().cpu().numpy(),
                TOL[dtype],
                what=f"seq {b} window {window}",
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multi_query_attention_realistic(dtype: torch.dtype) -> None:
    preset, d, hq, hkv = "kvarn_k4v2_g128", 128, 32, 8
    lens, nqs = [700, 260, 5], [8, 200, 5]
    seqs = [
        (make_kv((t, hkv, d), "heavy_tailed", i), make_kv((t, hkv, d), "gaussian", 5 + i))
        for i, t in enumerate(lens)
    ]
    batch = build_paged(seqs, preset, dtype, DEV, staging_tiles=2, uncommitted=[8, 0, 5])
    loc = np.concatenate([[0], np.cumsum(nqs)]).astype(np.int32)
    q = make_kv((int(loc[-1]), hq, d), "gaussian", 4)
    scale = d**-0.5
    out = kk.multi_query_attention(
        torch.from_numpy(q).to(DEV, dtype),
        torch.from_numpy(loc).to(DEV),
        batch.kv_cache,
        batch.staging,
        batch.block_table,
        batch.seq_lens,
        batch.quantized_lens,
        batch.staging_slots,
        preset,
        scale,
    )
    q_in = torch.from_numpy(q).to(dtype).float().numpy()
    for b, ref in enumerate(batch.refs):
        rows = slice(int(loc[b]), int(loc[b + 1]))
        want = reference_attention(q_in[rows], staged_reference(ref, dtype), scale)
        assert_close_rms(want, out[rows].float().cpu().numpy(), TOL[dtype], what=f"seq {b}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 700])
def test_multi_query_fresh_kv_realistic(dtype: torch.dtype, window: int | None) -> None:
    """Long chunks attend their own tokens from the step's K/V, not from the records their
    store completed (nor from staging, NaN there): 1500 of 2000 tokens, 300 of 700."""
    case = {
        "preset": "kvarn_k4v2_g128",
        "head_dim": 128,
        "num_kv_heads": 8,
        "group": 4,
        "lens": [2000, 700],
        "num_q": [1500, 300],
        "splits": None,
        "window": window,
        "seed": 21,
        "sinks": [True, False, False],
    }
    run_fresh(case, dtype, DEV, TOL[dtype])


def test_rotate_and_dequantize_on_gpu() -> None:
    x = make_kv((1000, 128), "heavy_tailed", 0)
    np.testing.assert_array_equal(kk.rotate(torch.from_numpy(x).to(DEV)).cpu().numpy(), rotate(x))
    preset, d = "kvarn_k4v2_g128", 128
    k, v = make_kv((4, 128, d), "outlier_channels", 1), make_kv((4, 128, d), "gaussian", 2)
    rec = ref_quantize_tiles(k, v, preset)
    kg, vg = kk.decode_tiles(torch.from_numpy(rec).to(DEV), preset, d)
    kw, vw = ref_decode_tiles(rec, preset, d)
    np.testing.assert_allclose(kg.cpu().numpy(), kw, rtol=1e-5, atol=1e-5 * np.abs(kw).max())
    np.testing.assert_allclose(vg.cpu().numpy(), vw, rtol=1e-5, atol=1e-5 * np.abs(vw).max())


def _adversarial(kind: str, g: int, d: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    if kind == "zero":
        return np.zeros((g, d), np.float32)
    if kind == "constant":
        return np.full((g, d), 3.25, np.float32)
    if kind == "outliers":
        x = rng.standard_normal((g, d)).astype(np.float32)
        x[rng.integers(0, g, 5), rng.integers(0, d, 5)] = 1e4
        return x
    if kind == "fp16_max":
        x = rng.choice(np.array([-65504.0, 65504.0], np.float32), size=(g, d))
        x[:, 0] = 65504.0
        return x
    if kind == "one_hot":
        x = np.zeros((g, d), np.float32)
        x[3, 7] = 1.0
        return x
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["zero", "constant", "outliers", "fp16_max", "one_hot"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_adversarial_tiles_stay_finite(kind: str, dtype: torch.dtype) -> None:
    preset, d, g = "kvarn_k4v2_g128", 128, 128
    x = _adversarial(kind, g, d)
    t = 2 * g + 3
    k = np.concatenate([x, x, x[:3]])[:, None, :]
    v = np.concatenate([x[::-1], x, x[:3]])[:, None, :]
    lay = tile_layout(preset, d)
    cache = unwritten_cache(4, 1, lay.tile_bytes, DEV)
    # rotated fp16-max tokens exceed the fp16 range: the store saturates them to +-65504
    staging = nan_like_staging(kk.staging_shape(1, 1, d, preset), dtype, DEV)
    table = np.array([[2, 0, 1]], dtype=np.int32)
    plan = kk.plan_store([0], [t], None, [0], table, preset).to(DEV)
    kt = torch.from_numpy(k).to(DEV, dtype)
    vt = torch.from_numpy(v).to(DEV, dtype)
    kk.store_kv(kt, vt, cache, staging, plan, preset)
    rec = cache[[2, 0]].cpu().numpy()
    fields = rec.view(np.uint8)
    kd, vd = ref_decode_tiles(fields, preset, d)
    assert np.isfinite(kd).all() and np.isfinite(vd).all(), "records decode to non-finite values"
    q = torch.randn(1, 4, d, device=DEV, dtype=dtype)
    out = kk.decode_attention(
        q,
        cache,
        staging,
        torch.from_numpy(table).to(DEV),
        torch.tensor([t], dtype=torch.int32, device=DEV),
        torch.tensor([2 * g], dtype=torch.int32, device=DEV),
        torch.tensor([0], dtype=torch.int32, device=DEV),
        preset,
        d**-0.5,
    )
    assert torch.isfinite(out).all()


def test_large_cache_offsets_use_int64() -> None:
    """A block beyond 2**31 bytes into the cache is read and written correctly."""
    preset, d, h = "kvarn_k4v2_g64", 128, 8
    lay = tile_layout(preset, d)
    num_blocks = (2**31) // (h * lay.tile_bytes) + 8
    cache = torch.zeros((num_blocks, h, lay.tile_bytes), dtype=torch.uint8, device=DEV)
    k = make_kv((1, h, 64, d), "gaussian", 0)
    v = make_kv((1, h, 64, d), "gaussian", 1)
    want = kk.quantize_tiles(torch.from_numpy(k).to(DEV), torch.from_numpy(v).to(DEV), preset)
    last = num_blocks - 1
    staging = torch.zeros(kk.staging_shape(1, h, d, preset), device=DEV)
    plan = kk.plan_store([0], [64], None, [0], [[last]], preset).to(DEV)
    kk.store_kv(
        torch.from_numpy(k[0].transpose(1, 0, 2).copy()).to(DEV),
        torch.from_numpy(v[0].transpose(1, 0, 2).copy()).to(DEV),
        cache,
        staging,
        plan,
        preset,
    )
    torch.testing.assert_close(cache[last], want[0], rtol=0, atol=0)
    kd, _ = kk.dequantize(
        cache, torch.tensor([last], dtype=torch.int32, device=DEV), preset, d, dtype=torch.float32
    )
    kw, _ = ref_decode_tiles(want[0].cpu().numpy(), preset, d)
    np.testing.assert_allclose(kd.cpu().numpy().transpose(1, 0, 2), kw, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("sinks", "window"), [(False, None), (True, None), (True, 700)])
@pytest.mark.parametrize(("d", "h", "group"), [(128, 8, 4), (64, 3, 3)])
def test_batch_invariant_mode_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, d: int, h: int, group: int, sinks: bool, window: int | None
) -> None:
    """KVARN_KERNELS_BATCH_INVARIANT=1 on the GPU: a verify row (multi-query block) has the
    bits of the decode row of its position, alone or in another batch."""
    from kvarn_kernels.attention import launch
    from test_kernels_attention import batch_invariance_case

    # Two splits at these lengths (passed on the H200 with 1024, 2026-11-30: commit 493abb8).
    monkeypatch.setattr(launch, "_MIN_SPLIT_TOKENS", 1024)
    set_env(monkeypatch, "KVARN_KERNELS_BATCH_INVARIANT", "1")
    mqa, alone, both = batch_invariance_case(DEV, d, h, group, [2000, 700], sinks, window)
    for j, (a, b) in enumerate(zip(alone, both, strict=True)):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), ("batch", j)
        assert torch.equal(a.view(torch.int16), mqa[j : j + 1].view(torch.int16)), ("verify", j)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hkv"), [(32, 8), (64, 8), (8, 8)])
@pytest.mark.parametrize("raw_keys", [False, True])
@pytest.mark.parametrize("invariant", ["0", "1"])
@pytest.mark.parametrize("preset", ["kvarn_k4v2_g128", "kvarn_k4v4_g128"])
def test_fast_decode_matches_the_triton_kernel(
    preset: str,
    dtype: torch.dtype,
    hq: int,
    hkv: int,
    raw_keys: bool,
    invariant: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Gluon kernel of the quantized tiles (``preset``, head_dim 128) against the
    Triton kernel alone and the reference: sink rows, staging, half the tiles' keys in their
    own channels, sequences with no record at all; in the default launch and batch-invariant
    (``invariant``: the Gluon kernel's splits at fixed positions, 8 tiles each, so the
    9000-token sequence spans nine)."""
    from kvarn_kernels.attention.launch import fast_decode_applies

    set_env(monkeypatch, "KVARN_KERNELS_BATCH_INVARIANT", invariant)

    d, g = 128, 128
    lens = [1, g - 1, g + 5, 2000, 5 * g, 9000]
    seqs = [
        (
            make_kv((t, hkv, d), "outlier_channels", 20 + i),
            make_kv((t, hkv, d), "gaussian", 40 + i),
        )
        for i, t in enumerate(lens)
    ]
    sinks = [i % 2 == 0 for i in range(len(lens))]
    batch = build_paged(seqs, preset, dtype, DEV, sinks=sinks, raw_keys=raw_keys)
    q = torch.from_numpy(make_kv((len(lens), hq, d), "gaussian", 5)).to(DEV, dtype)
    scale = d**-0.5
    outs = {}
    for fast in ("1", "0"):
        set_env(monkeypatch, "KVARN_KERNELS_FAST_DECODE", fast)
        assert fast_decode_applies(q, tile_layout(preset, d), hkv, None) == (fast == "1")
        outs[fast] = kk.decode_attention(
            q,
            batch.kv_cache,
            batch.staging,
            batch.block_table,
            batch.seq_lens,
            batch.quantized_lens,
            batch.staging_slots,
            preset,
            scale,
            sink_lens=batch.sink_lens,
            raw_keys=raw_keys,
        )
    assert torch.isfinite(outs["1"].float()).all()
    q_in = q.float().cpu().numpy()
    for b, ref in enumerate(batch.refs):
        want = reference_attention(q_in[b : b + 1], staged_reference(ref, dtype), scale)
        for fast, out in outs.items():
            assert_close_rms(
                want, out[b : b + 1].float().cpu().numpy(), TOL[dtype], what=f"seq {b} fast {fast}"
            )
        assert_close_rms(
            outs["0"][b].float().cpu().numpy(),
            outs["1"][b].float().cpu().numpy(),
            TOL[dtype],
            what=f"seq {b}: fast against Triton",
        )


@pytest.mark.parametrize("invariant", ["0", "1"])
@pytest.mark.parametrize("preset", ["kvarn_k4v2_g128", "kvarn_k4v4_g128"])
def test_fast_decode_prefetch_changes_no_bit(
    preset: str, invariant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``KVARN_KERNELS_FAST_PREFETCH`` (L2 prefetch of the record 1-4 tiles ahead) only moves
    bytes into L2 earlier: the Gluon kernel's output is bit-for-bit the same as without it,
    for splits that end before, at and after the prefetch distance (one tile to 70), also
    where the record is longer than the 16 KiB one prefetch covers (``kvarn_k4v4_g128``)."""
    from kvarn_kernels.attention.launch import fast_decode_applies

    set_env(monkeypatch, "KVARN_KERNELS_BATCH_INVARIANT", invariant)
    d, g, hq, hkv = 128, 128, 32, 8
    lens = [g + 3, 2 * g, 3 * g + 1, 1000, 9000]
    seqs = [
        (
            make_kv((t, hkv, d), "outlier_channels", 60 + i),
            make_kv((t, hkv, d), "gaussian", 80 + i),
        )
        for i, t in enumerate(lens)
    ]
    batch = build_paged(seqs, preset, torch.bfloat16, DEV, sinks=[True, False] * 2 + [True])
    q = torch.from_numpy(make_kv((len(lens), hq, d), "gaussian", 7)).to(DEV, torch.bfloat16)
    assert fast_decode_applies(q, tile_layout(preset, d), hkv, None)
    outs = {}
    for prefetch in ("0", "1", "2", "4"):
        set_env(monkeypatch, "KVARN_KERNELS_FAST_PREFETCH", prefetch)
        outs[prefetch] = kk.decode_attention(
            q,
            batch.kv_cache,
            batch.staging,
            batch.block_table,
            batch.seq_lens,
            batch.quantized_lens,
            batch.staging_slots,
            preset,
            d**-0.5,
            sink_lens=batch.sink_lens,
        )
    assert torch.isfinite(outs["0"].float()).all()
    for prefetch in ("1", "2", "4"):
        assert torch.equal(outs[prefetch], outs["0"]), f"prefetch {prefetch}"


@pytest.mark.parametrize("sink", [False, True])
def test_values_only_windows_decode(sink: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Values-only exact windows at a real shape (kvarn_k4v2_g128, head_dim 128, bf16, GQA 4,
    the key frame chosen per tile): prefill, then decode steps across a tile boundary; the
    fast path (its Triton launch scoring the window tiles from their records) against the
    Triton kernel alone and kvarn_math's ``window_keys=False``."""
    from kvarn_math import step_sequence

    preset, d, g, hq, hkv, dtype = "kvarn_k4v2_g128", 128, 128, 16, 4, torch.bfloat16
    s_tiles, recent = 2, 1
    lens = [3 * g - 2, g - 1, 5 * g + 60, 2]
    steps = 4
    # K/V as the model hands them over (bf16): the reference reads the same values.
    seqs = [
        (
            as_dtype(make_kv((t + steps, hkv, d), "outlier_channels", 60 + i), dtype),
            as_dtype(make_kv((t + steps, hkv, d), "gaussian", 80 + i), dtype),
        )
        for i, t in enumerate(lens)
    ]
    n = len(lens)
    cache = unwritten_cache(*kk.cache_shape(n * 8, hkv, d, preset), DEV)
    shape = kk.staging_shape(n, hkv, d, preset, staging_tiles=s_tiles, sink=sink, key_tiles=1)
    staging = nan_like_staging(shape, dtype, DEV)
    table = np.arange(n * 8, dtype=np.int32).reshape(n, 8)[:, ::-1].copy()
    slots = list(range(n))[::-1]
    sink_lens = torch.tensor([g] * n, dtype=torch.int32, device=DEV) if sink else None
    cached, new = [0] * n, list(lens)
    for step in range(steps + 1):
        keys = torch.cat(
            [torch.from_numpy(k[c : c + m]) for (k, _), c, m in zip(seqs, cached, new)]
        )
        vals = torch.cat(
            [torch.from_numpy(v[c : c + m]) for (_, v), c, m in zip(seqs, cached, new)]
        )
        q_all = torch.from_numpy(make_kv((keys.shape[0], hq, d), "gaussian", step)).to(DEV, dtype)
        plan = kk.plan_store(
            cached, new, None, slots, table, preset, staging_tiles=s_tiles, sink=sink,
            recent_tiles=recent, exact_start=[0] * n, window_keys=False,
        ).to(DEV)  # fmt: skip
        kk.store_kv(
            keys.to(DEV, dtype), vals.to(DEV, dtype), cache, staging, plan, preset,
            key_frame="auto", query=q_all,
        )  # fmt: skip
        before, cached, new = cached, [c + m for c, m in zip(cached, new)], [1] * n
        if step == 0:
            continue
        q = torch.from_numpy(make_kv((n, hq, d), "gaussian", 100 + step)).to(DEV, dtype)
        outs = {}
        for fast in ("1", "0"):
            set_env(monkeypatch, "KVARN_KERNELS_FAST_DECODE", fast)
            outs[fast] = kk.decode_attention(
                q, cache, staging, torch.from_numpy(table).to(DEV), plan.seq_lens,
                plan.attention_lens, torch.tensor(slots, dtype=torch.int32, device=DEV), preset,
                d**-0.5, sink_lens=sink_lens, key_lens=plan.key_read_lens, key_tiles=1,
            )  # fmt: skip
        q_in = q.float().cpu().numpy()
        for b, (k, v) in enumerate(seqs):
            ref = step_sequence(
                k[: cached[b]], v[: cached[b]], preset, before[b], recent_tiles=recent,
                ring_tiles=s_tiles, keep_first_tile=sink and cached[b] >= g, window_keys=False,
            )  # fmt: skip
            # the store chose each tile's key frame: read the records it wrote
            blocks = torch.from_numpy(table[b, : ref.records.shape[0]].copy()).to(DEV)
            ref = staged_reference(replace(ref, records=cache[blocks].cpu().numpy()), dtype)
            want = reference_attention(q_in[b : b + 1], ref, d**-0.5)
            for fast, out in outs.items():
                got = out[b : b + 1].float().cpu().numpy()
                assert_close_rms(want, got, TOL[dtype], what=f"step {step} seq {b} fast {fast}")


def test_fast_decode_under_cuda_graphs() -> None:
    """The fast path replays in a CUDA graph with the eager result (fixed split counts)."""
    preset, d, g, hq, hkv = "kvarn_k4v2_g128", 128, 128, 32, 8
    seqs = [
        (make_kv((t, hkv, d), "outlier_channels", i), make_kv((t, hkv, d), "gaussian", 7 + i))
        for i, t in enumerate([3 * g + 2, 700, 1])
    ]
    batch = build_paged(seqs, preset, torch.bfloat16, DEV, sinks=[True, False, True])
    q = torch.from_numpy(make_kv((3, hq, d), "gaussian", 1)).to(DEV, torch.bfloat16)
    out = torch.empty_like(q)

    def run() -> None:
        kk.decode_attention(
            q,
            batch.kv_cache,
            batch.staging,
            batch.block_table,
            batch.seq_lens,
            batch.quantized_lens,
            batch.staging_slots,
            preset,
            d**-0.5,
            out=out,
            sink_lens=batch.sink_lens,
        )

    run()
    eager = out.clone()
    out.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)


def real_verify_case(d: int, hq: int, hkv: int):
    """Three verify blocks of 5, 3 and 5 uncommitted tokens ending 2000, 700 and 9000-token
    sequences (kvarn_k4v2_g128, bf16): ``(batch, lens, n, q, common, loc, qsl)``."""
    preset, dtype = "kvarn_k4v2_g128", torch.bfloat16
    lens, n = [2000, 700, 9000], [5, 3, 5]
    seqs = [
        (make_kv((t, hkv, d), "outlier_channels", 90 + i), make_kv((t, hkv, d), "gaussian", 95 + i))
        for i, t in enumerate(lens)
    ]
    batch = build_paged(seqs, preset, dtype, DEV, uncommitted=n, sinks=[True, False, True])
    q = torch.from_numpy(make_kv((sum(n), hq, d), "gaussian", 17)).to(DEV, dtype)
    common = {**_batch_args(batch, preset), "scale": d**-0.5, "sink_lens": batch.sink_lens}
    loc = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    return batch, lens, n, q, common, loc, torch.from_numpy(loc).to(DEV)


@pytest.mark.parametrize(("d", "hq", "hkv"), [(128, 32, 8), (64, 9, 3)])
def test_verify_as_decode_at_real_sizes(d: int, hq: int, hkv: int) -> None:
    """``verify_as_decode=True`` in the default launch (kvarn_k4v2_g128, bf16): three verify
    blocks of 5, 3 and 5 tokens over 2000, 700 and 9000-token sequences give the bits of one
    ``decode_attention`` call over the same 13 query rows, each row its sequence's position,
    and agree with kvarn-math. head_dim 128 decodes on the Gluon kernel, head_dim 64
    (SmolLM2's shape) on the Triton kernel."""
    batch, lens, n, q, common, loc, qsl = real_verify_case(d, hq, hkv)
    got = kk.multi_query_attention(q, qsl, max_query_len=max(n), verify_as_decode=True, **common)
    dec = decode_as_rows(q, common, lens, n)
    assert torch.equal(dec.view(torch.int16), got.view(torch.int16))
    q_in = q.float().cpu().numpy()
    for b, ref in enumerate(batch.refs):
        rows = slice(int(loc[b]), int(loc[b + 1]))
        want = reference_attention(q_in[rows], staged_reference(ref, q.dtype), d**-0.5)
        assert_close_rms(want, got[rows].float().cpu().numpy(), TOL[q.dtype], what=f"seq {b}")


@pytest.mark.parametrize(("d", "hq", "hkv"), [(128, 32, 8), (64, 9, 3)])
def test_split_batch_at_real_sizes(d: int, hq: int, hkv: int) -> None:
    """The default launch with the step's request count as ``split_batch``: the last token of
    each of three verify blocks (run as decode rows, 13 rows in all) has the bits of the same
    token in a decode call of the three sequences, as a step without speculation computes it;
    without ``split_batch`` the two calls would size their splits for 13 rows and for 3."""
    _, _, n, q, common, loc, qsl = real_verify_case(d, hq, hkv)
    last = torch.from_numpy(loc[1:] - 1).to(DEV)
    verify = kk.multi_query_attention(
        q, qsl, max_query_len=max(n), verify_as_decode=True, split_batch=3, **common
    )
    decode = kk.decode_attention(q.index_select(0, last), split_batch=3, **common)
    assert torch.equal(decode.view(torch.int16), verify.index_select(0, last).view(torch.int16))


@pytest.mark.parametrize(("rows", "sink", "recent", "window_keys"), PLANNER_CASES)
def test_triton_planner_on_the_gpu(rows: int, sink: bool, recent: int, window_keys: bool) -> None:
    """The Triton store planner on CUDA tensors, bit for bit its torch twin (GPU integer
    division truncates where NumPy's floors: the planner divides only non-negative numbers)."""
    planner_case(rows, sink, recent, window_keys, DEV)


@pytest.mark.parametrize(("rows", "n", "sink", "recent", "window_keys"), DRAFT_PLANNER_CASES)
def test_draft_planner_on_the_gpu(
    rows: int, n: int, sink: bool, recent: int, window_keys: bool
) -> None:
    """``plan_draft_device``'s Triton kernel on CUDA tensors, element for element its torch
    twin, written into views of one buffer."""
    draft_planner_case(rows, n, sink, recent, window_keys, DEV)
