#!/usr/bin/env python3
"""One engine of the hybrid GPU evidence (``hybrid_evidence.py``), in its own process.

``python hybrid_engine.py SPEC.json RESULT.json``: builds ``vllm.LLM`` from the spec (dummy
weights, a ``config.json`` folder, no tokenizer), records vLLM's block size, blocks and the
KV capacity it logs, runs the greedy batches, then (burst jobs) one burst of long prompts.
Greedy batches and bursts hold an exclusive lock on ``spec["lock"]`` (``fcntl.flock``), so
that no two engines' generations share the GPU; start-ups run side by side. Times are
recorded as epoch seconds so that the parent can say what overlapped a burst.

The result is written even when the engine fails (``ok`` False, the traceback in ``error``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import random
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any

KV_LINE = re.compile(r"GPU KV cache size:\s*([\d,]+)\s*tokens")
STAGING_LINE = re.compile(r"kvarn: staging for open tiles: .*?= ([\d.]+) GiB")


class _Capture(logging.Handler):
    """Keeps vLLM's log lines about the KV cache, block sizes and kvarn."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:  # a bad record must not kill the run
            return
        if any(k in msg for k in ("KV cache", "kvarn", "block size", "mamba", "Mamba")):
            self.lines.append(msg[:400])


@contextlib.contextmanager
def gpu_lock(path: str | None):
    """Exclusive use of the GPU for a generation (no-op without a lock file)."""
    if not path:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def random_prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` random token ids (ids 10..vocab-10)."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(count)]


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[Any]:
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
    )
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _burst(llm: Any, burst: dict[str, Any], vocab: int, lock: str | None) -> dict[str, Any]:
    """One burst: ``requests`` prompts of ``prompt_len`` random tokens, ``output_len`` greedy
    tokens each, submitted at once; wall time and tokens per second."""
    prompts = random_prompts(vocab, burst["requests"], burst["prompt_len"], seed=7)
    with gpu_lock(lock):
        start = time.time()
        outs = _generate(llm, prompts, burst["output_len"])
        end = time.time()
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(p) for p in prompts)
    wall = end - start
    return {
        **burst,
        "start": round(start, 2),
        "end": round(end, 2),
        "wall_s": round(wall, 2),
        "output_tokens": out_tokens,
        "output_tok_per_s": round(out_tokens / wall, 1),
        "total_tok_per_s": round((out_tokens + prompt_tokens) / wall, 1),
    }


def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine: start-up, capacity, greedy batches, then the burst if any."""
    result: dict[str, Any] = {"name": spec["name"], "cache": spec["cache"], "ok": False}
    result["launched"] = round(time.time(), 2)
    capture = _Capture()
    logging.getLogger("vllm").addHandler(capture)
    llm = None
    try:
        from vllm import LLM

        kwargs = dict(spec["llm_kwargs"])
        llm = LLM(kv_cache_dtype=spec["cache"], **kwargs)
        result["up"] = round(time.time(), 2)
        result["startup_s"] = round(result["up"] - result["launched"], 1)
        cache = llm.llm_engine.vllm_config.cache_config
        result.update(
            block_size=cache.block_size,
            num_gpu_blocks=cache.num_gpu_blocks,
            mamba_cache_mode=cache.mamba_cache_mode,
        )
        outputs: list[list[int]] = []
        with gpu_lock(spec.get("lock")):
            gen_start = time.time()
            for batch in spec["batches"]:
                outs = _generate(llm, batch, spec["max_tokens"])
                outputs += [list(o.outputs[0].token_ids) for o in outs]
            result["greedy"] = [round(gen_start, 2), round(time.time(), 2)]
        result["outputs"] = outputs
        if spec.get("burst"):
            result["burst"] = _burst(llm, spec["burst"], spec["vocab_size"], spec.get("lock"))
        result["ok"] = True
    except Exception as exc:  # recorded; the parent carries on with the other engines
        result["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
    finally:
        result["seconds"] = round(time.time() - result["launched"], 1)
        logging.getLogger("vllm").removeHandler(capture)
        found = [
            int(m.group(1).replace(",", "")) for x in capture.lines if (m := KV_LINE.search(x))
        ]
        result["kv_cache_tokens"] = found[-1] if found else None
        result["log"] = capture.lines[-12:]
        if llm is not None:
            with contextlib.suppress(Exception):  # best effort: the process ends next
                llm.llm_engine.engine_core.shutdown()
    return result


def main(argv: list[str]) -> int:
    spec_path, result_path = argv[1], argv[2]
    spec = json.loads(Path(spec_path).read_text())
    os.environ.update(spec.get("env", {}))
    result = run_engine(spec)
    Path(result_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
