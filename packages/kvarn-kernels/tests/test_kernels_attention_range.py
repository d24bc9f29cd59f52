"""Exact (staged) tokens of a bf16 model past fp16's range: the attention kernels read the
staging's bf16 rows as they are (the exact first tile in the sink rows, the open tile, a
chunk's own K/V), against kvarn-math's reference attention over the same bf16 rows.

Before 2026-12-06 the kernels made fp16 dot operands of them, saturated at +-65504: a bf16
model's massive activations (1e5 and beyond) were read wrong until their tile was quantized.
"""

from __future__ import annotations

import kvarn_kernels as kk
import numpy as np
import pytest
import torch
from kernel_testing import build_paged, set_env, staged_reference, through_dtype
from kvarn_math import reference_attention, rotate, tile_layout
from kvarn_math.testing import assert_close_rms, make_kv

MAGNITUDES = [1e4, 1e5, 1e20]
KINDS = ["tiles", "outliers", "faint"]
# Relative RMS error per query head against the float64 reference over the same bf16 rows:
# the bf16 output's rounding (2^-9), and where a weight of about 1e-9 carries the output
# (``outliers``, ``faint``), ln 2 times its score's error, which the records' fp16 dot
# operands set. Measured at most 4.7e-3 (interpreter, 2026-12-06); 1.0 before the fix.
TOL = 1e-2
DTYPE = torch.bfloat16


def staged_case(kind: str, magnitude: float, t: int, hkv: int, hq: int, d: int, g: int, seed: int):
    """``(k, v, q)`` of one sequence of ``t`` tokens (float32 ``[t, hkv, d]``, ``[1, hq, d]``)
    whose staged positions (the sink tile ``[0, g)`` and the open tail from ``t // g * g``)
    carry values of ``magnitude``:

    * ``tiles``: every staged key and value, largest ``magnitude``; the query divided by it,
      so that scores stay of order one and every staged token weighs in;
    * ``outliers``: one key element (token 5, of the sign that hides it from KV head 0's
      query heads) and one value element (the open tile's second token) of ``magnitude``;
    * ``faint``: one value element of ``magnitude`` on a staged token the query heads weigh
      at most about 1e-10 (between 1e-14 and 2^-25, which fp16 rounds to 0): times 1e20 it
      dominates the output.
    """
    k = make_kv((t, hkv, d), "outlier_channels", seed)
    v = make_kv((t, hkv, d), "gaussian", seed + 1)
    q = make_kv((1, hq, d), "gaussian", seed + 2)
    staged = np.r_[0:g, t // g * g : t]
    m = np.float32(magnitude)
    if kind == "tiles":
        for x in (k, v):
            x[staged] *= m / np.abs(x[staged]).max()
        q /= m
    elif kind == "outliers":
        # the key in a channel where KV head 0's query heads agree in sign, so that token 5
        # scores far below the others for all of them (a key outlier they weigh fully would
        # hide the value outlier)
        c = int(np.flatnonzero(np.abs(np.sign(q[0, : hq // hkv]).sum(axis=0)) == hq // hkv)[0])
        k[5, 0, c] = -np.sign(q[0, 0, c]) * m
        v[t // g * g + 1, 0, 4] = -m
    elif kind == "faint":
        q *= np.float32(2.0)  # scores spread further
        group = hq // hkv
        scores = np.einsum("hd,thd->th", q[0], np.repeat(k, group, axis=1)) * d**-0.5
        weight = np.exp(scores - scores.max(axis=0))  # [t, hq], at most 1 per head
        most = weight[staged].max(axis=1)
        j = staged[np.argmin(np.abs(np.log(most) - np.log(1e-10)))]
        # fp16 rounds such a weight to 0 (under 2^-25), yet times magnitude it dominates
        assert 1e-14 < weight[j].max() < 2.0**-25, weight[j].max()
        v[j, :, 3] = m
    else:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return k, v, q


def run_decode(kind: str, magnitude: float, device: str, preset: str, d: int, hkv: int, hq: int):
    """Decode attention over a sequence with its first tile exact in the sink rows, records
    after it and an open tail, against the reference, per query head."""
    g = tile_layout(preset, d).group_size
    t = 3 * g + 9
    k, v, q = staged_case(kind, magnitude, t, hkv, hq, d, g, seed=31)
    batch = build_paged([(k, v)], preset, DTYPE, device, sinks=[True])
    out = kk.decode_attention(
        torch.from_numpy(q).to(device, DTYPE), batch.kv_cache, batch.staging, batch.block_table,
        batch.seq_lens, batch.quantized_lens, batch.staging_slots, preset, d**-0.5,
        sink_lens=batch.sink_lens,
    )  # fmt: skip
    q_in = torch.from_numpy(q).to(DTYPE).float().numpy()
    want = reference_attention(q_in, staged_reference(batch.refs[0], DTYPE), d**-0.5)
    got = out.float().cpu().numpy()
    for h in range(hq):
        assert_close_rms(want[:, h], got[:, h], TOL, what=f"{kind} {magnitude:g} head {h}")


def run_fresh(magnitude: float, device: str, preset: str, d: int, hkv: int, hq: int):
    """Multi-query attention of a chunk of 5 tokens whose own K/V (``fresh_kv``) and the staged
    tokens before them are of ``magnitude`` (queries divided by it), against the reference
    with ``exact_kv``."""
    g = tile_layout(preset, d).group_size
    t, nq = 3 * g + 9, 5
    k, v, _ = staged_case("tiles", magnitude, t, hkv, hq, d, g, seed=41)
    q = make_kv((nq, hq, d), "gaussian", 43) / np.float32(magnitude)
    batch = build_paged([(k, v)], preset, DTYPE, device, sinks=[True])
    fresh = [torch.from_numpy(rotate(x[t - nq :], axis=-1)).to(device, DTYPE) for x in (k, v)]
    loc = torch.tensor([0, nq], dtype=torch.int32, device=device)
    out = kk.multi_query_attention(
        torch.from_numpy(q).to(device, DTYPE), loc, batch.kv_cache, batch.staging,
        batch.block_table, batch.seq_lens, batch.quantized_lens, batch.staging_slots, preset,
        d**-0.5, max_query_len=nq, sink_lens=batch.sink_lens, fresh_kv=(fresh[0], fresh[1]),
    )  # fmt: skip
    q_in = torch.from_numpy(q).to(DTYPE).float().numpy()
    exact = (through_dtype(k[t - nq :], DTYPE), through_dtype(v[t - nq :], DTYPE))
    ref = staged_reference(batch.refs[0], DTYPE)
    want = reference_attention(q_in, ref, d**-0.5, exact_kv=exact)
    got = out.float().cpu().numpy()
    for h in range(hq):
        assert_close_rms(want[:, h], got[:, h], TOL, what=f"fresh {magnitude:g} head {h}")


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("magnitude", MAGNITUDES)
def test_staged_rows_past_fp16_range_cpu(kind: str, magnitude: float) -> None:
    run_decode(kind, magnitude, "cpu", "kvarn_k4v2_g64", 64, 1, 2)


@pytest.mark.interpreter
def test_fresh_rows_past_fp16_range_cpu() -> None:
    run_fresh(1e20, "cpu", "kvarn_k4v2_g64", 64, 1, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("fast", ["1", "0"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("magnitude", MAGNITUDES)
def test_staged_rows_past_fp16_range_gpu(
    kind: str, magnitude: float, fast: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Llama-3.1-8B shape, where the fast decode path (the Gluon kernel over the records,
    the Triton kernel over the sink rows and staging) applies, and the Triton kernel alone."""
    from kvarn_kernels.attention.launch import fast_decode_applies

    preset, d, hkv, hq = "kvarn_k4v2_g128", 128, 8, 32
    set_env(monkeypatch, "KVARN_KERNELS_FAST_DECODE", fast)
    probe = torch.zeros((1, hq, d), dtype=DTYPE, device="cuda")
    assert fast_decode_applies(probe, tile_layout(preset, d), hkv, None) == (fast == "1")
    run_decode(kind, magnitude, "cuda", preset, d, hkv, hq)


@pytest.mark.gpu
@pytest.mark.parametrize("magnitude", MAGNITUDES)
def test_fresh_rows_past_fp16_range_gpu(magnitude: float) -> None:
    run_fresh(magnitude, "cuda", "kvarn_k4v2_g128", 128, 8, 32)
