"""Tables, JSON and plots from result dicts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from kvarn_eval import report

PPL = {
    "suite": "wikitext",
    "source": "x",
    "reference": "bf16",
    "num_chunks": 2,
    "chunk_len": 256,
    "block_size": 128,
    "exact_first_block": True,
    "head_dim": 64,
    "rows": [
        {
            "method": "bf16",
            "bits_per_element": 16.0,
            "bytes_per_token_per_head": 256.0,
            "perplexity": 20.0,
            "delta_pct": 0.0,
            "delta_se_pct": 0.0,
            "kl": 0.0,
            "kl_se": 0.0,
            "top1": 1.0,
            "top1_se": 0.0,
        },
        {
            "method": "kvarn_k4v2_g128",
            "bits_per_element": 3.6,
            "bytes_per_token_per_head": 58.0,
            "perplexity": 20.2,
            "delta_pct": 1.0,
            "delta_se_pct": math.nan,
            "kl": 0.01,
            "kl_se": 0.001,
            "top1": 0.95,
            "top1_se": 0.01,
        },
    ],
    "skipped": {"kivi_k2v2": "head_dim must be one of (64,)"},
}
TASK = {
    "suite": "lambada",
    "primary_metric": "acc",
    "reference": "bf16",
    "num_items": 10,
    "mean_context_tokens": 530.0,
    "mean_shots": 4.0,
    "mean_quantized_fraction": 0.7,
    "rows": [
        {
            "method": "bf16",
            "bits_per_element": 16.0,
            "accuracy": 0.5,
            "accuracy_se": 0.158,
            "agreement": 1.0,
        },
        {
            "method": "kivi_k2v2",
            "bits_per_element": 2.5,
            "accuracy": 0.3,
            "accuracy_se": 0.145,
            "agreement": 0.8,
        },
    ],
}


def test_sink_label() -> None:
    assert report.sink_label(PPL) == ", first block exact"
    assert report.sink_label({**PPL, "exact_first_block": False}) == ""
    assert report.sink_label({**PPL, "sink_tokens": 0}) == ""
    assert report.sink_label({**PPL, "sink_tokens": 16}) == ", first 16 tokens exact"
    requantized = report.sink_label({**PPL, "sink_tokens": 4, "sink_requantize": True})
    assert requantized == ", first 4 tokens exact (block 0 quantized without them)"


def test_markdown_tables() -> None:
    md = report.markdown_table(PPL)
    lines = md.splitlines()
    assert lines[0].startswith("**wikitext: 2 x 256 tokens")
    assert "| kvarn_k4v2_g128 | 3.60 | 58 | 20.200 | +1.00 | n/a | 0.01000 | 95.00% |" in md
    assert "skipped kivi_k2v2" in md
    task_md = report.markdown_table(TASK)
    # a stored result from before the paired change: its columns read n/a
    assert "| kivi_k2v2 | 2.50 | 30.0 | 14.5 | n/a | n/a | 80.0 |" in task_md
    paired = {
        **TASK,
        "rows": [
            {**TASK["rows"][0], "change": 0.0, "change_se": 0.0},
            {**TASK["rows"][1], "change": -0.2, "change_se": 0.133},
        ],
    }
    assert "| kivi_k2v2 | 2.50 | 30.0 | 14.5 | -20.0 | 13.3 | 80.0 |" in report.markdown_table(
        paired
    )
    assert "70% of it read quantized" in task_md


def test_print_tables(capsys: pytest.CaptureFixture[str]) -> None:
    from rich.console import Console

    report.print_tables([PPL, TASK], Console(width=200, force_terminal=False))
    out = capsys.readouterr().out
    assert "kvarn_k4v2_g128" in out and "agree w/ ref" in out and "skipped kivi_k2v2" in out


def test_write_json_turns_nan_into_null(tmp_path: Path) -> None:
    path = report.write_json(tmp_path / "sub" / "r.json", {"results": [PPL]})
    loaded = json.loads(path.read_text())
    assert loaded["results"][0]["rows"][1]["delta_se_pct"] is None
    assert loaded["results"][0]["rows"][1]["kl"] == 0.01


def test_environment_info(monkeypatch) -> None:
    monkeypatch.setenv("KVARN_KERNELS_FAST_PREFETCH", "2")
    monkeypatch.setenv("UNRELATED_VARIABLE", "x")
    info = report.environment_info()
    assert info["versions"]["kvarn-eval"] == "0.1.0"
    assert info["cpu_count"] and info["date_utc"].endswith("+00:00")
    assert "git_sha" in info
    # the kvarn settings a result was made under, and only those
    assert info["kvarn_env"]["KVARN_KERNELS_FAST_PREFETCH"] == "2"
    assert all(k.startswith("KVARN_") for k in info["kvarn_env"])


def test_git_sha_names_an_exported_tree(tmp_path: Path, monkeypatch) -> None:
    """Outside any checkout there is no sha, unless $KVARN_GIT_SHA names the commit (a tree
    exported with git archive, as the GPU runs use)."""
    monkeypatch.delenv(report.GIT_SHA_ENV, raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert report.git_sha(tmp_path) is None
    monkeypatch.setenv(report.GIT_SHA_ENV, "0bbfa8e\n")
    assert report.git_sha(tmp_path) == "0bbfa8e"
    assert report.environment_info()["git_sha"] == "0bbfa8e"


def test_plot(tmp_path: Path) -> None:
    path = report.plot_results([PPL, TASK], tmp_path / "accuracy.png", "title")
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.plot_results([], tmp_path / "none.png") is None


def test_task_plot_shows_the_paired_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.axes import Axes

    drawn: list[tuple[float, float]] = []
    errorbar = Axes.errorbar

    def spy(self, x, y, yerr=None, **kwargs):  # type: ignore[no-untyped-def]
        drawn.append((round(y, 6), round(yerr, 6)))
        return errorbar(self, x, y, yerr=yerr, **kwargs)

    monkeypatch.setattr(Axes, "errorbar", spy)
    paired = {
        **TASK,
        "rows": [
            {**TASK["rows"][0], "change": 0.0, "change_se": 0.0},
            {**TASK["rows"][1], "change": -0.2, "change_se": 0.133},
        ],
    }
    report.plot_results([paired], tmp_path / "paired.png")
    assert drawn == [(0.0, 0.0), (-20.0, 13.3)]
    drawn.clear()
    report.plot_results([TASK], tmp_path / "old.png")  # stored before the paired change
    assert drawn == [(50.0, 15.8), (30.0, 14.5)]


def test_labels_of_crowded_points_do_not_overlap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Methods with nearly the same bits and change label one spot: the labels are spread so
    that none covers another or another point's error bar, and all stay inside the panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    fig, (ax, other) = plt.subplots(1, 2)
    names = ["kivi_k4v2", "hadamard_rtn_k4v2", "kvarn_k4v2_g128", "kvarn_k4v2_g64", "int4"]
    points = [(2.05, 0.40), (3.38, 0.30), (3.48, 0.32), (3.64, 0.35), (3.5, 0.33)]
    err = 0.1 / 3  # not a binary fraction: y - err and y + err do not average back to y
    labels, errors = [], {}
    for name, (x, y) in zip(names, points, strict=True):
        ax.errorbar(x, y, yerr=err, fmt="o")
        labels.append(report._label(ax, name, x, y))
        errors[labels[-1]] = (y - err, y + err)
    ax.set_xlim(2, 5)
    ax.set_ylim(-1, 2)
    lone = report._label(other, "alone", 0.5, 0.5)  # nothing near it: it stays
    fig.tight_layout()
    report._declutter(fig, [*labels, lone], errors)
    renderer = fig.canvas.get_renderer()
    boxes = []
    for t in labels:
        t.update_positions(renderer)
        boxes.append(Text.get_window_extent(t, renderer))  # the text, without its hairline
    frame = ax.get_window_extent(renderer)
    for i, a in enumerate(boxes):
        assert frame.x0 <= a.x0 and frame.y0 <= a.y0 and a.y1 <= frame.y1, names[i]
        assert not any(a.overlaps(b) for b in boxes[i + 1 :]), names[i]
        for j, (x, y) in enumerate(points):
            if j == i:
                continue
            (x0, y0), (_, y1) = ax.transData.transform([(x, y - err), (x, y + err)])
            assert not (a.x0 < x0 < a.x1 and a.y0 < y1 and y0 < a.y1), (names[i], names[j])
    assert labels[0].xyann == (3, 3)  # kivi_k4v2, alone at the left edge: where it was
    assert lone.xyann == (3, 3)
    plt.close(fig)
