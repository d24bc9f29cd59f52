"""The soak's client (``packages/kvarn-eval/scripts/soak.py`` starts the server): a bounded
asyncio mixed load against an OpenAI-compatible server, every answer checked.

:func:`soak` sends a fixed greedy probe set twice (one request at a time), then keeps
``--concurrency`` requests in flight for the load's seconds (:func:`next_spec`'s seeded mix:
short and long prompts, the long ones sharing passages so that the prefix cache hits; streaming
and not; greedy and sampled; ``n`` of 2 or 3; log-probabilities; streams cancelled after a few
events; a greedy prompt repeated), polling ``/metrics`` and GPU memory, then the probes again.
It checks every answer (:func:`completion_problems`: status, ``[DONE]``, choices, token ids in
the vocabulary, finite log-probabilities), that the probes answer after the load as before it,
that repeated greedy answers start with a token a serial run gave (:func:`repeat_summary`), GPU
memory and health. Raw HTTP/1.1 over asyncio streams: no dependencies, no vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

__all__ = [
    "COUNTERS",
    "MODEL_NAME",
    "Load",
    "Reply",
    "completion_problems",
    "memory_steady",
    "metric",
    "next_spec",
    "parse_metrics",
    "probe_prompts",
    "repeat_summary",
    "request",
    "run_load",
    "run_probes",
    "soak",
]

MODEL_NAME = "smollm2"
PASSAGES = [
    "The river town kept its old mill long after the railway came. Each spring the water "
    "rose over the lower fields, and the miller's family moved the grain to the loft. ",
    "A compiler turns source text into tokens, tokens into a tree, the tree into an "
    "intermediate form, and that form into machine code, checking types along the way. ",
    "In the winter of that year the expedition crossed the ice shelf in eleven days, "
    "hauling sledges of food and fuel, and mapping the coast as far as the cape. ",
]
SHORT_PROMPTS = [
    "The capital of France is",
    "List three prime numbers:",
    "def fibonacci(n):",
    "Once upon a time",
    "Q: What is 12 times 7?\nA:",
    "Translate to French: good morning",
]


def long_prompt(index: int, repeats: int) -> str:
    """A prompt of a shared passage repeated (prefix-cache hits; n-gram drafts find matches)
    and a distinct question at its end."""
    passage = PASSAGES[index % len(PASSAGES)]
    return passage * repeats + f"\nQuestion {index}: summarize the text above in one line.\n"


def probe_prompts(repeats: int) -> list[str]:
    """The fixed greedy probe set: long enough to read several quantized tiles."""
    return [long_prompt(i, repeats) for i in range(len(PASSAGES))] + [
        PASSAGES[0] * (repeats // 2) + SHORT_PROMPTS[i] for i in range(3)
    ]


# --- HTTP (asyncio streams; vLLM's server speaks HTTP/1.1) ---------------------------------


@dataclass
class Reply:
    """One HTTP exchange: status, the JSON body or the stream's events, whether the client
    closed a stream early, and whether the stream ended with ``[DONE]``."""

    status: int
    body: Any = None
    events: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    cancelled: bool = False


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> Any:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        chunks = []
        async for chunk in _chunks(reader):
            chunks.append(chunk)
        return b"".join(chunks)
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    return await reader.read()


async def _chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while True:
        size_line = await reader.readline()
        if not size_line:
            return
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            await reader.readline()
            return
        data = await reader.readexactly(size)
        await reader.readexactly(2)
        yield data


async def request(
    base: str,
    path: str,
    payload: dict[str, Any] | None = None,
    *,
    cancel_after: int | None = None,
    timeout: float = 300.0,
) -> Reply:
    """GET (no payload) or POST JSON to ``base + path``. A payload with ``"stream": true``
    reads server-sent events; ``cancel_after=n`` closes the connection after ``n`` events (the
    server then aborts the request, as when a user goes away)."""
    url = urlsplit(base)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        body = b"" if payload is None else json.dumps(payload).encode()
        head = (
            f"{'GET' if payload is None else 'POST'} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        )
        writer.write(head.encode() + body)
        await writer.drain()
        return await asyncio.wait_for(_response(reader, payload, cancel_after), timeout)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _response(
    reader: asyncio.StreamReader, payload: dict[str, Any] | None, cancel_after: int | None
) -> Reply:
    status = int((await reader.readline()).split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    if not (payload and payload.get("stream")) or status != 200:
        raw = await _read_body(reader, headers)
        try:
            return Reply(status, json.loads(raw))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return Reply(status, raw.decode(errors="replace"))
    reply = Reply(status)
    buffer = b""
    source = _chunks(reader) if "chunked" in headers.get("transfer-encoding", "") else None
    while True:
        data = await source.__anext__() if source else await reader.read(65536)
        if not data:
            break
        buffer += data
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            text = line.decode().strip()
            if not text.startswith("data:"):
                continue
            item = text[len("data:") :].strip()
            if item == "[DONE]":
                reply.done = True
                return reply
            reply.events.append(json.loads(item))
            if cancel_after is not None and len(reply.events) >= cancel_after:
                reply.cancelled = True
                return reply
    return reply


# --- checks ---------------------------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text: each metric's samples summed over their labels (``_total`` kept)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{")[0].strip()
        try:
            totals[name] = totals.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return totals


def metric(totals: dict[str, float], name: str) -> float | None:
    """``name`` or ``name_total`` (counters carry the suffix in the text format)."""
    for key in (name, f"{name}_total"):
        if key in totals:
            return totals[key]
    return None


def _choices(reply: Reply, spec: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Each choice's text, token ids (``None`` where the server sent none), log-probabilities
    and finish reason by index, a stream's deltas joined."""
    if spec.get("stream"):
        parts = [c for e in reply.events for c in e.get("choices", [])]
    else:
        parts = reply.body.get("choices", []) if isinstance(reply.body, dict) else []
    out: dict[int, dict[str, Any]] = {}
    for c in parts:
        o = out.setdefault(int(c.get("index", 0)), {"text": "", "ids": None, "lp": [], "fin": None})
        o["text"] += c.get("text") or ""
        if c.get("token_ids") is not None:
            o["ids"] = (o["ids"] or []) + list(c["token_ids"])
        o["lp"] += [
            v for v in (c.get("logprobs") or {}).get("token_logprobs") or [] if v is not None
        ]
        o["fin"] = c.get("finish_reason") or o["fin"]
    return out


def completion_problems(reply: Reply, spec: dict[str, Any], vocab: int | None = None) -> list[str]:
    """What is wrong with one completion's reply (empty when nothing is): a status other than
    200, a stream without ``[DONE]``, fewer choices than ``n``, a choice with no tokens that did
    not stop, token ids missing or outside ``[0, vocab)``, a non-finite log-probability."""
    if reply.status != 200:
        return [f"status {reply.status}: {str(reply.body)[:200]}"]
    if spec.get("stream") and reply.cancelled:
        return []
    if spec.get("stream") and not reply.done:
        return ["stream ended without [DONE]"]
    choices = _choices(reply, spec)
    n = int(spec["payload"].get("n", 1))
    problems = [] if len(choices) == n else [f"{len(choices)} choices, asked for {n}"]
    for i, c in sorted(choices.items()):
        ids = c["ids"]
        if not c["text"] and not ids and c["fin"] != "stop":
            problems.append(f"choice {i}: no text (finish_reason {c['fin']})")
        if spec["payload"].get("return_token_ids") and ids is None:
            problems.append(f"choice {i}: no token ids")
        bad = [t for t in ids or [] if not (isinstance(t, int) and 0 <= t < (vocab or 2**31))]
        if bad:
            problems.append(f"choice {i}: token ids outside [0, {vocab}): {bad[:8]}")
        if any(not math.isfinite(float(v)) for v in c["lp"]):
            problems.append(f"choice {i}: non-finite log-probability in {c['lp'][:8]}")
    return problems


def next_spec(
    rng: random.Random, index: int, long_repeats: int, repeat_prompt: str, repeat_tokens: int
) -> dict[str, Any]:
    """Request ``index`` of the mixed load (what it asks and how the client treats it). Every
    request asks for its token ids. Of every ten, the fourth is the greedy ``repeat_prompt``
    (``repeat``: its answers are compared with the probes'), the seventh samples 2 or 3
    choices (``-n``), the ninth a stream cancelled after 1-8 events; the others draw short or
    long, streaming or not, greedy or sampled, with log-probabilities or not, a stream
    cancelled or not, from ``rng``."""
    base = {"model": MODEL_NAME, "return_token_ids": True, "seed": index}
    slot = index % 10
    if slot == 3:
        payload = {"prompt": repeat_prompt, "max_tokens": repeat_tokens, "temperature": 0.0}
        return {"kind": "repeat", "stream": False, "payload": base | payload}
    long = rng.random() < 0.4
    prompt = long_prompt(rng.randrange(64), long_repeats) if long else rng.choice(SHORT_PROMPTS)
    stream = slot == 8 or (slot != 6 and rng.random() < 0.5)
    spec: dict[str, Any] = {
        "kind": f"{'long' if long else 'short'}-{'stream' if stream else 'plain'}",
        "stream": stream,
        "payload": base
        | {
            "prompt": prompt,
            "max_tokens": rng.choice([16, 64, 128, 256]),
            "temperature": rng.choice([0.0, 0.0, 0.8]),
            "ignore_eos": rng.random() < 0.5,
        },
    }
    if stream:
        spec["payload"]["stream"] = True
        if slot == 8 or rng.random() < 0.15:
            spec["cancel_after"] = rng.randint(1, 8)
            spec["kind"] += "-cancelled"
    elif slot == 6:
        spec["payload"] |= {"n": rng.choice([2, 3]), "temperature": 0.8}
        spec["kind"] += "-n"
    elif rng.random() < 0.3:
        spec["payload"]["logprobs"] = 1
    return spec


@dataclass
class Load:
    """What the client asks: ``seconds`` of load, ``concurrency`` requests in flight, the
    seeded mix (:func:`next_spec`), the vocabulary size the token ids must be under."""

    seconds: float
    concurrency: int
    seed: int
    long_repeats: int = 12
    repeat_prompt: str = PASSAGES[0]
    repeat_tokens: int = 16
    vocab: int | None = None


async def run_load(base: str, load: Load) -> dict[str, Any]:
    """Keep ``load.concurrency`` requests in flight for ``load.seconds``; returns counts,
    failures and the token ids of the ``repeat`` requests (``repeat_ids``)."""
    rng = random.Random(load.seed)
    counts: dict[str, int] = {}
    failures: list[dict[str, Any]] = []
    repeats: list[list[int]] = []
    served = cancelled = events = index = 0
    deadline = time.monotonic() + load.seconds

    async def worker() -> None:
        nonlocal served, cancelled, events, index
        while time.monotonic() < deadline:
            spec = next_spec(rng, index, load.long_repeats, load.repeat_prompt, load.repeat_tokens)
            index += 1
            try:
                reply = await request(
                    base, "/v1/completions", spec["payload"], cancel_after=spec.get("cancel_after")
                )
                problems = completion_problems(reply, spec, load.vocab)
            except Exception as exc:  # a dropped connection is a failure to report, not a crash
                reply, problems = Reply(0), [f"{type(exc).__name__}: {exc}"]
            counts[spec["kind"]] = counts.get(spec["kind"], 0) + 1
            served += 1
            cancelled += reply.cancelled
            events += len(reply.events)
            if problems:
                failures.append({"kind": spec["kind"], "problems": problems})
            elif spec["kind"] == "repeat":
                repeats.append(_choices(reply, spec)[0]["ids"] or [])

    await asyncio.gather(*(worker() for _ in range(load.concurrency)))
    return {
        "requests": served,
        "by_kind": dict(sorted(counts.items())),
        "cancelled": cancelled,
        "stream_events": events,
        "failed": len(failures),
        "failures": failures[:20],
        "repeat_ids": repeats,
    }


async def run_probes(base: str, prompts: list[str], max_tokens: int) -> list[dict[str, Any]]:
    """Greedy completions of ``prompts``, one at a time (no batching differences): each
    one's ``text`` and token ``ids``."""
    answers = []
    for prompt in prompts:
        payload = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens}
        reply = await request(
            base, "/v1/completions", payload | {"temperature": 0.0, "return_token_ids": True}
        )
        if reply.status == 200 and isinstance(reply.body, dict):
            choice = reply.body["choices"][0]
            answers.append({"text": choice["text"], "ids": choice.get("token_ids") or []})
        else:
            answers.append({"text": f"<status {reply.status}>", "ids": []})
    return answers


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def repeat_summary(repeats: list[list[int]], serial: list[list[int]]) -> dict[str, Any]:
    """The in-load greedy answers to one prompt against its serial answers (``serial``: the
    probe runs before the load). Batching may change a greedy answer's later tokens (vLLM's
    matmuls are not batch-invariant), so they are reported; a first token that no serial run
    gave (``first_token_differs``) is counted as a failure: garbage, not batching."""
    firsts = {s[0] for s in serial if s}
    return {
        "count": len(repeats),
        "distinct": len({tuple(r) for r in repeats}),
        "equal_to_a_serial_answer": sum(r in serial for r in repeats),
        "min_common_prefix": min(
            (max(common_prefix(r, s) for s in serial) for r in repeats), default=None
        ),
        "first_token_differs": sum(bool(r) and r[0] not in firsts for r in repeats),
    }


def gpu_memory_mib() -> float | None:
    """Used memory of GPU 0 from nvidia-smi, or None without one."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        return float(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


async def poll(base: str, stop: asyncio.Event, every: float, samples: list[dict[str, Any]]) -> None:
    """Sample /metrics and GPU memory every ``every`` seconds until ``stop``."""
    start = time.monotonic()
    while not stop.is_set():
        sample: dict[str, Any] = {"t": round(time.monotonic() - start, 1)}
        try:
            totals = parse_metrics(str((await request(base, "/metrics", timeout=30)).body))
            for name in ("vllm:num_preemptions", "vllm:num_requests_running"):
                sample[name] = metric(totals, name)
            sample["vllm:kv_cache_usage_perc"] = metric(totals, "vllm:kv_cache_usage_perc")
        except Exception as exc:
            sample["error"] = f"{type(exc).__name__}: {exc}"
        sample["gpu_mib"] = gpu_memory_mib()
        samples.append(sample)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), every)


def memory_steady(samples: list[dict[str, Any]], warmup: float, slack_mib: float) -> bool | None:
    """GPU memory after ``warmup`` seconds never grew more than ``slack_mib`` over its first
    sample there (None without samples)."""
    values = [s["gpu_mib"] for s in samples if s["t"] >= warmup and s.get("gpu_mib") is not None]
    if not values:
        return None
    return max(values) - values[0] <= slack_mib


COUNTERS = (
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


def load_seconds(args: argparse.Namespace) -> float:
    """``--minutes`` of load, or less where ``--budget-minutes`` (counted from the script's
    start, ``args.started``) leaves less after ``--reserve-seconds`` for what follows the load
    (then at least 30 s)."""
    seconds = float(args.minutes * 60)
    budget = getattr(args, "budget_minutes", None)
    if budget:
        left = args.started + budget * 60 - time.monotonic() - args.reserve_seconds
        seconds = max(30.0, min(seconds, left))
    return seconds


async def soak(base: str, args: argparse.Namespace) -> dict[str, Any]:
    """The client half: probes, the load with polling, probes again, the verdict."""
    prompts = probe_prompts(args.long_repeats)
    before = [await run_probes(base, prompts, args.probe_tokens) for _ in range(2)]
    start = parse_metrics(str((await request(base, "/metrics")).body))
    samples: list[dict[str, Any]] = []
    stop = asyncio.Event()
    poller = asyncio.create_task(poll(base, stop, args.poll_seconds, samples))
    t0 = time.monotonic()
    spec = Load(
        load_seconds(args), args.concurrency, args.seed, args.long_repeats,
        prompts[0], args.probe_tokens, getattr(args, "vocab", None),
    )  # fmt: skip
    load = await run_load(base, spec)
    elapsed = time.monotonic() - t0
    stop.set()
    await poller
    after = await run_probes(base, prompts, args.probe_tokens)
    end = parse_metrics(str((await request(base, "/metrics")).body))
    health = (await request(base, "/health")).status
    deltas = {}
    for name in COUNTERS:
        a, b = metric(start, name), metric(end, name)
        deltas[name] = None if a is None or b is None else b - a
    # Prefix-cache hits may change a probe's path (records read instead of a fresh prefill):
    # after the load it must equal one of the two runs before it.
    texts = [[p["text"] for p in run] for run in (after, *before)]
    same = [a in (b0, b1) for a, b0, b1 in zip(*texts, strict=True)]
    repeats = repeat_summary(load.pop("repeat_ids"), [run[0]["ids"] for run in before])
    steady = memory_steady(samples, args.warmup_seconds, args.memory_slack_mib)
    result = {
        "seconds": round(elapsed, 1),
        "load": load,
        "metrics_delta": deltas,
        "probes_same": sum(same),
        "probes": len(same),
        "probe_mismatches": [
            {"before": b0, "after": a}
            for a, b0, ok in zip(texts[0], texts[1], same, strict=True)
            if not ok
        ],
        "repeats": repeats,
        "memory_steady": steady,
        "samples": samples,
        "healthy_after": health == 200,
    }
    result["passed"] = bool(
        load["failed"] == 0
        and all(same)
        and repeats["first_token_differs"] == 0
        and health == 200
        and steady is not False
    )
    return result
