"""GPU end-to-end runs of speculative decoding over a KVarN cache (issue 6, items 2-4).

Each engine starts in its own Python process (a crash, hang or CUDA error is recorded and the
script carries on); results go to ``--out`` as JSON after every run. In every phase but
``dummy`` each engine first generates 16 tokens for ``--warmup-prompts`` prompts of its own
(untimed, in two waves so that steps mix prefill and decode, their drafts left out of the
counts; :func:`warm_up`), so that kernels compiled on first use do not land in the timed run (a
batch-invariant n-gram engine once spent most of it compiling). The stress phases have warmed
up since 2026-12-03; before, one first EAGLE stress engine on a fresh H200 ran at a third of
the speed of later ones, for a reason not found.

Phases (one per call, each well under 10 minutes on an H200 with SmolLM2-135M):

* ``agreement`` (real SmolLM2 weights): greedy outputs without speculation and with n-gram
  (prompt-lookup) speculation, for bf16, ``kvarn_k4v2_g128`` and ``kvarn_k4v4_g128``, over
  prompts of repeated-but-varying text (prompt lookup proposes drafts that are then rejected),
  each behind ``--pad-words`` of its own notes so that decoding reads quantized tiles. vLLM
  0.26 runs n-gram on its V1 model runner (kvarn keeps staging slots by request id there);
  without speculation it runs V2. ``--methods ngram ngram_gpu`` adds the GPU proposer (async
  scheduling); ``--dtypes ... fp8`` adds vLLM's fp8 cache as a reference. Acceptance counts
  and generation time come from vLLM's own metrics (items 2 and 4).
* ``dummy`` (dummy weights, SmolLM2 shape): the same comparison with EAGLE speculation (a
  one-layer EAGLE draft of the same shape, dummy weights too), which kvarn serves: almost every
  draft is rejected. Greedy agreement spec vs no spec for bf16 and both kvarn presets, and
  acceptance / throughput beside bf16.
* ``stress`` (item 3): dummy target + dummy EAGLE draft, CUDA graphs (vLLM's default mode;
  full graphs for uniform speculative steps unless ``KVARN_VLLM_SPEC_FULL_GRAPHS=0``), prefix
  caching on, thousands of engine steps; checks every sampled token's logprob is finite and
  nothing crashed.
* ``dflash``: dummy target + a dummy DFlash drafter of its shape (:func:`dflash_draft_dir`),
  CUDA graphs, prefix caching, ``--stress-prompts`` x ``--stress-tokens``: finite logprobs, no
  crash, and greedy agreement with no speculation (DFlash on vLLM's V2 runner).
* ``eagle3``: the dummy target with a dummy one-layer EAGLE-3 draft
  (:func:`eagle3_draft_dir`), otherwise as ``dflash``.
* ``mtp``: a dummy MiMo target of SmolLM2's shape (:func:`mtp_model_dir`) drafting with its
  own multi-token-prediction layer (method ``mtp``), otherwise as ``dflash``.
* ``repeat`` (real SmolLM2 weights, CUDA graphs, or eager with ``--eager``): an EAGLE draft
  built from the target's own weights that proposes the last token again
  (:func:`repeat_draft_dir`), over prompts of which half make the model repeat a word (drafts
  accepted) and half vary (drafts rejected), each behind about 580 tokens of its own notes
  (``--pad-words``) so that decoding reads quantized tiles: greedy
  agreement spec vs no spec, acceptance and tokens/s, bf16 beside both kvarn presets. This
  gives real acceptances and rejections in the same batches on the V2 runner's draft path.

``--profile N``: every engine's timed run goes through vLLM's torch profiler, which records
``N`` engine steps after skipping the first ``--profile-skip``; the profiler's table of
operations by GPU and CPU time (vLLM's ``profiler_out_0.txt``) lands in the run's result
(``profile_table``) and the traces are deleted. Its tokens/s then include the profiler's
overhead: compare the tables, not the speeds.

Usage (GPU machine)::

    python packages/kvarn-eval/scripts/e2e_spec.py --phase agreement --model /tmp/smollm2-hf --out $OUT/spec
    python packages/kvarn-eval/scripts/e2e_spec.py --phase dummy --model /tmp/smollm2-hf --out $OUT/spec
    python packages/kvarn-eval/scripts/e2e_spec.py --phase stress --model /tmp/smollm2-hf --out $OUT/spec
    python packages/kvarn-eval/scripts/e2e_spec.py --phase dflash --model /tmp/smollm2-hf --out $OUT/spec
    python packages/kvarn-eval/scripts/e2e_spec.py --phase repeat --model /tmp/smollm2-hf --out $OUT/spec

``--model`` is a Hugging Face folder (config + weights + tokenizer); without it the SmolLM2
GGUF is converted as ``e2e_smoke.py`` does (``--gguf`` or ``$KVARN_GPU_FILES``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_smoke import (
    _free,
    compare_outputs,
    environment,
    run_child,
    smoke_model,
)
from kvarn_math import PRESETS

KVARN_PRESETS = ("kvarn_k4v2_g128", "kvarn_k4v4_g128")
DTYPES = ("auto", *KVARN_PRESETS)
# On request: every other kvarn preset, and fp8 (vLLM's own quantized cache) as the reference
# for what quantizing the cache does to agreement between serving modes.
_ALL_DTYPES = (*DTYPES, *(p for p in PRESETS if p not in KVARN_PRESETS), "fp8")
_DTYPE_ORDER = {d: i for i, d in enumerate(_ALL_DTYPES)}
NGRAM_METHODS = ("ngram", "ngram_gpu")

_SUBJECTS = (
    "the red fox",
    "a small boat",
    "the old clock",
    "my neighbour's cat",
    "the winter garden",
    "a quiet library",
    "the mountain road",
    "the city market",
    "an empty station",
    "the river bridge",
)
_VERBS = ("watched", "crossed", "painted", "counted", "followed", "described", "remembered")
_OBJECTS = ("the lanterns", "seven birds", "the last train", "a paper map", "the tall trees")


def make_repetitive_prompts(n: int) -> list[str]:
    """``n`` distinct prompts of repeated-but-varying text.

    Each repeats one sentence pattern with a changing object and number, so the continuation
    looks like the prompt (prompt lookup finds n-gram matches and proposes drafts) but the
    next token usually differs from what the match predicts (the drafts get rejected).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    prompts = []
    for i in range(n):
        subject = _SUBJECTS[i % len(_SUBJECTS)]
        verb = _VERBS[(i // len(_SUBJECTS)) % len(_VERBS)]
        lines = [
            f"Day {d + 1}: {subject} {verb} {_OBJECTS[(i + d) % len(_OBJECTS)]} "
            f"{(i * 7 + d * 3) % 11 + 2} times."
            for d in range(4 + i % 5)
        ]
        prompts.append(" ".join(lines) + f" Day {len(lines) + 1}: {subject}")
    return prompts


_ECHO_WORDS = ("yes", "go", "blue", "tree", "stop", "hello", "rain", "apple", "north", "seven")


def make_echo_prompts(n: int) -> list[str]:
    """``n`` prompts, alternately one that makes a model repeat a word (a draft proposing the
    last token again is accepted) and one of :func:`make_repetitive_prompts` (rejected)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    varying = make_repetitive_prompts(n)
    prompts = []
    for i in range(n):
        if i % 2:
            prompts.append(varying[i])
        else:
            word = _ECHO_WORDS[(i // 2) % len(_ECHO_WORDS)]
            count = 40 + (i // 2) % 7
            prompts.append(
                f"Write the word '{word}' {count} times, separated by spaces: "
                + " ".join([word] * (3 + i % 4))
            )
    return prompts


def warmup_prompts(n: int, words: int) -> list[str]:
    """``n`` prompts for an engine's warm-up before the timed run: repetitive like the measured
    ones (n-gram proposes drafts, so the verify path and vLLM's rejection sampler compile),
    behind notes of 1/n to all of ``words`` (chunks of several sizes) under a header of their
    own, so that no measured prompt hits their blocks in the prefix cache."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    bases = make_repetitive_prompts(n) if n else []
    return [
        f"Warm-up notes {i}: {_notes(i, words * (i + 1) // n)}.\n\n{base}"
        for i, base in enumerate(bases)
    ]


def _notes(i: int, words: int) -> str:
    vocab = _OBJECTS + _SUBJECTS + _ECHO_WORDS
    return " ".join(vocab[(i * 7 + j * 3) % len(vocab)] for j in range(words))


def pad_prompts(prompts: list[str], words: int) -> list[str]:
    """Each prompt behind ``words`` words of its own notes (numbered, so no two prompts share
    a prefix-cache block): long enough that generation attends quantized tiles, not only the
    exact first tile (128 tokens) and the open one in staging."""
    if words < 0:
        raise ValueError(f"words must be >= 0, got {words}")
    if words == 0:
        return list(prompts)
    return [f"Notes {i}: {_notes(i, words)}.\n\n{prompt}" for i, prompt in enumerate(prompts)]


def spec_counters(metrics: list[Any], since: dict[str, float] | None = None) -> dict[str, float]:
    """Sum vLLM's ``vllm:spec_decode_*`` counters (``LLM.get_metrics()``) over engines, less
    the counts ``since`` (an earlier call's result: the warm-up's drafts)."""
    out: dict[str, float] = {}
    for m in metrics:
        name = getattr(m, "name", "")
        if name.startswith("vllm:spec_decode_num_") and hasattr(m, "value"):
            key = name.removeprefix("vllm:spec_decode_")
            out[key] = out.get(key, 0.0) + float(m.value)
    for key, value in (since or {}).items():
        if key.startswith("num_") and key in out:
            out[key] -= value
    drafts, accepted = out.get("num_draft_tokens"), out.get("num_accepted_tokens")
    if drafts:
        out["acceptance_rate"] = round((accepted or 0.0) / drafts, 4)
    if out.get("num_drafts"):
        out["mean_accepted_per_draft"] = round((accepted or 0.0) / out["num_drafts"], 4)
    return out


def speculative_config(method: str, k: int, draft: str | None) -> dict[str, Any] | None:
    """vLLM 0.26 ``speculative_config`` dict for ``method`` (None: no speculation)."""
    if method == "none":
        return None
    if method in NGRAM_METHODS:
        return {
            "method": method,
            "num_speculative_tokens": k,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 5,
        }
    if method in ("eagle", "eagle3", "dflash"):
        if draft is None:
            raise ValueError(f"{method} needs a draft model folder")
        return {"method": method, "model": draft, "num_speculative_tokens": k}
    if method == "mtp":  # the target's own multi-token-prediction layers draft
        return {"method": "mtp", "num_speculative_tokens": k}
    raise ValueError(
        f"method must be none, ngram, ngram_gpu, eagle, eagle3, dflash or mtp, got {method!r}"
    )


def eagle_draft_dir(model: Path, out: Path) -> Path:
    """A one-layer EAGLE draft config of ``model``'s shape (for dummy weights only).

    vLLM wraps a Llama config named as the draft in its EAGLEConfig (architecture
    ``EagleLlamaForCausalLM``: embedding + fc + one decoder layer, lm_head shared).
    """
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((model / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def eagle3_draft_dir(model: Path, out: Path) -> Path:
    """A one-layer EAGLE-3 draft config of ``model``'s shape (for dummy weights only): vLLM
    0.26 maps ``LlamaForCausalLMEagle3`` to its Llama EAGLE-3 drafter, which reads the target's
    hidden states after three of its layers (vLLM's default choice) and drafts over the
    target's vocabulary."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((model / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def dflash_draft_dir(model: Path, out: Path, layers: int = 2) -> Path:
    """A DFlash drafter config of ``model``'s shape (for dummy weights only): vLLM 0.26 maps
    the architecture ``DFlashDraftModel`` to its Qwen3 DFlash drafter, whose full-attention
    layers attend their block of drafts non-causally. Same hidden size, heads, head size and
    vocabulary as the target (one KV cache group, no token map); it reads the target's hidden
    states after three of its layers; the mask token is the vocabulary's last."""
    out.mkdir(parents=True, exist_ok=True)
    t = json.loads((model / "config.json").read_text())
    heads = int(t["num_attention_heads"])
    depth = int(t["num_hidden_layers"])
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": t["hidden_size"],
        "intermediate_size": t["intermediate_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": t.get("num_key_value_heads", heads),
        "head_dim": t.get("head_dim", t["hidden_size"] // heads),
        "hidden_act": "silu",
        "rms_norm_eps": t.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": t.get("max_position_embeddings", 8192),
        "rope_theta": t.get("rope_theta", 10000.0),
        "vocab_size": t["vocab_size"],
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * layers,
        "dflash_config": {
            "mask_token_id": int(t["vocab_size"]) - 1,
            "target_layer_ids": sorted({1, depth // 2, depth - 2}),
        },
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def mtp_model_dir(model: Path, out: Path) -> Path:
    """``model``'s shape as a MiMo model with one multi-token-prediction layer (for dummy
    weights only): vLLM 0.26 serves ``MiMoForCausalLM`` (Qwen2 layers, so dense attention, on
    the kvarn cache) and drafts with its ``num_nextn_predict_layers`` MTP layers (method
    ``mtp``, architecture ``MiMoMTPModel``), whose attention layers are kvarn layers too. The
    config says ``model_type: qwen2`` so that transformers reads it without remote code; the
    tokenizer files are ``model``'s."""
    out.mkdir(parents=True, exist_ok=True)
    t = json.loads((model / "config.json").read_text())
    heads = int(t["num_attention_heads"])
    cfg = {
        "architectures": ["MiMoForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": t["hidden_size"],
        "intermediate_size": t["intermediate_size"],
        "num_hidden_layers": t["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": t.get("num_key_value_heads", heads),
        "hidden_act": "silu",
        "rms_norm_eps": t.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": t.get("max_position_embeddings", 8192),
        "rope_theta": t.get("rope_theta", 10000.0),
        "vocab_size": t["vocab_size"],
        "tie_word_embeddings": bool(t.get("tie_word_embeddings", False)),
        "use_sliding_window": False,
        "num_nextn_predict_layers": 1,
        "torch_dtype": t.get("torch_dtype", "bfloat16"),
    }
    for key in ("bos_token_id", "eos_token_id"):
        if key in t:
            cfg[key] = t[key]
    if int(t.get("head_dim", t["hidden_size"] // heads)) != t["hidden_size"] // heads:
        raise ValueError(
            f"MiMo (Qwen2) layers take head_dim = hidden_size / heads; {model} has "
            f"head_dim {t['head_dim']} with hidden_size {t['hidden_size']} and {heads} heads"
        )
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in model.iterdir():
        if f.is_file() and f.name != "config.json" and f.suffix not in (".safetensors", ".bin"):
            shutil.copy(f, out / f.name)
    return out


def repeat_draft_dir(model: Path, out: Path) -> Path:
    """A one-layer EAGLE draft, with real weights, that proposes the last token again.

    vLLM's EAGLE-1 Llama draft computes ``fc([embed(token), h])`` -> one decoder layer (no
    input norm) -> ``h + residual`` -> the target's ``lm_head`` (shared: the draft has no
    ``lm_head`` or ``embed_tokens`` weights). With ``fc = [0 | I]`` and the layer's output
    projections ``o_proj`` and ``down_proj`` zero, the draft returns the target's final
    (normed) hidden state unchanged, so its logits are the target's logits for the token just
    sampled: every draft token repeats the last one. The layer's other weights are the
    target's layer 0 (its attention still reads and writes the draft's KV cache).
    """
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((model / "config.json").read_text())
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError(f"{model}: biased projections; zeroing the weights would not zero them")
    cfg["num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    state: dict[str, Any] = {}
    for f in sorted(model.glob("*.safetensors")):
        state.update(load_file(str(f)))
    prefix = "model.layers.0."
    layer = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    if not layer:
        raise ValueError(f"{model}: no {prefix}* weights in its safetensors")
    hidden = int(cfg["hidden_size"])
    dtype = layer["self_attn.q_proj.weight"].dtype
    weights = {
        "fc.weight": torch.cat(
            [torch.zeros(hidden, hidden, dtype=dtype), torch.eye(hidden, dtype=dtype)], dim=1
        )
    }
    for name, tensor in layer.items():
        if name.startswith("input_layernorm"):
            continue  # vLLM drops the first draft layer's input norm
        if name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            tensor = torch.zeros_like(tensor)
        weights[f"layers.0.{name}"] = tensor.contiguous()
    save_file(weights, str(out / "model.safetensors"))
    return out


def warm_up(engine: Any, prompts: list[str], params: Any, max_steps: int = 10_000) -> str | None:
    """Run ``prompts`` through ``engine`` (vLLM's ``LLMEngine``) in two waves: the second half
    arrives while the first decodes, so that steps mix prefill chunks with decode (or verify)
    rows, as the timed run's do. Returns None, or the error that stopped it (every warm-up
    request aborted, so the timed run starts from an idle engine)."""
    ids = [f"warmup-{i}" for i in range(len(prompts))]
    half = (len(prompts) + 1) // 2
    try:
        for rid, prompt in zip(ids[:half], prompts[:half]):
            engine.add_request(rid, prompt, params)
        for _ in range(2):  # the first wave prefills and starts decoding
            engine.step()
        for rid, prompt in zip(ids[half:], prompts[half:]):
            engine.add_request(rid, prompt, params)
        steps = 0
        while engine.has_unfinished_requests():
            steps += 1
            if steps > max_steps:
                raise RuntimeError(f"warm-up unfinished after {max_steps} steps")
            engine.step()
    except Exception as exc:
        with contextlib.suppress(Exception):  # the error that stopped it is what to report
            engine.abort_request(ids)
        return f"{type(exc).__name__}: {exc}"
    return None


def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine: start, generate greedily, read metrics, shut down (child process)."""
    result: dict[str, Any] = {"name": spec["name"], "ok": False, "settings": spec["llm_kwargs"]}
    start = time.time()
    llm = None
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(**spec["llm_kwargs"])
        cfg = llm.llm_engine.vllm_config
        result["kv_cache_tokens"] = (cfg.cache_config.num_gpu_blocks or 0) * (
            cfg.cache_config.block_size or 0
        )
        result["cudagraph_mode"] = str(cfg.compilation_config.cudagraph_mode)
        result["model_runner"] = "v2" if cfg.use_v2_model_runner else "v1"
        params = SamplingParams(
            temperature=0.0,
            max_tokens=spec["max_tokens"],
            ignore_eos=True,
            seed=0,
            logprobs=1 if spec.get("logprobs") else None,
        )
        warm = spec.get("warmup_prompts") or []
        before: dict[str, float] = {}
        if warm:
            # Lazily compiled kernels (vLLM's rejection sampler, any kernel variant the engine's
            # own warm-up missed) compile here rather than inside the timed run.
            w0 = time.perf_counter()
            warm_params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
            result["warmup_error"] = warm_up(llm.llm_engine, warm, warm_params)
            result["warmup_seconds"] = round(time.perf_counter() - w0, 3)
            try:
                before = spec_counters(llm.get_metrics())
            except Exception:  # metrics are a bonus (see below)
                before = {}
        profile_dir = spec.get("profile_dir")
        t0 = time.perf_counter()
        if profile_dir:
            llm.start_profile()
        outs = llm.generate(spec["prompts"], params, use_tqdm=False)
        result["generate_seconds"] = round(time.perf_counter() - t0, 3)
        if profile_dir:
            llm.stop_profile()
            result["profile_table"] = read_profile(Path(profile_dir))
        result["outputs"] = [list(o.outputs[0].token_ids) for o in outs]
        result["output_tokens"] = sum(len(t) for t in result["outputs"])
        result["tokens_per_second"] = round(
            result["output_tokens"] / max(result["generate_seconds"], 1e-9), 1
        )
        if spec.get("logprobs"):
            bad = 0
            for o in outs:
                for tok, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs or []):
                    if tok not in lp or not math.isfinite(lp[tok].logprob):
                        bad += 1
            result["non_finite_logprobs"] = bad
        try:
            result["spec_decode"] = spec_counters(llm.get_metrics(), since=before)
        except Exception as exc:  # metrics are a bonus; never lose the outputs for them
            result["spec_decode"] = {"error": repr(exc)}
        result["ok"] = True
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
    finally:
        result["seconds"] = round(time.time() - start, 1)
        if llm is not None:
            _free(llm)
    return result


def profiler_config(profile_dir: Path, steps: int, skip: int) -> dict[str, Any]:
    """vLLM's torch profiler over ``steps`` engine steps after ``skip``, into ``profile_dir``:
    no stack traces (smaller, faster), the front end left out, a table by GPU time."""
    return {
        "profiler": "torch",
        "torch_profiler_dir": str(profile_dir),
        "torch_profiler_with_stack": False,
        "ignore_frontend": True,
        "delay_iterations": skip,
        "max_iterations": steps,
    }


def read_profile(profile_dir: Path) -> str:
    """The profiler's table (vLLM writes ``profiler_out_<rank>.txt`` when profiling stops),
    then the traces deleted: only the table is kept."""
    table = profile_dir / "profiler_out_0.txt"
    text = table.read_text() if table.exists() else f"no {table.name} in {profile_dir}"
    for trace in profile_dir.rglob("*.json*"):
        trace.unlink()
    return text


# The V2 runner's bars say "(FULL)", the V1 runner's "(decode, FULL)" and
# "(mixed prefill-decode, PIECEWISE)".
_CAPTURE = re.compile(
    r"Capturing CUDA graphs \((?:[^,()]*,\s*)?(\w+)\):\s+100%\|[^|]*\|\s*(\d+)/(\d+)"
)


def captured_graphs(log: str) -> dict[str, int]:
    """CUDA graphs the engine captured, by kind (``{"FULL": 11, "PIECEWISE": 23}``), from the
    progress bars in its output. ``cudagraph_mode`` in a result is the mode the engine was
    asked for; vLLM lowers it in the worker where a backend cannot take full graphs (a
    speculative engine whose attention supports less than uniform batches runs piecewise)."""
    out: dict[str, int] = {}
    for kind, done, total in _CAPTURE.findall(log):
        if done == total:
            out[kind] = max(out.get(kind, 0), int(total))
    return out


def _slug(name: str) -> str:
    """A run's name as a file name (its logs, specs, results and profiles)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def run_isolated_engine(spec: dict[str, Any], workdir: Path, timeout: float) -> dict[str, Any]:
    """:func:`run_engine` in a fresh process; a crash or timeout becomes a recorded failure."""
    workdir.mkdir(parents=True, exist_ok=True)
    slug = _slug(spec["name"])
    spec_path, result_path = workdir / f"{slug}.spec.json", workdir / f"{slug}.result.json"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--internal-run", str(spec_path)]
    cmd += ["--internal-result", str(result_path)]
    code, full = run_child(cmd, timeout)
    tail = full[-4000:] if code is not None else f"timed out after {timeout}s\n{full[-2000:]}"
    (workdir / f"{slug}.log").write_text(tail)
    if result_path.exists():
        result = json.loads(result_path.read_text())
    else:
        result = {
            "name": spec["name"],
            "ok": False,
            "error": f"child process gave no result (exit {code}):\n{tail}",
        }
    result["captured_graphs"] = captured_graphs(full)
    status = "ok" if result.get("ok") else "FAILED"
    print(f"[{status}] {spec['name']} {result.get('seconds', '?')}s", flush=True)
    if result.get("error"):
        print(result["error"].strip().splitlines()[-1][:400], flush=True)
    return result


def _public(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k != "outputs"}


def _dump(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str))


def comparison_rows(runs: dict[str, dict[str, Any]], methods: tuple[str, ...]) -> dict[str, Any]:
    """Per cache dtype: greedy agreement of each speculative run with the same dtype's
    non-speculative run, plus acceptance and throughput beside it."""
    rows: dict[str, Any] = {}
    for dtype in sorted({name.split("/")[0] for name in runs}, key=_DTYPE_ORDER.get):
        base = runs.get(f"{dtype}/none")
        for method in methods:
            run = runs.get(f"{dtype}/{method}")
            if run is None:
                continue
            row: dict[str, Any] = {"ok": bool(run.get("ok"))}
            if not run.get("ok"):
                row["error"] = (run.get("error") or "").strip().splitlines()[:1]
            elif base and base.get("ok"):
                row["agreement_with_no_spec"] = compare_outputs(base["outputs"], run["outputs"])
                row["tokens_per_second"] = run.get("tokens_per_second")
                row["tokens_per_second_no_spec"] = base.get("tokens_per_second")
                row["spec_decode"] = run.get("spec_decode")
            rows[f"{dtype}/{method}"] = row
    return rows


def _phase(
    args: argparse.Namespace,
    out: Path,
    phase: str,
    model: Path,
    methods: tuple[str, ...],
    draft: Path | None,
    base_kwargs: dict[str, Any],
    prompts: list[str],
    max_tokens: int,
    logprobs: bool = False,
    with_baseline: bool = True,
    warmup: list[str] | None = None,
) -> bool:
    runs: dict[str, dict[str, Any]] = {}
    path = out / f"spec_{phase}.json"
    for dtype in args.dtypes:
        for method in (("none",) if with_baseline else ()) + methods:
            name = f"{dtype}/{method}"
            kwargs = dict(base_kwargs)
            kwargs.update(model=str(model), kv_cache_dtype=dtype, disable_log_stats=False)
            sc = speculative_config(method, args.num_spec, None if draft is None else str(draft))
            if sc is not None:
                kwargs["speculative_config"] = sc
            spec = {"name": f"{phase}:{name}"}
            if args.profile:
                slug = _slug(spec["name"])
                pdir = (out / "profiles" / slug).resolve()
                kwargs["profiler_config"] = profiler_config(pdir, args.profile, args.profile_skip)
                spec["profile_dir"] = str(pdir)
            spec |= {
                "llm_kwargs": kwargs,
                "prompts": prompts,
                "max_tokens": max_tokens,
                "logprobs": logprobs,
                "warmup_prompts": warmup or [],
            }
            runs[name] = run_isolated_engine(spec, out / "runs", args.run_timeout)
            _dump(
                path,
                {
                    "phase": phase,
                    "complete": False,
                    "environment": environment(),
                    "num_prompts": len(prompts),
                    "max_tokens": max_tokens,
                    "num_speculative_tokens": args.num_spec,
                    "runs": {k: _public(v) for k, v in runs.items()},
                    "comparison": comparison_rows(runs, methods),
                },
            )
    payload = json.loads(path.read_text())
    payload["complete"] = True
    _dump(path, payload)
    print(json.dumps(payload["comparison"], indent=2, default=str)[:6000], flush=True)
    return all(r.get("ok") for r in runs.values())


def engine_kwargs(args: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    """The ``LLM(...)`` settings every phase shares (eager, 128 sequences, 2048-token
    context, seed 0), with the phase's ``overrides``."""
    return {
        "enforce_eager": True,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_model_len": 2048,
        "seed": 0,
        "max_num_seqs": 128,
        **overrides,
    }


def phase_agreement(args: argparse.Namespace, out: Path) -> bool:
    """Real weights; no speculation vs n-gram, for bf16 and the kvarn presets (item 2/4)."""
    base = engine_kwargs(args, enforce_eager=not args.graphs)
    prompts = pad_prompts(make_repetitive_prompts(args.num_prompts), args.pad_words)
    model = smoke_model(args)
    methods = tuple(args.methods)
    warm = warmup_prompts(args.warmup_prompts, args.pad_words)
    return _phase(
        args, out, "agreement", model, methods, None, base, prompts, args.max_tokens, warmup=warm
    )


def phase_dummy(args: argparse.Namespace, out: Path) -> bool:
    """Dummy weights; no speculation vs a dummy one-layer EAGLE draft (kvarn serves EAGLE)."""
    model = smoke_model(args)
    draft = eagle_draft_dir(model, out / "eagle-draft")
    base = engine_kwargs(args, load_format="dummy")
    prompts = make_repetitive_prompts(args.num_prompts)
    return _phase(args, out, "dummy", model, ("eagle",), draft, base, prompts, args.max_tokens)


def _stress(
    args: argparse.Namespace,
    out: Path,
    phase: str,
    model: Path,
    method: str,
    draft: Path | None,
    baseline: bool,
) -> bool:
    """Dummy target + dummy ``draft`` (None: the target drafts, MTP), CUDA graphs, prefix
    caching, thousands of steps, every sampled token's logprob checked finite."""
    # Few concurrent sequences and long outputs: many steps, requests finishing and starting
    # in reused request rows, prefix hits on the shared prompt starts.
    base = engine_kwargs(
        args,
        enforce_eager=False,
        enable_prefix_caching=True,
        load_format="dummy",
        max_num_seqs=16,
    )
    prompts = make_repetitive_prompts(args.stress_prompts)
    # Steps >= stress_prompts / max_num_seqs * stress_tokens / (1 + accepted per step).
    return _phase(
        args,
        out,
        phase,
        model,
        (method,),
        draft,
        base,
        prompts,
        args.stress_tokens,
        logprobs=True,
        with_baseline=baseline,
        warmup=warmup_prompts(args.warmup_prompts, 0),
    )


def phase_stress(args: argparse.Namespace, out: Path) -> bool:
    """Dummy target + dummy EAGLE draft, CUDA graphs, prefix caching, thousands of steps."""
    model = smoke_model(args)
    draft = eagle_draft_dir(model, out / "eagle-draft")
    return _stress(args, out, "stress", model, "eagle", draft, baseline=False)


def phase_repeat(args: argparse.Namespace, out: Path) -> bool:
    """Real weights, CUDA graphs (eager with ``--eager``); no speculation vs the
    repeat-last-token EAGLE draft."""
    model = smoke_model(args)
    draft = repeat_draft_dir(model, out / "repeat-draft")
    base = engine_kwargs(args, enforce_eager=args.eager)
    prompts = pad_prompts(make_echo_prompts(args.num_prompts), args.pad_words)
    warm = warmup_prompts(args.warmup_prompts, args.pad_words)
    return _phase(
        args, out, "repeat", model, ("eagle",), draft, base, prompts, args.max_tokens, warmup=warm
    )


def phase_dflash(args: argparse.Namespace, out: Path) -> bool:
    """Dummy target + dummy DFlash drafter (non-causal blocks of ``1 + k`` drafts, the
    drafter's context stored with the target step's plan), CUDA graphs, prefix caching, many
    steps: every logprob finite, nothing crashed; beside no speculation for agreement."""
    model = smoke_model(args)
    draft = dflash_draft_dir(model, out / "dflash-draft")
    return _stress(args, out, "dflash", model, "dflash", draft, baseline=True)


def phase_eagle3(args: argparse.Namespace, out: Path) -> bool:
    """Dummy target + dummy one-layer EAGLE-3 draft (:func:`eagle3_draft_dir`), otherwise as
    ``dflash``: finite logprobs, no crash, greedy agreement with no speculation."""
    model = smoke_model(args)
    draft = eagle3_draft_dir(model, out / "eagle3-draft")
    return _stress(args, out, "eagle3", model, "eagle3", draft, baseline=True)


def phase_mtp(args: argparse.Namespace, out: Path) -> bool:
    """Dummy MiMo target of SmolLM2's shape drafting with its own MTP layer (method ``mtp``,
    vLLM's V2 runner), CUDA graphs, prefix caching, ``--stress-prompts`` x
    ``--stress-tokens``: finite logprobs, no crash, greedy agreement with no speculation."""
    model = mtp_model_dir(smoke_model(args), out / "mtp-target")
    return _stress(args, out, "mtp", model, "mtp", None, baseline=True)


PHASES = {
    "agreement": phase_agreement,
    "dummy": phase_dummy,
    "stress": phase_stress,
    "repeat": phase_repeat,
    "dflash": phase_dflash,
    "eagle3": phase_eagle3,
    "mtp": phase_mtp,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phase", choices=sorted(PHASES), default="agreement")
    p.add_argument("--out", default="e2e-spec-out")
    p.add_argument("--model", default=None, help="Hugging Face model folder (SmolLM2-135M)")
    p.add_argument("--gguf", default=None)
    p.add_argument("--converted-dir", default="/tmp/smollm2-hf")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-spec", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--stress-prompts", type=int, default=128)
    p.add_argument("--stress-tokens", type=int, default=512)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--run-timeout", type=float, default=150.0, help="seconds per engine")
    p.add_argument(
        "--pad-words",
        type=int,
        default=240,
        help="agreement and repeat phases: words of per-prompt notes before each prompt "
        "(240: about 580 SmolLM2 tokens, so generation reads quantized tiles; 0: the bare "
        "prompts, which fit in the exact first tile)",
    )
    p.add_argument(
        "--warmup-prompts",
        type=int,
        default=16,
        help="every phase but dummy: prompts each engine generates 16 tokens for before "
        "the timed run, in two waves so that steps mix prefill and decode, so that kernels "
        "compiled on first use compile outside it (their drafts are left out of the "
        "acceptance counts; 0: none)",
    )
    p.add_argument(
        "--graphs",
        action="store_true",
        help="agreement phase: CUDA graphs (vLLM's default) instead of eager engines, so that "
        "tokens/s measure the GPU rather than the host (engines then take 90-200 s to start)",
    )
    p.add_argument(
        "--eager",
        action="store_true",
        help="repeat phase: eager engines instead of CUDA graphs (about 30 s to start instead "
        "of 90-200; agreement and acceptance are the same measurement, tokens/s then include "
        "eager host overhead)",
    )
    p.add_argument(
        "--dtypes",
        nargs="+",
        default=list(DTYPES),
        choices=list(_ALL_DTYPES),
        help="KV cache dtypes to run (default: bf16 and the two g128 4-bit-key kvarn presets; "
        "every other kvarn preset and fp8 on request)",
    )
    p.add_argument(
        "--methods",
        nargs="+",
        default=["ngram"],
        choices=list(NGRAM_METHODS),
        help="agreement phase: the n-gram proposers to compare with no speculation (ngram: "
        "drafts on the host, synchronous scheduling; ngram_gpu: drafts on the GPU, async "
        "scheduling)",
    )
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="profile this many engine steps of each timed run with vLLM's torch profiler "
        "(0: off); the table of operations by time goes into each run's result",
    )
    p.add_argument(
        "--profile-skip",
        type=int,
        default=50,
        metavar="STEPS",
        help="engine steps of the timed run before profiling starts (past the first prefills)",
    )
    p.add_argument("--internal-run", default=None, help=argparse.SUPPRESS)
    p.add_argument("--internal-result", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.internal_run:
        spec = json.loads(Path(args.internal_run).read_text())
        result = run_engine(spec)
        Path(args.internal_result).write_text(json.dumps(result, default=str))
        return 0 if result["ok"] else 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ok = PHASES[args.phase](args, out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
