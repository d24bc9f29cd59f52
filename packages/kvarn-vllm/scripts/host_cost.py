#!/usr/bin/env python3
"""Host cost of kvarn-vllm's Python per engine step, on the CPU, with the kernels left out.

A step that no full CUDA graph replays (a prefill chunk, a mixed batch, an n-gram verify step
whose requests drafted different numbers of tokens) pays the attention layer's Python in every
layer: on a small model that cost bounds the step. This script drives kvarn's real metadata
builder and a real vLLM ``Attention`` layer on the CPU (vLLM's CPU platform, V1 runner, the
speculative config of n-gram) through steps of ``--requests`` requests, and times

* ``build``: the builder's ``build`` once per step (planning, one host-to-device copy);
* ``forward``: one layer's ``forward`` (the store, the attention calls and their gathers);
* ``torch calls``: the torch functions a layer's ``forward`` calls, averaged over the
  layers of a step (most are a kernel launch on a GPU; what a step's first layer computes for
  all of them, it computes once);

inside a forward context per step as vLLM sets one, with every Triton launch replaced by a counter (Triton's interpreter, ``TRITON_INTERPRET=1``,
is stubbed), so the numbers are the Python and the torch operations around the kernels, and
``launches`` how many kernels a layer starts. On a GPU the torch operations become kernel
launches of a few microseconds of host time each; here they also compute on the CPU, so the
numbers are an upper bound of the host's share, for comparing code paths, not a GPU timing.

Step kinds (``--modes``):

``mixed``    every request verifies 0 or ``k`` drafts (40% and 60%): n-gram's usual step;
``uniform``  every request verifies ``k`` drafts (the step a full CUDA graph replays);
``decode``   one token per request, no speculative decoding.

    python host_cost.py [--requests 100] [--layers 30] [--steps 12] [--json OUT]

The model shape is SmolLM2-135M's (9 query and 3 KV heads, head_dim 64, 30 layers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports Triton: launches are stubbed
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

MODES = ("mixed", "uniform", "decode")


def _positive(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {raw!r}")
    return value


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=_positive, default=100, help="requests per step")
    p.add_argument("--layers", type=_positive, default=30, help="layers per step")
    p.add_argument("--steps", type=_positive, default=12, help="timed steps per mode")
    p.add_argument("--drafts", type=_positive, default=4, help="k, drafts per verify block")
    p.add_argument("--context", type=_positive, default=580, help="tokens cached per request")
    p.add_argument("--preset", default="kvarn_k4v2_g128")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--json", help="also write the results here")
    return p.parse_args(argv)


def _setup() -> None:
    import torch
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    if torch.cuda.is_available():
        raise SystemExit("host_cost.py measures the CPU path: run it with CUDA_VISIBLE_DEVICES=")
    platforms._current_platform = CpuPlatform()
    import kvarn_vllm

    kvarn_vllm.register()


def _schedule(new=(), cached=(), drafts=None) -> SimpleNamespace:
    """A V1 SchedulerOutput with the fields kvarn reads."""
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=list(cached), new_block_ids=[None] * len(cached), resumed_req_ids=set()
        ),
        finished_req_ids=set(),
        preempted_req_ids=set(),
        scheduled_spec_decode_tokens={r: [0] * n for r, n in (drafts or {}).items() if n},
    )


def _count_torch_calls():
    """Counts torch function calls (tensor methods and ``torch.*``) made inside it: on a GPU
    most of them are a kernel launch of their own."""
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") not in _NOT_OPS:
                self.calls += 1
            return func(*args, **(kwargs or {}))

    return Count()


# Tensor attribute reads and other calls that launch nothing
_NOT_OPS = {"__get__", "shape", "dtype", "device", "stride", "dim", "numel", "size", "is_cuda"}
_NOT_OPS |= {"data_ptr", "element_size", "is_contiguous", "__len__", "__index__", "__int__"}


class _Runner:
    """Stands in for vLLM's V1 GPUModelRunner (kvarn's step channel keeps a weak reference)."""


def run_mode(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    import numpy as np
    import torch
    from kvarn_math import get_preset
    from kvarn_vllm import sink
    from kvarn_vllm.step import STEP
    from triton.runtime import interpreter
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        SchedulerConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.forward_context import override_forward_context
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.attention.backend import CommonAttentionMetadata

    hq, hkv, d = 9, 3, 64
    g = get_preset(args.preset).group_size
    r, k = args.requests, args.drafts
    launches: list[str] = []
    saved_run = interpreter.InterpretedFunction.run
    interpreter.InterpretedFunction.run = lambda self, *a, **kw: launches.append(
        getattr(getattr(self, "fn", None), "__name__", "?")
    )
    STEP.__init__()  # a fresh worker's step state
    sink.reset()
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"  # n-gram runs on the V1 runner
    try:
        blocks = -(-(args.context + 64 * (k + 1)) // g)
        max_len = blocks * g
        vc = VllmConfig(
            cache_config=CacheConfig(cache_dtype=args.preset, block_size=g),
            scheduler_config=SchedulerConfig(
                max_num_seqs=r,
                max_num_batched_tokens=max(2048, r * (k + 1)),
                max_model_len=max_len,
                is_encoder_decoder=False,
            ),
            device_config=DeviceConfig(device="cpu"),
        )
        if mode != "decode":
            object.__setattr__(
                vc, "speculative_config", SimpleNamespace(method="ngram", num_speculative_tokens=k)
            )
        torch.set_default_dtype(torch.float16)
        try:
            with set_current_vllm_config(vc):
                layer = Attention(
                    num_heads=hq,
                    head_size=d,
                    scale=d**-0.5,
                    num_kv_heads=hkv,
                    cache_config=vc.cache_config,
                    prefix="model.layers.0.self_attn.attn",
                )
        finally:
            torch.set_default_dtype(torch.float32)
        spec = layer.get_kv_cache_spec(vc)
        builder = layer.attn_backend.get_builder_cls()(
            spec, [layer.layer_name], vc, torch.device("cpu")
        )
        kv_cache = torch.zeros(
            layer.attn_backend.get_kv_cache_shape(r * blocks, g, hkv, d), dtype=torch.uint8
        )
        table = torch.arange(r * blocks, dtype=torch.int32).reshape(r, blocks)
        runner = _Runner()
        ids = [f"r{i}" for i in range(r)]
        STEP.report_v1_schedule(
            runner,
            _schedule(
                new=[
                    SimpleNamespace(req_id=x, block_ids=(table[i].tolist(),))
                    for i, x in enumerate(ids)
                ]
            ),
        )
        STEP.report_v1_batch(runner, ids)
        cached = np.full(r, args.context, dtype=np.int32)
        rng = np.random.default_rng(0)
        builds, forwards, per_layer = [], [], 0.0
        tokens = 0
        for step in range(args.steps + 2):  # the first two warm up
            if mode == "mixed":
                drafts = rng.choice([0, k], size=r, p=[0.4, 0.6])
                drafts[: min(r, 2)] = [0, k][: min(r, 2)]  # mixed whatever the draw
            elif mode == "uniform":
                drafts = np.full(r, k)
            else:
                drafts = np.zeros(r, dtype=np.int64)
            STEP.report_v1_schedule(
                runner,
                _schedule(
                    cached=ids, drafts=dict(zip(ids, drafts.tolist())) if mode != "decode" else None
                ),
            )
            STEP.report_v1_batch(runner, ids)
            num_new = (1 + drafts).astype(np.int32)
            seq = cached + num_new
            qsl = np.concatenate([[0], np.cumsum(num_new)]).astype(np.int32)
            n = int(qsl[-1])
            cam = CommonAttentionMetadata(
                query_start_loc=torch.from_numpy(qsl),
                query_start_loc_cpu=torch.from_numpy(qsl),
                seq_lens=torch.from_numpy(seq),
                num_reqs=r,
                num_actual_tokens=n,
                max_query_len=int(num_new.max()),
                max_seq_len=int(seq.max()),
                block_table_tensor=table,
                slot_mapping=torch.zeros(n, dtype=torch.int64),
                seq_lens_cpu_upper_bound=torch.from_numpy(seq),
                causal=True,
            )
            t0 = time.perf_counter()
            meta = builder.build(0, cam)
            t1 = time.perf_counter()
            q = torch.randn(n, hq, d, dtype=torch.float16)
            key = torch.randn(n, hkv, d, dtype=torch.float16)
            value = torch.randn(n, hkv, d, dtype=torch.float16)
            out = torch.empty(n, hq, d, dtype=torch.float16)
            launches.clear()
            t2 = time.perf_counter()
            with override_forward_context(SimpleNamespace()):  # vLLM: a new one per forward
                for _ in range(args.layers):
                    layer.impl.forward(layer, q, key, value, kv_cache, meta, output=out)
            t3 = time.perf_counter()
            if step >= 2:
                builds.append(t1 - t0)
                forwards.append((t3 - t2) / args.layers)
                per_layer = len(launches) / args.layers
                tokens += n
            if step == 2:  # an untimed forward, counting the torch calls of its layers
                with override_forward_context(SimpleNamespace()), _count_torch_calls() as counted:
                    for _ in range(args.layers):
                        layer.impl.forward(layer, q, key, value, kv_cache, meta, output=out)
                torch_calls = counted.calls / args.layers
            # every request keeps about 40% of its drafts; a tile boundary now and then
            cached = cached + 1 + (drafts * 2 // 5).astype(np.int32)
        build_ms = 1e3 * statistics.median(builds)
        forward_us = 1e6 * statistics.median(forwards)
        return {
            "mode": mode,
            "requests": r,
            "tokens_per_step": tokens / args.steps,
            "build_ms": build_ms,
            "forward_us_per_layer": forward_us,
            "launches_per_layer": per_layer,
            "torch_calls_per_layer": torch_calls,
            "host_ms_per_step": build_ms + args.layers * forward_us / 1e3,
        }
    finally:
        interpreter.InterpretedFunction.run = saved_run


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    _setup()
    import torch
    import vllm

    rows = [run_mode(args, m) for m in args.modes]
    print(
        f"kvarn-vllm host cost, {args.preset}, SmolLM2-135M shape, {args.requests} requests, "
        f"k = {args.drafts}, {args.layers} layers; vLLM {vllm.__version__}, torch "
        f"{torch.__version__}, {os.cpu_count()} CPUs, kernels stubbed (median of {args.steps} "
        "steps)\n"
    )
    print(
        "| step | tokens | build (ms) | forward per layer (us) | Triton launches per layer "
        "| torch calls per layer | host per step (ms) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(
            f"| {row['mode']} | {row['tokens_per_step']:.0f} | {row['build_ms']:.2f} | "
            f"{row['forward_us_per_layer']:.0f} | {row['launches_per_layer']:.0f} | "
            f"{row['torch_calls_per_layer']:.1f} | {row['host_ms_per_step']:.1f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
