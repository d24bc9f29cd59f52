"""Benchmark output: terminal and markdown tables, JSON with provenance, and plots.

A run writes, into its output folder, ``results.json`` (every suite's rows, the machine, library
versions, git SHA, command line, timings) and ``accuracy.png`` (perplexity change or accuracy
against bits per element), and prints one table per suite.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from kvarn_eval.settings import EvalSettings

__all__ = [
    "FAMILY_COLORS",
    "environment_info",
    "git_sha",
    "markdown_table",
    "perplexity_table",
    "plot_results",
    "plot_serving",
    "print_tables",
    "sink_label",
    "task_table",
    "write_json",
]

# plot colours by KV-cache family (see kvarn_eval.serving.caches.CacheSpec.family)
FAMILY_COLORS = {
    "kvarn": "tab:red",
    "bf16": "tab:blue",
    "fp8": "tab:green",
    "turboquant": "tab:purple",
    "other": "tab:gray",
}

_VERSIONED = ("kvarn-math", "kvarn-eval", "numpy", "torch", "transformers", "vllm", "triton")


GIT_SHA_ENV = "KVARN_GIT_SHA"


def git_sha(start: Path | None = None) -> str | None:
    """``HEAD`` of the git checkout holding ``start`` (default: this file), ``-dirty`` marked.

    ``$KVARN_GIT_SHA`` wins when set: code run from an exported tree (``git archive``, no
    ``.git``) can name its commit instead of reporting whatever checkout surrounds it.
    """
    if sha := EvalSettings.from_env().git_sha:
        return sha
    where = start or Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=where,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{sha}-dirty" if dirty else sha


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment_info() -> dict[str, Any]:
    """Machine, accelerator, library versions, git SHA, time and command line."""
    versions: dict[str, str | None] = {}
    for dist in _VERSIONED:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    info: dict[str, Any] = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "git_sha": git_sha(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "versions": versions,
        # kvarn's settings (KVARN_VLLM_*, KVARN_KERNELS_*) the run was made under
        "kvarn_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("KVARN_")},
        "gpu": None,
    }
    if "torch" in sys.modules:
        import torch

        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def _fmt(value: float, digits: int = 2, signed: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def _fmt_bytes(value: float) -> str:
    """Bytes per token and head: whole numbers as such, fractions (55.625 at head_dim 64) kept."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:g}"


def perplexity_table(result: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows for a perplexity result (as produced by ``to_dict``)."""
    header = [
        "method",
        "bits/elem",
        "B/token/head",
        "perplexity",
        "Δ ppl %",
        "± se",
        "KL (nats)",
        "top-1 agree",
    ]
    rows = []
    for r in result["rows"]:
        rows.append(
            [
                r["method"],
                _fmt(r["bits_per_element"], 2),
                _fmt_bytes(r["bytes_per_token_per_head"]),
                _fmt(r["perplexity"], 3),
                _fmt(r["delta_pct"], 2, signed=True),
                _fmt(r["delta_se_pct"], 2),
                f"{r['kl']:.5f}",
                f"{100 * r['top1']:.2f}%",
            ]
        )
    return header, rows


def task_table(result: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows for a task result (as produced by ``to_dict``)."""
    header = [
        "method",
        "bits/elem",
        f"{result['primary_metric']} %",
        "± se",
        "change vs ref (points)",
        "± paired se",
        "agree w/ ref %",
    ]
    rows = []
    for r in result["rows"]:
        # results from before the paired change was recorded have neither column
        change, change_se = r.get("change"), r.get("change_se")
        rows.append(
            [
                r["method"],
                _fmt(r["bits_per_element"], 2),
                _fmt(100 * r["accuracy"], 1),
                _fmt(100 * r["accuracy_se"], 1),
                "n/a" if change is None else _fmt(100 * change, 1, signed=True),
                "n/a" if change_se is None else _fmt(100 * change_se, 1),
                _fmt(100 * r["agreement"], 1),
            ]
        )
    return header, rows


def sink_label(result: Mapping[str, Any]) -> str:
    """Title fragment naming a pseudo-decode result's exact sink and recent window (``""`` for
    neither).

    Args:
        result: a perplexity or greedy result dict; older ones have no ``sink_tokens`` and go
            by ``exact_first_block``.
    """
    block = result["block_size"]
    sink = result.get("sink_tokens")
    recent = int(result.get("recent_blocks") or 0)  # older results have none: 0
    window = f", {recent} recent block{'s' if recent > 1 else ''} exact" if recent else ""
    if sink is None:
        sink = block if result["exact_first_block"] else 0
    if sink == block:
        return ", first block exact" + window
    if sink == 0:
        return window
    rest = " (block 0 quantized without them)" if result.get("sink_requantize") else ""
    return f", first {sink} tokens exact{rest}{window}"


def _title(result: Mapping[str, Any]) -> str:
    # results merged by ``kvarn-eval report`` name their model
    model = f" on {result['model']}" if result.get("model") else ""
    if result.get("mean_scored_tokens"):  # perplexity of each item's tail (GSM8K solutions)
        return (
            f"{result['suite']}{model}: {result['num_chunks']} items, "
            f"{result['mean_scored_tokens']:.0f} tokens scored after "
            f"{result['mean_context_tokens']:.0f} of context, "
            f"{100 * result['mean_quantized_fraction']:.0f}% of it read quantized, "
            f"pseudo-decode blocks of {result['block_size']}{sink_label(result)}, "
            f"reference {result['reference']}"
        )
    if "chunk_len" in result:
        return (
            f"{result['suite']}{model}: {result['num_chunks']} x {result['chunk_len']} tokens, "
            f"pseudo-decode blocks of {result['block_size']}{sink_label(result)}, "
            f"reference {result['reference']}"
        )
    first = int(result.get("first_item", 0))
    items = f"{result['num_items']} items"
    if first:
        items += f" ({first} to {first + result['num_items'] - 1})"
    return (
        f"{result['suite']}{model}: {items}, context "
        f"{result['mean_context_tokens']:.0f} tokens ({result['mean_shots']:.1f} shots), "
        f"{100 * result['mean_quantized_fraction']:.0f}% of it read quantized, "
        f"reference {result['reference']}"
    )


_TEXT_COLUMNS = {"method", "model", "cache", "preset", "shape", "status"}


def _tables_of(result: Mapping[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """``(title, header, rows)`` of every table of a result.

    Suites that build their own tables (GPU suites, greedy fidelity) store them under
    ``tables``; perplexity and task results are formatted here.
    """
    if "tables" in result:
        return [
            (t["title"], list(t["header"]), [list(r) for r in t["rows"]]) for t in result["tables"]
        ]
    header, rows = perplexity_table(result) if "chunk_len" in result else task_table(result)
    return [(_title(result), header, rows)]


def markdown_table(result: Mapping[str, Any]) -> str:
    """The titled GitHub-markdown table(s) of one suite's result."""
    blocks = []
    for title, header, rows in _tables_of(result):
        lines = [
            f"**{title}**",
            "",
            "| " + " | ".join(header) + " |",
            "| " + " | ".join("---" if h in _TEXT_COLUMNS else "---:" for h in header) + " |",
        ]
        lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
        blocks.append("\n".join(lines))
    for name, why in result.get("skipped", {}).items():
        blocks.append(f"skipped {name}: {why}")
    return "\n\n".join(blocks)


def print_tables(results: Sequence[Mapping[str, Any]], console: Any | None = None) -> None:
    """Print each suite's table(s) on the terminal (rich)."""
    from rich.console import Console
    from rich.table import Table

    out = console or Console()
    for result in results:
        for title, header, rows in _tables_of(result):
            table = Table(title=title, title_justify="left")
            for _i, col in enumerate(header):
                table.add_column(col, justify="left" if col in _TEXT_COLUMNS else "right")
            for row in rows:
                table.add_row(*row)
            out.print(table)
        for name, why in result.get("skipped", {}).items():
            out.print(f"[yellow]skipped {name}[/]: {why}", markup=True)


def write_json(path: Path, payload: Mapping[str, Any]) -> Path:
    """Write ``payload`` as indented JSON (NaN written as null)."""

    def clean(obj: Any) -> Any:
        if isinstance(obj, float) and not math.isfinite(obj):
            return None
        if isinstance(obj, Mapping):
            return {str(k): clean(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [clean(v) for v in obj]
        return obj

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean(payload), indent=2, allow_nan=False) + "\n")
    return path


def _is_accuracy(result: Mapping[str, Any]) -> bool:
    if "points" in result:
        return result.get("plot_file") == "accuracy" and bool(result["points"])
    return "rows" in result and ("chunk_len" in result or "primary_metric" in result)


def _label(ax: Any, text: str, x: float, y: float) -> Any:
    """A point's label, up and right of it, with a hairline back to the point for when
    :func:`_declutter` moves it."""
    return ax.annotate(
        text,
        (x, y),
        fontsize=6,
        xytext=(3, 3),
        textcoords="offset points",
        arrowprops={"arrowstyle": "-", "color": "0.6", "lw": 0.4, "shrinkA": 0, "shrinkB": 2},
    )


def _declutter(
    fig: Any,
    labels: Sequence[Any],
    errors: Mapping[Any, tuple[float, float]] | None = None,
    max_rows: int = 12,
) -> None:
    """Move labels so that none covers another, a point or an error bar (methods with nearly
    the same bits and error put theirs on one spot otherwise). kvarn's labels are placed
    first, then the others, each left to right: a label takes the nearest free place in its
    panel, right or left of its point, up to ``max_rows`` label heights up or down, and stays
    where it was when there is none. Call after the layout is final (``tight_layout``).

    Args:
        fig: the figure.
        labels: the annotations of :func:`_label`.
        errors: the error bar ``(y_low, y_high)`` (data coordinates) of a label's point, by
            label; a point without one is a marker only.
        max_rows: how far a label may move.
    """
    from matplotlib.text import Text
    from matplotlib.transforms import Bbox

    renderer = fig.canvas.get_renderer()
    px_to_pt = 72.0 / fig.dpi
    errors = errors or {}

    def text_box(label: Any) -> Any:
        label.update_positions(renderer)  # the text where its offset puts it now
        return Text.get_window_extent(label, renderer)  # the text alone, not its hairline

    points: dict[int, Any] = {}  # each label's point and error bar, in pixels
    for label in labels:
        x, y = label.xy
        lo, hi = errors.get(label, (y, y))
        (x0, y0), (_, y1) = label.axes.transData.transform([(x, lo), (x, hi)])
        points[id(label)] = Bbox([[x0 - 3, min(y0, y1) - 3], [x0 + 3, max(y0, y1) + 3]])

    def order(label: Any) -> tuple[bool, float, float]:
        x, y = label.axes.transData.transform(label.xy)
        return not label.get_text().startswith("kvarn"), float(x), float(y)

    # half-height steps, nearest first, up before down
    rows = sorted(range(-2 * max_rows, 2 * max_rows + 1), key=lambda k: (abs(k), -k))
    taken: list[Any] = []
    for label in sorted(labels, key=order):
        others = [b for key, b in points.items() if key != id(label)]  # its own bar is fine
        box = text_box(label)
        frame = label.axes.get_window_extent(renderer)
        dx, dy = label.xyann
        left = -(box.width + 2 * dx / px_to_pt)  # the same gap, left of the point
        half = box.height / 2
        for k in rows:
            free = [
                moved
                for moved in (box.translated(0, k * half), box.translated(left, k * half))
                if frame.x0 <= moved.x0
                and frame.y0 <= moved.y0
                and moved.y1 <= frame.y1
                and not any(moved.overlaps(b) for b in (*taken, *others))
            ]
            if free:
                label.xyann = (dx + (free[0].x0 - box.x0) * px_to_pt, dy + k * half * px_to_pt)
                box = text_box(label)
                break
        taken.append(box)


def plot_results(results: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> Path | None:
    """One panel per accuracy suite: perplexity change (%), task accuracy change against the
    reference (points, paired error bars; accuracy (%) for results from before it was
    recorded) or greedy agreement (%) against bits per element. Other results (throughput, capacity, kernels) are left out.

    Args:
        results: suite results (those that are not accuracy results are skipped).
        path: the PNG to write.
        title: the figure's title.

    Returns:
        ``path``, or ``None`` when there is nothing to plot.
    """
    results = [r for r in results if _is_accuracy(r)]
    if not results:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(results))
    nrows = -(-len(results) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 4.2 * nrows), squeeze=False)
    labels: list[Any] = []
    errors: dict[Any, tuple[float, float]] = {}
    for ax, result in zip(axes.flat, results, strict=False):
        if "points" in result:
            labels += _plot_points(ax, result)
            continue
        is_ppl = "chunk_len" in result
        # tasks: the change against the reference with its paired error where the result has
        # it (since 2026-12-04), else the accuracy with its binomial error
        paired = not is_ppl and all(r.get("change_se") is not None for r in result["rows"])
        for r in result["rows"]:
            x = r["bits_per_element"]
            if is_ppl:
                y, err = r["delta_pct"], r["delta_se_pct"]
            elif paired:
                y, err = 100 * r["change"], 100 * r["change_se"]
            else:
                y, err = 100 * r["accuracy"], 100 * r["accuracy_se"]
            err = 0.0 if err is None or math.isnan(err) else err
            color = "tab:red" if r["method"].startswith("kvarn") else "tab:blue"
            ax.errorbar(x, y, yerr=err, fmt="o", color=color, capsize=2, markersize=4)
            labels.append(_label(ax, r["method"], x, y))
            errors[labels[-1]] = (y - err, y + err)
        if is_ppl:
            ax.set_yscale("symlog", linthresh=1.0)
            ax.axhline(1.0, color="gray", lw=0.6, ls="--")
            ax.set_ylabel(f"perplexity change vs {result['reference']} (%)")
        elif paired:
            ax.axhline(0.0, color="gray", lw=0.6, ls="--")
            ax.set_ylabel(
                f"{result['primary_metric']} change vs {result['reference']} (points, paired se)"
            )
        else:
            ax.set_ylabel(f"{result['primary_metric']} (%)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bits per element (scales included, log scale)")
        ax.set_title(result["suite"], fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(results) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    _declutter(fig, labels, errors)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def _plot_points(ax: Any, result: Mapping[str, Any]) -> list[Any]:
    """A panel of labelled points (``result["points"]``: x, y, label, family); returns the
    labels."""
    labels = []
    for p in result["points"]:
        color = FAMILY_COLORS.get(p.get("family", "other"), "tab:gray")
        ax.plot(p["x"], p["y"], "o", color=color, markersize=4)
        labels.append(_label(ax, p["label"], p["x"], p["y"]))
    axes = result.get("axes", {})
    ax.set_xscale(axes.get("xscale", "log"), base=2)
    ax.set_xlabel(axes.get("xlabel", ""))
    ax.set_ylabel(axes.get("ylabel", ""))
    ax.set_title(axes.get("title", result.get("suite", "")), fontsize=9)
    ax.grid(alpha=0.3)
    return labels


def plot_serving(results: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> Path | None:
    """Throughput against KV capacity: one panel per model and prompt length, one point per cache.

    Args:
        results: suite results; only ``throughput`` results with measured rows are drawn.
        path: the PNG to write.
        title: the figure's title.

    Returns:
        ``path``, or ``None`` when there is nothing to plot.
    """
    panels: dict[tuple[str, int], list[Mapping[str, Any]]] = {}
    for result in results:
        if result.get("kind") != "throughput":
            continue
        for row in result["rows"]:
            if row.get("total_tok_per_s") and row.get("kv_cache_tokens"):
                key = (f"{row['model']} tp{row['tensor_parallel_size']}", int(row["prompt_len"]))
                panels.setdefault(key, []).append(row)
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(panels)
    cols = min(3, len(keys))
    nrows = -(-len(keys) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 4.2 * nrows), squeeze=False)
    labels: list[Any] = []
    for ax, key in zip(axes.flat, keys, strict=False):
        for row in panels[key]:
            x, y = row["kv_cache_tokens"] / 1e6, row["total_tok_per_s"]
            ax.plot(x, y, "o", color=FAMILY_COLORS.get(row.get("family", "other"), "tab:gray"))
            labels.append(_label(ax, row["cache"], x, y))
        ax.set_xlabel("KV cache capacity (million tokens)")
        ax.set_ylabel("burst throughput (prompt + output tokens/s)")
        ax.set_title(f"{key[0]}, {key[1]}-token prompts", fontsize=9)
        # Room right of the largest cache for its label (the points' labels extend right).
        ax.set_xlim(0, 1.3 * max(r["kv_cache_tokens"] for r in panels[key]) / 1e6)
        ax.set_ylim(0, 1.1 * max(r["total_tok_per_s"] for r in panels[key]))
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    _declutter(fig, labels)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
