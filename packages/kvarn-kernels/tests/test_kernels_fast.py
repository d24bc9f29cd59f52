"""The fast decode path's CPU-testable parts: its query preparation (plain Triton, interpreter)
and when the launcher takes it. The Gluon kernel itself has no interpreter: it is compiled for
sm_90 in ``test_kernels_sm90.py`` and checked on the GPU in ``test_kernels_gpu.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_testing import set_env
from kvarn_kernels import settings as kernel_settings
from kvarn_kernels.attention.launch import fast_decode_applies, fast_decode_supported
from kvarn_kernels.attention.prep import prepare_queries
from kvarn_math import rotate, tile_layout
from kvarn_math.testing import make_kv

LOG2E = 1.4426950408889634


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("raw_keys", [False, True])
@pytest.mark.parametrize(("b", "hq", "d"), [(3, 8, 128), (1, 5, 64), (2, 4, 256)])
def test_prepare_queries_matches_numpy(dtype, raw_keys, b, hq, d) -> None:
    q = torch.from_numpy(make_kv((b, hq, d), "outlier_channels", 3)).to(dtype)
    q[0, 0] = 0  # an all-zero row keeps max 1
    scale = d**-0.5
    qs, qa = prepare_queries(q, scale, raw_keys)
    frames = 2 if raw_keys else 1
    assert qs.shape == (b, frames, hq, d) and qs.dtype == torch.float16
    assert qa.shape == (b, frames, hq) and qa.dtype == torch.float32
    x = q.float().numpy() * np.float32(scale * LOG2E)
    want = [rotate(x, axis=-1)] + ([x] if raw_keys else [])
    for f, w in enumerate(want):
        amax = np.abs(w).max(-1)
        amax = np.where(amax > 0, amax, 1.0)
        np.testing.assert_allclose(qa[:, f].numpy(), amax, rtol=1e-5)
        np.testing.assert_allclose(
            qs[:, f].float().numpy(), w / amax[..., None], atol=1e-3, rtol=1e-3
        )
        assert float(qs[:, f].abs().max()) <= 1.0
    assert float(qa[0, 0, 0]) == 1.0 and not qs[0, :, 0].any()


def test_prepare_queries_reads_strided_rows() -> None:
    base = torch.from_numpy(make_kv((4, 12, 64), "gaussian", 1))
    q = base[:, ::2]  # head stride 128, last dim contiguous
    qs, qa = prepare_queries(q, 0.125, True)
    ref_qs, ref_qa = prepare_queries(q.contiguous(), 0.125, True)
    torch.testing.assert_close(qs, ref_qs, rtol=0, atol=0)
    torch.testing.assert_close(qa, ref_qa, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("preset", "d", "hq", "hkv", "dtype", "window", "want"),
    [
        ("kvarn_k4v2_g128", 128, 32, 8, torch.bfloat16, None, True),  # Llama-3.1-8B
        ("kvarn_k4v2_g128", 128, 64, 8, torch.float16, None, True),  # GQA 8 (Qwen3-32B)
        ("kvarn_k4v2_g128", 128, 8, 8, torch.bfloat16, None, True),  # MHA
        ("kvarn_k4v2_g128", 128, 32, 2, torch.bfloat16, None, False),  # GQA 16
        ("kvarn_k4v4_g128", 128, 32, 8, torch.bfloat16, None, True),  # 4-bit values
        ("kvarn_k4v4_g128", 128, 64, 8, torch.float16, None, True),
        ("kvarn_k2v2_g128", 128, 32, 8, torch.bfloat16, None, False),  # 2-bit keys
        ("kvarn_k3v2_g128", 128, 32, 8, torch.bfloat16, None, False),
        ("kvarn_k4v2_g64", 128, 32, 8, torch.bfloat16, None, False),  # 64-token tiles
        ("kvarn_k4v2_g128", 64, 32, 8, torch.bfloat16, None, False),  # head_dim 64
        ("kvarn_k4v2_g128", 128, 32, 8, torch.float32, None, False),  # fp32 queries
        ("kvarn_k4v2_g128", 128, 32, 8, torch.bfloat16, 512, False),  # a sliding window
    ],
)
def test_fast_decode_supported_shapes(preset, d, hq, hkv, dtype, window, want) -> None:
    assert fast_decode_supported(tile_layout(preset, d), hq, hkv, dtype, window) is want


def test_fast_decode_never_applies_off_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A supported shape still takes the Triton kernel on the CPU, in Triton's interpreter,
    or with KVARN_KERNELS_FAST_DECODE=0."""
    lay = tile_layout("kvarn_k4v2_g128", 128)
    q = torch.zeros((2, 32, 128), dtype=torch.bfloat16)
    assert fast_decode_supported(lay, 32, 8, q.dtype, None)
    assert not fast_decode_applies(q, lay, 8, None)
    set_env(monkeypatch, "KVARN_KERNELS_FAST_DECODE", "0")
    assert not fast_decode_applies(q, lay, 8, None)


@pytest.mark.parametrize(("raw", "want"), [(None, 1), ("0", 0), ("2", 2), (" 4 ", 4)])
def test_fast_prefetch_reads_the_environment(raw, want, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvarn_kernels.attention.launch import fast_prefetch

    if raw is None:
        set_env(monkeypatch, "KVARN_KERNELS_FAST_PREFETCH", None)
    else:
        set_env(monkeypatch, "KVARN_KERNELS_FAST_PREFETCH", raw)
    assert fast_prefetch() == want


@pytest.mark.parametrize("raw", ["5", "-1", "yes", "1.5"])
def test_fast_prefetch_rejects_what_it_cannot_use(raw, monkeypatch: pytest.MonkeyPatch) -> None:

    monkeypatch.setenv("KVARN_KERNELS_FAST_PREFETCH", raw)
    with pytest.raises(ValueError, match=f"KVARN_KERNELS_FAST_PREFETCH.*{raw!r}"):
        kernel_settings.reload()
