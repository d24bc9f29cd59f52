"""Greedy-generation fidelity: how closely one run's greedy tokens follow a reference run's.

Shared by the CPU suite (transformers under pseudo-decode) and the GPU suite (vLLM with the real
kernels): the same metrics and the same fixed prompt set, so the two can be read side by side.
Pure Python, no dependencies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["SHARED_PREAMBLE", "compare_outputs", "longest_common_prefix", "make_prompts"]


def longest_common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens equal from the start of ``a`` and ``b`` until the first difference.

    Args:
        a: token ids of one output.
        b: token ids of the other.
    """
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare_outputs(
    reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]
) -> dict[str, Any]:
    """Greedy-output agreement of ``other`` against ``reference`` (same prompts, same order).

    Args:
        reference: generated token ids per prompt of the reference run.
        other: generated token ids per prompt of the compared run.

    Returns:
        ``num_prompts``; ``exact_match`` (fraction of identical outputs); ``mean_lcp`` and
        ``median_lcp`` (tokens); ``mean_lcp_fraction`` (LCP over the reference length);
        ``token_agreement`` (equal tokens at equal positions over all reference tokens);
        ``first_token_agreement`` (the token decided by the prompt alone);
        ``first_divergence`` (mean position of the first difference, over diverging prompts,
        ``None`` when none diverges).

    Raises:
        ValueError: different numbers of outputs, or none.
    """
    if len(reference) != len(other):
        raise ValueError(
            f"need one output per prompt in both runs, got {len(reference)} and {len(other)}"
        )
    if not reference:
        raise ValueError("no outputs to compare")
    lcps: list[int] = []
    fractions: list[float] = []
    same = total = exact = first = 0
    diverged: list[int] = []
    for ref, out in zip(reference, other):
        ref, out = list(ref), list(out)
        lcp = longest_common_prefix(ref, out)
        lcps.append(lcp)
        fractions.append(lcp / len(ref) if ref else 1.0)
        same += sum(1 for x, y in zip(ref, out) if x == y)
        total += len(ref)
        first += ref[:1] == out[:1]
        if ref == out:
            exact += 1
        else:
            diverged.append(lcp)
    ordered = sorted(lcps)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return {
        "num_prompts": len(reference),
        "exact_match": exact / len(reference),
        "mean_lcp": sum(lcps) / len(lcps),
        "median_lcp": median,
        "mean_lcp_fraction": sum(fractions) / len(fractions),
        "token_agreement": same / total if total else 1.0,
        "first_token_agreement": first / len(reference),
        "first_divergence": sum(diverged) / len(diverged) if diverged else None,
    }


_TOPICS = [
    "the water cycle",
    "photosynthesis",
    "the French Revolution",
    "binary search",
    "black holes",
    "the immune system",
    "supply and demand",
    "plate tectonics",
    "the Roman Empire",
    "neural networks",
    "climate change",
    "the printing press",
    "vaccines",
    "prime numbers",
    "the stock market",
    "volcanoes",
    "the Renaissance",
    "electric cars",
    "the human heart",
    "compilers",
    "honey bees",
    "the Moon landing",
    "recycling",
    "jazz music",
    "the Great Wall of China",
]
_TEMPLATES = [
    "Explain {t} to a ten-year-old.",
    "Write three short facts about {t}.",
    "What is the most surprising thing about {t}? Answer in two sentences.",
    "Give a one-paragraph history of {t}.",
]
SHARED_PREAMBLE = (
    "You are a careful assistant who answers clearly and precisely. Keep answers short, "
    "use plain words, avoid jargon unless it is explained, and prefer concrete examples "
    "over abstract statements. If a question is ambiguous, state the most likely reading "
    "and answer it. Never invent sources. Use complete sentences. When listing facts, "
    "number them. When explaining a process, describe its steps in order. When comparing "
    "things, say how they are alike before saying how they differ. Finish every answer "
    "with a single sentence that sums it up. "
) * 2


def make_prompts(n: int) -> list[str]:
    """``n`` distinct, deterministic prompts (the fixed prompt set of greedy comparisons).

    Every other prompt starts with a shared ~300-token preamble, so that prefix caching has
    full tiles to reuse and quantized tiles are read by the question's tokens.

    Args:
        n: number of prompts (>= 1).

    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    prompts: list[str] = []
    i = 0
    while len(prompts) < n:
        topic = _TOPICS[i % len(_TOPICS)]
        question = _TEMPLATES[(i // len(_TOPICS)) % len(_TEMPLATES)].format(t=topic)
        if i >= len(_TOPICS) * len(_TEMPLATES):
            question = f"{question} (variant {i})"
        prompts.append(SHARED_PREAMBLE + question if i % 2 else question)
        i += 1
    return prompts
