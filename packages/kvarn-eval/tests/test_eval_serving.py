"""GPU suites on the CPU: caches, shapes, request planning, timings, the isolated runner (real
child processes), the worker against a stand-in vLLM, result tables and the CLI end to end."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kvarn_eval import cli
from kvarn_eval.fidelity import compare_outputs, longest_common_prefix, make_prompts
from kvarn_eval.serving import (
    Budget,
    EngineJob,
    ServingOptions,
    get_shape,
    parse_cache,
    parse_caches,
    parse_log,
    plan_requests,
    random_token_prompts,
    request_timing,
    run_job,
    summarize_burst,
    write_model_dir,
)
from kvarn_eval.serving.caches import DEFAULT_CACHES, TURBOQUANT_PRESETS, VLLM_CACHE_DTYPES
from kvarn_eval.serving.metrics import percentile
from kvarn_eval.serving.suites import (
    capacity_result,
    greedy_jobs,
    greedy_result,
    perplexity_jobs,
    perplexity_result,
    run_jobs,
    serving_jobs,
    throughput_result,
)

FAKE_VLLM = Path(__file__).resolve().parent / "fake_vllm"


# --- caches ------------------------------------------------------------------------------


def test_parse_cache() -> None:
    assert parse_cache("bf16@flash_attn") == parse_cache("auto@FLASH_ATTN")
    spec = parse_cache("bf16@TRITON_ATTN")
    assert (spec.label, spec.kv_cache_dtype, spec.backend) == (
        "bf16@TRITON_ATTN",
        "auto",
        "TRITON_ATTN",
    )
    assert spec.llm_kwargs() == {
        "kv_cache_dtype": "auto",
        "attention_config": {"backend": "TRITON_ATTN"},
    }
    kvarn = parse_cache("kvarn_k4v2_g128")
    assert kvarn.llm_kwargs() == {"kv_cache_dtype": "kvarn_k4v2_g128"} and kvarn.family == "kvarn"
    assert parse_cache("turboquant_4bit_nc").family == "turboquant"
    assert parse_cache("fp8").family == "fp8" and parse_cache("bf16").is_reference
    with pytest.raises(ValueError, match="unknown KV cache 'int3'"):
        parse_cache("int3")
    with pytest.raises(ValueError, match="unknown attention backend 'WARP'"):
        parse_cache("bf16@WARP")
    with pytest.raises(ValueError, match="chooses its own attention backend"):
        parse_cache("kvarn_k4v2_g128@TRITON_ATTN")
    with pytest.raises(ValueError, match="chooses its own attention backend"):
        parse_cache("turboquant_k8v4@FLASH_ATTN")


def test_parse_cache_kvarn_settings() -> None:
    spec = parse_cache("kvarn_k4v2_g128+recent0")
    assert spec.label == "kvarn_k4v2_g128+recent0" and spec.kv_cache_dtype == "kvarn_k4v2_g128"
    assert spec.env == (("KVARN_VLLM_RECENT_TILES", "0"),)
    assert spec.llm_kwargs() == {"kv_cache_dtype": "kvarn_k4v2_g128"}
    assert parse_cache("kvarn_k4v2_g128").env == ()
    with pytest.raises(ValueError, match="unknown kvarn setting 'recent9'"):
        parse_cache("kvarn_k4v2_g128+recent9")
    with pytest.raises(ValueError, match="only a kvarn preset takes a '\\+' setting"):
        parse_cache("fp8+recent0")
    rot = parse_cache("kvarn_k2v2_g128+rotated")
    assert rot.env == (("KVARN_VLLM_KEY_FRAME", "rotated"),)
    assert parse_cache("kvarn_k4v2_g128+keys").env == (("KVARN_VLLM_WINDOW_KEYS", "1"),)
    assert parse_cache("kvarn_k2v2_g128+values").env == (("KVARN_VLLM_WINDOW_KEYS", "0"),)
    with pytest.raises(ValueError, match="sets KVARN_VLLM_WINDOW_KEYS twice"):
        parse_cache("kvarn_k2v2_g128+keys+values")
    both = parse_cache("kvarn_k4v2_g128+recent0+mqa")
    assert both.label == "kvarn_k4v2_g128+recent0+mqa"
    assert both.env == (("KVARN_VLLM_RECENT_TILES", "0"), ("KVARN_VLLM_DENSE_CONTEXT", "0"))
    with pytest.raises(ValueError, match="sets KVARN_VLLM_RECENT_TILES twice"):
        parse_cache("kvarn_k4v2_g128+recent0+recent2")
    with pytest.raises(ValueError, match="unknown kvarn setting 'dense'.*keys.*values"):
        parse_cache("kvarn_k4v2_g128+mqa+dense")
    inv = parse_cache("kvarn_k4v2_g128+invariant+split32")
    assert inv.label == "kvarn_k4v2_g128+invariant+split32"
    assert inv.env == (
        ("KVARN_KERNELS_BATCH_INVARIANT", "1"),
        ("KVARN_KERNELS_INVARIANT_SPLIT_TILES", "32"),
    )
    with pytest.raises(ValueError, match="unknown kvarn setting 'split12'.*splitN"):
        parse_cache("kvarn_k4v2_g128+invariant+split12")


def test_parse_caches_groups() -> None:
    labels = [c.label for c in parse_caches("default")]
    assert labels[:3] == ["bf16@FLASH_ATTN", "bf16@TRITON_ATTN", "fp8@TRITON_ATTN"]
    assert len(labels) == len(DEFAULT_CACHES) == 3 + 4 + 6
    assert [c.label for c in parse_caches("bf16,kvarn_k4v4_g64,bf16")] == ["bf16", "kvarn_k4v4_g64"]
    assert [c.label for c in parse_caches("turboquant")] == list(TURBOQUANT_PRESETS)
    with pytest.raises(ValueError, match="no KV cache selected"):
        parse_caches(" , ")


def test_cache_names_match_installed_vllm() -> None:
    """The names are hard-coded (no vLLM import); they must be exactly vLLM 0.26's."""
    pytest.importorskip("vllm")
    import typing

    from vllm.config.cache import CacheDType
    from vllm.model_executor.layers.quantization.turboquant.config import TQ_PRESETS

    assert tuple(typing.get_args(CacheDType)) == VLLM_CACHE_DTYPES
    assert {
        name: (p["key_quant_bits"], p["value_quant_bits"]) for name, p in TQ_PRESETS.items()
    } == TURBOQUANT_PRESETS


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cache_bytes(head_dim: int) -> None:
    from kvarn_math.layout import tile_layout

    assert parse_cache("bf16").bytes_per_token_per_head(head_dim) == 4 * head_dim
    assert parse_cache("fp8@TRITON_ATTN").bits_per_element(head_dim) == 8
    kvarn = parse_cache("kvarn_k4v2_g128")
    assert (
        kvarn.bytes_per_token_per_head(head_dim)
        == tile_layout("kvarn_k4v2_g128", head_dim).bytes_per_token_per_head
    )
    try:
        from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
    except ImportError:
        pytest.skip("vllm not installed")
    for name in TURBOQUANT_PRESETS:
        want = TurboQuantConfig.from_cache_dtype(name, head_dim).slot_size_aligned
        assert parse_cache(name).bytes_per_token_per_head(head_dim) == want


def test_turboquant_layer_average() -> None:
    tq = parse_cache("turboquant_4bit_nc")
    slot = tq.bytes_per_token_per_head(128)
    assert slot == 66 + 68  # 4-bit keys + fp16 norm, 4-bit values + fp16 scale and zero
    # vLLM keeps the first and last two layers in bf16
    assert tq.bytes_per_token_per_head(128, num_layers=32) == pytest.approx(
        (28 * slot + 4 * 512) / 32
    )
    assert tq.bytes_per_token_per_head(128, num_layers=3) == pytest.approx((1 * slot + 2 * 512) / 3)


# --- shapes ------------------------------------------------------------------------------


def _parameters(cfg: dict[str, Any]) -> float:
    h, i, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    d, q, kv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    attention = h * q * d * 2 + h * kv * d * 2
    return (2 * cfg["vocab_size"] * h + n * (attention + 3 * h * i)) / 1e9


@pytest.mark.parametrize(
    "name, billions", [("llama-3.1-8b", 8.03), ("qwen3-8b", 8.19), ("qwen3-32b", 32.76)]
)
def test_shapes_have_the_published_sizes(name: str, billions: float, tmp_path: Path) -> None:
    shape = get_shape(name)
    assert _parameters(shape.config) == pytest.approx(billions, abs=0.01)
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.from_pretrained(write_model_dir(shape, tmp_path))
    assert cfg.num_key_value_heads == 8 and cfg.head_dim == 128
    assert cfg.num_hidden_layers == shape.num_layers
    with pytest.raises(ValueError, match="unknown model shape 'gpt-5'"):
        get_shape("gpt-5")


# --- planning and metrics -------------------------------------------------------------------


def test_plan_requests() -> None:
    # 4096 + 1024 tokens = 40 blocks of 128 (exact); 200,000 tokens hold 39 such requests
    assert plan_requests(200_000, 128, 4096, 1024, max_num_seqs=512) == 39
    # 4096 + 1000 tokens round up to 40 blocks of 128 too
    assert plan_requests(200_000, 128, 4096, 1000, max_num_seqs=512) == 39
    assert plan_requests(200_000, 128, 4096, 1024, max_num_seqs=16) == 16
    assert plan_requests(200_000, 128, 4096, 1024, max_num_seqs=512, fill=0.5) == 19
    assert plan_requests(1_000, 16, 4096, 1024, max_num_seqs=512) == 0
    assert plan_requests(1_000, 16, 4096, 1024, max_num_seqs=512, requests=7) == 7
    with pytest.raises(ValueError, match="fill must be in"):
        plan_requests(1_000, 16, 10, 10, max_num_seqs=4, fill=1.5)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        plan_requests(1_000, 0, 10, 10, max_num_seqs=4)


def test_random_token_prompts() -> None:
    prompts = random_token_prompts(3, 50, 128256, seed=4)
    assert len(prompts) == 3 and all(len(p) == 50 for p in prompts)
    assert prompts == random_token_prompts(3, 50, 128256, seed=4)
    assert prompts != random_token_prompts(3, 50, 128256, seed=5)
    assert all(1000 <= t < 128256 - 1000 and isinstance(t, int) for p in prompts for t in p)


def test_request_timing_reads_vllm_fields() -> None:
    metrics = SimpleNamespace(
        first_token_latency=0.5, first_token_ts=10.0, last_token_ts=12.0, num_generation_tokens=5
    )
    assert request_timing(metrics) == {"ttft_s": 0.5, "tpot_s": 0.5}
    assert request_timing(None) == {"ttft_s": None, "tpot_s": None}
    single = SimpleNamespace(
        first_token_latency=0.5, first_token_ts=10.0, last_token_ts=10.0, num_generation_tokens=1
    )
    assert request_timing(single)["tpot_s"] is None


def test_request_timing_field_names_exist_in_vllm() -> None:
    pytest.importorskip("vllm")
    from vllm.outputs import RequestOutput
    from vllm.v1.metrics.stats import RequestStateStats

    stats = RequestStateStats(
        num_generation_tokens=3, first_token_ts=1.0, last_token_ts=1.5, first_token_latency=0.2
    )
    assert request_timing(stats) == {"ttft_s": 0.2, "tpot_s": 0.25}
    import inspect

    assert "metrics" in inspect.signature(RequestOutput.__init__).parameters


def test_llm_disables_stats_unless_asked() -> None:
    """RequestOutput.metrics needs disable_log_stats=False: LLM sets True by default."""
    pytest.importorskip("vllm")
    import inspect

    from vllm.entrypoints.llm import LLM

    source = inspect.getsource(LLM.__init__)
    assert 'kwargs["disable_log_stats"] = True' in source
    job = serving_jobs(_options(caches="bf16"), Path("/tmp/kvarn-models-test"), "throughput")[0]
    assert job.llm_kwargs["disable_log_stats"] is False


def test_percentile_and_burst_summary() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0], 90) == pytest.approx(1.9)
    assert percentile([], 50) is None
    timings = [{"ttft_s": 1.0, "tpot_s": 0.01}, {"ttft_s": 3.0, "tpot_s": 0.03}]
    s = summarize_burst([100, 100], [10, 10], timings, 2.0)
    assert s["total_tok_per_s"] == 110 and s["output_tok_per_s"] == 10 and s["requests_per_s"] == 1
    assert s["ttft_s_p50"] == 2.0 and s["tpot_s_mean"] == pytest.approx(0.02)
    # the last first token came after the burst ended: no phases
    assert s["ttft_s_max"] == 3.0 and s["prefill_phase_tok_per_s"] is None
    phased = summarize_burst([100, 300], [10, 10], timings, 8.0)
    assert phased["prefill_phase_tok_per_s"] == pytest.approx(400 / 3.0)
    assert phased["decode_phase_s"] == pytest.approx(5.0)
    empty = summarize_burst([1], [1], [{"ttft_s": None, "tpot_s": None}], 1.0)
    assert empty["ttft_s_p50"] is None and empty["timed_requests"] == 0
    assert empty["ttft_s_max"] is None and empty["decode_phase_s"] is None
    partly = summarize_burst([1, 1], [1, 1], [timings[0], {"ttft_s": None, "tpot_s": None}], 5.0)
    assert partly["ttft_s_max"] is None  # one request's first token is unknown
    with pytest.raises(ValueError):
        summarize_burst([1], [1], [], 0.0)


def test_fidelity_metrics() -> None:
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    out = [[1, 2, 3, 4], [5, 0, 7, 8], [1, 9]]
    c = compare_outputs(ref, out)
    assert c["exact_match"] == pytest.approx(1 / 3) and c["median_lcp"] == 1
    assert c["token_agreement"] == pytest.approx(8 / 10)
    assert c["first_divergence"] == pytest.approx(0.5)
    assert longest_common_prefix([1, 2], [1, 2, 3]) == 2
    assert len(set(make_prompts(120))) == 120


# --- the runner ------------------------------------------------------------------------------


def _job(name: str = "t/job", **workload: Any) -> EngineJob:
    return EngineJob(
        suite="throughput",
        name=name,
        cache={"label": "bf16", "kv_cache_dtype": "auto", "backend": None},
        llm_kwargs={"model": "/m", "kv_cache_dtype": "auto"},
        workload={"kind": "throughput", **workload},
        meta={"model": "m", "tensor_parallel_size": 1, "head_dim": 128, "num_layers": 2},
    )


def _script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


def test_parse_log() -> None:
    text = (
        "INFO GPU KV cache size: 1,234 tokens\nINFO GPU KV cache size: 891,872 tokens\n"
        "INFO Maximum concurrency for 16,384 tokens per request: 54.44x\n"
        "(Worker pid=3) INFO kvarn: staging for open tiles: 512 slots x 128 tokens x 32 layers "
        "= 8.000 GiB, allocated at model build\n"
    )
    assert parse_log(text) == {
        "kv_cache_tokens_logged": 891872,
        "max_concurrency_logged": 54.44,
        "staging_gib_logged": 8.0,
    }
    assert parse_log("") == {
        "kv_cache_tokens_logged": None,
        "max_concurrency_logged": None,
        "staging_gib_logged": None,
    }


def test_kvarn_staging_line_is_parsed() -> None:
    """The exact line kvarn-vllm logs."""
    staging = pytest.importorskip("kvarn_vllm.staging")
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    saved = dict(staging._STAGING)
    staging._STAGING.update(bytes=3 * 2**30, layers=2, slots=4, tokens=128, logged=False)
    handler, log = Keep(), logging.getLogger("vllm.kvarn")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        staging.log_staging_once()
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        staging._STAGING.clear()
        staging._STAGING.update(saved)
    assert parse_log("\n".join(records))["staging_gib_logged"] == pytest.approx(3.0)


def test_run_job_ok_relays_progress_and_parses_log(tmp_path: Path) -> None:
    cmd = _script(
        tmp_path,
        """
        import json, sys
        print("[kvarn-eval worker] engine up", flush=True)
        print("GPU KV cache size: 4,096 tokens", flush=True)
        spec = json.load(open(sys.argv[1]))
        json.dump({"complete": True, "capacity": {"block_size": 16}, "echo": spec["name"]},
                  open(sys.argv[2], "w"))
        """,
    )
    lines: list[str] = []
    job = _job()
    workdir = tmp_path / "runs"
    spec, result = workdir / "t_job.spec.json", workdir / "t_job.json"
    record = run_job(job, workdir, 60, command=[*cmd, str(spec), str(result)], echo=lines.append)
    assert record["status"] == "ok" and record["returncode"] == 0
    assert record["echo"] == "t/job" and record["kv_cache_tokens_logged"] == 4096
    assert record["cache"]["label"] == "bf16" and "model" not in record["settings"]
    assert "engine up" in lines and lines[-1].startswith("[ok] t/job")
    assert json.loads(result.read_text())["status"] == "ok"  # the merged record on disk


def test_run_job_failure_is_a_record(tmp_path: Path) -> None:
    cmd = _script(tmp_path, "raise RuntimeError('CUDA out of memory (fake)')\n")
    record = run_job(_job(), tmp_path, 60, command=cmd, echo=None)
    assert record["status"] == "failed" and record["returncode"] == 1
    assert record["error"] == "RuntimeError: CUDA out of memory (fake)"
    assert "Traceback" in record["log_tail"]


def test_run_job_timeout_kills_the_group_and_keeps_partial(tmp_path: Path) -> None:
    cmd = _script(
        tmp_path,
        """
        import json, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open(sys.argv[3], "w").write(str(child.pid))
        json.dump({"complete": False, "bursts": {"4096": {"seconds": 1.0}}}, open(sys.argv[2], "w"))
        time.sleep(600)
        """,
    )
    pid_file = tmp_path / "grandchild.pid"
    result = tmp_path / "runs" / "t_job.json"
    start = time.monotonic()
    record = run_job(
        _job(), tmp_path / "runs", 3, command=[*cmd, "spec", str(result), str(pid_file)], echo=None
    )
    assert time.monotonic() - start < 40
    assert record["status"] == "timeout" and "killed after 3 s" in record["error"]
    assert record["bursts"] == {"4096": {"seconds": 1.0}}
    grandchild = int(pid_file.read_text())
    assert not _alive(grandchild)  # the engine's own children die with the group (waited for)
    from kvarn_eval.serving.runner import group_members

    assert group_members(os.getpgid(0)) and group_members(grandchild) == []


def test_sigterm_to_the_bench_stops_the_engine_group(tmp_path: Path) -> None:
    """An outer ``timeout`` SIGTERMs the bench while an engine runs: the engine's process group
    (vLLM's engine core is a grandchild in its own session) is stopped before the bench exits,
    instead of living on with its GPU memory."""
    pid_file = tmp_path / "grandchild.pid"
    child = _script(
        tmp_path,
        """
        import subprocess, sys, time
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open(sys.argv[3], "w").write(str(grandchild.pid))
        time.sleep(600)
        """,
    )
    parent = tmp_path / "parent.py"
    parent.write_text(
        textwrap.dedent(
            f"""
            import sys
            from pathlib import Path
            sys.path.insert(0, {str(Path(__file__).parent)!r})
            from test_eval_serving import _job
            from kvarn_eval.serving.runner import run_job
            run_job(_job(), Path({str(tmp_path / "runs")!r}), 600,
                    command={[*child, "spec", str(tmp_path / "r.json"), str(pid_file)]!r},
                    echo=None)
            """
        )
    )
    proc = subprocess.Popen([sys.executable, str(parent)])
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, "the engine never started"
        time.sleep(0.1)
    grandchild = int(pid_file.read_text())
    assert _alive(grandchild)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 128 + signal.SIGTERM
    assert not _alive(grandchild)


def _alive(pid: int) -> bool:
    """Running (a killed process that nobody reaped yet is a zombie: not alive)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_run_job_hung_exit_after_completion_counts_as_ok(tmp_path: Path) -> None:
    cmd = _script(
        tmp_path,
        """
        import json, sys, time
        json.dump({"complete": True}, open(sys.argv[1], "w"))
        time.sleep(600)
        """,
    )
    result = tmp_path / "t_job.json"
    record = run_job(_job(), tmp_path, 60, command=[*cmd, str(result)], echo=None, exit_grace=1)
    assert record["status"] == "ok" and record["returncode"] == -signal.SIGTERM


def test_budget() -> None:
    assert Budget().timeout_for(300) == 300
    budget = Budget(max_seconds=100, reserve_seconds=10, min_run_seconds=30)
    assert budget.timeout_for(1000) == pytest.approx(90, abs=1)
    assert budget.timeout_for(20) is None  # less than min_run_seconds
    spent = Budget(max_seconds=100, started=time.monotonic() - 80, min_run_seconds=30)
    assert spent.timeout_for(1000) is None


# --- the worker against a stand-in vLLM -----------------------------------------------------


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Path:
    """Worker processes import the stand-in ``vllm`` (first on PYTHONPATH)."""
    path = os.pathsep.join([str(FAKE_VLLM), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)
    return FAKE_VLLM


def _options(**kwargs: Any) -> ServingOptions:
    base: dict[str, Any] = dict(
        gpu_models=("llama-3.1-8b",),
        caches="bf16@FLASH_ATTN,kvarn_k4v2_g128",
        prompt_lens=(1024, 2048),
        output_len=32,
        max_num_seqs=64,
    )
    return ServingOptions(**{**base, **kwargs})


def test_serving_jobs(tmp_path: Path) -> None:
    opts = _options(
        caches="bf16@FLASH_ATTN,fp8@TRITON_ATTN,kvarn_k4v2_g128", tensor_parallel_size=2
    )
    jobs = serving_jobs(opts, tmp_path, "throughput")
    assert [j.name for j in jobs] == [
        "llama-3.1-8b/tp2/bf16@FLASH_ATTN",
        "llama-3.1-8b/tp2/fp8@TRITON_ATTN",
        "llama-3.1-8b/tp2/kvarn_k4v2_g128",
    ]
    bf16, fp8, kvarn = (j.llm_kwargs for j in jobs)
    assert (
        bf16["attention_config"] == {"backend": "FLASH_ATTN"} and bf16["kv_cache_dtype"] == "auto"
    )
    assert fp8["kv_cache_dtype"] == "fp8" and "attention_config" not in kvarn
    assert kvarn["load_format"] == "dummy" and kvarn["skip_tokenizer_init"] is True
    # 2048 + 32 + 16 rounded up to a multiple of 256, so whole requests fill whole tiles
    assert kvarn["tensor_parallel_size"] == 2 and kvarn["max_model_len"] == 2304
    assert (tmp_path / "llama-3.1-8b" / "config.json").is_file()
    assert jobs[0].workload["prompt_lens"] == [1024, 2048]
    capacity = serving_jobs(opts, tmp_path, "capacity")
    assert [j.engine_key() for j in capacity] == [j.engine_key() for j in jobs]
    in_process = serving_jobs(_options(engine_in_process=True), tmp_path, "capacity")
    assert in_process[0].env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    # A kvarn setting reaches its engine's environment, and only that engine's.
    two = serving_jobs(
        _options(caches="kvarn_k4v2_g128,kvarn_k4v2_g128+recent0"), tmp_path, "capacity"
    )
    assert [j.env for j in two] == [{}, {"KVARN_VLLM_RECENT_TILES": "0"}]
    assert two[0].engine_key() != two[1].engine_key()
    assert two[1].cache["env"] == {"KVARN_VLLM_RECENT_TILES": "0"}
    with pytest.raises(
        ValueError, match=r"rounded up to 41216\) exceed qwen3-8b's 40960 positions"
    ):
        _options(gpu_models=("qwen3-8b",), prompt_lens=(40920,))
    # Capture sizes reach every engine only when asked (earlier records keep their job key).
    assert "compilation_config" not in kvarn
    sized = serving_jobs(_options(cudagraph_capture_sizes=(1, 8, 256)), tmp_path, "throughput")
    assert all(
        j.llm_kwargs["compilation_config"] == {"cudagraph_capture_sizes": [1, 8, 256]}
        for j in sized
    )
    assert sized[0].engine_key() != serving_jobs(_options(), tmp_path, "throughput")[0].engine_key()
    title = throughput_result([], {k: v for k, v in sized[0].llm_kwargs.items() if k != "model"})
    assert "CUDA graphs at batch sizes 1, 8, 256;" in title["tables"][0]["title"]
    for bad in ((), (0, 8), (8, 1), (1, 1)):
        with pytest.raises(ValueError, match="distinct positive batch sizes in increasing"):
            _options(cudagraph_capture_sizes=bad)
    with pytest.raises(ValueError, match="no effect with enforce_eager"):
        _options(cudagraph_capture_sizes=(1, 2), enforce_eager=True)
    args = cli.build_parser().parse_args(["bench", "--cudagraph-sizes", "1,2,4,256"])
    assert cli.serving_options_from_args(args).cudagraph_capture_sizes == (1, 2, 4, 256)
    for lens, out in (((4096,), 1024), ((16384, 4096), 1024), ((100,), 1)):
        opts = _options(prompt_lens=lens, output_len=out)
        assert opts.max_model_len % 256 == 0
        assert 0 <= opts.max_model_len - (max(lens) + out + 16) < 256


def test_worker_throughput_and_capacity(fake_vllm: Path, tmp_path: Path) -> None:
    opts = _options()
    jobs = serving_jobs(opts, tmp_path / "models", "throughput")
    reuse: dict[str, dict[str, Any]] = {}
    records = run_jobs(jobs, tmp_path / "runs", opts, Budget(), reuse=reuse, echo=lambda s: None)
    bf16, kvarn = records
    assert bf16["status"] == "ok", bf16.get("log_tail")
    assert bf16["capacity"] == {
        "num_gpu_blocks": 4000,
        "block_size": 16,
        "kv_cache_tokens_config": 64000,
    }
    assert kvarn["kv_cache_tokens_logged"] == 384000 and kvarn["staging_gib_logged"] == 1.5
    # bf16: 64,000 tokens / (1024 + 32 -> 66 blocks of 16) = 60 requests; kvarn capped at 64
    assert bf16["bursts"]["1024"]["requests"] == 60 and kvarn["bursts"]["1024"]["requests"] == 64
    burst = kvarn["bursts"]["2048"]
    assert burst["output_tokens"] == 64 * 32 and burst["prompt_tokens"] == 64 * 2048
    assert burst["ttft_s_p50"] == pytest.approx(0.325) and burst["tpot_s_p50"] == pytest.approx(
        0.002
    )
    # capacity jobs with the same engines reuse the throughput runs
    lines: list[str] = []
    cap_jobs = serving_jobs(opts, tmp_path / "models", "capacity")
    caps = run_jobs(cap_jobs, tmp_path / "runs2", opts, Budget(), reuse=reuse, echo=lines.append)
    assert [c["reused_from"] for c in caps] == [j.name for j in jobs]
    assert not (tmp_path / "runs2").exists() and "capacity from" in lines[0]
    table = capacity_result(caps, {"max_num_seqs": 64})
    assert [r["vs_bf16"] for r in table["rows"]] == [1.0, 6.0]
    assert table["rows"][1]["problems"] == []
    result = throughput_result(records, {"output_len": 32})
    rows = {(r["cache"], r["prompt_len"]): r for r in result["rows"]}
    assert rows[("kvarn_k4v2_g128", 1024)]["capacity_vs_bf16"] == 6.0
    assert rows[("bf16@FLASH_ATTN", 2048)]["throughput_vs_bf16"] == 1.0
    assert rows[("kvarn_k4v2_g128", 2048)]["throughput_vs_bf16"] is not None


def test_worker_failure_and_budget(
    fake_vllm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    opts = _options()
    jobs = serving_jobs(opts, tmp_path / "models", "capacity")
    budget = Budget(max_seconds=200, reserve_seconds=0, min_run_seconds=30)
    failed = run_jobs(jobs[:1], tmp_path / "runs", opts, budget, echo=lambda s: None)[0]
    assert failed["status"] == "failed"
    assert failed["error"].startswith("RuntimeError: CUDA error: no kernel image")
    assert "Traceback" in failed["traceback"]
    budget.started -= 190  # nearly spent: the next run is not started
    skipped = run_jobs(jobs[1:], tmp_path / "runs", opts, budget, echo=lambda s: None)[0]
    assert skipped["status"] == "skipped" and "time budget" in skipped["error"]
    rows = capacity_result([failed, skipped], {})["tables"][0]["rows"]
    assert "failed: RuntimeError" in rows[0][-1] and "skipped" in rows[1][-1]


def test_worker_timeout_keeps_finished_bursts(
    fake_vllm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_VLLM_SLEEP", "60")  # the second burst never finishes
    opts = _options(caches="bf16", run_timeout=12)
    jobs = serving_jobs(opts, tmp_path / "models", "throughput")
    record = run_jobs(
        jobs, tmp_path / "runs", opts, Budget(min_run_seconds=1), echo=lambda s: None
    )[0]
    assert record["status"] == "timeout"
    assert list(record["bursts"]) == ["1024"]
    # the error names where the run was killed: the second burst, a few seconds into it, and
    # how many of its requests had finished (the fake's 60 s spread over them: a few)
    where = re.search(
        r"during the 2048-token burst \((\d+) requests\) \((\d+) s into it, "
        r"(\d+) of (\d+) requests finished\)",
        record["error"],
    )
    assert where, record["error"]
    assert int(where[1]) == int(where[4]) > int(where[3]) >= 1 and 0 <= int(where[2]) <= 12
    assert record["phase_progress"] == {"done": int(where[3]), "total": int(where[4])}
    rows = throughput_result([record], {})["rows"]
    assert [r["status"] for r in rows] == ["ok", "timeout"]


def test_worker_timeout_in_start_up_says_so(
    fake_vllm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run killed while its engine starts (after vLLM sized the cache, as TurboQuant's did in
    a CUDA graph capture on the H200) keeps the capacity vLLM logged and says where it was."""
    monkeypatch.setenv("FAKE_VLLM_START_SLEEP", "60")
    opts = _options(caches="bf16", run_timeout=5)
    jobs = serving_jobs(opts, tmp_path / "models", "throughput")
    record = run_jobs(
        jobs, tmp_path / "runs", opts, Budget(min_run_seconds=1), echo=lambda s: None
    )[0]
    assert record["status"] == "timeout" and "bursts" not in record
    where = re.search(
        r"killed after 5 s during engine start-up \((\d+) s into it\)", record["error"]
    )
    # measured when the record is written, after the kill: a loaded 2-core CI machine read 6 s
    assert where and 1 <= int(where[1]) <= 15, record["error"]
    assert record["kv_cache_tokens_logged"] == 64000


def test_kvarn_checks_catch_a_silent_fallback() -> None:
    def rec(label: str, tokens: int, block: int, staging: float | None) -> dict[str, Any]:
        return {
            "suite": "capacity",
            "name": label,
            "status": "ok",
            "cache": {
                "label": label,
                "kv_cache_dtype": label.split("@")[0].replace("bf16", "auto"),
                "backend": None,
            },
            "meta": {"model": "m", "tensor_parallel_size": 1, "head_dim": 128, "num_layers": 32},
            "capacity": {"kv_cache_tokens_config": tokens, "block_size": block},
            "staging_gib_logged": staging,
        }

    rows = capacity_result(
        [rec("bf16", 1000, 16, None), rec("kvarn_k4v2_g128", 900, 16, None)], {}
    )["rows"]
    problems = rows[1]["problems"]
    assert len(problems) == 3 and "block size 16" in problems[1] and "not more than" in problems[2]


def test_greedy_jobs_and_result(fake_vllm: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"hidden_size": 576, "num_attention_heads": 9, "num_hidden_layers": 30})
    )
    opts = _options(greedy_caches="kvarn_k4v2_g128,fp8", greedy_prompts=6, greedy_tokens=8)
    jobs = greedy_jobs(opts, str(model))
    assert [j.meta["role"] for j in jobs] == ["reference", "compare", "compare", "noise"]
    assert jobs[0].cache["label"] == "bf16@TRITON_ATTN" and jobs[3].llm_kwargs["max_num_seqs"] == 8
    assert jobs[0].meta["head_dim"] == 64 and jobs[0].llm_kwargs["enforce_eager"] is True
    records = run_jobs(jobs, tmp_path / "runs", opts, Budget(), echo=lambda s: None)
    assert all(r["status"] == "ok" for r in records), records[0].get("log_tail")
    result = greedy_result(records, {"greedy_prompts": 6})
    rows = {r["method"]: r for r in result["rows"]}
    assert (
        rows["bf16@TRITON_ATTN seqs<=8"]["token_agreement"] == 1.0
    )  # the stand-in is deterministic
    assert rows["fp8"]["exact_match"] == 1.0
    # the stand-in's kvarn tokens change after the first half (LCP 5 of 8)
    assert rows["kvarn_k4v2_g128"]["mean_lcp"] == 5 and rows["kvarn_k4v2_g128"]["exact_match"] == 0
    assert rows["kvarn_k4v2_g128"]["bits_per_element"] == pytest.approx(55.625 * 8 / 128)
    assert {p["label"] for p in result["points"]} == set(rows) - {"bf16@TRITON_ATTN"}
    named = greedy_result(records, {"model": "/cache/models/gemma-3-270m"})
    assert named["axes"]["title"] == "vllm_greedy, gemma-3-270m"
    # The reference run lost: the noise run (same cache, other batch size) stands in, labelled.
    stand_in = greedy_result(records[1:], {})
    assert "stands in" in stand_in["tables"][0]["title"]
    assert stand_in["reference"] == "bf16@TRITON_ATTN seqs<=8"
    rows = {r["method"]: r for r in stand_in["rows"]}
    assert rows["fp8"]["exact_match"] == 1.0 and rows["kvarn_k4v2_g128"]["mean_lcp"] == 5
    no_ref = greedy_result(records[1:3], {})  # neither the reference nor the noise run
    assert "NO REFERENCE" in no_ref["tables"][0]["title"]


def test_perplexity_jobs_and_result(fake_vllm: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"hidden_size": 576, "num_attention_heads": 9, "num_hidden_layers": 30})
    )
    opts = _options(ppl_caches="kvarn_k4v2_g128,kvarn_k4v2_g128+recent0", ppl_chunk_size=64)
    chunks = [[(7 * i + j) % 50 for j in range(40)] for i in range(3)]
    jobs = perplexity_jobs(opts, str(model), chunks)
    assert [j.meta["role"] for j in jobs] == ["reference", "compare", "compare", "noise"]
    ref, noise = jobs[0].llm_kwargs, jobs[3].llm_kwargs
    # three texts side by side, 64 tokens of each per step
    assert ref["kv_cache_dtype"] == "auto" and ref["max_num_batched_tokens"] == 3 * 64
    assert ref["long_prefill_token_threshold"] == 64 and ref["max_num_seqs"] == 3
    assert ref["enable_prefix_caching"] is False
    assert noise["long_prefill_token_threshold"] == 256 and noise["max_num_batched_tokens"] == 768
    assert jobs[3].meta["label"].endswith("chunk 256")
    assert jobs[2].env == {"KVARN_VLLM_RECENT_TILES": "0"} and jobs[1].env == {}
    records = run_jobs(jobs, tmp_path / "runs", opts, Budget(), echo=lambda s: None)
    assert all(r["status"] == "ok" for r in records), records[0].get("log_tail")
    result = perplexity_result(records, {"ppl_chunks": 3, "ppl_tokens": 40})
    rows = {r["method"]: r for r in result["rows"]}
    noise_row = rows["bf16@TRITON_ATTN chunk 256"]
    assert noise_row["ppl_change_pct"] == pytest.approx(0.0) and noise_row["top1_agreement"] == 1
    kvarn = rows["kvarn_k4v2_g128"]
    # 0.02 nats worse on every token: exp(0.02) - 1; the top-1 changes at 5 of 39 positions
    assert kvarn["ppl_change_pct"] == pytest.approx(100 * (math.exp(0.02) - 1))
    assert kvarn["ppl_change_se"] == pytest.approx(0.0, abs=1e-9)
    assert kvarn["top1_agreement"] == pytest.approx(34 / 39)
    assert rows["bf16@TRITON_ATTN"]["is_reference"] and "perplexity" in rows["bf16@TRITON_ATTN"]
    assert "+2.02 ± 0.00" in result["tables"][0]["rows"][1][3]
    assert {p["label"] for p in result["points"]} == set(rows) - {"bf16@TRITON_ATTN"}
    no_ref = perplexity_result(records[1:], {})
    assert "NO REFERENCE" in no_ref["tables"][0]["title"]


# --- the command line ----------------------------------------------------------------------


def test_gpu_suite_on_a_cpu_machine_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvarn_eval import suites

    monkeypatch.setattr(suites, "_gpu_available", lambda: False)
    assert cli.main(["bench", "--suites", "throughput", "--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_missing_vllm_explains_what_to_install(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvarn_eval import suites
    from kvarn_eval.serving import suites as serving_suites

    monkeypatch.setattr(suites, "_gpu_available", lambda: True)
    real = serving_suites.importlib.util.find_spec
    monkeypatch.setattr(
        serving_suites.importlib.util, "find_spec", lambda n: None if n == "vllm" else real(n)
    )
    assert cli.main(["bench", "--suites", "capacity", "--out", str(tmp_path)]) == 2
    out = capsys.readouterr().out.replace("\n", "")
    assert "'vllm' is missing" in out and "vllm==0.26" in out


def test_vllm_perplexity_from_the_command_line(
    fake_vllm: Path,
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The suite's glue: the model's tokenizer cuts --text into chunks, the engines score them,
    the table compares them with the reference."""
    from kvarn_eval import suites

    monkeypatch.setattr(suites, "_gpu_available", lambda: True)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(["the cat sat on the mat and the dog ran"] * 40))
    argv = [
        "bench", "--suites", "vllm_perplexity", "--greedy-model", str(tiny_model_dir),
        "--text", str(text), "--vllm-ppl-chunks", "2", "--vllm-ppl-tokens", "24",
        "--ppl-caches", "kvarn_k4v2_g128+recent0", "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "vllm_perplexity: 2 chunks x 24 tokens" in out and "kvarn_k4v2_g128+recent0" in out
    payload = json.loads((tmp_path / "out" / "results.json").read_text())
    (result,) = payload["results"]
    rows = {r["method"]: r for r in result["rows"]}
    assert rows["kvarn_k4v2_g128+recent0"]["ppl_change_pct"] > 0
    assert result["settings"]["text_source"] == str(text)
    # the served model is named, not only --model's default (SmolLM2)
    assert payload["model"]["served"] == str(tiny_model_dir)
    assert f"serve {tiny_model_dir}" in out
    spec = json.loads(next((tmp_path / "out" / "runs").rglob("*spec*.json")).read_text())
    assert len(spec["workload"]["chunks"]) == 2 and len(spec["workload"]["chunks"][0]) == 24


def test_report_merges_perplexity_runs_per_model(
    fake_vllm: Path,
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Perplexity runs of two models with the same caches stay two results, each against its
    own reference; a second folder of one model adds its caches to that model's table."""
    import shutil

    from kvarn_eval import suites

    monkeypatch.setattr(suites, "_gpu_available", lambda: True)
    other = tmp_path / "other-model"
    shutil.copytree(tiny_model_dir, other)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(["the cat sat on the mat and the dog ran"] * 40))
    common = ["--suites", "vllm_perplexity", "--text", str(text), "--vllm-ppl-chunks", "2"]
    common += ["--vllm-ppl-tokens", "24"]
    runs = {
        "a": [str(tiny_model_dir), "kvarn_k4v2_g128"],
        "b": [str(other), "kvarn_k4v2_g128"],
        "c": [str(tiny_model_dir), "bf16@TRITON_ATTN,fp8@TRITON_ATTN"],
    }
    for name, (model, caches) in runs.items():
        argv = ["bench", *common, "--greedy-model", model, "--ppl-caches", caches]
        assert cli.main([*argv, "--out", str(tmp_path / name)]) == 0
    merged = tmp_path / "merged"
    dirs = [str(tmp_path / name) for name in runs]
    capsys.readouterr()
    assert cli.main(["report", *dirs, "--out", str(merged), "--no-plot"]) == 0
    payload = json.loads((merged / "results.json").read_text())
    ppl = [r for r in payload["results"] if r["suite"] == "vllm_perplexity"]
    by_model = {Path(r["settings"]["model"]).name: r for r in ppl}
    assert sorted(by_model) == sorted([tiny_model_dir.name, "other-model"])
    tiny = {row["method"] for row in by_model[tiny_model_dir.name]["rows"]}
    assert {"kvarn_k4v2_g128", "fp8@TRITON_ATTN", "bf16@TRITON_ATTN"} <= tiny
    assert {row["method"] for row in by_model["other-model"]["rows"]} >= {"kvarn_k4v2_g128"}
    # the tiny model's reference ran twice (folders a and c): the later one is kept, and said
    assert any("bf16@TRITON_ATTN: kept the run" in line for line in payload["left_out"])
    assert all(
        r.get("ppl_change_pct") is not None
        for r in by_model["other-model"]["rows"]
        if r["role"] == "compare"
    )


def test_bench_and_report_end_to_end(
    fake_vllm: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvarn_eval import suites

    monkeypatch.setattr(suites, "_gpu_available", lambda: True)
    common = ["--gpu-models", "llama-3.1-8b", "--prompt-lens", "1024,2048", "--output-len", "16"]
    first, second = tmp_path / "a", tmp_path / "b"
    argv = ["bench", "--suites", "throughput,capacity", "--caches", "bf16@FLASH_ATTN", *common]
    assert cli.main([*argv, "--out", str(first), "--max-seconds", "600"]) == 0
    argv2 = ["bench", "--suites", "throughput", "--caches", "kvarn_k4v2_g128", *common]
    assert cli.main([*argv2, "--out", str(second)]) == 0
    printed = capsys.readouterr().out
    assert "[1/1] llama-3.1-8b/tp1/kvarn_k4v2_g128: starting" in printed
    assert "burst of 176 x 2048 tokens" in printed  # the worker's progress, relayed
    payload = json.loads((first / "results.json").read_text())
    assert payload["complete"] and [r["suite"] for r in payload["results"]] == [
        "throughput",
        "capacity",
    ]
    assert payload["options"]["serving"]["prompt_lens"] == [1024, 2048]
    assert (first / "serving.png").stat().st_size > 0
    assert "| llama-3.1-8b tp1 | 1024 | bf16@FLASH_ATTN |" in (first / "results.md").read_text()
    merged = tmp_path / "merged"
    assert cli.main(["report", str(first), str(second), "--out", str(merged)]) == 0
    results = json.loads((merged / "results.json").read_text())["results"]
    throughput = next(r for r in results if r["suite"] == "throughput")
    caches = {(r["cache"], r["prompt_len"]): r for r in throughput["rows"]}
    assert len(caches) == 4
    assert caches[("kvarn_k4v2_g128", 1024)]["capacity_vs_bf16"] == 6.0  # across the two runs
    assert (merged / "serving.png").stat().st_size > 0
    assert json.loads((merged / "results.json").read_text())["left_out"] == []
    # The same cache run again in a third folder (other settings, say): the report keeps the
    # later run and says which one it left out, on the terminal and in the JSON.
    third = tmp_path / "c"
    assert cli.main([*argv2, "--out", str(third)]) == 0
    capsys.readouterr()
    again = tmp_path / "again"
    assert cli.main(["report", str(second), str(third), "--out", str(again)]) == 0
    note = capsys.readouterr().out.replace("\n", "")
    left_out = json.loads((again / "results.json").read_text())["left_out"]
    assert len(left_out) == 1  # one record per engine run (both prompt lengths)
    assert all(f"kept the run from {third}" in line for line in left_out)
    assert all(f"left out the one from {second}" in line for line in left_out)
    assert "note: throughput/" in note
    assert cli.main(["report", str(tmp_path / "nothing")]) == 2


def test_report_keeps_one_engine_per_prompt_length(
    fake_vllm: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cache run once per prompt length (one engine each, in separate folders: how long
    bursts fit 10-minute GPU calls) gives one row per length, not the last engine's only."""
    from kvarn_eval import suites

    monkeypatch.setattr(suites, "_gpu_available", lambda: True)
    common = ["--suites", "throughput", "--gpu-models", "llama-3.1-8b", "--output-len", "16"]
    folders = {
        "bf16": ["--caches", "bf16@FLASH_ATTN", "--prompt-lens", "1024,2048"],
        "q2k": ["--caches", "kvarn_k4v2_g128", "--prompt-lens", "2048"],
        "q1k": ["--caches", "kvarn_k4v2_g128", "--prompt-lens", "1024"],
    }
    for name, extra in folders.items():
        assert cli.main(["bench", *common, *extra, "--out", str(tmp_path / name)]) == 0
    merged = tmp_path / "merged"
    dirs = [str(tmp_path / name) for name in folders]
    assert cli.main(["report", *dirs, "--out", str(merged), "--no-plot"]) == 0
    payload = json.loads((merged / "results.json").read_text())
    assert payload["left_out"] == []
    throughput = next(r for r in payload["results"] if r["suite"] == "throughput")
    rows = {(r["cache"], r["prompt_len"]): r for r in throughput["rows"]}
    assert sorted(rows) == [
        ("bf16@FLASH_ATTN", 1024),
        ("bf16@FLASH_ATTN", 2048),
        ("kvarn_k4v2_g128", 1024),
        ("kvarn_k4v2_g128", 2048),
    ]
    assert all(r["status"] == "ok" and r["throughput_vs_bf16"] for r in rows.values())
    capacity = next(r for r in payload["results"] if r["suite"] == "capacity")
    assert [r["cache"] for r in capacity["rows"]].count("kvarn_k4v2_g128") == 1
    # The same length again replaces the earlier engine and says so.
    again = tmp_path / "again"
    assert cli.main(["bench", *common, *folders["q1k"], "--out", str(again)]) == 0
    capsys.readouterr()
    assert cli.main(["report", *dirs, str(again), "--out", str(merged), "--no-plot"]) == 0
    left_out = json.loads((merged / "results.json").read_text())["left_out"]
    assert len(left_out) == 1 and "(1024): kept the run from" in left_out[0]


def test_report_takes_stored_rows_of_folders_without_run_records(
    fake_vllm: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Published results keep only ``results.json`` (GPU calls return a few files): their
    capacity and throughput rows still merge, ratios computed across folders, and a stored
    row never shadows a run record of the same measurement."""
    import shutil

    from kvarn_eval import suites

    monkeypatch.setattr(suites, "_gpu_available", lambda: True)
    common = ["--gpu-models", "llama-3.1-8b", "--prompt-lens", "1024", "--output-len", "16"]
    bf16, kvarn, kvarn2 = tmp_path / "bf16", tmp_path / "kvarn", tmp_path / "kvarn2"
    bench = ["bench", "--suites", "throughput,capacity", *common]
    assert cli.main([*bench, "--caches", "bf16@FLASH_ATTN", "--out", str(bf16)]) == 0
    for out in (kvarn, kvarn2):
        assert cli.main([*bench, "--caches", "kvarn_k4v2_g128", "--out", str(out)]) == 0
    shutil.rmtree(bf16 / "runs")
    shutil.rmtree(kvarn / "runs")
    capsys.readouterr()
    merged = tmp_path / "merged"
    assert cli.main(["report", str(bf16), str(kvarn), "--out", str(merged), "--no-plot"]) == 0
    printed = capsys.readouterr().out.replace("\n", "")
    assert f"throughput: 1 row(s) taken as stored from {bf16 / 'results.json'}" in printed
    payload = json.loads((merged / "results.json").read_text())
    assert len(payload["rows_as_stored"]) == 4 and payload["left_out"] == []
    by_suite = {r["suite"]: r for r in payload["results"]}
    rows = {r["cache"]: r for r in by_suite["throughput"]["rows"]}
    assert rows["kvarn_k4v2_g128"]["capacity_vs_bf16"] == 6.0  # across the two folders
    assert rows["kvarn_k4v2_g128"]["throughput_vs_bf16"] == pytest.approx(
        rows["kvarn_k4v2_g128"]["total_tok_per_s"] / rows["bf16@FLASH_ATTN"]["total_tok_per_s"]
    )
    assert rows["bf16@FLASH_ATTN"]["throughput_vs_bf16"] == 1.0
    assert {r["cache"]: r["vs_bf16"] for r in by_suite["capacity"]["rows"]} == {
        "bf16@FLASH_ATTN": 1.0,
        "kvarn_k4v2_g128": 6.0,
    }
    # kvarn2 kept its run records: they win over kvarn's stored rows, which are left out.
    again = tmp_path / "again"
    argv = ["report", str(bf16), str(kvarn), str(kvarn2), "--out", str(again), "--no-plot"]
    assert cli.main(argv) == 0
    payload = json.loads((again / "results.json").read_text())
    throughput = next(r for r in payload["results"] if r["suite"] == "throughput")
    assert [r["cache"] for r in throughput["rows"]] == ["kvarn_k4v2_g128", "bf16@FLASH_ATTN"]
    assert "source" not in throughput["rows"][0]  # from kvarn2's run record
    assert len(payload["left_out"]) == 2  # kvarn's stored throughput and capacity rows
    assert all(f"left out the stored row from {kvarn}" in line for line in payload["left_out"])


def test_bench_resume_keeps_finished_engine_runs(
    fake_vllm: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--resume`` runs only what an earlier bench into the same folder did not finish ok
    with the same job; without it every engine runs again."""
    from kvarn_eval import suites

    monkeypatch.setattr(suites, "_gpu_available", lambda: True)
    out = tmp_path / "out"
    argv = [
        "bench", "--suites", "throughput,capacity", "--gpu-models", "llama-3.1-8b",
        "--prompt-lens", "1024", "--output-len", "16", "--out", str(out),
        "--caches", "bf16@FLASH_ATTN,kvarn_k4v2_g128",
    ]  # fmt: skip
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    assert cli.main([*argv, "--caches", "bf16@FLASH_ATTN"]) == 0  # its engine fails
    capsys.readouterr()
    monkeypatch.delenv("FAKE_VLLM_FAIL")
    assert cli.main([*argv, "--resume"]) == 0  # the failed run is not kept
    first = capsys.readouterr().out
    assert first.count(": starting (timeout") == 2 and "--resume)" not in first

    def throughput_rows() -> dict[str, dict[str, Any]]:
        payload = json.loads((out / "results.json").read_text())
        result = next(r for r in payload["results"] if r["suite"] == "throughput")
        return {row["cache"]: row for row in result["rows"]}

    before = throughput_rows()
    assert cli.main([*argv, "--resume"]) == 0
    again = capsys.readouterr().out
    assert ": starting (timeout" not in again
    assert again.count("(--resume)") == 2
    assert "capacity from llama-3.1-8b/tp1/kvarn_k4v2_g128" in again  # from the kept run
    after = throughput_rows()
    assert {c: r["seconds"] for c, r in after.items()} == {
        c: r["seconds"] for c, r in before.items()
    }
    # Another workload is another job: it runs.
    other = [*argv[:-2], "--caches", "kvarn_k4v2_g128", "--output-len", "8", "--resume"]
    assert cli.main(other) == 0
    assert capsys.readouterr().out.count(": starting (timeout") == 1
    # Without --resume, everything runs again.
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.count(": starting (timeout") == 2


def test_root_cause_of_an_engine_start_up_failure() -> None:
    """vLLM's front end says only "Engine core initialization failed. See root cause above.";
    the record names the engine core's own exception (lines as an H200 log had them)."""
    from kvarn_eval.serving.runner import root_cause

    log = "\n".join(
        [
            "(EngineCore pid=4832) INFO 11-30 10:27:00 [impl.py:513] kvarn: exact first-chunk "
            "prefill via FlashAttention 3",
            "(EngineCore pid=4832) ERROR 11-30 10:27:08 [core.py:1330]     raise err",
            "(EngineCore pid=4832) ERROR 11-30 10:27:08 [core.py:1330] "
            "triton.runtime.errors.OutOfResources: out of resource: shared memory, "
            "Required: 262144, Hardware limit: 232448.",
            "(EngineCore pid=4832) Process EngineCore:",
            "RuntimeError: Engine core initialization failed. See root cause above. "
            "Failed core proc(s): {}",
            "[kvarn-eval worker] greedy/kvarn: FAILED: RuntimeError: Engine core "
            "initialization failed. See root cause above.",
        ]
    )
    assert root_cause(log) == (
        "triton.runtime.errors.OutOfResources: out of resource: shared memory, "
        "Required: 262144, Hardware limit: 232448."
    )
    assert root_cause("RuntimeError: Engine core initialization failed.\nValueError: x") == ""


def test_vllm_greedy_with_context_passages_from_the_command_line(
    fake_vllm: Path,
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--vllm-greedy-context puts a distinct passage of --text before every prompt (so the
    prompts read quantized tiles) and gives the engines room for it."""
    from kvarn_eval import suites
    from kvarn_eval.fidelity import make_prompts

    monkeypatch.setattr(suites, "_gpu_available", lambda: True)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i % 90}" for i in range(400)))  # the tiny model's words
    argv = [
        "bench", "--suites", "vllm_greedy", "--greedy-model", str(tiny_model_dir),
        "--text", str(text), "--vllm-greedy-prompts", "3", "--vllm-greedy-tokens", "8",
        "--vllm-greedy-context", "40", "--greedy-caches", "kvarn_k4v2_g128",
        "--noise-max-num-seqs", "0", "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "3 prompts after 40-token passages x 8 greedy tokens" in out.replace("\n", "")
    specs = [json.loads(p.read_text()) for p in (tmp_path / "out" / "runs").rglob("*spec*.json")]
    assert len(specs) == 2  # the reference and kvarn
    prompts = specs[0]["workload"]["prompts"]
    bare = make_prompts(3)
    assert [p.endswith(b) for p, b in zip(prompts, bare, strict=True)] == [True] * 3
    passages = [p[: -len(b)] for p, b in zip(prompts, bare, strict=True)]
    assert len(set(passages)) == 3 and all(c.startswith("w") for c in passages)
    assert specs[0]["llm_kwargs"]["max_model_len"] >= 40 + 8
    payload = json.loads((tmp_path / "out" / "results.json").read_text())
    assert payload["results"][0]["settings"]["context_source"] == str(text)


def test_greedy_context_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="greedy_context_tokens must be >= 0, got -1"):
        _options(greedy_context_tokens=-1)


def test_kernel_command_benches_what_kvarn_vllm_serves(tmp_path) -> None:
    from kvarn_eval.gpu_suites import kernel_command
    from kvarn_eval.serving.options import KERNEL_KEY_FRAMES, KERNEL_WINDOWS, ServingOptions

    cmd = kernel_command(ServingOptions(), tmp_path / "k.json")
    assert cmd[1:] == [
        "-m", "kvarn_kernels.bench", "--out", str(tmp_path / "k.json"),
        "--presets", "kvarn_k4v2_g128", "--key-frame", "auto", "--windows", "values",
    ]  # fmt: skip
    opts = ServingOptions(
        kernel_presets="kvarn_k2v2_g128, kvarn_k4v4_g128",
        kernel_key_frame="rotated",
        kernel_windows="keys",
        kernel_quick=True,
    )
    cmd = kernel_command(opts, tmp_path / "k.json")
    assert cmd[cmd.index("--presets") + 1 : cmd.index("--key-frame")] == [
        "kvarn_k2v2_g128",
        "kvarn_k4v4_g128",
    ]
    assert cmd[-5:] == ["--key-frame", "rotated", "--windows", "keys", "--quick"]
    with pytest.raises(ValueError, match="kernel_windows must be one of open, keys, values"):
        ServingOptions(kernel_windows="sink")
    with pytest.raises(ValueError, match="kernel_key_frame must be one of auto, rotated"):
        ServingOptions(kernel_key_frame="raw")
    # the choices are the bench's own
    from kvarn_kernels import bench
    from kvarn_math.tile import KEY_FRAMES

    assert KERNEL_WINDOWS == bench.WINDOWS
    assert set(KERNEL_KEY_FRAMES) == set(KEY_FRAMES)


def test_docs_coverage_table_names_the_default_caches() -> None:
    """docs/gen_tables.py lists the default caches itself (the docs session installs
    kvarn-math alone): it must follow DEFAULT_CACHES."""
    import importlib.util

    path = Path(__file__).resolve().parents[3] / "docs" / "gen_tables.py"
    if not path.is_file():
        pytest.skip("not a repository checkout")
    spec = importlib.util.spec_from_file_location("gen_tables", path)
    assert spec is not None and spec.loader is not None
    gen_tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_tables)
    labels = [c.split("@")[0] if c.startswith("fp8") else c for c in DEFAULT_CACHES]
    assert list(gen_tables.GPU_TABLE_CACHES) == labels


def test_report_names_files_it_cannot_read(tmp_path: Path) -> None:
    """A truncated results.json or run record is left out with a note, not skipped silently."""
    from kvarn_eval.serving.collect import collect_results

    good, bad = tmp_path / "good", tmp_path / "bad"
    (bad / "runs" / "capacity").mkdir(parents=True)
    good.mkdir()
    (good / "results.json").write_text(json.dumps({"results": [{"suite": "wikitext"}]}))
    (bad / "results.json").write_text('{"results": [')
    (bad / "runs" / "capacity" / "engine.json").write_text("[1, 2]")
    results, sources, dropped, notes = collect_results([good, bad])
    assert [r["suite"] for r in results] == ["wikitext"] and notes == []
    assert sources == [str(good / "results.json")]
    assert len(dropped) == 2
    assert dropped[0].startswith(f"{bad / 'results.json'}: unreadable (")
    assert dropped[1] == f"{bad / 'runs' / 'capacity' / 'engine.json'}: not a JSON object, left out"
