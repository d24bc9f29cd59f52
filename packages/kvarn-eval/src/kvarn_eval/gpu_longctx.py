"""The long-context suites: ``longctx`` (vLLM's real kernels, GPU) and ``longctx_cpu``
(pseudo-decode, CPU).

``longctx`` starts one vLLM engine per KV cache (bf16 reference first, then fp8, TurboQuant,
every kvarn preset, ...), each in its own process, and gives it every prompt at once:

* retrieval: the contexts and questions of :mod:`kvarn_eval.longctx` (passkey, multi-key,
  multi-value, key-value lookup at 2K-32K tokens, capped by the model's positions), greedy,
  as many tokens out as the answer has plus a slack of 4; an item is right when the text
  holds every value of the answer (:func:`kvarn_eval.longctx.answer_found`);
* long generations: WikiText-2 passages of ``longgen_context`` tokens, each continued greedily
  for ``longgen_tokens`` tokens (``ignore_eos``): token agreement, longest common prefix and the
  share of repeated 4-grams, against the reference; the reference cache again with another
  ``max_num_seqs`` (another batch shape) on the same passages is the bf16-against-bf16 noise
  floor.

The prompts are written once to a JSON file that every engine reads (their token ids go to
vLLM as they are, so every cache sees the same tokens); answers and item metadata travel in
the job's workload, so that the result is rebuilt from the run records alone. Nothing here
imports vLLM or torch at import time.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvarn_eval.longctx import (
    LongContext,
    LongCtxOptions,
    answer_found,
    max_new_tokens,
    paired_by_context,
    repeated_ngram_fraction,
)
from kvarn_eval.serving.runner import EngineJob

__all__ = [
    "longctx_jobs",
    "longctx_result",
    "plan_line",
    "plot_longctx",
    "retrieval_rows",
    "run_workload",
]


MAX_NUM_SEQS = 128


def _max_positions(model_dir: str) -> int | None:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    value = config.get("max_position_embeddings")
    return int(value) if value else None


def write_prompts(
    cells: dict[tuple[str, int], list[LongContext]],
    passages: Sequence[Sequence[int]],
    folder: Path,
) -> tuple[Path, str, list[dict[str, Any]]]:
    """Write the contexts, questions and passages to ``folder/prompts-<sha>.json``.

    Returns:
        The file, its sha256 and one metadata dict per retrieval item (task, length, context
        key, prompt tokens, depth, answer text, tokens to generate), in the order of the
        file's questions.
    """
    contexts: list[list[int]] = []
    questions: list[tuple[int, list[int], int]] = []  # (context, question ids, max tokens)
    items: list[dict[str, Any]] = []
    for (task, length), cell in cells.items():
        for context in cell:
            contexts.append(list(context.ids))
            for it in context.items:
                questions.append((len(contexts) - 1, list(it.question), max_new_tokens(it)))
                items.append(
                    {
                        "task": task,
                        "length": length,
                        "context": f"{task}/{length}/{context.index}",
                        "prompt_tokens": len(context.ids) + len(it.question),
                        "depth": it.depth,
                        "answer": it.answer_text,
                        "max_tokens": max_new_tokens(it),
                    }
                )
    payload = {"contexts": contexts, "questions": questions, "longgen": [list(p) for p in passages]}
    text = json.dumps(payload, separators=(",", ":"))
    sha = hashlib.sha256(text.encode()).hexdigest()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"prompts-{sha[:12]}.json"
    if not path.is_file():
        path.write_text(text)
    return path, sha, items


def longctx_jobs(
    options: LongCtxOptions,
    model_dir: str,
    prompts: tuple[Path, str, list[dict[str, Any]]],
    longgen_count: int,
    *,
    engine_in_process: bool = False,
    gpu_memory_utilization: float = 0.3,
) -> list[EngineJob]:
    """The reference's job, the noise run (the reference cache again, long generations only,
    ``noise_max_num_seqs`` at once), then one job per compared cache (retrieval and long
    generations), in the order of ``options.caches``.

    Args:
        options: the suite's options (``caches`` etc.).
        model_dir: a Hugging Face folder with weights and tokenizer.
        prompts: :func:`write_prompts`' file, sha256 and item metadata.
        longgen_count: passages in the prompts file.
        engine_in_process: vLLM's engine core inside the worker process.
        gpu_memory_utilization: memory share of each engine.
    """
    from kvarn_eval.serving.suites import _cache_dict, _model_geometry, _reference_and_rest

    path, sha, items = prompts
    reference, caches = _reference_and_rest(options.caches)
    head_dim, num_layers = _model_geometry(model_dir)
    longest = max([m["prompt_tokens"] + m["max_tokens"] for m in items] + [0])
    if longgen_count:
        longest = max(longest, options.longgen_context + options.longgen_tokens)
    limit = _max_positions(model_dir)
    max_len = -(-(longest + 16) // 256) * 256
    max_len = min(max_len, limit) if limit else max_len
    base: dict[str, Any] = {
        "model": model_dir,
        "max_model_len": max_len,
        "gpu_memory_utilization": gpu_memory_utilization,
        "enforce_eager": True,
        "max_num_seqs": MAX_NUM_SEQS,
        "seed": 0,
    }
    if options.prefill_chunk:
        # every prompt prefilled a chunk per step, all side by side; no prefix-cache hits, so
        # every question reads its context as the chunks before it stored it
        base.update(
            enable_chunked_prefill=True,
            long_prefill_token_threshold=options.prefill_chunk,
            max_num_batched_tokens=MAX_NUM_SEQS * options.prefill_chunk,
            enable_prefix_caching=False,
        )
    work = {
        "kind": "longctx",
        "prompts_file": str(path),
        "prompts_sha256": sha,
        "longgen_tokens": options.longgen_tokens,
    }
    meta = {"model": model_dir, "head_dim": head_dim, "num_layers": num_layers}
    # the noise run right after the reference: a short time budget drops compared caches
    # first, and without the floor the long generations' agreement cannot be read
    plan: list[tuple[str, Any, dict[str, Any], str, bool]] = [
        ("reference", reference, {}, reference.label, True)
    ]
    if longgen_count and options.noise_max_num_seqs:
        n = options.noise_max_num_seqs
        plan.append(
            ("noise", reference, {"max_num_seqs": n}, f"{reference.label} seqs<={n}", False)
        )
    plan += [("compare", c, {}, c.label, True) for c in caches]
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if engine_in_process else {}
    return [
        EngineJob(
            suite="longctx",
            name=f"longctx/{label}",
            cache=_cache_dict(cache),
            llm_kwargs={**base, **extra, **cache.llm_kwargs()},
            workload={**work, "retrieval": retrieval, "items": items if retrieval else []},
            meta={**meta, "role": role, "label": label},
            env={**env, **dict(cache.env)},
        )
        for role, cache, extra, label, retrieval in plan
    ]


def run_workload(llm: Any, job: dict[str, Any], record: dict[str, Any], save: Any) -> None:
    """The worker's ``longctx`` workload: every retrieval prompt at once, then every long
    generation at once, greedy, ``ignore_eos``; the generated texts and ids go into
    ``record``."""
    from vllm import SamplingParams

    work = job["workload"]
    data = json.loads(Path(work["prompts_file"]).read_text())
    if work.get("retrieval"):
        contexts = data["contexts"]
        questions = data["questions"]
        texts: list[str] = [""] * len(questions)
        ids: list[list[int]] = [[] for _ in questions]
        start = time.perf_counter()
        # one batch per answer budget (a few): each question gets its answer's length + slack
        for budget in sorted({int(n) for _, _, n in questions}):
            index = [i for i, (_, _, n) in enumerate(questions) if int(n) == budget]
            batch = [
                {"prompt_token_ids": contexts[questions[i][0]] + questions[i][1]} for i in index
            ]
            params = SamplingParams(temperature=0.0, max_tokens=budget, ignore_eos=True, seed=0)
            for i, out in zip(index, llm.generate(batch, params, use_tqdm=False), strict=True):
                texts[i], ids[i] = out.outputs[0].text, list(out.outputs[0].token_ids)
        record["retrieval_seconds"] = round(time.perf_counter() - start, 2)
        record["retrieval_texts"] = texts
        record["retrieval_outputs"] = ids
        save()
    if data["longgen"]:
        batch = [{"prompt_token_ids": p} for p in data["longgen"]]
        params = SamplingParams(
            temperature=0.0, max_tokens=int(work["longgen_tokens"]), ignore_eos=True, seed=0
        )
        start = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        record["longgen_seconds"] = round(time.perf_counter() - start, 2)
        record["longgen_outputs"] = [list(o.outputs[0].token_ids) for o in outs]
        record["longgen_sample"] = outs[0].outputs[0].text[:600] if outs else ""


def retrieval_rows(
    label: str, right: Sequence[bool], ref: Sequence[bool] | None, items: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Rows of one cache: per (task, length) and per length over all tasks (task ``all``):
    accuracy, change against the reference with its standard error paired item by item and
    clustered by context, agreement with the reference's right/wrong.

    Args:
        label: the cache (or method).
        right: per item, right or not.
        ref: per item, the reference right (``None``: no reference).
        items: per item, ``task``, ``length`` and ``context``.
    """
    groups: dict[tuple[str, int], list[int]] = {}
    for i, m in enumerate(items):
        groups.setdefault((m["task"], m["length"]), []).append(i)
        groups.setdefault(("all", m["length"]), []).append(i)
    rows = []
    for (task, length), idx in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        mine = [right[i] for i in idx]
        row: dict[str, Any] = {
            "cache": label,
            "task": task,
            "length": length,
            "items": len(idx),
            "accuracy": sum(mine) / len(mine),
        }
        if ref is not None:
            base = [ref[i] for i in idx]
            row["change"], row["change_se"] = paired_by_context(
                mine, base, [items[i]["context"] for i in idx]
            )
            row["agreement"] = sum(a == b for a, b in zip(mine, base)) / len(idx)
        rows.append(row)
    return rows


DEPTH_BINS = (
    (0.0, 1 / 3, "first third"),
    (1 / 3, 2 / 3, "middle third"),
    (2 / 3, 1.01, "last third"),
)


def depth_rows(
    label: str, right: Sequence[bool], ref: Sequence[bool] | None, items: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Rows of one cache per third of the context where the asked needle sits, over every
    task and length (the first tile and the recent ones stay exact in a kvarn cache): the
    fields of :func:`retrieval_rows`, ``task`` naming the third."""
    rows = []
    for lo, hi, name in DEPTH_BINS:
        idx = [i for i, m in enumerate(items) if lo <= m["depth"] < hi]
        if not idx:
            continue
        mine = [right[i] for i in idx]
        row: dict[str, Any] = {"cache": label, "task": name, "length": None, "items": len(idx)}
        row["accuracy"] = sum(mine) / len(idx)
        if ref is not None:
            base = [ref[i] for i in idx]
            keys = [items[i]["context"] for i in idx]
            row["change"], row["change_se"] = paired_by_context(mine, base, keys)
            row["agreement"] = sum(a == b for a, b in zip(mine, base)) / len(idx)
        rows.append(row)
    return rows


def _fmt_change(row: dict[str, Any]) -> str:
    if row.get("change") is None:
        return f"{100 * row['accuracy']:.1f}"
    se = row["change_se"]
    se_text = "-" if se is None or math.isnan(se) else f"{100 * se:.1f}"
    return f"{100 * row['accuracy']:.1f} ({100 * row['change']:+.1f} ± {se_text})"


def longctx_result(records: Sequence[dict[str, Any]], settings: dict[str, Any]) -> dict[str, Any]:
    """The ``longctx`` suite's result from its run records: retrieval rows per cache and cell,
    long-generation rows per cache, three tables and the data of the plot."""
    from kvarn_eval.fidelity import compare_outputs
    from kvarn_eval.serving.caches import CacheSpec

    def role(r: dict[str, Any]) -> str:
        return str(r.get("meta", {}).get("role"))

    reference = next(
        (r for r in records if role(r) == "reference" and r.get("retrieval_texts")), None
    )
    ref_gen = next(
        (r for r in records if role(r) == "reference" and r.get("longgen_outputs")), None
    )
    items: list[dict[str, Any]] = []
    ref_right = None
    if reference is not None:
        items = reference["workload"]["items"]
        ref_right = [
            answer_found(t, m["answer"]) for t, m in zip(reference["retrieval_texts"], items)
        ]
    retrieval: list[dict[str, Any]] = []
    depth: list[dict[str, Any]] = []
    generation: list[dict[str, Any]] = []
    status: list[list[str]] = []
    for r in records:
        meta, cache = r.get("meta", {}), r.get("cache", {})
        label = str(meta.get("label", cache.get("label")))
        spec = CacheSpec(cache.get("label", label), cache.get("kv_cache_dtype", "auto"))
        bits = spec.bits_per_element(int(meta.get("head_dim", 64)), meta.get("num_layers"))
        error = str(r.get("error") or "").strip().splitlines()
        status.append([label, str(r.get("status")), error[0][:120] if error else ""])
        texts = r.get("retrieval_texts")
        mine_items = (r.get("workload") or {}).get("items") or items
        if texts:
            right = [answer_found(t, m["answer"]) for t, m in zip(texts, mine_items)]
            same = ref_right is not None and len(mine_items) == len(items)
            base = ref_right if same else None
            for row in retrieval_rows(label, right, base, mine_items):
                retrieval.append({**row, "bits_per_element": bits, "role": role(r)})
            depth += depth_rows(label, right, base, mine_items)
        gen = r.get("longgen_outputs")
        if gen:
            row = {"cache": label, "role": role(r), "bits_per_element": bits}
            row["repeated_4gram"] = sum(map(repeated_ngram_fraction, gen)) / len(gen)
            if ref_gen is not None and r is not ref_gen:
                row.update(compare_outputs(ref_gen["longgen_outputs"], gen))
            generation.append(row)
    return {
        "suite": "longctx",
        "kind": "longctx",
        "settings": settings,
        "reference": None if reference is None else reference["meta"].get("label"),
        "retrieval": retrieval,
        "depth": depth,
        "generation": generation,
        "tables": _tables(retrieval, depth, generation, status, settings),
        "plot_file": "longctx",
    }


def _tables(
    retrieval: list[dict[str, Any]],
    depth: list[dict[str, Any]],
    generation: list[dict[str, Any]],
    status: list[list[str]],
    settings: dict[str, Any],
) -> list[dict[str, Any]]:
    model = Path(str(settings.get("model") or "?")).name
    lengths = sorted({r["length"] for r in retrieval})
    caches = list(dict.fromkeys(r["cache"] for r in retrieval))
    cells = {(r["cache"], r["task"], r["length"]): r for r in retrieval}
    summary = [
        [
            c,
            *[
                _fmt_change(cells[(c, "all", n)]) if (c, "all", n) in cells else "-"
                for n in lengths
            ],
        ]
        for c in caches
    ]
    detail = [
        [
            r["task"],
            str(r["length"]),
            r["cache"],
            str(r["items"]),
            _fmt_change(r),
            "-" if r.get("agreement") is None else f"{100 * r['agreement']:.1f}",
        ]
        for r in sorted(retrieval, key=lambda r: (r["task"], r["length"]))
        if r["task"] != "all"
    ]
    thirds = {(d["cache"], d["task"]): d for d in depth}
    by_depth = [
        [c, *[_fmt_change(thirds[(c, n)]) if (c, n) in thirds else "-" for _, _, n in DEPTH_BINS]]
        for c in caches
    ]
    gen_rows = [
        [
            g["cache"] + (" (reference)" if g["role"] == "reference" else ""),
            f"{g['bits_per_element']:.2f}",
            "-" if g.get("token_agreement") is None else f"{100 * g['token_agreement']:.1f}",
            "-" if g.get("mean_lcp") is None else f"{g['mean_lcp']:.0f}",
            "-" if g.get("exact_match") is None else f"{100 * g['exact_match']:.0f}",
            f"{100 * g['repeated_4gram']:.1f}",
        ]
        for g in generation
    ]
    return [
        {
            "title": f"longctx: retrieval accuracy % over all tasks per context length "
            f"(change against the reference in points ± its standard error, paired item by "
            f"item, clustered by context), {model} through vLLM",
            "header": ["cache", *[str(n) for n in lengths]],
            "rows": summary,
        },
        {
            "title": "longctx: retrieval accuracy % per task and length (change ± paired SE); "
            "agreement: items right or wrong alike with the reference",
            "header": ["task", "length", "cache", "items", "accuracy % (change ± SE)", "agree %"],
            "rows": detail,
        },
        {
            "title": "longctx: retrieval accuracy % by where the asked needle sits, over all "
            "tasks and lengths (change ± paired SE)",
            "header": ["cache", *[name for _, _, name in DEPTH_BINS]],
            "rows": by_depth,
        },
        {
            "title": f"longctx: long generations, {settings.get('longgen_prompts')} passages of "
            f"{settings.get('longgen_context')} tokens, {settings.get('longgen_tokens')} greedy "
            "tokens each, against the reference (the noise row: the reference cache at another "
            "batch shape)",
            "header": [
                "cache",
                "bits/elem",
                "token agree %",
                "mean LCP",
                "exact %",
                "repeated 4-grams %",
            ],
            "rows": gen_rows,
        },
        {"title": "longctx: engine runs", "header": ["cache", "status", "error"], "rows": status},
    ]


def plot_longctx(result: dict[str, Any], path: Path, title: str = "") -> Path | None:
    """Retrieval accuracy against context length, one line per cache (or method), one panel
    per task plus one over all tasks. Needs matplotlib; ``None`` when there is nothing."""
    rows = result.get("retrieval") or []
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted(dict.fromkeys(r["task"] for r in rows), key=lambda t: t != "all")
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.8), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        for cache in dict.fromkeys(r["cache"] for r in rows):
            pts = sorted((r["length"], 100 * r["accuracy"]) for r in rows
                         if r["cache"] == cache and r["task"] == task)  # fmt: skip
            if pts:
                ax.plot(*zip(*pts), marker="o", label=cache, linewidth=1.2)
        ax.set_xscale("log", base=2)
        ax.set_title("all tasks" if task == "all" else task)
        ax.set_xlabel("context tokens")
        ax.set_ylim(-2, 102)
        ax.grid(alpha=0.3)
    axes.flat[0].set_ylabel("retrieval accuracy (%)")
    axes.flat[-1].legend(fontsize=7, loc="lower left")
    fig.suptitle(title or f"{result.get('suite')}: retrieval accuracy against context length")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plan_line(name: str, options: Any) -> str:
    """``--dry-run``'s line for ``longctx`` (engines, cells, long generations) or
    ``longctx_cpu`` (methods, cells)."""
    from kvarn_eval.accuracy.methods import select_methods
    from kvarn_eval.serving.caches import parse_caches

    lo: LongCtxOptions = options.longctx
    if name == "longctx_cpu":
        names = [m.name for m in select_methods(lo.cpu_methods, options.block_size)]
        if options.reference not in names:
            names.insert(0, options.reference)
        return (
            f"{len(lo.tasks)} tasks x lengths {','.join(map(str, lo.cpu_lengths))} x "
            f"{lo.cpu_items} items, {len(names)} methods ({', '.join(names)}) under "
            f"pseudo-decode on {options.model}"
        )
    caches = parse_caches(lo.caches)
    engines = len(caches) + int(not any(c.is_reference for c in caches))
    engines += int(bool(lo.longgen_prompts and lo.noise_max_num_seqs))
    model = options.serving.greedy_model or options.model
    return (
        f"{engines} vLLM engines on {model} (the caches, the bf16 reference, the noise run): "
        f"{len(lo.tasks)} tasks x lengths {','.join(map(str, lo.lengths))} (capped by the "
        f"model's positions) x {lo.items} items; {lo.longgen_prompts} passages of "
        f"{lo.longgen_context} tokens x {lo.longgen_tokens} greedy tokens"
    )
