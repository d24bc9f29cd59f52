"""Task changes pooled over every item of the three tasks, paired item by item: each method
against bf16, and kvarn_k2v2_g128 against KIVI-2, in right answers and in agreement with bf16's
answer. Reads ``results.json`` files of ``kvarn-eval bench`` or ``kvarn-eval report`` (which
pools runs over consecutive item ranges into one); given several (one per model, the same
items), also the k2v2-KIVI-2 differences averaged over the models item by item, with the items
as the sampling unit.

    python pooled.py smollm2-pooled/results.json gemma3-pooled/results.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvarn_eval.accuracy.pool import item_range, stored_golds
from kvarn_eval.accuracy.summary import mean_and_se

A, B = "kvarn_k2v2_g128", "kivi_k2v2"


def per_item(path: str) -> tuple[dict[tuple[str, int], dict[str, int]], list[str]]:
    """Per (task, item): each method's right (``<method>``: 1 or 0) and whether it gave bf16's
    answer (``<method>=bf16``: 1 or 0); and the methods."""
    out: dict[tuple[str, int], dict[str, int]] = {}
    methods: list[str] = []
    for result in json.loads(Path(path).read_text())["results"]:
        if result.get("kind_of_result") != "task":
            continue
        first, end = item_range(result)
        print(f"  {result['suite']}: items [{first}, {end})")
        golds = stored_golds(result)
        preds = {row["method"]: row["predictions"] for row in result["rows"]}
        methods = list(preds)
        for k, gold in enumerate(golds):
            out[result["suite"], first + k] = {
                **{m: int(p[k] == gold) for m, p in preds.items()},
                **{f"{m}=bf16": int(p[k] == preds["bf16"][k]) for m, p in preds.items()},
            }
    return out, methods


def show(label: str, diff: list[float]) -> None:
    mean, se = mean_and_se(diff)
    print(f"  {label}: {100 * mean:+.2f} ± {100 * se:.2f} points")


def main() -> None:
    runs = []
    for path in sys.argv[1:]:
        print(path)
        items, methods = per_item(path)
        runs.append(items)
        print(f"  {len(items)} items")
        for m in methods:
            if m != "bf16":
                same = sum(v[m] == v["bf16"] for v in items.values()) / len(items)
                show(
                    f"{m} - bf16 (right/wrong the same on {100 * same:.1f}%)",
                    [v[m] - v["bf16"] for v in items.values()],
                )
        if {A, B} <= set(methods):
            show(f"{A} - {B}", [v[A] - v[B] for v in items.values()])
            agree = [sum(v[f"{m}=bf16"] for v in items.values()) / len(items) for m in (A, B)]
            show(
                f"agreement with bf16's answer, {A} - {B} ({100 * agree[0]:.1f}% and "
                f"{100 * agree[1]:.1f}%)",
                [v[f"{A}=bf16"] - v[f"{B}=bf16"] for v in items.values()],
            )
    if len(runs) > 1:
        keys = sorted(set.intersection(*(set(r) for r in runs)))
        print(f"averaged over the {len(runs)} runs item by item ({len(keys)} items in all):")
        for label, a, b in (
            (f"{A} - {B}", A, B),
            ("agreement with bf16", f"{A}=bf16", f"{B}=bf16"),
        ):
            show(label, [sum(r[k][a] - r[k][b] for r in runs) / len(runs) for k in keys])


if __name__ == "__main__":
    main()
