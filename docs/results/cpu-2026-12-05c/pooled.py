"""Pooled task changes from kvarn-eval results: each method against bf16 and kvarn_k2v2_g128
against KIVI-2, paired item by item over every item of the three tasks, and how many first-run
predictions a later run repeats.

    python pooled.py smollm2/results.json [../cpu-2026-12-05b/smollm2/results.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvarn_eval.accuracy.summary import mean_and_se
from kvarn_eval.data import load_task


def rights(path: str) -> tuple[dict[str, dict[str, list[int]]], dict[str, list[int]]]:
    """Per task: each method's right (1) or wrong (0) per item; and the golds."""
    out: dict[str, dict[str, list[int]]] = {}
    golds: dict[str, list[int]] = {}
    for result in json.loads(Path(path).read_text())["results"]:
        task, n = result["suite"], result["num_items"]
        golds[task] = [it.gold for it in load_task(task)[:n]]
        out[task] = {
            row["method"]: [int(p == g) for p, g in zip(row["predictions"], golds[task])]
            for row in result["rows"]
        }
    return out, golds


def predictions(path: str) -> dict[tuple[str, str], list[int]]:
    return {
        (r["suite"], row["method"]): row["predictions"]
        for r in json.loads(Path(path).read_text())["results"]
        for row in r["rows"]
    }


def main() -> None:
    right, _ = rights(sys.argv[1])
    tasks = list(right)
    methods = list(right[tasks[0]])

    def pooled(a: str, b: str) -> tuple[float, float, float]:
        diff = [x - y for t in tasks for x, y in zip(right[t][a], right[t][b])]
        same = [x == y for t in tasks for x, y in zip(right[t][a], right[t][b])]
        mean, se = mean_and_se(diff)
        return 100 * mean, 100 * se, 100 * sum(same) / len(same)

    n = sum(len(right[t]["bf16"]) for t in tasks)
    print(f"{sys.argv[1]}: {n} items over {', '.join(tasks)}")
    for m in methods:
        if m != "bf16":
            mean, se, same = pooled(m, "bf16")
            print(
                f"  {m} - bf16: {mean:+.2f} ± {se:.2f} points (right/wrong the same on {same:.1f}%)"
            )
    if {"kvarn_k2v2_g128", "kivi_k2v2"} <= set(methods):
        mean, se, same = pooled("kvarn_k2v2_g128", "kivi_k2v2")
        print(f"  kvarn_k2v2_g128 - kivi_k2v2: {mean:+.2f} ± {se:.2f} points")
    if len(sys.argv) > 2:
        new, old = predictions(sys.argv[1]), predictions(sys.argv[2])
        for key in sorted(set(new) & set(old)):
            k = len(old[key])
            equal = sum(a == b for a, b in zip(new[key][:k], old[key]))
            print(f"  {key[0]} {key[1]}: first {k} predictions equal to the earlier run's: {equal}")


if __name__ == "__main__":
    main()
