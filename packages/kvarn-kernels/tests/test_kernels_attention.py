"""Decode and multi-query attention over the paged cache against kvarn_math.reference_attention."""

from __future__ import annotations

import kvarn_kernels as kk
import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from kernel_testing import build_paged, examples, set_env, staged_reference, through_dtype
from kvarn_kernels import settings as kernel_settings
from kvarn_math import get_preset, reference_attention, rotate
from kvarn_math.testing import assert_close_rms, make_kv

pytestmark = pytest.mark.interpreter

# Relative RMS error of the kernel against the float64 reference over the SAME records: only the
# kernel's arithmetic differs (fp32 dots for fp32; fp16 operands of the tensor-core dots else).
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}
PRESETS = [
    "kvarn_k4v2_g64",
    "kvarn_k4v4_g64",
    "kvarn_k4v2_g128",
    "kvarn_k3v2_g128",
    "kvarn_k2v2_g128",
]


def _lengths(g: int) -> st.SearchStrategy[int]:
    edges = [1, 2, g - 1, g, g + 1, 2 * g - 1, 2 * g, 2 * g + 1, 3 * g + 5]
    return st.one_of(st.sampled_from(edges), st.integers(1, 3 * g))


@st.composite
def decode_cases(draw: st.DrawFn) -> dict[str, object]:
    preset = draw(st.sampled_from(PRESETS))
    g = get_preset(preset).group_size
    return {
        "preset": preset,
        "head_dim": draw(st.sampled_from([64, 128])),
        "num_kv_heads": draw(st.integers(1, 2)),
        "group": draw(st.sampled_from([1, 2, 3, 4, 8, 16])),
        "lens": draw(st.lists(_lengths(g), min_size=1, max_size=3)),
        "splits": draw(st.integers(1, 4)),
        "window": draw(st.one_of(st.none(), st.integers(1, 3 * g))),
        "seed": draw(st.integers(0, 2**31)),
        # Exact first tile in the sink rows of staging, per sequence (None: no sink rows).
        "sinks": draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=3, max_size=3))),
        # Each sink read from another slot's sink rows (sink_slots), as a request sharing its
        # first tile through the prefix cache reads the copy its owner wrote.
        "move_sinks": draw(st.booleans()),
        # Records whose keys are stored in their own channels, mixed with rotated ones.
        "raw_keys": draw(st.booleans()),
    }


def _move_sinks(batch, g: int) -> torch.Tensor:
    """Move the sink rows of the sequences that keep a sink to another slot (cyclically among
    them, or to a spare slot for a single one; their own rows become NaN) and return the
    ``sink_slots`` that point at them. Rows [0, G) of the others hold their open first tile
    and stay."""
    slots = batch.staging_slots.tolist()
    # Sequences whose whole first tile is in the sink rows (a shorter one's open tile 0 is
    # there too, and is always read from its own slot).
    holders = [
        b
        for b in range(len(slots))
        if int(batch.sink_lens[b]) and int(batch.quantized_lens[b]) >= g
    ]
    spare = sorted(set(range(batch.staging.shape[0])) - set(slots))
    targets = [spare[0]] if len(holders) == 1 else [slots[h] for h in holders[1:] + holders[:1]]
    moved = batch.staging.clone()
    for b in holders:
        moved[slots[b], :, :g] = float("nan")
    sink_slots = list(slots)
    for b, target in zip(holders, targets):
        moved[target, :, :g] = batch.staging[slots[b], :, :g]
        sink_slots[b] = target
    batch.staging = moved
    return torch.tensor(sink_slots, dtype=torch.int32)


def _sequences(lens: list[int], h: int, d: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    dists = ["outlier_channels", "gaussian", "heavy_tailed"]
    return [
        (
            make_kv((t, h, d), dists[i % 3], seed + 2 * i),
            make_kv((t, h, d), "gaussian", seed + 2 * i + 1),
        )
        for i, t in enumerate(lens)
    ]


def _run_decode(case: dict[str, object], dtype: torch.dtype, tol: float | None = None) -> None:
    preset, d, h = case["preset"], case["head_dim"], case["num_kv_heads"]
    hq = h * case["group"]
    seqs = _sequences(case["lens"], h, d, case["seed"])
    batch = build_paged(
        seqs,
        preset,
        dtype,
        "cpu",
        seed=case["seed"],
        sinks=case.get("sinks"),
        raw_keys=case.get("raw_keys", False),
    )
    sink_slots = None
    if batch.sink_lens is not None and case.get("move_sinks"):
        sink_slots = _move_sinks(batch, get_preset(preset).group_size)
    q = make_kv((len(seqs), hq, d), "gaussian", case["seed"] + 99)
    scale = 1.0 / np.sqrt(d)
    out = torch.full((len(seqs), hq, d), float("nan"), dtype=dtype)
    got = kk.decode_attention(
        torch.from_numpy(q).to(dtype),
        batch.kv_cache,
        batch.staging,
        batch.block_table,
        batch.seq_lens,
        batch.quantized_lens,
        batch.staging_slots,
        preset,
        scale,
        sliding_window=case["window"],
        out=out,
        num_splits=case["splits"],
        sink_lens=batch.sink_lens,
        sink_slots=sink_slots,
    )
    assert got.data_ptr() == out.data_ptr()
    q_in = torch.from_numpy(q).to(dtype).float().numpy()
    for b, ref in enumerate(batch.refs):
        want = reference_attention(
            q_in[b : b + 1], staged_reference(ref, dtype), scale, case["window"]
        )
        bound = TOL[dtype] if tol is None else tol
        assert_close_rms(want, got[b : b + 1].float().numpy(), bound, what=f"sequence {b}")


@given(decode_cases())
@example(
    {
        "preset": "kvarn_k4v2_g64",
        "head_dim": 64,
        "num_kv_heads": 1,
        "group": 1,
        "lens": [1],
        "splits": 3,
        "window": None,
        "seed": 0,
    }
)
@example(
    {
        "preset": "kvarn_k4v2_g64",
        "head_dim": 64,
        "num_kv_heads": 2,
        "group": 4,
        "lens": [64, 65, 127],
        "splits": 2,
        "window": 7,
        "seed": 1,
    }
)
@example(
    {
        "preset": "kvarn_k4v2_g64",
        "head_dim": 64,
        "num_kv_heads": 2,
        "group": 4,
        "lens": [130, 64, 20],
        "splits": 3,
        "window": None,
        "seed": 2,
        "sinks": [True, True, True],
    }
)
@example(
    {
        "preset": "kvarn_k4v2_g64",
        "head_dim": 64,
        "num_kv_heads": 2,
        "group": 4,
        "lens": [130, 200, 64],
        "splits": 2,
        "window": None,
        "seed": 3,
        "sinks": [True, False, True],
        "move_sinks": True,
    }
)
@example(
    {
        "preset": "kvarn_k4v2_g64",
        "head_dim": 64,
        "num_kv_heads": 2,
        "group": 4,
        "lens": [300, 129, 64],
        "splits": 2,
        "window": None,
        "seed": 4,
        "sinks": [True, False, False],
        "raw_keys": True,
    }
)
@example(
    {
        "preset": "kvarn_k2v2_g128",
        "head_dim": 64,
        "num_kv_heads": 2,
        "group": 3,
        "lens": [300, 260],
        "splits": 1,
        "window": None,
        "seed": 5,
        "raw_keys": True,
    }
)
def test_decode_matches_reference_fp32(case: dict[str, object]) -> None:
    _run_decode(case, torch.float32)


@examples(8)
@given(decode_cases(), st.sampled_from([torch.float16, torch.bfloat16]))
def test_decode_matches_reference_half(case: dict[str, object], dtype: torch.dtype) -> None:
    _run_decode(case, dtype)


@examples(3)
@given(st.integers(0, 2**31), st.sampled_from(["kvarn_k4v2_g64", "kvarn_k4v4_g64"]))
def test_decode_head_dim_256(seed: int, preset: str) -> None:
    _run_decode(
        {
            "preset": preset,
            "head_dim": 256,
            "num_kv_heads": 1,
            "group": 2,
            "lens": [130],
            "splits": 2,
            "window": None,
            "seed": seed,
        },
        torch.float32,
    )


@pytest.mark.parametrize("lens", [[60], [130]])
def test_exact_tokens_keep_fp16_precision_for_bf16_models(lens: list[int]) -> None:
    """Staged (exact) tokens of a bf16 model are scored and weighted with the query and the
    probabilities kept to 16 bits (two bf16 parts), so the error against the reference stays
    within the fp16 bound, with keys whose outlier channels make large logits (a rotated query
    rounded to bf16, as before 2026-12-02, erred several times more here)."""
    case = {
        "preset": "kvarn_k4v2_g64",
        "head_dim": 64,
        "num_kv_heads": 1,
        "group": 4,
        "lens": lens,  # all in staging; or tile 0 exact in the sink rows, tile 1 a record
        "splits": 1,
        "window": None,
        "seed": 11,
        "sinks": [True],
    }
    _run_decode(case, torch.bfloat16, tol=TOL[torch.float16])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tokens_at_fp16s_limit_stay_finite(dtype: torch.dtype) -> None:
    """Tokens of +-65504 in every channel: rotated they reach sqrt(D) x 65504, past fp16's
    range, which bf16 staging holds. The exact tokens stay finite (the H200 GPU test of this
    case gave NaN, 2026-12-03, when they became fp16 infinities; bf16 rows are now dot operands
    as they are, test_kernels_attention_range); the quantized tile's record saturates its fp16
    scales."""
    from kernel_testing import nan_like_staging, unwritten_cache
    from kvarn_math import tile_layout

    preset, d, g = "kvarn_k4v2_g64", 64, 64
    rng = np.random.default_rng(0)
    x = rng.choice(np.array([-65504.0, 65504.0], np.float32), size=(g + 3, 1, d))
    x[:, :, 0] = 65504.0
    cache = unwritten_cache(3, 1, tile_layout(preset, d).tile_bytes, "cpu")
    staging = nan_like_staging(kk.staging_shape(1, 1, d, preset), dtype, "cpu")
    table = np.array([[2, 1]], dtype=np.int32)
    plan = kk.plan_store([0], [g + 3], None, [0], table, preset)
    kv = torch.from_numpy(x).to(dtype)
    kk.store_kv(kv, kv.flip(0), cache, staging, plan, preset)  # one record, 3 tokens staged
    q = torch.randn((1, 4, d), generator=torch.Generator().manual_seed(0)).to(dtype)
    out = kk.decode_attention(
        q, cache, staging, torch.from_numpy(table), torch.tensor([g + 3], dtype=torch.int32),
        torch.tensor([g], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), preset,
        d**-0.5,
    )  # fmt: skip
    assert torch.isfinite(out).all()


def test_decode_staging_holds_an_uncommitted_full_tile() -> None:
    """S=2: a complete tile still unquantized (speculative) is read exactly from staging."""
    preset, d, h, g = "kvarn_k4v2_g64", 64, 1, 64
    seqs = _sequences([2 * g + 10, g + 3], h, d, 5)
    batch = build_paged(seqs, preset, torch.float32, "cpu", staging_tiles=2, uncommitted=[70, 5])
    assert batch.quantized_lens.tolist() == [g, 0]
    q = make_kv((2, 2 * h, d), "gaussian", 1)
    got = kk.decode_attention(
        torch.from_numpy(q),
        batch.kv_cache,
        batch.staging,
        batch.block_table,
        batch.seq_lens,
        batch.quantized_lens,
        batch.staging_slots,
        preset,
        0.125,
        num_splits=2,
    )
    for b, ref in enumerate(batch.refs):
        want = reference_attention(q[b : b + 1], ref, 0.125)
        assert_close_rms(want, got[b : b + 1].numpy(), TOL[torch.float32])


@st.composite
def mqa_cases(draw: st.DrawFn) -> dict[str, object]:
    case = draw(decode_cases())
    lens = case["lens"]
    case["num_q"] = [draw(st.integers(1, min(t, 20))) for t in lens]
    case["splits"] = draw(st.integers(1, 2))
    return case


def _run_mqa(case: dict[str, object], dtype: torch.dtype, staging_tiles: int = 1) -> None:
    preset, d, h = case["preset"], case["head_dim"], case["num_kv_heads"]
    hq = h * case["group"]
    seqs = _sequences(case["lens"], h, d, case["seed"])
    g = get_preset(preset).group_size
    hold = [
        min(nq, t) if staging_tiles > 1 else 0
        for nq, t in zip(case["num_q"], case["lens"], strict=True)
    ]
    hold = [
        x if (t - (t - x) // g * g) <= staging_tiles * g else 0
        for x, t in zip(hold, case["lens"], strict=True)
    ]
    batch = build_paged(
        seqs,
        preset,
        dtype,
        "cpu",
        staging_tiles=staging_tiles,
        uncommitted=hold,
        raw_keys=case.get("raw_keys", False),
        seed=case["seed"],
        sinks=case.get("sinks"),
    )
    nqs = case["num_q"]
    loc = np.concatenate([[0], np.cumsum(nqs)]).astype(np.int32)
    pad = 3  # padding rows past query_start_loc[-1] must stay untouched
    q = make_kv((int(loc[-1]) + pad, hq, d), "gaussian", case["seed"] + 7)
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    scale = 1.0 / np.sqrt(d)
    kk.multi_query_attention(
        torch.from_numpy(q).to(dtype),
        torch.from_numpy(loc),
        batch.kv_cache,
        batch.staging,
        batch.block_table,
        batch.seq_lens,
        batch.quantized_lens,
        batch.staging_slots,
        preset,
        scale,
        sliding_window=case["window"],
        out=out,
        max_query_len=max(nqs),
        num_splits=case["splits"],
        sink_lens=batch.sink_lens,
    )
    q_in = torch.from_numpy(q).to(dtype).float().numpy()
    for b, ref in enumerate(batch.refs):
        rows = slice(int(loc[b]), int(loc[b + 1]))
        want = reference_attention(q_in[rows], staged_reference(ref, dtype), scale, case["window"])
        assert_close_rms(want, out[rows].float().numpy(), TOL[dtype], what=f"sequence {b}")
    assert torch.isnan(out[int(loc[-1]) :]).all(), "padding rows were written"


@examples(15)
@given(mqa_cases())
@example(
    {
        "preset": "kvarn_k4v2_g64",
        "head_dim": 64,
        "num_kv_heads": 1,
        "group": 4,
        "lens": [130, 1, 64],
        "num_q": [20, 1, 64 if False else 20],
        "splits": 2,
        "window": None,
        "seed": 3,
    }
)
def test_multi_query_matches_reference_fp32(case: dict[str, object]) -> None:
    _run_mqa(case, torch.float32)


@examples(6)
@given(mqa_cases())
def test_multi_query_speculative_staging(case: dict[str, object]) -> None:
    """Verify step: the query tokens' own K/V sit uncommitted in a 2-tile staging."""
    _run_mqa(case, torch.float32, staging_tiles=2)


@examples(4)
@given(mqa_cases(), st.sampled_from([torch.float16, torch.bfloat16]))
def test_multi_query_half(case: dict[str, object], dtype: torch.dtype) -> None:
    _run_mqa(case, dtype)


@st.composite
def fresh_cases(draw: st.DrawFn) -> dict[str, object]:
    """Chunks of any length up to the whole sequence: their own tokens may fill whole tiles
    (whose records the step's store just wrote), start inside a tile or in the sink tile."""
    case = draw(decode_cases())
    case["lens"] = case["lens"][:2]
    case["num_q"] = [draw(st.integers(1, t)) for t in case["lens"]]
    case["splits"] = draw(st.integers(1, 3))
    return case


def run_fresh(
    case: dict[str, object], dtype: torch.dtype, device: str = "cpu", tol: float | None = None
) -> None:
    """Multi-query attention with ``fresh_kv`` against kvarn-math's ``exact_kv`` reference; the
    staged copies of the queries' own positions are NaN (so they must not be read)."""
    preset, d, h = case["preset"], case["head_dim"], case["num_kv_heads"]
    hq = h * case["group"]
    seqs = _sequences(case["lens"], h, d, case["seed"])
    g = get_preset(preset).group_size
    batch = build_paged(
        seqs,
        preset,
        dtype,
        device,
        seed=case["seed"],
        sinks=case.get("sinks"),
        raw_keys=case.get("raw_keys", False),
    )
    nqs = case["num_q"]
    loc = np.concatenate([[0], np.cumsum(nqs)]).astype(np.int32)
    base = 0 if batch.sink_lens is None else g
    fresh_k, fresh_v = [], []
    for b, ((k, v), nq) in enumerate(zip(seqs, nqs, strict=True)):
        t = k.shape[0]
        fresh_k.append(torch.from_numpy(rotate(k[t - nq :], axis=-1)).to(dtype))
        fresh_v.append(torch.from_numpy(rotate(v[t - nq :], axis=-1)).to(dtype))
        # The queries' own positions must come from fresh_kv: their staged copies are NaN.
        # (Staged: the tail [quantized_len, t), and tile 0 in the sink rows where kept.)
        slot, qlen = int(batch.staging_slots[b]), int(batch.quantized_lens[b])
        for pos in range(t - nq, t):
            if pos >= qlen or (pos < base and int(batch.sink_lens[b])):
                row = pos if pos < base else base + (pos - base) % g
                batch.staging[slot, :, row] = float("nan")
    q = make_kv((int(loc[-1]), hq, d), "gaussian", case["seed"] + 7)
    scale = 1.0 / np.sqrt(d)
    out = kk.multi_query_attention(
        torch.from_numpy(q).to(device, dtype),
        torch.from_numpy(loc).to(device),
        batch.kv_cache,
        batch.staging,
        batch.block_table,
        batch.seq_lens,
        batch.quantized_lens,
        batch.staging_slots,
        preset,
        scale,
        sliding_window=case["window"],
        max_query_len=max(nqs),
        num_splits=case["splits"],
        sink_lens=batch.sink_lens,
        fresh_kv=(torch.cat(fresh_k).to(device), torch.cat(fresh_v).to(device)),
    )
    q_in = torch.from_numpy(q).to(dtype).float().numpy()
    for b, ((k, v), ref) in enumerate(zip(seqs, batch.refs, strict=True)):
        rows = slice(int(loc[b]), int(loc[b + 1]))
        t, nq = k.shape[0], nqs[b]
        exact = (through_dtype(k[t - nq :], dtype), through_dtype(v[t - nq :], dtype))
        want = reference_attention(
            q_in[rows], staged_reference(ref, dtype), scale, case["window"], exact_kv=exact
        )
        got = out[rows].float().cpu().numpy()
        assert_close_rms(want, got, TOL[dtype] if tol is None else tol, what=f"sequence {b}")


@examples(15)
@given(fresh_cases())
@example(
    {
        "preset": "kvarn_k4v2_g64",
        "head_dim": 64,
        "num_kv_heads": 1,
        "group": 2,
        # 200 tokens, the last 150 the chunk: tiles [64, 128) and half of [0, 64) are its own
        # and have records; positions [128, 200) are staged (and NaN there).
        "lens": [200, 70],
        "num_q": [150, 70],
        "splits": 2,
        "window": None,
        "seed": 4,
        "sinks": [True, True, False],
    }
)
@example(
    {
        "preset": "kvarn_k4v2_g64",
        "head_dim": 64,
        "num_kv_heads": 2,
        "group": 2,
        "lens": [260, 200],
        "num_q": [70, 3],
        "splits": 2,
        "window": None,
        "seed": 6,
        "sinks": None,
        "raw_keys": True,
    }
)
def test_multi_query_fresh_kv_reads_own_tokens_exact(case: dict[str, object]) -> None:
    """With ``fresh_kv`` a chunk attends its own tokens exact from the step's K/V, whatever
    tiles its store completed, and earlier positions as stored (kvarn_math's exact_kv)."""
    run_fresh(case, torch.float32)


@examples(3)
@given(fresh_cases(), st.sampled_from([torch.float16, torch.bfloat16]))
def test_multi_query_fresh_kv_half(case: dict[str, object], dtype: torch.dtype) -> None:
    run_fresh(case, dtype)


def test_multi_query_fresh_kv_checks() -> None:
    preset, d = "kvarn_k4v2_g64", 64
    seqs = _sequences([100], 2, d, 3)
    batch = build_paged(seqs, preset, torch.float32, "cpu")
    q = torch.zeros((4, 4, d))
    args = (
        torch.tensor([0, 4], dtype=torch.int32),
        batch.kv_cache,
        batch.staging,
        batch.block_table,
        batch.seq_lens,
        batch.quantized_lens,
        batch.staging_slots,
        preset,
        0.125,
    )
    good = torch.zeros((4, 2, d))
    with pytest.raises(ValueError, match="fresh_kv must be a"):
        kk.multi_query_attention(q, *args, fresh_kv=good)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"fresh_kv\[1\] must have shape \[4, 2, 64\]"):
        kk.multi_query_attention(q, *args, fresh_kv=(good, torch.zeros((3, 2, d))))
    with pytest.raises(ValueError, match=r"fresh_kv\[0\] must have dtype"):
        kk.multi_query_attention(q, *args, fresh_kv=(good.half(), good))


def test_skipping_the_key_frame_flag_changes_nothing_on_rotated_records() -> None:
    """``raw_keys=False`` (a cache whose store only rotates) reads no flag: on such a cache the
    result is bit-identical to reading the flags; on a mixed one it is not."""
    for preset in ("kvarn_k4v2_g64", "kvarn_k2v2_g128"):
        d = 64
        q = torch.from_numpy(make_kv((2, 4, d), "gaussian", 3))
        for mixed in (False, True):
            seqs = _sequences([300, 270], 2, d, 7)
            batch = build_paged(seqs, preset, torch.float32, "cpu", raw_keys=mixed)
            args = (
                batch.kv_cache,
                batch.staging,
                batch.block_table,
                batch.seq_lens,
                batch.quantized_lens,
                batch.staging_slots,
                preset,
                0.125,
            )
            read = kk.decode_attention(q, *args, num_splits=2)
            skip = kk.decode_attention(q, *args, num_splits=2, raw_keys=False)
            assert torch.equal(read, skip) != mixed, (preset, mixed)
            for b, ref in enumerate(batch.refs):
                want = reference_attention(q[b : b + 1].numpy(), ref, 0.125)
                assert_close_rms(want, read[b : b + 1].numpy(), TOL[torch.float32])


def test_decode_equals_single_token_multi_query() -> None:
    preset, d = "kvarn_k4v2_g64", 64
    seqs = _sequences([100, 7], 2, d, 11)
    batch = build_paged(seqs, preset, torch.float32, "cpu")
    q = torch.from_numpy(make_kv((2, 4, d), "gaussian", 3))
    args = (
        batch.kv_cache,
        batch.staging,
        batch.block_table,
        batch.seq_lens,
        batch.quantized_lens,
        batch.staging_slots,
        preset,
        0.1,
    )
    a = kk.decode_attention(q, *args, num_splits=2)
    b = kk.multi_query_attention(q, torch.tensor([0, 1, 2], dtype=torch.int32), *args, num_splits=2)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_split_count_does_not_change_the_result() -> None:
    preset, d = "kvarn_k4v4_g64", 64
    seqs = _sequences([300], 1, d, 2)
    batch = build_paged(seqs, preset, torch.float32, "cpu")
    q = torch.from_numpy(make_kv((1, 2, d), "gaussian", 4))
    args = (
        batch.kv_cache,
        batch.staging,
        batch.block_table,
        batch.seq_lens,
        batch.quantized_lens,
        batch.staging_slots,
        preset,
        0.1,
    )
    outs = [kk.decode_attention(q, *args, num_splits=s) for s in (1, 2, 5, 8)]
    for o in outs[1:]:
        torch.testing.assert_close(outs[0], o, rtol=1e-5, atol=1e-6)


def _batch_args(batch, preset: str) -> dict[str, object]:
    """The cache arguments of a decode or multi-query call over ``batch`` (scale 1/8)."""
    return {
        "kv_cache": batch.kv_cache,
        "staging": batch.staging,
        "block_table": batch.block_table,
        "seq_lens": batch.seq_lens,
        "quantized_lens": batch.quantized_lens,
        "staging_slots": batch.staging_slots,
        "preset": preset,
        "scale": 0.125,
    }


class TestGuards:
    def _args(self) -> dict[str, object]:
        preset, d = "kvarn_k4v2_g64", 64
        batch = build_paged(_sequences([70], 1, d, 0), preset, torch.float32, "cpu")
        return {"query": torch.zeros(1, 2, d), **_batch_args(batch, preset)}

    @pytest.mark.parametrize(
        ("field", "bad", "message"),
        [
            ("query", torch.zeros(1, 2, 64, dtype=torch.int32), "query must have dtype"),
            ("query", torch.zeros(1, 17, 64), "query heads must be 1..16 times"),
            ("query", torch.zeros(1, 2, 32), "head_dim must be one of"),
            ("kv_cache", torch.zeros(4, 1, 10, dtype=torch.uint8), "kv_cache must have shape"),
            ("block_table", torch.zeros(1, 4, dtype=torch.int64), "block_table must have dtype"),
            ("seq_lens", torch.zeros(2, dtype=torch.int32), "seq_lens must have shape"),
            ("preset", "kvarn_k9v9_g7", "unknown KVarN preset"),
            (
                "staging",
                torch.zeros(3, 2, 64, 1, 64, dtype=torch.float16),
                "staging dtype must equal",
            ),
        ],
    )
    def test_bad_inputs_raise(self, field: str, bad: object, message: str) -> None:
        args = self._args()
        args[field] = bad
        with pytest.raises(ValueError, match=message):
            kk.decode_attention(**args)

    def test_bad_window_and_splits(self) -> None:
        with pytest.raises(ValueError, match="sliding_window"):
            kk.decode_attention(**self._args(), sliding_window=0)
        with pytest.raises(ValueError, match="num_splits"):
            kk.decode_attention(**self._args(), num_splits=0)
        with pytest.raises(ValueError, match=r"num_splits must be an int in \[1, 64\]"):
            kk.decode_attention(**self._args(), num_splits=65)

    def test_sink_slots_need_sink_lens_and_int32(self) -> None:
        slots = torch.zeros(1, dtype=torch.int32)
        with pytest.raises(ValueError, match="sink_slots needs sink_lens"):
            kk.decode_attention(**self._args(), sink_slots=slots)
        args = self._args()
        g = 64
        args["staging"] = torch.zeros(3, 2, 2 * g, 1, 64)
        with pytest.raises(ValueError, match="sink_slots must have dtype"):
            kk.decode_attention(
                **args,
                sink_lens=torch.full((1,), g, dtype=torch.int32),
                sink_slots=slots.long(),
            )


def test_autotuned_kernel_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVARN_KERNELS_AUTOTUNE=1 launches the autotuned wrapper (one config in the interpreter)."""
    preset, d = "kvarn_k4v2_g64", 64
    batch = build_paged(_sequences([90], 1, d, 6), preset, torch.float32, "cpu")
    q = torch.from_numpy(make_kv((1, 2, d), "gaussian", 8))
    args = (
        batch.kv_cache,
        batch.staging,
        batch.block_table,
        batch.seq_lens,
        batch.quantized_lens,
        batch.staging_slots,
        preset,
        0.125,
    )
    plain = kk.decode_attention(q, *args, num_splits=2)
    set_env(monkeypatch, "KVARN_KERNELS_AUTOTUNE", "1")
    from kvarn_kernels.attention import autotune_enabled

    assert autotune_enabled()
    tuned = kk.decode_attention(q, *args, num_splits=2)
    torch.testing.assert_close(plain, tuned, rtol=0, atol=0)


@pytest.mark.parametrize("sub", [32, 64, 128])
@pytest.mark.parametrize("preset", ["kvarn_k4v2_g128", "kvarn_k3v2_g128"])  # phased, generic
def test_other_launch_configs(monkeypatch: pytest.MonkeyPatch, preset: str, sub: int) -> None:
    """The step sizes the GPU autotuner may pick meet the same tolerance, on both paths."""
    from kvarn_kernels.attention import launch

    d = 64
    batch = build_paged(_sequences([300, 40], 1, d, 2), preset, torch.float32, "cpu")
    q = make_kv((2, 4, d), "gaussian", 1)
    monkeypatch.setattr(
        launch,
        "default_launch",
        lambda *args: {"SUB": sub, "num_warps": 4, "num_stages": 1},
    )
    for splits in (1, 3):
        got = kk.decode_attention(
            torch.from_numpy(q),
            batch.kv_cache,
            batch.staging,
            batch.block_table,
            batch.seq_lens,
            batch.quantized_lens,
            batch.staging_slots,
            preset,
            0.125,
            num_splits=splits,
        )
        for b, ref in enumerate(batch.refs):
            want = reference_attention(q[b : b + 1], ref, 0.125)
            assert_close_rms(want, got[b : b + 1].numpy(), TOL[torch.float32])


def test_empty_padding_rows_give_zeros() -> None:
    """A row with seq_len 0 (CUDA-graph padding) attends to nothing and returns zeros."""
    preset, d = "kvarn_k4v2_g64", 64
    batch = build_paged(_sequences([70, 5], 1, d, 3), preset, torch.float32, "cpu")
    seq_lens = batch.seq_lens.clone()
    qlens = batch.quantized_lens.clone()
    seq_lens[1] = 0
    qlens[1] = 0
    q = torch.from_numpy(make_kv((2, 2, d), "gaussian", 2))
    out = kk.decode_attention(
        q,
        batch.kv_cache,
        batch.staging,
        batch.block_table,
        seq_lens,
        qlens,
        batch.staging_slots,
        preset,
        0.125,
        num_splits=2,
    )
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    want = reference_attention(q[:1].numpy(), batch.refs[0], 0.125)
    assert_close_rms(want, out[:1].numpy(), TOL[torch.float32])


def test_launch_override_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvarn_kernels.attention.launch import launch_override

    set_env(monkeypatch, "KVARN_KERNELS_ATTN_LAUNCH", "SUB=64, num_stages=1,num_warps=2")
    assert launch_override() == {"SUB": 64, "num_stages": 1, "num_warps": 2}
    monkeypatch.setenv("KVARN_KERNELS_ATTN_LAUNCH", "SUB=64,warps=2")
    with pytest.raises(ValueError, match="KVARN_KERNELS_ATTN_LAUNCH must be .*KEY=INT with KEY in"):
        kernel_settings.reload()
    set_env(monkeypatch, "KVARN_KERNELS_ATTN_LAUNCH", None)
    assert launch_override() == {}


def test_split_plan_fixed_positions(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvarn_kernels.attention import launch
    from kvarn_kernels.attention.launch import split_plan

    assert split_plan(129, 128, 128) == (16, 9)  # 2048 positions (16 tiles) per split
    assert split_plan(16, 64, 128) == (32, 1)
    assert split_plan(40, 64, 64) == (32, 2)  # 32 tiles of 64 per split
    assert split_plan(2048, 128, 128) == (32, 64)  # at most 64 splits
    assert split_plan(1, 32, 128) == (64, 1)
    monkeypatch.setattr(launch, "_MIN_SPLIT_TOKENS", 1)
    assert split_plan(16, 128, 128) == (1, 16)  # one tile per split
    assert split_plan(16, 64, 128) == (2, 8)
    with pytest.raises(ValueError, match="sub dividing G"):
        split_plan(8, 48, 128)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))


def batch_invariance_case(
    device: str,
    d: int,
    h: int,
    group: int,
    lens: list[int],
    sinks: bool,
    window: int | None = None,
    invariant: bool | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """In batch-invariant mode (``invariant``, or KVARN_KERNELS_BATCH_INVARIANT=1): the last n positions of sequence 0 as one
    multi-query (verify) block, each position as a decode row alone, and each beside
    sequence 1 (another batch). Returns ``(mqa rows, alone rows, in-batch rows)``."""
    preset, n, dtype = "kvarn_k4v2_g64" if d == 64 else "kvarn_k4v2_g128", 3, torch.float16
    seqs = _sequences(lens, h, d, 5)
    sink = [True, True] if sinks else None
    batch = build_paged(seqs, preset, dtype, device, uncommitted=[n, 0], seed=5, sinks=sink)
    q = torch.from_numpy(make_kv((n, h * group, d), "gaussian", 11)).to(dtype).to(device)
    first = {
        "block_table": batch.block_table[:1],
        "quantized_lens": batch.quantized_lens[:1],
        "staging_slots": batch.staging_slots[:1],
        "sink_lens": None if batch.sink_lens is None else batch.sink_lens[:1],
    }
    common = {
        "kv_cache": batch.kv_cache,
        "staging": batch.staging,
        "preset": preset,
        "scale": 0.125,
        "sliding_window": window,
        "batch_invariant": invariant,
    }
    i32 = {"dtype": torch.int32, "device": device}
    mqa = kk.multi_query_attention(
        q,
        torch.tensor([0, n], **i32),
        seq_lens=batch.seq_lens[:1],
        max_query_len=n,
        **first,
        **common,
    )
    alone, both = [], []
    for j in range(n):
        seq_len = lens[0] - n + 1 + j
        alone.append(
            kk.decode_attention(
                q[j : j + 1], seq_lens=torch.tensor([seq_len], **i32), **first, **common
            )
        )
        both.append(
            kk.decode_attention(
                torch.cat([q[j : j + 1], q[:1]]),
                block_table=batch.block_table,
                seq_lens=torch.tensor([seq_len, lens[1]], **i32),
                quantized_lens=batch.quantized_lens,
                staging_slots=batch.staging_slots,
                sink_lens=batch.sink_lens,
                **common,
            )[:1]
        )
    return mqa, alone, both


@pytest.mark.parametrize(
    ("sinks", "window", "via"),
    [(False, None, "env"), (True, None, "env"), (True, 100, "env"), (True, 100, "argument")],
)
def test_batch_invariant_mode(
    monkeypatch: pytest.MonkeyPatch, sinks: bool, window: int | None, via: str
) -> None:
    """KVARN_KERNELS_BATCH_INVARIANT=1: splits at fixed positions, so a decode row's bits do
    not depend on the rest of the batch; a verify row matches the decode row of its position
    (bit for bit on the GPU, test_kernels_gpu.py; here within fp16 rounding: the
    interpreter's matrix products may sum a row differently by its place in the block)."""
    from kvarn_kernels.attention import launch

    monkeypatch.setattr(launch, "_MIN_SPLIT_TOKENS", 64)  # several splits at these lengths
    if via == "env":
        set_env(monkeypatch, "KVARN_KERNELS_BATCH_INVARIANT", "1")
    else:  # the argument wins over the environment
        set_env(monkeypatch, "KVARN_KERNELS_BATCH_INVARIANT", "0")
    invariant = True if via == "argument" else None
    mqa, alone, both = batch_invariance_case("cpu", 64, 2, 4, [250, 90], sinks, window, invariant)
    for j, (a, b) in enumerate(zip(alone, both, strict=True)):
        assert _bits_equal(a, b), j
        assert_close_rms(a.float().numpy(), mqa[j : j + 1].float().numpy(), 2e-3, what=f"row {j}")
    args = TestGuards()._args()
    with pytest.raises(ValueError, match="num_splits must be None"):
        kk.decode_attention(**args, num_splits=2, batch_invariant=invariant)


@pytest.mark.parametrize("sinks", [False, True])
def test_verify_rows_as_decode_rows_share_their_bits(
    monkeypatch: pytest.MonkeyPatch, sinks: bool
) -> None:
    """Where the Gluon kernel decodes (forced here: ``verify_as_decode``), a batch-invariant
    verify block runs as decode rows, one per token: each verify row has exactly the bits of
    the decode row of its position, alone or in another batch."""
    from kvarn_kernels.attention import launch

    monkeypatch.setattr(launch, "_MIN_SPLIT_TOKENS", 64)
    monkeypatch.setattr(launch, "verify_as_decode", lambda *args: True)
    mqa, alone, both = batch_invariance_case("cpu", 64, 2, 4, [250, 90], sinks, None, True)
    for j, (a, b) in enumerate(zip(alone, both, strict=True)):
        assert _bits_equal(a, b), j
        assert _bits_equal(a, mqa[j : j + 1]), j


def test_verify_as_decode_keeps_padding_rows_and_sequences_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two sequences' verify blocks (3 and 2 tokens) and two padding rows, through decode rows:
    each token's output is the decode row of its own sequence and position, bit for bit, and
    the padding rows of ``out`` are left as they were."""
    from kvarn_kernels.attention import launch

    monkeypatch.setattr(launch, "verify_as_decode", lambda *args: True)
    preset, d, h, group, dtype = "kvarn_k4v2_g64", 64, 2, 4, torch.float16
    lens, n = [200, 150], [3, 2]
    seqs = _sequences(lens, h, d, 7)
    batch = build_paged(seqs, preset, dtype, "cpu", uncommitted=n, seed=7, sinks=[True, False])
    q = torch.from_numpy(make_kv((7, h * group, d), "gaussian", 13)).to(dtype)
    out = torch.full_like(q, 7.0)
    common = _batch_args(batch, preset)
    common.update(sink_lens=batch.sink_lens, batch_invariant=True)
    qsl = torch.tensor([0, 3, 5], dtype=torch.int32)
    kk.multi_query_attention(q, qsl, max_query_len=3, out=out, **common)
    assert bool((out[5:] == 7.0).all())
    rows = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    for i, (b, j) in enumerate(rows):
        seq_lens = batch.seq_lens.clone()
        seq_lens[b] = lens[b] - n[b] + 1 + j
        pair = torch.stack([q[i], q[0]]) if b == 0 else torch.stack([q[0], q[i]])
        got = kk.decode_attention(pair, **{**common, "seq_lens": seq_lens})
        assert _bits_equal(got[b : b + 1], out[i : i + 1]), (b, j)


def decode_as_rows(
    q: torch.Tensor, common: dict[str, object], lens: list[int], n: list[int]
) -> torch.Tensor:
    """One ``decode_attention`` call over verify blocks' query rows (``n[b]`` rows at the end
    of sequence ``b`` of ``lens[b]`` tokens): each row its sequence's cache arguments and its
    own position, what ``verify_as_decode`` must reproduce bit for bit."""
    dev = q.device
    owner = torch.tensor([b for b, k in enumerate(n) for _ in range(k)], device=dev)
    pos = [lens[b] - n[b] + 1 + j for b, k in enumerate(n) for j in range(k)]
    per_row = {
        k: common[k].index_select(0, owner)  # type: ignore[attr-defined]
        for k in ("block_table", "quantized_lens", "staging_slots", "sink_lens")
    }
    seq_lens = torch.tensor(pos, dtype=torch.int32, device=dev)
    return kk.decode_attention(q, **{**common, **per_row, "seq_lens": seq_lens})  # type: ignore[arg-type]


def verify_blocks_case(n: tuple[int, int] = (3, 2), seed: int = 7, q_seed: int = 13):
    """Two sequences (200 and 150 tokens, head_dim 64, 2 KV heads, GQA 4, fp16,
    ``kvarn_k4v2_g64``) ending in blocks of ``n`` uncommitted tokens: ``(batch, lens, n, q,
    common, qsl)`` for a multi-query call over their query rows."""
    preset, d, h, group, dtype = "kvarn_k4v2_g64", 64, 2, 4, torch.float16
    lens, n_list = [200, 150], list(n)
    seqs = _sequences(lens, h, d, seed)
    batch = build_paged(
        seqs, preset, dtype, "cpu", uncommitted=n_list, seed=seed, sinks=[True, False]
    )
    q = torch.from_numpy(make_kv((sum(n_list), h * group, d), "gaussian", q_seed)).to(dtype)
    common = {**_batch_args(batch, preset), "sink_lens": batch.sink_lens}
    qsl = torch.tensor([0, n_list[0], sum(n_list)], dtype=torch.int32)
    return batch, lens, n_list, q, common, qsl


@pytest.mark.parametrize(("flag", "gluon"), [(True, False), (None, True), (False, True)])
def test_verify_as_decode_in_the_default_launch(
    monkeypatch: pytest.MonkeyPatch, flag: bool | None, gluon: bool
) -> None:
    """``verify_as_decode=True`` outside batch-invariant mode, whatever kernel decodes: two
    sequences' verify blocks give the bits of one decode call over the same query tokens,
    each a row of its own sequence and position, and agree with kvarn-math. ``None`` and
    ``False`` keep the multi-query kernel (no decode rows), ``None`` even where the Gluon
    kernel would decode (forced here)."""
    from kvarn_kernels.attention import launch

    set_env(monkeypatch, "KVARN_KERNELS_BATCH_INVARIANT", "0")
    if gluon:
        monkeypatch.setattr(launch, "verify_as_decode", lambda *args: True)
    as_rows = []
    decode_rows = launch.decode_rows
    monkeypatch.setattr(launch, "decode_rows", lambda *a: as_rows.append(1) or decode_rows(*a))
    batch, lens, n, q, common, qsl = verify_blocks_case()
    got = kk.multi_query_attention(q, qsl, max_query_len=3, verify_as_decode=flag, **common)
    assert len(as_rows) == (1 if flag else 0)
    if flag:
        assert _bits_equal(decode_as_rows(q, common, lens, n), got)
    q_in = q.float().numpy()
    for b, rs in enumerate((slice(0, 3), slice(3, 5))):  # a sequence's rows: its last positions
        want = reference_attention(q_in[rs], staged_reference(batch.refs[b], q.dtype), 0.125)
        assert_close_rms(want, got[rs].float().numpy(), TOL[q.dtype], what=f"sequence {b}")
    # Blocks longer than VERIFY_AS_DECODE_MAX_QUERY keep the multi-query kernel.
    as_rows.clear()
    monkeypatch.setattr(launch, "VERIFY_AS_DECODE_MAX_QUERY", 2)
    kk.multi_query_attention(q, qsl, max_query_len=3, verify_as_decode=True, **common)
    assert not as_rows


def test_split_sizing() -> None:
    """The default launch sizes its splits for the call's rows, or for ``split_batch`` rounded
    up to a power of two; anything but None or an int >= 1 is refused by name."""
    from kvarn_kernels.attention.launch import split_sizing

    assert split_sizing(5, None) == 5
    assert [split_sizing(3, b) for b in (1, 2, 3, 5, 8, 100, 128, 129)] == [
        1, 2, 4, 8, 8, 128, 128, 256,
    ]  # fmt: skip
    for bad in (0, -3, True, 2.5, "4"):
        with pytest.raises(ValueError, match="split_batch must be None or an int >= 1"):
            split_sizing(3, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="split_batch"):
        kk.decode_attention(**TestGuards()._args(), split_batch=0)


def test_split_batch_gives_verify_rows_the_splits_of_the_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Default launch: without ``split_batch`` a verify block run as decode rows sizes its
    splits for its own rows (5 here), a decode call for its own sequences, so the same token
    can get other splits in a speculative step than when decoded; with the step's request
    count as ``split_batch`` both size for its power of two and the verify rows have exactly
    the bits of the decode call over the same tokens. (The CPU has no SMs to size for, so the
    split count is made to depend on the sizing here.) Batch-invariant mode ignores it."""
    from kvarn_kernels.attention import launch

    set_env(monkeypatch, "KVARN_KERNELS_BATCH_INVARIANT", "0")
    sized: list[int] = []

    def splits(num_seqs: int, *args: object, **kwargs: object) -> int:
        sized.append(num_seqs)
        return 1 + num_seqs % 3

    monkeypatch.setattr(launch, "choose_num_splits", splits)
    # The records' kernel beside the staged pass (Gluon or tiles) sizes its own splits.
    monkeypatch.setattr(launch, "fast_decode_splits", splits)
    batch, lens, n, q, common, qsl = verify_blocks_case()
    kk.multi_query_attention(q, qsl, max_query_len=3, verify_as_decode=True, **common)
    kk.decode_attention(q[:2], **common)
    assert sized == [5, 2]  # rows of the verify call; sequences of the decode call
    sized.clear()
    step = {**common, "split_batch": 3}  # the step's requests: 3 -> sized for 4
    got = kk.multi_query_attention(q, qsl, max_query_len=3, verify_as_decode=True, **step)
    want = decode_as_rows(q, step, lens, n)
    assert sized == [4, 4]
    assert _bits_equal(want, got)
    sized.clear()
    kk.decode_attention(q[:2], **{**step, "batch_invariant": True})
    assert sized == []  # fixed split positions: nothing sized


def test_non_causal_blocks_attend_their_whole_sequence() -> None:
    """``causal=False`` (a DFlash-style draft block): every query of a sequence attends all of
    its positions, block included: the decode row of the whole sequence bit for bit, and
    kvarn-math's attention of that query over the whole sequence; ``fresh_kv`` is refused."""
    batch, _, _, q, common, qsl = verify_blocks_case((4, 3), seed=9, q_seed=17)
    dtype, h = q.dtype, batch.kv_cache.shape[1]
    got = kk.multi_query_attention(q, qsl, max_query_len=4, causal=False, **common)
    causal = kk.multi_query_attention(q, qsl, max_query_len=4, **common)
    q_in = q.float().numpy()
    for i, b in enumerate([0, 0, 0, 0, 1, 1, 1]):
        pair = torch.stack([q[i], q[0]]) if b == 0 else torch.stack([q[0], q[i]])
        row = kk.decode_attention(pair, **common)[b : b + 1]
        assert _bits_equal(row, got[i : i + 1]), i
        want = reference_attention(q_in[i : i + 1], staged_reference(batch.refs[b], dtype), 0.125)
        assert_close_rms(want, got[i : i + 1].float().numpy(), TOL[dtype], what=f"row {i}")
    # Only a block's last query sees the same keys either way.
    assert torch.allclose(got[3].float(), causal[3].float(), atol=2e-3)
    assert not torch.allclose(got[0].float(), causal[0].float(), atol=1e-3)
    fresh = (torch.zeros(7, h, 64, dtype=dtype), torch.zeros(7, h, 64, dtype=dtype))
    with pytest.raises(ValueError, match="causal=False"):
        kk.multi_query_attention(q, qsl, max_query_len=4, causal=False, fresh_kv=fresh, **common)


def test_decode_rows_map_tokens_to_positions() -> None:
    """Tokens of blocks [1, 5, 0, 3] tokens (one sequence empty) and two padding tokens: each
    token's sequence and its position + 1; padding takes the last sequence's last position."""
    from kvarn_kernels.attention.launch import decode_rows

    qsl = torch.tensor([0, 1, 6, 6, 9], dtype=torch.int32)
    rows, lens = decode_rows(qsl, 11, torch.tensor([10, 20, 7, 30], dtype=torch.int32))
    assert rows.tolist() == [0, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3]
    assert lens.tolist() == [10, 16, 17, 18, 19, 20, 28, 29, 30, 30, 30]
    assert lens.dtype == torch.int32
    rows, lens = decode_rows(qsl, 11, torch.tensor([10, 20, 7, 30], dtype=torch.int32), False)
    assert lens.tolist() == [10, 20, 20, 20, 20, 20, 30, 30, 30, 30, 30]


def test_fast_split_plan_fixed_positions() -> None:
    """Batch-invariant splits of the Gluon kernel: 8 tiles each from tile 0, doubled until
    the table fits beside the staged splits in the combine's 64."""
    from kvarn_kernels.attention.launch import fast_split_plan

    assert fast_split_plan(32, 3) == (8, 4)
    assert fast_split_plan(33, 3) == (8, 5)
    assert fast_split_plan(488, 3) == (8, 61)
    assert fast_split_plan(489, 3) == (16, 31)
    assert fast_split_plan(1000, 3) == (32, 32)
    for bad in ((0, 3), (32, 0), (32, 64)):
        with pytest.raises(ValueError, match="fast_split_plan"):
            fast_split_plan(*bad)


def test_invariant_split_tiles_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """``KVARN_KERNELS_INVARIANT_SPLIT_TILES`` sets the batch-invariant split length (still
    doubled until the table fits the combine); anything but a power of two up to 256 is
    refused with the variable's name."""
    from kvarn_kernels.attention.launch import fast_split_plan

    set_env(monkeypatch, "KVARN_KERNELS_INVARIANT_SPLIT_TILES", "32")
    assert fast_split_plan(32, 3) == (32, 1)
    assert fast_split_plan(128, 3) == (32, 4)
    assert fast_split_plan(3000, 3) == (64, 47)
    for bad in ("0", "12", "512", "x", "-8"):
        monkeypatch.setenv("KVARN_KERNELS_INVARIANT_SPLIT_TILES", bad)
        with pytest.raises(ValueError, match="KVARN_KERNELS_INVARIANT_SPLIT_TILES"):
            kernel_settings.reload()


@pytest.mark.parametrize(
    ("preset", "windows", "cap"),
    # the 4-bit-key (phased) path with values-only windows, the generic path with keys too:
    # the two presets' defaults in kvarn-vllm; 2-bit keys from the records (the generic window
    # step, kvarn-eval's +values); then fewer splits than staged tiles
    [
        ("kvarn_k4v2_g128", "values", None),
        ("kvarn_k2v2_g128", "keys", None),
        ("kvarn_k2v2_g128", "values", None),
        ("kvarn_k4v2_g128", "values", 1),
        ("kvarn_k4v2_g128", "values", 2),
    ],
)
def test_staged_splits_of_the_fast_path_walk_every_staged_step_once(
    preset, windows, cap, monkeypatch
):
    """The Triton kernel's part of the fast decode path (``QUANT=False``) runs one split per
    staged tile (at most ``KVARN_KERNELS_STAGED_SPLITS``): with the sink tile, the recent tile
    and the open tile exact (keys too, or values only with keys from their records) and no other
    tile, those splits alone must give the whole decode attention: every staged step walked
    once, by one split."""
    from kvarn_kernels import bench
    from kvarn_kernels.attention import launch

    if cap is not None:
        set_env(monkeypatch, launch.STAGED_SPLITS_ENV, str(cap))

    cpu = torch.device("cpu")
    g, d, hkv, hq, b = 128, 64, 2, 4, 3
    template = bench._template_records(preset, d, hkv, torch.bfloat16, cpu, mixed=True)

    def staged(case: bench._Case) -> torch.Tensor:
        """The staged splits of ``case``'s decode attention alone."""
        return launch._run(
            case.query, None, 1, case.kv_cache, case.staging, case.block_table, case.seq_lens,
            case.qlens, case.slots, case.layout, hkv, case.scale, None, None, None,
            case.sink_lens, None, False, raw_keys=True, key_lens=case.key_lens,
            key_tiles=case.key_tiles, staged_only=True,
        ).float()  # fmt: skip

    case = bench._Case(preset, hq, hkv, d, b, 2 * g, torch.bfloat16, cpu, template, True, windows)
    assert launch.staged_splits(case.staging, g, True, case.key_tiles) == (cap or 3)
    want = case.run().float()
    got = staged(case)
    # bf16 outputs: the two split layouts round differently (a bf16 ulp is 2^-8 = 3.9e-3)
    assert_close_rms(want.numpy(), got.numpy(), 8e-3, what=f"{preset} {windows}")
    # with a tile in between that only the quantized pass reads, the staged splits alone miss it
    long = bench._Case(preset, hq, hkv, d, 1, 3 * g, torch.bfloat16, cpu, template, True, windows)
    full = long.run().float()
    part = staged(long)
    assert float((full - part).norm() / full.norm()) > 0.05


def test_staged_splits_one_when_sequences_fill_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A split per staged tile while sequences x KV heads leave SMs idle, one split from two
    programs per SM on (the properties of a 132-SM GPU stand in for a GPU here)."""
    from types import SimpleNamespace

    from kvarn_kernels.attention import launch

    staging = torch.zeros(kk.staging_shape(1, 1, 64, "kvarn_k4v2_g128", staging_tiles=2, sink=True))
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda dev: SimpleNamespace(multi_processor_count=132)
    )
    gpu = torch.device("cuda")
    assert launch.staged_splits(staging, 128, True, None, 16 * 8, gpu) == 3
    assert launch.staged_splits(staging, 128, True, None, 263, gpu) == 3
    assert launch.staged_splits(staging, 128, True, None, 264, gpu) == 1
    assert launch.staged_splits(staging, 128, True, None, 4096, torch.device("cpu")) == 3
    set_env(monkeypatch, launch.STAGED_SPLITS_ENV, "2")
    assert launch.staged_splits(staging, 128, True, None, 128, gpu) == 2


@pytest.mark.parametrize("raw", ["0", "-1", "two", "1.5"])
def test_staged_splits_cap_rejects_bad_values(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvarn_kernels.attention import launch

    monkeypatch.setenv(launch.STAGED_SPLITS_ENV, raw)
    with pytest.raises(ValueError, match="KVARN_KERNELS_STAGED_SPLITS must be an integer >= 1"):
        kernel_settings.reload()


def test_default_launch_of_multi_query_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Multi-query blocks keep SUB <= 64 (SUB 128 failed on the H200); 4 warps for
    kvarn_k4v2 at head_dim 128 (the H200 sweep), 8 elsewhere; decode launches unchanged."""
    from kvarn_kernels.attention import kernel

    monkeypatch.setattr(kernel, "INTERPRET", False)  # the interpreter's one launch aside
    mq = kernel.default_launch(False, 128, 128, (4, 2))
    assert mq == {"SUB": 64, "num_warps": 4, "num_stages": 1}
    assert kernel.default_launch(False, 128, 128, (2, 2))["num_warps"] == 8
    assert kernel.default_launch(False, 64, 128, (4, 2))["num_warps"] == 8
    assert kernel.default_launch(False, 128, 128)["num_warps"] == 8
    for bits in (None, (4, 2), (2, 2)):
        assert kernel.default_launch(True, 128, 128, bits) == {
            "SUB": 128, "num_warps": 4, "num_stages": 2,
        }  # fmt: skip
    assert all(kernel.default_launch(False, d, 128, (4, 2))["SUB"] <= 64 for d in (64, 128, 256))
