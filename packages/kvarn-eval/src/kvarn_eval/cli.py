"""``kvarn-eval``: the command line.

kvarn-eval bench                  accuracy on SmolLM2-135M (about ten minutes on 2 CPU cores)
kvarn-eval bench --quick          a smoke run (a minute or two)
kvarn-eval bench --suites all --methods kvarn,bf16 --items 200 --out results/
kvarn-eval list                   suites, methods and built-in models
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvarn_eval import __version__
from kvarn_eval.models import BUILTIN_MODELS, DEFAULT_MODEL, MissingDependencyError
from kvarn_eval.suites import (
    DEFAULT_SUITES,
    DEFAULT_TASK_METHODS,
    SUITES,
    BenchContext,
    BenchOptions,
    resolve_suites,
)

__all__ = ["build_parser", "main", "options_from_args"]

QUICK = {"num_chunks": 2, "chunk_len": 512, "items": 6}


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


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
    bench.add_argument("--no-plot", action="store_true", help="skip the matplotlib plot")

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
    return BenchOptions(
        model=args.model,
        methods=args.methods,
        task_methods=args.task_methods,
        reference=args.reference,
        num_chunks=sizes["num_chunks"],
        chunk_len=sizes["chunk_len"],
        items=sizes["items"],
        min_context_tokens=args.min_context,
        block_size=args.block_size,
        exact_first_block=not args.no_exact_first_block,
        text_file=args.text,
        threads=args.threads,
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
    return 0


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

    options = options_from_args(args)
    suites = resolve_suites(args.suites)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    safe_model = Path(options.model).name or "model"
    out_dir = Path(args.out) if args.out else Path("kvarn-bench") / f"{safe_model}-{stamp}"
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

    ctx = BenchContext(options=options, progress=factory)
    started = time.perf_counter()
    console.print(f"kvarn-eval bench: model {options.model}, suites {[s.name for s in suites]}")
    with console.status("loading the model (a built-in GGUF is converted once, ~1 min)"):
        lm = ctx.model
    console.print(
        f"model {lm.path}: {lm.num_layers} layers, {lm.num_kv_heads} KV heads, "
        f"head_dim {lm.head_dim}"
    )
    results: list[dict[str, Any]] = []
    environment = report.environment_info()

    def save() -> Path:
        # written after every suite, so an interrupted run keeps what it finished
        payload = {
            "model": {
                "name": options.model,
                "path": lm.path,
                "head_dim": lm.head_dim,
                "num_kv_heads": lm.num_kv_heads,
                "num_layers": lm.num_layers,
            },
            "options": vars(options),
            "environment": environment,
            "seconds": time.perf_counter() - started,
            "complete": len(results) == len(suites),
            "results": results,
        }
        (out_dir / "results.md").parent.mkdir(parents=True, exist_ok=True)
        (out_dir / "results.md").write_text(
            "\n\n".join(report.markdown_table(r) for r in results) + "\n"
        )
        return report.write_json(out_dir / "results.json", payload)

    with progress:
        for suite in suites:
            suite_start = time.perf_counter()
            result = suite.run(ctx)
            result["seconds"] = time.perf_counter() - suite_start
            results.append(result)
            json_path = save()
    report.print_tables(results, console)
    console.print(f"wrote {json_path} and {out_dir / 'results.md'}")
    if not args.no_plot:
        title = f"{options.model}: KV-cache methods under pseudo-decode"
        plot = report.plot_results(results, out_dir / "accuracy.png", title)
        if plot is not None:
            console.print(f"wrote {plot}")
    console.print(f"total {time.perf_counter() - started:.0f} s")
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
        return _bench(args, console)
    except (MissingDependencyError, FileNotFoundError, ValueError) as exc:
        console.print(f"[red]kvarn-eval {args.command}: {exc}[/]")
        return 2
    except ModuleNotFoundError as exc:
        console.print(
            f"[red]kvarn-eval {args.command}: the module {exc.name!r} is missing; the accuracy "
            "suites need the models extra: pip install 'kvarn-eval[models]'[/]"
        )
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
