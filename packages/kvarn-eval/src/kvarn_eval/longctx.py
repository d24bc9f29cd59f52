"""Long-context retrieval tasks in the RULER manner, and the measures of long generations.

Six tasks, each a set of *contexts* (token ids) and *items* (a question asked after one
context, and the answer's token ids), built deterministically from a seed:

* ``magic_single`` (the default): one needle "The special magic number for lantern is
  48213." in a haystack of WikiText-2 with its digits removed, its depth swept over nine
  points from 10% to 90%; asked by completion, the prompt ending "The special magic number
  for lantern is". Values are five digits and the haystack holds no other number: a format
  a small model retrieves by copying (SmolLM2-135M-Instruct in bf16, docs/long-context.md),
  where the instruction-style tasks below test its instruction following as much as the
  cache (RULER's single needle, completion-style).
* ``magic_numbers``: eight such needles with distinct one-word keys at depths 10% to 90%,
  each asked in turn (the others are distractors): an eighth of the prefills per question
  on CPU, but SmolLM2 confuses its keys (about 70% right in bf16 on CPU at 2K and 8K).
* ``passkey``: one needle ("The pass key is 471932. Remember it. ...") in a haystack of
  WikiText-2 text, one question per context.
* ``multikey``: four needles with distinct keys ("The special magic number for quiet-river
  is: 583920."); each key is asked in turn, the other needles are the distractors.
* ``multivalue``: one key with three values spread through the haystack; the answer is the
  three values in the order they appear.
* ``kv_lookup``: no haystack: a list of ``key: value`` lines filling the context
  (``amber-382: 591047``); ten keys are asked per context. Exact copying by induction, which
  small models do at lengths where they fail the prose tasks.

A context's tokens are built from separately tokenized pieces joined as ids (a haystack slice
ending at a sentence end, a needle, the next slice, ...), so every prompt has exactly the
length asked for up to the question, and the same ids go to transformers and to vLLM. Each
item's question plus answer is tokenized in one piece and split where the question ends, so
the answer ids are those a greedy decoder emits when it copies the value. An item is right
when the text greedy decoding writes in the answer's length plus :data:`ANSWER_SLACK` tokens
holds every value of the answer exactly (as a whole number, RULER's string match: ``the
364608`` counts, ``164608`` does not).

Needle depth (the asked needle's position in the haystack, 0 = start, 1 = end) is swept over
ten points (``magic_numbers``: eight, ``magic_single``: nine, 0.1 to 0.9); every item
records its depth. Pure Python apart from the tokenizer passed in.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_LENGTHS",
    "DEFAULT_TASKS",
    "TASKS",
    "LongContext",
    "LongCtxOptions",
    "LongItem",
    "build_cell",
    "build_cells",
    "max_new_tokens",
    "paired_by_context",
    "cell_length",
    "answer_found",
    "digit_free",
    "haystack_ids",
    "repeated_ngram_fraction",
]

TASKS: tuple[str, ...] = (
    "magic_single", "magic_numbers", "passkey", "multikey", "multivalue", "kv_lookup"
)  # fmt: skip
DEFAULT_TASKS: tuple[str, ...] = ("magic_single",)
# tasks whose haystack has its digits removed
DIGIT_FREE_TASKS = frozenset({"magic_numbers", "magic_single"})
DEFAULT_LENGTHS: tuple[int, ...] = (2048, 4096, 8192, 16384, 32768)
DEPTHS = 10  # needle depths swept: 0, 1/9, ..., 1
MAGIC_NEEDLES = 8  # needles (and questions) per magic_numbers context
QUESTIONS_PER_CONTEXT = {
    "magic_numbers": MAGIC_NEEDLES,
    "magic_single": 1,
    "passkey": 1,
    "multikey": 4,
    "multivalue": 1,
    "kv_lookup": 10,
}
MULTIVALUE_VALUES = 3
KV_QUESTION = "\nLook up a key of the list above.\n{key}:"
ANSWER_SLACK = 4  # greedy tokens allowed beyond the answer's own
ANSWER_RESERVE = 40  # tokens kept free under the model's positions for the answer

_ADJECTIVES = (
    "amber", "quiet", "bright", "silver", "rapid", "gentle", "hollow", "golden", "frozen",
    "crimson", "ancient", "narrow", "velvet", "bitter", "hidden", "lucky", "proud", "shy",
    "wild", "calm", "brave", "clever", "dusty", "eager", "fancy", "fierce", "fuzzy", "giant",
    "happy", "humble", "jolly", "lively", "mighty", "noble", "plain", "rusty", "salty",
    "sleepy", "smooth", "sunny", "tidy", "vivid", "warm", "windy", "young"
)  # fmt: skip
_NOUNS = (
    "river", "lantern", "falcon", "meadow", "harbor", "pepper", "canyon", "ribbon", "thistle",
    "marble", "compass", "orchard", "beacon", "willow", "garnet", "saddle", "glacier", "pebble",
    "violin", "tunnel", "kettle", "spruce", "walrus", "cobalt", "lagoon", "quarry", "tulip",
    "anchor", "badger", "fossil", "acorn", "basket", "candle", "cactus", "donkey", "engine",
    "feather", "garden", "hammer", "island", "jacket", "ladder", "magnet", "needle", "oyster",
    "parrot", "pillow", "pocket", "rabbit", "rocket", "sandal", "shovel", "spider", "statue",
    "teapot", "ticket", "tomato", "turtle", "wagon", "whistle", "window", "zipper", "bucket",
    "button", "carpet", "cherry", "cotton", "dragon"
)  # fmt: skip

_HEADERS = {
    "magic_numbers": "",
    "magic_single": "",
    "passkey": "There is an important piece of information hidden inside a lot of irrelevant "
    "text. Find it and memorize it. I will quiz you about it afterwards.\n",
    "multikey": "Some special magic numbers are hidden inside the following text. Make sure to "
    "memorize them. I will quiz you about the numbers afterwards.\n",
    "multivalue": "Some special magic numbers are hidden inside the following text. Make sure "
    "to memorize them. I will quiz you about the numbers afterwards.\n",
    "kv_lookup": "Here is a list of keys and their values. Memorize it; I will ask you for "
    "the value of some keys afterwards.\n",
}


DEFAULT_CACHES = "bf16@TRITON_ATTN,fp8@TRITON_ATTN,turboquant_4bit_nc,turboquant_k3v4_nc,kvarn"
DEFAULT_CPU_METHODS = "bf16,kvarn_k4v2_g128,kvarn_k2v2_g128,kivi_k2v2"


@dataclass
class LongCtxOptions:
    """What the long-context suites (``longctx`` on vLLM, ``longctx_cpu``) were asked for.

    Attributes:
        tasks: tasks of :data:`TASKS` (default :data:`DEFAULT_TASKS`).
        lengths: nominal context lengths of the GPU suite (capped by the model's positions).
        items: questions per (task, length) cell.
        seed: seed of every context.
        caches: KV caches of the GPU suite (``kvarn_eval.serving.caches`` syntax); the first
            bf16 one is the reference (``bf16@TRITON_ATTN`` is added first when none is).
        longgen_prompts: WikiText-2 passages continued greedily (0: no long generations).
        longgen_context: tokens of each passage.
        longgen_tokens: greedy tokens generated after each passage.
        noise_max_num_seqs: the reference cache again on the long generations with this
            concurrency limit (another batch shape): the bf16-against-bf16 noise floor (0: none).
        cpu_lengths: nominal lengths of the CPU suite.
        cpu_items: questions per cell of the CPU suite.
        cpu_methods: methods of the CPU suite (pseudo-decode; the reference is added).
    """

    tasks: tuple[str, ...] = DEFAULT_TASKS
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    items: int = 100
    seed: int = 0
    caches: str = DEFAULT_CACHES
    longgen_prompts: int = 16
    longgen_context: int = 4096
    longgen_tokens: int = 1024
    noise_max_num_seqs: int = 8
    prefill_chunk: int = 128
    cpu_lengths: tuple[int, ...] = (2048,)
    cpu_items: int = 20
    cpu_methods: str = DEFAULT_CPU_METHODS

    def __post_init__(self) -> None:
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown or not self.tasks:
            raise ValueError(f"longctx tasks must be some of {', '.join(TASKS)}, got {self.tasks}")
        for name in ("lengths", "cpu_lengths"):
            values = getattr(self, name)
            if not values or min(values) < 512:
                raise ValueError(f"longctx {name} must be lengths >= 512 tokens, got {values}")
        for name in ("items", "cpu_items", "longgen_context", "longgen_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"longctx {name} must be >= 1, got {getattr(self, name)}")
        for name in ("longgen_prompts", "noise_max_num_seqs", "prefill_chunk"):
            if getattr(self, name) < 0:
                raise ValueError(f"longctx {name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class LongItem:
    """One question after one context.

    Attributes:
        task: one of :data:`TASKS`.
        length: the cell's nominal context length in tokens (2048, 4096, ...).
        context: index of its context within the cell.
        depth: the asked needle's relative position in the context, in ``[0, 1]``.
        question: token ids of the question, appended to the context.
        answer: token ids of the answer (what greedy decoding must reproduce).
        answer_text: the answer as text.
    """

    task: str
    length: int
    context: int
    depth: float
    question: tuple[int, ...]
    answer: tuple[int, ...]
    answer_text: str


@dataclass(frozen=True)
class LongContext:
    """A context (token ids, BOS first where the tokenizer adds one) and its items."""

    task: str
    length: int
    index: int
    ids: tuple[int, ...]
    items: tuple[LongItem, ...]

    def prompts(self) -> list[list[int]]:
        """``[context + question]`` per item."""
        return [list(self.ids) + list(it.question) for it in self.items]


def cell_length(length: int, max_positions: int | None, new_tokens: int) -> int:
    """The prompt length of a cell: ``length``, or less where the model's positions end
    (``max_positions - new_tokens``: the answer must fit too)."""
    if max_positions is None:
        return length
    return min(length, max_positions - new_tokens)


def repeated_ngram_fraction(tokens: Sequence[int], n: int = 4) -> float:
    """Share of the ``n``-grams of ``tokens`` that occurred earlier in ``tokens`` (0: none
    repeats; a generation caught in a loop approaches 1).

    Args:
        tokens: generated token ids.
        n: n-gram length.
    """
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / len(grams)


class _Tokens:
    """The tokenizer's ``encode`` without special tokens, and the BOS to put first."""

    def __init__(self, tokenizer: Any) -> None:
        from kvarn_eval.suites import leading_bos

        self.tokenizer = tokenizer
        self.bos = leading_bos(tokenizer)

    def __call__(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def split(self, question: str, answer: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``question + answer`` tokenized in one piece, split where the question ends."""
        q, full = self(question), self(question + answer)
        if full[: len(q)] != q or len(full) == len(q):
            raise ValueError(
                f"the tokenizer joins the question's end {question[-12:]!r} with the answer "
                f"{answer!r}: no clean split"
            )
        return tuple(q), tuple(full[len(q) :])


def _sentence_ends(tokenizer: Any, haystack: Sequence[int]) -> list[int]:
    """Positions ``p`` where a needle may go: before token ``p``, the token ``p - 1`` ending
    a sentence or a line."""
    texts: dict[int, str] = {}
    ends = []
    for p, tok in enumerate(haystack[:-1], 1):
        if tok not in texts:
            texts[tok] = str(tokenizer.decode([tok]))
        if texts[tok].rstrip(" ").endswith((".", "\n")):
            ends.append(p)
    return ends


def _value(rng: random.Random) -> str:
    return str(rng.randrange(100000, 1000000))


def _keys(rng: random.Random, count: int) -> list[str]:
    pairs = [(a, n) for a in _ADJECTIVES for n in _NOUNS]
    return [f"{a}-{n}" for a, n in rng.sample(pairs, count)]


def _insert(
    slice_ids: list[int], ends: list[int], needles: list[tuple[float, list[int]]]
) -> tuple[list[int], list[float]]:
    """``slice_ids`` with each ``(depth, ids)`` needle put at the sentence end nearest its
    depth; returns the ids and each needle's realized depth (in ``needles``' order)."""
    placed = []
    for depth, ids in needles:
        target = depth * len(slice_ids)
        at = min(ends, key=lambda p: abs(p - target)) if ends else round(target)
        placed.append((at, ids))
    order = sorted(range(len(placed)), key=lambda i: placed[i][0])
    out: list[int] = []
    prev = 0
    positions = [0] * len(placed)
    for i in order:
        at, ids = placed[i]
        out += slice_ids[prev:at]
        positions[i] = len(out)
        out += ids
        prev = at
    out += slice_ids[prev:]
    return out, [p / max(1, len(out)) for p in positions]


def _haystack_context(
    tok: _Tokens,
    task: str,
    body_len: int,
    haystack: Sequence[int],
    ends: list[int],
    rng: random.Random,
    index: int,
) -> tuple[list[int], list[tuple[float, str, str]]]:
    """A haystack context of at most ``body_len`` tokens (header included) with the task's
    needles, leaving room for its longest question after it; returns its ids and the
    questions ``(depth, question text, answer text)``."""
    header = tok(_HEADERS[task])
    grid = [d / (DEPTHS - 1) for d in range(DEPTHS)]
    if task in ("magic_numbers", "magic_single"):
        count = QUESTIONS_PER_CONTEXT[task]
        keys = rng.sample(_NOUNS, count)
        values = [str(v) for v in rng.sample(range(10000, 100000), count)]
        if count == 1:  # nine depths, 0.1 to 0.9, in turn
            depths = [0.1 + 0.1 * (index % 9)]
        else:
            depths = [0.1 + 0.8 * i / (count - 1) for i in range(count)]
        needles = [f" The special magic number for {k} is {v}." for k, v in zip(keys, values)]
        asks = [(f"\nThe special magic number for {k} is", f" {v}") for k, v in zip(keys, values)]
    elif task == "passkey":
        value = _value(rng)
        depths = [grid[index % DEPTHS]]
        needles = [f" The pass key is {value}. Remember it. {value} is the pass key."]
        asks = [("\nWhat is the pass key? The pass key is", f" {value}")]
    elif task == "multikey":
        keys, values = _keys(rng, 4), [_value(rng) for _ in range(4)]
        depths = rng.sample(grid, 4)
        needles = [f" The special magic number for {k} is: {v}." for k, v in zip(keys, values)]
        asks = [
            (f"\nWhat is the special magic number for {k}? The special magic number for {k} is:",
             f" {v}")
            for k, v in zip(keys, values)
        ]  # fmt: skip
    else:  # multivalue
        (key,) = _keys(rng, 1)
        values = [_value(rng) for _ in range(MULTIVALUE_VALUES)]
        depths = sorted(rng.sample(grid, MULTIVALUE_VALUES))
        needles = [f" One of the special magic numbers for {key} is: {v}." for v in values]
        asks = [
            (f"\nWhat are all the special magic numbers for {key}? The special magic numbers "
             f"for {key} are:", " " + ", ".join(values))
        ]  # fmt: skip
    needle_ids = [tok(n) for n in needles]
    room = max(len(tok(q)) for q, _ in asks)
    fill = body_len - room - len(header) - sum(len(n) for n in needle_ids)
    if fill < 64:
        raise ValueError(f"a {task} context of {body_len} tokens leaves no room for a haystack")
    if len(haystack) < fill + 1:
        raise ValueError(f"the haystack has {len(haystack)} tokens; a context needs {fill}")
    start = rng.randrange(0, len(haystack) - fill)
    window = list(haystack[start : start + fill])
    local = [p - start for p in ends if start < p < start + fill]
    body, realized = _insert(window, local, list(zip(depths, needle_ids)))
    if task == "multivalue":  # one question: the mean depth of its values
        realized = [sum(realized) / len(realized)]
    questions = [(d, q, a) for d, (q, a) in zip(realized, asks)]
    if task == "magic_numbers":  # asked in a random order, not by depth
        rng.shuffle(questions)
    return header + body, questions


def _kv_context(
    tok: _Tokens, body_len: int, rng: random.Random
) -> tuple[list[int], list[tuple[float, str, str]]]:
    """A list of ``key:value`` lines filling ``body_len`` tokens, less room for a question
    after it; ten keys asked, at depths spread over the list."""
    ids = tok(_HEADERS["kv_lookup"])
    # a key has at most 15 characters: as many tokens at worst, and a margin of two
    room = len(tok(KV_QUESTION.format(key=""))) + 17
    pairs = [(a, n) for a in _ADJECTIVES for n in _NOUNS]
    rng.shuffle(pairs)
    lines: list[tuple[int, str, str]] = []  # (position, key, value)
    while len(lines) < len(pairs):
        a, n = pairs[len(lines)]
        key = f"{a}-{n}"
        value = _value(rng)
        line = tok(f"\n{key}:{value}")
        if len(ids) + len(line) + room > body_len:
            break
        lines.append((len(ids), key, value))
        ids += line
    if len(lines) < 2:
        raise ValueError(f"a kv_lookup context of {body_len} tokens holds only {len(lines)} keys")
    count = min(QUESTIONS_PER_CONTEXT["kv_lookup"], len(lines))
    picks = [round(i * (len(lines) - 1) / (count - 1)) for i in range(count)]
    asks = []
    for i in picks:
        pos, key, value = lines[i]
        asks.append((pos / len(ids), KV_QUESTION.format(key=key), value))
    rng.shuffle(asks)
    return ids, asks


def build_cell(
    tokenizer: Any,
    task: str,
    length: int,
    items: int,
    haystack: Sequence[int],
    *,
    seed: int = 0,
    prompt_len: int | None = None,
    ends: list[int] | None = None,
) -> list[LongContext]:
    """The contexts of one (task, length) cell, ``items`` questions in all.

    Args:
        tokenizer: a Hugging Face tokenizer.
        task: one of :data:`TASKS`.
        length: the nominal length (the cell's name).
        items: questions in the cell (the last context may ask fewer than the others).
        haystack: token ids of the filler text (WikiText-2; :func:`digit_free` text for the
            tasks of :data:`DIGIT_FREE_TASKS`), at least ``length`` long.
        seed: everything random comes from ``(seed, task, length, context index)``.
        prompt_len: tokens of context plus question (default ``length``; see
            :func:`cell_length`).
        ends: sentence ends of ``haystack`` (computed when ``None``; pass them to share the
            work between cells).

    Raises:
        ValueError: an unknown task, too few items or a length too short.
    """
    if task not in TASKS:
        raise ValueError(f"unknown long-context task {task!r}; expected one of {TASKS}")
    if items < 1:
        raise ValueError(f"items must be >= 1, got {items}")
    tok = _Tokens(tokenizer)
    body_len = (prompt_len or length) - (tok.bos is not None)
    if body_len < 256:
        raise ValueError(f"a context of {prompt_len or length} tokens is too short (>= 257)")
    if task != "kv_lookup" and ends is None:
        ends = _sentence_ends(tokenizer, haystack)
    per = QUESTIONS_PER_CONTEXT[task]
    contexts: list[LongContext] = []
    done = 0
    while done < items:
        index = len(contexts)
        rng = random.Random(f"{seed}/{task}/{length}/{index}")
        if task == "kv_lookup":
            body, asks = _kv_context(tok, body_len, rng)
        else:
            assert ends is not None
            body, asks = _haystack_context(tok, task, body_len, haystack, ends, rng, index)
        asks = asks[: min(per, items - done)]
        ids = ([tok.bos] if tok.bos is not None else []) + body
        made = []
        for depth, question, answer in asks:
            q_ids, a_ids = tok.split(question, answer)
            if len(ids) + len(q_ids) > (prompt_len or length):
                raise RuntimeError(
                    f"a {task} prompt of {len(ids) + len(q_ids)} tokens outgrew its cell of "
                    f"{prompt_len or length}"
                )
            made.append(
                LongItem(task, length, index, round(depth, 4), q_ids, a_ids, answer.strip())
            )
        contexts.append(LongContext(task, length, index, tuple(ids), tuple(made)))
        done += len(made)
    return contexts


def digit_free(text: str) -> str:
    """``text`` without its digits: the haystack of :data:`DIGIT_FREE_TASKS`, so that the
    only numbers of a context are its needles' values (WikiText-2's "1 @,@ 000" becomes
    " @,@ ")."""
    return re.sub(r"[0-9]", "", text)


def haystack_ids(tokenizer: Any, text: str, tokens: int) -> list[int]:
    """The first ``tokens`` tokens (or all) of ``text``, tokenized in growing prefixes."""
    prefix = tokens * 6
    while True:
        ids = list(tokenizer(text[:prefix], add_special_tokens=False)["input_ids"])
        if len(ids) >= tokens or prefix >= len(text):
            return ids[:tokens]
        prefix *= 2


def answer_found(text: str, answer: str) -> bool:
    """Whether ``text`` holds every comma-separated value of ``answer`` as a whole number
    (not inside a longer run of digits).

    Args:
        text: what greedy decoding wrote.
        answer: the item's answer text (``"471932"``, ``"272058, 188126, 925212"``).
    """
    return all(
        re.search(rf"(?<!\d){re.escape(v.strip())}(?!\d)", text) is not None
        for v in answer.split(",")
    )


def paired_by_context(
    mine: Sequence[bool], ref: Sequence[bool], contexts: Sequence[Any]
) -> tuple[float, float]:
    """Mean of (mine right) - (reference right) over items and its standard error, the
    items clustered by context (per-context means weighted by their item counts).

    Args:
        mine: per item, this method right.
        ref: per item, the reference right (same items, same order).
        contexts: per item, its context (any hashable key).
    """
    from kvarn_eval.accuracy.summary import weighted_mean_and_se

    sums: dict[Any, float] = {}
    counts: dict[Any, int] = {}
    for a, b, c in zip(mine, ref, contexts, strict=True):
        sums[c] = sums.get(c, 0.0) + float(a) - float(b)
        counts[c] = counts.get(c, 0) + 1
    keys = list(sums)
    return weighted_mean_and_se([sums[k] / counts[k] for k in keys], [counts[k] for k in keys])


def max_new_tokens(item: LongItem) -> int:
    """Greedy tokens generated after ``item``'s question: its answer's, plus the slack."""
    return len(item.answer) + ANSWER_SLACK


def build_cells(
    tokenizer: Any,
    text: str,
    tasks: Sequence[str],
    lengths: Sequence[int],
    items: int,
    *,
    seed: int = 0,
    max_positions: int | None = None,
    new_tokens: int = ANSWER_RESERVE,
) -> dict[tuple[str, int], list[LongContext]]:
    """Every (task, length) cell: :func:`build_cell` over one WikiText-2 haystack, lengths
    capped by :func:`cell_length` (a length the cap makes equal to a shorter one is dropped).

    Args:
        tokenizer: a Hugging Face tokenizer.
        text: the haystack's text (WikiText-2 test).
        tasks: tasks of :data:`TASKS` (default :data:`DEFAULT_TASKS`).
        lengths: nominal lengths.
        items: questions per cell.
        seed: the contexts' seed.
        max_positions: the model's positions (``None``: no cap).
        new_tokens: tokens generated after a question (kept free under the cap).
    """
    capped: dict[int, int] = {}
    for length in sorted(lengths):
        prompt_len = cell_length(length, max_positions, new_tokens)
        if prompt_len not in capped.values():
            capped[length] = prompt_len
    tokens = max(60000, 4 * max(capped.values()))
    hays: dict[bool, tuple[list[int], list[int]]] = {}
    for plain in sorted({t in DIGIT_FREE_TASKS for t in tasks}):
        hay = haystack_ids(tokenizer, digit_free(text) if plain else text, tokens)
        hays[plain] = (hay, _sentence_ends(tokenizer, hay))
    cells = {}
    for task in tasks:
        hay, ends = hays[task in DIGIT_FREE_TASKS]
        for length, prompt_len in capped.items():
            cells[(task, length)] = build_cell(
                tokenizer, task, length, items, hay, seed=seed, prompt_len=prompt_len, ends=ends
            )
    return cells
