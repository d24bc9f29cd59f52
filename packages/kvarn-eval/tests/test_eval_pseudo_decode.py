"""The pseudo-decode attention hook against plain attention and an explicit block loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from eval_helpers import HEAD_DIM, tiny_llama
from kvarn_eval.accuracy import (
    PseudoDecodeConfig,
    Unquantized,
    install,
    pseudo_decode,
    pseudo_decode_mask,
    quantize_kv,
)
from kvarn_eval.accuracy.pseudo_decode import pseudo_decode_attention
from kvarn_math.baselines import KIVI, Exact, KVarN, PerTokenRTN

BLOCK = 64


def _logits(model: torch.nn.Module, ids: torch.Tensor, config: PseudoDecodeConfig) -> torch.Tensor:
    with torch.inference_mode(), pseudo_decode(config):
        return model(input_ids=ids, use_cache=False).logits[0]


@pytest.fixture(scope="module")
def model_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    plain = tiny_llama(seed=1)
    hooked = install(tiny_llama(seed=1))
    return plain, hooked


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(4, 94, (1, 4 * BLOCK + 17), generator=gen)


@pytest.mark.parametrize("exact_first", [True, False])
@pytest.mark.parametrize("seq_len", [1, 63, 64, 65, 200, 257])
def test_mask_sees_each_past_key_exactly_once(seq_len: int, exact_first: bool) -> None:
    mask = pseudo_decode_mask(seq_len, BLOCK, exact_first)
    quantized, exact = mask[:, :seq_len], mask[:, seq_len:]
    assert not (quantized & exact).any()
    causal = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool))
    assert torch.equal(quantized | exact, causal)
    t = torch.arange(seq_len)
    block_start = (t // BLOCK) * BLOCK
    # a query's own block is exact; everything quantized is strictly before its block
    for q in range(seq_len):
        assert exact[q, block_start[q] : q + 1].all()
        assert not quantized[q, block_start[q] :].any()
        if exact_first:
            assert not quantized[q, :BLOCK].any()


@pytest.mark.parametrize("sink", [0, 1, 16, BLOCK])
def test_mask_with_sink_tokens(sink: int) -> None:
    seq_len = 3 * BLOCK + 5
    mask = pseudo_decode_mask(seq_len, BLOCK, True, sink_tokens=sink)
    quantized, exact = mask[:, :seq_len], mask[:, seq_len:]
    causal = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool))
    assert not (quantized & exact).any() and torch.equal(quantized | exact, causal)
    # keys before S are never read quantized; the rest of block 0 is, from block 1 on
    assert not quantized[:, :sink].any()
    assert quantized[BLOCK:, sink:BLOCK].all()
    assert not quantized[:BLOCK].any()
    if sink in (0, BLOCK):
        assert torch.equal(mask, pseudo_decode_mask(seq_len, BLOCK, sink == BLOCK))


@pytest.mark.parametrize("recent", [1, 2])
def test_mask_with_recent_exact_blocks(recent: int) -> None:
    seq_len = 5 * BLOCK + 9
    mask = pseudo_decode_mask(seq_len, BLOCK, True, recent_blocks=recent)
    quantized, exact = mask[:, :seq_len], mask[:, seq_len:]
    causal = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool))
    assert not (quantized & exact).any() and torch.equal(quantized | exact, causal)
    for q in range(seq_len):
        b = q // BLOCK
        first_exact = max(0, b - recent) * BLOCK  # blocks b - R .. b, and block 0 (the sink)
        assert exact[q, first_exact : q + 1].all() and exact[q, : min(BLOCK, q + 1)].all()
        assert quantized[q, BLOCK:first_exact].all()
    assert torch.equal(
        pseudo_decode_mask(seq_len, BLOCK, True, recent_blocks=0),
        pseudo_decode_mask(seq_len, BLOCK, True),
    )
    with pytest.raises(ValueError, match="recent_blocks must be >= 0"):
        PseudoDecodeConfig(Unquantized(), BLOCK, recent_blocks=-1)


def test_mask_sliding_window() -> None:
    mask = pseudo_decode_mask(300, BLOCK, True, sliding_window=100)
    visible = mask[:, :300] | mask[:, 300:]
    q, k = torch.meshgrid(torch.arange(300), torch.arange(300), indexing="ij")
    assert torch.equal(visible, (k <= q) & (q - k < 100))


def test_exact_method_matches_plain_forward(model_pair, ids) -> None:  # type: ignore[no-untyped-def]
    plain, hooked = model_pair
    with torch.inference_mode():
        want = plain(input_ids=ids, use_cache=False).logits[0]
    got = _logits(hooked, ids, PseudoDecodeConfig(Unquantized(), BLOCK))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got_none = _logits(hooked, ids, PseudoDecodeConfig(None, BLOCK))
    torch.testing.assert_close(got_none, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("exact_first", [True, False])
def test_quantization_changes_logits_only_after_the_exact_blocks(
    model_pair, ids, exact_first: bool
) -> None:  # type: ignore[no-untyped-def]
    _, hooked = model_pair
    exact = _logits(hooked, ids, PseudoDecodeConfig(Unquantized(), BLOCK, exact_first))
    method = KIVI(name="kivi_k2v2", group_size=BLOCK, key_bits=2, value_bits=2)
    quant = _logits(hooked, ids, PseudoDecodeConfig(method, BLOCK, exact_first))
    first_affected = 2 * BLOCK if exact_first else BLOCK
    torch.testing.assert_close(quant[:first_affected], exact[:first_affected], rtol=0, atol=1e-5)
    per_position = (quant - exact).abs().amax(-1)
    assert (per_position[first_affected:] > 1e-4).all()


@pytest.mark.parametrize(
    "method",
    [
        KVarN.of("kvarn_k4v2_g64"),
        PerTokenRTN(),
        Exact(),
        KIVI(name="kivi_k4v2", group_size=BLOCK, key_bits=4, value_bits=2),
    ],
    ids=lambda m: m.name,
)
def test_one_pass_equals_growing_prefixes(model_pair, ids, method) -> None:  # type: ignore[no-untyped-def]
    """Logits of block b from the whole sequence equal those from the prefix ending at b.

    A quantized tile that leaked information from later tokens would break this.
    """
    _, hooked = model_pair
    config = PseudoDecodeConfig(method, BLOCK)
    full = _logits(hooked, ids, config)
    for end in (2 * BLOCK + 5, 3 * BLOCK, 4 * BLOCK + 1):
        prefix = _logits(hooked, ids[:, :end], config)
        torch.testing.assert_close(prefix, full[:end], rtol=1e-5, atol=1e-5)


def _explicit_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    method: KIVI,
    sink: int,
    requantize: bool = False,
) -> torch.Tensor:
    """Decode-style reference: each block's queries read a cache of quantized earlier tiles.

    Tokens ``[0, sink)`` are cached exact; with ``requantize`` block 0 is quantized with them
    replaced by token ``sink``.
    """
    _, hq, t, d = q.shape
    hkv = k.shape[1]
    out = torch.zeros(1, t, hq, d, dtype=torch.float64)
    cache_k: list[np.ndarray] = []
    cache_v: list[np.ndarray] = []
    for start in range(0, t, BLOCK):
        stop = min(start + BLOCK, t)
        past_k = np.concatenate(cache_k, axis=0) if cache_k else np.zeros((0, hkv, d), np.float32)
        past_v = np.concatenate(cache_v, axis=0) if cache_v else np.zeros((0, hkv, d), np.float32)
        for pos in range(start, stop):
            keys = np.concatenate([past_k, k[0, :, start : pos + 1].permute(1, 0, 2).numpy()])
            vals = np.concatenate([past_v, v[0, :, start : pos + 1].permute(1, 0, 2).numpy()])
            for h in range(hq):
                g = h // (hq // hkv)
                logits = keys[:, g].astype(np.float64) @ q[0, h, pos].double().numpy() / d**0.5
                p = np.exp(logits - logits.max())
                out[0, pos, h] = torch.from_numpy((p / p.sum()) @ vals[:, g].astype(np.float64))
        # the block is full (or the sequence ends): flush it into the cache
        tile_k = k[0, :, start:stop].permute(1, 0, 2).numpy()
        tile_v = v[0, :, start:stop].permute(1, 0, 2).numpy()
        if stop - start == BLOCK and not (start == 0 and sink == BLOCK):
            in_k, in_v = tile_k.copy(), tile_v.copy()
            if start == 0 and requantize and sink:
                in_k[:sink], in_v[:sink] = tile_k[sink], tile_v[sink]
            rt_k, rt_v = method.roundtrip(in_k, in_v)
            if start == 0:
                rt_k[:sink], rt_v[:sink] = tile_k[:sink], tile_v[:sink]
            tile_k, tile_v = rt_k, rt_v
        cache_k.append(tile_k)
        cache_v.append(tile_v)
    return out


@pytest.mark.parametrize(
    "exact_first,sink_tokens,requantize",
    [
        (True, None, False),
        (False, None, False),
        (True, 0, False),
        (False, BLOCK, True),
        (True, 1, False),
        (True, 16, False),
        (True, 1, True),
        (True, 16, True),
    ],
)
def test_attention_equals_explicit_block_loop(
    exact_first: bool, sink_tokens: int | None, requantize: bool
) -> None:
    gen = torch.Generator().manual_seed(3)
    t = 3 * BLOCK + 9
    q = torch.randn(1, 4, t, HEAD_DIM, generator=gen)
    k = torch.randn(1, 2, t, HEAD_DIM, generator=gen) * 2
    v = torch.randn(1, 2, t, HEAD_DIM, generator=gen)
    k[:, :, :4] *= 20  # an outlier sink
    method = KIVI(name="kivi_k2v2", group_size=BLOCK, key_bits=2, value_bits=2)
    config = PseudoDecodeConfig(method, BLOCK, exact_first, sink_tokens, requantize)
    with pseudo_decode(config):
        got, _ = pseudo_decode_attention(torch.nn.Module(), q, k, v, None, scaling=HEAD_DIM**-0.5)
    want = _explicit_block_attention(q, k, v, method, config.sink, requantize)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("recent", [0, 1, 2])
@pytest.mark.parametrize("window", [None, 40, 150])
@pytest.mark.parametrize("sink", [0, 7, BLOCK])
@pytest.mark.parametrize("q_len", [1, 30, 4 * BLOCK + 9])
def test_blockwise_attention_equals_the_mask_over_both_copies(
    recent: int, window: int | None, sink: int, q_len: int
) -> None:
    """The attention computes, block by block, what :func:`pseudo_decode_mask` selects over
    ``[K_hat; K]`` (the specification): each key once, quantized or exact as the mask says."""
    from kvarn_eval.accuracy.pseudo_decode import _blockwise_attention

    gen = torch.Generator().manual_seed(11)
    t = 4 * BLOCK + 9
    q = torch.randn(2, 4, q_len, HEAD_DIM, generator=gen)
    k, v = (torch.randn(2, 2, t, HEAD_DIM, generator=gen) for _ in range(2))
    k_hat = k + torch.randn(k.shape, generator=gen)  # stands for the quantized copies
    v_hat = v + torch.randn(v.shape, generator=gen)
    method = KIVI(name="kivi_k2v2", group_size=BLOCK, key_bits=2, value_bits=2)
    config = PseudoDecodeConfig(method, BLOCK, sink_tokens=sink, recent_blocks=recent)
    mask = pseudo_decode_mask(t, BLOCK, False, window, sink_tokens=sink, recent_blocks=recent)[
        t - q_len :
    ]
    want = torch.nn.functional.scaled_dot_product_attention(
        q,
        torch.cat([k_hat, k], dim=2),
        torch.cat([v_hat, v], dim=2),
        attn_mask=mask,
        scale=0.3,
        enable_gqa=True,
    )
    got = _blockwise_attention(q, k, v, k_hat, v_hat, config, window, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sink_requantize_keeps_the_sink_out_of_block_zero() -> None:
    gen = torch.Generator().manual_seed(6)
    k = torch.randn(1, 2, 3 * BLOCK, HEAD_DIM, generator=gen)
    v = torch.randn(1, 2, 3 * BLOCK, HEAD_DIM, generator=gen)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, :4] = 500.0
    v2[:, :, :4] = -30.0
    method = KVarN.of("kvarn_k4v2_g64")
    config = PseudoDecodeConfig(method, BLOCK, sink_tokens=4, sink_requantize=True)
    a_k, a_v = quantize_kv(k, v, config)
    b_k, b_v = quantize_kv(k2, v2, config)
    assert torch.equal(a_k[:, :, 4:], b_k[:, :, 4:]) and torch.equal(a_v[:, :, 4:], b_v[:, :, 4:])
    plain = PseudoDecodeConfig(method, BLOCK, sink_tokens=4)
    c_k, _ = quantize_kv(k2, v2, plain)
    assert not torch.equal(c_k[:, :, 4:64], b_k[:, :, 4:64])


def test_quantize_kv_touches_only_read_blocks() -> None:
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(2, 1, 4 * BLOCK + 3, HEAD_DIM, generator=gen)
    v = torch.randn(2, 1, 4 * BLOCK + 3, HEAD_DIM, generator=gen)
    method = PerTokenRTN()
    k_hat, v_hat = quantize_kv(k, v, PseudoDecodeConfig(method, BLOCK, True))
    # block 0 (sink) and the last block (never read quantized) stay exact
    assert torch.equal(k_hat[:, :, :BLOCK], k[:, :, :BLOCK])
    assert torch.equal(v_hat[:, :, 4 * BLOCK :], v[:, :, 4 * BLOCK :])
    assert not torch.equal(k_hat[:, :, BLOCK : 4 * BLOCK], k[:, :, BLOCK : 4 * BLOCK])
    k_np = k[1, :, BLOCK : 4 * BLOCK].permute(1, 0, 2).numpy()
    v_np = v[1, :, BLOCK : 4 * BLOCK].permute(1, 0, 2).numpy()
    want_k, want_v = method.roundtrip(k_np, v_np)
    assert np.array_equal(k_hat[1, :, BLOCK : 4 * BLOCK].permute(1, 0, 2).numpy(), want_k)
    assert np.array_equal(v_hat[1, :, BLOCK : 4 * BLOCK].permute(1, 0, 2).numpy(), want_v)


def test_quantize_kv_hands_the_stored_positions_queries_to_methods_that_read_them() -> None:
    seen: list[np.ndarray | None] = []

    class QueryAware(PerTokenRTN):
        reads_queries = True

        def roundtrip(self, k, v, queries=None):  # type: ignore[no-untyped-def]
            seen.append(queries)
            return super().roundtrip(k, v)

    gen = torch.Generator().manual_seed(6)
    k = torch.randn(2, 1, 4 * BLOCK + 3, HEAD_DIM, generator=gen)
    v = torch.randn(2, 1, 4 * BLOCK + 3, HEAD_DIM, generator=gen)
    q = torch.randn(2, 3, 4 * BLOCK + 3, HEAD_DIM, generator=gen)
    config = PseudoDecodeConfig(QueryAware(), BLOCK, True)
    k_hat, _ = quantize_kv(k, v, config, q)
    assert len(seen) == 2 and seen[1] is not None
    # the queries of the positions stored (block 0 is the sink), as [T', H_q, D]
    np.testing.assert_array_equal(seen[1], q[1, :, BLOCK : 4 * BLOCK].permute(1, 0, 2).numpy())
    assert torch.equal(k_hat, quantize_kv(k, v, PseudoDecodeConfig(PerTokenRTN(), BLOCK, True))[0])
    seen.clear()
    quantize_kv(k, v, config, q[:, :, -1:])  # cached decoding: only the last query
    assert seen == [None, None]


def test_cached_decoding_round_trips_each_block_once() -> None:
    from kvarn_eval.accuracy.pseudo_decode import decoding

    seen: list[tuple[int, bool]] = []

    class Counting(PerTokenRTN):
        reads_queries = True

        def roundtrip(self, k, v, queries=None):  # type: ignore[no-untyped-def]
            seen.append((k.shape[0], queries is not None))
            return super().roundtrip(k, v)

    gen = torch.Generator().manual_seed(8)
    t = 3 * BLOCK + 1
    k = torch.randn(1, 1, t + BLOCK, HEAD_DIM, generator=gen)
    v = torch.randn(1, 1, t + BLOCK, HEAD_DIM, generator=gen)
    q = torch.randn(1, 3, t + BLOCK, HEAD_DIM, generator=gen)
    config = PseudoDecodeConfig(Counting(), BLOCK, True)
    with decoding():
        # the prefill: blocks 1 and 2 are read quantized (block 0 is the sink)
        first_k, _ = quantize_kv(k[:, :, :t], v[:, :, :t], config, q[:, :, :t], layer="a")
        assert seen == [(2 * BLOCK, True)]
        # steps: nothing new until block 3 is complete and a later token reads it
        for n in range(t + 1, t + BLOCK + 1):
            step_k, _ = quantize_kv(k[:, :, :n], v[:, :, :n], config, q[:, :, n - 1 : n], "a")
        assert seen == [(2 * BLOCK, True), (BLOCK, True)]
    # the same reconstruction as one pass over the whole sequence
    whole_k, _ = quantize_kv(k, v, config, q)
    assert torch.equal(step_k, whole_k)
    assert torch.equal(first_k[:, :, : 3 * BLOCK], whole_k[:, :, : 3 * BLOCK])
    with decoding(), pytest.raises(RuntimeError, match="no query kept for position 64 "):
        quantize_kv(k, v, config, q[:, :, -1:], layer="a")  # no prefill inside decoding()


def test_sliding_window_model_matches_plain_forward() -> None:
    plain = tiny_llama(seed=2, sliding_window=96)
    hooked = install(tiny_llama(seed=2, sliding_window=96))
    ids = torch.randint(4, 94, (1, 3 * BLOCK))
    with torch.inference_mode():
        want = plain(input_ids=ids, use_cache=False).logits[0]
    got = _logits(hooked, ids, PseudoDecodeConfig(Unquantized(), BLOCK))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="block_size must be a multiple"):
        PseudoDecodeConfig(KVarN.of("kvarn_k4v2_g128"), block_size=64)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        PseudoDecodeConfig(None, block_size=0)
    for bad in (-1, BLOCK + 1):
        with pytest.raises(ValueError, match="sink_tokens must be in"):
            PseudoDecodeConfig(None, block_size=BLOCK, sink_tokens=bad)
    q = torch.zeros(1, 2, 4, HEAD_DIM)
    with pytest.raises(RuntimeError, match="needs a configuration"):
        pseudo_decode_attention(torch.nn.Module(), q, q, q, None)
