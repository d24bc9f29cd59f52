"""Speculative decoding through kvarn's builder and a real vLLM Attention layer, on CPU.

Verify steps of ``1 + k`` tokens with random rejections (the host lengths an optimistic upper
bound, as under async scheduling; the plan comes from the device lengths), drafter decode
steps inside ``STEP.draft_steps()``, and a new request in a reused request-state row. Each
query's output is checked against kvarn-math's reference over the accepted tokens: tiles
``[0, quantized_len)`` as records, the rest exact.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import _releases
import numpy as np
import pytest
import torch
from _records import cached_records
from kvarn_math.attention import recent_window_start
from kvarn_vllm.builder import KvarnMetadataBuilder
from kvarn_vllm.step import STEP

PRESET, G, HQ, HKV, D, K = "kvarn_k4v4_g64", 64, 2, 1, 64, 4
MAX_BLOCKS = 4

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="runs the kvarn kernels on CPU tensors: needs TRITON_INTERPRET=1",
)


class SpecHarness:
    """One kvarn layer and its builder with speculative decoding configured (k = 4)."""

    def __init__(self, vllm_config_factory, monkeypatch, method="eagle", preset=PRESET):
        from kvarn_math import get_preset
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.attention.attention import Attention

        self.preset = preset
        self.g = get_preset(preset).group_size
        self.vc = vllm_config_factory(preset, max_num_seqs=4, max_num_batched_tokens=256)
        self.vc.cache_config.block_size = self.g
        # The builder and the layer read only these fields of the speculative config
        # (vLLM 0.33's backend selection also reads enable_adaptive_verification).
        object.__setattr__(
            self.vc,
            "speculative_config",
            SimpleNamespace(
                method=method, num_speculative_tokens=K, enable_adaptive_verification=False
            ),
        )
        # EAGLE runs on vLLM's V2 model runner, n-gram on V1 (kvarn_vllm.speculative.SPEC_METHODS);
        # set before the layer is built: the backend selection reads it on vLLM 0.29+.
        from kvarn_vllm.speculative import SPEC_METHODS

        v1 = method in SPEC_METHODS["v1"]
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0" if v1 else "1")
        torch.set_default_dtype(torch.float16)
        try:
            with set_current_vllm_config(self.vc):
                self.layer = Attention(
                    num_heads=HQ,
                    head_size=D,
                    scale=D**-0.5,
                    num_kv_heads=HKV,
                    cache_config=self.vc.cache_config,
                    prefix="model.layers.0.self_attn.attn",
                )
        finally:
            torch.set_default_dtype(torch.float32)
        spec = _releases.worker_spec(self.layer, self.vc)  # as the release's worker has it
        builder_cls = self.layer.attn_backend.get_builder_cls()
        self.builder = builder_cls(spec, [self.layer.layer_name], self.vc, torch.device("cpu"))
        cache = _releases.layer_cache(self.layer.attn_backend, spec, num_blocks=16)
        self.kv_cache = _releases.records(cache)  # [num_blocks, HKV, tile_bytes]
        self.block_table = torch.arange(16, dtype=torch.int32).reshape(4, MAX_BLOCKS).flip(1)
        gen = torch.Generator().manual_seed(0)
        self.rand = lambda *s: torch.randn(*s, generator=gen).to(torch.float16)
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # slot -> accepted K, V

    def cam(self, slots, cached, num_new, upper_bound, causal=True):
        from vllm.v1.attention.backend import CommonAttentionMetadata

        num_new = np.asarray(num_new, dtype=np.int32)
        seq = np.asarray(cached, dtype=np.int32) + num_new
        qsl = np.concatenate([[0], np.cumsum(num_new)]).astype(np.int32)
        return CommonAttentionMetadata(
            query_start_loc=torch.from_numpy(qsl),
            query_start_loc_cpu=torch.from_numpy(qsl),
            seq_lens=torch.from_numpy(seq),
            num_reqs=len(slots),
            num_actual_tokens=int(qsl[-1]),
            max_query_len=int(num_new.max()),
            max_seq_len=int(seq.max()),
            block_table_tensor=self.block_table[slots].contiguous(),
            slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
            seq_lens_cpu_upper_bound=None
            if upper_bound is None
            else torch.from_numpy(seq + np.asarray(upper_bound, dtype=np.int32)),
            causal=causal,
        )

    def run(self, meta, reqs):
        """reqs: (slot, num_cached, K/V rows of the step). Returns (q, out)."""
        k = torch.cat([kv[0] for _, _, kv in reqs])
        v = torch.cat([kv[1] for _, _, kv in reqs])
        q = self.rand(k.shape[0], HQ, D)
        out = torch.full((k.shape[0], HQ, D), float("nan"), dtype=torch.float16)
        self.layer.impl.forward(self.layer, q, k, v, self.kv_cache, meta, output=out)
        return q, out

    def reference(self, slot, k, v, quantized, q_rows, key_quantized=None):
        """kvarn-math over ``k``/``v``: tiles [0, quantized) as records, the rest exact; with
        values-only windows the keys of [quantized, key_quantized) from records too."""
        from kvarn_math import QuantizedSequence, quantize_sequence, reference_attention

        kf, vf = k.float().numpy(), v.float().numpy()
        g = self.g
        sink = self.builder.config.sink and quantized >= g  # tile 0 exact in staging
        # keys from records below max(quantized, key_quantized), and tile 0's exact while it
        # is the step's own tile (kvarn_math.step_sequence)
        kq = quantized if key_quantized is None else max(quantized, key_quantized)
        keys_exact = self.builder.config.window_keys or (sink and key_quantized < g)
        stored = quantize_sequence(
            kf[:kq],
            vf[:kq],
            self.preset,
            keep_first_tile=sink,
            recent_tiles=(kq - quantized) // g,
            window_keys=keys_exact,
        )
        if slot is not None:  # the cache's own records, checked to encode these tokens
            stored = cached_records(
                self.kv_cache, self.block_table[slot], kf, vf, stored, self.preset, D
            )
        seq = QuantizedSequence(
            records=stored.records,
            preset=records_preset(self.preset),
            head_dim=D,
            tail_k=kf[kq:],
            tail_v=vf[kq:],
            first_k=stored.first_k,
            first_v=stored.first_v,
            recent_v=stored.recent_v,
            window_keys=stored.window_keys,
        )
        return torch.from_numpy(reference_attention(q_rows.float().numpy(), seq, D**-0.5))


def records_preset(preset=PRESET):
    from kvarn_math import get_preset

    return get_preset(preset)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def assert_matches(h, got, k, v, quantized, q, where, slot=None, key_quantized=None):
    """Close to the reference with tiles [0, quantized) as records (``slot``'s records in the
    cache, checked to encode exactly ``k``/``v``, when given; values-only windows: keys up
    to ``key_quantized``); when there are records, much closer to it than to exact attention
    (so the records, not exact K/V, were read). The kernel reads the fp16-rounded rotated
    tokens, the reference the fp32 ones."""
    want = h.reference(slot, k, v, quantized, q, key_quantized)
    cfg = h.builder.config
    kq = quantized if key_quantized is None else key_quantized
    # nothing read from records (values-only windows read tile 0's keys from its record)
    if kq == 0 or (quantized <= cfg.sink_rows and cfg.window_keys):
        assert _rel(got, want) < 3e-3, where
        return
    exact = h.reference(None, k, v, 0, q)
    assert _rel(got, want) < 0.02, (where, _rel(got, want))
    assert _rel(got, want) < 0.5 * _rel(got, exact), where


@pytest.mark.parametrize(
    ("sink", "recent", "as_decode", "window_keys", "preset"),
    [
        ("0", "1", False, "0", PRESET),
        ("1", "1", False, "0", PRESET),
        ("1", "0", False, "0", PRESET),
        ("1", "1", True, "0", PRESET),
        ("0", "0", True, "0", PRESET),
        ("1", "1", False, "1", PRESET),
        ("1", "1", False, "1", "kvarn_k2v2_g128"),  # 2-bit keys, 128-token tiles
    ],
)
def test_verify_and_draft_steps_with_rejections(
    vllm_config_factory, monkeypatch, sink, recent, as_decode, window_keys, preset
):
    """Verify steps with random rejections and drafter steps against kvarn-math over the
    accepted tokens. ``as_decode``: ``KVARN_VLLM_VERIFY_AS_DECODE=1``: the verify blocks go
    to the kernels as decode rows, reading their own tokens from staging. ``window_keys``:
    ``KVARN_VLLM_WINDOW_KEYS=1``, exact windows with their keys (the default of the 2- and
    3-bit-key presets; values only otherwise). ``preset``: the walk's tiles are the preset's."""
    monkeypatch.setenv("KVARN_VLLM_EXACT_SINK", sink)
    monkeypatch.setenv("KVARN_VLLM_RECENT_TILES", recent)
    monkeypatch.setenv("KVARN_VLLM_WINDOW_KEYS", window_keys)
    monkeypatch.setenv("KVARN_VLLM_VERIFY_AS_DECODE", "1" if as_decode else "0")
    as_rows = []
    if as_decode:
        from kvarn_kernels.attention import launch

        decode_rows = launch.decode_rows
        monkeypatch.setattr(launch, "decode_rows", lambda *a: as_rows.append(1) or decode_rows(*a))
    h = SpecHarness(vllm_config_factory, monkeypatch, preset=preset)
    g = h.g
    assert h.builder.config.verify_as_decode is as_decode
    assert h.builder.config.window_keys == (window_keys == "1")
    assert h.builder.config.sink == (sink == "1")
    assert h.builder.config.staging_tiles == 2  # 1 + ceil(2k / G)
    assert h.builder.config.ring_tiles == 2 + int(recent)
    slot = 2
    # Accepted drafts per verify step (of K = 4), rejections mixed in. Verifies at g - 1 and
    # 2g - 1 commit a sampled token that completes a tile (tile 1's keeps tile 0 in its
    # window): at 63 and 127 for 64-token tiles, at 127 and 255 for 128.
    schedule = [1, 0, 4, 0, 2, 4, 4, 4, 1, 4, 4, 4, 4, 4, 4, 2, 1, 1, 0, 2]
    if g == 128:
        schedule = schedule + schedule
        schedule[34:36] = [3, 1]
    # Prompt: g - 3 tokens, committed (no drafts), a new request in its row.
    prompt = g - 3
    k0, v0 = h.rand(prompt, HKV, D), h.rand(prompt, HKV, D)
    STEP.report_added([slot])
    STEP.report_real(
        SimpleNamespace(num_reqs=1, idx_mapping_np=np.array([slot]), num_draft_tokens_per_req=None)
    )
    meta = h.builder.build(0, h.cam([slot], [0], [prompt], [0]))
    q0, _ = h.run(meta, [(slot, 0, (k0, v0))])
    h.kv[slot] = (k0, v0)
    accepted_q = [q0]  # the queries of the accepted tokens, which key frames are chosen from
    cached = prompt
    checked_quantized = set()
    completing = set()
    for step in range(len(schedule)):
        accepted = schedule[step]
        real_k, real_v = h.rand(1 + K, HKV, D), h.rand(1 + K, HKV, D)
        # The host only knows an upper bound (as if every earlier draft was accepted).
        STEP.report_real(
            SimpleNamespace(
                num_reqs=1,
                idx_mapping_np=np.array([slot]),
                num_draft_tokens_per_req=np.array([K], dtype=np.int32),
            )
        )
        meta = h.builder.build(0, h.cam([slot], [cached], [1 + K], [3 * step]))
        assert meta.context is not None and meta.decode is None  # verify -> multi-query
        q, out = h.run(meta, [(slot, cached, (real_k, real_v))])
        # Committed: everything before the step plus its first (sampled) token.
        assert int(meta.plan.quantized_lens[0]) == (cached + 1) // g * g
        # Attention reads records up to here, the recent window (from the step's first token)
        # and the rest from staging.
        quantized = int(meta.context.quantized_lens[0])
        q_after = int(meta.plan.quantized_lens[0])
        ring = h.builder.config.ring_tiles
        want = recent_window_start(cached, cached + 1 + K, q_after, g, int(recent), ring)
        assert quantized == want
        if recent == "1" and want < q_after - g:
            completing.add(step)  # the old rule (q_after - g) would have lost the window
        checked_quantized.add(int(meta.plan.quantized_lens[0]))
        ak, av = h.kv[slot]
        step_k, step_v = torch.cat([ak, real_k]), torch.cat([av, real_v])
        for j in range(1 + K):
            pos = cached + j
            assert_matches(
                h,
                out[j : j + 1],
                step_k[: pos + 1],
                step_v[: pos + 1],
                quantized,
                q[j : j + 1],
                (step, j),
                slot,
                None if meta.context.key_lens is None else int(meta.context.key_lens[0]),
            )
        h.kv[slot] = (step_k[: cached + 1 + accepted], step_v[: cached + 1 + accepted])
        accepted_q.append(q[: 1 + accepted])
        cached += 1 + accepted
        # A drafter decode step: one draft token per row at the next position.
        dk, dv = h.rand(1, HKV, D), h.rand(1, HKV, D)
        with STEP.draft_steps():
            dmeta = h.builder.build(0, h.cam([slot], [cached], [1], None))
        assert dmeta.plan is not None and (dmeta.plan.tiles == -1).all()
        base = h.builder.config.sink_rows
        row = cached if cached < base else base + (cached - base) % h.builder.config.ring_tokens
        key_tiles = h.builder.config.key_tiles
        key_row = row if key_tiles is None else cached % (key_tiles * g)
        assert dmeta.plan.writes[0].tolist() == [0, slot, row, key_row]
        # Drafts commit nothing; the window counts from the draft's position.
        read = recent_window_start(
            cached, cached + 1, min(q_after, cached // g * g), g, int(recent), ring
        )
        assert int(dmeta.decode.quantized_lens[0]) == read
        dq, dout = h.run(dmeta, [(slot, cached, (dk, dv))])
        ak, av = h.kv[slot]
        key_read = None if dmeta.decode.key_lens is None else int(dmeta.decode.key_lens[0])
        assert_matches(
            h, dout, torch.cat([ak, dk]), torch.cat([av, dv]), read, dq, step, slot, key_read
        )
        # The next verify step rewrites that position with the real token.
    assert {0, g, 2 * g} <= checked_quantized  # the walk crossed two tile boundaries
    assert completing or recent == "0"  # a verify completed a tile and kept its window
    assert len(as_rows) == (len(schedule) if as_decode else 0)  # every verify, as decode rows
    # Key frames as without speculation: every record equals the one-shot store of the
    # accepted tokens with their queries (each tile judged by its last position's query).
    assert_records_as_one_shot(h, slot, torch.cat(accepted_q), max(checked_quantized))


@pytest.mark.parametrize(("sink", "window_keys"), [("0", "1"), ("1", "0")])
def test_a_tile_completed_by_accepted_drafts_keeps_its_key_frame(
    vllm_config_factory, monkeypatch, sink, window_keys
):
    """Accepted drafts complete tile 0 (its last position is the second of three accepted
    drafts); the next verify step commits it with all its tokens staged. The store judges its
    key frame by the query staged with its last position (the layer's ``frame_queries``), so
    the records equal the one-shot store of the accepted tokens, as without speculation."""
    monkeypatch.setenv("KVARN_VLLM_EXACT_SINK", sink)
    monkeypatch.setenv("KVARN_VLLM_WINDOW_KEYS", window_keys)
    monkeypatch.setenv("KVARN_VLLM_KEY_FRAME", "auto")
    h = SpecHarness(vllm_config_factory, monkeypatch)
    g, slot = h.g, 1
    assert h.layer.impl.frame_queries is not None
    prompt = g - 3
    k0, v0 = h.rand(prompt, HKV, D), h.rand(prompt, HKV, D)
    STEP.report_added([slot])
    report = SimpleNamespace(num_reqs=1, idx_mapping_np=np.array([slot]))
    STEP.report_real(SimpleNamespace(**vars(report), num_draft_tokens_per_req=None))
    q, _ = h.run(h.builder.build(0, h.cam([slot], [0], [prompt], [0])), [(slot, 0, (k0, v0))])
    h.kv[slot], accepted_q, cached = (k0, v0), [q], prompt
    for accepted in (3, 0, 1):  # positions g-2, g-1, g accepted drafts; then g + 1 sampled
        real_k, real_v = h.rand(1 + K, HKV, D), h.rand(1 + K, HKV, D)
        drafts = np.array([K], dtype=np.int32)
        STEP.report_real(SimpleNamespace(**vars(report), num_draft_tokens_per_req=drafts))
        meta = h.builder.build(0, h.cam([slot], [cached], [1 + K], [0]))
        q, _ = h.run(meta, [(slot, cached, (real_k, real_v))])
        ak, av = h.kv[slot]
        h.kv[slot] = (
            torch.cat([ak, real_k[: 1 + accepted]]),
            torch.cat([av, real_v[: 1 + accepted]]),
        )
        accepted_q.append(q[: 1 + accepted])
        cached += 1 + accepted
    assert int(meta.plan.quantized_lens[0]) == g  # tile 0 committed from staging
    assert_records_as_one_shot(h, slot, torch.cat(accepted_q), g)


def assert_records_as_one_shot(h, slot, q, committed):
    """The cache's records of ``slot``'s tiles below ``committed`` are byte-identical to
    storing its accepted K/V (with queries ``q``) once, ``key_frame="auto"``."""
    import kvarn_kernels as kk

    k, v = h.kv[slot]
    n = q.shape[0]
    assert k.shape[0] == n
    once = torch.zeros_like(h.kv_cache)
    staging = kk.allocate_staging(1, HKV, D, h.preset, k.dtype, "cpu")
    table = h.block_table[slot : slot + 1].numpy()
    plan = kk.plan_store([0], [n], None, [0], table, h.preset)
    kk.store_kv(k, v, once, staging, plan, h.preset, key_frame="auto", query=q)
    for t in range(committed // h.g):
        blk = int(h.block_table[slot, t])
        assert torch.equal(h.kv_cache[blk], once[blk]), f"tile {t} differs"


@pytest.mark.parametrize(("sink", "invariant"), [("0", "0"), ("1", "0"), ("1", "1")])
def test_dflash_context_store_and_non_causal_block(
    vllm_config_factory, monkeypatch, sink, invariant
):
    """A DFlash drafter's layer over verify steps with rejections crossing tile boundaries:
    each target step's context K/V (every scheduled token, rejected drafts included) stored by
    ``do_kv_cache_update`` with the target step's plan, then the draft block of ``1 + K``
    tokens after the last accepted one, attending non-causally: every block token reads the
    accepted context (records below the quantized length) and the whole block."""
    monkeypatch.setenv("KVARN_VLLM_EXACT_SINK", sink)
    monkeypatch.setenv("KVARN_KERNELS_BATCH_INVARIANT", invariant)
    h = SpecHarness(vllm_config_factory, monkeypatch, method="dflash")
    assert h.layer.impl.config.batch_invariant == (invariant == "1")
    slot, n = 3, 1 + K
    name = h.layer.layer_name

    def target_step(cached, new, drafts, upper):
        STEP.report_real(
            SimpleNamespace(
                num_reqs=1,
                idx_mapping_np=np.array([slot]),
                num_draft_tokens_per_req=np.array([drafts], dtype=np.int32),
            )
        )
        return h.builder.build(0, h.cam([slot], [cached], [new], [upper]))

    def store_context(meta, k, v):
        with STEP.proposing({name: meta}):
            h.layer.impl.do_kv_cache_update(h.layer, k, v, h.kv_cache, None)

    STEP.report_added([slot])
    k0, v0 = h.rand(61, HKV, D), h.rand(61, HKV, D)
    with pytest.raises(RuntimeError, match="outside a DFlash proposal"):
        h.layer.impl.do_kv_cache_update(h.layer, k0, v0, h.kv_cache, None)
    meta = target_step(0, 61, 0, 0)
    store_context(meta, k0, v0)
    accepted_k, accepted_v = k0, v0
    schedule = [0, 4, 1, 4, 4, 2, 4, 4, 0, 3, 4, 4, 4]
    cached = 61
    crossed = set()
    for step, accepted in enumerate([None, *schedule]):
        if accepted is not None:
            # A verify step of the target: the sampled token and K drafts; `accepted` of
            # them survive. The drafter's context store writes all 1 + K of them.
            ck, cv = h.rand(n, HKV, D), h.rand(n, HKV, D)
            meta = target_step(cached, n, K, 3 * step)
            store_context(meta, ck, cv)
            accepted_k = torch.cat([accepted_k, ck[: 1 + accepted]])
            accepted_v = torch.cat([accepted_v, cv[: 1 + accepted]])
            cached += 1 + accepted
        # The draft block: positions cached .. cached + K (the bonus token and K masks),
        # over the rejected context positions, non-causal.
        bk, bv = h.rand(n, HKV, D), h.rand(n, HKV, D)
        with STEP.draft_steps():
            dmeta = h.builder.build(0, h.cam([slot], [cached], [n], None, causal=False))
        assert dmeta.decode is None and dmeta.context is not None and not dmeta.causal
        assert (dmeta.plan.tiles == -1).all()  # drafts commit nothing
        assert dmeta.plan.writes[:, 0].tolist() == list(range(n))
        quantized = int(dmeta.context.quantized_lens[0])
        crossed.add(int(dmeta.plan.quantized_lens[0]))
        q, out = h.run(dmeta, [(slot, cached, (bk, bv))])
        all_k, all_v = torch.cat([accepted_k, bk]), torch.cat([accepted_v, bv])
        key_read = None if dmeta.context.key_lens is None else int(dmeta.context.key_lens[0])
        for j in range(n):  # every block token attends the whole sequence
            assert_matches(h, out[j : j + 1], all_k, all_v, quantized, q[j : j + 1],
                           (step, j), slot, key_read)  # fmt: skip
    assert {0, 64} <= crossed  # the context crossed a tile boundary


def test_dflash_propose_exposes_the_target_metadata(vllm_config_factory, monkeypatch):
    """The worker patch wraps vLLM's DFlashSpeculator.propose: while vLLM's own propose runs,
    the target step's metadata (its second argument) is what do_kv_cache_update stores with,
    and afterwards (an exception included) it is gone."""
    from kvarn_vllm import compat
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    SpecHarness(vllm_config_factory, monkeypatch, method="dflash")  # applies worker patches
    assert compat.is_wrapped(DFlashSpeculator.propose)
    seen = []

    class Stop(Exception):
        pass

    class Batch:  # vLLM's propose reads num_reqs first: look at the scope then, and stop
        @property
        def num_reqs(self):
            seen.append(STEP.target_metadata)
            raise Stop

    by_layer = {"model.layers.0.self_attn.attn": object()}
    assert STEP.target_metadata is None
    with pytest.raises(Stop):
        DFlashSpeculator.propose(
            object.__new__(DFlashSpeculator), Batch(), by_layer, {}, *[None] * 8
        )
    assert seen == [by_layer]
    assert STEP.target_metadata is None


def test_draft_steps_refuse_uneven_blocks(vllm_config_factory, monkeypatch):
    h = SpecHarness(vllm_config_factory, monkeypatch)
    STEP.report_real(
        SimpleNamespace(num_reqs=2, idx_mapping_np=np.array([0, 1]), num_draft_tokens_per_req=None)
    )
    with STEP.draft_steps(), pytest.raises(ValueError, match=r"different numbers.*\[2, 3\]"):
        h.builder.build(0, h.cam([0, 1], [10, 20], [2, 3], None, causal=False))


def test_new_request_in_a_reused_row_starts_from_its_prefix(vllm_config_factory, monkeypatch):
    h = SpecHarness(vllm_config_factory, monkeypatch)
    slot = 1

    def build(cached, new, drafts, added):
        if added:
            STEP.report_added([slot])
        STEP.report_real(
            SimpleNamespace(
                num_reqs=1,
                idx_mapping_np=np.array([slot]),
                num_draft_tokens_per_req=np.array([drafts], dtype=np.int32),
            )
        )
        return h.builder.build(0, h.cam([slot], [cached], [new], [0]))

    assert int(build(0, 130, 0, True).plan.quantized_lens[0]) == 128
    # A new request takes the row with a 64-token prefix-cache hit: its quantized tiles are
    # the hit, not the previous owner's 128 (nothing is re-quantized from staging).
    meta = build(64, 5, 4, True)
    assert int(meta.plan.quantized_lens[0]) == 64
    assert (meta.plan.tiles == -1).all()
    # The same request continues: state carried on the device.
    meta = build(66, 5, 4, False)
    assert int(meta.plan.quantized_lens[0]) == 64


@pytest.mark.parametrize(
    ("method", "v2", "match"),
    [
        (
            "ngram",
            "1",
            "serves 'ngram' on vLLM's V1 model runner, and this configuration runs the V2",
        ),
        (
            "eagle",
            "0",
            "serves 'eagle' on vLLM's V2 model runner, and this configuration runs the V1",
        ),
        (
            "ngram_gpu",
            "1",
            "serves 'ngram_gpu' on vLLM's V1 model runner, and this configuration runs the V2",
        ),
        (
            "dflash",
            "0",
            "serves 'dflash' on vLLM's V2 model runner, and this configuration runs the V1",
        ),
        ("dspark", "1", "got method 'dspark'"),
        ("suffix", "0", "got method 'suffix'"),
    ],
)
def test_spec_methods_follow_the_model_runner(vllm_config_factory, monkeypatch, method, v2, match):
    vc = vllm_config_factory(PRESET, max_num_seqs=4, max_num_batched_tokens=256)
    object.__setattr__(
        vc, "speculative_config", SimpleNamespace(method=method, num_speculative_tokens=4)
    )
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", v2)
    from kvarn_vllm.config import parse_kv_cache_dtype
    from kvarn_vllm.spec import make_layer_spec

    spec = make_layer_spec(
        parse_kv_cache_dtype(PRESET),
        block_size=G,
        num_kv_heads=HKV,
        head_size=D,
        head_size_v=D,
        sliding_window=None,
    )
    with pytest.raises(ValueError, match=match):
        KvarnMetadataBuilder(spec, ["l0"], vc, torch.device("cpu"))


# --- full CUDA graphs for uniform speculative batches (KVARN_VLLM_SPEC_FULL_GRAPHS, default 1) ---

# What a captured graph fixes of a step's metadata: every tensor the forward reads (its
# storage and shape) and the host values that shape its launches. Host copies and upper
# bounds that only build() reads (max_seq_len, query_start_loc_host, host) may differ.
_HOST_ONLY = {"max_seq_len", "query_start_loc_host", "host", "num_tokens"}


def graph_signature(obj, name="md"):
    import dataclasses

    if isinstance(obj, torch.Tensor):
        return (name, obj.data_ptr(), tuple(obj.shape), tuple(obj.stride()), obj.dtype)
    if dataclasses.is_dataclass(obj):
        return tuple(
            graph_signature(getattr(obj, f.name), f"{name}.{f.name}")
            for f in dataclasses.fields(obj)
            if f.name not in _HOST_ONLY
        )
    return (name, obj)


def _graph_cam(block_table, num_new, seq, padded_reqs, padded_tokens, causal=True):
    """vLLM's metadata for a uniform step padded to a captured size: padding rows bring no
    token and have seq_len 0; ``num_actual_tokens`` is the padded count."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    num_new = list(num_new) + [0] * (padded_reqs - len(num_new))
    seq = np.asarray(list(seq) + [0] * (padded_reqs - len(seq)), dtype=np.int32)
    qsl = torch.from_numpy(np.concatenate([[0], np.cumsum(num_new)]).astype(np.int32))
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=torch.from_numpy(seq),
        num_reqs=padded_reqs,
        num_actual_tokens=padded_tokens,
        max_query_len=max(num_new),
        max_seq_len=int(seq.max()),
        block_table_tensor=block_table,
        slot_mapping=torch.full((padded_tokens,), -1, dtype=torch.int64),
        seq_lens_cpu_upper_bound=torch.from_numpy(seq),
        causal=causal,
    )


def replay_on_capture(h, real, captured, q, k, v, n):
    """The forward on ``real`` and, from the same cache and staging, on ``captured`` (what a
    replayed graph does once build() has refreshed the buffers): outputs of the first ``n``
    tokens, the cache and staging must be equal. Returns the output and staging after."""
    state = (h.kv_cache.clone(), h.layer.impl.staging.clone())
    results = []
    for meta in (real, captured):
        h.kv_cache.copy_(state[0])
        h.layer.impl.staging.copy_(state[1])
        out = torch.full((q.shape[0], HQ, D), float("nan"), dtype=torch.float16)
        h.layer.impl.forward(h.layer, q, k, v, h.kv_cache, meta, output=out)
        results.append((out[:n].clone(), h.kv_cache.clone(), h.layer.impl.staging.clone()))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    return results[0][0], results[0][2]


@pytest.mark.parametrize(("spec", "flag", "want"), [(True, "1", "UNIFORM_BATCH"),
                         (True, None, "UNIFORM_BATCH"),
                         (True, "0", "UNIFORM_SINGLE_TOKEN_DECODE"),
                         (False, "1", "UNIFORM_SINGLE_TOKEN_DECODE"),
                         (False, None, "UNIFORM_SINGLE_TOKEN_DECODE")])  # fmt: skip
def test_full_graph_support_under_speculation(vllm_config_factory, monkeypatch, spec, flag, want):
    """Full graphs for uniform speculative batches by default; ``0`` turns them off."""
    if flag is None:
        monkeypatch.delenv("KVARN_VLLM_SPEC_FULL_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("KVARN_VLLM_SPEC_FULL_GRAPHS", flag)
    vc = vllm_config_factory(PRESET)
    if spec:
        object.__setattr__(
            vc, "speculative_config", SimpleNamespace(method="eagle", num_speculative_tokens=K)
        )
    assert KvarnMetadataBuilder.get_cudagraph_support(vc, None).name == want


@pytest.mark.parametrize("sink", ["0", "1"])
def test_verify_step_graph_replays_capture_buffers(vllm_config_factory, monkeypatch, sink):
    """With full graphs for speculative batches, the capture of a uniform verify batch (2 rows
    of 1 + K tokens) lays out the buffers a real verify step of that size uses: a real step of
    one request plus a padding row (no tokens, seq_len 0, as vLLM pads a graph's batch) has
    the same tensors and launch shapes, and the forward run on the *capture's* metadata after
    build() (a replay) stores and attends exactly as the real metadata does, correctly."""
    monkeypatch.setenv("KVARN_VLLM_SPEC_FULL_GRAPHS", "1")
    monkeypatch.setenv("KVARN_VLLM_EXACT_SINK", sink)
    h = SpecHarness(vllm_config_factory, monkeypatch)
    n, slot = 1 + K, 2
    bt = torch.zeros((2, MAX_BLOCKS), dtype=torch.int32)  # the runner's persistent table
    captured = h.builder.build_for_cudagraph_capture(_graph_cam(bt, [n, n], [n, n], 2, 2 * n))
    assert captured.decode is None and captured.fresh is None
    assert captured.context is not None and captured.context.rows is None
    assert (captured.plan.tiles == -1).all() and (captured.plan.writes == -1).all()
    # A prompt of 61 tokens (a mixed step, piecewise), then verify steps crossing tile 0's end.
    k0, v0 = h.rand(61, HKV, D), h.rand(61, HKV, D)
    STEP.report_added([slot])
    STEP.report_real(
        SimpleNamespace(num_reqs=1, idx_mapping_np=np.array([slot]), num_draft_tokens_per_req=None)
    )
    h.run(h.builder.build(0, h.cam([slot], [0], [61], [0])), [(slot, 0, (k0, v0))])
    acc_k, acc_v, cached = k0, v0, 61
    bt[0] = h.block_table[slot]
    for step, accepted in enumerate([1, 4, 0, 2]):
        STEP.report_real(
            SimpleNamespace(
                num_reqs=1,
                idx_mapping_np=np.array([slot]),
                num_draft_tokens_per_req=np.array([K], dtype=np.int32),
            )
        )
        real = h.builder.build(0, _graph_cam(bt, [n], [cached + n], 2, 2 * n))
        assert graph_signature(real) == graph_signature(captured)
        sk, sv = h.rand(2 * n, HKV, D), h.rand(2 * n, HKV, D)  # rows n.. are padding
        q = h.rand(2 * n, HQ, D)
        out, _ = replay_on_capture(h, real, captured, q, sk, sv, n)
        quantized = int(real.context.quantized_lens[0])
        key_read = None if real.context.key_lens is None else int(real.context.key_lens[0])
        step_k, step_v = torch.cat([acc_k, sk[:n]]), torch.cat([acc_v, sv[:n]])
        for j in range(n):
            pos = cached + j
            assert_matches(h, out[j : j + 1], step_k[: pos + 1], step_v[: pos + 1], quantized,
                           q[j : j + 1], (step, j), slot, key_read)  # fmt: skip
        acc_k, acc_v = step_k[: cached + 1 + accepted], step_v[: cached + 1 + accepted]
        cached += 1 + accepted


@pytest.mark.parametrize("method", ["eagle", "dflash"])
def test_draft_step_graph_replays_capture_buffers(vllm_config_factory, monkeypatch, method):
    """A drafter's step captured (EAGLE: one token per request; DFlash: a non-causal block of
    1 + K) keeps its store plan (empty), so the graph holds the store, and a real draft step
    of one request plus a padding row uses the same tensors and shapes; replayed on the
    capture's metadata it writes the same staging and attends the same."""
    monkeypatch.setenv("KVARN_VLLM_SPEC_FULL_GRAPHS", "1")
    h = SpecHarness(vllm_config_factory, monkeypatch, method=method)
    n, slot = (1 + K, 1) if method == "dflash" else (1, 1)
    causal = method != "dflash"
    bt = torch.zeros((2, MAX_BLOCKS), dtype=torch.int32)
    captured = h.builder.build_for_cudagraph_capture(
        _graph_cam(bt, [n, n], [n, n], 2, 2 * n, causal=causal)
    )
    assert captured.plan is not None and (captured.plan.writes == -1).all()
    assert captured.causal == causal
    k0, v0 = h.rand(70, HKV, D), h.rand(70, HKV, D)
    STEP.report_added([slot])
    STEP.report_real(
        SimpleNamespace(num_reqs=1, idx_mapping_np=np.array([slot]), num_draft_tokens_per_req=None)
    )
    h.run(h.builder.build(0, h.cam([slot], [0], [70], [0])), [(slot, 0, (k0, v0))])
    bt[0] = h.block_table[slot]
    with STEP.draft_steps():
        real = h.builder.build(0, _graph_cam(bt, [n], [70 + n], 2, 2 * n, causal=causal))
    assert graph_signature(real) == graph_signature(captured)
    assert real.plan.writes[:n, 0].tolist() == list(range(n))
    assert (real.plan.writes[n:] == -1).all()  # the padding row's tokens write nothing
    dk, dv, q = h.rand(2 * n, HKV, D), h.rand(2 * n, HKV, D), h.rand(2 * n, HQ, D)
    before = h.layer.impl.staging.clone()
    out, staging = replay_on_capture(h, real, captured, q, dk, dv, n)
    assert torch.isfinite(out.float()).all()
    assert not torch.equal(staging, before)  # the drafts reached staging


def test_uniform_verify_batch_with_a_new_prompt_of_the_same_length(
    vllm_config_factory, monkeypatch
):
    """With full graphs for speculative batches, a step whose rows all bring 1 + K tokens runs
    as one context group even where a row is a new prompt of exactly 1 + K tokens (nothing
    cached): that row attends its own tokens, stored this step, exactly; the verify row beside
    it reads its records."""
    monkeypatch.setenv("KVARN_VLLM_SPEC_FULL_GRAPHS", "1")
    h = SpecHarness(vllm_config_factory, monkeypatch)
    n, old, new = 1 + K, 2, 3
    k0, v0 = h.rand(200, HKV, D), h.rand(200, HKV, D)
    STEP.report_added([old])
    STEP.report_real(
        SimpleNamespace(num_reqs=1, idx_mapping_np=np.array([old]), num_draft_tokens_per_req=None)
    )
    h.run(h.builder.build(0, h.cam([old], [0], [200], [0])), [(old, 0, (k0, v0))])
    STEP.report_added([new])
    STEP.report_real(
        SimpleNamespace(
            num_reqs=2,
            idx_mapping_np=np.array([old, new]),
            num_draft_tokens_per_req=np.array([K, 0], dtype=np.int32),
        )
    )
    meta = h.builder.build(0, h.cam([old, new], [200, 0], [n, n], [0, 0]))
    assert meta.context is not None and meta.context.rows is None and meta.fresh is None
    ka, va = h.rand(n, HKV, D), h.rand(n, HKV, D)
    kb, vb = h.rand(n, HKV, D), h.rand(n, HKV, D)
    q, out = h.run(meta, [(old, 200, (ka, va)), (new, 0, (kb, vb))])
    quantized = int(meta.context.quantized_lens[0])
    assert quantized >= G  # the verify row reads records (tile 1 at least)
    key_read = None if meta.context.key_lens is None else int(meta.context.key_lens[0])
    all_k, all_v = torch.cat([k0, ka]), torch.cat([v0, va])
    for j in range(n):
        assert_matches(h, out[j : j + 1], all_k[: 201 + j], all_v[: 201 + j], quantized,
                       q[j : j + 1], ("verify", j), old, key_read)  # fmt: skip
        assert_matches(h, out[n + j : n + j + 1], kb[: j + 1], vb[: j + 1], 0,
                       q[n + j : n + j + 1], ("prompt", j))  # fmt: skip


@pytest.mark.parametrize("capturing", [False, True])
def test_verify_rows_are_expanded_once_per_forward(vllm_config_factory, monkeypatch, capturing):
    """A uniform verify step run as decode rows (the default under speculative decoding): in
    one forward the first layer expands the block into decode rows and the next reuses it,
    with the same output bits as a layer that expands them itself; a new forward expands
    again. ``capturing``: as inside a CUDA graph capture, where the output is masked (a
    replay may bring padding rows) instead of written in place: the same bits."""
    from kvarn_kernels.attention import launch
    from kvarn_vllm import groups
    from vllm.forward_context import override_forward_context

    monkeypatch.setattr(groups, "capturing", lambda: capturing)

    calls = []
    decode_rows = launch.decode_rows
    monkeypatch.setattr(launch, "decode_rows", lambda *a: calls.append(1) or decode_rows(*a))
    h = SpecHarness(vllm_config_factory, monkeypatch)
    assert h.builder.config.verify_as_decode
    slot, prompt = 1, h.g + 5
    STEP.report_added([slot])
    STEP.report_real(
        SimpleNamespace(num_reqs=1, idx_mapping_np=np.array([slot]), num_draft_tokens_per_req=None)
    )
    h.run(h.builder.build(0, h.cam([slot], [0], [prompt], [0])), [(slot, 0, (h.rand(prompt, HKV, D), h.rand(prompt, HKV, D)))])  # fmt: skip
    STEP.report_real(
        SimpleNamespace(
            num_reqs=1,
            idx_mapping_np=np.array([slot]),
            num_draft_tokens_per_req=np.array([K], dtype=np.int32),
        )
    )
    meta = h.builder.build(0, h.cam([slot], [prompt], [1 + K], [0]))
    assert meta.context is not None and meta.context.token_index is None  # uniform
    k, v = h.rand(1 + K, HKV, D), h.rand(1 + K, HKV, D)
    q = h.rand(1 + K, HQ, D)

    def layer():
        out = torch.full((1 + K, HQ, D), float("nan"), dtype=torch.float16)
        h.layer.impl.forward(h.layer, q, k, v, h.kv_cache, meta, output=out)
        return out

    calls.clear()
    alone = layer()  # no forward context: expanded by this call
    with override_forward_context(SimpleNamespace()):
        first, second = layer(), layer()
    assert len(calls) == 2  # one of its own, one for the forward's two layers
    with override_forward_context(SimpleNamespace()):
        layer()
    assert len(calls) == 3
    assert not torch.isnan(alone).any()
    assert torch.equal(first, alone) and torch.equal(second, alone)


# speculative decoding, served on vLLM 0.26: where the 'draft-steps' ledger entry applies
pytestmark = [pytestmark, _releases.needs("draft-steps")]
