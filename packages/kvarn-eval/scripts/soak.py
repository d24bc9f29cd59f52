#!/usr/bin/env python3
"""Soak: ``vllm serve`` with a kvarn cache under a long mixed load, checking that nothing is lost.

The server runs ``--kv-cache-dtype kvarn_k4v2_g128`` (``--kv-cache-dtype``), prefix caching,
n-gram speculative decoding and a KV cache of ``--cache-tokens`` tokens, small enough that
vLLM must preempt running requests. A bounded asyncio client (``--concurrency`` requests in
flight, raw HTTP, no dependencies) sends for ``--minutes`` a seeded mix: short and long prompts
(the long ones share passages, so the prefix cache hits), streaming and not, greedy and
sampled, some asking for log-probabilities, and streams cancelled after a few tokens. It checks:

* every request answers 200 with text (cancelled ones excepted), every log-probability finite
  (NaN logits would show there), a stream ends with ``[DONE]``;
* a fixed greedy probe set (prompts reading several quantized tiles) answers the same after
  the load as before it (sent one at a time, so batching cannot change them);
* GPU memory (``nvidia-smi``) is steady after the warm-up, the server healthy at the end.

It prints and writes ``soak.json``: requests served by kind, failures, cancellations, tokens,
preemptions and speculative acceptance from vLLM's ``/metrics``, memory samples.

On the GPU machine (vLLM 0.26 from the parts, SmolLM2's GGUF carried with ``--file``)::

    source /tmp/kvarn-gpu/env.sh
    python3 -m pip install --no-deps --no-build-isolation -e packages/kvarn-math \\
        -e packages/kvarn-kernels -e packages/kvarn-vllm
    python3 packages/kvarn-eval/scripts/soak.py --out $OUT/soak --minutes 15

The client half (everything but starting the server) runs against any OpenAI-compatible
server: ``--url http://host:port`` skips the launch (tests run it against a fake one).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
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


async def _chunks(reader: asyncio.StreamReader):  # type: ignore[no-untyped-def]
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


def completion_problems(reply: Reply, spec: dict[str, Any]) -> list[str]:
    """What is wrong with one completion's reply (empty when nothing is)."""
    if reply.status != 200:
        return [f"status {reply.status}: {str(reply.body)[:200]}"]
    if spec.get("stream"):
        if reply.cancelled:
            return []
        if not reply.done:
            return ["stream ended without [DONE]"]
        choices = [c for e in reply.events for c in e.get("choices", [])]
    else:
        choices = reply.body.get("choices", []) if isinstance(reply.body, dict) else []
    text = "".join(c.get("text") or "" for c in choices)
    problems = [] if text else ["no text"]
    for c in choices:
        lp = c.get("logprobs") or {}
        values = [v for v in lp.get("token_logprobs") or [] if v is not None]
        if any(not math.isfinite(float(v)) for v in values):
            problems.append(f"non-finite log-probability in {values[:8]}")
            break
    return problems


def next_spec(rng: random.Random, index: int, long_repeats: int) -> dict[str, Any]:
    """One request of the mixed load (what it asks and how the client treats it)."""
    long = rng.random() < 0.4
    prompt = long_prompt(rng.randrange(64), long_repeats) if long else rng.choice(SHORT_PROMPTS)
    stream = rng.random() < 0.5
    spec: dict[str, Any] = {
        "kind": f"{'long' if long else 'short'}-{'stream' if stream else 'plain'}",
        "stream": stream,
        "payload": {
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": rng.choice([16, 64, 128, 256]),
            "temperature": rng.choice([0.0, 0.0, 0.8]),
            "ignore_eos": rng.random() < 0.5,
            "seed": index,
        },
    }
    if stream:
        spec["payload"]["stream"] = True
        if rng.random() < 0.25:
            spec["cancel_after"] = rng.randint(1, 8)
            spec["kind"] += "-cancelled"
    elif rng.random() < 0.3:
        spec["payload"]["logprobs"] = 1
    return spec


async def run_load(
    base: str, seconds: float, concurrency: int, seed: int, long_repeats: int = 12
) -> dict[str, Any]:
    """Keep ``concurrency`` requests in flight for ``seconds``; returns counts and failures."""
    rng = random.Random(seed)
    counts: dict[str, int] = {}
    failures: list[dict[str, Any]] = []
    served = cancelled = events = 0
    deadline = time.monotonic() + seconds
    index = 0

    async def worker() -> None:
        nonlocal served, cancelled, events, index
        while time.monotonic() < deadline:
            spec = next_spec(rng, index, long_repeats)
            index += 1
            try:
                reply = await request(
                    base, "/v1/completions", spec["payload"], cancel_after=spec.get("cancel_after")
                )
                problems = completion_problems(reply, spec)
            except Exception as exc:  # a dropped connection is a failure to report, not a crash
                reply, problems = Reply(0), [f"{type(exc).__name__}: {exc}"]
            counts[spec["kind"]] = counts.get(spec["kind"], 0) + 1
            served += 1
            cancelled += reply.cancelled
            events += len(reply.events)
            if problems:
                failures.append({"kind": spec["kind"], "problems": problems})

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {
        "requests": served,
        "by_kind": dict(sorted(counts.items())),
        "cancelled": cancelled,
        "stream_events": events,
        "failed": len(failures),
        "failures": failures[:20],
    }


async def run_probes(base: str, prompts: list[str], max_tokens: int) -> list[str]:
    """Greedy completions of ``prompts``, one at a time (no batching differences)."""
    texts = []
    for prompt in prompts:
        payload = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens}
        reply = await request(base, "/v1/completions", {**payload, "temperature": 0.0})
        ok = reply.status == 200 and isinstance(reply.body, dict)
        texts.append(reply.body["choices"][0]["text"] if ok else f"<status {reply.status}>")
    return texts


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


async def soak(base: str, args: argparse.Namespace) -> dict[str, Any]:
    """The client half: probes, the load with polling, probes again, the verdict."""
    prompts = probe_prompts(args.long_repeats)
    before = [await run_probes(base, prompts, args.probe_tokens) for _ in range(2)]
    start = parse_metrics(str((await request(base, "/metrics")).body))
    samples: list[dict[str, Any]] = []
    stop = asyncio.Event()
    poller = asyncio.create_task(poll(base, stop, args.poll_seconds, samples))
    t0 = time.monotonic()
    load = await run_load(base, args.minutes * 60, args.concurrency, args.seed, args.long_repeats)
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
    same = [a in (b0, b1) for a, b0, b1 in zip(after, *before, strict=True)]
    steady = memory_steady(samples, args.warmup_seconds, args.memory_slack_mib)
    result = {
        "seconds": round(elapsed, 1),
        "load": load,
        "metrics_delta": deltas,
        "probes_same": sum(same),
        "probes": len(same),
        "probe_mismatches": [
            {"before": b0, "after": a}
            for a, b0, ok in zip(after, before[0], same, strict=True)
            if not ok
        ],
        "memory_steady": steady,
        "samples": samples,
        "healthy_after": health == 200,
    }
    result["passed"] = bool(
        load["failed"] == 0 and all(same) and health == 200 and steady is not False
    )
    return result


# --- the server -----------------------------------------------------------------------------


def resolve_model(args: argparse.Namespace) -> str:
    """``--model``, or SmolLM2 converted from its GGUF (kvarn-vllm's e2e_smoke converter)."""
    if args.model:
        return str(args.model)
    import importlib.util

    script = Path(__file__).resolve().parents[2] / "kvarn-vllm" / "scripts" / "e2e_smoke.py"
    spec = importlib.util.spec_from_file_location("e2e_smoke", script)
    assert spec and spec.loader
    e2e = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(e2e)
    gguf = Path(args.gguf or Path(os.environ.get("KVARN_GPU_FILES", ".")) / GGUF_NAME)
    if not gguf.exists():
        raise SystemExit(f"GGUF not found at {gguf}; pass --gguf or --model")
    return str(e2e.convert_gguf(gguf, Path(args.converted_dir)))


def serve_command(model: str, args: argparse.Namespace) -> list[str]:
    """``vllm serve`` with the soak's settings (the cache from ``--cache-tokens`` tiles)."""
    from kvarn_vllm.config import parse_kv_cache_dtype

    block = parse_kv_cache_dtype(args.kv_cache_dtype).block_size
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    return [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
        "--served-model-name", MODEL_NAME,
        "--kv-cache-dtype", args.kv_cache_dtype,
        "--enable-prefix-caching",
        "--speculative-config", json.dumps(spec),
        "--num-gpu-blocks-override", str(max(1, args.cache_tokens // block)),
        "--max-model-len", str(args.max_model_len),
        "--max-num-seqs", str(args.max_num_seqs),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        "--port", str(args.port),
        *args.extra,
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for soak.json and server.log")
    p.add_argument("--minutes", type=float, default=15.0, help="how long the load runs")
    p.add_argument("--url", help="an already running server (skips the launch)")
    p.add_argument("--model", help="a Hugging Face folder (default: SmolLM2 from its GGUF)")
    p.add_argument("--gguf", help=f"default $KVARN_GPU_FILES/{GGUF_NAME}")
    p.add_argument("--converted-dir", default="/tmp/smollm2-hf")
    p.add_argument("--kv-cache-dtype", default="kvarn_k4v2_g128")
    p.add_argument("--cache-tokens", type=int, default=6144, help="small: forces preemption")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--long-repeats", type=int, default=12, help="passage repeats per long prompt")
    p.add_argument("--probe-tokens", type=int, default=48)
    p.add_argument("--poll-seconds", type=float, default=15.0)
    p.add_argument("--warmup-seconds", type=float, default=60.0)
    p.add_argument("--memory-slack-mib", type=float, default=256.0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("extra", nargs="*", help="more vllm serve options, after --")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    proc = None
    base = args.url
    if base is None:
        cmd = serve_command(resolve_model(args), args)
        print("server:", " ".join(cmd), flush=True)
        log = open(out / "server.log", "w")  # noqa: SIM115 (the server writes it until killed)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        base = f"http://127.0.0.1:{args.port}"
    try:
        result = asyncio.run(_start_and_soak(base, args, proc))
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
    result["command"] = sys.argv if argv is None else argv
    (out / "soak.json").write_text(json.dumps(result, indent=2))
    summary = {k: result.get(k) for k in ("passed", "seconds", "probes_same", "probes")}
    summary |= {k: result.get("load", {}).get(k) for k in ("requests", "cancelled", "failed")}
    print(json.dumps(summary | {"metrics_delta": result.get("metrics_delta")}), flush=True)
    return 0 if result.get("passed") else 1


async def _start_and_soak(
    base: str, args: argparse.Namespace, proc: subprocess.Popen[bytes] | None
) -> dict[str, Any]:
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return {"passed": False, "error": f"server exited with {proc.returncode}"}
        try:
            if (await request(base, "/health", timeout=5)).status == 200:
                return await soak(base, args)
        except OSError:
            pass
        await asyncio.sleep(2)
    return {"passed": False, "error": "server did not come up"}


if __name__ == "__main__":
    sys.exit(main())
