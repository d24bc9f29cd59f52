"""The kvarn MLA impl's store, decode and context paths against kvarn-math's MLA reference.

Triton's interpreter on CPU (conftest sets ``TRITON_INTERPRET=1``), fp32 at a small real shape:
latent 256 + RoPE 64, 16 heads, ``kvarn_mla_l4_g64``. The cache starts filled with 0xFF bytes
(NaN scales), so a row read that was never written poisons the output.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from kvarn_math.mla import decode_latent_tiles, encode_latent_tiles, mla_reference_attention
from kvarn_vllm import releases

pytestmark = pytest.mark.skipif(
    releases.current() is None or releases.current().name != "vllm-0.26",
    reason="the MLA latent cache is served on vLLM 0.26.x only",
)

NAME = "kvarn_mla_l4_g64"
L, R, H, G = 256, 64, 16, 64
SEQ_LENS = [70, 129, 1, 64, 150]
SCALE = 0.125


@pytest.fixture(scope="module")
def impl(registered):
    from kvarn_vllm.mla_impl import KvarnMLAImpl
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig, set_current_vllm_config

    config = VllmConfig(
        cache_config=CacheConfig(cache_dtype=NAME), device_config=DeviceConfig(device="cpu")
    )
    with set_current_vllm_config(config):
        return KvarnMLAImpl(
            num_heads=H,
            head_size=L + R,
            scale=SCALE,
            num_kv_heads=1,
            alibi_slopes=None,
            sliding_window=None,
            kv_cache_dtype=NAME,
            logits_soft_cap=None,
            attn_type="decoder",
            kv_sharing_target_layer_name=None,
            q_lora_rank=None,
            kv_lora_rank=L,
            qk_nope_head_dim=64,
            qk_rope_head_dim=R,
            qk_head_dim=64 + R,
            v_head_dim=64,
            kv_b_proj=torch.nn.Linear(L, H * 128, bias=False),
        )


@pytest.fixture(scope="module")
def filled(impl):
    """Sequences' rows stored in one shuffled call with padding slots; returns the pieces."""
    gen = torch.Generator().manual_seed(0)
    max_blocks = -(-max(SEQ_LENS) // G)
    num_blocks = len(SEQ_LENS) * max_blocks + 3
    block_table = torch.randperm(num_blocks, generator=gen)[: len(SEQ_LENS) * max_blocks]
    block_table = block_table.view(len(SEQ_LENS), max_blocks).to(torch.int32)
    latents = [torch.randn(n, L, generator=gen) * 2 + 0.5 for n in SEQ_LENS]
    ropes = [torch.randn(n, R, generator=gen) for n in SEQ_LENS]
    slots = [
        block_table[b, torch.arange(n) // G].long() * G + torch.arange(n) % G
        for b, n in enumerate(SEQ_LENS)
    ]
    latent = torch.cat([*latents, torch.randn(5, L, generator=gen)])
    rope = torch.cat([*ropes, torch.randn(5, R, generator=gen)])
    slot = torch.cat([*slots, torch.full((5,), -1)])
    order = torch.randperm(latent.shape[0], generator=gen)
    cache = torch.full((num_blocks, impl.tile_bytes), 0xFF, dtype=torch.uint8)
    impl.do_kv_cache_update(
        latent[order], rope[order].unsqueeze(1), cache, slot[order], NAME, torch.ones(())
    )
    return cache, block_table, latents, ropes, slots


def _roundtrip(latent, rope):
    """kvarn-math's values of these rows (padded to whole tiles, then cut)."""
    n = latent.shape[0]
    pad = -n % G
    lat = np.concatenate([latent.numpy(), np.zeros((pad, L), np.float32)]).reshape(-1, G, L)
    pe = np.concatenate([rope.numpy(), np.zeros((pad, R), np.float32)]).reshape(-1, G, R)
    back_lat, back_pe = decode_latent_tiles(encode_latent_tiles(lat, pe, NAME), NAME, L, R)
    return back_lat.reshape(-1, L)[:n], back_pe.reshape(-1, R)[:n]


def test_store_and_decode_match_reference(impl, filled):
    """Records of the shuffled store equal kvarn-math's encoding; decode (complete tiles from
    records, the open tile's rows from its record) equals the reference attention."""
    cache, block_table, latents, ropes, _ = filled
    for b, n in enumerate(SEQ_LENS):
        full = n // G
        if full:
            lat = latents[b][: full * G].numpy().reshape(full, G, L)
            pe = ropes[b][: full * G].numpy().reshape(full, G, R)
            expected = encode_latent_tiles(lat, pe, NAME)
            np.testing.assert_array_equal(cache[block_table[b, :full].long()].numpy(), expected)
    gen = torch.Generator().manual_seed(1)
    q_latent = torch.randn(len(SEQ_LENS), H, L, generator=gen) * 0.1
    q_rope = torch.randn(len(SEQ_LENS), H, R, generator=gen) * 0.1
    metadata = SimpleNamespace(
        decode=SimpleNamespace(
            block_table=block_table, seq_lens=torch.tensor(SEQ_LENS, dtype=torch.int32)
        )
    )
    out, lse = impl.forward_mqa((q_latent, q_rope), cache, metadata, None)
    assert lse is None and out.shape == (len(SEQ_LENS), H, L)
    for b, n in enumerate(SEQ_LENS):
        full = n // G
        tail_lat, tail_pe = _roundtrip(latents[b][full * G :], ropes[b][full * G :])
        ref = mla_reference_attention(
            q_latent[b].numpy(),
            q_rope[b].numpy(),
            cache[block_table[b, :full].long()].numpy(),
            tail_lat,
            tail_pe,
            NAME,
            SCALE,
        )
        err = np.abs(out[b].numpy() - ref).max() / np.abs(ref).max()
        assert err < 1e-4, (b, n, err)


def test_prefill_tokens_read_the_bytes_stored(impl, filled):
    """forward_mha's tokens go through the values their records hold: exactly the rows the
    store wrote (so prefix caching on or off reads the same latents)."""
    from kvarn_kernels.mla import dequantize_latent

    cache, block_table, latents, ropes, _ = filled
    b = 4  # 150 tokens: 2 complete tiles and an open one
    latent, rope = impl._through_records(latents[b], ropes[b].unsqueeze(1))
    assert rope.shape == (SEQ_LENS[b], 1, R)
    rows = dequantize_latent(cache, block_table[b], NAME, L, R, dtype=torch.float32)
    torch.testing.assert_close(latent, rows[: SEQ_LENS[b], :L], rtol=0, atol=0)
    torch.testing.assert_close(rope[:, 0], rows[: SEQ_LENS[b], L:], rtol=0, atol=0)
    back_lat, back_pe = _roundtrip(latents[b], ropes[b])
    np.testing.assert_allclose(latent.numpy(), back_lat, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(rope[:, 0].numpy(), back_pe, rtol=1e-6, atol=1e-6)


def test_context_rows_fill_vllms_workspace(impl, filled):
    """A context chunk (block-aligned start, partial last tiles, an empty prefill) lands in the
    workspace in vLLM's order: each prefill's positions after the previous prefill's."""
    from kvarn_vllm.mla_impl import context_rows

    cache, block_table, latents, ropes, _ = filled
    prefills = [1, 2, 4]  # rows of the block table that prefill, with 129, 1, 150 tokens
    start, lens = G, [65, 0, 86]  # the chunk of positions [64, 64 + n) of each
    workspace = torch.full((400, L + R), float("nan"))
    rows = context_rows(cache, block_table[prefills], lens, start, impl.mla_preset, L, R, workspace)
    assert rows.shape == (sum(lens), L + R)
    offset = 0
    for b, n in zip(prefills, lens, strict=True):
        want_lat, want_pe = _roundtrip(latents[b], ropes[b])
        np.testing.assert_allclose(rows[offset : offset + n, :L], want_lat[start : start + n])
        np.testing.assert_allclose(rows[offset : offset + n, L:], want_pe[start : start + n])
        offset += n
    with pytest.raises(ValueError, match="multiple of G=64"):
        context_rows(cache, block_table, [3], 10, impl.mla_preset, L, R, workspace)
