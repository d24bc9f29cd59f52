"""vLLM's own V2 worker pipeline on CPU with kvarn layers (full + sliding window, GQA).

spec collection -> KV cache groups and config -> attention backends and builders ->
raw cache allocation and reshape -> per-step metadata (vLLM's build_attn_metadata) ->
each layer's forward with the real kvarn kernels (Triton interpreter).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import _releases
import numpy as np
import pytest
import torch
from _records import cached_records
from kvarn_math.layout import tile_layout
from kvarn_vllm.step import STEP

PRESET, G, HQ, HKV, D = "kvarn_k4v4_g64", 64, 4, 1, 64

# Kernels run on CPU tensors in Triton's interpreter (conftest sets it when there is no GPU).
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="runs the kvarn kernels on CPU tensors: needs TRITON_INTERPRET=1",
)


def _near_reference(out, q, k, v, window, where, kv_cache, block_row, recent=0):
    """``out`` against kvarn-math's attention over the same tokens, tile 0 exact, the step's
    recent window exact (``recent`` tiles before its first query's, in a ring of ``1 + recent``
    tiles), the queries' own tokens exact (a chunk attends them from the
    step's K/V, on the dense path and through the multi-query kernel alike), and the other
    complete tiles as the records the cache holds in ``block_row`` (checked to encode exactly
    these tokens, ``_records``): within 2%, and much closer to it than to exact attention when
    records are read (so the records, not exact K/V, were read)."""
    from kvarn_math.attention import QuantizedSequence, reference_attention, step_sequence
    from kvarn_math.layout import get_preset
    from kvarn_vllm.config import window_keys_from_env

    kf, vf = k.float().numpy(), v.float().numpy()
    seq = step_sequence(
        kf,
        vf,
        PRESET,
        kf.shape[0] - q.shape[0],
        recent_tiles=recent,
        ring_tiles=1 + recent,
        keep_first_tile=True,
        window_keys=window_keys_from_env(PRESET),
    )
    seq = cached_records(kv_cache, block_row, kf, vf, seq, PRESET, D)
    lay = tile_layout(PRESET, D)
    exact_seq = QuantizedSequence(
        get_preset(PRESET), D, np.zeros((0, HKV, lay.tile_bytes), np.uint8), kf, vf
    )
    qn = q.float().numpy()
    own = (kf[kf.shape[0] - qn.shape[0] :], vf[vf.shape[0] - qn.shape[0] :])
    ref = torch.from_numpy(
        reference_attention(qn, seq, D**-0.5, sliding_window=window, exact_kv=own)
    )
    exact = torch.from_numpy(reference_attention(qn, exact_seq, D**-0.5, sliding_window=window))

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    assert rel(out, ref) < 0.02, (where, rel(out, ref))
    if rel(ref, exact) > 1e-2:  # records were read
        assert rel(out, ref) < 0.5 * rel(out, exact), (where, rel(out, ref), rel(out, exact))


@pytest.mark.parametrize(
    ("dense_context", "recent", "window_keys"),
    [
        ("off", 1, "0"),
        ("on", 1, "0"),
        ("tiny", 1, "0"),
        ("on", 0, "0"),
        ("on", 1, "1"),
        ("off", 1, "1"),
    ],
)
def test_v2_pipeline_full_and_sliding(
    vllm_config_factory, monkeypatch, dense_context, recent, window_keys
):
    """``dense_context``: continuation chunks through the multi-query kernel (off), the
    dense path (on), or the dense path with a workspace too small for the row (tiny: the
    row falls back to the multi-query kernel). ``recent``: complete tiles read exact from
    staging (the default 1, or 0). ``window_keys``: the exact tiles keep only their values
    (the default 0) or their keys too."""
    from kvarn_vllm import dense
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.worker.gpu import attn_utils

    monkeypatch.setenv(dense.DENSE_CONTEXT_ENV, "0" if dense_context == "off" else "1")
    monkeypatch.setenv("KVARN_VLLM_RECENT_TILES", str(recent))
    monkeypatch.setenv("KVARN_VLLM_WINDOW_KEYS", window_keys)
    monkeypatch.setattr(dense, "_WORKSPACES", {})
    # Workspace of 1024 tokens, or 128 (tiny): less than the 170-token context row below.
    ws_tokens = 128 if dense_context == "tiny" else 1024
    monkeypatch.setattr(dense, "DENSE_CONTEXT_WORKSPACE_BYTES", ws_tokens * 2 * HKV * D * 2)
    vc = vllm_config_factory(PRESET, max_num_seqs=4, max_num_batched_tokens=256)
    # After construction: VllmConfig refuses V2 without a GPU Triton; the builder only checks.
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    vc.cache_config.block_size = G
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    torch.set_default_dtype(torch.float16)
    try:
        with set_current_vllm_config(vc):
            layers = [
                Attention(
                    num_heads=HQ,
                    head_size=D,
                    scale=D**-0.5,
                    num_kv_heads=HKV,
                    cache_config=vc.cache_config,
                    prefix=names[0],
                ),
                Attention(
                    num_heads=HQ,
                    head_size=D,
                    scale=D**-0.5,
                    num_kv_heads=HKV,
                    cache_config=vc.cache_config,
                    prefix=names[1],
                    per_layer_sliding_window=96,
                ),
            ]
    finally:
        torch.set_default_dtype(torch.float32)

    specs = attn_utils.get_kv_cache_spec(vc)
    assert set(specs) == set(names)
    page = tile_layout(PRESET, D).page_bytes(HKV)
    assert all(s.page_size_bytes == page for s in specs.values())
    groups = get_kv_cache_groups(vc, specs)
    assert len(groups) == 2  # full attention and sliding window, same page size
    # Hybrid groups share one tensor per layer pair; block ids are disjoint across groups.
    num_blocks = 24
    kv_cache_config = get_kv_cache_config_from_groups(vc, groups, num_blocks * page)
    assert kv_cache_config.num_blocks == num_blocks
    assert len(kv_cache_config.kv_cache_tensors) == 1

    device = torch.device("cpu")
    attn_groups, cg_info, kernel_block_sizes = attn_utils.init_attn_backend(
        kv_cache_config, vc, device
    )
    assert kernel_block_sizes == [G, G]
    assert cg_info.min_cg_support == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    flat_groups = [g for gs in attn_groups for g in gs]
    raw = attn_utils._allocate_kv_cache(kv_cache_config, {}, device)
    kv_caches = attn_utils._reshape_kv_cache(
        attn_groups=flat_groups,
        kv_cache_raw_tensors=raw,
        kernel_block_sizes=kernel_block_sizes,
        cache_dtype=PRESET,
        shared_kv_cache_layers={},
        kv_cache_config=kv_cache_config,
    )
    for name in names:
        assert kv_caches[name].shape == (num_blocks, HKV, tile_layout(PRESET, D).tile_bytes)
        assert kv_caches[name].dtype is torch.uint8

    # Two requests: request rows 2 and 0; prompt lengths 100 and 40, then one decode each.
    gen = torch.Generator().manual_seed(1)
    tables = [torch.zeros((4, 8), dtype=torch.int32) for _ in range(2)]
    blocks = {2: [3, 4], 0: [5]}
    for t, offset in zip(tables, (0, 10)):
        for row, ids in blocks.items():
            t[row, : len(ids)] = torch.tensor(ids, dtype=torch.int32) + offset
    history: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def step(rows, cached, new, first_blocks=None):
        qsl = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
        seq = (np.array(cached) + np.array(new)).astype(np.int32)
        if first_blocks is not None:  # requests added to their rows, with their tile-0 blocks
            STEP.report_added(rows, first_blocks)
        elif not any(cached):  # new requests in their rows: they keep their first tile exact
            STEP.report_added(rows)
        STEP.report_real(
            SimpleNamespace(num_reqs=len(rows), idx_mapping_np=np.array(rows, dtype=np.int32))
        )
        n = int(qsl[-1])
        metadata = attn_utils.build_attn_metadata(
            attn_groups=attn_groups,
            num_reqs=len(rows),
            num_tokens=n,
            query_start_loc_gpu=torch.from_numpy(qsl),
            query_start_loc_cpu=torch.from_numpy(qsl),
            max_query_len=int(max(new)),
            seq_lens=torch.from_numpy(seq),
            max_seq_len=int(seq.max()),
            block_tables=[t[rows] for t in tables],
            slot_mappings=torch.zeros((2, n), dtype=torch.int64),
            kv_cache_config=kv_cache_config,
            seq_lens_cpu_upper_bound=torch.from_numpy(seq),
        )
        assert set(metadata) == set(names)
        outs = []
        for li, (name, layer) in enumerate(zip(names, layers)):
            q = torch.randn(n, HQ, D, generator=gen).half()
            k = torch.randn(n, HKV, D, generator=gen).half()
            v = torch.randn(n, HKV, D, generator=gen).half()
            out = torch.full((n, HQ, D), float("nan"), dtype=torch.float16)
            layer.impl.forward(layer, q, k, v, kv_caches[name], metadata[name], output=out)
            for r, lo, hi in zip(rows, qsl[:-1], qsl[1:]):
                old = history.get((li, r), (k[:0], v[:0]))
                history[(li, r)] = (torch.cat([old[0], k[lo:hi]]), torch.cat([old[1], v[lo:hi]]))
            outs.append((q, out, metadata[name]))
        return outs

    step([2, 0], [0, 0], [100, 40])
    outs = step([2, 0], [100, 40], [1, 1])
    for li, (q, out, meta) in enumerate(outs):
        window = 96 if li == 1 else None
        assert meta.decode is not None and meta.decode.token_index is None
        for i, r in enumerate([2, 0]):
            k, v = history[(li, r)]
            # Default serving keeps the first tile exact (the sink rows of staging).
            _near_reference(
                out[i : i + 1],
                q[i : i + 1],
                k,
                v,
                window,
                (li, r),
                kv_caches[names[li]],
                tables[li][r],
                recent,
            )
    # A chunked-prefill continuation (69 tokens after 101 cached: a context row) beside a
    # decode row, through multi_query_attention or the dense path: dequantized tiles, the
    # exact first tile and staging, attended in torch here (no GPU).
    outs = step([2, 0], [101, 41], [69, 1])
    for li, (q, out, meta) in enumerate(outs):
        window = 96 if li == 1 else None
        assert meta.context is not None
        workspace = layers[li].impl.workspace
        assert (workspace is None) == (dense_context == "off")
        if workspace is not None:
            assert workspace.shape[1] == ws_tokens
        assert dense.use_dense_context(meta.context, workspace) == (dense_context != "off")
        k, v = history[(li, 2)]
        # The dense path and the multi-query kernel read the chunk's own tokens (from 101 on)
        # exact, although the store completed their tile.
        _near_reference(
            out[:69],
            q[:69],
            k,
            v,
            window,
            (li, "context"),
            kv_caches[names[li]],
            tables[li][2],
            recent,
        )
    # One tensor, two groups: group 0 quantized the 170-token request's two tiles into blocks 3
    # and 4, group 1 into 13 and 14 (the sink's record too, for prefix-cache hits); nothing else
    # was written (the 41-token request has no complete tile).
    assert kv_caches[names[0]].data_ptr() == kv_caches[names[1]].data_ptr()
    written = [b for b in range(num_blocks) if kv_caches[names[0]][b].any()]
    assert written == [3, 4, 13, 14]  # the continuation completed each group's second tile

    # A second continuation of row 2 (80 tokens after 170): its first query is at 170, so the
    # sliding-window layer (96) sees nothing before position 75 and the dense path starts its
    # keys at tile 1 (position 64), without the sink; the full layer takes everything.
    for t, offset in zip(tables, (0, 10)):
        t[2, 2:4] = torch.tensor([8, 9], dtype=torch.int32) + offset
    for li, (q, out, _meta) in enumerate(step([2], [170], [80])):
        window = 96 if li == 1 else None
        k, v = history[(li, 2)]
        _near_reference(
            out,
            q,
            k,
            v,
            window,
            (li, "second continuation"),
            kv_caches[names[li]],
            tables[li][2],
            recent,
        )

    # Preemption and recompute: the 170-token request (row 2) is preempted and resumed in the
    # same row from nothing (vLLM recomputes it; 80 tokens here) with other blocks. Its stale
    # staging, sink rows and old blocks must not leak into what the resumed request attends.
    for t, offset in zip(tables, (0, 10)):
        t[2, :2] = torch.tensor([6, 7], dtype=torch.int32) + offset
    for li in range(2):
        history.pop((li, 2))
    step([2], [0], [80], first_blocks=[(6, 16)])
    for li, (q, out, _meta) in enumerate(step([2], [80], [1])):
        window = 96 if li == 1 else None
        k, v = history[(li, 2)]
        _near_reference(
            out[:1],
            q[:1],
            k,
            v,
            window,
            (li, "resumed"),
            kv_caches[names[li]],
            tables[li][2],
            recent,
        )

    # A new request in row 1 that hit the prefix cache on row 2's first tile (blocks 6 / 16):
    # it computes only its 10 tokens after it, and reads that tile exact from row 2's sink rows
    # (as row 2 does), not from the quantized record.
    for t, offset in zip(tables, (0, 10)):
        t[1, :2] = torch.tensor([6, 11], dtype=torch.int32) + offset
    for li in range(2):
        k2, v2 = history[(li, 2)]
        history[(li, 1)] = (k2[:G], v2[:G])
    outs = step([1], [G], [10], first_blocks=[(6, 16)])
    for li, (q, out, meta) in enumerate(outs):
        window = 96 if li == 1 else None
        assert meta.context is not None and int(meta.context.sink_slots[0]) == 2
        k, v = history[(li, 1)]
        # Only tile 0 (exact here) and 10 staged tokens: nothing is read from a record (but
        # the keys of tile 0 with values-only windows), so the kernels match the
        # exact-first-tile reference to fp16 rounding, far from the record's.
        from kvarn_math.attention import quantize_sequence, reference_attention
        from kvarn_vllm.config import window_keys_from_env

        errs = []
        for exact in (True, False):
            seq = quantize_sequence(
                k.float().numpy(),
                v.float().numpy(),
                PRESET,
                keep_first_tile=exact,
                window_keys=window_keys_from_env(PRESET) or not exact,
            )
            # the record the cache holds (its key frame chosen from the queries)
            kf, vf = k.float().numpy(), v.float().numpy()
            seq = cached_records(kv_caches[names[li]], tables[li][1], kf, vf, seq, PRESET, D)
            ref = torch.from_numpy(
                reference_attention(q.float().numpy(), seq, D**-0.5, sliding_window=window)
            )
            errs.append(float((out.float() - ref).norm() / ref.norm()))
        assert errs[0] < 0.02 and errs[0] < errs[1] / 2, (li, "prefix hit", errs)


def test_dense_runs_pack_rows_into_the_workspace(monkeypatch):
    from kvarn_vllm import dense

    assert dense.dense_runs([100, 100, 100], 256) == [(0, 2), (2, 3)]
    assert dense.dense_runs([300, 50, 50], 256) == [(0, 1), (1, 3)]
    assert dense.dense_runs([50, 300, 50], 256) == [(0, 1), (1, 2), (2, 3)]
    assert dense.dense_runs([256, 1], 256) == [(0, 1), (1, 2)]
    assert dense.dense_runs([], 256) == []
    for lens in ([5] * 10, [200, 60, 1, 400, 3, 255], [1000]):
        runs = dense.dense_runs(lens, 256)
        assert [r for lo, hi in runs for r in range(lo, hi)] == list(range(len(lens)))
        for lo, hi in runs:  # a run fits, or is one row that does not
            assert sum(lens[lo:hi]) <= 256 or hi - lo == 1

    monkeypatch.setenv(dense.DENSE_CONTEXT_ENV, "yes")
    with pytest.raises(ValueError, match="KVARN_VLLM_DENSE_CONTEXT must be 0 or 1, got 'yes'"):
        dense.dense_context_enabled()
    monkeypatch.delenv(dense.DENSE_CONTEXT_ENV)
    assert dense.dense_context_enabled()


# vLLM 0.26's planning and allocation functions: where the 'kv-cache-spec' ledger entry applies
pytestmark = [pytestmark, _releases.needs("kv-cache-spec")]
