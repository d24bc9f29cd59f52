"""The metadata builder and the layer's forward pass, end to end on CPU.

Real vLLM ``Attention`` layer, real builder, real kvarn-kernels (Triton interpreter),
a step sequence covering prefill, decode, mixed batches and a chunked-prefill
continuation; outputs compared with exact attention over the same K/V.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import _releases
import numpy as np
import pytest
import torch
from _records import cached_records
from kvarn_vllm import metadata as md
from kvarn_vllm import sink
from kvarn_vllm.prefill import exact_causal_attention
from kvarn_vllm.step import STEP

PRESET = "kvarn_k4v4_g64"
G, HQ, HKV, D = 64, 4, 2, 64
MAX_BLOCKS = 4

# Kernels run on CPU tensors in Triton's interpreter (conftest sets it when there is no GPU).
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="runs the kvarn kernels on CPU tensors: needs TRITON_INTERPRET=1",
)


def test_split_rows():
    s = md.split_rows(np.array([10, 0, 5, 0, 7]), np.array([1, 30, 8, 0, 0]))
    assert s.decode.tolist() == [0]  # rows 3 and 4 have no query: no kind
    assert s.fresh.tolist() == [1]
    assert s.context.tolist() == [2]
    assert s.uniform is None
    assert md.split_rows(np.array([3, 4]), np.array([1, 1])).uniform == "decode"
    with pytest.raises(ValueError):
        md.split_rows(np.array([1]), np.array([-1]))


def test_encoded_block_table():
    t = md.encoded_block_table(3, 5)
    assert t.shape == (3, 5) and t[2, 4] == 14 and t.dtype == np.int32
    with pytest.raises(ValueError, match="int32"):
        md.encoded_block_table(2**16, 2**16)


class Harness:
    """One kvarn layer plus its builder, driven step by step like vLLM's V2 runner."""

    def __init__(self, vllm_config_factory, monkeypatch, preset=PRESET, head_dim=D):
        from kvarn_math.layout import get_preset
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.attention.attention import Attention

        sink.reset()  # no earlier test's first-tile owners (rows are reused)
        self.preset, self.d = preset, head_dim
        self.g = get_preset(preset).group_size
        self.vc = vllm_config_factory(preset, max_num_seqs=4, max_num_batched_tokens=256)
        self.vc.cache_config.block_size = self.g
        torch.set_default_dtype(torch.float16)
        try:
            with set_current_vllm_config(self.vc):
                self.layer = Attention(
                    num_heads=HQ,
                    head_size=head_dim,
                    scale=head_dim**-0.5,
                    num_kv_heads=HKV,
                    cache_config=self.vc.cache_config,
                    prefix="model.layers.0.self_attn.attn",
                )
        finally:
            torch.set_default_dtype(torch.float32)
        self.spec = _releases.worker_spec(self.layer, self.vc)  # as the release's worker has it
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
        builder_cls = self.layer.attn_backend.get_builder_cls()
        self.builder = builder_cls(self.spec, [self.layer.layer_name], self.vc, torch.device("cpu"))
        num_blocks = 16
        cache = _releases.layer_cache(self.layer.attn_backend, self.spec, num_blocks)
        self.kv_cache = _releases.records(cache)  # [num_blocks, HKV, tile_bytes]
        self.block_table = torch.zeros((4, MAX_BLOCKS), dtype=torch.int32)  # per slot
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # slot -> all K, V so far
        gen = torch.Generator().manual_seed(0)
        self.rand = lambda *s: torch.randn(*s, generator=gen).to(torch.float16)

    def step(self, reqs):
        """reqs: list of (slot, num_cached, num_new, blocks). Returns (metadata, q, out)."""
        from vllm.v1.attention.backend import CommonAttentionMetadata

        for slot, _, _, blocks in reqs:
            self.block_table[slot, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        num_new = np.array([r[2] for r in reqs], dtype=np.int32)
        seq = np.array([r[1] + r[2] for r in reqs], dtype=np.int32)
        qsl = np.concatenate([[0], np.cumsum(num_new)]).astype(np.int32)
        slots = np.array([r[0] for r in reqs], dtype=np.int32)
        STEP.report_real(SimpleNamespace(num_reqs=len(reqs), idx_mapping_np=slots))
        cam = CommonAttentionMetadata(
            query_start_loc=torch.from_numpy(qsl),
            query_start_loc_cpu=torch.from_numpy(qsl),
            seq_lens=torch.from_numpy(seq),
            num_reqs=len(reqs),
            num_actual_tokens=int(qsl[-1]),
            max_query_len=int(num_new.max()),
            max_seq_len=int(seq.max()),
            block_table_tensor=self.block_table[slots].contiguous(),
            slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
            seq_lens_cpu_upper_bound=torch.from_numpy(seq),
        )
        meta = self.builder.build(0, cam)
        n = int(qsl[-1])
        d = self.d
        q, k, v = self.rand(n, HQ, d), self.rand(n, HKV, d), self.rand(n, HKV, d)
        for (slot, cached, new, _), lo in zip(reqs, qsl[:-1]):
            old_k, old_v = self.kv.get(slot, (k[:0], v[:0]))
            assert old_k.shape[0] == cached
            self.kv[slot] = (
                torch.cat([old_k, k[lo : lo + new]]),
                torch.cat([old_v, v[lo : lo + new]]),
            )
        out = torch.full((n, HQ, d), float("nan"), dtype=torch.float16)
        self.layer.impl.forward(self.layer, q, k, v, self.kv_cache, meta, output=out)
        return meta, q, out, qsl

    def exact(self, slot, q_rows, num_queries):
        """Exact attention of the last ``num_queries`` positions of ``slot``'s sequence."""
        k, v = self.kv[slot]
        total = k.shape[0]
        qk = torch.zeros(total, HQ, self.d, dtype=torch.float16)
        qk[total - num_queries :] = q_rows
        out = torch.zeros_like(qk)
        exact_causal_attention(qk, k, v, out, [0, total], self.d**-0.5)
        return out[total - num_queries :].float()

    def quantized(self, slot, q_rows, recent=None, exact_start=0):
        """kvarn-math's reference: the same sequence stored as tiles + open tail, the tiles as
        the cache's own records (checked to encode exactly these tokens, ``_records``), the
        step's recent window (``recent`` tiles before its first query's, default the
        builder's, from ``exact_start`` on) read exact, and several query rows' own tokens
        exact (a chunk or verify step attends them from the step's K/V)."""
        from kvarn_math.attention import reference_attention, step_sequence
        from kvarn_math.hadamard import rotate, unrotate

        def staged(x):  # the kernels quantize rotated tokens as rounded to the fp16 staging
            rot = torch.from_numpy(rotate(x.float().numpy(), axis=-1)).half().float().numpy()
            return unrotate(rot, axis=-1)

        k, v = self.kv[slot]
        kf, vf = staged(k), staged(v)
        if recent is None:
            recent = self.builder.config.recent_tiles
        n = q_rows.shape[0]
        seq = step_sequence(
            kf,
            vf,
            self.preset,
            kf.shape[0] - n,
            recent_tiles=recent,
            ring_tiles=self.builder.config.ring_tiles,
            exact_start=exact_start,
            window_keys=self.builder.config.window_keys,
        )
        seq = cached_records(
            self.kv_cache, self.block_table[slot], kf, vf, seq, self.preset, self.d
        )
        own = (kf[kf.shape[0] - n :], vf[vf.shape[0] - n :]) if n > 1 else None
        ref = reference_attention(q_rows.float().numpy(), seq, self.d**-0.5, exact_kv=own)
        ref = torch.from_numpy(ref)
        return ref, seq.records.shape[0] > seq.recent_tiles


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _near_quantized(h, got, slot, q_rows, recent=None, exact_start=0):
    """``got`` matches kvarn-math's attention over the cache's records, and is much closer to
    it than to exact attention where some record is read (so the records, not exact K/V, were
    read; with recent tiles, a short sequence reads none)."""
    ref, reads_records = h.quantized(slot, q_rows, recent, exact_start)
    exact = h.exact(slot, q_rows, q_rows.shape[0])
    assert _rel(got, ref) < 0.02, _rel(got, ref)
    if reads_records:
        assert _rel(got, ref) < 0.5 * _rel(got, exact), (_rel(got, ref), _rel(got, exact))


@pytest.mark.parametrize("recent", ["0", "1"])
def test_steps_prefill_decode_mixed_chunked(vllm_config_factory, monkeypatch, recent):
    monkeypatch.setenv("KVARN_VLLM_RECENT_TILES", recent)
    h = Harness(vllm_config_factory, monkeypatch)
    assert h.builder.config.recent_tiles == int(recent)

    # Step 1: two fresh prompts. Exact attention over their own K/V.
    meta, q, out, qsl = h.step([(1, 0, 100, [3, 5]), (3, 0, 70, [7, 2])])
    assert meta.fresh is not None and meta.decode is None and meta.context is None
    assert meta.plan.num_tiles == 2  # tile 0 of both requests completes
    assert sorted(meta.plan.tiles[:, 0].tolist()) == [3, 7]  # real block ids, on the device
    for slot, (lo, hi) in ((1, (0, 100)), (3, (100, 170))):
        assert _rel(out[lo:hi], h.exact(slot, q[lo:hi], hi - lo)) < 2e-3
    assert h.kv_cache[3].any() and h.kv_cache[7].any() and not h.kv_cache[5].any()

    # Step 2: both decode (uniform batch: one decode_attention call, padded plan).
    meta, q, out, _ = h.step([(1, 100, 1, [3, 5]), (3, 70, 1, [7, 2])])
    assert meta.decode is not None and meta.decode.token_index is None
    assert meta.plan.tiles.shape[0] == 2 and meta.plan.writes.shape[0] == 2
    for row, slot in enumerate((1, 3)):
        _near_quantized(h, out[row : row + 1], slot, q[row : row + 1])

    # Step 3: mixed: one decode, one new prompt's first chunk (fresh) in slot 0.
    meta, q, out, qsl = h.step([(1, 101, 1, [3, 5]), (0, 0, 40, [9])])
    assert meta.decode is not None and meta.fresh is not None
    assert meta.decode.token_index is not None
    _near_quantized(h, out[0:1], 1, q[0:1])
    assert _rel(out[1:41], h.exact(0, q[1:41], 40)) < 2e-3

    # Step 4: chunked-prefill continuation of slot 0 (40 cached, 50 new) next to a decode.
    meta, q, out, qsl = h.step([(3, 71, 1, [7, 2]), (0, 40, 50, [9, 11])])
    assert meta.context is not None
    assert meta.plan.num_tiles == 1  # slot 0 completes its first tile (staged 40 + fresh 24)
    assert meta.plan.tiles[0, 0].item() == 9
    _near_quantized(h, out[0:1], 3, q[0:1])
    _near_quantized(h, out[1:51], 0, q[1:51])
    assert not torch.isnan(out).any()


def test_default_preset_at_head_dim_128(vllm_config_factory, monkeypatch):
    """The shipped default, ``kvarn_k4v2_g128`` at head_dim 128 (a 128-token tile, 2-bit
    values, its default windows and exact first tile), through the forward path: first chunks,
    uniform decodes, a 100-token continuation that completes a tile (the dense-context path)
    next to a decode, and a 20-token one (the multi-query kernel)."""
    from kvarn_math.layout import DEFAULT_PRESET

    h = Harness(vllm_config_factory, monkeypatch, preset=DEFAULT_PRESET, head_dim=128)
    assert h.builder.config.name == "kvarn_k4v2_g128" and h.g == 128
    assert h.layer.impl.head_size == 128 and h.layer.impl.workspace is not None

    meta, q, out, _ = h.step([(1, 0, 150, [3, 5]), (2, 0, 40, [7])])
    assert meta.fresh is not None and meta.decode is None and meta.context is None
    assert meta.plan.num_tiles == 1 and meta.plan.tiles[0, 0].item() == 3
    assert _rel(out[:150], h.exact(1, q[:150], 150)) < 2e-3
    assert _rel(out[150:190], h.exact(2, q[150:190], 40)) < 2e-3

    meta, q, out, _ = h.step([(1, 150, 1, [3, 5]), (2, 40, 1, [7])])
    assert meta.decode is not None and meta.decode.token_index is None
    for row, slot in enumerate((1, 2)):
        _near_quantized(h, out[row : row + 1], slot, q[row : row + 1])

    meta, q, out, _ = h.step([(1, 151, 1, [3, 5]), (2, 41, 100, [7, 9])])
    assert meta.context is not None and meta.context.max_query_len == 100
    assert meta.plan.num_tiles == 1 and meta.plan.tiles[0, 0].item() == 7
    _near_quantized(h, out[0:1], 1, q[0:1])
    _near_quantized(h, out[1:101], 2, q[1:101])

    meta, q, out, _ = h.step([(1, 152, 20, [3, 5])])
    assert meta.context is not None and meta.context.max_query_len == 20
    _near_quantized(h, out, 1, q)
    assert not torch.isnan(out).any()


def _spy(monkeypatch, name, make_spy):
    """Spy on the kernel entry ``name`` wherever kvarn-vllm reaches it: the attention plans'
    ``run`` (``kvarn_kernels.attention.wrapper``) and the direct calls
    (``kvarn_vllm.kernels``). ``make_spy(real)`` returns the spy around each real function."""
    from kvarn_kernels.attention import wrapper
    from kvarn_vllm import kernels

    for module in (kernels, wrapper):
        monkeypatch.setattr(module, name, make_spy(getattr(module, name)))


@pytest.mark.parametrize("invariant", ["0", "1"])
def test_continuation_own_kv_to_the_multi_query_kernel(vllm_config_factory, monkeypatch, invariant):
    """A continuation through the multi-query kernel gets the step's own K/V, rotated (so it
    attends its own tokens exact, checked against kvarn-math above), except in batch-invariant
    mode, where it reads them from the cache as decoding does."""
    from kvarn_vllm import kernels
    from kvarn_vllm.config import INVARIANT_ENV

    monkeypatch.setenv(INVARIANT_ENV, invariant)
    seen = []

    def make_spy(real):
        def spy(*args, **kwargs):
            seen.append(kwargs.get("fresh_kv"))
            return real(*args, **kwargs)

        return spy

    _spy(monkeypatch, "multi_query_attention", make_spy)
    h = Harness(vllm_config_factory, monkeypatch)
    h.step([(0, 0, 40, [9])])
    meta, _, out, _ = h.step([(0, 40, 50, [9, 11])])  # 50 < 64 tokens: the multi-query kernel
    assert meta.context is not None and len(seen) == 1
    if invariant == "1":
        assert seen[0] is None
    else:
        k, v = seen[0]
        assert k.shape == v.shape == (50, HKV, D)
        assert torch.equal(k, kernels.rotate(h.kv[0][0][40:90].to(k.dtype)))
    assert not torch.isnan(out).any()


def test_query_runs():
    from kvarn_vllm.groups import query_runs

    assert query_runs([0, 5, 10, 40, 41, 100], 16) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert query_runs([0, 1, 2, 3], 16) == [(0, 3)]
    assert query_runs([0, 17], 16) == [(0, 1)]
    assert query_runs([0], 16) == []


@pytest.mark.parametrize("invariant", ["0", "1", "as_decode"])
def test_invariant_context_runs_verify_blocks_apart(vllm_config_factory, monkeypatch, invariant):
    """Batch-invariant mode: a context group holding a short block (3 tokens, a verify's size)
    and a 30-token chunk goes to the multi-query kernel as two calls, each with its own longest
    block, so that the short one may run as decode rows; both rows' outputs stay kvarn-math's.
    ``KVARN_VLLM_VERIFY_AS_DECODE=1`` in the default launch: the builder moves the short block
    into the decode rows, one per token (a per-token group: one ``decode_attention`` call of 3
    rows), and the chunk alone goes to the multi-query kernel with its own K/V; both calls are
    sized for the step's 2 requests. The default launch alone makes one call for the group."""
    from kvarn_vllm.config import INVARIANT_ENV, VERIFY_AS_DECODE_ENV

    monkeypatch.setenv(INVARIANT_ENV, "1" if invariant == "1" else "0")
    monkeypatch.setenv(VERIFY_AS_DECODE_ENV, "1" if invariant == "as_decode" else "0")
    seen, flags, decoded = [], [], []

    def make_spy(real):
        def spy(*args, **kwargs):
            seen.append((kwargs["max_query_len"], int(args[0].shape[0]), kwargs.get("fresh_kv")))
            flags.append((kwargs.get("verify_as_decode"), kwargs.get("split_batch")))
            return real(*args, **kwargs)

        return spy

    def make_spy_decode(real):
        def spy_decode(*args, **kwargs):
            decoded.append((int(args[0].shape[0]), args[4].tolist(), kwargs.get("split_batch")))
            return real(*args, **kwargs)

        return spy_decode

    _spy(monkeypatch, "multi_query_attention", make_spy)
    _spy(monkeypatch, "decode_attention", make_spy_decode)
    h = Harness(vllm_config_factory, monkeypatch)
    h.step([(0, 0, 100, [9, 11]), (1, 0, 70, [3, 5])])
    meta, q, out, _ = h.step([(0, 100, 3, [9, 11]), (1, 70, 30, [3, 5])])
    assert meta.context is not None
    if invariant == "1":
        assert meta.context.max_query_len == 30 and meta.decode is None
        assert seen == [(3, 3, None), (30, 30, None)]
    elif invariant == "as_decode":
        assert meta.decode is not None and meta.decode.per_token
        assert meta.context.max_query_len == 30 and meta.context.rows.tolist() == [1]
        # the short block's 3 tokens as decode rows at positions 101, 102, 103
        assert decoded == [(3, [101, 102, 103], 2)]
        assert [x[:2] for x in seen] == [(30, 30)]
        assert seen[0][2] is not None  # the chunk's own K/V
        assert flags == [(None, 2)]
    else:
        assert meta.context.max_query_len == 30 and meta.decode is None
        assert [x[:2] for x in seen] == [(30, 33)]
    _near_quantized(h, out[0:3], 0, q[0:3])
    _near_quantized(h, out[3:33], 1, q[3:33])
    assert not torch.isnan(out).any()


def test_a_step_sizes_every_attention_call_for_its_requests(vllm_config_factory, monkeypatch):
    """The decode call and the multi-query call of one step get the step's request count as
    ``split_batch``, not their own rows, so that a verify token run as a decode row
    (``KVARN_VLLM_VERIFY_AS_DECODE=1``) is split as it would be when decoded in a step of as
    many requests (the kernels' ``split_sizing``)."""

    seen = []
    for name in ("decode_attention", "multi_query_attention"):

        def make_spy(real, _name=name):
            def spy(*args, **kwargs):
                seen.append((_name, int(args[0].shape[0]), kwargs.get("split_batch")))
                return real(*args, **kwargs)

            return spy

        _spy(monkeypatch, name, make_spy)
    h = Harness(vllm_config_factory, monkeypatch)
    h.step([(0, 0, 100, [9, 11]), (1, 0, 70, [3, 5]), (2, 0, 20, [7])])
    seen.clear()
    h.step([(0, 100, 1, [9, 11]), (1, 70, 3, [3, 5]), (2, 20, 1, [7])])
    assert seen == [("decode_attention", 2, 3), ("multi_query_attention", 3, 3)]


def test_capture_and_replay_share_buffers(vllm_config_factory, monkeypatch):
    """A full CUDA graph captured on capture metadata reads the real step's values."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    monkeypatch.setenv("KVARN_VLLM_RECENT_TILES", "1")
    h = Harness(vllm_config_factory, monkeypatch)
    qsl = torch.arange(3, dtype=torch.int32)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=torch.ones(2, dtype=torch.int32),
        num_reqs=2,
        num_actual_tokens=2,
        max_query_len=1,
        max_seq_len=1,
        block_table_tensor=h.block_table[:2],
        slot_mapping=torch.zeros(2, dtype=torch.int64),
        seq_lens_cpu_upper_bound=torch.ones(2, dtype=torch.int32),
    )
    cap = h.builder.build_for_cudagraph_capture(cam)
    assert (cap.plan.tiles[:, 0] == -1).all() and (cap.plan.writes[:, 0] == -1).all()
    h.step([(1, 0, 70, [3, 5]), (2, 0, 10, [4])])
    real, _, _, _ = h.step([(1, 70, 1, [3, 5]), (2, 10, 1, [4])])
    for a, b in (
        (cap.plan.tiles, real.plan.tiles),
        (cap.plan.writes, real.plan.writes),
        (cap.decode.seq_lens, real.decode.seq_lens),
        (cap.decode.quantized_lens, real.decode.quantized_lens),
        (cap.decode.staging_slots, real.decode.staging_slots),
    ):
        assert a.data_ptr() == b.data_ptr() and a.shape == b.shape
    assert real.decode.seq_lens.tolist() == [71, 11]
    assert real.decode.staging_slots.tolist() == [1, 2]
    assert real.plan.quantized_lens.tolist() == [64, 0]
    # attention reads the last complete tile (the only one) from staging, not its record
    assert real.decode.quantized_lens.tolist() == [0, 0]


def test_dummy_batch_stores_nothing(vllm_config_factory, monkeypatch):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    h = Harness(vllm_config_factory, monkeypatch)
    STEP.report_dummy(SimpleNamespace(num_reqs=1))
    qsl = torch.tensor([0, 8], dtype=torch.int32)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=torch.tensor([8], dtype=torch.int32),
        num_reqs=1,
        num_actual_tokens=8,
        max_query_len=8,
        max_seq_len=8,
        block_table_tensor=h.block_table[:1],
        slot_mapping=torch.zeros(8, dtype=torch.int64),
        seq_lens_cpu_upper_bound=torch.tensor([8], dtype=torch.int32),
    )
    meta = h.builder.build(0, cam)
    assert meta.plan is None and meta.fresh is not None
    q, k, v = h.rand(8, HQ, D), h.rand(8, HKV, D), h.rand(8, HKV, D)
    out = torch.empty(8, HQ, D, dtype=torch.float16)
    before = h.layer.impl.staging.clone()
    h.layer.impl.forward(h.layer, q, k, v, h.kv_cache, meta, output=out)
    assert not h.kv_cache.any() and torch.equal(before, h.layer.impl.staging)
    # A second build without a new runner report is also treated as a dummy batch.
    assert h.builder.build(0, cam).plan is None


def test_runner_hook_reports_request_rows(vllm_config_factory, monkeypatch):
    """The worker patch wraps vLLM's real V2 GPUModelRunner methods (installed by the builder)."""
    from kvarn_vllm import compat
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    Harness(vllm_config_factory, monkeypatch)  # builds a builder -> worker patches applied
    assert compat.is_wrapped(GPUModelRunner.prepare_attn)
    assert compat.is_wrapped(GPUModelRunner.prepare_dummy_attn)
    sentinel = object()
    # With a prefill-context-parallel manager, vLLM's method returns its answer at once,
    # which lets the real (wrapped) method run here without a GPU runner.
    fake_runner = SimpleNamespace(pcp_manager=SimpleNamespace(prepare_attn=lambda b: sentinel))
    batch = SimpleNamespace(num_reqs=2, idx_mapping_np=np.array([5, 1, 7], dtype=np.int32))
    before = STEP.record.serial
    assert GPUModelRunner.prepare_attn(fake_runner, batch) is sentinel
    record = STEP.record
    assert record.serial == before + 1
    assert record.num_reqs == 2 and record.slots.tolist() == [5, 1]


def test_replay_with_capture_metadata_equals_eager(vllm_config_factory, monkeypatch):
    """Emulates a full CUDA graph: kernels launched with the *capture-time* metadata objects
    must compute exactly what the real step's metadata computes, once build() has refreshed
    the persistent buffers (as vLLM does before each replay)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    h = Harness(vllm_config_factory, monkeypatch)
    persistent_bt = torch.zeros((2, MAX_BLOCKS), dtype=torch.int32)  # the runner's buffer

    def cam_for(qsl, seq):
        qsl = torch.tensor(qsl, dtype=torch.int32)
        seq = torch.tensor(seq, dtype=torch.int32)
        return CommonAttentionMetadata(
            query_start_loc=qsl,
            query_start_loc_cpu=qsl,
            seq_lens=seq,
            num_reqs=2,
            num_actual_tokens=int(qsl[-1]),
            max_query_len=int((qsl[1:] - qsl[:-1]).max()),
            max_seq_len=int(seq.max()),
            block_table_tensor=persistent_bt,
            slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
            seq_lens_cpu_upper_bound=seq,
        )

    captured = h.builder.build_for_cudagraph_capture(cam_for([0, 1, 2], [1, 1]))
    # Prefill two prompts (63 and 10 tokens): request 1's next decode completes its tile.
    h.step([(1, 0, 63, [3, 5]), (2, 0, 10, [4])])
    persistent_bt[0, :2] = torch.tensor([3, 5])
    persistent_bt[1, :1] = torch.tensor([4])
    STEP.report_real(SimpleNamespace(num_reqs=2, idx_mapping_np=np.array([1, 2])))
    real = h.builder.build(0, cam_for([0, 1, 2], [64, 11]))
    assert real.plan.tiles[0, 0].item() == 3  # the decode completes tile 0 of request 1
    q, k, v = h.rand(2, HQ, D), h.rand(2, HKV, D), h.rand(2, HKV, D)
    state = (h.kv_cache.clone(), h.layer.impl.staging.clone())

    def run(meta):
        h.kv_cache.copy_(state[0])
        h.layer.impl.staging.copy_(state[1])
        out = torch.full((2, HQ, D), float("nan"), dtype=torch.float16)
        h.layer.impl.forward(h.layer, q, k, v, h.kv_cache, meta, output=out)
        return out, h.kv_cache.clone(), h.layer.impl.staging.clone()

    eager = run(real)
    replay = run(captured)
    for a, b in zip(eager, replay):
        assert torch.equal(a, b)
    assert not torch.equal(eager[1], state[0])  # the tile really was quantized


def test_recent_tile_read_exact_except_after_a_prefix_hit(vllm_config_factory, monkeypatch):
    """With one recent tile, attention reads the tile before its first query's from staging; a
    request that hit the prefix cache has no exact copy of the tiles it shares, and reads their
    records (the builder tracks where each request's own tokens begin)."""
    monkeypatch.setenv("KVARN_VLLM_RECENT_TILES", "1")
    h = Harness(vllm_config_factory, monkeypatch)
    h.step([(1, 0, 200, [3, 5, 6, 8])])  # tiles 0-2 complete, 8 tokens open
    meta, q, out, _ = h.step([(1, 200, 1, [3, 5, 6, 8])])
    assert meta.plan.quantized_lens.tolist() == [192]
    assert meta.decode.quantized_lens.tolist() == [128]  # tile 2 read from staging
    _near_quantized(h, out, 1, q)  # records of tiles 0-1, tile 2 exact
    # The window counts from the step's token: the decode step completing tile 3 still
    # reads tile 2 exact (and its own tile 3), although tiles 0-3 are records after the step.
    h.step([(1, 201, 54, [3, 5, 6, 8])])
    meta, q, out, _ = h.step([(1, 255, 1, [3, 5, 6, 8])])
    assert meta.plan.quantized_lens.tolist() == [256]
    assert meta.decode.quantized_lens.tolist() == [128]
    _near_quantized(h, out, 1, q)

    # Slot 2: a new request whose first 128 tokens hit the prefix cache (slot 1's tiles 0-1).
    k1, v1 = h.kv[1]
    h.kv[2] = (k1[:128], v1[:128])
    STEP.report_added([2])
    meta, q, out, _ = h.step([(2, 128, 10, [3, 5, 10])])
    assert meta.context is not None
    # Tile 1 completed before this request began: no exact copy, its record is read.
    assert meta.context.quantized_lens.tolist() == [128]
    _near_quantized(h, out, 2, q, exact_start=128)
    # Its own tile 2 completes, then stays exact.
    meta, q, out, _ = h.step([(2, 138, 60, [3, 5, 10, 11])])
    assert meta.plan.quantized_lens.tolist() == [192]
    assert meta.context.quantized_lens.tolist() == [128]
    _near_quantized(h, out, 2, q, exact_start=128)
    assert not torch.isnan(out).any()


def test_row_expansion_once_per_forward():
    """A context group's tokens as decode rows: each token's sequence and length (its position
    + 1, or the whole sequence for a non-causal block), its sequence's table row and lengths;
    padding past the last query marked. Kept on the group for the other layers of the same
    forward only (a new forward context computes it again; outside one nothing is kept)."""
    from kvarn_vllm.groups import row_expansion
    from vllm.forward_context import override_forward_context

    g = md.RowGroup(
        rows=None,
        token_index=None,
        query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32),
        seq_lens=torch.tensor([10, 7], dtype=torch.int32),
        quantized_lens=torch.tensor([0, 64], dtype=torch.int32),
        staging_slots=torch.tensor([2, 1], dtype=torch.int32),
        block_table=torch.tensor([[5, 6], [7, 8]], dtype=torch.int32),
        max_query_len=3,
        max_seq_len=10,
        num_tokens=5,
        sink_lens=torch.tensor([64, 0], dtype=torch.int32),
        key_lens=torch.tensor([0, 0], dtype=torch.int32),
    )
    e = row_expansion(g, 6, True)  # one padding token
    assert e["rows"].tolist() == [0, 0, 0, 1, 1, 1]
    assert e["row_lens"].tolist() == [8, 9, 10, 6, 7, 7]
    assert e["block_table"].tolist() == [[5, 6]] * 3 + [[7, 8]] * 3
    assert e["staging_slots"].tolist() == [2, 2, 2, 1, 1, 1]
    assert e["sink_lens"].tolist() == [64, 64, 64, 0, 0, 0] and e["sink_slots"] is None
    assert e["valid"].view(-1).tolist() == [True] * 5 + [False]
    assert row_expansion(g, 5, False)["row_lens"].tolist() == [10, 10, 10, 7, 7]
    assert g.expansion is None  # outside a forward: nothing kept
    first, second = SimpleNamespace(), SimpleNamespace()
    with override_forward_context(first):
        e1 = row_expansion(g, 5, True)
        assert row_expansion(g, 5, True) is e1  # the other layers of the forward
        assert row_expansion(g, 5, False) is not e1  # another question
    with override_forward_context(second):
        e2 = row_expansion(g, 5, True)
    assert e2 is not row_expansion(g, 5, True)
    assert e2["row_lens"].tolist() == e1["row_lens"].tolist() == [8, 9, 10, 6, 7]
