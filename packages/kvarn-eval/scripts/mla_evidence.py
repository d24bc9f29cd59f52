#!/usr/bin/env python3
"""GPU evidence for the MLA latent cache through vLLM 0.26 (issue 47): one GPU, dummy weights.

Two model shapes, each a real model's ``config.json`` (written locally; no hub, no weights):

``deepseek-v2-lite``  DeepSeek-V2-Lite: 27 layers (1 dense, 26 MoE of 64 routed + 2 shared experts,
                      top-6), 16 heads, kv_lora_rank 512, qk_rope 64, qk_nope 128, v_head 128,
                      no q_lora; hidden 2048, vocab 102400; YaRN RoPE as released.
``glm-4.7-flash``     GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``, transformers' own defaults for it,
                      which a public GGUF's metadata matches): 47 layers (1 dense, 46 MoE of 64
                      routed + 1 shared, top-4), 20 heads, kv_lora_rank 512, qk_rope 64, qk_nope
                      192, v_head 256, q_lora 768; hidden 2048, vocab 154880. About 30B parameters:
                      58 GB of bf16 weights, so on an 80 GB H100 its KV pool is small.

Phases (each engine in its own process, results as JSON and markdown under ``--out``):

``impl``      no engine: kvarn's MLA decode glue at 16 and 128 heads, bf16, eager against an fp32
              reference and replayed in a CUDA graph with new lengths (``mla_decode_check.py``).

``capacity``  one eager engine per shape and cache (``--caches``; GLM: ``--glm-caches``), prefix
              caching off, ``max_model_len`` 32K, 256 request slots, ``gpu_memory_utilization``
              0.9: vLLM's blocks x block size and its logged KV tokens, the attention backend
              vLLM chose, and 2 prompts x 8 greedy tokens (the path runs). A cache vLLM cannot
              serve there (``fp8_ds_mla`` on a dense MLA model) is recorded with its error.
``modes``     DeepSeek-V2-Lite cut to ``--mode-layers`` layers (4: the modes do not depend on
              depth, and engines start faster): greedy token ids of 8 prompts sharing a 300-token
              prefix, in two batches (the second hits the prefix cache), under eager / CUDA
              graphs (full decode graphs, no torch.compile) and prefix caching off / on, for
              ``kvarn_mla_l4_g128`` and for bf16 (``auto``, the baseline's own agreement).
``burst``     the full DeepSeek-V2-Lite shape, CUDA graphs, 64 prompts of 8,192 random tokens and
              256 greedy output tokens at once, for ``auto`` and ``kvarn_mla_l4_g128``: seconds,
              output and total tokens per second.

    python mla_evidence.py --out $OUT --models /tmp/mla-models --phases impl capacity
    python mla_evidence.py --out $OUT --models /tmp/mla-models --phases modes burst
    python mla_evidence.py --dry-run            # the plan only (no vLLM import)

vLLM 0.26's MLA prefill runs on FlashAttention only (no Triton MLA prefill): the GPU machine
needs vLLM's FlashAttention ops (the ``fa3`` part); the script says so first when they are missing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

DEEPSEEK_V2_LITE: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "scoring_func": "softmax",
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "hidden_act": "silu",
    "vocab_size": 102400,
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "torch_dtype": "bfloat16",
}
GLM_47_FLASH: dict[str, Any] = {
    "architectures": ["Glm4MoeLiteForCausalLM"],
    "model_type": "glm4_moe_lite",
    "hidden_size": 2048,
    "intermediate_size": 10240,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 47,
    "num_attention_heads": 20,
    "num_key_value_heads": 20,
    "n_shared_experts": 1,
    "n_routed_experts": 64,
    "num_experts_per_tok": 4,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.8,
    "kv_lora_rank": 512,
    "q_lora_rank": 768,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "hidden_act": "silu",
    "vocab_size": 154880,
    "max_position_embeddings": 202752,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "rope_interleave": True,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}
SHAPES = {"deepseek-v2-lite": DEEPSEEK_V2_LITE, "glm-4.7-flash": GLM_47_FLASH}
KVARN = "kvarn_mla_l4_g128"
CAPACITY_CACHES = [
    "auto",
    "fp8",
    "fp8_ds_mla",
    "kvarn_k4v2_g128",  # the dense default name: selects kvarn_mla_l4_g128 on an MLA model
    "kvarn_mla_l4_g64",
    "kvarn_mla_l2_g128",
    "kvarn_mla_l8_g128",
]
GLM_CAPACITY_CACHES = ["auto", "kvarn_k4v2_g128"]
MODES = {  # name: (enforce_eager, enable_prefix_caching)
    "eager-noprefix": (True, False),
    "eager-prefix": (True, True),
    "graphs-prefix": (False, True),
}
KV_LINE = re.compile(r"GPU KV cache size:\s*([\d,]+)\s*tokens")
BACKEND_LINE = re.compile(
    r"Using (\w+) (attention|MLA prefill) backend|kvarn: MLA layers use (\w+)"
)


def model_config(shape: str, layers: int | None = None) -> dict[str, Any]:
    """The ``config.json`` of a shape, optionally cut to ``layers`` decoder layers."""
    config = dict(SHAPES[shape])
    if layers is not None:
        config["num_hidden_layers"] = layers
    return config


def write_model_dir(models: Path, shape: str, layers: int | None = None) -> Path:
    """``models/<shape>[-<layers>l]/config.json``; returns the folder."""
    folder = models / (shape if layers is None else f"{shape}-{layers}l")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model_config(shape, layers), indent=1))
    return folder


def prompts(vocab: int, count: int, length: int, seed: int, prefix: int = 0) -> list[list[int]]:
    """``count`` random token-id prompts of about ``length`` tokens (lengths vary by up to 1/3
    so tiles end at awkward places), the first ``prefix`` tokens shared by all."""
    import random

    rng = random.Random(seed)
    shared = [rng.randrange(10, vocab) for _ in range(prefix)]
    out = []
    for i in range(count):
        n = max(1, length - (i * length) // (3 * max(1, count)))
        out.append(shared + [rng.randrange(10, vocab) for _ in range(n)])
    return out


def _llm_kwargs(model: Path, eager: bool, prefix: bool, **extra: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "model": str(model),
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "max_model_len": 32768,
        "max_num_seqs": 256,
        "gpu_memory_utilization": 0.9,
        "enforce_eager": eager,
        "enable_prefix_caching": prefix,
        "seed": 0,
    }
    if not eager:
        kwargs["compilation_config"] = {
            "mode": 0,
            "cudagraph_mode": "FULL_DECODE_ONLY",
            "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64],
        }
    kwargs.update(extra)
    return kwargs


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every engine of the chosen phases, in order (model configs written to ``--models``)."""
    jobs: list[dict[str, Any]] = []
    models = args.models
    if "impl" in args.phases:
        jobs.append({"phase": "impl", "name": "impl-decode-graphs", "cache": KVARN, "llm": {}})
    if "capacity" in args.phases:
        for shape, caches in (
            ("deepseek-v2-lite", args.caches),
            ("glm-4.7-flash", args.glm_caches),
        ):
            model = write_model_dir(models, shape)
            for cache in caches:
                jobs.append({
                    "phase": "capacity", "name": f"capacity-{shape}-{cache}", "shape": shape,
                    "cache": cache, "llm": _llm_kwargs(model, True, False),
                    "batches": [prompts(SHAPES[shape]["vocab_size"], 2, 200, 1)], "max_tokens": 8,
                })  # fmt: skip
    if "modes" in args.phases:
        model = write_model_dir(models, "deepseek-v2-lite", args.mode_layers)
        vocab = DEEPSEEK_V2_LITE["vocab_size"]
        batch = prompts(vocab, 8, 260, 2, prefix=300)
        for cache in (KVARN, "auto"):
            for mode, (eager, prefix) in MODES.items():
                llm = _llm_kwargs(model, eager, prefix, max_num_batched_tokens=2048)
                jobs.append({
                    "phase": "modes", "name": f"modes-{cache}-{mode}", "shape": "deepseek-v2-lite",
                    "layers": args.mode_layers, "cache": cache, "mode": mode, "llm": llm,
                    "batches": [batch[:4], batch[4:]], "max_tokens": args.mode_tokens,
                })  # fmt: skip
    if "burst" in args.phases:
        model = write_model_dir(models, "deepseek-v2-lite")
        burst = {"requests": args.burst_requests, "prompt_len": args.burst_prompt_len,
                 "output_len": args.burst_output_len}  # fmt: skip
        for cache in ("auto", KVARN):
            llm = _llm_kwargs(model, False, False, max_num_seqs=args.burst_requests)
            jobs.append({
                "phase": "burst", "name": f"burst-deepseek-v2-lite-{cache}",
                "shape": "deepseek-v2-lite", "cache": cache, "llm": llm, "batches": [],
                "max_tokens": 0, "burst": burst,
            })  # fmt: skip
    return jobs


# --- one engine (in its own process) ------------------------------------------------------------


def _generate(llm: Any, batch: list[list[int]], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def run_engine(job: dict[str, Any]) -> dict[str, Any]:
    """Start one engine, read its capacity, run its batches (and its burst)."""
    result: dict[str, Any] = {"name": job["name"], "ok": False}
    start = time.perf_counter()
    try:
        if job["phase"] == "impl":
            from mla_decode_check import impl_check  # beside this script

            result.update(impl_check(job["cache"]))
        else:
            run_llm(job, result)
        result["ok"] = True
    except Exception as exc:  # recorded; the parent goes on with the next engine
        result["error"] = f"{type(exc).__name__}: {exc}"[:3000]
        result["traceback"] = traceback.format_exc()[-4000:]
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def run_llm(job: dict[str, Any], result: dict[str, Any]) -> None:
    """One vLLM engine: its capacity, its greedy batches, its burst; into ``result``."""
    start = time.perf_counter()
    from vllm import LLM

    llm = LLM(kv_cache_dtype=job["cache"], **job["llm"])
    result["startup_s"] = round(time.perf_counter() - start, 1)
    cache = llm.llm_engine.vllm_config.cache_config
    result.update(block_size=cache.block_size, num_gpu_blocks=cache.num_gpu_blocks)
    if cache.num_gpu_blocks:
        result["capacity_tokens"] = cache.num_gpu_blocks * cache.block_size
    result["outputs"] = [ids for batch in job["batches"] for ids in _generate(
        llm, batch, job["max_tokens"])]  # fmt: skip
    if job.get("burst"):
        b = job["burst"]
        vocab = SHAPES[job["shape"]]["vocab_size"]
        batch = [p[: b["prompt_len"]] for p in prompts(vocab, b["requests"], b["prompt_len"], 7)]
        batch = [p + p[: b["prompt_len"] - len(p)] for p in batch]  # all full length
        _generate(llm, batch[:2], 4)  # warm-up (first-call compilation of kernels)
        t0 = time.perf_counter()
        outs = _generate(llm, batch, b["output_len"])
        seconds = time.perf_counter() - t0
        produced = sum(len(o) for o in outs)
        result["burst"] = {
            "seconds": round(seconds, 2),
            "output_tokens": produced,
            "output_tok_s": round(produced / seconds, 1),
            "total_tok_s": round((produced + sum(map(len, batch))) / seconds, 1),
        }


def run_isolated(job: dict[str, Any], work: Path, timeout: float) -> dict[str, Any]:
    """One engine in a child process; its log parsed for the KV line and the backend."""
    work.mkdir(parents=True, exist_ok=True)
    spec, result_path, log = (
        work / f"{job['name']}.{x}" for x in ("job.json", "result.json", "log")
    )
    spec.write_text(json.dumps(job))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    cmd = [sys.executable, __file__, "--engine", str(spec), "--result", str(result_path)]
    # a timed-out engine leaves no result file; its log says how far it got
    with log.open("w") as handle, contextlib.suppress(subprocess.TimeoutExpired):
        subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    text = log.read_text(errors="replace")
    if result_path.exists():
        result = json.loads(result_path.read_text())
    else:
        result = {"name": job["name"], "ok": False, "error": f"no result: {text[-1500:]}"}
    found = KV_LINE.findall(text)
    result["kv_cache_tokens"] = int(found[-1].replace(",", "")) if found else None
    found_backends = {f"{a} ({b})" if a else c for a, b, c in BACKEND_LINE.findall(text)}
    result["backends"] = sorted(found_backends)
    for key in ("phase", "shape", "cache", "mode", "layers"):
        if key in job:
            result[key] = job[key]
    return result


# --- the report -----------------------------------------------------------------------------------


def _agreement(a: list[list[int]], b: list[list[int]]) -> float | None:
    pairs = [(x, y) for ra, rb in zip(a, b, strict=False) for x, y in zip(ra, rb, strict=False)]
    return round(sum(x == y for x, y in pairs) / len(pairs), 4) if pairs else None


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Capacity ratios against bf16 per shape; greedy equality between modes; burst ratio."""
    summary: dict[str, Any] = {"impl": [], "capacity": {}, "modes": {}, "burst": {}}
    for r in results:
        if r.get("phase") == "impl":
            summary["impl"] = r.get("cases", r.get("error"))
    for r in results:
        if r.get("phase") == "capacity":
            summary["capacity"].setdefault(r["shape"], {})[r["cache"]] = r.get("capacity_tokens")
    for shape, caps in summary["capacity"].items():
        base = caps.get("auto")
        if base:
            summary["capacity"][shape] = {
                c: {"tokens": t, "vs_bf16": round(t / base, 3) if t else None}
                for c, t in caps.items()
            }
    modes = [r for r in results if r.get("phase") == "modes" and r.get("ok")]
    for cache in sorted({r["cache"] for r in modes}):
        runs = {r["mode"]: r["outputs"] for r in modes if r["cache"] == cache}
        ref = runs.get("eager-noprefix")
        summary["modes"][cache] = {
            m: {"equal": out == ref, "agreement": _agreement(out, ref) if ref else None,
                "distinct_tokens": len({t for o in out for t in o})}
            for m, out in runs.items()
        }  # fmt: skip
    bursts = {r["cache"]: r["burst"] for r in results if r.get("burst")}
    if "auto" in bursts and KVARN in bursts:
        ratio = bursts[KVARN]["output_tok_s"] / bursts["auto"]["output_tok_s"]
        summary["burst"] = {**bursts, "kvarn_vs_bf16": round(ratio, 3)}
    return summary


def markdown(results: list[dict[str, Any]], summary: dict[str, Any], env: dict[str, Any]) -> str:
    lines = [f"# MLA evidence ({env.get('gpu')}, vLLM {env.get('vllm')}, {env.get('date')})", ""]
    lines += ["| engine | ok | block | blocks | tokens (blocks x block) | logged KV tokens | "
              "vs bf16 | backends | seconds | error |", "|" + " --- |" * 10]  # fmt: skip
    caps = summary["capacity"]
    for r in results:
        ratio = caps.get(r.get("shape"), {}).get(r.get("cache"), {})
        ratio = ratio.get("vs_bf16") if isinstance(ratio, dict) else None
        error = (r.get("error") or "").splitlines()[0][:160] if r.get("error") else ""
        lines.append(
            f"| {r['name']} | {r.get('ok')} | {r.get('block_size')} | {r.get('num_gpu_blocks')} | "
            f"{r.get('capacity_tokens')} | {r.get('kv_cache_tokens')} | {ratio} | "
            f"{', '.join(r.get('backends', []))} | {r.get('seconds')} | {error} |"
        )
    lines += ["", "## Decode glue on the GPU (KvarnMLAImpl.forward_mqa, bf16)", ""]
    lines += [f"- {case}" for case in summary["impl"]] if isinstance(summary["impl"], list) else [
        f"- failed: {summary['impl']}"]  # fmt: skip
    lines += ["", "## Greedy token ids against eager, prefix caching off (same cache)", ""]
    for cache, modes in summary["modes"].items():
        for mode, row in modes.items():
            lines.append(f"- {cache} {mode}: equal {row['equal']}, agreement {row['agreement']}, "
                         f"{row['distinct_tokens']} distinct tokens")  # fmt: skip
    if summary["burst"]:
        lines += ["", "## Burst", "", f"```\n{json.dumps(summary['burst'], indent=1)}\n```"]
    return "\n".join(lines) + "\n"


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        import torch

        env["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
        env["torch"] = torch.__version__
        import vllm

        env["vllm"] = vllm.__version__
    except Exception as exc:  # the report still says what was found
        env["error"] = repr(exc)
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        env["git"] = sha.stdout.strip() or None
    except OSError:  # no git there: a snapshot names its commit in GIT_SHA
        env["git"] = None
    for marker in (Path("GIT_SHA"), Path(".snap/GIT_SHA")):
        if env["git"] is None and marker.exists():
            env["git"] = marker.read_text().strip()
    return env


def flash_attention_present() -> bool:
    """Whether vLLM's FlashAttention ops (FA3 or FA2) are installed: MLA prefill needs them."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return False
    folder = Path(next(iter(spec.submodule_search_locations))) / "vllm_flash_attn"
    return any(folder.glob("_vllm_fa3_C*")) or any(folder.glob("_vllm_fa2_C*"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "mla_evidence_out")))
    p.add_argument("--models", type=Path, help="where the config.json folders go (OUT/models)")
    p.add_argument("--phases", nargs="+", default=["impl", "capacity", "modes", "burst"],
                   choices=["impl", "capacity", "modes", "burst"])  # fmt: skip
    p.add_argument("--caches", nargs="*", default=CAPACITY_CACHES)
    p.add_argument("--glm-caches", nargs="*", default=GLM_CAPACITY_CACHES)
    p.add_argument("--mode-layers", type=int, default=4)
    p.add_argument("--mode-tokens", type=int, default=32)
    p.add_argument("--burst-requests", type=int, default=64)
    p.add_argument("--burst-prompt-len", type=int, default=8192)
    p.add_argument("--burst-output-len", type=int, default=256)
    p.add_argument("--engine-timeout", type=float, default=300.0)
    p.add_argument("--dry-run", action="store_true", help="print the plan; import no vLLM")
    p.add_argument("--engine", type=Path, help=argparse.SUPPRESS)  # child: one engine's job
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.engine:  # the child process of run_isolated
        result = run_engine(json.loads(args.engine.read_text()))
        args.result.write_text(json.dumps(result))
        return 0
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    args.models = args.models or out / "models"
    jobs = plan(args)
    (out / "plan.json").write_text(json.dumps(jobs, indent=1))
    for job in jobs:
        flags = {k: v for k, v in job["llm"].items() if k not in ("model", "load_format", "seed")}
        print(f"{job['name']}: kv_cache_dtype={job['cache']} {flags}")
    print(f"{len(jobs)} engines; plan in {out / 'plan.json'}")
    if args.dry_run:
        return 0
    if not flash_attention_present():
        print("mla_evidence: vLLM's FlashAttention ops are missing; vLLM 0.26's MLA prefill needs "
              "them (carry the fa3 part). Engines will fail at their first prefill.")  # fmt: skip
    env = environment()
    results = []
    for job in jobs:
        result = run_isolated(job, out / "engines", args.engine_timeout)
        print(f"{job['name']}: ok={result.get('ok')} tokens={result.get('capacity_tokens')} "
              f"{result.get('seconds')} s {(result.get('error') or '')[:200]}", flush=True)  # fmt: skip
        results.append(result)
        (out / "mla_evidence.json").write_text(json.dumps(
            {"env": env, "results": results, "summary": summarize(results)}, indent=1))  # fmt: skip
    summary = summarize(results)
    (out / "mla_evidence.md").write_text(markdown(results, summary, env))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
