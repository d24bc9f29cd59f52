"""What each suite of a ``kvarn-eval bench`` command will run, in one line, before it runs
(``--dry-run`` prints it and stops): so that a command whose GPU suites start dozens of vLLM
engines says so first."""

from __future__ import annotations

from collections.abc import Sequence

from kvarn_eval.accuracy.methods import select_methods
from kvarn_eval.serving.caches import parse_caches
from kvarn_eval.suites import BenchOptions

__all__ = ["check_methods", "suite_plan"]

_PERPLEXITY = ("wikitext", "lambada_ppl")
_TASKS = ("lambada", "arc_easy", "hellaswag", "piqa", "winogrande", "mmlu")


def _methods(options: BenchOptions, spec: str, extra: tuple[str, ...] = ()) -> str:
    names = [m.name for m in select_methods(spec, options.block_size)]
    for name in (options.reference, *extra):
        if name not in names:
            names.insert(0, name)
    return f"{len(names)} methods ({', '.join(names)})"


def check_methods(names: Sequence[str], options: BenchOptions) -> None:
    """Raise before a model loads where a method that suites ``names`` would run cannot: an
    unknown name, or a tile that does not divide ``--block-size``.

    Raises:
        ValueError: naming the method and its tile.
    """
    for name in names:
        if name in _PERPLEXITY:
            specs = (options.reference, options.methods)
        elif name in (*_TASKS, "greedy", "gsm8k"):
            specs = (options.reference, options.task_methods)
        else:
            continue
        for spec in specs:
            for m in select_methods(spec, options.block_size):
                if options.block_size % m.group_size:
                    raise ValueError(
                        f"--block-size must be a multiple of {m.name}'s tile of "
                        f"{m.group_size} tokens, got {options.block_size} (suite {name})"
                    )


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def suite_plan(name: str, options: BenchOptions) -> str | None:
    """One line: what built-in suite ``name`` runs under ``options`` (engines, items,
    methods); ``None`` for a suite this module does not know (one registered elsewhere).

    Args:
        name: a suite name.
        options: the bench's options.
    """
    s = options.serving
    if name in _PERPLEXITY:
        text = "WikiText-2" if options.text_file is None else options.text_file
        if name == "lambada_ppl":
            text = "LAMBADA passages"
        return (
            f"{options.num_chunks} chunks x {options.chunk_len} tokens of {text}, "
            f"{_methods(options, options.methods)} on {options.model}"
        )
    first = f" from item {options.first_item}" if options.first_item else ""
    if name in _TASKS:
        return (
            f"{_count(options.items, 'item')}{first}, "
            f"{_methods(options, options.task_methods)} on {options.model}"
        )
    if name == "gsm8k":
        return (
            f"{_count(options.items, 'GSM8K solution')}{first} (8-shot prompts), "
            f"{_methods(options, options.task_methods)} on {options.model}"
        )
    if name == "greedy":
        return (
            f"{options.greedy_prompts} prompts x {options.greedy_tokens} greedy tokens, "
            f"{_methods(options, options.task_methods, ('fp32',))} on {options.model}"
        )
    if name in ("throughput", "capacity"):
        caches = parse_caches(s.caches)
        engines = len(s.gpu_models) * len(caches)
        where = f"{_count(len(s.gpu_models), 'model shape')} x {_count(len(caches), 'cache')}" + (
            f", {s.tensor_parallel_size} GPUs each" if s.tensor_parallel_size > 1 else ""
        )
        if name == "capacity":
            return (
                f"{_count(engines, 'vLLM engine')} ({where}), start-up only; the throughput "
                "suite's engines when both run"
            )
        lens = ", ".join(str(n) for n in s.prompt_lens)
        requests = (
            f"{s.requests} requests"
            if s.requests
            else f"requests filling {s.fill:.0%} of the cache"
        )
        return (
            f"{_count(engines, 'vLLM engine')} ({where}), each a burst per prompt length "
            f"({lens} tokens; {s.output_len} out; {requests}, at most {s.max_num_seqs} at once)"
        )
    if name == "vllm_greedy":
        reference = sum(1 for c in parse_caches(s.greedy_caches) if c.is_reference) == 0
        engines = len(parse_caches(s.greedy_caches)) + int(reference)
        engines += int(bool(s.greedy_noise_max_num_seqs))
        model = s.greedy_model or options.model
        return (
            f"{_count(engines, 'vLLM engine')} on {model} (the caches, the bf16 reference, "
            f"the noise run): {s.greedy_prompts} prompts x {s.greedy_tokens} tokens"
        )
    if name == "vllm_perplexity":
        reference = sum(1 for c in parse_caches(s.ppl_caches) if c.is_reference) == 0
        engines = len(parse_caches(s.ppl_caches)) + int(reference) + 1
        model = s.greedy_model or options.model
        return (
            f"{_count(engines, 'vLLM engine')} on {model} (the caches, the bf16 reference, "
            f"the noise run): {s.ppl_chunks} chunks x {s.ppl_tokens} tokens"
        )
    if name in ("longctx", "longctx_cpu"):
        from kvarn_eval.gpu_longctx import plan_line

        return plan_line(name, options)
    if name == "kernels":
        grid = "quick" if s.kernel_quick else "full"
        return f"kvarn_kernels.bench, {grid} grid, presets {s.kernel_presets}"
    return None
