"""``kvarn-eval``: the command line.

kvarn-eval bench                  accuracy on SmolLM2-135M (about ten minutes on 2 CPU cores)
kvarn-eval bench --quick          a smoke run (a minute or two)
kvarn-eval bench --suites all --methods kvarn,bf16 --items 200 --out results/
kvarn-eval bench --suites throughput --gpu-models qwen3-8b --caches bf16@FLASH_ATTN,kvarn
kvarn-eval report DIR [DIR ...]   tables and plots again, merging the GPU runs of several DIRs
kvarn-eval list                   suites, methods and built-in models
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvarn_eval import __version__
from kvarn_eval.longctx_suites import add_longctx_arguments, longctx_options_from_args
from kvarn_eval.models import BUILTIN_MODELS, DEFAULT_MODEL, MissingDependencyError
from kvarn_eval.serving.options import KERNEL_KEY_FRAMES, KERNEL_WINDOWS, ServingOptions
from kvarn_eval.suites import (
    DEFAULT_SUITES,
    DEFAULT_TASK_METHODS,
    SUITES,
    BenchContext,
    BenchOptions,
    Suite,
    explicit_suite_names,
    gpu_available,
    int_list,
    resolve_suites,
)

__all__ = ["build_parser", "main", "options_from_args"]

QUICK = {"num_chunks": 2, "chunk_len": 512, "items": 6}


# suites that serve --greedy-model (when given) instead of --model
_SERVED_MODEL_SUITES = frozenset({"vllm_greedy", "vllm_perplexity", "longctx"})


def _int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``, errors saying it expected ``what``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


_positive = _int_at_least(1, "a positive integer")
_non_negative = _int_at_least(0, "an integer >= 0")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def _add_gpu_arguments(bench: argparse.ArgumentParser) -> None:
    defaults = ServingOptions()
    gpu = bench.add_argument_group(
        "GPU suites (kernels, throughput, capacity, vllm_greedy, vllm_perplexity)",
        "Each vLLM engine runs in its own process; a crash or timeout is recorded and the run "
        "goes on. Per-run records land in OUT/runs/ as soon as each finishes.",
    )
    gpu.add_argument(
        "--gpu-models",
        default=",".join(defaults.gpu_models),
        help="model shapes with dummy weights for throughput and capacity "
        "(llama-3.1-8b, qwen3-8b, qwen3-32b; default all three)",
    )
    gpu.add_argument(
        "--caches",
        default=defaults.caches,
        help="KV caches: DTYPE[@BACKEND] comma-separated, or 'default', 'kvarn', 'turboquant' "
        "(default: bf16@FLASH_ATTN, bf16@TRITON_ATTN, fp8@TRITON_ATTN, every TurboQuant and "
        "kvarn preset)",
    )
    gpu.add_argument(
        "--prompt-lens",
        type=int_list,
        default=defaults.prompt_lens,
        help="prompt tokens of each throughput burst (default 4096,16384,32768)",
    )
    gpu.add_argument(
        "--output-len", type=_positive, default=defaults.output_len, help="tokens out (1024)"
    )
    gpu.add_argument(
        "--requests",
        type=_positive,
        default=None,
        help="requests per burst (default: as many as fill the cache, up to --max-num-seqs)",
    )
    gpu.add_argument(
        "--fill",
        type=_positive_float,
        default=defaults.fill,
        help="share of each KV cache a burst fills (default 1.0)",
    )
    gpu.add_argument(
        "--max-num-seqs",
        type=_positive,
        default=defaults.max_num_seqs,
        help="vLLM's concurrency limit for every cache (256; kvarn allocates staging per slot)",
    )
    gpu.add_argument(
        "--gpu-memory-utilization",
        type=_positive_float,
        default=defaults.gpu_memory_utilization,
        help="(0.9)",
    )
    gpu.add_argument(
        "--tensor-parallel-size", "--tp", type=_positive, default=1, help="GPUs per engine (1)"
    )
    gpu.add_argument("--eager", action="store_true", help="no CUDA graphs (capacity, throughput)")
    gpu.add_argument(
        "--cudagraph-sizes",
        type=int_list,
        default=None,
        help="batch sizes to capture CUDA graphs for in capacity and throughput engines, "
        "increasing, e.g. 1,2,4,8,16,32,64,128,256,512 (default: vLLM's 51 sizes up to 512); "
        "fewer start an engine sooner where capturing is slow",
    )
    gpu.add_argument(
        "--run-timeout",
        type=_positive_float,
        default=defaults.run_timeout,
        help=f"seconds before one engine run is killed ({defaults.run_timeout:.0f})",
    )
    gpu.add_argument(
        "--max-seconds",
        type=_positive_float,
        default=None,
        help="wall-clock budget of the whole bench: runs get what is left and are skipped "
        "when too little is (e.g. 540 inside a 10-minute call)",
    )
    gpu.add_argument(
        "--resume",
        action="store_true",
        help="keep the engine runs an earlier bench into the same --out finished ok with the "
        "same job (model, cache, engine arguments, workload, environment), and the CPU suites "
        "it finished with the same model and options, and run only the rest: a table that "
        "took more than one call, or a run that was killed, goes on where it stopped (it does "
        "not check that the code is the same)",
    )
    gpu.add_argument(
        "--engine-in-process",
        action="store_true",
        help="vLLM's engine core inside the worker process (VLLM_ENABLE_V1_MULTIPROCESSING=0)",
    )
    gpu.add_argument(
        "--greedy-model",
        default=None,
        help="model of vllm_greedy and vllm_perplexity (default --model; a .gguf file is "
        "converted once)",
    )
    gpu.add_argument(
        "--greedy-caches",
        default=defaults.greedy_caches,
        help=f"caches of vllm_greedy; the first bf16 one is the reference ({defaults.greedy_caches})",
    )
    gpu.add_argument(
        "--vllm-greedy-prompts",
        type=_positive,
        default=defaults.greedy_prompts,
        help=f"prompts of vllm_greedy ({defaults.greedy_prompts})",
    )
    gpu.add_argument(
        "--vllm-greedy-tokens",
        type=_positive,
        default=defaults.greedy_tokens,
        help=f"greedy tokens per prompt in vllm_greedy ({defaults.greedy_tokens})",
    )
    gpu.add_argument(
        "--vllm-greedy-context",
        type=int,
        default=defaults.greedy_context_tokens,
        help="tokens of --text put before each vllm_greedy prompt, a distinct passage each, so "
        "that the prompts read quantized tiles (0: the prompt set alone, which the exact first "
        "tile, window and open tile cover)",
    )
    gpu.add_argument(
        "--noise-max-num-seqs",
        type=int,
        default=defaults.greedy_noise_max_num_seqs,
        help="vllm_greedy's noise run: the reference cache again with this max_num_seqs "
        f"({defaults.greedy_noise_max_num_seqs}; 0 skips it)",
    )
    gpu.add_argument(
        "--ppl-caches",
        default=defaults.ppl_caches,
        help=f"caches of vllm_perplexity; the first bf16 one is the reference ({defaults.ppl_caches})",
    )
    gpu.add_argument(
        "--vllm-ppl-chunks",
        type=_positive,
        default=defaults.ppl_chunks,
        help=f"text chunks vllm_perplexity scores ({defaults.ppl_chunks}; the text is --text)",
    )
    gpu.add_argument(
        "--vllm-ppl-tokens",
        type=_positive,
        default=defaults.ppl_tokens,
        help=f"tokens per chunk in vllm_perplexity ({defaults.ppl_tokens})",
    )
    gpu.add_argument(
        "--vllm-ppl-chunk-size",
        type=_positive,
        default=defaults.ppl_chunk_size,
        help="vllm_perplexity's prefill chunk (tokens of each text per step, all texts side by "
        "side): "
        f"each attends to the cache the earlier ones wrote ({defaults.ppl_chunk_size}, a kvarn tile)",
    )
    gpu.add_argument("--kernel-quick", action="store_true", help="kvarn_kernels.bench --quick")
    gpu.add_argument(
        "--kernel-presets",
        default=defaults.kernel_presets,
        help=f"presets of the kernel benchmark ({defaults.kernel_presets})",
    )
    gpu.add_argument(
        "--kernel-key-frame",
        choices=KERNEL_KEY_FRAMES,
        default=defaults.kernel_key_frame,
        help="the kernel benchmark's key frames: auto, chosen per tile as kvarn-vllm stores "
        f"them, or rotated, the plain format ({defaults.kernel_key_frame})",
    )
    gpu.add_argument(
        "--kernel-windows",
        choices=KERNEL_WINDOWS,
        default=defaults.kernel_windows,
        help="what the kernel benchmark's decode attention reads from staging: values (the "
        "exact first and recent tiles' values, kvarn-vllm's default for 4-bit keys), keys "
        "(their keys too, its default for 2- and 3-bit keys) or open (the open tile only) "
        f"({defaults.kernel_windows})",
    )


def serving_options_from_args(args: argparse.Namespace) -> ServingOptions:
    """Validated :class:`ServingOptions` from parsed ``bench`` arguments.

    Args:
        args: the parsed ``bench`` arguments.
    """
    return ServingOptions(
        gpu_models=tuple(m.strip() for m in args.gpu_models.split(",") if m.strip()),
        caches=args.caches,
        prompt_lens=tuple(args.prompt_lens),
        output_len=args.output_len,
        requests=args.requests,
        fill=args.fill,
        max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
        enforce_eager=args.eager,
        cudagraph_capture_sizes=args.cudagraph_sizes,
        run_timeout=args.run_timeout,
        max_seconds=args.max_seconds,
        resume=args.resume,
        engine_in_process=args.engine_in_process,
        greedy_model=args.greedy_model,
        greedy_caches=args.greedy_caches,
        greedy_prompts=args.vllm_greedy_prompts,
        greedy_tokens=args.vllm_greedy_tokens,
        greedy_context_tokens=args.vllm_greedy_context,
        greedy_noise_max_num_seqs=args.noise_max_num_seqs,
        ppl_caches=args.ppl_caches,
        ppl_chunks=args.vllm_ppl_chunks,
        ppl_tokens=args.vllm_ppl_tokens,
        ppl_chunk_size=args.vllm_ppl_chunk_size,
        kernel_quick=args.kernel_quick,
        kernel_presets=args.kernel_presets,
        kernel_key_frame=args.kernel_key_frame,
        kernel_windows=args.kernel_windows,
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``kvarn-eval``."""
    parser = argparse.ArgumentParser(
        prog="kvarn-eval", description="Benchmarks of KVarN and other KV-cache formats."
    )
    parser.add_argument("--version", action="version", version=f"kvarn-eval {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser(
        "bench",
        help="run benchmark suites and write tables, JSON and plots",
        description=(
            "Accuracy under simulated KV-cache quantization (pseudo-decode, CPU): every method "
            "against the bf16 cache. Suites: "
            + "; ".join(f"{s.name}: {s.description}" for s in SUITES.values())
        ),
    )
    bench.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"built-in ({', '.join(BUILTIN_MODELS)}), a Hugging Face folder, or a hub name "
        f"(default {DEFAULT_MODEL})",
    )
    bench.add_argument(
        "--suites",
        default="default",
        help=f"comma-separated suites, 'default' ({','.join(DEFAULT_SUITES)}, plus GPU suites "
        "where a GPU exists) or 'all'",
    )
    bench.add_argument(
        "--methods",
        default="all",
        help="methods for perplexity suites: 'all', 'kvarn' or comma-separated names "
        "(see 'kvarn-eval list')",
    )
    bench.add_argument(
        "--task-methods",
        default=DEFAULT_TASK_METHODS,
        help="methods for task suites (one forward pass per item and method)",
    )
    bench.add_argument("--reference", default="bf16", help="method compared against (bf16)")
    bench.add_argument("--chunks", type=_positive, default=None, help="perplexity chunks (8)")
    bench.add_argument("--tokens", type=_positive, default=None, help="tokens per chunk (1024)")
    bench.add_argument("--items", type=_positive, default=None, help="items per task (24)")
    bench.add_argument(
        "--first-item",
        type=_non_negative,
        default=0,
        metavar="N",
        help="score items from index N on (0); a run with --first-item N extends one with "
        "--items N by new items, each prompted as in one longer run",
    )
    bench.add_argument(
        "--mmlu-subjects",
        default=None,
        help="comma-separated MMLU subjects of the mmlu suite (default: all 57, items taken "
        "round-robin across them; 'kvarn-eval list' names them)",
    )
    bench.add_argument(
        "--min-context",
        type=int,
        default=512,
        help="task prompts are filled with solved shots to this many tokens (512)",
    )
    bench.add_argument(
        "--block-size", type=_positive, default=128, help="pseudo-decode block (tile) size (128)"
    )
    bench.add_argument(
        "--no-exact-first-block",
        action="store_true",
        help="quantize the first block too (default: kept exact, like the attention sink)",
    )
    bench.add_argument(
        "--sink-tokens",
        type=int,
        default=None,
        metavar="N",
        help="keep only the first N tokens exact (0 <= N <= --block-size; 0: no sink, the "
        "block size: the default exact first block); the rest of the first block is read "
        "quantized like any earlier block",
    )
    bench.add_argument(
        "--sink-requantize",
        action="store_true",
        help="with --sink-tokens N: quantize the first block with its first N tokens replaced "
        "by copies of token N, keeping the sink out of its scales (they are read exact)",
    )
    bench.add_argument(
        "--recent-blocks",
        type=int,
        default=BenchOptions.recent_blocks,
        help="complete blocks before a query's own that every method reads exact, as a "
        "serving engine keeps them in staging (default 1: what kvarn-vllm serves, "
        "KVARN_VLLM_RECENT_TILES; 0: the published recipe)",
    )
    bench.add_argument("--text", default=None, help="perplexity text file instead of WikiText-2")
    bench.add_argument("--threads", type=_positive, default=None, help="torch CPU threads")
    bench.add_argument(
        "--out",
        default=None,
        help="output folder for results.json and accuracy.png "
        "(default kvarn-bench/<model>-<UTC time>)",
    )
    bench.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {QUICK['num_chunks']} chunks of {QUICK['chunk_len']} tokens, "
        f"{QUICK['items']} items per task (explicit sizes still win)",
    )
    bench.add_argument("--no-plot", action="store_true", help="skip the matplotlib plots")
    bench.add_argument(
        "--dry-run",
        action="store_true",
        help="print what each suite would run (methods, items, vLLM engines) and stop; GPU "
        "suites are listed as on a GPU machine, marked when they cannot run here",
    )
    bench.add_argument(
        "--greedy-prompts", type=_positive, default=8, help="prompts of the CPU greedy suite (8)"
    )
    bench.add_argument(
        "--greedy-prompt-len",
        type=_positive,
        default=None,
        help="tokens per prompt of the CPU greedy suite (384, or the fewest that read a "
        "quantized block at a larger --block-size)",
    )
    bench.add_argument(
        "--greedy-tokens",
        type=_positive,
        default=32,
        help="greedy tokens per prompt in the CPU greedy suite (32)",
    )
    _add_gpu_arguments(bench)
    add_longctx_arguments(bench)

    report_parser = sub.add_parser(
        "report",
        help="tables, JSON and plots again from bench output folders (merging their GPU runs)",
        description="Reads each DIR's results.json and the per-run records under DIR/runs/, "
        "merges the GPU runs of all DIRs into one table per suite, prints the tables and "
        "writes results.json, results.md and the plots into --out.",
    )
    report_parser.add_argument("dirs", nargs="+", help="bench output folders")
    report_parser.add_argument("--out", default=None, help="output folder (default: the first DIR)")
    report_parser.add_argument("--no-plot", action="store_true", help="skip the plots")

    sub.add_parser("list", help="list suites, methods and built-in models")
    return parser


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """Validated :class:`BenchOptions` from parsed ``bench`` arguments."""
    sizes = dict(QUICK) if args.quick else {"num_chunks": 8, "chunk_len": 1024, "items": 24}
    if args.chunks is not None:
        sizes["num_chunks"] = args.chunks
    if args.tokens is not None:
        sizes["chunk_len"] = args.tokens
    if args.items is not None:
        sizes["items"] = args.items
    # BenchOptions checks the range of --sink-tokens
    if args.sink_tokens is not None and args.no_exact_first_block:
        raise ValueError("give --sink-tokens or --no-exact-first-block, not both")
    if args.sink_requantize and args.sink_tokens is None:
        raise ValueError("--sink-requantize needs --sink-tokens N")
    return BenchOptions(
        model=args.model,
        methods=args.methods,
        task_methods=args.task_methods,
        reference=args.reference,
        num_chunks=sizes["num_chunks"],
        chunk_len=sizes["chunk_len"],
        items=sizes["items"],
        first_item=args.first_item,
        min_context_tokens=args.min_context,
        block_size=args.block_size,
        exact_first_block=not args.no_exact_first_block,
        sink_tokens=args.sink_tokens,
        sink_requantize=args.sink_requantize,
        recent_blocks=args.recent_blocks,
        text_file=args.text,
        threads=args.threads,
        greedy_prompts=args.greedy_prompts,
        greedy_prompt_len=(
            args.greedy_prompt_len or max(384, (2 + args.recent_blocks) * args.block_size)
        ),
        greedy_tokens=args.greedy_tokens,
        mmlu_subjects=args.mmlu_subjects,
        serving=serving_options_from_args(args),
        longctx=longctx_options_from_args(args),
    )


def _quiet_transformers() -> None:
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _list(console: Any) -> int:
    from kvarn_eval.accuracy.methods import available_methods

    console.print("[bold]suites[/]")
    for s in SUITES.values():
        default = " (default)" if s.name in DEFAULT_SUITES else ""
        console.print(f"  {s.name}{default}: {s.description}")
    console.print("[bold]methods[/] (bits per element at head_dim 64 / 128)")
    for name, m in available_methods().items():
        console.print(f"  {name}: {m.bits_per_element(64):.2f} / {m.bits_per_element(128):.2f}")
    console.print("[bold]built-in models[/]")
    for b in BUILTIN_MODELS.values():
        console.print(f"  {b.name}: {b.description} ({b.pip})")
    from kvarn_eval.data import DataNotFoundError, mmlu_subjects

    try:
        subjects = ", ".join(mmlu_subjects())
    except DataNotFoundError as exc:
        subjects = str(exc)
    console.print("[bold]MMLU subjects[/] (--mmlu-subjects)")
    console.print(f"  {subjects}", markup=False)
    return 0


def _ready_suites(args: argparse.Namespace, options: BenchOptions, console: Any) -> list[Suite]:
    """The selected suites whose preflight passes; a suite named explicitly must pass."""
    explicit = explicit_suite_names(args.suites)
    ready = []
    for suite in resolve_suites(args.suites):
        if suite.preflight is not None:
            try:
                suite.preflight(options)
            except (MissingDependencyError, ValueError) as exc:
                if suite.name in explicit:
                    raise
                console.print(f"skipping suite {suite.name}: {exc}", markup=False)
                continue
        ready.append(suite)
    if not ready:
        raise ValueError(f"none of the suites selected by {args.suites!r} can run here")
    return ready


def _print_plan(
    suites: Sequence[Suite], options: BenchOptions, console: Any, blocked: dict[str, str]
) -> None:
    """One line per suite: what it will run (``blocked``: why a suite cannot run here)."""
    from kvarn_eval.plan import suite_plan

    console.print("plan:")
    for suite in suites:
        line = f"  {suite.name}: {suite_plan(suite.name, options) or suite.description}"
        if suite.name in blocked:
            line += f" [cannot run here: {blocked[suite.name]}]"
        console.print(line, markup=False, highlight=False)


def _dry_run(args: argparse.Namespace, options: BenchOptions, console: Any) -> int:
    """``--dry-run``: the plan of the selected suites as a GPU machine would run them, each
    marked where it cannot run here."""
    gpu = gpu_available()
    blocked: dict[str, str] = {}
    suites = resolve_suites(args.suites, gpu=True)
    for suite in suites:
        if suite.needs_gpu and not gpu:
            blocked[suite.name] = "needs a CUDA GPU"
        elif suite.preflight is not None:
            try:
                suite.preflight(options)
            except (MissingDependencyError, ValueError) as exc:
                blocked[suite.name] = str(exc)
    _print_plan(suites, options, console, blocked)
    console.print("dry run: nothing ran", markup=False)
    return 0


def _write_outputs(
    out_dir: Path,
    results: Sequence[dict[str, Any]],
    console: Any,
    title: str,
    plot: bool,
) -> None:
    """Print the tables and draw the plots (accuracy.png, serving.png) into ``out_dir``."""
    from kvarn_eval import report

    report.print_tables(results, console)
    if not plot:
        return
    try:
        written = [
            report.plot_results(results, out_dir / "accuracy.png", title),
            report.plot_serving(results, out_dir / "serving.png", title),
        ]
    except ImportError as exc:
        console.print(
            f"no plots: {exc}; run 'kvarn-eval report {out_dir}' where matplotlib is installed",
            markup=False,
        )
        return
    for path in written:
        if path is not None:
            console.print(f"wrote {path}", markup=False)


def _save(out_dir: Path, payload: dict[str, Any], results: Sequence[dict[str, Any]]) -> Path:
    from kvarn_eval import report

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.md").write_text(
        "\n\n".join(report.markdown_table(r) for r in results) + "\n"
    )
    return report.write_json(out_dir / "results.json", {**payload, "results": list(results)})


# options that change no CPU suite's numbers: a resumed run may differ in them
_RESUME_FREE_OPTIONS = ("serving", "threads")


def _finished_cpu_suites(
    out_dir: Path, options: BenchOptions, suites: Sequence[Suite]
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """``--resume``: the results of the CPU suites among ``suites`` that the bench output in
    ``out_dir`` finished with the same model and options (a CPU suite saves its result only
    once it finished; ``bench_suite`` names the suite that made a result, since 2026-12-05),
    and what that output recorded of the model.
    """
    try:
        stored = json.loads((out_dir / "results.json").read_text())
    except FileNotFoundError:
        return {}, {}
    except (OSError, ValueError) as exc:
        raise ValueError(f"--resume: cannot read {out_dir / 'results.json'}: {exc}") from None

    # an option newer than the stored run takes its default there (the run had no other)
    defaults = dataclasses.asdict(BenchOptions())

    def same(opts: dict[str, Any]) -> dict[str, Any]:
        opts = json.loads(json.dumps({**defaults, **opts}))  # tuples as lists, as stored
        return {k: v for k, v in opts.items() if k not in _RESUME_FREE_OPTIONS}

    if same(stored.get("options") or {}) != same(dataclasses.asdict(options)):
        return {}, {}
    cpu = {s.name for s in suites if not s.needs_gpu}
    finished = {
        r["bench_suite"]: r
        for r in stored.get("results") or []
        if isinstance(r, dict) and r.get("bench_suite") in cpu
    }
    return finished, dict(stored.get("model") or {})


def _bench(args: argparse.Namespace, console: Any) -> int:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from kvarn_eval import report
    from kvarn_eval.plan import check_methods

    options = options_from_args(args)
    check_methods([s.name for s in resolve_suites(args.suites, gpu=True)], options)
    if args.dry_run:
        return _dry_run(args, options, console)
    suites = _ready_suites(args, options, console)
    _print_plan(suites, options, console, {})
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    safe_model = Path(options.model).name or "model"
    out_dir = Path(args.out) if args.out else Path("kvarn-bench") / f"{safe_model}-{stamp}"
    finished, stored_model = (
        _finished_cpu_suites(out_dir, options, suites) if args.resume else ({}, {})
    )
    _quiet_transformers()

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[step]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )

    def factory(description: str, total: int) -> Callable[[str], None]:
        task_id = progress.add_task(description, total=total, step="")
        done = 0
        began = time.perf_counter()
        # without a terminal (CI logs) rich draws nothing until the end: print a line per ~10%
        every = max(1, total // 10)

        def advance(step: str) -> None:
            nonlocal done
            done += 1
            progress.update(task_id, advance=1, step=step)
            if not console.is_terminal and (done % every == 0 or done == total):
                elapsed = time.perf_counter() - began
                console.print(f"{description}: {done}/{total} ({step}) {elapsed:.0f} s")

        return advance

    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    payload: dict[str, Any] = {
        "model": {"name": options.model},
        "options": dataclasses.asdict(options),
        "environment": report.environment_info(),
        "complete": False,
        "suites": [s.name for s in suites],
    }

    def save(partial: dict[str, Any] | None = None) -> Path:
        # after every suite and every GPU run, so an interrupted run keeps what it finished
        done = results + ([partial] if partial is not None else [])
        payload["seconds"] = time.perf_counter() - started
        if "torch" in sys.modules:
            # the model's loading applies --threads after the environment was recorded
            payload["environment"]["torch_threads"] = sys.modules["torch"].get_num_threads()
        payload["complete"] = partial is None and len(results) == len(suites)
        return _save(out_dir, payload, done)

    def checkpoint(partial: dict[str, Any]) -> None:
        save(partial)

    ctx = BenchContext(
        options=options,
        progress=factory,
        out_dir=out_dir,
        echo=lambda line: console.print(line, markup=False, highlight=False),
        checkpoint=checkpoint,
    )
    console.print(f"kvarn-eval bench: model {options.model}, suites {[s.name for s in suites]}")
    served = options.serving.greedy_model
    if served and any(s.name in _SERVED_MODEL_SUITES for s in suites):
        # the real-model vLLM suites run --greedy-model, not --model: say so in both places
        payload["model"]["served"] = served
        console.print(f"vLLM suites {sorted(_SERVED_MODEL_SUITES)} serve {served}")
    if any(s.loads_model and s.name not in finished for s in suites):
        with console.status("loading the model (a built-in GGUF is converted once, ~1 min)"):
            lm = ctx.model
        console.print(
            f"model {lm.path}: {lm.num_layers} layers, {lm.num_kv_heads} KV heads, "
            f"head_dim {lm.head_dim}"
        )
        payload["model"].update(
            path=lm.path,
            head_dim=lm.head_dim,
            num_kv_heads=lm.num_kv_heads,
            num_layers=lm.num_layers,
        )
    if finished and "path" not in payload["model"]:
        payload["model"] = {**stored_model, **payload["model"]}  # no model loaded this time
    for suite in suites:  # kept first, so that no save drops them
        if suite.name in finished:
            console.print(f"{suite.name}: kept from {out_dir} (--resume)", markup=False)
            results.append(finished[suite.name])
    json_path = save()
    with progress:
        for suite in suites:
            if suite.name in finished:
                continue
            suite_start = time.perf_counter()
            result = suite.run(ctx)
            result["seconds"] = time.perf_counter() - suite_start
            result["bench_suite"] = suite.name  # what --resume finds it by
            results.append(result)
            json_path = save()
    console.print(f"wrote {json_path} and {out_dir / 'results.md'}", markup=False)
    title = f"{options.model}: KV-cache methods"
    _write_outputs(out_dir, results, console, title, not args.no_plot)
    console.print(f"total {time.perf_counter() - started:.0f} s")
    return 0


def _report(args: argparse.Namespace, console: Any) -> int:
    from kvarn_eval.accuracy.pool import pool_item_ranges
    from kvarn_eval.serving.collect import collect_results

    dirs = [Path(d) for d in args.dirs]
    for d in dirs:
        if not d.is_dir():
            raise FileNotFoundError(f"no bench output folder {d}")
    results, sources, dropped, as_stored = collect_results(dirs)
    results, pooled = pool_item_ranges(results)
    for line in pooled + as_stored + dropped:
        console.print(f"note: {line}", markup=False)
    if not results:
        raise ValueError(f"no results.json or run records under {', '.join(map(str, dirs))}")
    out_dir = Path(args.out) if args.out else dirs[0]
    from kvarn_eval import report

    payload = {
        "merged_from": [str(d) for d in dirs],
        "sources": sources,
        "left_out": dropped,
        "rows_as_stored": as_stored,
        "pooled": pooled,
        "environment": report.environment_info(),
    }
    json_path = _save(out_dir, payload, results)
    _write_outputs(out_dir, results, console, "kvarn-eval report", not args.no_plot)
    console.print(f"wrote {json_path} and {out_dir / 'results.md'}", markup=False)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvarn-eval`` console script; returns the exit status."""
    from rich.console import Console

    parser = build_parser()
    args = parser.parse_args(argv)
    console = Console()
    if not console.is_terminal:
        # piped or captured (CI logs): rich would fold tables to 80 columns
        console = Console(width=160)
    try:
        if args.command == "list":
            return _list(console)
        if args.command == "report":
            return _report(args, console)
        return _bench(args, console)
    except (MissingDependencyError, FileNotFoundError, ValueError) as exc:
        console.print(f"kvarn-eval {args.command}: {exc}", style="red", markup=False)
        return 2
    except ModuleNotFoundError as exc:
        console.print(
            f"kvarn-eval {args.command}: the module {exc.name!r} is missing; the accuracy "
            "suites need the models extra: pip install 'kvarn-eval[models]'",
            style="red",
            markup=False,
        )
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
