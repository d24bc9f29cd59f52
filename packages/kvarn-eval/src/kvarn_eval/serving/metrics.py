"""Pure arithmetic of the serving suites: how many requests fill a cache, per-request timings
from vLLM's ``RequestOutput.metrics``, and the summary of one burst.

vLLM 0.26 fills ``RequestOutput.metrics`` (a ``vllm.v1.metrics.stats.RequestStateStats``) only
when the engine logs stats (``LLM(..., disable_log_stats=False)``; ``LLM`` disables them by
default). Its fields: ``arrival_time`` (wall clock, when ``generate`` queued the request),
``queued_ts``, ``scheduled_ts``, ``first_token_ts``, ``last_token_ts`` (engine-core monotonic
clock), ``first_token_latency`` (seconds from arrival to the first token) and
``num_generation_tokens``. In a burst every request arrives at once, so the time to first token
includes the wait for a place in the batch: it is the latency a user of a saturated server sees.
The time per output token of a request is ``(last_token_ts - first_token_ts) /
(num_generation_tokens - 1)``, vLLM's own definition.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = [
    "percentile",
    "plan_requests",
    "random_token_prompts",
    "request_timing",
    "summarize_burst",
]


def plan_requests(
    kv_cache_tokens: int,
    block_size: int,
    prompt_len: int,
    output_len: int,
    *,
    max_num_seqs: int,
    fill: float = 1.0,
    requests: int | None = None,
) -> int:
    """Requests of ``prompt_len + output_len`` tokens that fill ``fill`` of the KV cache at once.

    Each request holds whole blocks, so it needs ``ceil((prompt_len + output_len) / block_size)``
    of them; at most ``max_num_seqs`` run together, so more would only queue. ``requests`` fixes
    the number instead.

    Args:
        kv_cache_tokens: the cache's capacity in tokens.
        block_size: tokens per cache block (a kvarn block is one tile).
        prompt_len: prompt tokens per request.
        output_len: generated tokens per request.
        max_num_seqs: vLLM's concurrency limit.
        fill: share of the cache to fill (0 < fill <= 1).
        requests: a fixed number of requests (overrides the rest).

    Returns:
        The number of requests, 0 when one request does not fit in the cache.

    Raises:
        ValueError: non-positive sizes or ``fill`` outside (0, 1].
    """
    if requests is not None:
        if requests < 1:
            raise ValueError(f"requests must be >= 1, got {requests}")
        return requests
    for name, value in (
        ("block_size", block_size),
        ("prompt_len", prompt_len),
        ("output_len", output_len),
        ("max_num_seqs", max_num_seqs),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not 0.0 < fill <= 1.0:
        raise ValueError(f"fill must be in (0, 1], got {fill}")
    blocks_per_request = -(-(prompt_len + output_len) // block_size)
    fitting = int(fill * kv_cache_tokens) // (blocks_per_request * block_size)
    return min(max_num_seqs, fitting)


def random_token_prompts(num: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``num`` prompts of ``length`` random token ids (dummy-weight models have no tokenizer).

    Ids avoid the first and last thousand of the vocabulary, where special tokens live.

    Args:
        num: number of prompts.
        length: tokens per prompt.
        vocab_size: the model's vocabulary size (> 2000).
        seed: the random seed (the same seed gives the same prompts).
    """
    import numpy as np

    if vocab_size <= 2000:
        raise ValueError(f"vocab_size must be > 2000, got {vocab_size}")
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, vocab_size - 1000, size=(num, length), dtype=np.int64)
    return [list(map(int, row)) for row in ids]


def request_timing(metrics: Any) -> dict[str, float | None]:
    """Time to first token and time per output token of one request, in seconds.

    Args:
        metrics: a ``RequestOutput.metrics`` (``RequestStateStats``), or ``None``.

    Returns:
        ``ttft_s`` and ``tpot_s``, ``None`` where the metrics cannot tell (no stats, or a single
        generated token for ``tpot_s``).
    """
    if metrics is None:
        return {"ttft_s": None, "tpot_s": None}
    ttft = getattr(metrics, "first_token_latency", None)
    first = getattr(metrics, "first_token_ts", None)
    last = getattr(metrics, "last_token_ts", None)
    generated = getattr(metrics, "num_generation_tokens", 0) or 0
    tpot = None
    if first and last and generated > 1:
        tpot = (last - first) / (generated - 1)
    return {"ttft_s": float(ttft) if ttft else None, "tpot_s": tpot}


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation, ``None`` for no values.

    Args:
        values: the sample.
        q: percentile in [0, 100].
    """
    data = sorted(v for v in values if v is not None and math.isfinite(v))
    if not data:
        return None
    pos = (len(data) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (pos - low)


def summarize_burst(
    prompt_tokens: Sequence[int],
    output_tokens: Sequence[int],
    timings: Sequence[dict[str, float | None]],
    seconds: float,
) -> dict[str, Any]:
    """Throughput and latency of one burst (every request submitted at once).

    Args:
        prompt_tokens: prompt length of each request.
        output_tokens: generated tokens of each request.
        timings: :func:`request_timing` of each request.
        seconds: wall time of the whole ``generate`` call.

    Returns:
        ``requests``, token counts, ``seconds``, ``total_tok_per_s`` (prompt plus output tokens
        per second), ``output_tok_per_s``, ``requests_per_s``, and median / p90 / p99 of
        ``ttft_s`` and ``tpot_s`` (``None`` without metrics). The burst's two phases, when
        every request has its time to first token: ``ttft_s_max`` (the last request's first
        token: the end of the phase in which prompts are prefilled, between decode steps),
        ``prefill_phase_tok_per_s`` (prompt tokens per second of that phase) and
        ``decode_phase_s`` (the time after it, decode only); ``None`` otherwise.
    """
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    ttft = [v for t in timings if (v := t.get("ttft_s")) is not None]
    tpot = [v for t in timings if (v := t.get("tpot_s")) is not None]
    prompt_sum, output_sum = int(sum(prompt_tokens)), int(sum(output_tokens))
    summary: dict[str, Any] = {
        "requests": len(prompt_tokens),
        "prompt_tokens": prompt_sum,
        "output_tokens": output_sum,
        "seconds": round(seconds, 3),
        "total_tok_per_s": (prompt_sum + output_sum) / seconds,
        "output_tok_per_s": output_sum / seconds,
        "requests_per_s": len(prompt_tokens) / seconds,
        "timed_requests": len(ttft),
    }
    for name, values in (("ttft_s", ttft), ("tpot_s", tpot)):
        summary[f"{name}_mean"] = sum(values) / len(values) if values else None
        for q in (50, 90, 99):
            summary[f"{name}_p{q}"] = percentile(values, q)
    last_first = max(ttft) if ttft and len(ttft) == len(prompt_tokens) else None
    summary["ttft_s_max"] = last_first
    summary["prefill_phase_tok_per_s"] = summary["decode_phase_s"] = None
    if last_first is not None and 0 < last_first <= seconds:
        summary["prefill_phase_tok_per_s"] = prompt_sum / last_first
        summary["decode_phase_s"] = seconds - last_first
    return summary
