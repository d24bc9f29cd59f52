"""Where a prefill burst's GPU time goes: vLLM's torch profiler around a few long prompts.

The sixth H200 run found kvarn's 16K-prompt bursts prefilling at about two thirds of bf16's
rate (docs/serving.md). This script measures where that time goes: per KV cache dtype, one
engine on a dummy-weight model shape (eager, so every kernel shows), a warm-up prompt, then
``--num-prompts`` prompts of ``--prompt-len`` random tokens with ``--output-len`` output tokens
each (default 1: pure prefill), timed once without and once under vLLM's torch profiler.
vLLM writes its table sorted by self CUDA time; this script keeps it and summarizes the total
(the table's footer) and the largest rows.

    python packages/kvarn-eval/scripts/profile_prefill.py --shape llama-3.1-8b \\
        --dtypes auto kvarn_k4v2_g128 --prompt-len 16384 --num-prompts 4 --out $OUT/prof

Writes ``OUT/<dtype>/profiler_out_0.txt`` (vLLM's table) and ``OUT/summary.json``: per dtype,
the wall times of the plain and the profiled generate, the total self CUDA time and the 25
largest rows.
vLLM also leaves its gzipped traces under ``OUT/<dtype>/`` (tens of MB; delete them before
copying results back when space is short).
Each dtype runs in its own process, so one engine's memory is gone before the next starts.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

_UNITS = {"s": 1e6, "ms": 1e3, "us": 1.0, "ns": 1e-3}
_TIME = re.compile(r"^([0-9]*\.?[0-9]+)(s|ms|us|ns)$")


def parse_time_us(text: str) -> float:
    """``"12.345ms"`` -> 12345.0 (microseconds), as torch's profiler tables print times."""
    m = _TIME.match(text.strip())
    if not m:
        raise ValueError(f"not a profiler time: {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_profiler_table(text: str) -> list[dict[str, float | str]]:
    """Rows of a ``torch.profiler`` key-averages table with CUDA columns.

    Returns ``[{"name", "self_cuda_us", "calls"}]`` in the table's order. Cells are separated
    by two or more spaces (a title wider than its column, such as ``CUDA time avg``, shifts
    the rest of its line, so fixed column spans do not work); a name keeps its single spaces.
    """
    lines = text.splitlines()
    header_at = next(
        (i for i, line in enumerate(lines) if "Self CUDA" in line and "Name" in line), None
    )
    if header_at is None:
        raise ValueError("no 'Name ... Self CUDA' header in the profiler table")
    titles = re.split(r"\s{2,}", lines[header_at].strip())
    col = {t: i for i, t in enumerate(titles)}
    for needed in ("Name", "Self CUDA", "# of Calls"):
        if needed not in col:
            raise ValueError(f"profiler table lacks the {needed!r} column: {titles}")
    if col["Name"] != 0:
        raise ValueError(f"profiler table's first column is not Name: {titles}")
    rows: list[dict[str, float | str]] = []
    for line in lines[header_at + 1 :]:
        if not line.strip() or set(line.strip()) <= {"-", " "}:
            continue
        if "time total:" in line:
            break
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) < len(titles):
            continue  # a wrapped or summary line
        values = cells[len(cells) - len(titles) + 1 :]
        name = "  ".join(cells[: len(cells) - len(titles) + 1])
        try:
            rows.append(
                {
                    "name": name,
                    "self_cuda_us": parse_time_us(values[col["Self CUDA"] - 1]),
                    "calls": float(values[col["# of Calls"] - 1]),
                }
            )
        except ValueError:
            continue
    return rows


def parse_cuda_total_us(text: str) -> float | None:
    """The table footer's ``Self CUDA time total`` in microseconds (``None`` without one).

    The rows mix operators and the kernels they launch (both carry self CUDA time), so the
    footer, not the sum of the rows, is the burst's GPU time."""
    m = re.search(r"^Self CUDA time total:\s*(\S+)", text, re.MULTILINE)
    return parse_time_us(m.group(1)) if m else None


def _run_one(args: argparse.Namespace, dtype: str, out: Path) -> dict[str, object]:
    """In a child process: one engine, warm-up, the profiled burst."""
    import numpy as np
    from kvarn_eval.serving.shapes import get_shape, write_model_dir
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    shape = get_shape(args.shape)
    model = write_model_dir(shape, out.parent / "models")
    llm = LLM(
        model=str(model),
        load_format="dummy",
        skip_tokenizer_init=True,
        kv_cache_dtype=dtype,
        max_model_len=args.prompt_len + args.output_len + 16,
        max_num_batched_tokens=args.max_num_batched_tokens or args.prompt_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=True,
        enable_prefix_caching=False,
        profiler_config={
            "profiler": "torch",
            "torch_profiler_dir": str(out.resolve()),
            "torch_profiler_with_stack": False,  # the table is the point; keep traces small
        },
        **({"attention_config": {"backend": args.bf16_backend}} if dtype == "auto" else {}),
    )
    rng = np.random.default_rng(0)
    vocab = int(shape.config["vocab_size"])

    def prompts(n: int) -> list[TokensPrompt]:
        ids = rng.integers(100, vocab - 100, size=(n, args.prompt_len))
        return [TokensPrompt(prompt_token_ids=row.tolist()) for row in ids]

    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts(1), params, use_tqdm=False)  # warm-up: JIT compiles, allocations
    start = time.perf_counter()  # the same burst without the profiler: its true wall time
    llm.generate(prompts(args.num_prompts), params, use_tqdm=False)
    plain = time.perf_counter() - start
    batch = prompts(args.num_prompts)
    llm.start_profile()
    start = time.perf_counter()
    llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    llm.stop_profile()
    return {
        "generate_seconds": seconds,
        "unprofiled_seconds": plain,
        "prompt_tokens": args.num_prompts * args.prompt_len,
        "output_tokens": args.num_prompts * args.output_len,
    }


def summarize(out: Path, run: dict[str, object], top: int = 25) -> dict[str, object]:
    """Add the table's total and largest rows to ``run`` (the child's result)."""
    tables = sorted(out.glob("profiler_out_*.txt"))
    if not tables:
        return {**run, "error": f"no profiler_out_*.txt under {out}"}
    text = tables[0].read_text()
    rows = parse_profiler_table(text)
    total = parse_cuda_total_us(text)
    if total is None:
        total = sum(float(r["self_cuda_us"]) for r in rows)
    return {
        **run,
        "table": str(tables[0]),
        "self_cuda_ms_total": round(total / 1e3, 3),
        "top": [
            {**r, "share": round(float(r["self_cuda_us"]) / total, 4) if total else 0.0}
            for r in rows[:top]
        ],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-3.1-8b", help="a kvarn_eval model shape")
    p.add_argument("--dtypes", nargs="+", default=["auto", "kvarn_k4v2_g128"])
    p.add_argument("--bf16-backend", default="FLASH_ATTN", help="attention backend for auto")
    p.add_argument("--prompt-len", type=int, default=16384)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument(
        "--output-len",
        type=int,
        default=1,
        help="tokens generated per prompt (more than 1 mixes decode steps into the burst)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=0,
        help="vLLM's step budget (default: --prompt-len, one prompt per step)",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--timeout", type=float, default=400.0, help="seconds per dtype")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--internal-dtype", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if min(args.prompt_len, args.num_prompts, args.output_len) < 1:
        p.error("--prompt-len, --num-prompts and --output-len must be >= 1")
    if args.max_num_batched_tokens < 0:
        p.error("--max-num-batched-tokens must be >= 0 (0: --prompt-len)")

    if args.internal_dtype is not None:
        out = args.out / args.internal_dtype
        out.mkdir(parents=True, exist_ok=True)
        result = _run_one(args, args.internal_dtype, out)
        (out / "run.json").write_text(json.dumps(result))
        return 0

    runs: dict[str, object] = {}
    for dtype in args.dtypes:
        out = args.out / dtype
        cmd = [sys.executable, __file__, *(argv or sys.argv[1:]), "--internal-dtype", dtype]
        print(f"[{dtype}] profiling {args.num_prompts} x {args.prompt_len} tokens", flush=True)
        try:
            proc = subprocess.run(cmd, timeout=args.timeout, capture_output=True, text=True)
            (args.out / f"{dtype}.log").write_text(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                runs[dtype] = {"error": f"exit {proc.returncode}; see {dtype}.log"}
                continue
        except subprocess.TimeoutExpired:
            runs[dtype] = {"error": f"timed out after {args.timeout:.0f} s"}
            continue
        run = json.loads((out / "run.json").read_text())
        runs[dtype] = summarize(out, run)
        r = runs[dtype]
        print(
            f"[{dtype}] {r.get('unprofiled_seconds', float('nan')):.2f} s unprofiled, "
            f"{r.get('generate_seconds', float('nan')):.2f} s profiled, "
            f"self CUDA {r.get('self_cuda_ms_total', float('nan'))} ms",
            flush=True,
        )
        for row in r.get("top", [])[:10]:  # type: ignore[union-attr]
            print(f"    {row['self_cuda_us'] / 1e3:10.2f} ms {row['share']:6.1%}  {row['name']}")
    summary = {"command": " ".join(sys.argv), "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {args.out / 'summary.json'}")
    return 0 if all("error" not in r for r in runs.values()) else 1  # type: ignore[operator]


if __name__ == "__main__":
    raise SystemExit(main())
