"""The long-context tasks, their CPU scoring under pseudo-decode and the GPU suite's jobs,
worker workload and result against the stand-in vLLM (seconds, on a tiny random model with a
character-level tokenizer)."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import string
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from kvarn_eval import cli
from kvarn_eval.accuracy.longctx import generate_answers, score_context
from kvarn_eval.accuracy.methods import select_methods
from kvarn_eval.accuracy.pseudo_decode import PseudoDecodeConfig, install, pseudo_decode
from kvarn_eval.gpu_longctx import depth_rows, retrieval_rows
from kvarn_eval.longctx import (
    ANSWER_SLACK,
    DEFAULT_TASKS,
    MAGIC_NEEDLES,
    TASKS,
    LongCtxOptions,
    answer_found,
    build_cell,
    build_cells,
    cell_length,
    haystack_ids,
    paired_by_context,
    repeated_ngram_fraction,
)

CHARS = string.ascii_letters + string.digits + " .,:;?!-'\n"
TEXT = (
    "The river ran past the old mill. Nobody knew who built it, or when. "
    "Children played on its banks in summer; in winter the ice was thick.\n"
) * 60


def char_tokenizer() -> Any:
    """One token per character of :data:`CHARS` (``<pad>=0``, ``<unk>=1``)."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel

    vocab = {"<pad>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>"
    )


def tiny_model(max_positions: int = 1024) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(CHARS) + 2,
        hidden_size=128,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=max_positions,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # peaky attention, so that quantization moves the logits
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    return model.eval()


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Path:
    """Worker processes import the stand-in ``vllm`` (first on PYTHONPATH)."""
    path = Path(__file__).resolve().parent / "fake_vllm"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")]))
    return path


@pytest.fixture(scope="module")
def tok() -> Any:
    return char_tokenizer()


@pytest.fixture(scope="module")
def hay(tok: Any) -> list[int]:
    return haystack_ids(tok, TEXT, 20000)


@pytest.mark.parametrize("task", TASKS)
def test_cells_have_their_items_and_lengths(task: str, tok: Any, hay: list[int]) -> None:
    cell = build_cell(tok, task, 1024, 12, hay, seed=3, prompt_len=1000)
    items = [it for c in cell for it in c.items]
    assert len(items) == 12
    for context in cell:
        for prompt, it in zip(context.prompts(), context.items, strict=True):
            assert len(prompt) <= 1000
            # the answer is the value's characters, and the context holds every value
            text = tok.decode(list(it.answer))
            assert text.strip() == it.answer_text and 0.0 <= it.depth <= 1.0
            for value in it.answer_text.split(", "):
                assert value in tok.decode(list(context.ids))
        longest = max(len(it.question) for it in context.items)
        assert len(context.ids) + longest > 950  # filled up to the question's room
    again = build_cell(tok, task, 1024, 12, hay, seed=3, prompt_len=1000)
    assert [c.ids for c in again] == [c.ids for c in cell]
    other = build_cell(tok, task, 1024, 12, hay, seed=4, prompt_len=1000)
    assert [c.ids for c in other] != [c.ids for c in cell]


def test_needle_depths_are_swept_and_values_in_order(tok: Any, hay: list[int]) -> None:
    passkey = build_cell(tok, "passkey", 1024, 10, hay)
    depths = [c.items[0].depth for c in passkey]
    # the first and last sentence ends of a short haystack bound the realized depths
    assert min(depths) < 0.05 and max(depths) > 0.8 and depths == sorted(depths)
    for context in build_cell(tok, "multivalue", 1024, 3, hay):
        text = tok.decode(list(context.ids))
        values = context.items[0].answer_text.split(", ")
        assert [text.index(v) for v in values] == sorted(text.index(v) for v in values)
    kv = build_cell(tok, "kv_lookup", 1024, 10, hay)
    lines = tok.decode(list(kv[0].ids)).splitlines()[2:]
    keys = [line.split(":")[0] for line in lines]
    assert len(keys) == len(set(keys)) > 10
    kv_depths = sorted(it.depth for it in kv[0].items)  # the first key follows the header
    assert kv_depths[0] < 0.2 and kv_depths[-1] > 0.9


def test_magic_numbers_are_completions_over_a_digit_free_haystack(tok: Any) -> None:
    """Eight needles with distinct one-word keys and five-digit values at depths 0.1-0.9 of
    WikiText-like text whose own digits are removed; each question is the start of its needle."""
    text = TEXT.replace("old mill.", "old mill in 1887 at 42 Elm Street.")
    cells = build_cells(tok, text, ["magic_numbers"], [4096], 2 * MAGIC_NEEDLES + 3)
    (cell,) = cells.values()
    assert [len(c.items) for c in cell] == [MAGIC_NEEDLES, MAGIC_NEEDLES, 3]
    assert DEFAULT_TASKS == ("magic_single",) == LongCtxOptions().tasks
    for context in cell:
        body = tok.decode(list(context.ids))
        needles = re.findall(r" The special magic number for (\w+) is (\d+)\.", body)
        assert len(needles) == MAGIC_NEEDLES == len({k for k, _ in needles})
        # the values are the context's only digits
        assert re.findall(r"\d+", body) == [v for _, v in needles]
        assert all(len(v) == 5 for _, v in needles) and "1887" not in body
        for it in context.items:
            question = tok.decode(list(it.question)).strip()
            assert f"{question} {it.answer_text}." in body
        depths = sorted(it.depth for it in context.items)
        if len(depths) == MAGIC_NEEDLES:  # 0.1 to 0.9, one needle per step of 0.8 / 7
            assert depths[0] == pytest.approx(0.1, abs=0.06)
            assert depths[-1] == pytest.approx(0.9, abs=0.06)
            assert all(0.05 < b - a < 0.18 for a, b in itertools.pairwise(depths))
    # one needle per context, its depth 0.1 to 0.9 in turn
    (single,) = build_cells(tok, text, ["magic_single"], [4096], 9).values()
    assert [len(c.items) for c in single] == [1] * 9
    assert [round(c.items[0].depth, 1) for c in single] == [d / 10 for d in range(1, 10)]
    assert all(re.findall(r"\d+", tok.decode(list(c.ids))) == [c.items[0].answer_text]
               for c in single)  # fmt: skip
    # the instruction-style tasks keep the text's digits
    (passkey,) = build_cells(tok, text, ["passkey"], [1024], 1).values()
    assert "1887" in tok.decode(list(passkey[0].ids))


def test_cells_are_capped_by_the_model(tok: Any) -> None:
    assert cell_length(8192, 8192, 32) == 8160 and cell_length(2048, None, 32) == 2048
    cells = build_cells(tok, TEXT, ["kv_lookup"], [512, 1024, 2048], 4, max_positions=1024)
    # 2048 capped to 992 tokens; 1024 (capped to 992 as well) is dropped as a duplicate
    assert sorted(cells) == [("kv_lookup", 512), ("kv_lookup", 1024)]
    with pytest.raises(ValueError, match="unknown long-context task"):
        build_cell(tok, "nope", 1024, 1, [])
    with pytest.raises(ValueError, match="lengths >= 512"):
        LongCtxOptions(lengths=(100,))


def test_measures() -> None:
    assert repeated_ngram_fraction([1, 2, 3, 4, 5, 6]) == 0.0
    # nine 4-grams, the first four new, the five after them repeats
    assert repeated_ngram_fraction([1, 2, 3, 4] * 3) == pytest.approx(5 / 9)
    # two contexts: one where the method loses both items, one where it agrees
    change, se = paired_by_context([0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1])
    # per-context means -1 and 0: their standard error, sqrt(0.5 / 2), not that of 4 items
    assert change == -0.5 and se == pytest.approx(math.sqrt(0.5 / 2))
    items = [{"task": "passkey", "length": 512, "context": str(i // 2)} for i in range(4)]
    rows = retrieval_rows("c", [False, False, True, True], [True] * 4, items)
    assert [(r["task"], r["items"]) for r in rows] == [("all", 4), ("passkey", 4)]
    assert rows[0]["change"] == -0.5 and rows[0]["change_se"] == pytest.approx(se)
    deep = [{**m, "depth": d} for m, d in zip(items, (0.1, 0.2, 0.5, 0.9), strict=True)]
    thirds = depth_rows("c", [False, False, True, True], [True] * 4, deep)
    assert [(r["task"], r["items"], r["accuracy"]) for r in thirds] == [
        ("first third", 2, 0.0), ("middle third", 1, 1.0), ("last third", 1, 1.0),
    ]  # fmt: skip


def test_greedy_answers_equal_full_passes(tok: Any, hay: list[int]) -> None:
    """Prefill once, decode each question from the cache cropped back to the context (memo
    restored) = greedy on the full sequence under pseudo-decode: one full pass over context,
    question and generated tokens predicts each generated token."""
    model = install(tiny_model())
    (context,) = build_cell(tok, "kv_lookup", 512, 2, hay, prompt_len=320)
    (method,) = select_methods("kvarn_k4v2_g64", 64)
    config = PseudoDecodeConfig(method=method, block_size=64, recent_blocks=1)
    with pseudo_decode(config), torch.inference_mode():
        outs = generate_answers(model, context)
        for prompt, it, out in zip(context.prompts(), context.items, outs, strict=True):
            assert len(out) == len(it.answer) + ANSWER_SLACK
            logits = model(input_ids=torch.tensor([prompt + out[:-1]]), use_cache=False).logits
            assert logits[0, len(prompt) - 1 :].argmax(-1).tolist() == out
        # an answer that is the decoded greedy text is found; the real one is not
        right = score_context(model, context, lambda ids: tok.decode(ids))
    assert right == [
        answer_found(tok.decode(o), it.answer_text) for o, it in zip(outs, context.items)
    ]
    assert answer_found("the 364608.", "364608") and not answer_found("1364608", "364608")
    assert answer_found("272058. 188126, 925212", "272058, 188126, 925212")
    assert not answer_found("272058, 188126", "272058, 188126, 925212")


@pytest.fixture
def char_model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "char-llama"
    tiny_model(max_positions=1024).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def test_cpu_suite_from_the_command_line(
    char_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    out = tmp_path / "out"
    argv = [
        "bench", "--suites", "longctx_cpu", "--model", str(char_model_dir), "--text", str(text),
        "--block-size", "64", "--longctx-cpu-lengths", "512", "--longctx-cpu-items", "2",
        "--longctx-tasks", "passkey,kv_lookup", "--longctx-cpu-methods", "kvarn_k4v2_g64",
        "--out", str(out), "--no-plot",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    result = json.loads((out / "results.json").read_text())["results"][0]
    assert result["suite"] == "longctx_cpu"
    rows = {(r["task"], r["method"]): r for r in result["retrieval"]}
    assert set(rows) == {
        (t, m) for t in ("passkey", "kv_lookup") for m in ("bf16", "kvarn_k4v2_g64")
    }
    assert all(r["items"] == 2 and r["prompt_tokens"] <= 512 for r in rows.values())
    assert rows[("kv_lookup", "bf16")]["change"] == 0.0
    assert "longctx_cpu: retrieval under pseudo-decode" in capsys.readouterr().out


def test_gpu_suite_against_the_stand_in(
    fake_vllm: Path,
    char_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvarn_eval import suites

    monkeypatch.setattr(suites, "_gpu_available", lambda: True)
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    out = tmp_path / "out"
    argv = [
        "bench", "--suites", "longctx", "--greedy-model", str(char_model_dir), "--text",
        str(text), "--longctx-lengths", "768,2048", "--longctx-items", "5",
        "--longctx-caches", "kvarn_k4v2_g128,fp8", "--longctx-gen-prompts", "2",
        "--longctx-gen-context", "64", "--longctx-gen-tokens", "16",
        "--longctx-noise-max-num-seqs", "4", "--out", str(out),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    specs = {
        json.loads(p.read_text())["name"]: json.loads(p.read_text())
        for p in (out / "runs").rglob("*.spec.json")
    }
    assert sorted(specs) == [
        "longctx/bf16@TRITON_ATTN", "longctx/bf16@TRITON_ATTN seqs<=4", "longctx/fp8",
        "longctx/kvarn_k4v2_g128",
    ]  # fmt: skip
    ref = specs["longctx/bf16@TRITON_ATTN"]
    assert ref["llm_kwargs"]["max_model_len"] <= 1024  # the model's positions
    assert ref["llm_kwargs"]["long_prefill_token_threshold"] == 128  # pseudo-decode on vLLM
    assert ref["llm_kwargs"]["enable_prefix_caching"] is False
    # the default task (magic_single) x lengths (2048 capped) x items
    assert len(ref["workload"]["items"]) == 1 * 2 * 5
    assert specs["longctx/bf16@TRITON_ATTN seqs<=4"]["workload"]["retrieval"] is False
    payload = json.loads((out / "results.json").read_text())
    result = payload["results"][0]
    cells = {(r["cache"], r["task"], r["length"]) for r in result["retrieval"]}
    assert ("fp8", "all", 2048) in cells and ("kvarn_k4v2_g128", "magic_single", 768) in cells
    gen = {g["cache"]: g for g in result["generation"]}
    # the stand-in is deterministic, and its kvarn tokens change after the first half
    assert gen["bf16@TRITON_ATTN seqs<=4"]["token_agreement"] == 1.0
    assert gen["fp8"]["exact_match"] == 1.0 and gen["kvarn_k4v2_g128"]["mean_lcp"] == 9
    assert (out / "longctx.png").is_file()
    assert {t["title"].split(":")[0] for t in result["tables"]} == {"longctx"}
    assert {d["task"] for d in result["depth"]} <= {"first third", "middle third", "last third"}


def test_dry_run_prints_the_engines(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "bench", "--suites", "longctx", "--dry-run", "--greedy-model", "m.gguf",
        "--longctx-caches", "fp8@TRITON_ATTN,kvarn", "--longctx-lengths", "2048,4096",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    # six kvarn presets, fp8, the bf16 reference put first, the noise run
    assert "longctx: 9 vLLM engines on m.gguf" in out and "lengths 2048,4096" in out
    with pytest.raises(SystemExit):
        cli.main(["bench", "--suites", "longctx", "--longctx-lengths", "x"])
