"""The GPU end-to-end script for speculative decoding, checked on CPU (no engine started)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "e2e_spec.py"


@pytest.fixture(scope="module")
def spec_script():
    sys.path.insert(0, str(SCRIPT.parent))
    loader = importlib.util.spec_from_file_location("e2e_spec", SCRIPT)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return module


def test_prompts_repeat_with_variation(spec_script):
    prompts = spec_script.make_repetitive_prompts(120)
    assert len(set(prompts)) == 120
    first = prompts[0]
    assert first.count("Day ") >= 5 and first.split(": ")[1].split(" ")[0] == "the"
    with pytest.raises(ValueError):
        spec_script.make_repetitive_prompts(0)


def test_speculative_config_keys_exist_in_vllm(spec_script):
    from vllm.config.speculative import SpeculativeConfig

    fields = set(SpeculativeConfig.__dataclass_fields__)
    for method in ("ngram", "ngram_gpu", "eagle", "dflash"):
        cfg = spec_script.speculative_config(method, 4, "/draft")
        assert set(cfg) <= fields, set(cfg) - fields
        assert cfg["num_speculative_tokens"] == 4
    assert spec_script.speculative_config("none", 4, None) is None
    with pytest.raises(ValueError):
        spec_script.speculative_config("eagle", 4, None)


def test_engine_kwargs_exist_in_vllm(spec_script):
    from vllm.engine.arg_utils import EngineArgs

    fields = set(EngineArgs.__dataclass_fields__)
    for name in (
        "enforce_eager",
        "enable_prefix_caching",
        "load_format",
        "gpu_memory_utilization",
        "max_model_len",
        "seed",
        "max_num_seqs",
        "kv_cache_dtype",
        "speculative_config",
        "disable_log_stats",
    ):
        assert name in fields, name


def test_engine_kwargs_per_phase(spec_script):
    args = spec_script.parse_args(["--gpu-memory-utilization", "0.2"])
    base = spec_script.engine_kwargs(args)
    assert base == {
        "enforce_eager": True,
        "gpu_memory_utilization": 0.2,
        "max_model_len": 2048,
        "seed": 0,
        "max_num_seqs": 128,
    }
    stress = spec_script.engine_kwargs(args, enforce_eager=False, max_num_seqs=16)
    assert stress["enforce_eager"] is False and stress["max_num_seqs"] == 16
    assert stress["seed"] == 0


def test_spec_counters(spec_script):
    metrics = [
        SimpleNamespace(name="vllm:spec_decode_num_drafts", value=10),
        SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", value=40),
        SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=10),
        SimpleNamespace(name="vllm:num_requests_running", value=3),
    ]
    got = spec_script.spec_counters(metrics)
    assert got["acceptance_rate"] == 0.25 and got["mean_accepted_per_draft"] == 1.0
    assert "requests_running" not in "".join(got)
    # The warm-up's drafts are left out: counts since an earlier reading, rates from those.
    warm = {"num_drafts": 2.0, "num_draft_tokens": 8.0, "num_accepted_tokens": 6.0,
            "acceptance_rate": 0.75}  # fmt: skip
    since = spec_script.spec_counters(metrics, since=warm)
    assert (since["num_drafts"], since["num_draft_tokens"], since["num_accepted_tokens"]) == (
        8.0, 32.0, 4.0,
    )  # fmt: skip
    assert since["acceptance_rate"] == 0.125 and since["mean_accepted_per_draft"] == 0.5


def test_comparison_rows_and_failures(spec_script):
    runs = {
        "auto/none": {"ok": True, "outputs": [[1, 2, 3]], "tokens_per_second": 10.0},
        "auto/ngram": {
            "ok": True,
            "outputs": [[1, 2, 4]],
            "tokens_per_second": 20.0,
            "spec_decode": {"acceptance_rate": 0.5},
        },
        "kvarn_k4v2_g128/none": {"ok": True, "outputs": [[1, 2, 3]]},
        "kvarn_k4v2_g128/ngram": {"ok": False, "error": "ValueError: refused\nmore"},
    }
    rows = spec_script.comparison_rows(runs, ("ngram",))
    assert rows["auto/ngram"]["agreement_with_no_spec"]["exact_match"] == 0.0
    assert rows["auto/ngram"]["spec_decode"]["acceptance_rate"] == 0.5
    assert rows["kvarn_k4v2_g128/ngram"] == {"ok": False, "error": ["ValueError: refused"]}


def smollm2_target(folder, **extra):
    """A folder with SmolLM2-135M's config (a Llama model), plus ``extra`` keys."""
    folder.mkdir(exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "torch_dtype": "bfloat16", **extra,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_eagle_draft_dir(spec_script, tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 30, "x": 1}))
    draft = spec_script.eagle_draft_dir(model, tmp_path / "d")
    assert json.loads((draft / "config.json").read_text()) == {"num_hidden_layers": 1, "x": 1}


def test_dflash_draft_dir_is_a_non_causal_dflash_drafter_for_vllm(spec_script, tmp_path):
    """vLLM 0.26 reads the drafter config as its Qwen3 DFlash drafter, non-causal, for a
    SmolLM2-shaped (Llama) target: what the dflash phase runs on the GPU."""
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig
    from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal
    from vllm.model_executor.models.registry import ModelRegistry

    model = smollm2_target(tmp_path / "target")
    draft = spec_script.dflash_draft_dir(model, tmp_path / "draft")
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg["head_dim"] == 64 and cfg["num_key_value_heads"] == 3
    assert cfg["dflash_config"] == {"mask_token_id": 49151, "target_layer_ids": [1, 15, 28]}
    mc = ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="bfloat16")
    sc = SpeculativeConfig(
        target_model_config=mc, target_parallel_config=ParallelConfig(), method="dflash",
        model=str(draft), num_speculative_tokens=4,
    )  # fmt: skip
    dm = sc.draft_model_config
    assert sc.method == "dflash" and dflash_has_any_non_causal(dm.hf_config)
    cls = ModelRegistry.resolve_model_cls(dm.architectures, dm)[0]
    assert cls.__name__ == "DFlashQwen3ForCausalLM"


def test_eagle3_draft_dir_is_an_eagle3_drafter_for_vllm(spec_script, tmp_path):
    """vLLM 0.26 reads the one-layer draft as its Llama EAGLE-3 drafter over a SmolLM2-shaped
    target that can hand it auxiliary hidden states: what the eagle3 phase runs."""
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.model_executor.models.registry import ModelRegistry

    model = smollm2_target(tmp_path / "target")
    draft = spec_script.eagle3_draft_dir(model, tmp_path / "draft")
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    mc = ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="bfloat16")
    assert supports_eagle3(ModelRegistry.resolve_model_cls(mc.architectures, mc)[0])
    sc = SpeculativeConfig(
        target_model_config=mc, target_parallel_config=ParallelConfig(),
        **spec_script.speculative_config("eagle3", 4, str(draft)),
    )  # fmt: skip
    dm = sc.draft_model_config
    assert sc.method == "eagle3"
    cls = ModelRegistry.resolve_model_cls(dm.architectures, dm)[0]
    assert cls.__name__ == "Eagle3LlamaForCausalLM"


def test_mtp_model_dir_is_a_mimo_target_whose_mtp_layer_vllm_drafts_with(spec_script, tmp_path):
    """vLLM 0.26 reads the MiMo config (Qwen2 layers, one MTP layer) of SmolLM2's shape as a
    MiMo target and, for method ``mtp``, drafts with its ``MiMoMTPModel``: what the mtp phase
    runs on the GPU; the tokenizer files come along, the weights do not."""
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig
    from vllm.model_executor.models.registry import ModelRegistry

    model = smollm2_target(tmp_path / "target", head_dim=64, eos_token_id=2)
    (model / "tokenizer.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"x")
    mtp = spec_script.mtp_model_dir(model, tmp_path / "mtp")
    assert sorted(p.name for p in mtp.iterdir()) == ["config.json", "tokenizer.json"]
    mc = ModelConfig(model=str(mtp), skip_tokenizer_init=True, dtype="bfloat16")
    assert ModelRegistry.resolve_model_cls(mc.architectures, mc)[0].__name__ == "MiMoForCausalLM"
    assert mc.get_num_kv_heads(ParallelConfig()) == 3 and mc.get_head_size() == 64
    sc = SpeculativeConfig(
        target_model_config=mc, target_parallel_config=ParallelConfig(),
        **spec_script.speculative_config("mtp", 4, None),
    )  # fmt: skip
    dm = sc.draft_model_config
    assert sc.method == "mtp" and sc.num_speculative_tokens == 4
    assert dm.hf_config.n_predict == 1
    assert ModelRegistry.resolve_model_cls(dm.architectures, dm)[0].__name__ == "MiMoMTP"
    smollm2_target(model, head_dim=128)
    with pytest.raises(ValueError, match="head_dim"):
        spec_script.mtp_model_dir(model, tmp_path / "mtp2")


def stress_phase_call(spec_script, monkeypatch, tmp_path, phase, folder_fn, folder, prompts):
    """Run ``phase`` with the model and ``folder_fn`` (the draft's or target's folder
    builder, returning ``folder``) stubbed and ``_phase`` recorded: its ``(args, kwargs)``."""
    seen = []
    monkeypatch.setattr(spec_script, "smoke_model", lambda args: tmp_path)
    monkeypatch.setattr(spec_script, folder_fn, lambda model, out: folder)
    monkeypatch.setattr(spec_script, "_phase", lambda *a, **kw: seen.append((a, kw)) or True)
    args = spec_script.parse_args(["--phase", phase, "--stress-prompts", str(prompts)])
    assert spec_script.PHASES[phase](args, tmp_path)
    ((a, kw),) = seen
    return a, kw


def test_stress_phase_warms_up_and_runs_no_baseline(spec_script, monkeypatch, tmp_path):
    """The EAGLE stress phase: speculation only, each engine warmed up first (16 prompts of
    their own, so first-use compilations stay out of its tokens/s)."""
    a, kw = stress_phase_call(
        spec_script, monkeypatch, tmp_path, "stress", "eagle_draft_dir", tmp_path / "d", 4
    )
    assert a[2:6] == ("stress", tmp_path, ("eagle",), tmp_path / "d")
    warm = kw.pop("warmup")
    assert kw == {"logprobs": True, "with_baseline": False}
    assert len(warm) == 16 and all(w.startswith("Warm-up notes ") for w in warm)
    assert not set(warm) & set(a[7])  # no measured prompt among them


def test_eagle3_phase_runs_a_baseline(spec_script, monkeypatch, tmp_path):
    a, kw = stress_phase_call(
        spec_script, monkeypatch, tmp_path, "eagle3", "eagle3_draft_dir", tmp_path / "d", 4
    )
    assert a[2:6] == ("eagle3", tmp_path, ("eagle3",), tmp_path / "d")
    assert kw == {
        "logprobs": True,
        "with_baseline": True,
        "warmup": spec_script.warmup_prompts(16, 0),
    }


def test_mtp_phase_drafts_with_the_target(spec_script, monkeypatch, tmp_path):
    a, kw = stress_phase_call(
        spec_script, monkeypatch, tmp_path, "mtp", "mtp_model_dir", tmp_path / "mtp", 4
    )
    assert a[2:6] == ("mtp", tmp_path / "mtp", ("mtp",), None)
    assert a[6]["enforce_eager"] is False and a[6]["load_format"] == "dummy"
    assert kw == {
        "logprobs": True,
        "with_baseline": True,
        "warmup": spec_script.warmup_prompts(16, 0),
    }


def test_parse_args(spec_script):
    assert spec_script.parse_args(["--phase", "dflash"]).phase == "dflash"
    args = spec_script.parse_args(["--phase", "stress", "--out", "x"])
    assert args.phase == "stress" and args.num_spec == 4 and args.run_timeout == 150.0
    assert args.warmup_prompts == 16
    assert spec_script.parse_args(["--warmup-prompts", "0"]).warmup_prompts == 0
    assert tuple(args.dtypes) == spec_script.DTYPES
    only = spec_script.parse_args(["--phase", "stress", "--dtypes", "kvarn_k4v2_g128"])
    assert only.dtypes == ["kvarn_k4v2_g128"]
    from kvarn_math import PRESETS  # every preset on request (the twenty-fifth H200 run's
    # stress call stopped at argparse for kvarn_k2v2_g128 and kvarn_k4v2_g64)

    every = spec_script.parse_args(["--phase", "stress", "--dtypes", *PRESETS])
    assert every.dtypes == list(PRESETS)
    with pytest.raises(SystemExit):
        spec_script.parse_args(["--dtypes", "kvarn_bogus"])
    both = spec_script.parse_args(["--methods", "ngram", "ngram_gpu", "--dtypes", "fp8"])
    assert both.methods == ["ngram", "ngram_gpu"] and both.dtypes == ["fp8"]
    with pytest.raises(SystemExit):
        spec_script.parse_args(["--methods", "eagle"])


def test_repeat_phase_graphs_unless_eager(spec_script, monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(spec_script, "smoke_model", lambda args: tmp_path)
    monkeypatch.setattr(spec_script, "repeat_draft_dir", lambda model, out: tmp_path / "d")
    monkeypatch.setattr(spec_script, "_phase", lambda *a, **kw: seen.append(a[6]) or True)
    for argv, eager in (([], False), (["--eager"], True)):
        args = spec_script.parse_args(["--phase", "repeat", "--num-prompts", "4", *argv])
        assert spec_script.phase_repeat(args, tmp_path)
        assert seen[-1]["enforce_eager"] is eager


def test_dflash_phase_runs_graphs_prefix_caching_and_a_baseline(spec_script, monkeypatch, tmp_path):
    a, kw = stress_phase_call(
        spec_script, monkeypatch, tmp_path, "dflash", "dflash_draft_dir", tmp_path / "d", 8
    )
    assert a[2:6] == ("dflash", tmp_path, ("dflash",), tmp_path / "d")
    assert a[6]["enforce_eager"] is False and a[6]["enable_prefix_caching"] is True
    assert a[6]["load_format"] == "dummy" and len(a[7]) == 8
    assert kw == {
        "logprobs": True,
        "with_baseline": True,
        "warmup": spec_script.warmup_prompts(16, 0),
    }  # and no speculation


def test_agreement_phase_eager_unless_graphs_and_reads_tiles(spec_script, monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(spec_script, "smoke_model", lambda args: tmp_path)
    monkeypatch.setattr(
        spec_script, "_phase", lambda *a, **kw: seen.append((a[4], a[6], a[7], kw)) or True
    )
    for argv, eager in (([], True), (["--graphs"], False)):
        args = spec_script.parse_args(["--phase", "agreement", "--num-prompts", "4", *argv])
        assert spec_script.phase_agreement(args, tmp_path)
        methods, kwargs, prompts, kw = seen[-1]
        assert methods == ("ngram",)
        assert kw["warmup"] == spec_script.warmup_prompts(16, 240)
        assert kwargs["enforce_eager"] is eager
        # each prompt behind its own notes: decoding reads quantized tiles, not only tile 0
        assert all(p.startswith(f"Notes {i}: ") for i, p in enumerate(prompts))
        assert min(len(p.split()) for p in prompts) > 240


def test_pad_prompts_keep_prompts_distinct_and_long(spec_script):
    prompts = spec_script.make_echo_prompts(6)
    padded = spec_script.pad_prompts(prompts, 240)
    assert [p.split("\n\n", 1)[1] for p in padded] == prompts
    assert all(len(p.split()) > 240 for p in padded)
    notes = [p.split("\n\n", 1)[0] for p in padded]
    assert len({n[:40] for n in notes}) == 6  # no shared first block
    assert spec_script.pad_prompts(prompts, 0) == prompts
    with pytest.raises(ValueError):
        spec_script.pad_prompts(prompts, -1)


def test_warmup_prompts_share_no_block_with_the_measured_ones(spec_script):
    measured = spec_script.pad_prompts(spec_script.make_repetitive_prompts(100), 240)
    warm = spec_script.warmup_prompts(8, 240)
    assert len(warm) == 8 and len(set(warm)) == 8
    # notes of 1/8 to all of the measured prompts' notes: prefill chunks of several sizes
    notes = [w.split("\n\n", 1)[0].split(": ", 1)[1] for w in warm]
    lengths = [len(n.split()) for n in notes]
    assert lengths == sorted(set(lengths))
    assert lengths[-1] == len(measured[7].split("\n\n", 1)[0].split(": ", 1)[1].split())
    assert all(w.startswith("Warm-up notes ") for w in warm)
    assert not any(m.startswith("Warm-up") for m in measured)
    assert spec_script.warmup_prompts(0, 240) == []
    with pytest.raises(ValueError):
        spec_script.warmup_prompts(-1, 240)


class _FakeEngine:
    """vLLM's LLMEngine as warm_up uses it: requests finish after ``steps`` steps."""

    def __init__(self, steps=3, fail_at=None):
        self.steps, self.fail_at, self.now = steps, fail_at, 0
        self.live, self.log, self.aborted = {}, [], []

    def add_request(self, rid, prompt, params):
        self.live[rid] = self.now + self.steps
        self.log.append(("add", rid, self.now))

    def step(self):
        self.now += 1
        if self.now == self.fail_at:
            raise RuntimeError("boom")
        self.log.append(("step", sorted(self.live), self.now))
        self.live = {r: end for r, end in self.live.items() if end > self.now}

    def has_unfinished_requests(self):
        return bool(self.live)

    def abort_request(self, ids):
        self.aborted = list(ids)
        self.live = {}


def test_warm_up_mixes_arrivals_and_drains(spec_script):
    engine = _FakeEngine(steps=4)
    assert spec_script.warm_up(engine, ["a", "b", "c", "d", "e"], None) is None
    adds = {rid: t for kind, rid, t in engine.log if kind == "add"}
    assert [adds[f"warmup-{i}"] for i in range(5)] == [0, 0, 0, 2, 2]
    # steps after the second wave hold requests of both waves (prefill beside decode)
    mixed = [live for kind, live, t in engine.log if kind == "step" and t == 3]
    assert mixed and {"warmup-0", "warmup-4"} <= set(mixed[0])
    assert not engine.has_unfinished_requests()


def test_warm_up_reports_an_error_and_aborts(spec_script):
    engine = _FakeEngine(steps=50, fail_at=4)
    err = spec_script.warm_up(engine, ["a", "b"], None)
    assert err == "RuntimeError: boom"
    assert engine.aborted == ["warmup-0", "warmup-1"] and not engine.live
    stuck = _FakeEngine(steps=10**9)
    assert "unfinished after 5 steps" in spec_script.warm_up(stuck, ["a"], None, max_steps=5)
    assert stuck.aborted == ["warmup-0"]


def test_echo_prompts_alternate(spec_script):
    prompts = spec_script.make_echo_prompts(10)
    assert len(set(prompts)) == 10
    assert prompts[0].startswith("Write the word 'yes'") and prompts[0].endswith("yes yes yes")
    assert prompts[1] == spec_script.make_repetitive_prompts(10)[1]
    with pytest.raises(ValueError):
        spec_script.make_echo_prompts(0)


def test_repeat_draft_dir_returns_the_target_hidden_state(spec_script, tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "target")
    draft = spec_script.repeat_draft_dir(tmp_path / "target", tmp_path / "draft")
    from safetensors.torch import load_file

    w = load_file(str(draft / "model.safetensors"))
    assert json.loads((draft / "config.json").read_text())["num_hidden_layers"] == 1
    assert not any("lm_head" in k or "embed_tokens" in k or "input_layernorm" in k for k in w)
    target = load_file(str(tmp_path / "target" / "model.safetensors"))
    assert torch.equal(
        w["layers.0.self_attn.q_proj.weight"], target["model.layers.0.self_attn.q_proj.weight"]
    )
    assert not w["layers.0.self_attn.o_proj.weight"].any()
    assert not w["layers.0.mlp.down_proj.weight"].any()
    # fc([embed, h]) = h, and the zeroed output projections add nothing: the draft's hidden
    # state is the target's, whatever the embedding and the attention/MLP inputs are.
    emb, h = torch.randn(5, 32), torch.randn(5, 32)
    fc = w["fc.weight"].float()
    assert torch.allclose(torch.cat([emb, h], -1) @ fc.T, h)
    x = torch.randn(5, 32)
    assert not (x @ w["layers.0.self_attn.o_proj.weight"].float().T).any()
    assert not (torch.randn(5, 48) @ w["layers.0.mlp.down_proj.weight"].float().T).any()

    biased = json.loads((tmp_path / "target" / "config.json").read_text())
    biased["attention_bias"] = True
    (tmp_path / "target" / "config.json").write_text(json.dumps(biased))
    with pytest.raises(ValueError, match="biased projections"):
        spec_script.repeat_draft_dir(tmp_path / "target", tmp_path / "draft2")


def test_captured_graphs_are_read_from_the_progress_bars(spec_script):
    """vLLM's capture progress bars (carriage returns between updates, as a terminal-less run
    writes them) give the graphs an engine really captured: a half-done bar is not counted."""
    log = (
        "INFO start\n"
        "Capturing CUDA graphs (PIECEWISE):   0%|          | 0/23 [00:00<?, ?it/s]\r"
        "Capturing CUDA graphs (PIECEWISE): 100%|##########| 23/23 [00:00<00:00, 30.84it/s]\n"
        "Capturing CUDA graphs (FULL):  60%|######    | 3/5 [00:00<00:00, 11.27it/s]\r"
        "Capturing CUDA graphs (FULL): 100%|##########| 5/5 [00:00<00:00, 12.09it/s]\n"
        "Capturing CUDA graphs (FULL): 100%|##########| 5/5 [00:00<00:00, 11.67it/s]\n"
    )
    assert spec_script.captured_graphs(log) == {"PIECEWISE": 23, "FULL": 5}
    cut = "Capturing CUDA graphs (FULL):  20%|##        | 1/5 [00:00<00:00,  8.63it/s]\n"
    assert spec_script.captured_graphs(cut) == {}
    assert spec_script.captured_graphs("no graphs, eager\n") == {}
    # vLLM's V1 runner (n-gram) names the batch kind before the mode.
    v1 = (
        "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|###| 35/35 [00:01]\n"
        "Capturing CUDA graphs (decode, FULL):  50%|#  | 24/48 [00:01<00:01, 14.0it/s]\r"
        "Capturing CUDA graphs (decode, FULL): 100%|###| 48/48 [00:03<00:00, 13.9it/s]\n"
    )
    assert spec_script.captured_graphs(v1) == {"PIECEWISE": 35, "FULL": 48}


def test_profile_option_configures_vllms_profiler(spec_script, monkeypatch, tmp_path):
    """``--profile N``: each engine gets a ProfilerConfig vLLM accepts (N steps after
    ``--profile-skip``, into a folder of its own) and the run is told where the table lands;
    without it, no profiler."""
    from vllm.config import ProfilerConfig

    seen = []
    monkeypatch.setattr(
        spec_script, "run_isolated_engine", lambda spec, workdir, timeout: seen.append(spec) or {}
    )
    argv = ["--phase", "dummy", "--dtypes", "kvarn_k4v2_g128", "--num-prompts", "2"]
    args = spec_script.parse_args([*argv, "--profile", "20", "--profile-skip", "7"])
    spec_script._phase(args, tmp_path, "dummy", tmp_path, ("eagle",), tmp_path, {}, ["a"], 4)
    assert [s["name"] for s in seen] == [
        "dummy:kvarn_k4v2_g128/none",
        "dummy:kvarn_k4v2_g128/eagle",
    ]
    dirs = {s["profile_dir"] for s in seen}
    assert len(dirs) == 2 and all(d.startswith(str(tmp_path.resolve())) for d in dirs)
    for s in seen:
        cfg = ProfilerConfig(**s["llm_kwargs"]["profiler_config"])
        assert (cfg.profiler, cfg.max_iterations, cfg.delay_iterations) == ("torch", 20, 7)
        assert cfg.torch_profiler_dir == s["profile_dir"]
    seen.clear()
    spec_script._phase(spec_script.parse_args(argv), tmp_path, "dummy", tmp_path, ("eagle",),
                       tmp_path, {}, ["a"], 4)  # fmt: skip
    assert all("profile_dir" not in s and "profiler_config" not in s["llm_kwargs"] for s in seen)


def test_read_profile_keeps_the_table_and_drops_the_traces(spec_script, tmp_path):
    (tmp_path / "profiler_out_0.txt").write_text("Name  Self CUDA\nfoo   1.0ms\n")
    (tmp_path / "rank0.pt.trace.json.gz").write_bytes(b"x" * 100)
    assert spec_script.read_profile(tmp_path).startswith("Name  Self CUDA")
    assert [p.name for p in tmp_path.iterdir()] == ["profiler_out_0.txt"]
    assert "no profiler_out_0.txt" in spec_script.read_profile(tmp_path / "missing")
