"""The suites that need a GPU, registered in :data:`kvarn_eval.suites.SUITES`.

* ``kernels``: kvarn-kernels' microbenchmark (``python -m kvarn_kernels.bench``) in a child
  process: decode attention time, GB/s and share of the measured HBM bandwidth against fp16
  baselines, quantize-on-write cost.
* ``throughput``: burst throughput, TTFT and TPOT per model shape, cache and prompt length
  (vLLM, dummy weights); records each engine's KV capacity too.
* ``capacity``: KV cache tokens per model shape and cache (reuses ``throughput``'s engines).
* ``vllm_greedy``: greedy-generation fidelity through vLLM's real kernels against bf16.
* ``vllm_perplexity``: perplexity of a real model through vLLM's real kernels, prefilling in
  tile-sized chunks (pseudo-decode), against bf16.

Nothing here imports vLLM, torch or Triton (the perplexity suite's tokenizer comes from
``transformers``): every engine and the kernel benchmark run in their
own processes (:mod:`kvarn_eval.serving.runner`).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvarn_eval.serving.options import ServingOptions
from kvarn_eval.serving.runner import Budget
from kvarn_eval.serving.suites import (
    capacity_result,
    check_vllm,
    greedy_jobs,
    greedy_result,
    perplexity_jobs,
    perplexity_result,
    run_jobs,
    serving_jobs,
    settings_of,
    throughput_result,
)
from kvarn_eval.suites import BenchContext, BenchOptions, Suite, register_suite

__all__ = ["kernel_result"]


def _budget(ctx: BenchContext) -> Budget:
    budget = ctx.shared.get("budget")
    if budget is None:
        budget = Budget(ctx.options.serving.max_seconds, started=ctx.started)
        ctx.shared["budget"] = budget
    return budget


def _engine_suite(kind: str) -> Any:
    def run(ctx: BenchContext) -> dict[str, Any]:
        opts = ctx.options.serving
        jobs = serving_jobs(opts, ctx.out_dir / "models", kind)
        settings = settings_of(opts)
        build = throughput_result if kind == "throughput" else capacity_result
        records = run_jobs(
            jobs,
            ctx.out_dir / "runs" / kind,
            opts,
            _budget(ctx),
            reuse=ctx.shared.setdefault("engine_records", {}),
            echo=ctx.echo,
            on_record=lambda done: ctx.checkpoint(build(done, settings)),
        )
        return build(records, settings)

    return run


def _vllm_greedy(ctx: BenchContext) -> dict[str, Any]:
    from kvarn_eval.models import resolve_model_dir

    opts = ctx.options.serving
    model_dir = resolve_model_dir(opts.greedy_model or ctx.options.model)
    settings = {**settings_of(opts), "model": model_dir}
    contexts = None
    if opts.greedy_context_tokens:
        from transformers import AutoTokenizer

        from kvarn_eval.data import find_wikitext
        from kvarn_eval.suites import text_chunks

        text, source = find_wikitext(ctx.options.text_file)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        # distinct consecutive passages, one per prompt, without the BOS the prompt gets anyway
        passages = text_chunks(tokenizer, text, opts.greedy_prompts, opts.greedy_context_tokens)
        bos = tokenizer.bos_token_id
        contexts = [
            str(tokenizer.decode(p[1:] if p and p[0] == bos and bos is not None else p))
            for p in passages
        ]
        settings["context_source"] = source
    jobs = greedy_jobs(opts, model_dir, contexts)
    return _run_model_suite(ctx, "vllm_greedy", jobs, greedy_result, settings)


def _run_model_suite(
    ctx: BenchContext, suite: str, jobs: Any, build: Any, settings: dict[str, Any]
) -> dict[str, Any]:
    """Run a real-model suite's engines in turn, checkpointing ``build``'s partial result."""
    records = run_jobs(
        jobs,
        ctx.out_dir / "runs" / suite,
        ctx.options.serving,
        _budget(ctx),
        echo=ctx.echo,
        on_record=lambda done: ctx.checkpoint(build(done, settings)),
    )
    return build(records, settings)


def _vllm_perplexity(ctx: BenchContext) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from kvarn_eval.data import find_wikitext
    from kvarn_eval.models import resolve_model_dir
    from kvarn_eval.suites import text_chunks

    opts = ctx.options.serving
    model_dir = resolve_model_dir(opts.greedy_model or ctx.options.model)
    text, source = find_wikitext(ctx.options.text_file)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chunks = text_chunks(tokenizer, text, opts.ppl_chunks, opts.ppl_tokens)
    settings = {**settings_of(opts), "model": model_dir, "text_source": source}
    jobs = perplexity_jobs(opts, model_dir, chunks)
    return _run_model_suite(ctx, "vllm_perplexity", jobs, perplexity_result, settings)


def _check_serving(options: BenchOptions) -> None:
    check_vllm()


def _check_kernels(options: BenchOptions) -> None:
    from kvarn_eval.models import MissingDependencyError

    for module in ("kvarn_kernels", "triton", "torch"):
        if importlib.util.find_spec(module) is None:
            raise MissingDependencyError(
                f"the kernels suite needs {module!r}: pip install -e packages/kvarn-kernels "
                "(torch and triton come with it)"
            )


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def kernel_result(report: dict[str, Any] | None, status: str, error: str = "") -> dict[str, Any]:
    """The ``kernels`` suite's result from ``kvarn_kernels.bench``'s JSON report.

    Args:
        report: the benchmark's JSON (``None`` when it wrote none).
        status: ``ok``, ``failed`` or ``timeout``.
        error: what went wrong, if anything.
    """
    report = report or {}
    attention = report.get("attention", [])
    header = [
        "preset", "shape", "batch", "context", "time us", "GB/s", "of HBM", "SDPA fp16 us",
        "x SDPA", "vLLM Triton fp16 us", "x vLLM",
    ]  # fmt: skip
    rows = [
        [
            str(r.get("preset")),
            str(r.get("shape")),
            str(r.get("batch")),
            str(r.get("context")),
            _fmt(r.get("time_us"), ".1f"),
            _fmt(r.get("gbps"), ".0f"),
            _fmt(None if r.get("hbm_fraction") is None else 100 * r["hbm_fraction"], ".1f"),
            _fmt(r.get("sdpa_fp16_us"), ".1f"),
            _fmt(r.get("speedup_vs_sdpa"), ".2f"),
            _fmt(r.get("vllm_triton_fp16_us"), ".1f"),
            _fmt(r.get("speedup_vs_vllm_triton"), ".2f"),
        ]
        for r in attention
    ]
    store_header = ["preset", "shape", "store typical step us", "worst step us", "per tile us"]
    store_rows = [
        [
            str(s.get("preset")),
            str(s.get("shape")),
            _fmt(
                None
                if s.get("store_step_typical_ms") is None
                else 1e3 * s["store_step_typical_ms"],
                ".1f",
            ),
            _fmt(
                None if s.get("store_step_worst_ms") is None else 1e3 * s["store_step_worst_ms"],
                ".1f",
            ),
            _fmt(s.get("store_per_tile_us"), ".2f"),
        ]
        for s in report.get("store", [])
    ]
    gbps = report.get("hbm_copy_gbps")
    title = (
        f"kernels: decode attention on {report.get('gpu', '?')}, copy bandwidth "
        f"{_fmt(gbps, '.0f')} GB/s, {report.get('dtype', '?')}, key frames "
        f"{report.get('key_frame', '?')}, staged windows {report.get('windows', '?')}, "
        f"status {status}" + (f": {error}" if error else "")
    )
    tables = [{"title": title, "header": header, "rows": rows}]
    if store_rows:
        tables.append(
            {"title": "kernels: quantize-on-write cost", "header": store_header, "rows": store_rows}
        )
    return {
        "suite": "kernels",
        "kind": "kernels",
        "status": status,
        "error": error,
        "notes": report.get("notes", []),
        "report": report,
        "tables": tables,
    }


def kernel_command(opts: ServingOptions, json_path: Path) -> list[str]:
    """The ``kernels`` suite's ``python -m kvarn_kernels.bench`` command line: the presets,
    key frames and staged windows of ``opts`` (by default as kvarn-vllm serves
    ``kvarn_k4v2_g128``), the JSON report at ``json_path``."""
    presets = [p.strip() for p in opts.kernel_presets.split(",") if p.strip()]
    cmd = [sys.executable, "-m", "kvarn_kernels.bench", "--out", str(json_path)]
    cmd += ["--presets", *presets, "--key-frame", opts.kernel_key_frame]
    cmd += ["--windows", opts.kernel_windows]
    return [*cmd, "--quick"] if opts.kernel_quick else cmd


def _kernels(ctx: BenchContext) -> dict[str, Any]:
    from kvarn_eval.serving.runner import sigterm_raises, stop_process_group

    opts = ctx.options.serving
    out = ctx.out_dir / "runs" / "kernels"
    out.mkdir(parents=True, exist_ok=True)
    json_path, log_path = out / "kernels.json", out / "kernels.log"
    cmd = kernel_command(opts, json_path)
    timeout = _budget(ctx).timeout_for(opts.run_timeout)
    if timeout is None:
        return kernel_result(None, "skipped", "time budget (--max-seconds) spent")
    ctx.echo(f"kernels: {' '.join(cmd[1:])} (timeout {timeout:.0f} s)")
    start = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    with sigterm_raises():
        try:
            proc.wait(timeout=timeout)
            status = "ok" if proc.returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            status = "timeout"
        finally:
            stop_process_group(proc, grace=10.0)
    report = None
    if json_path.is_file():
        report = json.loads(json_path.read_text())
    error = ""
    if status != "ok":
        tail = log_path.read_text(errors="replace").strip().splitlines()
        error = f"{status} after {time.monotonic() - start:.0f} s" + (
            f": {tail[-1][:200]}" if tail else ""
        )
    ctx.echo(f"[{status}] kernels ({time.monotonic() - start:.0f} s)")
    result = kernel_result(report, status, error)
    result["log"] = str(log_path)
    return result


register_suite(
    Suite(
        "kernels",
        "kvarn-kernels microbenchmark: decode attention GB/s vs fp16 baselines, store cost (GPU)",
        _kernels,
        needs_gpu=True,
        loads_model=False,
        preflight=_check_kernels,
    )
)
register_suite(
    Suite(
        "throughput",
        "vLLM burst throughput, TTFT, TPOT and KV capacity per model shape and cache (GPU)",
        _engine_suite("throughput"),
        needs_gpu=True,
        loads_model=False,
        preflight=_check_serving,
    )
)
register_suite(
    Suite(
        "capacity",
        "vLLM KV cache capacity in tokens per model shape and cache (GPU)",
        _engine_suite("capacity"),
        needs_gpu=True,
        loads_model=False,
        preflight=_check_serving,
        after=("throughput",),  # reuses its engines' records instead of starting them again
    )
)
register_suite(
    Suite(
        "vllm_greedy",
        "greedy-generation agreement with bf16 through vLLM's real kernels (GPU)",
        _vllm_greedy,
        needs_gpu=True,
        loads_model=False,
        preflight=_check_serving,
    )
)
register_suite(
    Suite(
        "vllm_perplexity",
        "perplexity through vLLM's real kernels, prefilled in tile-sized chunks, against bf16 (GPU)",
        _vllm_perplexity,
        needs_gpu=True,
        loads_model=False,
        preflight=_check_serving,
    )
)
