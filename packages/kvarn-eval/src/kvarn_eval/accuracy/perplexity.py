"""Perplexity, KL divergence and top-1 agreement under pseudo-decode.

For every chunk the reference method (bf16 by default) runs first; every other method then runs on
the same chunk and is compared position by position with the reference's next-token distribution.
All predicted positions of a chunk are scored (``T - 1`` per chunk), including those of the first
block, which no method changes; or, with ``scored_from``, only a chunk's tail (GSM8K: the gold
solution after its few-shot prompt, chunks of any length).

Noise: every statistic is computed per chunk, and the standard error over chunks of the paired
difference against the reference is reported beside it (a change smaller than about two standard
errors is not distinguishable from the text-sampling noise of this run). Chunk statistics are
weighted by the tokens each scored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from kvarn_math.baselines import Method

from kvarn_eval.accuracy.pseudo_decode import PseudoDecodeConfig, pseudo_decode
from kvarn_eval.accuracy.summary import MethodRows, mean_and_se, weighted_mean_and_se

__all__ = [
    "ChunkScores",
    "PerplexityRow",
    "PerplexityResult",
    "ReferenceDistribution",
    "compare_logits",
    "evaluate_perplexity",
    "mean_and_se",
]


@dataclass(frozen=True)
class ChunkScores:
    """One method on one chunk.

    Attributes:
        nll: mean negative log-likelihood of the next token, nats.
        kl: mean ``KL(reference || method)`` over positions, nats.
        top1: fraction of positions whose argmax equals the reference's.
        tokens: positions scored.
    """

    nll: float
    kl: float
    top1: float
    tokens: int


@dataclass(frozen=True)
class ReferenceDistribution:
    """The reference method's next-token distributions over one chunk, kept to compare the
    other methods with.

    Attributes:
        probs: ``[T, V]`` probabilities, float64.
        neg_entropy: ``[T]`` sum over the vocabulary of ``p log p``, float64.
        top1: ``[T]`` the most likely token of each position.
    """

    probs: torch.Tensor
    neg_entropy: torch.Tensor
    top1: torch.Tensor


def compare_logits(
    logits: torch.Tensor,
    reference: ReferenceDistribution | None,
    targets: torch.Tensor,
    rows_per_step: int = 128,
) -> tuple[ChunkScores, ReferenceDistribution | None]:
    """Scores of ``logits`` ``[T, V]`` against ``reference``, in float64.

    ``targets`` ``[T]`` is the next token of each position. Without a reference, ``logits``
    are the reference: their scores (KL 0, top-1 agreement 1) and their
    :class:`ReferenceDistribution` are returned (``None`` is returned otherwise).

    ``KL(ref || m) = sum p log p - sum p x + logsumexp(x)`` per position for the method's
    logits ``x`` (``sum p = 1``): one log-sum-exp and one dot product per position, no
    log-softmax of the method. Works ``rows_per_step`` positions at a time so that large
    vocabularies (Gemma: 262k) keep temporaries small.
    """
    num_rows = logits.shape[0]
    made = None
    if reference is None:
        made = ReferenceDistribution(
            probs=torch.empty(logits.shape, dtype=torch.float64),
            neg_entropy=torch.empty(num_rows, dtype=torch.float64),
            top1=torch.empty(num_rows, dtype=torch.long),
        )
    nll_sum = kl_sum = agree = 0.0
    for start in range(0, num_rows, rows_per_step):
        rows = slice(start, min(start + rows_per_step, num_rows))
        x = logits[rows].double()
        lse = torch.logsumexp(x, dim=-1)
        nll_sum += float((lse - x.gather(-1, targets[rows, None])[:, 0]).sum())
        top1 = logits[rows].argmax(-1)  # float32 -> float64 is exact: the same argmax
        if made is not None:
            lp = x - lse[:, None]
            p = torch.exp(lp, out=made.probs[rows])
            made.neg_entropy[rows] = (p * lp).sum(-1)
            made.top1[rows] = top1
            agree += top1.numel()
        else:
            assert reference is not None
            dot = (reference.probs[rows] * x).sum(-1)
            kl_sum += float((reference.neg_entropy[rows] - dot + lse).sum())
            agree += float((top1 == reference.top1[rows]).sum())
    scores = ChunkScores(
        nll=nll_sum / num_rows,
        kl=kl_sum / num_rows,
        top1=agree / num_rows,
        tokens=int(num_rows),
    )
    return scores, made


@dataclass
class PerplexityRow:
    """One method's summary.

    Attributes:
        method: method name.
        bits_per_element: average stored bits per K or V element, scales included.
        bytes_per_token_per_head: K plus V bytes per token and KV head.
        perplexity: ``exp`` of the mean NLL over all scored tokens.
        delta_pct: perplexity change against the reference, percent.
        delta_se_pct: standard error of ``delta_pct`` over chunks (paired).
        kl: mean KL divergence from the reference, nats.
        kl_se: its standard error over chunks.
        top1: top-1 agreement with the reference.
        top1_se: its standard error over chunks.
        chunk_nll: per-chunk mean NLL.
    """

    method: str
    bits_per_element: float
    bytes_per_token_per_head: float
    perplexity: float
    delta_pct: float
    delta_se_pct: float
    kl: float
    kl_se: float
    top1: float
    top1_se: float
    chunk_nll: list[float] = field(default_factory=list)


@dataclass
class PerplexityResult(MethodRows):
    """A perplexity suite's outcome, JSON-ready through :meth:`to_dict`.

    Scored from a tail of each chunk (``scored_from``), ``num_chunks`` counts items,
    ``chunk_len`` is the longest, and ``mean_scored_tokens``, ``mean_context_tokens`` and
    ``mean_quantized_fraction`` (the share of the keys a scored prediction reads quantized)
    describe them; they are 0 otherwise.
    """

    KIND = "perplexity"

    suite: str
    source: str
    reference: str
    num_chunks: int
    chunk_len: int
    block_size: int
    exact_first_block: bool
    head_dim: int
    rows: list[PerplexityRow]
    sink_tokens: int = 0
    sink_requantize: bool = False
    recent_blocks: int = 0
    skipped: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    mean_scored_tokens: float = 0.0
    mean_context_tokens: float = 0.0
    mean_quantized_fraction: float = 0.0


def _summarize(
    method: Method, head_dim: int, chunks: list[ChunkScores], ref: list[ChunkScores]
) -> PerplexityRow:
    weights = [c.tokens for c in chunks]
    mean_nll = sum(c.nll * c.tokens for c in chunks) / sum(weights)
    ref_nll = sum(c.nll * c.tokens for c in ref) / sum(weights)
    _, diff_se = weighted_mean_and_se(
        [c.nll - r.nll for c, r in zip(chunks, ref, strict=True)], weights
    )
    ratio = math.exp(mean_nll - ref_nll)
    kl, kl_se = weighted_mean_and_se([c.kl for c in chunks], weights)
    top1, top1_se = weighted_mean_and_se([c.top1 for c in chunks], weights)
    return PerplexityRow(
        method=method.name,
        bits_per_element=method.bits_per_element(head_dim),
        bytes_per_token_per_head=method.bytes_per_token_per_head(head_dim),
        perplexity=math.exp(mean_nll),
        delta_pct=100.0 * (ratio - 1.0),
        # d(exp(x))/dx = exp(x): first-order error propagation of the mean NLL difference
        delta_se_pct=100.0 * ratio * diff_se,
        kl=kl,
        kl_se=kl_se,
        top1=top1,
        top1_se=top1_se,
        chunk_nll=[c.nll for c in chunks],
    )


def evaluate_perplexity(
    model: Any,
    chunks: Sequence[Sequence[int]],
    methods: Sequence[Method],
    *,
    head_dim: int,
    reference: str = "bf16",
    block_size: int = 128,
    exact_first_block: bool = True,
    sink_tokens: int | None = None,
    sink_requantize: bool = False,
    recent_blocks: int = 0,
    suite: str = "text",
    source: str = "",
    scored_from: Sequence[int] | None = None,
    advance: Callable[[str], None] | None = None,
) -> PerplexityResult:
    """Run every method on every chunk under pseudo-decode and compare with ``reference``.

    Args:
        model: a causal LM prepared with :func:`~kvarn_eval.accuracy.pseudo_decode.install`.
        chunks: token id lists, all of one length ``T``.
        methods: the methods; ``reference`` must name one of them.
        head_dim: the model's head dimension (for bits per element).
        block_size: pseudo-decode block (tile) size.
        exact_first_block: keep the first block exact.
        sink_tokens: keys ``[0, S)`` read exact by every query (``None``: the whole first block
            with ``exact_first_block``, else none); see :class:`PseudoDecodeConfig`.
        sink_requantize: quantize block 0 without its sink tokens (copies of token ``S``).
        recent_blocks: complete blocks before a query's own that it reads exact.
        scored_from: per chunk, the index of its first scored token (the tokens before it are
            context: predicted by nothing scored); chunks may then differ in length. ``None``:
            every token after the first, all chunks of one length.
        advance: called with the method name after each forward pass (progress bars).
    """
    import time

    names = [m.name for m in methods]
    if reference not in names:
        raise ValueError(f"reference {reference!r} must be one of the methods {names}")
    if not chunks:
        raise ValueError("no chunks to score")
    tail = scored_from is not None
    if scored_from is None:
        lengths = {len(c) for c in chunks}
        if len(lengths) != 1 or min(lengths) < 2:
            raise ValueError(f"chunks must share one length >= 2, got lengths {sorted(lengths)}")
        scored_from = [1] * len(chunks)
    elif len(scored_from) != len(chunks):
        raise ValueError(f"one scored_from per chunk: {len(scored_from)} for {len(chunks)}")
    for i, (chunk, first) in enumerate(zip(chunks, scored_from, strict=True)):
        if not 1 <= first < len(chunk):
            raise ValueError(
                f"chunk {i}: scored_from {first} leaves no scored token after a context "
                f"(length {len(chunk)})"
            )
    ordered = sorted(methods, key=lambda m: m.name != reference)
    configs = {
        m.name: PseudoDecodeConfig(
            m, block_size, exact_first_block, sink_tokens, sink_requantize, recent_blocks
        )
        for m in ordered
    }
    scores: dict[str, list[ChunkScores]] = {m.name: [] for m in ordered}
    start = time.perf_counter()
    with torch.inference_mode():
        for chunk, first in zip(chunks, scored_from, strict=True):
            ids = torch.tensor([list(chunk)], dtype=torch.long)
            targets = ids[0, first:]
            keep = len(chunk) - first + 1  # the positions predicting tokens first..T-1, and T's
            ref: ReferenceDistribution | None = None
            for method in ordered:
                with pseudo_decode(configs[method.name]):
                    out = model(input_ids=ids, use_cache=False, logits_to_keep=keep)
                    logits = out.logits[0, :-1]
                score, made = compare_logits(logits, ref, targets)
                if ref is None:
                    ref = made
                del out, logits, made
                scores[method.name].append(score)
                if advance is not None:
                    advance(method.name)
    ref_scores = scores[reference]
    rows = [_summarize(m, head_dim, scores[m.name], ref_scores) for m in methods]
    scored = context = fraction = 0.0
    if tail:
        from kvarn_eval.accuracy.tasks import quantized_fraction

        sink = configs[reference].sink
        positions = [  # the positions whose predictions are scored
            p for chunk, first in zip(chunks, scored_from, strict=True)
            for p in range(first - 1, len(chunk) - 1)
        ]  # fmt: skip
        scored = len(positions) / len(chunks)
        context = sum(scored_from) / len(chunks)
        fraction = sum(
            quantized_fraction(p, block_size, True, sink, recent_blocks) for p in positions
        ) / len(positions)
    return PerplexityResult(
        suite=suite,
        source=source,
        reference=reference,
        num_chunks=len(chunks),
        chunk_len=max(len(c) for c in chunks),
        block_size=block_size,
        exact_first_block=exact_first_block,
        head_dim=head_dim,
        rows=rows,
        sink_tokens=configs[reference].sink,
        sink_requantize=sink_requantize,
        recent_blocks=recent_blocks,
        seconds=time.perf_counter() - start,
        mean_scored_tokens=scored,
        mean_context_tokens=context,
        mean_quantized_fraction=fraction,
    )
