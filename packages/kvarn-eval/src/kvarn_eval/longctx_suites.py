"""Registration, options and command-line arguments of the long-context suites.

* ``longctx`` (GPU): :mod:`kvarn_eval.gpu_longctx` through vLLM, model ``--greedy-model``
  (default ``--model``).
* ``longctx_cpu``: the same tasks under pseudo-decode on CPU
  (:mod:`kvarn_eval.accuracy.longctx`), at ``--longctx-cpu-lengths`` (2K by default), for
  CI-sized checks.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvarn_eval.longctx import DEFAULT_CPU_METHODS, DEFAULT_LENGTHS, TASKS, LongCtxOptions
from kvarn_eval.suites import BenchContext, BenchOptions, Suite, int_list, register_suite

__all__ = ["add_longctx_arguments", "longctx_options_from_args"]


def _ints(text: str) -> tuple[int, ...]:
    """Comma-separated integers of any sign (the lengths' bounds are LongCtxOptions')."""
    return int_list(text, positive=False)


def add_longctx_arguments(bench: argparse.ArgumentParser) -> None:
    """The ``--longctx-*`` options of ``kvarn-eval bench``."""
    d = LongCtxOptions()
    group = bench.add_argument_group(
        "long-context suites (longctx on the GPU through vLLM, longctx_cpu under pseudo-decode)"
    )
    group.add_argument(
        "--longctx-tasks",
        default=",".join(d.tasks),
        help=f"tasks, comma-separated, some of {', '.join(TASKS)} ({','.join(d.tasks)}; "
        "the other four ask in the instruction style, see docs/long-context.md)",
    )
    group.add_argument(
        "--longctx-lengths",
        type=_ints,
        default=d.lengths,
        help="context lengths of longctx, capped by the model's positions "
        f"({','.join(map(str, DEFAULT_LENGTHS))})",
    )
    group.add_argument(
        "--longctx-items",
        type=int,
        default=d.items,
        help=f"questions per task and length ({d.items})",
    )
    group.add_argument("--longctx-seed", type=int, default=d.seed, help="seed of the contexts (0)")
    group.add_argument(
        "--longctx-caches",
        default=d.caches,
        help=f"caches of longctx; the first bf16 one is the reference ({d.caches})",
    )
    group.add_argument(
        "--longctx-gen-prompts",
        type=int,
        default=d.longgen_prompts,
        help=f"WikiText-2 passages continued greedily ({d.longgen_prompts}; 0: none)",
    )
    group.add_argument(
        "--longctx-gen-context",
        type=int,
        default=d.longgen_context,
        help=f"tokens per passage ({d.longgen_context})",
    )
    group.add_argument(
        "--longctx-gen-tokens",
        type=int,
        default=d.longgen_tokens,
        help=f"greedy tokens after each passage ({d.longgen_tokens})",
    )
    group.add_argument(
        "--longctx-noise-max-num-seqs",
        type=int,
        default=d.noise_max_num_seqs,
        help="the noise run: the reference cache on the passages with this max_num_seqs "
        f"({d.noise_max_num_seqs}; 0 skips it)",
    )
    group.add_argument(
        "--longctx-prefill-chunk",
        type=int,
        default=d.prefill_chunk,
        help="prompt tokens per prefill step in longctx, prefix caching off, so that every "
        "chunk reads the earlier ones from the cache as stored (pseudo-decode through the real "
        f"kernels; {d.prefill_chunk}, a kvarn tile); 0: vLLM's defaults",
    )
    group.add_argument(
        "--longctx-cpu-lengths",
        type=_ints,
        default=d.cpu_lengths,
        help=f"context lengths of longctx_cpu ({','.join(map(str, d.cpu_lengths))})",
    )
    group.add_argument(
        "--longctx-cpu-items",
        type=int,
        default=d.cpu_items,
        help=f"questions per task and length in longctx_cpu ({d.cpu_items})",
    )
    group.add_argument(
        "--longctx-cpu-methods",
        default=d.cpu_methods,
        help=f"methods of longctx_cpu ({DEFAULT_CPU_METHODS})",
    )


def longctx_options_from_args(args: argparse.Namespace) -> LongCtxOptions:
    """Validated :class:`LongCtxOptions` from parsed ``bench`` arguments."""
    return LongCtxOptions(
        tasks=tuple(t.strip() for t in args.longctx_tasks.split(",") if t.strip()),
        lengths=tuple(args.longctx_lengths),
        items=args.longctx_items,
        seed=args.longctx_seed,
        caches=args.longctx_caches,
        longgen_prompts=args.longctx_gen_prompts,
        longgen_context=args.longctx_gen_context,
        longgen_tokens=args.longctx_gen_tokens,
        noise_max_num_seqs=args.longctx_noise_max_num_seqs,
        prefill_chunk=args.longctx_prefill_chunk,
        cpu_lengths=tuple(args.longctx_cpu_lengths),
        cpu_items=args.longctx_cpu_items,
        cpu_methods=args.longctx_cpu_methods,
    )


def _plot(ctx: BenchContext, result: dict[str, Any], name: str) -> None:
    from kvarn_eval.gpu_longctx import plot_longctx  # imported before the suite runs, too

    try:
        path = plot_longctx(result, ctx.out_dir / f"{name}.png")
    except Exception as exc:  # the plot is a by-product: a failure must not lose the result
        ctx.echo(f"{name}: no plot ({type(exc).__name__}: {exc})")
        return
    if path is not None:
        result["plot"] = str(path)
        ctx.echo(f"wrote {path}")


def _longctx(ctx: BenchContext) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from kvarn_eval.data import find_wikitext
    from kvarn_eval.gpu_longctx import (
        _max_positions,
        longctx_jobs,
        longctx_result,
        write_prompts,
    )
    from kvarn_eval.gpu_suites import _run_model_suite
    from kvarn_eval.longctx import build_cells
    from kvarn_eval.models import resolve_model_dir
    from kvarn_eval.suites import text_chunks

    lo, serving = ctx.options.longctx, ctx.options.serving
    model_dir = resolve_model_dir(serving.greedy_model or ctx.options.model)
    text, source = find_wikitext(ctx.options.text_file)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    limit = _max_positions(model_dir)
    cells = build_cells(
        tokenizer, text, lo.tasks, lo.lengths, lo.items,
        seed=lo.seed, max_positions=limit,
    )  # fmt: skip
    gen_len = min(lo.longgen_context, (limit or 10**9) - lo.longgen_tokens - 16)
    passages = (
        text_chunks(tokenizer, text, lo.longgen_prompts, gen_len) if lo.longgen_prompts else []
    )
    prompts = write_prompts(cells, passages, ctx.out_dir / "runs" / "longctx")
    jobs = longctx_jobs(
        lo, model_dir, prompts, len(passages),
        engine_in_process=serving.engine_in_process,
        gpu_memory_utilization=serving.greedy_gpu_memory_utilization,
    )  # fmt: skip
    settings = {
        **vars(lo),
        "model": model_dir,
        "max_positions": limit,
        "longgen_context": gen_len,
        "text_source": source,
        "cells": {f"{t}/{n}": len(c) for (t, n), c in cells.items()},
    }
    result = _run_model_suite(ctx, "longctx", jobs, longctx_result, settings)
    _plot(ctx, result, "longctx")
    return result


def _longctx_cpu(ctx: BenchContext) -> dict[str, Any]:
    from kvarn_eval import gpu_longctx  # noqa: F401 (the plot's module, loaded with the rest)
    from kvarn_eval.accuracy.longctx import evaluate_longctx, longctx_tables
    from kvarn_eval.data import find_wikitext
    from kvarn_eval.longctx import build_cells

    opts, lo = ctx.options, ctx.options.longctx
    lm = ctx.model
    methods, skipped = ctx.methods(lo.cpu_methods)
    text, source = find_wikitext(opts.text_file)
    limit = getattr(lm.model.config, "max_position_embeddings", None)
    cells = build_cells(
        lm.tokenizer, text, lo.tasks, lo.cpu_lengths, lo.cpu_items,
        seed=lo.seed, max_positions=limit,
    )  # fmt: skip
    advance = ctx.progress("longctx_cpu", len(cells) * len(methods))
    out = evaluate_longctx(
        lm.model, cells, methods, decode=lm.tokenizer.decode, reference=opts.reference,
        block_size=opts.block_size, exact_first_block=opts.exact_first_block,
        recent_blocks=opts.recent_blocks, advance=advance,
    )  # fmt: skip
    title = (
        f"longctx_cpu: retrieval under pseudo-decode (blocks of {opts.block_size}, "
        f"{opts.recent_blocks} recent exact), {opts.model}; change against {opts.reference} "
        "± its standard error paired by item, clustered by context"
    )
    result = {
        "suite": "longctx_cpu",
        "kind": "longctx_cpu",
        "settings": {**vars(lo), "text_source": source, "max_positions": limit},
        "skipped": skipped,
        **{k: v for k, v in out.items() if k != "rows"},
        "retrieval": [{**r, "cache": r["method"]} for r in out["rows"]],
        "tables": longctx_tables(out["rows"], title),
    }
    _plot(ctx, result, "longctx_cpu")
    return result


def _check_longctx(options: BenchOptions) -> None:
    from kvarn_eval.serving.caches import parse_caches
    from kvarn_eval.serving.suites import check_vllm

    parse_caches(options.longctx.caches)
    check_vllm()


register_suite(
    Suite(
        "longctx",
        "long-context retrieval (magic numbers by completion; passkey, multi-key, multi-value, "
        "key-value lookup on request; at 2K-32K tokens) and 1K-token greedy generations after long prompts through vLLM, every "
        "cache against bf16 (GPU)",
        _longctx,
        needs_gpu=True,
        loads_model=False,
        preflight=_check_longctx,
    )
)
register_suite(
    Suite(
        "longctx_cpu",
        "long-context retrieval under pseudo-decode (CPU; 2K by default, "
        "--longctx-cpu-lengths, --longctx-cpu-items, --longctx-cpu-methods)",
        _longctx_cpu,
    )
)
