"""How many exact leading tokens (the attention sink) KVarN needs: a perplexity sweep.

For every sink size ``S`` and both ways of quantizing tile 0 (variant ``a``: tile 0 quantized as
usual, sink tokens included; variant ``b``: tile 0 quantized with its first ``S`` tokens replaced
by copies of token ``S``, see ``PseudoDecodeConfig.sink_requantize``), runs the ``wikitext``
perplexity of ``kvarn-eval bench`` (pseudo-decode, blocks of 128, reference bf16) for the given
presets. ``S = 0`` (no sink) and ``S = 128`` (the whole first tile exact, the default) are the
same for both variants and run once.

Writes ``sink_sweep.json`` (every row, per-chunk NLL, the change against ``S = 128`` with its
paired standard error) and ``sink_sweep.png`` (perplexity change against ``S``) into ``--out``,
the JSON after every configuration.

    python packages/kvarn-eval/scripts/sink_sweep.py               # 8 x 1024 tokens, SmolLM2
    python packages/kvarn-eval/scripts/sink_sweep.py --chunks 4 --threads 1
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

BLOCK = 128
REPO = Path(__file__).resolve().parents[3]
DEFAULT_OUT = REPO / "docs" / "results" / "cpu-2026-11-30"


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def configurations(sinks: list[int]) -> list[tuple[int, bool]]:
    """``(S, requantize)`` pairs: the ends once, every other ``S`` with both variants."""
    ends = [s for s in (BLOCK, 0) if s in sinks]
    middle = sorted(s for s in sinks if 0 < s < BLOCK)
    return [(s, False) for s in ends] + [(s, r) for s in middle for r in (False, True)]


def variant_name(sink: int, requantize: bool) -> str:
    """``a``, ``b``, or ``a=b`` where the two coincide (``S`` 0 or the block)."""
    if sink in (0, BLOCK):
        return "a=b"
    return "b" if requantize else "a"


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Perplexity change against ``S``, one line per preset and variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    presets = sorted({r["preset"] for r in rows})
    for preset, color in zip(presets, ("tab:red", "tab:blue", "tab:green", "tab:purple")):
        for variant, style in (("a", "-o"), ("b", "--s")):
            pts = sorted(
                (r["sink_tokens"], r["delta_pct"], r["delta_se_pct"])
                for r in rows
                if r["preset"] == preset and r["variant"] in (variant, "a=b")
            )
            if not pts:
                continue
            xs, ys, es = zip(*pts)
            label = f"{preset}, {'tile 0 with sink' if variant == 'a' else 'tile 0 without sink'}"
            ax.errorbar(xs, ys, yerr=es, fmt=style, color=color, capsize=3, label=label)
    ax.set_xscale("symlog", linthresh=1)
    ticks = sorted({r["sink_tokens"] for r in rows})
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks])
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xlabel("exact leading tokens S (128 = whole first tile)")
    ax.set_ylabel("perplexity change vs bf16 (%), ± se over chunks")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--presets", default="kvarn_k4v2_g128,kvarn_k4v4_g128")
    parser.add_argument("--sinks", type=_ints, default=[0, 1, 4, 16, 32, 64, BLOCK])
    parser.add_argument("--chunks", type=int, default=8, help="WikiText-2 chunks (8)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per chunk (1024)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    args = parser.parse_args(argv)
    if any(not 0 <= s <= BLOCK for s in args.sinks):
        parser.error(f"--sinks must lie in [0, {BLOCK}], got {args.sinks}")

    from kvarn_eval import report
    from kvarn_eval.accuracy import evaluate_perplexity, install, select_methods
    from kvarn_eval.accuracy.summary import paired_change
    from kvarn_eval.data import find_wikitext
    from kvarn_eval.models import load_model
    from kvarn_eval.suites import text_chunks
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    started = time.perf_counter()
    lm = load_model(args.model, threads=args.threads)
    install(lm.model)
    text, source = find_wikitext()
    chunks = text_chunks(lm.tokenizer, text, args.chunks, args.tokens)
    methods = select_methods(f"bf16,{args.presets}", BLOCK)
    configs = configurations(args.sinks)
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = args.out / "sink_sweep.json", args.out / "sink_sweep.png"
    payload: dict[str, Any] = {
        "what": "perplexity change vs bf16 against the number S of exact leading tokens "
        "(pseudo-decode, WikiText-2); variant a: tile 0 quantized with its sink tokens, "
        "b: with them replaced by token S; a=b: S 0 or 128, where the two coincide",
        "command": "python packages/kvarn-eval/scripts/sink_sweep.py "
        f"--chunks {args.chunks} --tokens {args.tokens}"
        + (f" --threads {args.threads}" if args.threads else ""),
        "model": {"name": args.model, "path": lm.path, "head_dim": lm.head_dim},
        "source": source,
        "num_chunks": args.chunks,
        "chunk_len": args.tokens,
        "block_size": BLOCK,
        "reference": "bf16",
        "environment": report.environment_info(),
        "complete": False,
        "rows": [],
    }
    rows: list[dict[str, Any]] = payload["rows"]

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with progress:
        task = progress.add_task("sink sweep", total=len(configs) * len(chunks) * len(methods))
        for sink, requantize in configs:
            name = f"S={sink} {variant_name(sink, requantize)}"
            progress.update(task, description=f"sink sweep ({name})")
            result = evaluate_perplexity(
                lm.model,
                chunks,
                methods,
                head_dim=lm.head_dim,
                block_size=BLOCK,
                sink_tokens=sink,
                sink_requantize=requantize,
                suite="wikitext",
                source=source,
                advance=lambda step: progress.advance(task),
            )
            for row in result.rows:
                if row.method == "bf16":
                    continue
                rows.append(
                    {
                        "preset": row.method,
                        "variant": variant_name(sink, requantize),
                        "sink_tokens": sink,
                        "sink_requantize": requantize,
                        "perplexity": row.perplexity,
                        "delta_pct": row.delta_pct,
                        "delta_se_pct": row.delta_se_pct,
                        "kl": row.kl,
                        "kl_se": row.kl_se,
                        "top1": row.top1,
                        "top1_se": row.top1_se,
                        "chunk_nll": row.chunk_nll,
                        "seconds": result.seconds,
                    }
                )
            progress.console.print(
                f"{name}: "
                + ", ".join(f"{r['preset']} {r['delta_pct']:+.2f}%" for r in rows[-2:])
                + f" ({result.seconds:.0f} s)"
            )
            payload["seconds"] = time.perf_counter() - started
            report.write_json(json_path, payload)

    # the change of each row against the whole first tile exact, paired chunk by chunk
    for row in rows:
        full = [r for r in rows if r["preset"] == row["preset"] and r["sink_tokens"] == BLOCK]
        if full:
            row["vs_full_pct"], row["vs_full_se_pct"] = paired_change(
                row["chunk_nll"], full[0]["chunk_nll"]
            )
    payload["complete"] = True
    payload["seconds"] = time.perf_counter() - started
    report.write_json(json_path, payload)
    title = (
        f"{args.model}: WikiText-2 {args.chunks} x {args.tokens} tokens, pseudo-decode blocks "
        f"of {BLOCK}, reference bf16"
    )
    plot(rows, png_path, title)
    print(f"wrote {json_path} and {png_path} ({payload['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
