"""The Triton tiles decode kernel (``attention/tiles.py``): every preset, head sizes, windows.

CPU (Triton's interpreter): the path is taken where the launcher says, and matches kvarn-math's
reference with sink rows, unrotated key tiles, sliding windows and several splits. GPU
(``-m gpu``): the same for every preset at head_dim 64, 128 and 256 on 2000-token sequences, and
against the single-kernel Triton path it replaced.
"""

from __future__ import annotations

from collections.abc import Iterator

import kvarn_kernels as kk
import numpy as np
import pytest
import torch
from kernel_testing import build_paged, staged_reference
from kvarn_kernels.attention import launch, tiles
from kvarn_math import PRESETS, get_preset, reference_attention, tile_layout
from kvarn_math.testing import assert_close_rms, make_kv
from test_kernels_attention import TOL, _run_decode


@pytest.fixture(autouse=True)
def _tiles_on() -> Iterator[None]:
    """The tiles kernel is opt-in (``KVARN_KERNELS_TILES_DECODE``); these tests turn it on
    and leave the setting as they found it."""
    launch.set_tiles_decode(True)
    yield
    launch.set_tiles_decode(None)


@pytest.fixture
def count_tiles(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times the tiles kernel was launched (a list of one count)."""
    calls = [0]
    real = tiles.launch_tiles_decode

    def counted(*args: object, **kwargs: object) -> None:
        calls[0] += 1
        real(*args, **kwargs)

    monkeypatch.setattr(tiles, "launch_tiles_decode", counted)
    return calls


@pytest.mark.parametrize(
    "case",
    [
        # 2-bit keys, a window that cuts a tile, more splits than some sequences have tiles
        {"preset": "kvarn_k2v2_g128", "head_dim": 64, "lens": [300, 129, 5], "splits": 3,
         "window": 150, "group": 4},
        # 3-bit keys, sink rows, records with unrotated keys, GQA 3
        {"preset": "kvarn_k3v2_g128", "head_dim": 64, "lens": [400, 260], "splits": 2,
         "window": None, "group": 3, "sinks": [True, False], "raw_keys": True},
        # 4-bit keys and values at G = 64, head_dim 128, a window, the launcher's split count (1 on a CPU)
        {"preset": "kvarn_k4v4_g64", "head_dim": 128, "lens": [330, 64], "splits": None,
         "window": 100, "group": 2},
    ],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tiles_kernel_matches_reference(
    case: dict[str, object], dtype: torch.dtype, count_tiles: list[int]
) -> None:
    _run_decode({"num_kv_heads": 2, "seed": 7, **case}, dtype)
    assert count_tiles[0] == 1


def test_tiles_kernel_not_taken_for_fp32_or_when_off(count_tiles: list[int]) -> None:
    case = {"preset": "kvarn_k4v2_g64", "head_dim": 64, "num_kv_heads": 1, "group": 2,
            "lens": [130], "splits": 2, "window": None, "seed": 3}  # fmt: skip
    _run_decode(case, torch.float32)
    assert count_tiles[0] == 0
    launch.set_tiles_decode(False)
    try:
        _run_decode(case, torch.float16)
    finally:
        launch.set_tiles_decode(True)
    assert count_tiles[0] == 0
    _run_decode(case, torch.float16)
    assert count_tiles[0] == 1
    launch.set_tiles_decode(None)  # the default: KVARN_KERNELS_TILES_DECODE, off
    count_tiles[0] = 0
    _run_decode(case, torch.float16)
    assert count_tiles[0] == 0


def _realistic(
    preset: str, d: int, hq: int, hkv: int, dtype: torch.dtype, window: int | None
) -> tuple[object, np.ndarray, tuple[object, ...], dict[str, object]]:
    g = get_preset(preset).group_size
    lens = [1, g - 1, g, 2000, 3 * g + 1]
    seqs = [
        (
            make_kv((t, hkv, d), "outlier_channels", i),
            make_kv((t, hkv, d), "gaussian", 9 + i),
        )
        for i, t in enumerate(lens)
    ]
    batch = build_paged(seqs, preset, dtype, "cuda", sinks=[True, False, True, True, False])
    q = make_kv((len(lens), hq, d), "gaussian", 3)
    args = (
        torch.from_numpy(q).to("cuda", dtype),
        batch.kv_cache,
        batch.staging,
        batch.block_table,
        batch.seq_lens,
        batch.quantized_lens,
        batch.staging_slots,
        preset,
        d**-0.5,
    )
    kwargs = {"sliding_window": window, "sink_lens": batch.sink_lens}
    return batch, q, args, kwargs


# The bench's shapes (kvarn_kernels.bench.SHAPES), so that the GPU command's bench after these
# tests finds most variants compiled.
_SHAPES = [(64, 32, 8), (128, 32, 8), (256, 16, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize(("d", "hq", "hkv"), _SHAPES)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_tiles_kernel_realistic(
    preset: str, d: int, hq: int, hkv: int, count_tiles: list[int]
) -> None:
    """Every preset and head size, bf16, with sink rows, without and with a window: against the
    reference and the single-kernel Triton path (``set_tiles_decode(False)``) of the same
    call."""
    dtype = torch.bfloat16
    batch, q, args, kwargs = _realistic(preset, d, hq, hkv, dtype, None)
    for window in (None, 700):
        count_tiles[0] = 0
        kwargs = {**kwargs, "sliding_window": window}
        out = kk.decode_attention(*args, **kwargs)
        gluon = launch.fast_decode_applies(args[0], tile_layout(preset, d), hkv, window)
        assert count_tiles[0] == (0 if gluon else 1)
        launch.set_tiles_decode(False)
        try:
            legacy = kk.decode_attention(*args, **kwargs)
        finally:
            launch.set_tiles_decode(True)
        q_in = torch.from_numpy(q).to(dtype).float().numpy()
        for b, ref in enumerate(batch.refs):
            want = reference_attention(
                q_in[b : b + 1], staged_reference(ref, dtype), d**-0.5, window
            )
            got = out[b : b + 1].float().cpu().numpy()
            assert_close_rms(want, got, TOL[dtype], what=f"seq {b} window {window}")
            base = legacy[b : b + 1].float().cpu().numpy()
            assert_close_rms(base, got, TOL[dtype], what=f"seq {b} window {window}, old path")
        assert np.isfinite(out.float().cpu().numpy()).all()


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["kvarn_k2v2_g128", "kvarn_k4v4_g64"])
def test_tiles_kernel_fp16_and_cuda_graph(preset: str) -> None:
    """fp16 at head_dim 128, and a CUDA-graph replay after the inputs change in place."""
    dtype = torch.float16
    batch, q, args, kwargs = _realistic(preset, 128, 32, 8, dtype, None)
    out = torch.empty_like(args[0])
    kk.decode_attention(*args, **kwargs, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kk.decode_attention(*args, **kwargs, out=out)
    args[0].mul_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    q_in = (torch.from_numpy(q).to(dtype) * 0.5).float().numpy()
    for b, ref in enumerate(batch.refs):
        want = reference_attention(q_in[b : b + 1], staged_reference(ref, dtype), 128**-0.5)
        assert_close_rms(want, out[b : b + 1].float().cpu().numpy(), TOL[dtype], what=f"seq {b}")


def test_tiles_kernel_compiles_for_sm90() -> None:
    """Every preset and head size compiles for sm_90 within an SM's shared memory, and where
    ``tiles_launch`` caps the registers (3 CTAs per SM), without spills."""
    from test_kernels_sm90 import SM90_MAX_SHARED, _compile

    rows = _compile("tiles")
    assert len(rows) == len(PRESETS) * 3 + 2  # and two multi-query variants
    bad = [r for r in rows if "error" in r or r["shared"] > SM90_MAX_SHARED]
    assert not bad, bad
    capped = [r for r in rows if "maxnreg" in r]
    assert capped and all(r["spill_store_bytes"] == 0 for r in capped), capped
