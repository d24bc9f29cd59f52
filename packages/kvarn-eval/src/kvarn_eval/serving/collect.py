"""Rebuild results from bench output folders (``kvarn-eval report``).

A GPU call of ten minutes runs a few engines; a table of every cache and model takes several
calls. Each call's folder keeps one record per engine run under ``runs/<suite>/`` (the worker's
partial result, completed by the parent with status and log facts; the job's ``.spec.json``
beside it). :func:`collect_results` merges the records of several folders into one capacity and
one throughput result, one vLLM-greedy and one vLLM-perplexity result per real model, and keeps
the other suites' results as they are.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvarn_eval.serving.suites import (
    capacity_result,
    greedy_result,
    perplexity_result,
    throughput_result,
)

__all__ = ["collect_results", "load_records"]

_REBUILT = ("capacity", "throughput", "vllm_greedy", "vllm_perplexity")
# Suites on a real model: their runs compare within one model only.
_PER_MODEL = {"vllm_greedy": greedy_result, "vllm_perplexity": perplexity_result}


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def load_records(folder: Path) -> list[dict[str, Any]]:
    """Every run record under ``folder/runs/`` (suites capacity, throughput, vllm_greedy,
    vllm_perplexity).

    A record the parent never completed (the bench itself was killed) is completed from its
    ``.spec.json`` and marked ``interrupted``.

    Args:
        folder: a bench output folder.
    """
    records = []
    for suite in _REBUILT:
        for path in sorted((folder / "runs" / suite).glob("*.json")):
            if path.name.endswith(".spec.json"):
                continue
            record = _read(path)
            if record is None:
                continue
            if "suite" not in record:
                spec = _read(path.with_name(path.name[: -len(".json")] + ".spec.json"))
                if spec is None:
                    continue
                record = {
                    **record,
                    "suite": spec["suite"],
                    "name": spec["name"],
                    "cache": spec["cache"],
                    "meta": spec.get("meta", {}),
                    "workload": {
                        k: v for k, v in spec["workload"].items() if k not in ("prompts", "chunks")
                    },
                    "status": "ok" if record.get("complete") else "interrupted",
                }
            record["source"] = str(folder)
            records.append(record)
    return records


def _key(record: dict[str, Any]) -> tuple[str, str, tuple[int, ...]]:
    """What a record measured: its suite, its run name (model, parallelism, cache; the real
    model for greedy and perplexity runs) and, for throughput, its prompt lengths (two engines
    of one cache, one per prompt length, are two measurements, not a run and its repeat)."""
    lens: tuple[int, ...] = ()
    name = record["name"]
    if record["suite"] == "throughput":
        workload = record.get("workload") or {}
        lens = tuple(
            sorted(int(n) for n in workload.get("prompt_lens") or record.get("bursts") or ())
        )
    elif record["suite"] in _PER_MODEL:
        name = f"{Path(str(record.get('meta', {}).get('model', '?'))).name}/{name}"
    return record["suite"], name, lens


def _merge(records: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """One record per (suite, name, prompt lengths): a later one replaces an earlier one unless
    it is worse.

    Returns:
        The kept records, and one line per record left out (which, from where, kept what),
        so that two runs of the same cache under different settings never collapse silently.
    """
    merged: dict[tuple[str, str, tuple[int, ...]], dict[str, Any]] = {}
    dropped: list[str] = []
    for record in records:
        key = _key(record)
        label = f"{key[0]}/{key[1]}" + (f" ({','.join(map(str, key[2]))})" if key[2] else "")
        old = merged.get(key)
        if old is None or not (old.get("status") == "ok" and record.get("status") != "ok"):
            merged[key] = record
            if old is not None:
                dropped.append(
                    f"{label}: kept the run from {record.get('source')} "
                    f"({record.get('status')}), left out the one from {old.get('source')} "
                    f"({old.get('status')})"
                )
        else:
            dropped.append(
                f"{label}: kept the run from {old.get('source')} (ok), left out the "
                f"one from {record.get('source')} ({record.get('status')})"
            )
    return list(merged.values()), dropped


def collect_results(
    folders: Sequence[Path],
) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """Results of every suite found in ``folders``, GPU run records merged.

    Args:
        folders: bench output folders.

    Returns:
        The results (other suites first, as stored; then capacity, throughput and, per real
        model, vllm_greedy and vllm_perplexity rebuilt from the merged records), the files they came from, and a line per run
        record left out because another folder had the same suite and run name.
    """
    kept: list[dict[str, Any]] = []
    settings: dict[str, dict[str, Any]] = {}
    sources: list[str] = []
    records: list[dict[str, Any]] = []
    for folder in folders:
        stored = _read(folder / "results.json")
        if stored is not None:
            sources.append(str(folder / "results.json"))
            for result in stored.get("results", []):
                if result.get("suite") in _REBUILT:
                    settings.setdefault(result["suite"], result.get("settings", {}))
                else:
                    kept.append({**result, "source": str(folder)})
        found = load_records(folder)
        if found:
            sources.append(str(folder / "runs"))
        records += found
    records, dropped = _merge(records)
    by_suite = {s: [r for r in records if r["suite"] == s] for s in _REBUILT}
    results = list(kept)
    capacity = list(by_suite["capacity"])
    names = {r["name"] for r in capacity}
    for r in by_suite["throughput"]:  # engines the capacity suite did not start: one row each
        if r["name"] not in names:
            names.add(r["name"])
            capacity.append(r)
    if capacity:
        results.append(
            capacity_result(capacity, settings.get("capacity") or settings.get("throughput", {}))
        )
    if by_suite["throughput"]:
        results.append(throughput_result(by_suite["throughput"], settings.get("throughput", {})))
    for suite, build in _PER_MODEL.items():
        models: dict[str, list[dict[str, Any]]] = {}
        for r in by_suite[suite]:
            models.setdefault(str(r.get("meta", {}).get("model")), []).append(r)
        for model, runs in models.items():
            results.append(build(runs, {**settings.get(suite, {}), "model": model}))
    return results, sources, dropped
