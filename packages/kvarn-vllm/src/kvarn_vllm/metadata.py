"""The attention metadata of one step: its rows split by how their queries attend.

A step's rows are of three kinds, each served by one attention call per layer
(:mod:`kvarn_vllm.impl`):

* ``decode``: one new token after cached ones -> ``decode_attention`` over the cache; in a
  mixed speculative step also the query tokens of its verify blocks, one decode row each
  (:attr:`RowGroup.per_token`);
* ``fresh``: a prompt's first chunk with nothing cached -> exact causal attention over the
  fresh K/V (vLLM's Triton varlen kernel), as the published fork does;
* ``context``: a chunk after cached tokens (chunked prefill continuation, prefix-cache hit,
  the verify blocks of a uniform speculative step) -> ``multi_query_attention`` over the
  cache, after this step's store, or a dense path (:mod:`kvarn_vllm.dense`), or the verify
  blocks as decode rows.

:mod:`kvarn_vllm.planning` builds a :class:`KvarnMetadata` once per step and KV cache group;
nothing here imports vLLM or torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "BatchSplit",
    "KvarnMetadata",
    "RowGroup",
    "encoded_block_table",
    "split_rows",
]


@functools.lru_cache(maxsize=4)
def encoded_table(max_blocks: int, max_reqs: int) -> np.ndarray:
    """:func:`encoded_block_table` of ``max_reqs`` rows, read-only and cached (a step takes
    its first rows)."""
    table = encoded_block_table(max_reqs, max_blocks)
    table.flags.writeable = False
    return table


def encoded_block_table(num_reqs: int, max_blocks: int) -> np.ndarray:
    """``[num_reqs, max_blocks]`` int32 with entry ``row * max_blocks + tile``.

    Handed to ``plan_store`` as the host block table; the builder maps the codes back to
    block ids through the device block table.
    """
    if num_reqs * max_blocks >= 2**31:
        raise ValueError(f"num_reqs * max_blocks must fit int32, got {num_reqs} * {max_blocks}")
    return np.arange(num_reqs * max_blocks, dtype=np.int32).reshape(num_reqs, max_blocks)


@dataclass(frozen=True)
class BatchSplit:
    """Batch rows by how their queries attend (see the module docstring).

    Attributes:
        decode, fresh, context: row indices (int32) of each kind, in batch order.
        uniform: the single kind every row has, or None for a mixed batch.
    """

    decode: np.ndarray
    fresh: np.ndarray
    context: np.ndarray
    uniform: str | None


def split_rows(num_cached: np.ndarray, num_new: np.ndarray) -> BatchSplit:
    """Classify rows: ``decode`` (1 new token after cached ones), ``fresh`` (nothing
    cached), ``context`` (several new tokens after cached ones). Rows with no new token
    (padding) belong to no kind: they have no query row to attend for."""
    num_cached = np.asarray(num_cached)
    num_new = np.asarray(num_new)
    if num_cached.shape != num_new.shape:
        raise ValueError(
            f"num_cached and num_new must match, got {num_cached.shape} and {num_new.shape}"
        )
    if (num_cached < 0).any() or (num_new < 0).any():
        raise ValueError("num_cached and num_new must be >= 0")
    fresh_mask = (num_cached == 0) & (num_new > 0)
    decode_mask = ~fresh_mask & (num_new == 1)
    context_mask = ~fresh_mask & (num_new > 1)
    rows = np.arange(num_new.shape[0], dtype=np.int32)
    parts = {"decode": rows[decode_mask], "fresh": rows[fresh_mask], "context": rows[context_mask]}
    nonempty = [k for k, v in parts.items() if v.size]
    # A kind is the whole batch only if every row is of it: a row without tokens (padding)
    # belongs to no kind, so such a batch takes the gathered path.
    uniform = nonempty[0] if len(nonempty) == 1 and parts[nonempty[0]].size == rows.size else None
    return BatchSplit(uniform=uniform, **parts)


@dataclass
class RowGroup:
    """Device tensors for one kind of rows (absent kinds are None in the metadata).

    Attributes:
        rows: ``[n]`` int32 batch rows, or None when the group is the whole batch.
        token_index: ``[t]`` int64 rows of query/key/value/output, or None (whole batch).
        query_start_loc: ``[n + 1]`` int32 within the gathered tokens.
        seq_lens, staging_slots: ``[n]`` int32.
        quantized_lens: ``[n]`` int32 tokens attention reads from quantized records (the
            plan's ``attention_lens``: with recent tiles, fewer than are quantized).
        block_table: ``[n, max_blocks]`` int32.
        max_query_len, max_seq_len, num_tokens: host ints.
        query_start_loc_host: ``[n + 1]`` int32 NumPy copy of ``query_start_loc``.
        sink_lens: ``[n]`` int32 (``G`` where the exact first tile is in staging), or None
            when the cache keeps no sink.
        sink_slots: ``[n]`` int32, the staging slot whose sink rows each row reads (its own,
            or the one holding a first tile it shares through the prefix cache), or None.
        key_lens: ``[n]`` int32 with values-only windows: attention reads keys from records
            before it (the plan's ``key_read_lens``), else None.
        host: NumPy copies of ``seq_lens``, ``quantized_lens``, ``sink_lens``,
            ``sink_slots``, ``staging_slots`` and ``key_lens`` where the host knows them
            exactly (no speculative decoding), else None.
        per_token: a decode group of query tokens, not requests (verify blocks as decode
            rows in a mixed step): ``rows`` maps each token to its batch row, the per-row
            tensors are per token (``seq_lens`` the token's position + 1), and there are
            ``num_tokens`` of them.
        expansion: a context group's tokens as decode rows, kept by the step's first layer
            for the others (:func:`kvarn_vllm.groups.row_expansion`).
        plans: the step's :class:`kvarn_kernels.AttentionPlan` objects for this group, made by
            its first layer and run by every layer (keyed by what a layer's call may differ
            in: the kind of call, the scale and the sliding window; not copied by
            ``dataclasses.replace``, whose copy holds other tensors).
    """

    rows: Any
    token_index: Any
    query_start_loc: Any
    seq_lens: Any
    quantized_lens: Any
    staging_slots: Any
    block_table: Any
    max_query_len: int
    max_seq_len: int
    num_tokens: int
    query_start_loc_host: Any = None
    sink_lens: Any = None
    sink_slots: Any = None
    key_lens: Any = None
    host: dict[str, Any] | None = None
    per_token: bool = False
    expansion: Any = field(default=None, repr=False)
    plans: dict[tuple, Any] = field(default_factory=dict, repr=False, init=False)


@dataclass
class KvarnMetadata:
    """Attention metadata of one step for the layers of one KV cache group.

    Attributes:
        num_reqs, num_actual_tokens: batch size and real tokens.
        plan: the ``StorePlan`` (device tensors, real block ids), or None for a dummy
            batch (profiling/warm-up: nothing is written, attention runs on fresh K/V).
        decode, fresh, context: the three kinds of rows (:class:`RowGroup` or None).
        causal: False for a drafter's non-causal block (DFlash): every query token of a
            context row attends the whole sequence, its block included.
    """

    num_reqs: int
    num_actual_tokens: int
    plan: Any
    decode: RowGroup | None
    fresh: RowGroup | None
    context: RowGroup | None
    causal: bool = True
