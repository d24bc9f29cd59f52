"""Exact causal attention of a prompt's first chunk (nothing cached) over its own K/V.

vLLM's FlashAttention where this install runs it, else vLLM's Triton varlen kernel, else
(no GPU driver) a torch reference, as the published fork attends first chunks.
"""

from __future__ import annotations

import logging
from typing import Any

from kvarn_vllm import compat

__all__ = ["exact_causal_attention", "flash_prefill", "fresh_attention"]

logger = logging.getLogger("vllm.kvarn")  # inherits vLLM's handler and level

_PREFILL: dict[str, Any] = {}


def flash_prefill(head_size: int) -> tuple[Any, int] | None:
    """FlashAttention for exact prefill, decided once per process and logged once.

    Without it (e.g. the GPU machine without its ``fa3`` part) the first chunk goes
    through vLLM's Triton varlen kernel.
    """
    if "flash" not in _PREFILL:
        _PREFILL["flash"] = compat.flash_attn_prefill(head_size)
        found = _PREFILL["flash"]
        logger.info(
            "kvarn: exact first-chunk prefill via %s",
            f"FlashAttention {found[1]}" if found else "vLLM's Triton prefill kernel",
        )
    return _PREFILL["flash"]


def exact_causal_attention(
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    query_start_loc: Any,
    scale: float,
    sliding_window: int | None = None,
    kv_start_loc: Any = None,
) -> Any:
    """Causal attention of each sequence's queries over its keys, in torch (reference path).

    Used where vLLM's Triton kernels or FlashAttention are unavailable (vLLM without a GPU
    driver), and by the tests. ``q`` ``[T, Hq, D]``, ``k``/``v`` ``[S, Hkv, D]``,
    ``query_start_loc`` host ints ``[B+1]``; ``kv_start_loc`` host ints ``[B+1]`` (default:
    ``query_start_loc``, each sequence's queries over its own tokens); a sequence's queries
    are its last positions. Writes ``out`` ``[T, Hq, D]``.
    """
    import torch

    group = q.shape[1] // k.shape[1]
    kv_loc = query_start_loc if kv_start_loc is None else kv_start_loc
    for b in range(len(query_start_loc) - 1):
        lo, hi = int(query_start_loc[b]), int(query_start_loc[b + 1])
        klo, khi = int(kv_loc[b]), int(kv_loc[b + 1])
        if hi <= lo:
            continue
        qb = q[lo:hi].transpose(0, 1).float()
        kb = k[klo:khi].transpose(0, 1).float().repeat_interleave(group, 0)
        vb = v[klo:khi].transpose(0, 1).float().repeat_interleave(group, 0)
        qpos = torch.arange(hi - lo, device=q.device) + (khi - klo) - (hi - lo)
        kpos = torch.arange(khi - klo, device=q.device)
        allowed = qpos[:, None] >= kpos[None, :]
        if sliding_window is not None:
            allowed &= qpos[:, None] - kpos[None, :] < sliding_window
        scores = (qb @ kb.transpose(1, 2)) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[lo:hi] = (scores.softmax(-1) @ vb).transpose(0, 1).to(out.dtype)
    return out


def fresh_attention(
    group: Any, q: Any, k: Any, v: Any, out: Any, scale: float, window: int | None, head_size: int
) -> None:
    """Exact causal attention of a group of first chunks: ``q`` ``[T, Hq, D]`` over ``k``,
    ``v`` ``[T, Hkv, D]`` (original frame), each row over its own tokens
    (``group.query_start_loc``), into ``out`` ``[T, Hq, D]``."""
    flash = flash_prefill(head_size)
    done = False
    if flash is not None:
        flash_fn, fa_version = flash
        try:
            flash_fn(
                q,
                k,
                v,
                max_seqlen_q=group.max_query_len,
                cu_seqlens_q=group.query_start_loc,
                max_seqlen_k=group.max_query_len,
                cu_seqlens_k=group.query_start_loc,
                softmax_scale=scale,
                causal=True,
                window_size=None if window is None else [window - 1, 0],
                out=out,
                fa_version=fa_version,
            )
            done = True
        except Exception as exc:  # argument/shape refusal: use Triton from now on
            _PREFILL["flash"] = None
            logger.warning(
                "kvarn: FlashAttention %s refused the first-chunk prefill "
                "(%s); using vLLM's Triton prefill kernel instead",
                fa_version,
                exc,
            )
    triton_fn = None if done else compat.triton_prefill()
    if triton_fn is not None:
        lens = group.query_start_loc[1:] - group.query_start_loc[:-1]
        triton_fn(
            q,
            k,
            v,
            out,
            group.query_start_loc[:-1],
            lens,
            group.max_query_len,
            is_causal=True,
            softmax_scale=scale,
            sliding_window_q=None if window is None else window - 1,
        )
    elif not done:
        exact_causal_attention(q, k, v, out, group.query_start_loc_host, scale, window)
