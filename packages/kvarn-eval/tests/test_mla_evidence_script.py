"""scripts/mla_evidence.py on CPU: the dry-run plan, the model shapes vLLM reads, the report."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "mla_evidence.py"


@pytest.fixture(scope="module")
def mla_evidence():
    spec = importlib.util.spec_from_file_location("mla_evidence", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_prints_the_plan_without_vllm(tmp_path):
    """The dry run writes the plan and the model configs and never imports vLLM."""
    code = (
        "import runpy, sys\n"
        "sys.argv = ['mla_evidence.py', '--dry-run', '--out', sys.argv[1]]\n"
        "try:\n"
        f"    runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
        "except SystemExit as exc:\n"
        "    assert not exc.code, exc.code\n"
        "print('VLLM_IMPORTED', 'vllm' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "VLLM_IMPORTED False" in done.stdout
    assert "18 engines" in done.stdout
    jobs = json.loads((tmp_path / "plan.json").read_text())
    names = [j["name"] for j in jobs]
    for cache in (
        "auto",
        "fp8_ds_mla",
        "kvarn_k4v2_g128",
        "kvarn_mla_l2_g128",
        "kvarn_mla_l8_g128",
    ):
        assert f"capacity-deepseek-v2-lite-{cache}" in names
    assert "capacity-glm-4.7-flash-kvarn_k4v2_g128" in names
    modes = {(j["cache"], j["mode"]) for j in jobs if j["phase"] == "modes"}
    assert len(modes) == 6
    graphs = [j for j in jobs if j["phase"] == "modes" and j["mode"] == "graphs-prefix"]
    assert all(
        j["llm"]["compilation_config"]["cudagraph_mode"] == "FULL_DECODE_ONLY" for j in graphs
    )
    burst = [j for j in jobs if j["phase"] == "burst"]
    assert {j["cache"] for j in burst} == {"auto", "kvarn_mla_l4_g128"}
    assert all(j["burst"] == {"requests": 64, "prompt_len": 8192, "output_len": 256} for j in burst)
    for folder in ("deepseek-v2-lite", "deepseek-v2-lite-4l", "glm-4.7-flash"):
        assert (tmp_path / "models" / folder / "config.json").exists()


def test_shapes_are_mla_models_to_vllm(mla_evidence, tmp_path):
    """vLLM's own ModelConfig reads both configs as MLA models of the intended shapes."""
    from vllm.config import ModelConfig, ParallelConfig

    expected = {"deepseek-v2-lite": (27, 16), "glm-4.7-flash": (47, 20)}
    for shape, (layers, heads) in expected.items():
        folder = mla_evidence.write_model_dir(tmp_path, shape)
        config = ModelConfig(model=str(folder), skip_tokenizer_init=True, max_model_len=4096)
        assert config.use_mla and config.get_head_size() == 576, shape
        assert config.hf_text_config.kv_lora_rank == 512
        assert config.hf_text_config.num_hidden_layers == layers
        assert config.get_num_attention_heads(ParallelConfig()) == heads


def test_prompts_share_the_prefix_and_vary_in_length(mla_evidence):
    batch = mla_evidence.prompts(1000, 8, 260, 2, prefix=300)
    assert all(p[:300] == batch[0][:300] for p in batch)
    assert len({len(p) for p in batch}) > 4 and min(map(len, batch)) > 300 + 260 * 2 // 3 - 1
    assert all(10 <= t < 1000 for p in batch for t in p)


def test_summary_and_markdown(mla_evidence):
    """Capacity against bf16 per shape, greedy equality against eager without prefix caching,
    and the burst ratio come from the results as given."""
    results = [
        {"phase": "capacity", "shape": "s", "cache": "auto", "capacity_tokens": 1000, "ok": True,
         "name": "a"},
        {"phase": "capacity", "shape": "s", "cache": "kvarn_mla_l4_g128", "capacity_tokens": 3400,
         "ok": True, "name": "k"},
        {"phase": "capacity", "shape": "s", "cache": "fp8_ds_mla", "ok": False, "name": "f",
         "error": "ValueError: no backend\ndetails"},
        {"phase": "modes", "cache": "kvarn_mla_l4_g128", "mode": "eager-noprefix", "ok": True,
         "outputs": [[1, 2], [3, 4]], "name": "m1"},
        {"phase": "modes", "cache": "kvarn_mla_l4_g128", "mode": "graphs-prefix", "ok": True,
         "outputs": [[1, 2], [3, 5]], "name": "m2"},
        {"phase": "burst", "cache": "auto", "ok": True, "name": "b1",
         "burst": {"output_tok_s": 100.0}},
        {"phase": "burst", "cache": "kvarn_mla_l4_g128", "ok": True, "name": "b2",
         "burst": {"output_tok_s": 90.0}},
    ]  # fmt: skip
    summary = mla_evidence.summarize(results)
    assert summary["capacity"]["s"]["kvarn_mla_l4_g128"]["vs_bf16"] == 3.4
    assert summary["capacity"]["s"]["fp8_ds_mla"]["tokens"] is None
    modes = summary["modes"]["kvarn_mla_l4_g128"]
    assert modes["eager-noprefix"]["equal"] and not modes["graphs-prefix"]["equal"]
    assert modes["graphs-prefix"]["agreement"] == 0.75
    assert summary["burst"]["kvarn_vs_bf16"] == 0.9
    text = mla_evidence.markdown(results, summary, {"gpu": "H100", "vllm": "0.26.0"})
    assert "| k | True |" in text and "3.4" in text and "ValueError: no backend |" in text


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter (CI sets it)"
)
def test_decode_check_runs_on_cpu():
    """The GPU phase's decode check, eager only, fp32 in Triton's interpreter at a tiny batch:
    the script's glue runs and kvarn's decode matches the fp32 reference over the records."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import mla_decode_check
    finally:
        sys.path.remove(str(SCRIPT.parent))
    import torch

    impl = mla_decode_check.make_impl(16, device="cpu")
    result = mla_decode_check.decode_case(
        impl, seed=0, device="cpu", dtype=torch.float32, batch=2, blocks=1
    )
    assert result["heads"] == 16 and result["eager_rel_err"] < 1e-4
    assert "graph_replay_rel_err" not in result
