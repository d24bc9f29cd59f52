"""Long-context retrieval on CPU under pseudo-decode (the ``longctx_cpu`` suite).

Each context of :mod:`kvarn_eval.longctx` is prefilled once per method into an exact KV cache
under :func:`~kvarn_eval.accuracy.pseudo_decode.decoding`, so that its complete blocks are read
through the method's round trip as a decoder reads them; then each question runs from that
cache and greedy decoding writes the answer's length plus a slack of tokens, after which the
cache is cropped back to the context (and the decoding's memo restored) for the next question.
An item is right when that text holds every value of the answer
(:func:`~kvarn_eval.longctx.answer_found`), as in the GPU suite.

Items of one context are not independent (they share its haystack), so the paired standard
error of a method against the reference is taken over contexts: the per-context mean of
(this method right) - (reference right), weighted by the context's items.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from kvarn_math.baselines import Method

from kvarn_eval.accuracy.pseudo_decode import (
    PseudoDecodeConfig,
    decoding,
    exact_cache,
    pseudo_decode,
    with_cache,
)
from kvarn_eval.longctx import LongContext, answer_found, max_new_tokens, paired_by_context

__all__ = [
    "evaluate_longctx",
    "generate_answers",
    "longctx_tables",
    "score_context",
]


def generate_answers(model: Any, context: LongContext) -> list[list[int]]:
    """Greedy tokens after each question of ``context`` (:func:`max_new_tokens` of them),
    under the active pseudo-decode configuration: the context is prefilled once, each
    question decoded from its cache, cropped back to the context afterwards.

    Args:
        model: an :func:`~kvarn_eval.accuracy.pseudo_decode.install`-ed causal LM.
        context: the context and its items.

    Returns:
        The generated token ids, one list per item of ``context``.
    """
    outs = []
    with torch.inference_mode(), decoding() as memo:
        cache = exact_cache()
        passes_cache = with_cache(model, cache)
        model(
            input_ids=torch.tensor([list(context.ids)]),
            use_cache=True,
            logits_to_keep=1,
            **passes_cache,
        )
        blocks, queries = dict(memo.blocks), dict(memo.queries)
        for it in context.items:
            extra = cache.get_seq_length() - len(context.ids)
            if extra > 0:  # a negative length removes that many tokens (transformers 4 and 5)
                cache.crop(-extra)
            memo.blocks, memo.queries = dict(blocks), dict(queries)
            ids = torch.tensor([list(it.question)])
            generated: list[int] = []
            for _ in range(max_new_tokens(it)):
                logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **passes_cache)
                generated.append(int(logits.logits[0, -1].argmax()))
                ids = torch.tensor([generated[-1:]])
            outs.append(generated)
    return outs


def score_context(
    model: Any, context: LongContext, decode: Callable[[list[int]], str]
) -> list[bool]:
    """Whether greedy decoding writes each item's answer after ``context``
    (:func:`generate_answers`, then :func:`~kvarn_eval.longctx.answer_found` on the text
    ``decode`` gives)."""
    outs = generate_answers(model, context)
    return [answer_found(decode(o), it.answer_text) for o, it in zip(outs, context.items)]


def evaluate_longctx(
    model: Any,
    cells: dict[tuple[str, int], list[LongContext]],
    methods: Sequence[Method],
    *,
    decode: Callable[[list[int]], str],
    reference: str = "bf16",
    block_size: int = 128,
    exact_first_block: bool = True,
    recent_blocks: int = 1,
    advance: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Score every item of ``cells`` under each method; rows per (task, length, method).

    Args:
        model: an installed causal LM.
        cells: contexts by (task, nominal length).
        methods: the methods (the reference among them).
        decode: token ids to text (the tokenizer's ``decode``).
        reference: the method every other is paired against.
        block_size: pseudo-decode block (tile) size.
        exact_first_block: keep block 0 exact (the attention sink).
        recent_blocks: complete blocks before a query's own read exact.
        advance: called after each (cell, method).

    Returns:
        JSON-ready: ``rows`` (task, length, prompt tokens, method, accuracy, change and its
        paired SE against the reference, items, seconds), ``right`` (per cell and method,
        the per-item flags), ``depths`` (per cell, the per-item depths).
    """
    names = [m.name for m in methods]
    if reference not in names:
        raise ValueError(f"the reference {reference!r} is not among the methods {names}")
    right: dict[str, dict[str, list[bool]]] = {}
    seconds: dict[str, dict[str, float]] = {}
    rows = []
    depths: dict[str, list[float]] = {}
    for (task, length), contexts in cells.items():
        cell = f"{task}/{length}"
        depths[cell] = [it.depth for c in contexts for it in c.items]
        right[cell], seconds[cell] = {}, {}
        for method in methods:
            config = PseudoDecodeConfig(
                method=method,
                block_size=block_size,
                exact_first_block=exact_first_block,
                recent_blocks=recent_blocks,
            )
            start = time.perf_counter()
            flags: list[bool] = []
            with pseudo_decode(config):
                for context in contexts:
                    flags += score_context(model, context, decode)
            right[cell][method.name] = flags
            seconds[cell][method.name] = time.perf_counter() - start
            if advance is not None:
                advance(f"{cell} {method.name}")
        ctx_of = [c.index for c in contexts for _ in c.items]
        base = right[cell][reference]
        for method in methods:
            flags = right[cell][method.name]
            change, change_se = paired_by_context(flags, base, ctx_of)
            rows.append(
                {
                    "task": task,
                    "length": length,
                    "prompt_tokens": max(
                        len(c.ids) + len(it.question) for c in contexts for it in c.items
                    ),
                    "method": method.name,
                    "items": len(flags),
                    "contexts": len(contexts),
                    "accuracy": sum(flags) / len(flags),
                    "change": change,
                    "change_se": change_se,
                    "agreement": sum(a == b for a, b in zip(flags, base)) / len(flags),
                    "seconds": seconds[cell][method.name],
                }
            )
    return {"rows": rows, "right": right, "depths": depths, "reference": reference}


def longctx_tables(rows: Sequence[dict[str, Any]], title: str) -> list[dict[str, Any]]:
    """One table: per (task, length, method) accuracy, change against the reference with
    its paired standard error, agreement with the reference's right/wrong per item."""
    header = ["task", "length", "method", "items", "accuracy %", "change (paired SE)", "agree %"]
    table_rows = [
        [
            r["task"],
            str(r["length"]),
            r["method"],
            str(r["items"]),
            f"{100 * r['accuracy']:.1f}",
            f"{100 * r['change']:+.1f} ± "
            + ("-" if math.isnan(r["change_se"]) else f"{100 * r['change_se']:.1f}"),
            f"{100 * r['agreement']:.1f}",
        ]
        for r in rows
    ]
    return [{"title": title, "header": header, "rows": table_rows}]
