"""Rebuild results from bench output folders (``kvarn-eval report``).

A GPU call of ten minutes runs a few engines; a table of every cache and model takes several
calls. Each call's folder keeps one record per engine run under ``runs/<suite>/`` (the worker's
partial result, completed by the parent with status and log facts; the job's ``.spec.json``
beside it). :func:`collect_results` merges the records of several folders into one capacity and
one throughput result, one vLLM-greedy and one vLLM-perplexity result per real model, and keeps
the other suites' results as they are. A folder whose ``runs/`` is gone (the published results
keep only ``results.json``) still counts: its capacity and throughput rows join the tables as
stored, with the ratios computed again over every row.
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
    row_key,
    throughput_result,
)

__all__ = ["collect_results", "load_records"]

_REBUILT = ("capacity", "throughput", "vllm_greedy", "vllm_perplexity")
# Suites whose stored rows can join rebuilt tables when a folder has no run records for them.
_ROW_SUITES = ("capacity", "throughput")
# Suites on a real model: their runs compare within one model only.
_PER_MODEL = {"vllm_greedy": greedy_result, "vllm_perplexity": perplexity_result}


def _read(path: Path, unreadable: list[str] | None = None) -> dict[str, Any] | None:
    """The JSON object in ``path``; ``None`` where there is none, with a line in
    ``unreadable`` when the file exists but holds no JSON object."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        if unreadable is not None:
            unreadable.append(f"{path}: unreadable ({exc}), left out")
        return None
    if not isinstance(data, dict):
        if unreadable is not None:
            unreadable.append(f"{path}: not a JSON object, left out")
        return None
    return data


def load_records(folder: Path, unreadable: list[str] | None = None) -> list[dict[str, Any]]:
    """Every run record under ``folder/runs/`` (suites capacity, throughput, vllm_greedy,
    vllm_perplexity).

    A record the parent never completed (the bench itself was killed) is completed from its
    ``.spec.json`` and marked ``interrupted``.

    Args:
        folder: a bench output folder.
        unreadable: gets a line per record file that exists but cannot be read.
    """
    records = []
    for suite in _REBUILT:
        for path in sorted((folder / "runs" / suite).glob("*.json")):
            if path.name.endswith(".spec.json"):
                continue
            record = _read(path, unreadable)
            if record is None:
                continue
            if "suite" not in record:
                spec = _read(path.with_name(path.name[: -len(".json")] + ".spec.json"), unreadable)
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


def _latest(
    items: Sequence[dict[str, Any]], key_of: Any, label_of: Any, dropped: list[str]
) -> list[dict[str, Any]]:
    """One item per ``key_of(item)``: a later one replaces an earlier one unless it is worse
    (not ``ok`` where the earlier was). Each item left out gets a line in ``dropped`` (which,
    from where, kept what), so that two runs of the same measurement under different
    settings never collapse silently."""
    kept: dict[Any, dict[str, Any]] = {}
    for item in items:
        key = key_of(item)
        old = kept.get(key)
        if old is None or not (old.get("status") == "ok" and item.get("status") != "ok"):
            kept[key] = item
            if old is not None:
                dropped.append(
                    f"{label_of(key)}: kept the run from {item.get('source')} "
                    f"({item.get('status')}), left out the one from {old.get('source')} "
                    f"({old.get('status')})"
                )
        else:
            dropped.append(
                f"{label_of(key)}: kept the run from {old.get('source')} (ok), left out the "
                f"one from {item.get('source')} ({item.get('status')})"
            )
    return list(kept.values())


def _merge(records: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """One record per (suite, name, prompt lengths) (:func:`_latest`).

    Returns:
        The kept records, and one line per record left out.
    """
    dropped: list[str] = []

    def label(key: tuple[str, str, tuple[int, ...]]) -> str:
        return f"{key[0]}/{key[1]}" + (f" ({','.join(map(str, key[2]))})" if key[2] else "")

    return _latest(records, _key, label, dropped), dropped


def _extra_rows(
    stored: Sequence[dict[str, Any]], rebuilt: Sequence[dict[str, Any]], dropped: list[str]
) -> list[dict[str, Any]]:
    """The stored rows that join a rebuilt table: one per :func:`row_key` (:func:`_latest`),
    and none where a run record measured the same (that one wins). Every row left out gets a
    line in ``dropped``."""

    def label(key: tuple[Any, ...]) -> str:
        return "/".join(str(k) for k in key if k is not None)

    taken = {row_key(row) for row in rebuilt}
    fresh = []
    for row in stored:
        if row_key(row) in taken:
            dropped.append(
                f"{label(row_key(row))}: kept the run record, left out the stored row from "
                f"{row['source']}"
            )
        else:
            fresh.append(row)
    return _latest(fresh, row_key, label, dropped)


def collect_results(
    folders: Sequence[Path],
) -> tuple[list[dict[str, Any]], list[str], list[str], list[str]]:
    """Results of every suite found in ``folders``, GPU run records merged.

    Args:
        folders: bench output folders.

    Returns:
        The results (other suites first, as stored; then capacity, throughput and, per real
        model, vllm_greedy and vllm_perplexity rebuilt from the merged records and any stored
        capacity and throughput rows of folders without records), the files they came from, a
        line per file that could not be read and per run record or stored row left out because
        another folder measured the same, and a line per folder whose stored rows were taken as
        they are.
    """
    kept: list[dict[str, Any]] = []
    settings: dict[str, dict[str, Any]] = {}
    sources: list[str] = []
    records: list[dict[str, Any]] = []
    stored_rows: dict[str, list[dict[str, Any]]] = {s: [] for s in _ROW_SUITES}
    notes: list[str] = []
    unreadable: list[str] = []
    for folder in folders:
        stored = _read(folder / "results.json", unreadable)
        found = load_records(folder, unreadable)
        if stored is not None:
            sources.append(str(folder / "results.json"))
            recorded = {r["suite"] for r in found}
            if "throughput" in recorded:  # capacity rows are rebuilt from throughput engines too
                recorded.add("capacity")
            for result in stored.get("results", []):
                suite = result.get("suite")
                if suite in _REBUILT:
                    settings.setdefault(suite, result.get("settings", {}))
                    if suite in _ROW_SUITES and suite not in recorded and result.get("rows"):
                        rows = [{**row, "source": str(folder)} for row in result["rows"]]
                        stored_rows[suite] += rows
                        notes.append(
                            f"{suite}: {len(rows)} row(s) taken as stored from "
                            f"{folder / 'results.json'} (no run records there)"
                        )
                else:
                    model = (stored.get("model") or {}).get("name")
                    kept.append(
                        {**({"model": model} if model else {}), **result, "source": str(folder)}
                    )
        if found:
            sources.append(str(folder / "runs"))
        records += found
    records, dropped = _merge(records)
    dropped = unreadable + dropped
    by_suite = {s: [r for r in records if r["suite"] == s] for s in _REBUILT}
    results = list(kept)
    capacity = list(by_suite["capacity"])
    names = {r["name"] for r in capacity}
    for r in by_suite["throughput"]:  # engines the capacity suite did not start: one row each
        if r["name"] not in names:
            names.add(r["name"])
            capacity.append(r)
    cap_settings = settings.get("capacity") or settings.get("throughput", {})
    extra = _extra_rows(
        stored_rows["capacity"], capacity_result(capacity, cap_settings)["rows"], dropped
    )
    if capacity or extra:
        results.append(capacity_result(capacity, cap_settings, extra))
    tp_settings = settings.get("throughput", {})
    extra = _extra_rows(
        stored_rows["throughput"],
        throughput_result(by_suite["throughput"], tp_settings)["rows"],
        dropped,
    )
    if by_suite["throughput"] or extra:
        results.append(throughput_result(by_suite["throughput"], tp_settings, extra))
    for suite, build in _PER_MODEL.items():
        models: dict[str, list[dict[str, Any]]] = {}
        for r in by_suite[suite]:
            models.setdefault(str(r.get("meta", {}).get("model")), []).append(r)
        for model, runs in models.items():
            results.append(build(runs, {**settings.get(suite, {}), "model": model}))
    return results, sources, dropped, notes
