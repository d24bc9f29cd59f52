"""Pseudo-decode: simulated KV-cache quantization inside a transformers model.

A plain forward pass attends to exact K/V, so it barely sees KV-cache quantization. Pseudo-decode
(the KVarN paper's evaluation) splits the sequence into blocks of ``block_size`` tokens; a query in
block ``b`` attends to the exact K/V of its own block (causally) and to the *quantized* K/V of
every earlier block, as a decoder does once earlier tiles have been flushed to the quantized
cache. With ``exact_first_block`` the first block stays exact everywhere (the fork keeps the
first tile, the attention sink, unquantized). ``sink_tokens = S`` generalizes it: only keys
``[0, S)`` stay exact everywhere, and the rest of block 0 is read quantized like any earlier
block; ``sink_requantize`` quantizes block 0 with its first ``S`` tokens replaced by copies of
token ``S`` (so that the sink does not enter block 0's scales). ``recent_blocks = R`` also keeps
the ``R`` complete blocks before a query's own block exact for it (a short exact window of the
most recent tokens besides the open tile, which a serving engine would keep in staging).

Quantization errors accumulate through the layers exactly as in block-by-block decoding: layer
``l`` quantizes K/V computed from hidden states that already went through quantized attention in
layers ``< l``. Because every method quantizes each block from that block's K/V alone and
attention is causal, one forward pass with a ``[T, 2T]`` mask over ``[K_hat; K]`` equals the
block-by-block loop (the tests check this against an explicit loop). The attention computes what
that mask selects one query block at a time, over the block's keys only, each position once
(tests check it against the mask).

The hook is an attention function registered with transformers' ``AttentionInterface`` under
:data:`ATTENTION_NAME`; K arrives after RoPE. The method and block size come from the
:func:`pseudo_decode` context, so one loaded model serves every method.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from kvarn_math.baselines import Method

__all__ = [
    "ATTENTION_NAME",
    "DecodeMemo",
    "PseudoDecodeConfig",
    "decoding",
    "exact_cache",
    "with_cache",
    "pseudo_decode",
    "pseudo_decode_mask",
    "pseudo_decode_attention",
    "quantize_kv",
    "install",
]

ATTENTION_NAME = "kvarn_pseudo_decode"


@dataclass(frozen=True)
class PseudoDecodeConfig:
    """How a forward pass quantizes its KV cache.

    Attributes:
        method: the KV-cache method whose ``roundtrip`` reconstructs K/V; ``None`` for exact
            float32 K/V (then the hook is plain causal attention).
        block_size: tokens per pseudo-decode block; a multiple of ``method.group_size``.
        exact_first_block: keep the first block exact (the attention sink tile); the same as
            ``sink_tokens=block_size``. Ignored when ``sink_tokens`` is given.
        sink_tokens: keys ``[0, S)`` are read exact by every query, ``0 <= S <= block_size``;
            the rest of block 0 is read quantized. ``None``: ``block_size`` with
            ``exact_first_block``, else 0.
        sink_requantize: quantize block 0 with its first ``S`` tokens replaced by copies of
            token ``S`` (they are read exact anyway; this keeps them out of the scales).
        recent_blocks: ``R``: a query in block ``b`` reads blocks ``b - R .. b`` exact.
    """

    method: Method | None
    block_size: int = 128
    exact_first_block: bool = True
    sink_tokens: int | None = None
    sink_requantize: bool = False
    recent_blocks: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.recent_blocks < 0:
            raise ValueError(f"recent_blocks must be >= 0, got {self.recent_blocks}")
        if self.sink_tokens is not None and not 0 <= self.sink_tokens <= self.block_size:
            raise ValueError(
                f"sink_tokens must be in [0, {self.block_size}] (the block size), "
                f"got {self.sink_tokens}"
            )
        if self.method is not None and self.block_size % self.method.group_size:
            raise ValueError(
                f"block_size must be a multiple of {self.method.name}'s group size "
                f"{self.method.group_size}, got {self.block_size}"
            )

    @property
    def sink(self) -> int:
        """``S``: leading keys every query reads exact (``sink_tokens`` resolved)."""
        if self.sink_tokens is not None:
            return self.sink_tokens
        return self.block_size if self.exact_first_block else 0


_ACTIVE: ContextVar[PseudoDecodeConfig | None] = ContextVar("kvarn_pseudo_decode", default=None)


@dataclass
class DecodeMemo:
    """State kept across the forward passes of one cached decoding (:func:`decoding`), per
    attention layer (``layer``: any hashable, the hook passes ``id(module)``) and batch row.

    * ``blocks``: the reconstruction of the positions ``[start, done)`` already quantized,
      ``(done, k_hat, v_hat)`` with ``[H_kv, done - start, D]`` tensors. A complete block's K/V
      do not change once cached, and every method quantizes blocks independently, so each
      block is round-tripped once, when a query first reads it quantized, instead of at
      every step.
    * ``queries``: the query rows ``[H_q, D]`` at the positions that end a tile of the
      method's group size, kept from the step that computed them. A method that chooses key
      frames from queries (``reads_queries``) judges a tile by its last position's query;
      that tile is quantized at a later step, whose call holds only its own queries (a
      serving engine keeps the same row, ``store_kv(frame_queries=)``).
    """

    blocks: dict[tuple[Any, int], tuple[int, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )
    queries: dict[tuple[Any, int, int], torch.Tensor] = field(default_factory=dict)

    def repeat_row(self, copies: int) -> None:
        """After a prefill of one row, give rows ``1 .. copies - 1`` row 0's state (the cache
        expanded with ``batch_repeat_interleave(copies)``: every row continues the same prefix).
        """
        for (layer, b), kept in list(self.blocks.items()):
            if b == 0:
                for row in range(1, copies):
                    self.blocks[(layer, row)] = kept
        for (layer, b, p), q in list(self.queries.items()):
            if b == 0:
                for row in range(1, copies):
                    self.queries[(layer, row, p)] = q


_MEMO: ContextVar[DecodeMemo | None] = ContextVar("kvarn_pseudo_decode_memo", default=None)


@contextlib.contextmanager
def decoding() -> Iterator[DecodeMemo]:
    """Mark the forward passes inside as one cached decoding of one batch (a prefill, then
    steps that append tokens to the same rows): :func:`quantize_kv` then keeps a
    :class:`DecodeMemo`. Without it every pass stands alone, as a full-sequence pass does."""
    token = _MEMO.set(DecodeMemo())
    try:
        yield _MEMO.get()  # type: ignore[misc]
    finally:
        _MEMO.reset(token)


def exact_cache() -> Any:
    """A transformers KV cache for cached decoding under pseudo-decode: every layer keeps the
    exact K/V of every position, sliding-window layers too. The attention reads a key's position
    from its index and applies the window itself; the model's own cache for sliding-window
    layers keeps only the last ``window - 1`` positions, which would shift every index once a
    sequence outgrows the window."""
    from transformers import DynamicCache

    return DynamicCache()


def with_cache(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword that passes ``cache`` to ``model``'s forward: ``cache`` where the forward
    takes it (transformers 5.2x, which deprecates the old name), else ``past_key_values``."""
    forward = getattr(model, "forward", model)
    try:
        takes_cache = "cache" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        takes_cache = False
    return {"cache": cache} if takes_cache else {"past_key_values": cache}


@contextlib.contextmanager
def pseudo_decode(config: PseudoDecodeConfig) -> Iterator[PseudoDecodeConfig]:
    """Run forward passes of an :func:`install`-ed model under ``config``."""
    token = _ACTIVE.set(config)
    try:
        yield config
    finally:
        _ACTIVE.reset(token)


def pseudo_decode_mask(
    seq_len: int,
    block_size: int,
    exact_first_block: bool,
    sliding_window: int | None = None,
    device: torch.device | str = "cpu",
    *,
    sink_tokens: int | None = None,
    recent_blocks: int = 0,
) -> torch.Tensor:
    """Boolean mask ``[T, 2T]`` over the keys ``[K_hat; K]`` (quantized first, exact second).

    Query ``t`` in block ``b = t // block_size`` may see exact key ``s`` when ``s <= t`` and ``s``
    is in block ``b`` or ``s < S``, and quantized key ``s`` when ``s`` is in an earlier block and
    ``s >= S``. ``S`` is ``sink_tokens`` when given, else ``block_size`` with
    ``exact_first_block`` (block 0 exact) and 0 without; with ``recent_blocks = R`` the blocks
    ``b - R .. b - 1`` are exact for it too. A sliding window ``w`` additionally
    requires ``t - s < w``. Every query sees exactly one copy of each key ``s <= t`` (inside the
    window).
    """
    if sink_tokens is None:
        sink_tokens = block_size if exact_first_block else 0
    pos = torch.arange(seq_len, device=device)
    q_block = (pos // block_size)[:, None]
    k_block = (pos // block_size)[None, :]
    causal = pos[None, :] <= pos[:, None]
    if sliding_window is not None:
        causal = causal & (pos[:, None] - pos[None, :] < sliding_window)
    exact_block = (k_block <= q_block) & (k_block >= q_block - recent_blocks)
    exact_block = exact_block | (pos[None, :] < sink_tokens)
    exact = causal & exact_block
    quantized = causal & ~exact_block
    return torch.cat([quantized, exact], dim=1)


def quantize_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    config: PseudoDecodeConfig,
    query: torch.Tensor | None = None,
    layer: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reconstructions of ``key, value`` ``[B, H_kv, T, D]`` as the quantized cache holds them.

    A method with ``reads_queries = True`` also gets ``queries=`` the ``[T', H_q, D]`` queries
    of the positions it stores, from ``query`` ``[B, H_q, T, D]`` (what a serving engine has at
    store time), or ``None`` when ``query`` does not cover every position (cached decoding).

    Only tokens that some query reads quantized are passed through ``method.roundtrip``: the
    complete blocks before the last block, minus block 0 when the sink covers it
    (``config.sink == block_size``). The other positions are returned exact (the mask never
    selects them; neither does it select sink positions inside block 0). With
    ``sink_requantize`` the roundtrip sees tokens ``[0, S)`` replaced by copies of token ``S``.
    Returns float tensors like ``key``.

    Inside :func:`decoding`, with ``layer`` given, the blocks already round-tripped by an
    earlier pass of this layer are reused and only new ones are round-tripped; a method that
    reads queries gets the tile-ending rows kept from the passes that computed them (see
    :class:`DecodeMemo`).
    """
    if config.method is None:
        return key, value
    start, stop = _quantized_range(key.shape[2], config)
    memo = _MEMO.get() if layer is not None else None
    if memo is not None:
        return _quantize_kv_cached(key, value, config, query, layer, memo, start, stop)
    k_hat, v_hat = key.clone(), value.clone()
    if stop <= start:
        return k_hat, v_hat
    covered = query is not None and query.shape[2] == key.shape[2]
    for b in range(key.shape[0]):
        q_np = None
        if covered and getattr(config.method, "reads_queries", False):
            assert query is not None
            q_np = query[b, :, start:stop].transpose(0, 1).detach().float().cpu().numpy()
        k_hat[b, :, start:stop], v_hat[b, :, start:stop] = _roundtrip_row(
            key, value, b, start, stop, config, q_np
        )
    return k_hat, v_hat


def _quantized_range(seq_len: int, config: PseudoDecodeConfig) -> tuple[int, int]:
    """``[start, stop)``: the positions some query reads quantized (empty when ``stop <=
    start``): the complete blocks before the last, minus block 0 when the sink covers it."""
    num_blocks = -(-seq_len // config.block_size)
    start = config.block_size if config.sink == config.block_size else 0
    return start, (num_blocks - 1) * config.block_size


def _roundtrip_row(
    key: torch.Tensor,
    value: torch.Tensor,
    b: int,
    lo: int,
    hi: int,
    config: PseudoDecodeConfig,
    queries: np.ndarray | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ``b``'s positions ``[lo, hi)`` through ``config.method.roundtrip`` (``queries``
    ``[hi - lo, H_q, D]`` for a method that reads them), as ``[H_kv, hi - lo, D]`` tensors of
    ``key``'s dtype; with ``sink_requantize`` the positions before the sink are copies of
    token ``S``."""
    method = config.method
    assert method is not None
    k_in, v_in = key[b, :, lo:hi], value[b, :, lo:hi]
    sink = config.sink
    if config.sink_requantize and lo < sink < hi:
        k_in, v_in = k_in.clone(), v_in.clone()
        k_in[:, : sink - lo] = key[b, :, sink : sink + 1]
        v_in[:, : sink - lo] = value[b, :, sink : sink + 1]
    # [H, T', D] -> [T', H, D], the layout of Method.roundtrip, in C order: numpy's reductions
    # sum in an order that follows the memory layout, and a last-bit difference can move a
    # scale across a rounding boundary (a log8 byte), which changes a whole tile's codes; so a
    # pass over the whole sequence and a cached pass give the same tiles the same records
    k_np = np.ascontiguousarray(k_in.transpose(0, 1).detach().float().cpu().numpy())
    v_np = np.ascontiguousarray(v_in.transpose(0, 1).detach().float().cpu().numpy())
    if getattr(method, "reads_queries", False):
        reads: Callable[..., tuple[Any, Any]] = method.roundtrip
        k_rt, v_rt = reads(k_np, v_np, queries=queries)
    else:
        k_rt, v_rt = method.roundtrip(k_np, v_np)
    return (
        torch.from_numpy(np.ascontiguousarray(k_rt)).transpose(0, 1).to(key.dtype),
        torch.from_numpy(np.ascontiguousarray(v_rt)).transpose(0, 1).to(value.dtype),
    )


def _quantize_kv_cached(
    key: torch.Tensor,
    value: torch.Tensor,
    config: PseudoDecodeConfig,
    query: torch.Tensor | None,
    layer: Any,
    memo: DecodeMemo,
    start: int,
    stop: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_kv` inside :func:`decoding`: the same reconstruction, each block
    round-tripped once per layer and row."""
    method = config.method
    assert method is not None
    batch, _, seq_len, _ = key.shape
    reads = bool(getattr(method, "reads_queries", False))
    g = method.group_size
    if reads and query is not None:
        # keep the rows that end a tile: a later pass quantizes that tile without them
        first = seq_len - query.shape[2]
        for p in range(first + (-(first + 1)) % g, seq_len, g):
            for b in range(batch):
                memo.queries[(layer, b, p)] = query[b, :, p - first].clone()
    k_hat, v_hat = key.clone(), value.clone()
    if stop <= start:
        return k_hat, v_hat
    for b in range(batch):
        done, k_done, v_done = memo.blocks.get(
            (layer, b), (start, key[b, :, start:start], value[b, :, start:start])
        )
        if stop > done:
            q_np = None
            if reads:
                # the roundtrip reads each tile's last row only; the others stay zero
                ends = range(done + g - 1, stop, g)
                missing = [p for p in ends if (layer, b, p) not in memo.queries]
                if missing:
                    raise RuntimeError(
                        f"no query kept for position {missing[0]} (the end of a tile) of row "
                        f"{b}: a cached decoding must start with its prefill inside decoding()"
                    )
                rows = [memo.queries[(layer, b, p)] for p in ends]
                q_np = np.zeros((stop - done, *rows[0].shape), dtype=np.float32)
                for p, row in zip(ends, rows, strict=True):
                    q_np[p - done] = row.float().cpu().numpy()
            k_new, v_new = _roundtrip_row(key, value, b, done, stop, config, q_np)
            done, k_done, v_done = (
                stop,
                torch.cat([k_done, k_new], dim=1),
                torch.cat([v_done, v_new], dim=1),
            )
            memo.blocks[(layer, b)] = (done, k_done, v_done)
        k_hat[b, :, start:stop] = k_done[:, : stop - start]
        v_hat[b, :, start:stop] = v_done[:, : stop - start]
    return k_hat, v_hat


def pseudo_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [B, H_q, T_q, D]``, ``key/value [B, H_kv, T, D]``.

    Returns ``[B, T_q, H_q, D]`` like transformers' own functions. ``attention_mask`` is
    ignored: inputs must be unpadded or right-padded (causality keeps right padding harmless).
    Without a KV cache ``T_q == T`` (the whole sequence in one pass); with one (greedy
    generation) the queries are the last ``T_q`` positions and the cache holds exact K/V, which
    are quantized here as for the full sequence: each query reads its own block exact and the
    complete blocks before it quantized, so cached decoding equals recomputing the sequence.
    """
    config = _ACTIVE.get()
    if config is None:
        raise RuntimeError(
            f"attention {ATTENTION_NAME!r} needs a configuration: run the model inside "
            "kvarn_eval.accuracy.pseudo_decode(PseudoDecodeConfig(...))"
        )
    q_len, seq_len = query.shape[2], key.shape[2]
    if q_len > seq_len:
        raise ValueError(f"got {q_len} queries against only {seq_len} keys")
    if kwargs.get("softcap") is not None:
        raise ValueError("pseudo-decode attention does not support attention logit soft-capping")
    offset = seq_len - q_len
    window = (
        sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
    )
    gqa = query.shape[1] != key.shape[1]
    quantizes = config.method is not None and seq_len > config.block_size
    if not quantizes:
        pos = torch.arange(seq_len, device=query.device)
        mask = pos[None, :] <= pos[offset:, None]
        if window is not None:
            mask = mask & (pos[offset:, None] - pos[None, :] < window)
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa
        )
    else:
        k_hat, v_hat = quantize_kv(key, value, config, query, layer=id(module))
        out = _blockwise_attention(
            query, key, value, k_hat.to(key.dtype), v_hat.to(value.dtype), config, window, scaling
        )
    return out.transpose(1, 2).contiguous(), None


def _blockwise_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_hat: torch.Tensor,
    v_hat: torch.Tensor,
    config: PseudoDecodeConfig,
    window: int | None,
    scaling: float | None,
) -> torch.Tensor:
    """What :func:`pseudo_decode_mask` selects over ``[K_hat; K]``, one query block at a time:
    block ``b`` attends keys ``[0, end of b)``, each position once, quantized where the mask
    reads it quantized (``[S, (b - R) * G)``) and exact elsewhere; inside a sliding window only
    the window's keys. Skips the masked-out half of the ``[T, 2T]`` scores and the keys past the
    block (3.5x fewer scores at 8 blocks). Returns ``[B, H_q, T_q, D]``."""
    q_len, seq_len = query.shape[2], key.shape[2]
    offset = seq_len - q_len
    g, sink = config.block_size, config.sink
    gqa = query.shape[1] != key.shape[1]
    out = torch.empty_like(query)
    for q0 in range(offset - offset % g, seq_len, g):
        lo, hi = max(q0, offset), min(q0 + g, seq_len)  # this block's queries
        exact_from = max(0, q0 - config.recent_blocks * g)  # blocks b - R .. b are exact
        first = 0 if window is None else max(0, lo - window + 1)  # the oldest key in sight
        # keys [first, hi) in position order: the exact sink [first, a), the quantized
        # [a, b), the exact blocks [b, hi) (spans clamped so that none starts before first)
        a = max(min(sink, exact_from), first)
        b = max(exact_from, first)
        keys = torch.cat([key[:, :, first:a], k_hat[:, :, a:b], key[:, :, b:hi]], dim=2)
        values = torch.cat([value[:, :, first:a], v_hat[:, :, a:b], value[:, :, b:hi]], dim=2)
        k_pos = torch.arange(first, hi)[None, :]
        q_pos = torch.arange(lo, hi)[:, None]
        mask = k_pos <= q_pos
        if window is not None:
            mask = mask & (q_pos - k_pos < window)
        rows = slice(lo - offset, hi - offset)
        out[:, :, rows] = F.scaled_dot_product_attention(
            query[:, :, rows],
            keys,
            values,
            attn_mask=mask.to(query.device),
            scale=scaling,
            enable_gqa=gqa,
        )
    return out


def install(model: Any) -> Any:
    """Register the pseudo-decode attention and switch ``model`` to it; returns ``model``."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, pseudo_decode_attention)
    model.set_attn_implementation(ATTENTION_NAME)
    return model
