"""The GPU suites through vLLM: ``capacity``, ``throughput``, ``vllm_greedy`` and
``vllm_perplexity``.

Each suite turns the options into :class:`~kvarn_eval.serving.runner.EngineJob` s (one engine
per model shape and cache), runs them one by one in their own processes within the time
budget, and builds its result from the run records alone (:func:`capacity_result`,
:func:`throughput_result`, :func:`greedy_result`, :func:`perplexity_result`), so that ``kvarn-eval report`` can rebuild the
same tables from the record files of several runs. A throughput run records the capacity of its
engine too; ``capacity`` reuses it when both suites run with the same engine settings.
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvarn_eval.serving.caches import CacheSpec, parse_caches
from kvarn_eval.serving.options import ServingOptions
from kvarn_eval.serving.runner import (
    Budget,
    EngineJob,
    finished_record,
    run_job,
    skipped_record,
)
from kvarn_eval.serving.shapes import get_shape, write_model_dir

__all__ = [
    "capacity_result",
    "check_vllm",
    "greedy_jobs",
    "greedy_result",
    "perplexity_jobs",
    "perplexity_result",
    "row_key",
    "serving_jobs",
    "throughput_result",
]

VLLM_HINT = (
    "the GPU suites run vLLM: install vllm==0.26.* and the kvarn plugin "
    "(pip install -e packages/kvarn-vllm, or pip install kvarn-vllm)"
)


def check_vllm() -> None:
    """Raise a ``MissingDependencyError`` naming what to install when vLLM or the plugin is absent."""
    from kvarn_eval.models import MissingDependencyError

    for module in ("vllm", "kvarn_vllm"):
        if importlib.util.find_spec(module) is None:
            raise MissingDependencyError(f"the module {module!r} is missing; {VLLM_HINT}")


def _cache_dict(cache: CacheSpec) -> dict[str, Any]:
    out: dict[str, Any] = {
        "label": cache.label,
        "kv_cache_dtype": cache.kv_cache_dtype,
        "backend": cache.backend,
    }
    if cache.env:
        out["env"] = dict(cache.env)
    return out


def _env(opts: ServingOptions, cache: CacheSpec) -> dict[str, str]:
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if opts.engine_in_process else {}
    return {**env, **dict(cache.env)}


def serving_jobs(opts: ServingOptions, models_root: Path, kind: str) -> list[EngineJob]:
    """One job per model shape and cache, for the ``capacity`` or ``throughput`` workload.

    Both kinds build identical engines (same ``vllm.LLM`` arguments), so a capacity job can
    reuse a throughput job's record.

    Args:
        opts: the GPU options.
        models_root: where the shapes' ``config.json`` folders are written.
        kind: ``capacity`` or ``throughput``.
    """
    if kind not in ("capacity", "throughput"):
        raise ValueError(f"kind must be 'capacity' or 'throughput', got {kind!r}")
    jobs = []
    for shape_name in opts.gpu_models:
        shape = get_shape(shape_name)
        model_dir = write_model_dir(shape, models_root)
        for cache in parse_caches(opts.caches):
            llm_kwargs: dict[str, Any] = {
                "model": str(model_dir),
                "load_format": "dummy",
                "skip_tokenizer_init": True,
                "tensor_parallel_size": opts.tensor_parallel_size,
                "gpu_memory_utilization": opts.gpu_memory_utilization,
                "max_num_seqs": opts.max_num_seqs,
                "max_model_len": opts.max_model_len,
                "enforce_eager": opts.enforce_eager,
                "seed": 0,
                # RequestOutput.metrics (TTFT, TPOT) exists only with stats on
                "disable_log_stats": False,
                **cache.llm_kwargs(),
            }
            if opts.cudagraph_capture_sizes is not None:
                # only when asked, so that earlier records keep their job key (--resume)
                llm_kwargs["compilation_config"] = {
                    "cudagraph_capture_sizes": list(opts.cudagraph_capture_sizes)
                }
            workload: dict[str, Any] = {"kind": kind, "vocab_size": shape.vocab_size}
            if kind == "throughput":
                workload.update(
                    prompt_lens=list(opts.prompt_lens),
                    output_len=opts.output_len,
                    max_num_seqs=opts.max_num_seqs,
                    fill=opts.fill,
                    requests=opts.requests,
                )
            jobs.append(
                EngineJob(
                    suite=kind,
                    name=f"{shape.name}/tp{opts.tensor_parallel_size}/{cache.label}",
                    cache=_cache_dict(cache),
                    llm_kwargs=llm_kwargs,
                    workload=workload,
                    meta={
                        "model": shape.name,
                        "tensor_parallel_size": opts.tensor_parallel_size,
                        "head_dim": shape.head_dim,
                        "num_layers": shape.num_layers,
                        "num_kv_heads": shape.num_kv_heads,
                        "max_num_seqs": opts.max_num_seqs,
                        "gpu_memory_utilization": opts.gpu_memory_utilization,
                    },
                    env=_env(opts, cache),
                )
            )
    return jobs


def _model_geometry(model_dir: str) -> tuple[int, int]:
    """``(head_dim, num_layers)`` from a Hugging Face folder's ``config.json``."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return int(head_dim), int(config["num_hidden_layers"])


def _reference_and_rest(spec: str) -> tuple[CacheSpec, list[CacheSpec]]:
    """The first bf16 cache of ``spec`` (``bf16@TRITON_ATTN`` when there is none) and the
    others, in order."""
    from kvarn_eval.serving.caches import parse_cache

    caches = parse_caches(spec)
    reference = next((c for c in caches if c.is_reference), None)
    if reference is None:
        reference = parse_cache("bf16@TRITON_ATTN")
    return reference, [c for c in caches if c is not reference]


def greedy_jobs(
    opts: ServingOptions, model_dir: str, contexts: Sequence[str] | None = None
) -> list[EngineJob]:
    """Jobs of the ``vllm_greedy`` suite: the reference, the compared caches, the noise run.

    The reference is the first bf16 cache of ``opts.greedy_caches`` (``bf16@TRITON_ATTN`` is
    put first when there is none); the noise run is the reference cache again with
    ``greedy_noise_max_num_seqs``.

    Args:
        opts: the GPU options.
        model_dir: a Hugging Face folder with weights and tokenizer.
        contexts: a passage per prompt, put before it (``greedy_context_tokens`` tokens each).

    Raises:
        ValueError: ``contexts`` not one per prompt.
    """
    from kvarn_eval.fidelity import make_prompts

    reference, caches = _reference_and_rest(opts.greedy_caches)
    head_dim, num_layers = _model_geometry(model_dir)
    prompts = make_prompts(opts.greedy_prompts)
    max_len = 2048
    if contexts is not None:
        if len(contexts) != len(prompts):
            raise ValueError(f"{len(contexts)} contexts for {len(prompts)} prompts")
        prompts = [f"{c}\n\n{p}" for c, p in zip(contexts, prompts, strict=True)]
        # the passage, the longest prompt (~350 tokens) and the generated tokens, with room
        max_len = max(max_len, opts.greedy_context_tokens + 512 + opts.greedy_tokens)
    base: dict[str, Any] = {
        "model": model_dir,
        "max_model_len": max_len,
        "gpu_memory_utilization": opts.greedy_gpu_memory_utilization,
        "enforce_eager": True,
        "max_num_seqs": 128,
        "seed": 0,
    }
    workload = {"kind": "greedy", "prompts": prompts, "max_tokens": opts.greedy_tokens}
    meta = {"model": model_dir, "head_dim": head_dim, "num_layers": num_layers}
    plan: _Plan = [("reference", reference, {}, reference.label)]
    plan += [("compare", c, {}, c.label) for c in caches]
    # The noise run last: a budget that runs short drops it before a compared cache (at a small
    # batch size it is also the slowest run: 100 prompts x 512 tokens at 8 took over 200 s).
    if opts.greedy_noise_max_num_seqs:
        n = opts.greedy_noise_max_num_seqs
        plan.append(("noise", reference, {"max_num_seqs": n}, f"{reference.label} seqs<={n}"))
    return _model_jobs("vllm_greedy", "greedy", plan, base, workload, meta, opts)


_Plan = list[tuple[str, CacheSpec, dict[str, Any], str]]


def _model_jobs(
    suite: str,
    prefix: str,
    plan: _Plan,
    base: dict[str, Any],
    workload: dict[str, Any],
    meta: dict[str, Any],
    opts: ServingOptions,
) -> list[EngineJob]:
    """One job per ``(role, cache, extra engine arguments, label)`` of ``plan`` on a real model."""
    return [
        EngineJob(
            suite=suite,
            name=f"{prefix}/{label}",
            cache=_cache_dict(cache),
            llm_kwargs={**base, **extra, **cache.llm_kwargs()},
            workload=workload,
            meta={**meta, "role": role, "label": label},
            env=_env(opts, cache),
        )
        for role, cache, extra, label in plan
    ]


def perplexity_jobs(
    opts: ServingOptions, model_dir: str, chunks: Sequence[Sequence[int]]
) -> list[EngineJob]:
    """Jobs of the ``vllm_perplexity`` suite: the reference, the noise run, the compared caches.

    Each engine prefills every text at once, side by side, ``ppl_chunk_size`` tokens of each
    per step (vLLM's ``long_prefill_token_threshold``, with a token budget of one chunk per
    text), so every chunk of a text attends to the cache its earlier chunks wrote
    (pseudo-decode through the real kernels); prefix caching is off, so every token is
    computed. The noise run is the reference cache with chunks 4x as long: another batching of
    the same exact attention.

    Args:
        opts: the GPU options.
        model_dir: a Hugging Face folder with weights and tokenizer.
        chunks: token ids of the text chunks to score.
    """
    reference, caches = _reference_and_rest(opts.ppl_caches)
    head_dim, num_layers = _model_geometry(model_dir)
    longest = max(len(c) for c in chunks)
    step, n = opts.ppl_chunk_size, len(chunks)

    def chunked(size: int) -> dict[str, Any]:
        return {"max_num_batched_tokens": n * size, "long_prefill_token_threshold": size}

    base: dict[str, Any] = {
        "model": model_dir,
        "max_model_len": longest + 16,
        "gpu_memory_utilization": opts.greedy_gpu_memory_utilization,
        "enforce_eager": True,
        "max_num_seqs": n,
        **chunked(step),
        "enable_chunked_prefill": True,
        "enable_prefix_caching": False,
        "seed": 0,
    }
    workload = {"kind": "perplexity", "chunks": [list(c) for c in chunks]}
    meta = {"model": model_dir, "head_dim": head_dim, "num_layers": num_layers}
    # The noise run last: a budget that runs short drops it before a compared cache.
    plan: _Plan = [
        ("reference", reference, {}, reference.label),
        *[("compare", c, {}, c.label) for c in caches],
        ("noise", reference, chunked(4 * step), f"{reference.label} chunk {4 * step}"),
    ]
    return _model_jobs("vllm_perplexity", "perplexity", plan, base, workload, meta, opts)


def run_jobs(
    jobs: Sequence[EngineJob],
    workdir: Path,
    opts: ServingOptions,
    budget: Budget,
    *,
    reuse: dict[str, dict[str, Any]] | None = None,
    echo: Any = print,
    on_record: Any = None,
) -> list[dict[str, Any]]:
    """Run ``jobs`` in order within ``budget``; returns one record per job.

    Args:
        jobs: the jobs.
        workdir: where spec, record and log files go.
        opts: the GPU options (``run_timeout``).
        budget: the shared time budget; jobs that do not get ``min_run_seconds`` are skipped.
        reuse: records by engine key; a capacity job whose engine already ran reuses it, and
            every finished record is added.
        echo: progress lines.
        on_record: called with the records so far after each job (partial results).
    """
    records: list[dict[str, Any]] = []
    for index, job in enumerate(jobs, 1):
        key = job.engine_key()
        earlier = (reuse or {}).get(key)
        kept = finished_record(job, workdir) if opts.resume else None
        if kept is not None:
            record = kept
            echo(f"[{index}/{len(jobs)}] {job.name}: kept from {workdir} (--resume)")
        elif job.workload["kind"] == "capacity" and earlier and earlier.get("capacity"):
            record = {
                **earlier,
                "suite": job.suite,
                "name": job.name,
                "reused_from": earlier["name"],
            }
            echo(f"[{index}/{len(jobs)}] {job.name}: capacity from {earlier['name']}")
        else:
            timeout = budget.timeout_for(opts.run_timeout)
            if timeout is None:
                record = skipped_record(job, "not started: time budget (--max-seconds) spent")
                echo(f"[{index}/{len(jobs)}] {job.name}: skipped (time budget spent)")
            else:
                echo(f"[{index}/{len(jobs)}] {job.name}: starting (timeout {timeout:.0f} s)")
                record = run_job(job, workdir, timeout, echo=echo)
        if reuse is not None and record.get("capacity"):
            reuse.setdefault(key, record)
        records.append(record)
        if on_record is not None:
            on_record(records)
    return records


def _kv_tokens(record: dict[str, Any]) -> int | None:
    capacity = record.get("capacity") or {}
    return record.get("kv_cache_tokens_logged") or capacity.get("kv_cache_tokens_config")


def _spec(record: dict[str, Any]) -> CacheSpec:
    cache = record["cache"]
    env = tuple(sorted((cache.get("env") or {}).items()))
    return CacheSpec(cache["label"], cache["kv_cache_dtype"], cache.get("backend"), env)


def _group(record: dict[str, Any]) -> tuple[str, int]:
    meta = record.get("meta", {})
    return str(meta.get("model")), int(meta.get("tensor_parallel_size", 1))


def _first_line(text: Any) -> str:
    return str(text or "").strip().splitlines()[0][:200] if text else ""


def _kvarn_problems(record: dict[str, Any], bf16_tokens: int | None) -> list[str]:
    """Evidence that a kvarn run used the kvarn cache and not a silent fallback."""
    spec = _spec(record)
    if spec.family != "kvarn" or record.get("status") != "ok":
        return []
    from kvarn_math.layout import get_preset

    problems = []
    if record.get("staging_gib_logged") is None:
        problems.append("no 'kvarn: staging' log line")
    block = (record.get("capacity") or {}).get("block_size")
    group = get_preset(spec.kv_cache_dtype).group_size
    if block is not None and block != group:
        problems.append(f"block size {block}, expected the tile {group}")
    tokens = _kv_tokens(record)
    if bf16_tokens and tokens is not None and tokens <= bf16_tokens:
        problems.append(f"{tokens} KV tokens, not more than bf16's {bf16_tokens}")
    return problems


def _fmt(value: Any, spec: str = ",.0f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def _bf16_tokens(records: Sequence[dict[str, Any]]) -> dict[tuple[str, int], int]:
    """The first bf16 record's KV tokens per (model, tp): the capacity reference."""
    found: dict[tuple[str, int], int] = {}
    for r in records:
        tokens = _kv_tokens(r)
        if _spec(r).is_reference and tokens and _group(r) not in found:
            found[_group(r)] = tokens
    return found


def row_key(row: dict[str, Any]) -> tuple[Any, ...]:
    """What a capacity or throughput row measured: model, parallelism, cache, prompt length."""
    return (
        row.get("model"),
        row.get("tensor_parallel_size"),
        row.get("cache"),
        row.get("prompt_len"),
    )


def _capacity_ratios(rows: list[dict[str, Any]], key: str) -> None:
    """Set ``row[key]``: KV tokens against the first bf16 row of the same model and
    parallelism."""
    base: dict[tuple[Any, Any], int] = {}
    for row in rows:
        group = (row.get("model"), row.get("tensor_parallel_size"))
        if row.get("family") == "bf16" and row.get("kv_cache_tokens") and group not in base:
            base[group] = row["kv_cache_tokens"]
    for row in rows:
        ref = base.get((row.get("model"), row.get("tensor_parallel_size")))
        tokens = row.get("kv_cache_tokens")
        row[key] = tokens / ref if tokens and ref else None


def capacity_result(
    records: Sequence[dict[str, Any]],
    settings: dict[str, Any],
    extra_rows: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """The ``capacity`` suite's result from its run records.

    Args:
        records: one per (model, cache).
        settings: what the run was asked for (shown in the title, stored).
        extra_rows: finished rows (from a stored ``results.json`` whose run records are gone),
            appended after the records' rows; ratios are computed over all rows.
    """
    bf16 = _bf16_tokens(records)
    rows = []
    for r in records:
        spec, meta = _spec(r), r.get("meta", {})
        tokens = _kv_tokens(r)
        reference = bf16.get(_group(r))
        rows.append(
            {
                "model": meta.get("model"),
                "tensor_parallel_size": meta.get("tensor_parallel_size"),
                "cache": spec.label,
                "family": spec.family,
                "bytes_per_token_per_head": spec.bytes_per_token_per_head(
                    meta["head_dim"], meta.get("num_layers")
                ),
                "bits_per_element": spec.bits_per_element(meta["head_dim"], meta.get("num_layers")),
                "kv_cache_tokens": tokens,
                "kv_cache_tokens_logged": r.get("kv_cache_tokens_logged"),
                "kv_cache_tokens_config": (r.get("capacity") or {}).get("kv_cache_tokens_config"),
                "staging_gib": r.get("staging_gib_logged"),
                "startup_s": r.get("startup_seconds"),
                "status": r.get("status"),
                "error": _first_line(r.get("error")),
                "problems": _kvarn_problems(r, reference),
            }
        )
    rows += [dict(row) for row in extra_rows]
    _capacity_ratios(rows, "vs_bf16")
    header = [
        "model",
        "cache",
        "bits/elem",
        "KV tokens",
        "vs bf16",
        "staging GiB",
        "start s",
        "status",
    ]
    table_rows = [
        [
            f"{row['model']} tp{row['tensor_parallel_size']}",
            row["cache"],
            _fmt(row["bits_per_element"], ".2f"),
            _fmt(row["kv_cache_tokens"]),
            _fmt(row["vs_bf16"], ".2f"),
            _fmt(row["staging_gib"], ".2f"),
            _fmt(row["startup_s"], ".0f"),
            _status_text(row),
        ]
        for row in rows
    ]
    title = (
        f"capacity: KV cache tokens, gpu_memory_utilization {settings.get('gpu_memory_utilization')}, "
        f"max_num_seqs {settings.get('max_num_seqs')}, max_model_len {settings.get('max_model_len')}"
    )
    return {
        "suite": "capacity",
        "kind": "capacity",
        "settings": settings,
        "rows": rows,
        "tables": [{"title": title, "header": header, "rows": table_rows}],
    }


def _graphs_text(settings: dict[str, Any]) -> str:
    """``eager``, ``CUDA graphs`` or ``CUDA graphs at batch sizes 1, 2, ...``."""
    if settings.get("enforce_eager"):
        return "eager"
    sizes = (settings.get("compilation_config") or {}).get("cudagraph_capture_sizes")
    return f"CUDA graphs at batch sizes {', '.join(map(str, sizes))}" if sizes else "CUDA graphs"


def _status_text(row: dict[str, Any]) -> str:
    text = str(row.get("status"))
    if row.get("error") and row.get("status") != "ok":
        text += f": {row['error'][:80]}"
    if row.get("problems"):
        text += " CHECK: " + "; ".join(row["problems"])
    return text


def throughput_result(
    records: Sequence[dict[str, Any]],
    settings: dict[str, Any],
    extra_rows: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """The ``throughput`` suite's result: one row per (model, cache, prompt length).

    Ratios are against the first bf16 cache of the same model and prompt length.

    Args:
        records: one per (model, cache), each with its bursts.
        settings: what the run was asked for.
        extra_rows: finished rows (from a stored ``results.json`` whose run records are gone),
            appended after the records' rows; ratios are computed over all rows.
    """
    rows = []
    for r in records:
        spec, meta = _spec(r), r.get("meta", {})
        tokens = _kv_tokens(r)
        bursts = r.get("bursts") or {}
        lens = r.get("workload", {}).get("prompt_lens") or [int(k) for k in bursts]
        for prompt_len in lens:
            burst = bursts.get(str(prompt_len))
            row = {
                "model": meta.get("model"),
                "tensor_parallel_size": meta.get("tensor_parallel_size"),
                "cache": spec.label,
                "family": spec.family,
                "bits_per_element": spec.bits_per_element(meta["head_dim"], meta.get("num_layers")),
                "prompt_len": int(prompt_len),
                "output_len": r.get("workload", {}).get("output_len"),
                "kv_cache_tokens": tokens,
                "status": "ok" if burst and "seconds" in burst else r.get("status"),
                "error": _first_line((burst or {}).get("error") or r.get("error")),
            }
            if burst and "seconds" in burst:
                row.update(burst)
            elif r.get("status") == "ok":
                row["status"] = "missing"
            rows.append(row)
    rows += [dict(row) for row in extra_rows]
    _capacity_ratios(rows, "capacity_vs_bf16")
    base: dict[tuple[str, int, int], float] = {}
    for row in rows:
        key = (row["model"], row["tensor_parallel_size"], row["prompt_len"])
        if row["family"] == "bf16" and row.get("total_tok_per_s") and key not in base:
            base[key] = row["total_tok_per_s"]
    for row in rows:
        ref = base.get((row["model"], row["tensor_parallel_size"], row["prompt_len"]))
        row["throughput_vs_bf16"] = (
            row["total_tok_per_s"] / ref if ref and row.get("total_tok_per_s") else None
        )
    header = [
        "model", "prompt", "cache", "KV tokens", "x cap", "requests", "total tok/s",
        "out tok/s", "x bf16", "TTFT p50 s", "TTFT p90 s", "prefill phase tok/s", "TPOT p50 ms",
        "TPOT p90 ms", "status",
    ]  # fmt: skip
    table_rows = []
    for row in rows:
        tpot50, tpot90 = row.get("tpot_s_p50"), row.get("tpot_s_p90")
        table_rows.append(
            [
                f"{row['model']} tp{row['tensor_parallel_size']}",
                str(row["prompt_len"]),
                row["cache"],
                _fmt(row["kv_cache_tokens"]),
                _fmt(row["capacity_vs_bf16"], ".2f"),
                _fmt(row.get("requests"), "d"),
                _fmt(row.get("total_tok_per_s")),
                _fmt(row.get("output_tok_per_s")),
                _fmt(row["throughput_vs_bf16"], ".2f"),
                _fmt(row.get("ttft_s_p50"), ".2f"),
                _fmt(row.get("ttft_s_p90"), ".2f"),
                _fmt(row.get("prefill_phase_tok_per_s")),
                _fmt(None if tpot50 is None else 1e3 * tpot50, ".1f"),
                _fmt(None if tpot90 is None else 1e3 * tpot90, ".1f"),
                _status_text(row),
            ]
        )
    title = (
        f"throughput: bursts of random-token prompts, {settings.get('output_len')} tokens out "
        f"(greedy, ignore_eos), requests {settings.get('requests') or 'filling ' + format(settings.get('fill', 1.0), '.0%') + ' of each cache'}, "
        f"max_num_seqs {settings.get('max_num_seqs')}, "
        f"{_graphs_text(settings)}; ratios vs the first bf16 cache"
    )
    return {
        "suite": "throughput",
        "kind": "throughput",
        "settings": settings,
        "rows": rows,
        "tables": [{"title": title, "header": header, "rows": table_rows}],
        "plot_file": "serving",
    }


def _model_row(record: dict[str, Any], reference: dict[str, Any] | None) -> dict[str, Any]:
    """The columns every row of a real-model suite (greedy, perplexity) starts with."""
    spec, meta = _spec(record), record.get("meta", {})
    return {
        "method": meta.get("label", spec.label),
        "cache": spec.label,
        "family": spec.family,
        "role": meta.get("role"),
        "bits_per_element": spec.bits_per_element(meta["head_dim"], meta.get("num_layers")),
        "kv_cache_tokens": _kv_tokens(record),
        "status": record.get("status"),
        "error": _first_line(record.get("error")),
        "is_reference": record is reference,
    }


def greedy_result(records: Sequence[dict[str, Any]], settings: dict[str, Any]) -> dict[str, Any]:
    """The ``vllm_greedy`` suite's result: each run's greedy tokens against the reference's.

    Args:
        records: the reference (``meta.role == "reference"``), noise and compared runs.
        settings: what the run was asked for.
    """
    from kvarn_eval.fidelity import compare_outputs

    def first(role: str) -> dict[str, Any] | None:
        return next(
            (r for r in records if r.get("meta", {}).get("role") == role and r.get("outputs")),
            None,
        )

    # Without the reference run (it failed or was skipped), the noise run (the same bf16 cache,
    # another batch size) stands in, and the title says so.
    reference = first("reference")
    stand_in = reference is None and first("noise") is not None
    if stand_in:
        reference = first("noise")
    rows = []
    for r in records:
        row = _model_row(r, reference)
        if reference is not None and r.get("outputs") and r is not reference:
            try:
                row.update(compare_outputs(reference["outputs"], r["outputs"]))
            except ValueError as exc:
                row["error"] = str(exc)
        rows.append(row)
    header = [
        "cache", "bits/elem", "token agree %", "exact %", "mean LCP", "first token %",
        "KV tokens", "status",
    ]  # fmt: skip
    table_rows = [
        [
            row["method"] + (" (reference)" if row["is_reference"] else ""),
            _fmt(row["bits_per_element"], ".2f"),
            _fmt(_pct(row.get("token_agreement")), ".1f"),
            _fmt(_pct(row.get("exact_match")), ".0f"),
            _fmt(row.get("mean_lcp"), ".1f"),
            _fmt(_pct(row.get("first_token_agreement")), ".0f"),
            _fmt(row["kv_cache_tokens"]),
            _status_text(row),
        ]
        for row in rows
    ]
    title = (
        f"vllm_greedy: {settings.get('greedy_prompts')} prompts"
        + (
            f" after {settings['greedy_context_tokens']}-token passages"
            if settings.get("greedy_context_tokens")
            else ""
        )
        + f" x {settings.get('greedy_tokens')} greedy tokens through vLLM, {settings.get('model')}"
        "; agreement with the reference"
        + ("" if reference else " (NO REFERENCE RUN: nothing compared)")
        + (
            " (the reference run failed: the noise run, same cache with another batch size, "
            "stands in, so there is no noise row)"
            if stand_in
            else ""
        )
    )
    return _model_result(
        "vllm_greedy",
        "greedy",
        settings,
        reference,
        rows,
        {"title": title, "header": header, "rows": table_rows},
        [
            (row, 100 * row["token_agreement"])
            for row in rows
            if row.get("token_agreement") is not None
        ],
        "greedy token agreement with the reference (%)",
    )


def perplexity_result(
    records: Sequence[dict[str, Any]], settings: dict[str, Any]
) -> dict[str, Any]:
    """The ``vllm_perplexity`` suite's result: perplexity of each run, its change against the
    reference paired chunk by chunk (standard error), and the share of positions whose top-1
    token equals the reference's.

    Args:
        records: the reference (``meta.role == "reference"``), noise and compared runs.
        settings: what the run was asked for.
    """
    from kvarn_eval.accuracy.summary import paired_change

    def scored(r: dict[str, Any]) -> bool:
        return bool(r.get("chunk_nll"))

    reference = next(
        (r for r in records if r.get("meta", {}).get("role") == "reference" and scored(r)), None
    )
    rows = []
    for r in records:
        row = _model_row(r, reference)
        if scored(r):
            nll = [float(x) for x in r["chunk_nll"]]
            row["perplexity"] = math.exp(sum(nll) / len(nll))
            row["chunks"] = len(nll)
        if reference is not None and scored(r) and r is not reference:
            base = [float(x) for x in reference["chunk_nll"]]
            if len(base) != len(r["chunk_nll"]):
                row["problems"] = ["scored another number of chunks than the reference"]
            else:
                row["ppl_change_pct"], row["ppl_change_se"] = paired_change(
                    [float(x) for x in r["chunk_nll"]], base
                )
                pairs = [
                    (a, b)
                    for mine, ref in zip(r["top1"], reference["top1"], strict=True)
                    for a, b in zip(mine, ref, strict=True)
                ]
                row["top1_agreement"] = sum(a == b for a, b in pairs) / max(len(pairs), 1)
        rows.append(row)
    header = [
        "cache", "bits/elem", "perplexity", "change %", "top-1 agree %", "KV tokens", "status",
    ]  # fmt: skip
    table_rows = [
        [
            row["method"] + (" (reference)" if row["is_reference"] else ""),
            _fmt(row["bits_per_element"], ".2f"),
            _fmt(row.get("perplexity"), ".3f"),
            "-"
            if row.get("ppl_change_pct") is None
            else f"{row['ppl_change_pct']:+.2f} ± {row['ppl_change_se']:.2f}",
            _fmt(_pct(row.get("top1_agreement")), ".1f"),
            _fmt(row["kv_cache_tokens"]),
            _status_text(row),
        ]
        for row in rows
    ]
    title = (
        f"vllm_perplexity: {settings.get('ppl_chunks')} chunks x {settings.get('ppl_tokens')} "
        f"tokens of {settings.get('text_source', 'text')}, prefill chunks of "
        f"{settings.get('ppl_chunk_size')} tokens (each attends to the cache the earlier ones "
        f"wrote), {settings.get('model')}; change against the reference, paired by chunk"
        + ("" if reference else " (NO REFERENCE RUN: nothing compared)")
    )
    return _model_result(
        "vllm_perplexity",
        "perplexity",
        settings,
        reference,
        rows,
        {"title": title, "header": header, "rows": table_rows},
        [(row, row["ppl_change_pct"]) for row in rows if row.get("ppl_change_pct") is not None],
        "perplexity change against the reference (%)",
    )


def _model_result(
    suite: str,
    kind: str,
    settings: dict[str, Any],
    reference: dict[str, Any] | None,
    rows: list[dict[str, Any]],
    table: dict[str, Any],
    points: list[tuple[dict[str, Any], float]],
    ylabel: str,
) -> dict[str, Any]:
    """The result of a real-model suite: its rows and table, and ``points`` (row, y) plotted
    against bits per element in a panel that names the model (the numbers mean little
    without it)."""
    return {
        "suite": suite,
        "kind": kind,
        "settings": settings,
        "reference": None if reference is None else reference.get("meta", {}).get("label"),
        "rows": rows,
        "tables": [table],
        "plot_file": "accuracy",
        "points": [
            {"label": row["method"], "family": row["family"], "x": row["bits_per_element"], "y": y}
            for row, y in points
        ],
        "axes": {
            "xlabel": "bits per element (scales included, log scale)",
            "ylabel": ylabel,
            "title": f"{suite}, {Path(str(settings.get('model') or '?')).name}",
        },
    }


def _pct(value: float | None) -> float | None:
    return None if value is None else 100 * value


def settings_of(opts: ServingOptions) -> dict[str, Any]:
    """The options as stored in results (``max_model_len`` included).

    Args:
        opts: the GPU options.
    """
    return {**asdict(opts), "max_model_len": opts.max_model_len}
