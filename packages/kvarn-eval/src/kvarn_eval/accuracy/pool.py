"""Task results over consecutive item ranges, pooled into one.

``kvarn-eval bench --first-item N`` scores a task's items from index ``N`` on, each with the
prompt a longer run gives it, so a run of items ``[0, N)`` and one of ``[N, M)`` (same model,
methods and pseudo-decode settings) are together exactly one run of ``[0, M)``.
:func:`pool_task_results` rebuilds that run's rows from the per-item predictions: accuracies,
paired standard errors and agreement over all the items, not averages of the parts'.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvarn_eval.accuracy.summary import agreement, binomial_se, mean_and_se
from kvarn_eval.models import MissingDependencyError

# what must be equal for two task results to be one run over more items
SAME_SETTINGS = (
    "suite",
    "kind",
    "primary_metric",
    "reference",
    "block_size",
    "exact_first_block",
    "sink_tokens",
    "sink_requantize",
    "recent_blocks",
)


def item_range(result: Mapping[str, Any]) -> tuple[int, int]:
    """``(first, end)``: the items ``[first, end)`` a task result scored."""
    first = int(result.get("first_item", 0))
    return first, first + int(result["num_items"])


def pool_task_results(
    parts: Sequence[Mapping[str, Any]], golds: Sequence[Sequence[int]]
) -> dict[str, Any]:
    """One task result over the items of ``parts``, whose ranges follow one another.

    Args:
        parts: task results (``TaskResult.to_dict()``), in item order, each over the items
            right after the previous one's.
        golds: each part's right answer per item (LAMBADA: 1 per item, its predictions being
            right or wrong).

    Raises:
        ValueError: the parts differ in a setting or in their methods, leave a gap or overlap,
            or a part's golds do not match its items; the message names which.
    """
    if not parts:
        raise ValueError("no task results to pool")
    first = parts[0]
    for part, gold in zip(parts, golds, strict=True):
        for key in SAME_SETTINGS:
            if part.get(key) != first.get(key):
                raise ValueError(
                    f"{first['suite']}: {key} differs ({first.get(key)!r} and {part.get(key)!r})"
                )
        methods = [r["method"] for r in part["rows"]]
        if methods != [r["method"] for r in first["rows"]]:
            raise ValueError(f"{first['suite']}: the methods differ ({methods} and the first's)")
        if len(gold) != part["num_items"]:
            raise ValueError(f"{first['suite']}: {len(gold)} golds for {part['num_items']} items")
    for before, after in itertools.pairwise(parts):
        a, b = item_range(before), item_range(after)
        if a[1] != b[0]:
            raise ValueError(
                f"{first['suite']}: items [{a[0]}, {a[1]}) and [{b[0]}, {b[1]}) do not follow "
                "one another"
            )
    all_golds = [g for gold in golds for g in gold]
    n = len(all_golds)

    sizes = [int(p["num_items"]) for p in parts]
    by_method = [{r["method"]: r for r in p["rows"]} for p in parts]  # per part

    def weighted(values: Sequence[float]) -> float:
        return sum(v * size for v, size in zip(values, sizes, strict=True)) / n

    def joined(method: str) -> list[int]:
        return [x for part_rows in by_method for x in part_rows[method]["predictions"]]

    def right(preds: Sequence[int]) -> list[int]:
        return [int(p == g) for p, g in zip(preds, all_golds, strict=True)]

    ref_preds = joined(first["reference"])
    ref_right = right(ref_preds)
    rows = []
    for row in first["rows"]:
        method = row["method"]
        preds = joined(method)
        rights = right(preds)
        acc = sum(rights) / n
        change, change_se = mean_and_se([a - b for a, b in zip(rights, ref_right, strict=True)])
        rows.append(
            {
                **row,
                "accuracy": acc,
                "accuracy_se": binomial_se(acc, n),
                "agreement": agreement(preds, ref_preds),
                "accuracy_raw": weighted([r[method]["accuracy_raw"] for r in by_method]),
                "accuracy_per_char": weighted([r[method]["accuracy_per_char"] for r in by_method]),
                "predictions": preds,
                "change": change,
                "change_se": change_se,
            }
        )
    pooled = {
        **first,
        "num_items": n,
        "first_item": item_range(first)[0],
        "mean_context_tokens": weighted([p["mean_context_tokens"] for p in parts]),
        "mean_shots": weighted([p["mean_shots"] for p in parts]),
        "mean_quantized_fraction": weighted([p["mean_quantized_fraction"] for p in parts]),
        "rows": rows,
        "golds": list(all_golds),
        "skipped": {k: v for p in parts for k, v in (p.get("skipped") or {}).items()},
        "seconds": sum(float(p.get("seconds", 0.0)) for p in parts),
    }
    if any("subjects" in p for p in parts):
        subjects: dict[str, int] = {}
        for p in parts:
            for s, count in (p.get("subjects") or {}).items():
                subjects[s] = subjects.get(s, 0) + count
        pooled["subjects"] = subjects
    if any("source" in p for p in parts):
        pooled["source"] = ", ".join(str(p["source"]) for p in parts if "source" in p)
    return pooled


def stored_golds(result: Mapping[str, Any]) -> list[int]:
    """A task result's right answer per item: stored with it since 2026-12-05; before that,
    LAMBADA's are 1 and the others' are read from the task's data (not MMLU's, whose items
    depend on ``--mmlu-subjects``)."""
    if result.get("golds"):
        return [int(g) for g in result["golds"]]
    first, end = item_range(result)
    if result.get("kind") == "last_word":
        return [1] * (end - first)
    suite = str(result["suite"])
    if suite == "mmlu":
        raise ValueError("stored without its right answers, which depend on --mmlu-subjects")
    from kvarn_eval.data import load_task

    items = load_task(suite)
    if end > len(items):
        raise ValueError(f"items up to {end} stored, but the task has {len(items)}")
    return [it.gold for it in items[first:end]]


def pool_item_ranges(
    results: Sequence[dict[str, Any]],
    golds_of: Callable[[Mapping[str, Any]], Sequence[int]] = stored_golds,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Task results of one model, task and settings over consecutive item ranges, pooled.

    Args:
        results: results of any suites (``model`` names a result's model where known).
        golds_of: a task result's right answer per item; raises ``ValueError``,
            ``FileNotFoundError`` or ``MissingDependencyError`` when they cannot be had.

    Returns:
        The results, each group of task results that pooled replaced by the pooled one where
        its first was; and a line per group saying what was pooled, or why not.
    """
    groups: dict[tuple[Any, ...], list[int]] = {}
    for index, result in enumerate(results):
        if result.get("kind_of_result") == "task":
            key = (result.get("model"), *(repr(result.get(k)) for k in SAME_SETTINGS))
            groups.setdefault(key, []).append(index)
    out: dict[int, dict[str, Any] | None] = dict(enumerate(results))
    notes = []
    for key, indices in groups.items():
        if len(indices) < 2:
            continue
        parts = sorted((results[i] for i in indices), key=item_range)
        name = f"{parts[0]['suite']}" + (f" ({key[0]})" if key[0] else "")
        spans = ", ".join(f"[{a}, {b})" for a, b in map(item_range, parts))
        try:
            pooled = pool_task_results(parts, [golds_of(p) for p in parts])
        except (ValueError, FileNotFoundError, MissingDependencyError) as exc:
            notes.append(f"{name}: items {spans} kept apart: {exc}")
            continue
        notes.append(f"{name}: items {spans} pooled into {pooled['num_items']} items")
        out[indices[0]] = pooled
        for i in indices[1:]:
            out[i] = None
    return [r for r in out.values() if r is not None], notes
