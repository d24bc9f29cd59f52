#!/usr/bin/env python3
"""Soak: ``vllm serve`` with a kvarn cache under a long mixed load, checking that nothing is lost.

The server runs ``--kv-cache-dtype kvarn_k4v2_g128`` (``--kv-cache-dtype``), prefix caching,
chunked prefill (steps of ``--max-num-batched-tokens``), n-gram speculative decoding (unless
``--no-speculation``) and a KV cache of ``--cache-tokens`` tokens, small enough that vLLM must
preempt running requests. The client (:mod:`kvarn_eval.serving.soak`) sends for ``--minutes``
a seeded mix: short and long prompts with shared prefixes, streaming and not, greedy and
sampled, ``n`` > 1, log-probabilities, streams cancelled after a few events (vLLM aborts them),
a greedy prompt repeated. It fails on:

* any answer not 200, a stream without ``[DONE]``, fewer choices than ``n``, token ids missing
  or outside the model's vocabulary, a non-finite log-probability (NaN logits show there);
* a greedy probe (sent one at a time) that answers differently after the load than before it;
* a repeated greedy answer during the load whose first token no serial run gave (later tokens
  may differ with the batch: reported, not failed);
* GPU memory (``nvidia-smi``) growing after the warm-up, an unhealthy server at the end.

It prints and writes ``soak.json``: requests by kind, failures, cancellations, the deltas of
vLLM's preemption, token, success and speculative counters, memory samples, start-up seconds,
and counts of tracebacks, ERROR lines and kvarn saturation warnings in ``server.log``.
``--budget-minutes`` bounds the whole script (start-up included) by cutting the load.

On the GPU machine, after the vLLM 0.26 parts and SmolLM2's GGUF (``../shared/gpu/README.md``),
in one call of at most about 9 minutes::

    source tools/gpu/setup.sh
    timeout 560 python3 packages/kvarn-eval/scripts/soak.py --out $OUT/soak --minutes 8 \
        --budget-minutes 8

``--url http://host:port`` skips the launch and runs the client against any OpenAI-compatible
server (the tests run it against a fake one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

try:
    from kvarn_eval.serving.runner import sigterm_raises, stop_process_group
    from kvarn_eval.serving.soak import MODEL_NAME, request, soak
except ImportError as exc:  # pragma: no cover - a clear message instead of a bare traceback
    raise SystemExit(
        f"soak.py needs kvarn-eval ({exc}): pip install -e packages/kvarn-eval"
    ) from exc

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


# --- the server -----------------------------------------------------------------------------


def resolve_model(args: argparse.Namespace) -> str:
    """``--model``, or SmolLM2 converted from its GGUF (``e2e_smoke.convert_gguf``, beside
    this script)."""
    if args.model:
        return str(args.model)
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "e2e_smoke", Path(__file__).with_name("e2e_smoke.py")
    )
    assert spec and spec.loader
    e2e = importlib.util.module_from_spec(spec)
    sys.modules["e2e_smoke"] = e2e  # its dataclasses look their module up
    spec.loader.exec_module(e2e)
    gguf = Path(args.gguf or Path(os.environ.get("KVARN_GPU_FILES", ".")) / GGUF_NAME)
    if not gguf.exists():
        raise SystemExit(f"GGUF not found at {gguf}; pass --gguf or --model")
    return str(e2e.convert_gguf(gguf, Path(args.converted_dir)))


def vocab_size(model: str) -> int | None:
    """``vocab_size`` of a Hugging Face folder's ``config.json`` (None where there is none)."""
    try:
        return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def serve_command(model: str, args: argparse.Namespace) -> list[str]:
    """``vllm serve`` with the soak's settings: the cache from ``--cache-tokens`` tiles,
    prefix caching, chunked prefill in steps of ``--max-num-batched-tokens``, n-gram
    speculation unless ``--no-speculation``."""
    from kvarn_vllm.config import parse_kv_cache_dtype

    block = parse_kv_cache_dtype(args.kv_cache_dtype).block_size
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    speculation = ["--speculative-config", json.dumps(spec)] if args.speculation else []
    return [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
        "--served-model-name", MODEL_NAME,
        "--kv-cache-dtype", args.kv_cache_dtype,
        "--enable-prefix-caching",
        "--enable-chunked-prefill",
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        *speculation,
        "--num-gpu-blocks-override", str(max(1, args.cache_tokens // block)),
        "--max-model-len", str(args.max_model_len),
        "--max-num-seqs", str(args.max_num_seqs),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        "--port", str(args.port),
        "--disable-uvicorn-access-log",  # a line per request would bury the engine's lines
        *args.extra,
    ]  # fmt: skip


LOG_MARKS = {
    "tracebacks": re.compile(r"Traceback \(most recent call last\)"),
    "error_lines": re.compile(r"(^|\s)ERROR \d\d-\d\d "),  # vLLM's "ERROR MM-DD HH:MM:SS"
    "kvarn_saturation_warnings": re.compile(r"were stored saturated"),  # kvarn_vllm.overflow
}


def log_counts(text: str) -> dict[str, int]:
    """How many lines of the server's log match each of :data:`LOG_MARKS`."""
    lines = text.splitlines()
    return {name: sum(bool(m.search(line)) for line in lines) for name, m in LOG_MARKS.items()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for soak.json and server.log")
    p.add_argument("--minutes", type=float, default=15.0, help="how long the load runs")
    p.add_argument(
        "--budget-minutes",
        type=float,
        help="wall-clock budget of the whole script (start-up included): the load is cut "
        "to fit, leaving --reserve-seconds for the probes after it and the shutdown",
    )
    p.add_argument("--reserve-seconds", type=float, default=90.0)
    p.add_argument("--url", help="an already running server (skips the launch)")
    p.add_argument("--model", help="a Hugging Face folder (default: SmolLM2 from its GGUF)")
    p.add_argument("--gguf", help=f"default $KVARN_GPU_FILES/{GGUF_NAME}")
    p.add_argument("--converted-dir", default="/tmp/smollm2-hf")
    p.add_argument("--vocab", type=int, help="token ids must be under it (default: the model's)")
    p.add_argument("--kv-cache-dtype", default="kvarn_k4v2_g128")
    p.add_argument("--cache-tokens", type=int, default=6144, help="small: forces preemption")
    p.add_argument("--max-num-batched-tokens", type=int, default=384, help="chunked prefill")
    p.add_argument("--speculation", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--long-repeats", type=int, default=16, help="passage repeats per long prompt")
    p.add_argument("--probe-tokens", type=int, default=48)
    p.add_argument("--poll-seconds", type=float, default=15.0)
    p.add_argument("--warmup-seconds", type=float, default=60.0)
    p.add_argument("--memory-slack-mib", type=float, default=256.0)
    p.add_argument("--start-timeout", type=float, default=420.0)
    p.add_argument("extra", nargs="*", help="more vllm serve options, after --")
    args = p.parse_args(argv)
    args.started = time.monotonic()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    proc = None
    base = args.url
    with sigterm_raises():  # an outer timeout still stops the server's process group
        try:
            if base is None:
                model = resolve_model(args)
                args.vocab = args.vocab or vocab_size(model)
                cmd = serve_command(model, args)
                print("server:", " ".join(cmd), flush=True)
                with open(out / "server.log", "wb") as log:
                    proc = subprocess.Popen(
                        cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    )
                base = f"http://127.0.0.1:{args.port}"
            result = asyncio.run(_start_and_soak(base, args, proc))
        finally:
            if proc is not None:
                stop_process_group(proc, grace=60.0)
    if proc is not None:
        result["server_log"] = log_counts((out / "server.log").read_text(errors="replace"))
    result["command"] = sys.argv if argv is None else argv
    result["total_seconds"] = round(time.monotonic() - args.started, 1)
    (out / "soak.json").write_text(json.dumps(result, indent=2))
    summary = {k: result.get(k) for k in ("passed", "seconds", "probes_same", "probes", "error")}
    summary |= {k: result.get("load", {}).get(k) for k in ("requests", "cancelled", "failed")}
    summary |= {k: result.get(k) for k in ("repeats", "server_log", "total_seconds")}
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
                started = round(time.monotonic() - args.started, 1)
                return {"startup_seconds": started} | await soak(base, args)
        except OSError:
            pass
        await asyncio.sleep(2)
    return {"passed": False, "error": "server did not come up"}


if __name__ == "__main__":
    sys.exit(main())
