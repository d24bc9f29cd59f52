"""Task accuracy by log-likelihood scoring over a quantized context.

Pseudo-decode only quantizes blocks *before* the one being read, so a prompt shorter than two
blocks never touches the quantized cache. The item's own prompt is therefore preceded by other
items of the same task, each written with its correct answer, separated by blank lines, until the
context holds at least ``min_context_tokens`` tokens (a k-shot prompt filled to length). Shots are
taken deterministically from the items that follow in the file, never the item itself nor an item
of its group (Winogrande's twin sentences). The result records how much of the context the scored
tokens read quantized.

* ``multiple_choice`` (ARC-Easy, HellaSwag, PIQA, Winogrande, MMLU): every continuation is scored
  by its summed log-probability; ``acc`` picks the largest sum, ``acc_per_char`` the largest sum
  per character (oe-eval's primary metric for HellaSwag and PIQA, and the ``len_norm`` of
  ai2-olmo-eval's MMLU task). Winogrande uses partial scoring: each option fills the blank in its
  own context and the shared rest of the sentence is scored (``acc``, as oe-eval's ``acc_raw``).
* ``last_word`` (LAMBADA): correct when every token of the target word is the greedy prediction.

Continuations of one context are scored from one pass over it (its KV cache copied per choice);
per-choice contexts (Winogrande) and single continuations go as one right-padded batch.

Noise: the standard error of an accuracy over ``n`` items is ``sqrt(p (1 - p) / n)``; the
agreement of each method's predictions with the reference's, item by item, is reported too, and
is far less noisy than the difference of two accuracies.
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
from kvarn_eval.accuracy.summary import MethodRows, agreement, binomial_se, mean_and_se
from kvarn_eval.data import TaskItem

__all__ = [
    "PreparedItem",
    "TaskRow",
    "TaskResult",
    "build_prompt",
    "prepare_items",
    "evaluate_task",
    "quantized_fraction",
]

SHOT_SEPARATOR = "\n\n"


def _shots(
    items: Sequence[TaskItem],
    index: int,
    min_context_tokens: int,
    count_tokens: Callable[[str], int],
    max_shots: int,
) -> list[str]:
    """Solved shots for ``items[index]`` (see :func:`build_prompt`)."""
    item = items[index]
    # the first choice's prompt, so that the gold answer decides nothing about the context
    own = item.prompts()[0]
    shots: list[str] = []
    for step in range(1, len(items)):
        if len(shots) >= max_shots:
            break
        if count_tokens(SHOT_SEPARATOR.join([*shots, own])) >= min_context_tokens:
            break
        shot = items[(index + step) % len(items)]
        if item.group and shot.group == item.group:
            continue
        shots.append(shot.query + shot.choices[shot.gold])
    return shots


def build_prompt(
    items: Sequence[TaskItem],
    index: int,
    min_context_tokens: int,
    count_tokens: Callable[[str], int],
    max_shots: int = 64,
) -> tuple[str, int]:
    """Prompt for ``items[index]`` filled with solved shots to ``min_context_tokens``.

    Returns the prompt and the number of shots. Shots are ``items[index + 1]``, ``index + 2``, ...
    (wrapping around, skipping items of the same group), each as ``query + gold continuation``,
    placed before the item's query.
    """
    shots = _shots(items, index, min_context_tokens, count_tokens, max_shots)
    return SHOT_SEPARATOR.join([*shots, items[index].query]), len(shots)


@dataclass(frozen=True)
class PreparedItem:
    """Token ids of one item: the shared context and each continuation.

    ``contexts`` holds one context per continuation when they differ (Winogrande); ``context``
    is then the first choice's.
    """

    context: tuple[int, ...]
    continuations: tuple[tuple[int, ...], ...]
    choice_chars: tuple[int, ...]
    gold: int
    shots: int
    contexts: tuple[tuple[int, ...], ...] = ()

    def choice_contexts(self) -> tuple[tuple[int, ...], ...]:
        """The context each continuation follows."""
        return self.contexts or (self.context,) * len(self.continuations)


def prepare_items(
    items: Sequence[TaskItem],
    count: int,
    tokenizer: Any,
    min_context_tokens: int,
    max_tokens: int | None = None,
    start: int = 0,
) -> list[PreparedItem]:
    """Tokenize ``count`` items from index ``start`` on, with their filled prompts.

    Shots come from the whole of ``items``, so item ``k`` gets the same prompt whatever
    ``start`` is: runs over consecutive ranges pool into one longer run.
    ``max_tokens`` drops the oldest context tokens so that context plus the longest continuation
    fits (the model's context length).
    """
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")

    def encode(text: str, special: bool) -> list[int]:
        return list(tokenizer(text, add_special_tokens=special)["input_ids"])

    prepared = []
    for index in range(start, min(start + count, len(items))):
        item = items[index]
        shots = _shots(items, index, min_context_tokens, lambda s: len(encode(s, False)), 64)
        contexts = [
            encode(SHOT_SEPARATOR.join([*shots, prompt]), True) for prompt in item.prompts()
        ]
        continuations = tuple(tuple(encode(c, False)) for c in item.choices)
        if any(not c for c in continuations):
            raise ValueError(f"item {item.doc_id} has an empty continuation")
        if max_tokens is not None:
            room = max_tokens - max(len(c) for c in continuations)
            contexts = [context[-room:] for context in contexts]
        prepared.append(
            PreparedItem(
                context=tuple(contexts[0]),
                continuations=continuations,
                choice_chars=tuple(len(c) for c in item.choices),
                gold=item.gold,
                shots=len(shots),
                contexts=tuple(tuple(c) for c in contexts) if item.contexts else (),
            )
        )
    return prepared


def quantized_fraction(
    position: int,
    block_size: int,
    exact_first_block: bool,
    sink_tokens: int | None = None,
    recent_blocks: int = 0,
) -> float:
    """Share of the keys ``0..position`` that the query at ``position`` reads quantized.

    Keys ``[0, S)`` are exact: ``S = sink_tokens`` when given, else ``block_size`` with
    ``exact_first_block`` and 0 without; so are the query's own block and the
    ``recent_blocks`` before it.
    """
    exact_from = max(0, (position // block_size - recent_blocks) * block_size)
    if sink_tokens is None:
        sink_tokens = block_size if exact_first_block else 0
    quantized = max(0, exact_from - sink_tokens)
    return quantized / (position + 1)


def _score_item(model: Any, item: PreparedItem, pad_id: int) -> tuple[list[float], list[bool]]:
    """Summed log-probability of each continuation and whether it is the greedy one: choices
    that follow one context share its pass (:func:`_score_shared`), others go side by side
    (:func:`_score_batch`)."""
    if len(item.continuations) > 1 and not item.contexts:
        return _score_shared(model, item, pad_id)
    return _score_batch(model, item, pad_id)


def _continuation_scores(logprobs: torch.Tensor, continuation: Sequence[int]) -> tuple[float, bool]:
    """Summed log-probability of ``continuation`` under ``logprobs`` (one row per token, each
    predicting it) and whether every token is the greedy one."""
    target = torch.tensor(continuation)
    lp = logprobs.gather(-1, target[:, None]).sum()
    return float(lp), bool((logprobs.argmax(-1) == target).all())


def _score_shared(model: Any, item: PreparedItem, pad_id: int) -> tuple[list[float], list[bool]]:
    """:func:`_score_batch` for continuations of one context, 3-4x faster: the context runs
    once, as one row, into an exact KV cache; then every continuation, right-padded, runs from
    copies of that cache. Cached decoding under pseudo-decode equals recomputing the sequence
    (the greedy suite's property), so the scores are :func:`_score_batch`'s up to float rounding
    (a test checks it)."""
    conts = item.continuations
    with decoding() as memo:
        cache = exact_cache()
        passes_cache = with_cache(model, cache)
        out = model(
            input_ids=torch.tensor([item.context]),
            use_cache=True,
            logits_to_keep=1,
            **passes_cache,
        )
        first = torch.log_softmax(out.logits[0, -1].float(), dim=-1)  # predicts each cont[0]
        rest = None
        width = max(len(c) for c in conts) - 1  # the last token of each is predicted, not fed
        if width > 0:
            memo.repeat_row(len(conts))
            cache.batch_repeat_interleave(len(conts))
            ids = torch.full((len(conts), width), pad_id, dtype=torch.long)
            for i, cont in enumerate(conts):
                ids[i, : len(cont) - 1] = torch.tensor(cont[:-1])
            logits = model(input_ids=ids, use_cache=True, **passes_cache).logits
            rest = torch.log_softmax(logits.float(), dim=-1)
    sums, greedy = [], []
    for i, cont in enumerate(conts):
        rows = [first[None]]
        if rest is not None:
            rows.append(rest[i, : len(cont) - 1])
        total, top = _continuation_scores(torch.cat(rows), cont)
        sums.append(total)
        greedy.append(top)
    return sums, greedy


def _score_batch(model: Any, item: PreparedItem, pad_id: int) -> tuple[list[float], list[bool]]:
    """Summed log-probability of each continuation and whether it is the greedy one, every
    continuation after its context in one right-padded batch."""
    contexts = item.choice_contexts()
    rows = [list(ctx) + list(c) for ctx, c in zip(contexts, item.continuations, strict=True)]
    width = max(len(r) for r in rows)
    # right padding: with causal attention the pads never reach the scored positions
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    start = min(len(ctx) for ctx in contexts)
    # logits only where continuations are predicted: positions start - 1 .. width - 1
    keep = width - start + 1
    logits = model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    sums, greedy = [], []
    for i, cont in enumerate(item.continuations):
        positions = torch.arange(len(cont)) + (len(contexts[i]) - start)
        total, top = _continuation_scores(logprobs[i, positions], cont)
        sums.append(total)
        greedy.append(top)
    return sums, greedy


@dataclass
class TaskRow:
    """One method on one task.

    Attributes:
        method: method name.
        bits_per_element: stored bits per K or V element.
        accuracy: the task's primary accuracy.
        accuracy_se: binomial standard error of ``accuracy``.
        agreement: fraction of items whose prediction equals the reference's.
        accuracy_raw: multiple choice: argmax of summed log-probability (LAMBADA: same as
            ``accuracy``).
        accuracy_per_char: multiple choice: argmax of log-probability per character.
        predictions: predicted choice per item (LAMBADA: 1 correct, 0 wrong).
        change: ``accuracy`` minus the reference's (0 for the reference itself).
        change_se: standard error of ``change``, paired item by item: the standard error of
            the mean of (this method right) - (the reference right) over the items. Only the
            items where one of the two is right and the other wrong count, so it is far
            smaller than ``accuracy_se`` when the two mostly agree: a change within about two
            of it is what the items cannot tell from none (``nan`` for a single item).
    """

    method: str
    bits_per_element: float
    accuracy: float
    accuracy_se: float
    agreement: float
    accuracy_raw: float
    accuracy_per_char: float
    predictions: list[int] = field(default_factory=list)
    change: float = 0.0
    change_se: float = 0.0


@dataclass
class TaskResult(MethodRows):
    """A task suite's outcome, JSON-ready through :meth:`to_dict`.

    ``first_item`` is the index of the first item scored (``--first-item``), ``golds`` the
    right answer per item (LAMBADA: 1, its predictions being right or wrong): what
    :mod:`kvarn_eval.accuracy.pool` needs to pool runs over consecutive item ranges.
    """

    KIND_KEY = "kind_of_result"  # ``kind`` is a field (multiple_choice, last_word)
    KIND = "task"

    suite: str
    kind: str
    primary_metric: str
    reference: str
    num_items: int
    mean_context_tokens: float
    mean_shots: float
    mean_quantized_fraction: float
    block_size: int
    exact_first_block: bool
    rows: list[TaskRow]
    sink_tokens: int = 0
    sink_requantize: bool = False
    recent_blocks: int = 0
    skipped: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    first_item: int = 0
    golds: list[int] = field(default_factory=list)


# oe-eval's primary metric of each request file (winogrande: acc_raw); MMLU: the len_norm of
# ai2-olmo-eval's MMLU task
PRIMARY_METRIC = {
    "arc_easy": "acc",
    "hellaswag": "acc_per_char",
    "piqa": "acc_per_char",
    "winogrande": "acc",
    "mmlu": "acc_per_char",
}


def evaluate_task(
    model: Any,
    suite: str,
    kind: str,
    items: Sequence[PreparedItem],
    methods: Sequence[Method],
    *,
    head_dim: int,
    pad_id: int,
    reference: str = "bf16",
    block_size: int = 128,
    exact_first_block: bool = True,
    sink_tokens: int | None = None,
    sink_requantize: bool = False,
    recent_blocks: int = 0,
    advance: Callable[[str], None] | None = None,
) -> TaskResult:
    """Score ``items`` with every method under pseudo-decode.

    ``block_size``, ``exact_first_block``, ``sink_tokens``, ``sink_requantize`` and
    ``recent_blocks`` are those of :class:`PseudoDecodeConfig`.
    """
    names = [m.name for m in methods]
    if reference not in names:
        raise ValueError(f"reference {reference!r} must be one of the methods {names}")
    if kind not in ("multiple_choice", "last_word"):
        raise ValueError(f"kind must be 'multiple_choice' or 'last_word', got {kind!r}")
    if not items:
        raise ValueError(f"task {suite!r}: no items to score")
    raw: dict[str, list[int]] = {m.name: [] for m in methods}
    per_char: dict[str, list[int]] = {m.name: [] for m in methods}
    sink = PseudoDecodeConfig(None, block_size, exact_first_block, sink_tokens).sink
    start = time.perf_counter()
    with torch.inference_mode():
        for item in items:
            for method in methods:
                config = PseudoDecodeConfig(
                    method, block_size, exact_first_block, sink, sink_requantize, recent_blocks
                )
                with pseudo_decode(config):
                    sums, greedy = _score_item(model, item, pad_id)
                if kind == "last_word":
                    raw[method.name].append(int(greedy[0]))
                    per_char[method.name].append(int(greedy[0]))
                else:
                    raw[method.name].append(max(range(len(sums)), key=sums.__getitem__))
                    norm = [s / max(1, n) for s, n in zip(sums, item.choice_chars, strict=True)]
                    per_char[method.name].append(max(range(len(norm)), key=norm.__getitem__))
                if advance is not None:
                    advance(method.name)
    metric = "acc" if kind == "last_word" else PRIMARY_METRIC.get(suite, "acc")
    primary = per_char if metric == "acc_per_char" else raw
    golds = [1 if kind == "last_word" else it.gold for it in items]
    rows = []
    ref = primary[reference]
    ref_right = [int(p == g) for p, g in zip(ref, golds, strict=True)]
    for method in methods:
        preds = primary[method.name]
        right = [int(p == g) for p, g in zip(preds, golds, strict=True)]
        acc = sum(right) / len(items)
        change, change_se = mean_and_se([a - b for a, b in zip(right, ref_right, strict=True)])
        rows.append(
            TaskRow(
                method=method.name,
                bits_per_element=method.bits_per_element(head_dim),
                accuracy=acc,
                accuracy_se=binomial_se(acc, len(items)),
                agreement=agreement(preds, ref),
                accuracy_raw=sum(p == g for p, g in zip(raw[method.name], golds, strict=True))
                / len(items),
                accuracy_per_char=sum(
                    p == g for p, g in zip(per_char[method.name], golds, strict=True)
                )
                / len(items),
                predictions=preds,
                change=change,
                change_se=change_se,
            )
        )
    context_lengths = [len(it.context) for it in items]
    fractions = [
        quantized_fraction(n - 1, block_size, True, sink, recent_blocks) for n in context_lengths
    ]
    return TaskResult(
        suite=suite,
        kind=kind,
        primary_metric=metric,
        reference=reference,
        num_items=len(items),
        mean_context_tokens=sum(context_lengths) / len(items),
        mean_shots=sum(it.shots for it in items) / len(items),
        mean_quantized_fraction=sum(fractions) / len(items),
        block_size=block_size,
        exact_first_block=exact_first_block,
        rows=rows,
        sink_tokens=sink,
        sink_requantize=sink_requantize,
        recent_blocks=recent_blocks,
        seconds=time.perf_counter() - start,
        golds=golds,
    )
