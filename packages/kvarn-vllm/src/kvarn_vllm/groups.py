"""A row group's tensors: gathered and scattered, split into runs, or expanded into decode
rows (one per query token)."""

from __future__ import annotations

import itertools
from typing import Any

from kvarn_vllm import compat, kernels

__all__ = ["capturing", "group_rows", "query_runs", "row_expansion", "write_group_rows"]


def capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def row_expansion(group: Any, num_rows: int, causal: bool) -> dict[str, Any]:
    """A context group's ``num_rows`` query tokens as decode rows: each token's sequence
    (``rows``), length (``row_lens``: its position + 1, or with ``causal=False`` the whole
    sequence), and its sequence's table row, read lengths, staging slot, sink and key lengths;
    ``valid`` marks the tokens before the group's last query (the rest is padding of a CUDA
    graph). Computed once per model forward and group: the first layer's call stores it on
    the group for the others (every layer of a step reads the same rows). Within a CUDA
    graph capture the ops are captured once, by the first layer, and replay before the other
    layers read their results; outside a forward (tests) nothing is kept."""
    import torch

    ctx = compat.current_forward_context()
    key = (num_rows, causal, capturing())
    memo = group.expansion
    if ctx is not None and memo is not None and memo[0] is ctx and memo[1] == key:
        return memo[2]
    qsl = group.query_start_loc
    rows, row_lens = kernels.decode_rows(qsl, num_rows, group.seq_lens, causal)
    tables = kernels.row_tables(
        rows,
        group.block_table,
        group.quantized_lens,
        group.staging_slots,
        group.sink_lens,
        group.sink_slots,
        group.key_lens,
    )
    tokens = torch.arange(num_rows, device=qsl.device)
    valid = (tokens < qsl[qsl.shape[0] - 1]).view(-1, 1, 1)
    e = {"rows": rows, "row_lens": row_lens, "valid": valid, **tables._asdict()}
    if ctx is not None:
        group.expansion = (ctx, key, e)
    return e


def group_rows(group: Any, t: Any, n: int) -> Any:
    """The rows of ``t`` (queries, keys or values of the step's ``n`` tokens) that belong to a
    row group: all ``n`` when the group is the whole batch, else its ``token_index``."""
    return t[:n] if group.token_index is None else t.index_select(0, group.token_index)


def write_group_rows(group: Any, output: Any, res: Any, n: int) -> None:
    """Write a row group's results ``res`` back into the step's ``output`` (inverse of
    :func:`group_rows`)."""
    if group.token_index is None:
        output[:n].copy_(res)
    else:
        output.index_copy_(0, group.token_index, res)


def query_runs(query_start_loc: Any, limit: int) -> list[tuple[int, int]]:
    """Maximal runs ``[lo, hi)`` of consecutive rows whose query lengths (from the host
    ``query_start_loc``) are all at most ``limit``, or all above it."""
    starts = [int(x) for x in query_start_loc]
    lens = [b - a for a, b in itertools.pairwise(starts)]
    runs: list[tuple[int, int]] = []
    lo = 0
    for i in range(1, len(lens) + 1):
        if i == len(lens) or (lens[i] <= limit) != (lens[lo] <= limit):
            runs.append((lo, i))
            lo = i
    return runs
