"""A stand-in for vLLM's offline API (``LLM``, ``SamplingParams``) for the worker's CPU tests.

It mimics what the worker reads from vLLM 0.26: ``llm.llm_engine.vllm_config.cache_config``
(``num_gpu_blocks``, ``block_size``), the ``GPU KV cache size`` log line, kvarn's staging line,
``RequestOutput`` with ``prompt_token_ids``, ``outputs[0].token_ids`` / ``text``, ``metrics``
(the fields of ``RequestStateStats``) and, with ``prompt_logprobs``, ``prompt_logprobs`` (None,
then per position a dict token -> ``Logprob(logprob, rank)`` holding the prompt's token and the
top-1; a kvarn cache scores 0.02 nats worse and changes the top-1 at every 8th position). Behaviour is steered by environment variables:
``FAKE_VLLM_FAIL`` (raise at start-up), ``FAKE_VLLM_START_SLEEP`` (seconds of start-up after the
KV cache line), ``FAKE_VLLM_SLEEP`` (seconds per generate call after the first two),
``FAKE_VLLM_HANG_AT_EXIT`` (never exit after the worker is done).
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from types import SimpleNamespace

__version__ = "0.26.0-fake"
CALLS: list[dict] = []


class Logprob:
    def __init__(self, logprob, rank):
        self.logprob = logprob
        self.rank = rank


class SamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class LLM:
    def __init__(self, model, kv_cache_dtype="auto", **kwargs):
        if os.environ.get("FAKE_VLLM_FAIL"):
            raise RuntimeError("CUDA error: no kernel image is available (fake)")
        if os.environ.get("FAKE_VLLM_HANG_AT_EXIT"):
            atexit.register(lambda: time.sleep(3600))
        self.kwargs = {"model": model, "kv_cache_dtype": kv_cache_dtype, **kwargs}
        kvarn = kv_cache_dtype.startswith("kvarn_")
        block = 128 if kvarn else 16
        blocks = 3000 if kvarn else 1000 * 16 // 16 * 4
        print(f"INFO [kv_cache_utils.py] GPU KV cache size: {blocks * block:,} tokens", flush=True)
        if kvarn:
            print(
                "INFO kvarn: staging for open tiles: 8 slots x 128 tokens x 2 layers = 1.500 GiB",
                flush=True,
            )
        time.sleep(float(os.environ.get("FAKE_VLLM_START_SLEEP", "0")))  # e.g. graph capture
        cache = SimpleNamespace(num_gpu_blocks=blocks, block_size=block)
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(cache_config=cache))
        self.calls = 0

    def generate(self, prompts, params, use_tqdm=True):
        self.calls += 1
        sleep = float(os.environ.get("FAKE_VLLM_SLEEP", "0")) if self.calls > 2 else 0.0
        # A tqdm class, as vLLM's _run_engine calls it: one update per finished request (the
        # sleep spread over them), else the whole sleep first.
        bar = None
        if callable(use_tqdm):
            prompts = list(use_tqdm(prompts, desc="Rendering prompts"))
            bar = use_tqdm(total=len(prompts), desc="Processed prompts", dynamic_ncols=True)
        else:
            time.sleep(sleep)
        outs = []
        now = time.monotonic()
        for i, prompt in enumerate(prompts):
            if bar is not None:
                time.sleep(sleep / max(1, len(prompts)))
                bar.update(1)
            if isinstance(prompt, dict):
                ids = list(prompt["prompt_token_ids"])
            else:
                ids = [ord(c) % 97 for c in prompt]
            n = params.max_tokens
            # greedy "model": tokens depend on the prompt and on the cache dtype for kvarn
            shift = 1 if self.kwargs["kv_cache_dtype"].startswith("kvarn_") else 0
            tokens = [(sum(ids) + t * (1 + shift * (t > n // 2))) % 50 for t in range(n)]
            metrics = SimpleNamespace(
                arrival_time=time.time(),
                queued_ts=now,
                scheduled_ts=now + 0.001,
                first_token_ts=now + 0.01 * (i + 1),
                last_token_ts=now + 0.01 * (i + 1) + 0.002 * (n - 1),
                first_token_latency=0.01 * (i + 1),
                num_generation_tokens=n,
            )
            prompt_logprobs = None
            if getattr(params, "prompt_logprobs", None) is not None:
                prompt_logprobs = [None]
                for pos in range(1, len(ids)):
                    lp = -1.0 - 0.01 * (pos % 5) - 0.02 * shift
                    other = (ids[pos] + 1) % 50
                    if pos % 4 == 0 or (shift and pos % 8 == 1):
                        entry = {ids[pos]: Logprob(lp, 2), other: Logprob(-0.5, 1)}
                    else:
                        entry = {ids[pos]: Logprob(lp, 1)}
                    prompt_logprobs.append(entry)
            outs.append(
                SimpleNamespace(
                    prompt_token_ids=ids,
                    outputs=[SimpleNamespace(token_ids=tokens, text=f"text {i}")],
                    metrics=metrics,
                    prompt_logprobs=prompt_logprobs,
                )
            )
        if bar is not None:
            bar.close()
        print(f"fake generate: {len(prompts)} prompts", file=sys.stderr, flush=True)
        return outs
