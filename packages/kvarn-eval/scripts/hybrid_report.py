"""The tables of the hybrid GPU evidence (``hybrid_evidence.py``): capacity beside its
arithmetic, greedy agreement across serving modes, bursts, and the issue's targets."""

from __future__ import annotations

from typing import Any


def _agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict[str, Any]:
    pairs = list(zip(outputs, reference, strict=True))
    same = sum(a == b for x, y in pairs for a, b in zip(x, y, strict=True))
    total = sum(len(x) for x, _ in pairs)
    return {
        "agreement": round(same / total, 4) if total else None,
        "exact_prompts": sum(x == y for x, y in pairs),
        "num_prompts": len(pairs),
    }


def compare_greedy(runs: list[dict[str, Any]]) -> None:
    """Each run's greedy tokens against the eager, prefix-off run of its shape and cache
    (``agreement``, ``exact_prompts``), MTP runs also against the V2 runner without
    speculation (``vs_v2``), and every run against bf16's (``vs_bf16``: dummy weights, so only
    a sign that the path computes something close). In place."""
    ok = [r for r in runs if r.get("ok") and r.get("outputs")]
    reference = {
        (r["shape"], r["cache"]): r
        for r in ok
        if r["mode"] == "eager-noprefix" and r["role"] == "capacity"
    }
    v2 = {(r["shape"], r["cache"]): r for r in ok if r["role"] == "v2"}
    for run in ok:
        key = (run["shape"], run["cache"])
        run["distinct_tokens"] = len({t for x in run["outputs"] for t in x})
        ref = reference.get(key)
        if ref is not None and ref is not run:
            run.update(_agreement(run["outputs"], ref["outputs"]))
        if run["role"] == "mtp" and key in v2:
            run["vs_v2"] = _agreement(run["outputs"], v2[key]["outputs"])["agreement"]
        bf16 = reference.get((run["shape"], "auto"))
        if bf16 is not None and run["cache"] != "auto":
            run["vs_bf16"] = _agreement(run["outputs"], bf16["outputs"])["agreement"]


def _overlap(burst: dict[str, Any], runs: list[dict[str, Any]], owner: dict[str, Any]) -> float:
    """Seconds of other engines' start-ups inside a burst (summed over engines)."""
    total = 0.0
    for r in runs:
        if r is owner or "launched" not in r:
            continue
        end = r.get("up") or r["launched"] + r.get("seconds", 0)
        total += max(0.0, min(end, burst["end"]) - max(r["launched"], burst["start"]))
    return round(total, 1)


def _fmt(value: Any, spec: str = ",") -> str:
    if value is None:
        return "-"
    return format(value, spec)


def _capacity_rows(shape_runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One run per cache for the capacity table: its eager capacity run, else any run."""
    rows: dict[str, dict[str, Any]] = {}
    for r in shape_runs:
        if not r.get("ok") or r.get("role") in ("mtp",):
            continue
        if r["cache"] not in rows or r.get("role") == "capacity":
            rows[r["cache"]] = r
    return list(rows.values())


def _targets(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's capacity targets, checked on the measured rows."""
    lines = []
    for r in rows:
        if r["cache"].startswith("kvarn_") and r.get("measured_over_expected") is not None:
            ok = abs(r["measured_over_expected"] - 1) <= 0.05
            lines.append(
                f"- `{r['cache']}` measured / arithmetic {r['measured_over_expected']}: "
                f"{'within' if ok else 'OUTSIDE'} 5%"
            )
    quant = [r for r in rows if r["cache"].startswith("turboquant_") and r.get("kv_cache_tokens")]
    for r in rows:
        if not r["cache"].startswith("kvarn_") or not r.get("kv_cache_tokens"):
            continue
        rivals = [q for q in quant if q["bits_per_element"] >= r["bits_per_element"]]
        behind = [q["cache"] for q in rivals if q["kv_cache_tokens"] >= r["kv_cache_tokens"]]
        names = ", ".join(q["cache"] for q in rivals) or "none measured"
        verdict = f"behind {', '.join(behind)}" if behind else "ahead"
        lines.append(
            f"- `{r['cache']}` ({r['bits_per_element']} bits) against TurboQuant at equal or "
            f"more bits ({names}): {verdict}"
        )
    return lines


def report(runs: list[dict[str, Any]], args: Any, shapes: dict[str, Any]) -> str:
    """The markdown summary (``hybrid.md``)."""
    lines = [
        "# Hybrid models on kvarn: GPU evidence (hybrid_evidence.py)",
        "",
        f"Pool {args.kv_pool_gib} GiB per engine (kv_cache_memory_bytes), max_model_len "
        f"{args.max_model_len}, max_num_seqs {args.max_num_seqs}; bursts "
        f"{args.burst_requests} x {args.burst_prompt_len} tokens, {args.burst_output_len} out; "
        f"bf16 backend {args.bf16_backend or 'vLLM default'}.",
        "",
    ]
    for shape in args.shapes:
        shape_runs = [r for r in runs if r.get("shape") == shape]
        rows = _capacity_rows(shape_runs)
        lines += [
            f"## {shape}",
            "",
            "| cache | bits/elem | block | blocks/request | KV tokens | "
            "arithmetic | measured/arith. | vs bf16 | staging GiB | start-up s |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in rows:
            lines.append(
                f"| `{r['cache']}` | {_fmt(r.get('bits_per_element'), '')} | "
                f"{_fmt(r.get('block_size'))} | {_fmt(r.get('blocks_per_request'))} | "
                f"{_fmt(r.get('kv_cache_tokens'))} | {_fmt(r.get('expected_tokens'))} | "
                f"{_fmt(r.get('measured_over_expected'), '')} | {_fmt(r.get('vs_first'), '')} | "
                f"{_fmt(r.get('staging_gib'), '')} | {_fmt(r.get('startup_s'), '')} |"
            )
        lines += ["", *_targets(rows), ""]
        lines += [
            "| run | agreement with eager, prefix off | exact prompts | distinct tokens | "
            "vs bf16 | vs V2 without MTP |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in shape_runs:
            if r.get("ok") and r.get("outputs"):
                lines.append(
                    f"| `{r['cache']}` {r['mode']} {r['role']} | {_fmt(r.get('agreement'), '')} | "
                    f"{_fmt(r.get('exact_prompts'), '')}/{_fmt(r.get('num_prompts'), '')} | "
                    f"{r.get('distinct_tokens')} | {_fmt(r.get('vs_bf16'), '')} | "
                    f"{_fmt(r.get('vs_v2'), '')} |"
                )
        bursts = [r for r in shape_runs if r.get("ok") and r.get("burst")]
        base = next((r["burst"] for r in bursts if r["cache"] == "auto"), None)
        lines += [
            "",
            "| burst | wall s | output tok/s | total tok/s | vs bf16 | other start-ups inside, s |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in bursts:
            b = r["burst"]
            ratio = round(b["total_tok_per_s"] / base["total_tok_per_s"], 3) if base else None
            lines.append(
                f"| `{r['cache']}` | {round(b['wall_s'], 1)} | {b['output_tok_per_s']:,} | "
                f"{b['total_tok_per_s']:,} | {_fmt(ratio, '')} | {_overlap(b, runs, r)} |"
            )
        lines.append("")
    failed = [r for r in runs if not r.get("ok")]
    if failed:
        lines += ["## Not measured", ""]
        for r in failed:
            last = str(r.get("error", "")).strip().splitlines() or ["?"]
            lines.append(f"- {r['name']}: {last[-1][:300]}")
    return "\n".join(lines) + "\n"
