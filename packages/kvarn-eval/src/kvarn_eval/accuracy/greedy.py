"""Greedy-generation fidelity on CPU: each method's greedy continuation against bf16's.

Every prompt (a fixed set of equal-length text chunks) is prefilled under pseudo-decode and
then decoded greedily with transformers' KV cache: the cache holds exact K/V and the attention
hook quantizes them as the method's cache would (each new token reads its own block exact and
every complete block before it quantized), so cached decoding equals recomputing the whole
sequence at every step (a test checks this). The continuations are compared with the
reference's by :func:`kvarn_eval.fidelity.compare_outputs` (token agreement, longest common
prefix), the same metrics as the vLLM suite. The simulation is deterministic, so bf16 against
itself agrees exactly; the ``fp32`` row (an unquantized cache) shows how much bf16 rounding
alone moves greedy outputs: the noise floor of this measurement.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
from kvarn_eval.accuracy.summary import MethodRows
from kvarn_eval.fidelity import compare_outputs
from kvarn_eval.report import sink_label

__all__ = ["GreedyResult", "GreedyRow", "evaluate_greedy", "greedy_generate", "greedy_tables"]


def greedy_generate(
    model: Any, prompts: torch.Tensor, new_tokens: int, config: PseudoDecodeConfig
) -> list[list[int]]:
    """Greedy continuations of ``prompts`` ``[B, P]`` (one length) under ``config``.

    Args:
        model: a causal LM prepared with :func:`~kvarn_eval.accuracy.pseudo_decode.install`.
        prompts: token ids ``[B, P]``.
        new_tokens: tokens to generate per prompt.
        config: the pseudo-decode configuration (method, block size).

    Returns:
        ``B`` lists of ``new_tokens`` token ids.
    """
    generated: list[torch.Tensor] = []
    with torch.inference_mode(), pseudo_decode(config), decoding():
        cache = with_cache(model, exact_cache())
        out = model(input_ids=prompts, use_cache=True, logits_to_keep=1, **cache)
        next_ids = out.logits[:, -1].argmax(-1)
        for step in range(new_tokens):
            generated.append(next_ids)
            if step == new_tokens - 1:
                break
            out = model(input_ids=next_ids[:, None], use_cache=True, **cache)
            next_ids = out.logits[:, -1].argmax(-1)
    return [list(map(int, row)) for row in torch.stack(generated, dim=1)]


@dataclass
class GreedyRow:
    """One method's greedy agreement with the reference.

    Attributes:
        method: method name.
        bits_per_element: stored bits per K or V element.
        token_agreement: equal tokens at equal positions over all generated tokens.
        exact_match: fraction of prompts whose continuation is identical.
        mean_lcp: mean longest common prefix, tokens.
        first_token_agreement: fraction of prompts whose first generated token agrees.
        outputs: the continuations.
    """

    method: str
    bits_per_element: float
    token_agreement: float
    exact_match: float
    mean_lcp: float
    first_token_agreement: float
    outputs: list[list[int]] = field(default_factory=list)


@dataclass
class GreedyResult(MethodRows):
    """The CPU ``greedy`` suite's outcome, JSON-ready through :meth:`to_dict`."""

    KIND = "greedy"

    suite: str
    source: str
    reference: str
    num_prompts: int
    prompt_len: int
    new_tokens: int
    block_size: int
    exact_first_block: bool
    rows: list[GreedyRow]
    sink_tokens: int = 0
    sink_requantize: bool = False
    recent_blocks: int = 0
    skipped: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


def evaluate_greedy(
    model: Any,
    prompts: Sequence[Sequence[int]],
    methods: Sequence[Method],
    *,
    head_dim: int,
    new_tokens: int,
    reference: str = "bf16",
    block_size: int = 128,
    exact_first_block: bool = True,
    sink_tokens: int | None = None,
    sink_requantize: bool = False,
    recent_blocks: int = 0,
    source: str = "",
    advance: Callable[[str], None] | None = None,
) -> GreedyResult:
    """Generate greedily with every method and compare with ``reference``'s continuations.

    Args:
        model: a causal LM prepared with :func:`~kvarn_eval.accuracy.pseudo_decode.install`.
        prompts: token id lists, all of one length.
        methods: the methods; ``reference`` must name one of them.
        head_dim: the model's head dimension (for bits per element).
        new_tokens: tokens generated per prompt.
        reference: the method compared against.
        block_size: pseudo-decode block (tile) size.
        exact_first_block: keep the first block exact.
        sink_tokens: keys ``[0, S)`` read exact by every query (``None``: the whole first block
            with ``exact_first_block``, else none); see :class:`PseudoDecodeConfig`.
        sink_requantize: quantize block 0 without its sink tokens (copies of token ``S``).
        recent_blocks: complete blocks before a query's own that it reads exact.
        source: where the prompts come from (stored).
        advance: called with the method name after each method (progress bars).
    """
    names = [m.name for m in methods]
    if reference not in names:
        raise ValueError(f"reference {reference!r} must be one of the methods {names}")
    lengths = {len(p) for p in prompts}
    if len(lengths) != 1:
        raise ValueError(f"prompts must share one length, got lengths {sorted(lengths)}")
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    ids = torch.tensor([list(p) for p in prompts], dtype=torch.long)
    start = time.perf_counter()
    outputs: dict[str, list[list[int]]] = {}
    sink = PseudoDecodeConfig(None, block_size, exact_first_block, sink_tokens).sink
    for method in sorted(methods, key=lambda m: m.name != reference):
        config = PseudoDecodeConfig(
            method, block_size, exact_first_block, sink, sink_requantize, recent_blocks
        )
        outputs[method.name] = greedy_generate(model, ids, new_tokens, config)
        if advance is not None:
            advance(method.name)
    rows = []
    for method in methods:
        c = compare_outputs(outputs[reference], outputs[method.name])
        rows.append(
            GreedyRow(
                method=method.name,
                bits_per_element=method.bits_per_element(head_dim),
                token_agreement=c["token_agreement"],
                exact_match=c["exact_match"],
                mean_lcp=c["mean_lcp"],
                first_token_agreement=c["first_token_agreement"],
                outputs=outputs[method.name],
            )
        )
    return GreedyResult(
        suite="greedy",
        source=source,
        reference=reference,
        num_prompts=len(prompts),
        prompt_len=len(prompts[0]),
        new_tokens=new_tokens,
        block_size=block_size,
        exact_first_block=exact_first_block,
        rows=rows,
        sink_tokens=sink,
        sink_requantize=sink_requantize,
        recent_blocks=recent_blocks,
        seconds=time.perf_counter() - start,
    )


def greedy_tables(result: dict[str, Any]) -> dict[str, Any]:
    """Table and plot points of a :class:`GreedyResult` dict (added to it, and returned).

    Args:
        result: ``GreedyResult.to_dict()``.
    """
    header = ["method", "bits/elem", "token agree %", "exact %", "mean LCP", "first token %"]
    rows = [
        [
            r["method"],
            f"{r['bits_per_element']:.2f}",
            f"{100 * r['token_agreement']:.1f}",
            f"{100 * r['exact_match']:.0f}",
            f"{r['mean_lcp']:.1f}",
            f"{100 * r['first_token_agreement']:.0f}",
        ]
        for r in result["rows"]
    ]
    title = (
        f"greedy: {result['num_prompts']} prompts of {result['prompt_len']} tokens, "
        f"{result['new_tokens']} greedy tokens, pseudo-decode blocks of {result['block_size']}"
        f"{sink_label(result)}; agreement with "
        f"{result['reference']} (fp32: the noise of bf16 rounding itself)"
    )
    result["tables"] = [{"title": title, "header": header, "rows": rows}]
    result["plot_file"] = "accuracy"
    result["points"] = [
        {
            "label": r["method"],
            "family": "kvarn" if r["method"].startswith("kvarn") else "other",
            "x": r["bits_per_element"],
            "y": 100 * r["token_agreement"],
        }
        for r in result["rows"]
        if r["method"] != result["reference"]
    ]
    result["axes"] = {
        "xlabel": "bits per element (scales included, log scale)",
        "ylabel": f"greedy token agreement with {result['reference']} (%)",
        "title": "greedy (CPU, pseudo-decode)",
    }
    return result
