#!/usr/bin/env python3
"""GPU evidence for hybrid models on a kvarn cache (issue 48): vLLM 0.26, dummy weights, one GPU.

Everything the issue's Evidence section lists, in one call (about 6 minutes on an H100):

    source tools/gpu/setup.sh
    python3 packages/kvarn-eval/scripts/hybrid_evidence.py --out $OUT/hybrid
    python3 packages/kvarn-eval/scripts/hybrid_evidence.py --dry-run   # the plan, on any CPU

Two shapes, each a real model's configuration (dummy weights, no files):

``nemotron-h-8b``   Nemotron-H-8B-Base-8K: 52 layers (24 Mamba-2, 4 attention, 24 MLP), 8 KV heads
                    of head_dim 128, Mamba-2 with 128 heads of 64 and state 128. Changed:
                    max_position_embeddings 8192 -> 32768 (no RoPE; the capacity at 32K).
``qwen3-next-80b``  Qwen3-Next-80B-A3B: 48 layers (36 gated delta net, 12 gated attention), 2 KV
                    heads of head_dim 256, GDN with 16 key / 32 value heads of 128, one MTP layer.
                    Changed: 512 experts -> 32 (top-10 kept), so that three engines fit one 80 GB
                    GPU side by side (about 80B -> 7B parameters); KV and state shapes are real.

Engines (each its own process, several side by side; :func:`plan_jobs` lists them in priority
order, and what the ``--budget`` leaves out is reported as skipped):

* capacity: every cache of ``--caches`` (bf16, fp8, TurboQuant 4bit_nc and k3v4_nc, the six
  kvarn presets), eager, no prefix caching. Every engine gets the same KV pool
  (``kv_cache_memory_bytes``, ``--kv-pool-gib``) so that engines can start side by side
  (vLLM's memory profiling assumes it has the GPU alone); capacity is then the tokens that
  pool holds, set beside the arithmetic of the cache's pages. kvarn's staging is allocated
  beside the pool and reported (GiB).
* modes: greedy token ids of kvarn_k4v2_g128 (and bf16) under eager / CUDA graphs
  (full decode graphs, no torch.compile) and prefix caching off / on, on prompts that share a
  prefix longer than one kvarn block, in two batches so that the second hits the prefix cache.
* bursts: bf16, turboquant_4bit_nc and kvarn_k4v2_g128, ``--burst-requests`` prompts of
  ``--burst-prompt-len`` random tokens, ``--burst-output-len`` greedy tokens each, CUDA graphs.
* MTP (Qwen3-Next): kvarn_k4v2_g128 with ``speculative_config={"method": "mtp"}`` on vLLM's V2
  model runner (``VLLM_USE_V2_MODEL_RUNNER=1``; 0.26 runs hybrids on V1 by default), greedy
  tokens against the same cache without speculation.

Generations and bursts hold an exclusive lock (``hybrid_engine.gpu_lock``): no two run at once;
start-ups (weight fill, one profiling forward, graph capture) may overlap a burst, and the
report gives the seconds they did. Results: ``hybrid.json`` (every run) and ``hybrid.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hybrid_engine import KV_LINE, STAGING_LINE, random_prompts
from hybrid_report import compare_greedy, report

NEMOTRON_H_8B: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hidden_size": 4096,
    "intermediate_size": 21504,
    "num_hidden_layers": 52,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "expand": 2,
    "chunk_size": 128,
    "vocab_size": 131072,
    "max_position_embeddings": 32768,
    "mlp_hidden_act": "relu2",
    "mamba_hidden_act": "silu",
    "layer_norm_epsilon": 1e-5,
    "residual_in_fp32": False,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}
QWEN3_NEXT_80B: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_hidden_layers": 48,
    "full_attention_interval": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "num_experts": 32,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "num_nextn_predict_layers": 1,
    "vocab_size": 151936,
    "max_position_embeddings": 262144,
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000000,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}
SHAPES = {"nemotron-h-8b": NEMOTRON_H_8B, "qwen3-next-80b": QWEN3_NEXT_80B}
DEFAULT_CACHES = (
    "auto",
    "fp8",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "kvarn_k4v2_g128",
    "kvarn_k4v4_g128",
    "kvarn_k4v2_g64",
    "kvarn_k4v4_g64",
    "kvarn_k3v2_g128",
    "kvarn_k2v2_g128",
)
KVARN = "kvarn_k4v2_g128"
BURST_CACHES = ("turboquant_4bit_nc", KVARN, "auto")
MODES = {
    # name: (enforce_eager, enable_prefix_caching)
    "eager-noprefix": (True, False),
    "eager-prefix": (True, True),
    "graphs-noprefix": (False, False),
    "graphs-prefix": (False, True),
}
GRAPH_SIZES = [1, 2, 4, 8, 16, 32]


# --- the page arithmetic ----------------------------------------------------------------------


def layer_counts(config: dict[str, Any]) -> tuple[int, int]:
    """``(attention layers, recurrent layers)`` of a shape's configuration."""
    pattern = config.get("hybrid_override_pattern")
    if pattern is not None:
        return pattern.count("*"), pattern.count("M")
    interval = config["full_attention_interval"]
    layers = config["num_hidden_layers"]
    return layers // interval, layers - layers // interval


def layers_per_group(config: dict[str, Any]) -> int:
    """Layers per KV cache group (the number of pool tensors), as vLLM 0.26 groups them: the
    smaller layer count, or the larger one when they differ by under 1.5x."""
    attention, recurrent = layer_counts(config)
    group = min(attention, recurrent)
    return max(attention, recurrent) if max(attention, recurrent) < 1.5 * group else group


def blocks_per_request(
    config: dict[str, Any], block_size: int, max_model_len: int, mamba_cache_mode: str
) -> int:
    """Blocks one request of ``max_model_len`` tokens takes in vLLM 0.26's accounting.

    A block id names one page in one layer of every group. A request takes
    ``ceil(L / block)`` blocks in each attention group and, in each recurrent group, 1
    (``none`` cache mode), 2 (``align``) or ``ceil(L / block)`` (``all``).
    """
    attention, recurrent = layer_counts(config)
    group = layers_per_group(config)
    attention_blocks = math.ceil(max_model_len / block_size)
    per_state = {"none": 1, "align": 2}.get(mamba_cache_mode, attention_blocks)
    return (
        math.ceil(attention / group) * attention_blocks + math.ceil(recurrent / group) * per_state
    )


def arithmetic(
    runs: list[dict[str, Any]],
    config: dict[str, Any],
    max_model_len: int,
    pool_bytes: int | None = None,
) -> None:
    """Adds to each run the capacity its pages give in a pool, in place.

    The pool is ``pool_bytes`` (what ``kv_cache_memory_bytes`` gave every engine), or else
    the first run's (blocks x page x layers per group). ``expected_tokens``: that pool cut
    into this run's pages, per request of ``max_model_len`` tokens, times ``max_model_len``
    (vLLM's definition of the logged capacity); ``measured_over_expected`` is 1 where only
    the pages differ. ``vs_first``: tokens against the first run's.
    """
    base = next((r for r in runs if r.get("ok") and r.get("page_bytes")), None)
    if base is None:
        return
    slots = layers_per_group(config)
    pool = pool_bytes or base["num_gpu_blocks"] * base["page_bytes"] * slots
    for run in runs:
        if not run.get("ok") or not run.get("page_bytes"):
            continue
        blocks = pool // (run["page_bytes"] * slots)
        per_request = blocks_per_request(
            config, run["block_size"], max_model_len, run["mamba_cache_mode"]
        )
        run["blocks_per_request"] = per_request
        run["expected_tokens"] = int(blocks / per_request * max_model_len)
        run["pool_gib"] = round(run["num_gpu_blocks"] * run["page_bytes"] * slots / 2**30, 3)
        tokens = run.get("kv_cache_tokens")
        if tokens:
            run["measured_over_expected"] = round(tokens / run["expected_tokens"], 4)
            if base.get("kv_cache_tokens"):
                run["vs_first"] = round(tokens / base["kv_cache_tokens"], 3)


def attention_page_bytes(cache: str, block_size: int, config: dict[str, Any]) -> int:
    """Bytes of one attention block of one layer: the page every group of the pool uses (the
    worker pads the recurrent states to it; the front-end process is not told, so the script
    recomputes it as vLLM 0.26 and kvarn-vllm do)."""
    heads, head_dim = config["num_key_value_heads"], config["head_dim"]
    if cache.startswith("kvarn_"):
        from kvarn_vllm.config import parse_kv_cache_dtype
        from kvarn_vllm.hybrid import tile_page_bytes

        group = parse_kv_cache_dtype(cache).preset.group_size
        return block_size // group * tile_page_bytes(cache, heads, head_dim)
    if cache.startswith("turboquant_"):
        from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig

        slot = TurboQuantConfig.from_cache_dtype(cache, head_dim).slot_size_aligned
        return block_size * heads * slot
    element = 2 if cache in ("auto", "bfloat16", "float16") else 1  # fp8 variants: 1 byte
    return block_size * heads * 2 * head_dim * element


def bits_per_element(cache: str, block_size: int, config: dict[str, Any]) -> float:
    """Bits of one K or V element in the attention page (metadata included)."""
    elements = block_size * config["num_key_value_heads"] * config["head_dim"] * 2
    return round(attention_page_bytes(cache, block_size, config) * 8 / elements, 2)


def weight_gib(config: dict[str, Any]) -> float:
    """Approximate bf16 weights of a shape (GiB), for scheduling engines side by side."""
    h, vocab = config["hidden_size"], config["vocab_size"]
    params = 2 * vocab * h
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    if "hybrid_override_pattern" in config:
        pattern = config["hybrid_override_pattern"]
        inner = config["mamba_num_heads"] * config["mamba_head_dim"]
        groups = 2 * config["n_groups"] * config["ssm_state_size"]
        mamba = h * (2 * inner + groups + config["mamba_num_heads"]) + inner * h
        params += (
            pattern.count("M") * mamba + pattern.count("-") * 2 * h * config["intermediate_size"]
        )
        params += pattern.count("*") * (h * (q + 2 * kv) + q * h)
    else:
        attention, recurrent = layer_counts(config)
        experts = config["num_experts"] * 3 * h * config["moe_intermediate_size"]
        shared = 3 * h * config["shared_expert_intermediate_size"]
        kd = config["linear_num_key_heads"] * config["linear_key_head_dim"]
        vd = config["linear_num_value_heads"] * config["linear_value_head_dim"]
        gdn = h * (2 * kd + 2 * vd) + vd * h
        params += (attention + recurrent) * (experts + shared)
        params += recurrent * gdn + attention * (h * (2 * q + 2 * kv) + q * h)
    return round(params * 2 / 2**30, 1)


# --- the jobs ---------------------------------------------------------------------------------


def write_model_dir(shape: str, out: Path) -> Path:
    folder = out / f"model-{shape}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(SHAPES[shape], indent=1))
    return folder


def _has_flash_attention() -> bool:
    """Whether vLLM's FlashAttention-3 ops are installed (the GPU parts carry them only with
    ``--fa3``); without them bf16 and fp8 run on ``TRITON_ATTN``."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return False
    folder = Path(next(iter(spec.submodule_search_locations))) / "vllm_flash_attn"
    return any(folder.glob("_vllm_fa3_C*"))


def _job(
    args: argparse.Namespace, shape: str, cache: str, mode: str, role: str, **extra: Any
) -> dict[str, Any]:
    config = SHAPES[shape]
    eager, prefix = MODES[mode]
    kwargs: dict[str, Any] = {
        "model": str(args.model_dirs[shape]),
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": 8192,
        "kv_cache_memory_bytes": int(args.kv_pool_gib * 2**30),
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "enforce_eager": eager,
        "enable_prefix_caching": prefix,
        "seed": 0,
    }
    if not eager:
        kwargs["compilation_config"] = {
            "mode": 0,
            "cudagraph_mode": "FULL_DECODE_ONLY",
            "cudagraph_capture_sizes": GRAPH_SIZES,
        }
    if args.bf16_backend and not cache.startswith(("kvarn_", "turboquant_")):
        kwargs["attention_config"] = {"backend": args.bf16_backend}
    kwargs.update(extra.pop("llm", {}))
    name = f"{shape}-{cache}-{mode}" + (f"-{role}" if role in ("mtp", "v2") else "")
    slow = cache.startswith("turboquant_")
    return {
        "name": name,
        "shape": shape,
        "cache": cache,
        "mode": mode,
        "role": role,
        "llm_kwargs": kwargs,
        "vocab_size": config["vocab_size"],
        "batches": args.batches[shape],
        "max_tokens": args.max_tokens,
        "est_gib": weight_gib(config) + args.kv_pool_gib + 2.5,
        "timeout": args.engine_timeout * (2 if slow else 1),
        "env": extra.pop("env", {}),
        **extra,
    }


def plan_jobs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every engine, most important first (TurboQuant's slow start-ups early)."""
    burst = {
        "requests": args.burst_requests,
        "prompt_len": args.burst_prompt_len,
        "output_len": args.burst_output_len,
    }
    first: list[dict[str, Any]] = []
    second: list[dict[str, Any]] = []
    last: list[dict[str, Any]] = []
    v2 = {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    for shape in args.shapes:
        for cache in BURST_CACHES:
            first.append(_job(args, shape, cache, "graphs-noprefix", "burst", burst=burst))
        for cache in (KVARN, "auto"):
            first.append(_job(args, shape, cache, "eager-noprefix", "capacity"))
        for mode in ("eager-prefix", "graphs-prefix"):
            first.append(_job(args, shape, KVARN, mode, "mode"))
        if SHAPES[shape].get("num_nextn_predict_layers"):
            mtp = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}
            first.append(_job(args, shape, KVARN, "eager-noprefix", "mtp", llm=mtp, env=v2))
            last.append(_job(args, shape, KVARN, "eager-noprefix", "v2", env=v2))
            last.append(_job(args, shape, "auto", "eager-noprefix", "mtp", llm=mtp, env=v2))
        for cache in args.caches:
            if cache not in (KVARN, "auto", "turboquant_4bit_nc"):
                second.append(_job(args, shape, cache, "eager-noprefix", "capacity"))
        for mode in ("eager-prefix", "graphs-prefix"):
            last.append(_job(args, shape, "auto", mode, "mode"))
    jobs = first + second + last
    if args.only:
        jobs = [j for j in jobs if re.search(args.only, j["name"])]
    return jobs


# --- running them side by side ----------------------------------------------------------------


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies do not count: a container's
    first process may never reap them)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _stop(proc: subprocess.Popen) -> None:
    """Stops a child's process group and waits until none of it runs: vLLM's engine core
    is a grandchild that can outlive the child, holding its GPU memory while the next engine
    checks for free memory."""
    if proc.poll() is None or _group_alive(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        end = time.time() + grace
        while time.time() < end and (proc.poll() is None or _group_alive(proc.pid)):
            time.sleep(0.2)
        if proc.poll() is not None and not _group_alive(proc.pid):
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL if sig == signal.SIGTERM else sig)


def _collect(job: dict[str, Any], work: Path, code: int | None) -> dict[str, Any]:
    """The engine's result (or why there is none), its log's capacity and staging lines;
    the log's last 40,000 characters are kept in ``work/logs`` (the rest of ``work`` is
    spec and result files that ``hybrid.json`` holds)."""
    slug = job["slug"]
    output = (work / f"{slug}.log").read_text(errors="replace")
    (work / "logs").mkdir(exist_ok=True)
    (work / "logs" / f"{slug}.log").write_text(output[-40000:])
    result_path = work / f"{slug}.result.json"
    if result_path.exists():
        result = json.loads(result_path.read_text())
    else:
        why = "stopped (time limit)" if code is None else f"exit {code}"
        result = {"name": job["name"], "cache": job["cache"], "ok": False}
        result["error"] = f"no result ({why}): {output[-1500:]}"
    if result.get("kv_cache_tokens") is None:  # the engine core logs in its own process
        found = KV_LINE.findall(output)
        result["kv_cache_tokens"] = int(found[-1].replace(",", "")) if found else None
    staging = STAGING_LINE.findall(output)
    result["staging_gib"] = float(staging[-1]) if staging else None
    for key in ("shape", "mode", "role"):
        result[key] = job[key]
    if result.get("ok") and result.get("block_size"):
        config = SHAPES[job["shape"]]
        result["page_bytes"] = attention_page_bytes(job["cache"], result["block_size"], config)
        result["bits_per_element"] = bits_per_element(job["cache"], result["block_size"], config)
    return result


def run_jobs(jobs: list[dict[str, Any]], args: argparse.Namespace, work: Path) -> list[dict]:
    """Runs the jobs, at most ``--parallel`` at once and within ``--gpu-gib`` of estimated
    memory, in order; stops launching when ``--budget`` seconds are near their end."""
    deadline = time.time() + args.budget
    pending = list(jobs)
    alive: dict[str, tuple[subprocess.Popen, dict[str, Any], float, Any]] = {}
    results: list[dict[str, Any]] = []
    lock = str(work / "gpu.lock")
    try:
        while pending or alive:
            now = time.time()
            for name, (proc, job, started, log) in list(alive.items()):
                code = proc.poll()
                late = code is None and (now - started > job["timeout"] or now > deadline)
                if code is not None or late:
                    _stop(proc)  # also when it ended: its engine core may still be going
                    log.close()
                    results.append(_collect(job, work, proc.returncode if not late else None))
                    del alive[name]
                    r = results[-1]
                    status = "ok" if r.get("ok") else "FAILED"
                    print(
                        f"[{status}] {name} ({r.get('seconds', round(now - started))} s)",
                        flush=True,
                    )
            while pending and len(alive) < args.parallel:
                job = pending[0]
                if deadline - time.time() < args.min_left:
                    for skipped in pending:
                        results.append(
                            {
                                **{
                                    k: skipped[k]
                                    for k in ("name", "cache", "shape", "mode", "role")
                                },
                                "ok": False,
                                "skipped": True,
                                "error": "skipped: --budget spent",
                            }
                        )
                    pending.clear()
                    break
                used = sum(j["est_gib"] for _, j, _, _ in alive.values())
                if alive and used + job["est_gib"] > args.gpu_gib:
                    break
                pending.pop(0)
                job["slug"] = re.sub(r"[^A-Za-z0-9_.-]+", "_", job["name"])
                spec_path = work / f"{job['slug']}.spec.json"
                spec_path.write_text(json.dumps({**job, "lock": lock}))
                (work / f"{job['slug']}.result.json").unlink(missing_ok=True)
                log = open(work / f"{job['slug']}.log", "w")  # noqa: SIM115 (closed when reaped)
                cmd = [sys.executable, args.engine_script]
                cmd += [str(spec_path), str(work / f"{job['slug']}.result.json")]
                proc = subprocess.Popen(
                    cmd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env={**os.environ, "PYTHONUNBUFFERED": "1", **job["env"]},
                )
                alive[job["name"]] = (proc, job, time.time(), log)
                print(f"[start] {job['name']} (est {job['est_gib']:.0f} GiB)", flush=True)
            time.sleep(0.5)
    finally:
        for proc, _, _, log in alive.values():
            _stop(proc)
            log.close()
    return results


# --- command line -----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="results folder (default: a temp dir)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, start nothing")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--caches", nargs="+", default=list(DEFAULT_CACHES))
    parser.add_argument("--only", default=None, help="regex: run only the jobs it matches")
    parser.add_argument("--budget", type=float, default=330.0, help="seconds for all engines")
    parser.add_argument("--min-left", type=float, default=45.0, help="no launch with less left")
    parser.add_argument("--engine-timeout", type=float, default=150.0, help="s (x2 TurboQuant)")
    parser.add_argument("--parallel", type=int, default=3)
    parser.add_argument("--gpu-gib", type=float, default=72.0, help="estimated GiB at once")
    parser.add_argument("--kv-pool-gib", type=float, default=5.0)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--shared-prefix", type=int, default=6144)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--burst-requests", type=int, default=8)
    parser.add_argument("--burst-prompt-len", type=int, default=16384)
    parser.add_argument("--burst-output-len", type=int, default=1024)
    parser.add_argument(
        "--engine-script",
        default=str(Path(__file__).with_name("hybrid_engine.py")),
        help=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--bf16-backend",
        default="detect",
        help="attention backend for bf16/fp8 ('detect': FLASH_ATTN if vLLM's FA3 ops are "
        "installed, else TRITON_ATTN; 'none': vLLM's choice)",
    )
    return parser.parse_args(argv)


def _prepare(args: argparse.Namespace, out: Path) -> None:
    if args.bf16_backend == "detect":
        args.bf16_backend = None if _has_flash_attention() else "TRITON_ATTN"
    elif args.bf16_backend == "none":
        args.bf16_backend = None
    args.model_dirs = {shape: write_model_dir(shape, out) for shape in args.shapes}
    args.batches = {}
    for shape in args.shapes:
        vocab = SHAPES[shape]["vocab_size"]
        (prefix,) = random_prompts(vocab, 1, args.shared_prefix, seed=2)
        tails = random_prompts(vocab, args.num_prompts, 64, seed=3)
        prompts = [prefix + tail for tail in tails]
        args.batches[shape] = [prompts[:1], prompts[1:]]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="hybrid-"))
    out.mkdir(parents=True, exist_ok=True)
    _prepare(args, out)
    jobs = plan_jobs(args)
    print(
        f"{len(jobs)} engines, at most {args.parallel} at once, budget {args.budget:.0f} s; "
        f"bf16 backend {args.bf16_backend or 'vLLM default'}",
        flush=True,
    )
    for job in jobs:
        extra = " +burst" if job.get("burst") else ""
        print(f"  {job['name']}{extra} (est {job['est_gib']:.1f} GiB)", flush=True)
    if args.dry_run:
        (out / "hybrid.md").write_text(report([], args, SHAPES))
        return 0
    work = Path(tempfile.mkdtemp(prefix="hybrid-engines-"))
    start = time.time()
    results: list[dict[str, Any]] = []

    def _term(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _term)
    try:
        results = run_jobs(jobs, args, work)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for shape in args.shapes:
            config = SHAPES[shape]
            capacity = [r for r in results if r["shape"] == shape and r.get("role") != "mtp"]
            capacity.sort(key=lambda r: r["cache"] != "auto")
            arithmetic(capacity, config, args.max_model_len, int(args.kv_pool_gib * 2**30))
        compare_greedy(results)
        payload = {
            "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(start)),
            "seconds": round(time.time() - start, 1),
            "args": {k: v for k, v in vars(args).items() if k not in ("batches", "model_dirs")},
            "environment": environment(),
            "shapes": {s: SHAPES[s] for s in args.shapes},
            "runs": results,
        }
        with contextlib.suppress(Exception):
            payload["args"]["out"] = str(out)
        (out / "hybrid.json").write_text(json.dumps(payload, indent=1, default=str))
        if (work / "logs").is_dir():  # engine logs (tails) beside the results
            shutil.copytree(work / "logs", out / "logs", dirs_exist_ok=True)
        (out / "hybrid.md").write_text(report(results, args, SHAPES))
        print((out / "hybrid.md").read_text(), flush=True)
    return 0 if results and all(r.get("ok") for r in results) else 1


def environment() -> dict[str, Any]:
    info: dict[str, Any] = {"python": sys.version.split()[0]}
    for name in ("torch", "triton", "vllm", "kvarn_vllm", "kvarn_kernels"):
        try:
            info[name] = __import__(name).__version__
        except Exception as exc:  # recorded, not fatal
            info[name] = f"unavailable: {exc}"
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # recorded as missing
        pass
    return info


if __name__ == "__main__":
    sys.exit(main())
