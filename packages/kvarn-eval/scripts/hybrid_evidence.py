#!/usr/bin/env python3
"""GPU evidence for hybrid models on a kvarn cache (issue 48): vLLM 0.26, dummy weights, one GPU.

Two model shapes, each a real model's configuration (dummy weights, no files needed):

``nemotron-h-8b``      Nemotron-H-8B-Base-8K: 52 layers (24 Mamba-2, 4 attention, 24 MLP), 8 KV
                       heads of head_dim 128, Mamba-2 with 128 heads of 64 and state 128.
                       Changed: max_position_embeddings 8192 -> 32768 (no RoPE; the cache's
                       arithmetic at 32K tokens per request).
``qwen3-next-80b``     Qwen3-Next-80B-A3B: 48 layers (36 gated delta net, 12 gated attention),
                       2 KV heads of head_dim 256, GDN with 16 key / 32 value heads of 128.
                       Changed: 512 experts -> 64 (top-10 kept) so the dummy weights fit one
                       80 GB GPU (about 80B -> 13B parameters); KV and state shapes are the real
                       ones.

Phases (each engine in its own process; results as JSON under ``--out``):

``capacity``  one engine per ``--caches`` entry (eager, no prefix caching, max_num_seqs 256):
              vLLM's block size, blocks, logged KV capacity in tokens, kvarn's staging; then
              a short greedy generation (the path runs). The summary sets each cache beside
              the arithmetic of its pages: the same pool as the first cache (bf16), divided
              into blocks of this cache's page, per request of ``--max-model-len`` tokens by
              vLLM's own accounting (attention blocks plus recurrent-state blocks).
``modes``     greedy token ids of one cache (and bf16) under eager / CUDA graphs and prefix
              caching on / off, on prompts that share a prefix longer than one block and run
              in two batches (so the second hits the prefix cache); agreement with the eager,
              prefix-off run of the same cache, and the number of distinct tokens (dummy
              weights: a run that emits one token throughout proves little).

    python hybrid_evidence.py --out $OUT --shape nemotron-h-8b --phase capacity \\
        --caches auto fp8 turboquant_4bit_nc turboquant_k3v4_nc kvarn_k4v2_g128
    python hybrid_evidence.py --out $OUT --shape qwen3-next-80b --phase modes
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

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
    "num_experts": 64,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
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
MODES = {
    # name: (enforce_eager, enable_prefix_caching)
    "eager-noprefix": (True, False),
    "eager-prefix": (True, True),
    "graphs-prefix": (False, True),
}
_KV_LINE = re.compile(r"GPU KV cache size:\s*([\d,]+)\s*tokens")
_STAGING_LINE = re.compile(r"kvarn: staging for open tiles: .*?= ([\d.]+) GiB")


def layer_counts(config: dict[str, Any]) -> tuple[int, int]:
    """``(attention layers, recurrent layers)`` of a shape's configuration."""
    pattern = config.get("hybrid_override_pattern")
    if pattern is not None:
        return pattern.count("*"), pattern.count("M")
    interval = config["full_attention_interval"]
    layers = config["num_hidden_layers"]
    return layers // interval, layers - layers // interval


def blocks_per_request(
    config: dict[str, Any], block_size: int, max_model_len: int, mamba_cache_mode: str
) -> int:
    """Blocks one request of ``max_model_len`` tokens takes in vLLM 0.26's accounting.

    vLLM groups layers of one kind into groups of ``g`` layers (``g`` is the smaller layer
    count, or the larger one when they differ by under 1.5x); a block id names one page in one
    layer of every group. A request takes ``ceil(L / block)`` blocks in each attention group
    and, in each recurrent group, 1 (``none`` cache mode), 2 (``align``) or ``ceil(L / block)``
    (``all``).
    """
    attention, recurrent = layer_counts(config)
    group = min(attention, recurrent)
    if max(attention, recurrent) < 1.5 * group:
        group = max(attention, recurrent)
    attention_blocks = math.ceil(max_model_len / block_size)
    per_state = {"none": 1, "align": 2}.get(mamba_cache_mode, attention_blocks)
    return (
        math.ceil(attention / group) * attention_blocks + math.ceil(recurrent / group) * per_state
    )


def layers_per_group(config: dict[str, Any]) -> int:
    """Layers per KV cache group (the number of pool tensors), as in :func:`blocks_per_request`."""
    attention, recurrent = layer_counts(config)
    group = min(attention, recurrent)
    return max(attention, recurrent) if max(attention, recurrent) < 1.5 * group else group


def arithmetic(runs: list[dict[str, Any]], config: dict[str, Any], max_model_len: int) -> None:
    """Adds to each run the capacity its pages give in the first run's pool (bytes), in place.

    ``expected_tokens``: the first run's pool (blocks x page x layers per group) cut into this
    run's pages, per request of ``max_model_len`` tokens, times ``max_model_len`` (vLLM's own
    definition of the logged capacity). ``measured_over_expected`` is 1 where only the pages
    differ; kvarn's staging and TurboQuant's workspace come out of the pool before it is cut,
    so they show as the shortfall.
    """
    base = next((r for r in runs if r.get("ok")), None)
    if base is None or not base.get("page_bytes"):
        return
    slots = layers_per_group(config)
    pool = base["num_gpu_blocks"] * base["page_bytes"] * slots
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


def write_model_dir(shape: str, out: Path) -> Path:
    folder = out / f"model-{shape}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(SHAPES[shape], indent=1))
    return folder


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:  # a bad record must not kill the run
            return
        if "KV cache" in msg or "kvarn" in msg or "block size" in msg or "mamba" in msg:
            self.lines.append(msg)


def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine (in this process): capacity, then greedy generation in ``spec["batches"]``."""
    result: dict[str, Any] = {"name": spec["name"], "cache": spec["cache"], "ok": False}
    capture = _Capture()
    logging.getLogger("vllm").addHandler(capture)
    start = time.time()
    llm = None
    try:
        from vllm import LLM, SamplingParams

        kwargs = dict(spec["llm_kwargs"])
        if spec.get("bf16_backend") and not spec["cache"].startswith(("kvarn_", "turboquant_")):
            kwargs["attention_config"] = {"backend": spec["bf16_backend"]}
        llm = LLM(kv_cache_dtype=spec["cache"], **kwargs)
        result["startup_s"] = round(time.time() - start, 1)
        cache = llm.llm_engine.vllm_config.cache_config
        result.update(
            block_size=cache.block_size,
            num_gpu_blocks=cache.num_gpu_blocks,
            page_bytes=attention_page_bytes(spec["cache"], cache.block_size, SHAPES[spec["shape"]]),
            mamba_cache_mode=cache.mamba_cache_mode,
            kv_cache_tokens_config=getattr(cache, "kv_cache_size_tokens", None),
        )
        params = SamplingParams(
            temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, detokenize=False
        )
        outputs: list[list[int]] = []
        gen_start = time.perf_counter()
        for batch in spec["batches"]:
            outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
            outputs += [list(o.outputs[0].token_ids) for o in outs]
        result["generate_s"] = round(time.perf_counter() - gen_start, 2)
        result["outputs"] = outputs
        result["ok"] = True
    except Exception as exc:  # recorded; the parent carries on with the next engine
        result["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
    finally:
        result["seconds"] = round(time.time() - start, 1)
        logging.getLogger("vllm").removeHandler(capture)
        found = [
            int(m.group(1).replace(",", "")) for x in capture.lines if (m := _KV_LINE.search(x))
        ]
        result["kv_cache_tokens"] = found[-1] if found else None
        staging = [float(m.group(1)) for x in capture.lines if (m := _STAGING_LINE.search(x))]
        result["staging_gib"] = staging[-1] if staging else None
        result["log"] = capture.lines[-12:]
        if llm is not None:
            with contextlib.suppress(Exception):  # best effort: the process ends next
                llm.llm_engine.engine_core.shutdown()
    return result


def run_isolated(spec: dict[str, Any], workdir: Path, timeout: float) -> dict[str, Any]:
    """:func:`run_engine` in a fresh process (a clean GPU for every engine)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from e2e_smoke import run_child  # stops the child's whole process group on a timeout

    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", spec["name"])
    spec_path, result_path = workdir / f"{slug}.spec.json", workdir / f"{slug}.result.json"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--internal", str(spec_path)]
    cmd += ["--internal-result", str(result_path)]
    code, output = run_child(cmd, timeout)
    (workdir / f"{slug}.log").write_text(output[-6000:])
    if result_path.exists():
        result = json.loads(result_path.read_text())
    else:
        why = "timed out" if code is None else f"exit {code}"
        result = {"name": spec["name"], "cache": spec["cache"], "ok": False}
        result["error"] = f"no result ({why}): {output[-1500:]}"
    if result.get("staging_gib") is None:  # the engine core logs in its own process
        staging = _STAGING_LINE.findall(output)
        result["staging_gib"] = float(staging[-1]) if staging else None
    if result.get("kv_cache_tokens") is None:
        found = _KV_LINE.findall(output)
        result["kv_cache_tokens"] = int(found[-1].replace(",", "")) if found else None
    status = "ok" if result.get("ok") else "FAILED"
    print(
        f"[{status}] {spec['name']}: block {result.get('block_size')} blocks "
        f"{result.get('num_gpu_blocks')} tokens {result.get('kv_cache_tokens')} "
        f"({result.get('seconds')} s)",
        flush=True,
    )
    if not result.get("ok"):
        print(str(result.get("error", "")).strip().splitlines()[-1][:400], flush=True)
    return result


def _prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(count)]


def _llm_kwargs(args: argparse.Namespace, model: Path, eager: bool, prefix: bool) -> dict:
    return {
        "model": str(model),
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "enforce_eager": eager,
        "enable_prefix_caching": prefix,
        "seed": 0,
    }


def phase_capacity(args: argparse.Namespace, out: Path, model: Path) -> list[dict[str, Any]]:
    config = SHAPES[args.shape]
    prompts = _prompts(config["vocab_size"], 4, 64, seed=1)
    runs = []
    for cache in args.caches:
        spec = {
            "name": f"{args.shape}-{cache}-capacity",
            "shape": args.shape,
            "cache": cache,
            "llm_kwargs": _llm_kwargs(args, model, eager=True, prefix=False),
            "bf16_backend": args.bf16_backend,
            "batches": [prompts],
            "max_tokens": 8,
        }
        runs.append(run_isolated(spec, out, args.timeout))
        arithmetic(runs, config, args.max_model_len)
        _dump(out / f"{args.shape}-capacity.json", args, runs)
    return runs


def phase_modes(args: argparse.Namespace, out: Path, model: Path) -> list[dict[str, Any]]:
    """Prompts share a prefix of ``--shared-prefix`` tokens (more than one kvarn block):
    the first prompt runs alone, then all of them, so with prefix caching the rest hit it."""
    config = SHAPES[args.shape]
    (prefix,) = _prompts(config["vocab_size"], 1, args.shared_prefix, seed=2)
    tails = _prompts(config["vocab_size"], args.num_prompts, 64, seed=3)
    prompts = [prefix + tail for tail in tails]
    runs = []
    for cache in args.mode_caches:
        for mode, (eager, prefix_on) in MODES.items():
            spec = {
                "name": f"{args.shape}-{cache}-{mode}",
                "shape": args.shape,
                "cache": cache,
                "llm_kwargs": _llm_kwargs(args, model, eager=eager, prefix=prefix_on),
                "bf16_backend": args.bf16_backend,
                "batches": [prompts[:1], prompts[1:]],
                "max_tokens": args.max_tokens,
            }
            run = run_isolated(spec, out, args.timeout)
            run["mode"] = mode
            runs.append(run)
            _compare(runs)
            _dump(out / f"{args.shape}-modes.json", args, runs)
    return runs


def _compare(runs: list[dict[str, Any]]) -> None:
    """Each run's greedy tokens against its cache's eager, prefix-off run (in place)."""
    reference = {r["cache"]: r for r in runs if r.get("mode") == "eager-noprefix" and r.get("ok")}
    for run in runs:
        ref = reference.get(run["cache"])
        if not run.get("ok") or ref is None:
            continue
        pairs = list(zip(run["outputs"], ref["outputs"], strict=True))
        same = sum(a == b for x, y in pairs for a, b in zip(x, y, strict=True))
        total = sum(len(x) for x, _ in pairs)
        run["agreement"] = round(same / total, 4) if total else None
        run["exact_prompts"] = sum(x == y for x, y in pairs)
        run["num_prompts"] = len(pairs)
        run["distinct_tokens"] = len({t for x in run["outputs"] for t in x})


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


def _dump(path: Path, args: argparse.Namespace, runs: list[dict[str, Any]]) -> None:
    payload = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "args": {k: v for k, v in vars(args).items() if not k.startswith("internal")},
        "environment": environment(),
        "shape": SHAPES[args.shape],
        "runs": runs,
    }
    path.write_text(json.dumps(payload, indent=1))


def summary(runs: list[dict[str, Any]]) -> str:
    """One line per run: the numbers the docs quote."""
    lines = []
    for r in runs:
        if not r.get("ok"):
            lines.append(f"{r['name']}: FAILED")
            continue
        fields = [f"block {r['block_size']}", f"blocks {r['num_gpu_blocks']}"]
        fields += [f"tokens {r.get('kv_cache_tokens')}"]
        for key in ("vs_first", "expected_tokens", "measured_over_expected", "staging_gib"):
            if r.get(key) is not None:
                fields.append(f"{key} {r[key]}")
        for key in ("agreement", "exact_prompts", "distinct_tokens"):
            if r.get(key) is not None:
                fields.append(f"{key} {r[key]}")
        lines.append(f"{r['name']}: " + ", ".join(fields))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="folder for JSON results (default: a temp dir)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="nemotron-h-8b")
    parser.add_argument("--phase", choices=("capacity", "modes"), default="capacity")
    parser.add_argument("--caches", nargs="+", default=list(DEFAULT_CACHES))
    parser.add_argument("--mode-caches", nargs="+", default=["kvarn_k4v2_g128", "auto"])
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--shared-prefix", type=int, default=6144)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per engine")
    parser.add_argument(
        "--bf16-backend",
        default=None,
        help="attention backend for auto/fp8 (e.g. TRITON_ATTN where FlashAttention is missing)",
    )
    parser.add_argument("--internal", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--internal-result", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.internal:
        result = run_engine(json.loads(Path(args.internal).read_text()))
        Path(args.internal_result).write_text(json.dumps(result))
        return 0
    out = Path(args.out or tempfile.mkdtemp(prefix="hybrid-"))
    out.mkdir(parents=True, exist_ok=True)
    model = write_model_dir(args.shape, out)
    phase = phase_capacity if args.phase == "capacity" else phase_modes
    runs = phase(args, out, model)
    print(summary(runs), flush=True)
    return 0 if all(r.get("ok") for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
