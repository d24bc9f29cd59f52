#!/usr/bin/env python3
"""GPU check of kvarn-vllm's saturation counters (issue 50) in a real vLLM engine.

SmolLM2-135M (converted from its GGUF as ``e2e_smoke.py`` does) with one layer's key projection
multiplied by ``2^--shift`` (exact in bf16), so that layer's keys pass what a record holds
(about 5.4e8) and the store saturates their tiles. The engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with ``kvarn_k4v2_g128`` and CUDA graphs, the counters
polled at every step (``interval`` 0), and greedy generation over prompts long enough to
complete tiles. It checks that the warning came from the poll during serving, named that layer
and only it, and that the exit read (``report_now``) gives its count; ``--shift 0`` is the
control (no warning). Writes ``overflow.json`` under ``--out``; exit status 1 on a failed check.

    python3 packages/kvarn-eval/scripts/overflow_smoke.py --out $OUT/overflow
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def hot_model(base: Path, out: Path, layer: int, shift: int) -> Path:
    """A copy of the HF folder ``base`` whose layer ``layer`` key projection is scaled by
    ``2^shift``."""
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    for f in base.glob("*.safetensors"):
        weights = load_file(str(f))
        for name in list(weights):
            if f"layers.{layer}.self_attn.k_proj." in name:
                weights[name] = (weights[name].float() * 2.0**shift).to(weights[name].dtype)
                assert torch.isfinite(weights[name]).all(), name
        save_file(weights, str(out / f.name), metadata={"format": "pt"})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--gguf", default=str(Path(os.environ.get("KVARN_GPU_FILES", ".")) / GGUF_NAME))
    p.add_argument("--converted-dir", default="/tmp/smollm2-hf")
    p.add_argument("--layer", type=int, default=12)
    p.add_argument("--shift", type=int, default=36, help="keys times 2^shift (0: control)")
    args = p.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine's logs and counters here
    spec = importlib.util.spec_from_file_location(
        "e2e_smoke", Path(__file__).with_name("e2e_smoke.py")
    )
    assert spec and spec.loader
    e2e = importlib.util.module_from_spec(spec)
    sys.modules["e2e_smoke"] = e2e
    spec.loader.exec_module(e2e)
    base = e2e.convert_gguf(Path(args.gguf), Path(args.converted_dir))
    model = hot_model(
        base, Path(f"/tmp/smollm2-hot-{args.layer}-{args.shift}"), args.layer, args.shift
    )

    from kvarn_vllm import overflow
    from vllm import LLM, SamplingParams

    overflow.COUNTERS.interval = 0.0  # poll at every step
    warnings = _Warnings()
    logging.getLogger("vllm.kvarn").addHandler(warnings)
    llm = LLM(
        model=str(model), kv_cache_dtype="kvarn_k4v2_g128", gpu_memory_utilization=0.3,
        max_model_len=2048, max_num_seqs=8, seed=0,
    )  # fmt: skip
    prompts = [e2e.SHARED_PREAMBLE * 2 + f" Question {i}:" for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # polls once more
    during = list(warnings.messages)
    counts = overflow.COUNTERS.report_now()
    name = f"model.layers.{args.layer}.self_attn.attn"
    result = {
        "layer": name,
        "shift": args.shift,
        "prompt_tokens": [len(o.prompt_token_ids or []) for o in outs],
        "warnings_during_serving": during,
        "warnings_total": len(warnings.messages),
        "counts_at_exit": counts,
        "sample": outs[0].outputs[0].text[:200],
    }
    if args.shift:
        ok = any(name + ":" in w for w in during) and set(counts) == {name} and counts[name] > 0
    else:
        ok = not warnings.messages and not counts
    result["passed"] = ok
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"overflow_shift{args.shift}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
