"""The GPU e2e script's CPU-testable pieces: metrics, prompts, log parsing, configs, and the
isolated-run plumbing (a real child process, which fails here for want of a GPU)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "e2e_smoke.py"


@pytest.fixture(scope="module")
def e2e():
    spec = importlib.util.spec_from_file_location("e2e_smoke", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["e2e_smoke"] = module
    spec.loader.exec_module(module)
    return module


def test_longest_common_prefix(e2e):
    assert e2e.longest_common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert e2e.longest_common_prefix([1, 2], [1, 2, 3]) == 2
    assert e2e.longest_common_prefix([], [1]) == 0
    assert e2e.longest_common_prefix([5], [6]) == 0


def test_compare_outputs(e2e):
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    out = [[1, 2, 3, 4], [5, 0, 7, 8], [1, 9]]
    c = e2e.compare_outputs(ref, out)
    assert c["num_prompts"] == 3
    assert c["exact_match"] == pytest.approx(1 / 3)
    assert c["mean_lcp"] == pytest.approx((4 + 1 + 0) / 3)
    assert c["median_lcp"] == 1
    assert c["mean_lcp_fraction"] == pytest.approx((1 + 0.25 + 0) / 3)
    assert c["token_agreement"] == pytest.approx((4 + 3 + 1) / 10)
    assert c["first_divergence"] == pytest.approx(0.5)
    assert c["first_token_agreement"] == pytest.approx(2 / 3)
    assert e2e.compare_outputs(ref, ref)["first_divergence"] is None
    with pytest.raises(ValueError, match="one output per prompt"):
        e2e.compare_outputs(ref, out[:2])
    with pytest.raises(ValueError):
        e2e.compare_outputs([], [])


def test_prompts(e2e):
    prompts = e2e.make_prompts(100)
    assert len(prompts) == 100 and len(set(prompts)) == 100
    shared = [p for p in prompts if p.startswith(e2e.SHARED_PREAMBLE)]
    assert len(shared) == 50
    # The shared prefix spans several 128-token tiles even at ~4 characters per token.
    assert len(e2e.SHARED_PREAMBLE) > 4 * 2 * 128
    assert len(set(e2e.make_prompts(250))) == 250
    with pytest.raises(ValueError):
        e2e.make_prompts(0)


def test_log_capture_parses_vllm_and_kvarn_lines(e2e):
    cap = e2e.LogCapture()
    log = logging.getLogger("vllm.test_e2e")
    log.addHandler(cap)
    log.setLevel(logging.INFO)
    try:
        log.info("GPU KV cache size: %s tokens", f"{1234567:,}")
        log.info(
            "kvarn: staging for open tiles: 512 slots (max_num_seqs, no concurrency cap) "
            "x 128 tokens x 32 layers = 8.000 GiB, allocated at model build"
        )
        log.info("unrelated line")
    finally:
        log.removeHandler(cap)
    assert cap.kv_cache_tokens() == 1234567
    assert cap.staging_gib() == pytest.approx(8.0)
    assert len(cap.lines) == 2


def test_kvarn_staging_log_line_matches_script(e2e, caplog):
    """The script parses the exact line kvarn_vllm.staging logs."""
    staging = pytest.importorskip("kvarn_vllm.staging")

    saved = dict(staging._STAGING)
    # Only these fields: what earlier tests in this process allocated (a sink, recent tiles)
    # would add their own lines.
    staging._STAGING.clear()
    staging._STAGING.update(bytes=3 * 2**30, layers=2, slots=4, tokens=128, logged=False)
    cap = e2e.LogCapture()
    logging.getLogger("vllm").addHandler(cap)
    kvarn_log = logging.getLogger("vllm.kvarn")
    level = kvarn_log.level
    kvarn_log.setLevel(logging.INFO)  # the test session runs vLLM at WARNING
    try:
        staging.log_staging_once()
        staging.log_staging_once()
    finally:
        kvarn_log.setLevel(level)
        logging.getLogger("vllm").removeHandler(cap)
        staging._STAGING.clear()
        staging._STAGING.update(saved)
    assert cap.staging_gib() == pytest.approx(3.0)
    assert sum("staging for open tiles" in line for line in cap.lines) == 1  # once
    assert len(cap.lines) == 1


def test_llama_shape_config(e2e, tmp_path):
    from transformers import AutoConfig

    path = e2e.llama_8b_config_dir(tmp_path)
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.num_hidden_layers == 32 and cfg.num_key_value_heads == 8
    assert cfg.hidden_size // cfg.num_attention_heads == 128


def test_random_token_prompts(e2e):
    p = e2e.random_token_prompts(3, 10, 128256)
    assert len(p) == 3 and all(len(x) == 10 for x in p)
    assert p == e2e.random_token_prompts(3, 10, 128256)
    assert all(1000 <= t < 128256 - 1000 for x in p for t in x)


def test_parse_args(e2e):
    args = e2e.parse_args(["--out", "/tmp/x", "--phase", "capacity"])
    assert args.capacity_presets[0] == "kvarn_k4v2_g128"
    assert args.gpu_memory_utilization == 0.9
    with pytest.raises(SystemExit):
        e2e.parse_args(["--out", "/tmp/x", "--presets", "kvarn_k9v9_g128"])
    with pytest.raises(SystemExit):
        e2e.parse_args(["--phase", "smoke"])  # --out missing
    with pytest.raises(SystemExit):
        e2e.parse_args(["--out", "/tmp/x", "--mode-variants", "warp-speed"])


def test_isolated_run_records_failure(e2e, tmp_path):
    """A real child process: vLLM cannot start an engine on this GPU-less host, and the
    script records that instead of crashing."""
    result = e2e.run_isolated(
        "cpu/auto",
        "auto",
        {"model": str(tmp_path / "missing")},
        [],
        4,
        None,
        tmp_path / "runs",
        timeout=300,
    )
    assert not result.ok
    assert result.error
    assert (tmp_path / "runs" / "cpu_auto.log").exists()
    spec = json.loads((tmp_path / "runs" / "cpu_auto.spec.json").read_text())
    assert spec["kv_cache_dtype"] == "auto"


def test_kvarn_checks_catch_silent_fallback(e2e):
    R = e2e.RunResult
    good = {
        "auto/eager": R(
            "auto/eager", "auto", {}, ok=True, kv_cache_tokens_logged=1000, block_size=16
        ),
        "kvarn_k4v2_g128/eager": R(
            "kvarn_k4v2_g128/eager",
            "kvarn_k4v2_g128",
            {},
            ok=True,
            kv_cache_tokens_logged=4300,
            block_size=128,
            staging_gib_logged=0.4,
        ),
    }
    assert e2e.kvarn_checks(good)["problems"] == []
    fallback = dict(good)
    fallback["kvarn_k4v2_g128/eager"] = R(
        "kvarn_k4v2_g128/eager",
        "kvarn_k4v2_g128",
        {},
        ok=True,
        kv_cache_tokens_logged=1000,
        block_size=16,
    )
    problems = e2e.kvarn_checks(fallback)["problems"]
    assert len(problems) == 3
    assert any("staging" in p for p in problems)
    assert any("block size 16" in p for p in problems)
    assert any("not more than bf16" in p for p in problems)
    # A forced cache size (the preemption mode) holds as many tokens as bf16's by design.
    forced = {"num_gpu_blocks_override": 32}
    preempt = {
        "auto/preempt": R("auto/preempt", "auto", forced, ok=True, kv_cache_tokens_config=4096),
        "kvarn_k4v2_g128/preempt": R(
            "kvarn_k4v2_g128/preempt",
            "kvarn_k4v2_g128",
            forced,
            ok=True,
            kv_cache_tokens_config=4096,
            block_size=128,
            staging_gib_logged=0.4,
        ),
    }
    assert e2e.kvarn_checks(preempt)["problems"] == []
    cap = {
        "capacity/auto": R("capacity/auto", "auto", {}, ok=True, kv_cache_tokens_logged=900),
        "capacity/kvarn_k4v4_g64": R(
            "capacity/kvarn_k4v4_g64",
            "kvarn_k4v4_g64",
            {},
            ok=True,
            kv_cache_tokens_logged=800,
            block_size=64,
            staging_gib_logged=1.0,
        ),
    }
    assert e2e.kvarn_checks(cap)["problems"] == [
        "capacity/kvarn_k4v4_g64: 800 KV tokens, not more than bf16's 900"
    ]


def test_throughput_summary(e2e):
    R = e2e.RunResult
    runs = {
        "throughput/auto": R(
            "throughput/auto",
            "auto",
            {},
            ok=True,
            generate_seconds=10.0,
            prompt_tokens=1000,
            output_tokens=100,
        ),
        "throughput/kvarn_k4v2_g128": R(
            "throughput/kvarn_k4v2_g128",
            "kvarn_k4v2_g128",
            {},
            ok=True,
            generate_seconds=5.0,
            prompt_tokens=1000,
            output_tokens=100,
        ),
        "throughput/kvarn_k4v4_g128": R(
            "throughput/kvarn_k4v4_g128", "kvarn_k4v4_g128", {}, ok=False
        ),
    }
    table = e2e.throughput_summary(runs)
    assert table["throughput/auto"]["total_tok_per_s"] == 110.0
    assert table["throughput/kvarn_k4v2_g128"]["output_tok_per_s"] == 20.0
    assert table["throughput/kvarn_k4v2_g128"]["total_vs_bf16"] == 2.0
    assert table["throughput/kvarn_k4v4_g128"] == {"ok": False}
    args = e2e.parse_args(
        ["--out", "/tmp/x", "--phase", "throughput", "--throughput-dtypes", "auto"]
    )
    assert args.throughput_prompt_len == 16384 and args.throughput_prompts == 96


def test_parse_sse(e2e):
    events, done = e2e.parse_sse(
        [
            'data: {"choices": [{"text": "Hel"}]}\n',
            "\n",
            'data: {"choices": [{"text": "lo"}]}\n',
            "data: [DONE]\n",
        ]
    )
    assert [e["choices"][0]["text"] for e in events] == ["Hel", "lo"]
    assert done


def _fake_openai_server(max_model_len: int):
    """A stand-in for vLLM's server: /health, /v1/completions (stream or not), 400 when the
    prompt is longer than the model allows, an empty completion for a prompt starting with
    "stop" unless the request sets vLLM's ``ignore_eos``."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, status, body, ctype="application/json"):
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send(200 if self.path == "/health" else 404, "{}")

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if len(req["prompt"].split()) > max_model_len:
                self._send(400, json.dumps({"error": {"message": "maximum context length"}}))
                return
            words = ["tok"] * req["max_tokens"]
            if req["prompt"].startswith("stop") and not req.get("ignore_eos"):
                words = []  # the model's first token is EOS: an empty completion
            if req.get("stream"):
                chunks = (
                    "".join(
                        f"data: {json.dumps({'choices': [{'text': w + ' '}]})}\n\n" for w in words
                    )
                    + "data: [DONE]\n\n"
                )
                self._send(200, chunks, "text/event-stream")
            else:
                self._send(200, json.dumps({"choices": [{"text": " ".join(words)}]}))

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_exercise_server_against_fake(e2e):
    server = _fake_openai_server(max_model_len=64)
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        report = e2e.exercise_server(
            base, "m", ["a b c", "stop e"] * 5, max_tokens=3, concurrency=4, max_model_len=64
        )
    finally:
        server.shutdown()
    assert report["requests"] == 10 and report["streaming"] == 5
    assert report["ok"] == 10 and report["failures"] == []
    assert report["over_long_prompt"]["status"] == 400
    assert report["over_long_prompt"]["rejected_cleanly"]
    assert report["healthy_after"]


def test_serve_command(e2e):
    cmd = e2e.serve_command("/m", "kvarn_k4v2_g128", 9000, 2048, 0.3, ["--enforce-eager"])
    assert cmd[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", "/m"]
    assert cmd[cmd.index("--kv-cache-dtype") + 1] == "kvarn_k4v2_g128"
    assert cmd[-1] == "--enforce-eager"


def test_serve_cli_accepts_kvarn_dtype():
    """The exact arguments the server phase passes parse with vLLM's own serve parser, once
    the kvarn plugin is registered. In a child process: registering widens vLLM's cache dtypes
    for the whole process, which other tests here check are vLLM's own."""
    pytest.importorskip("kvarn_vllm")
    code = f"""
import importlib.util, sys
import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform
platforms._current_platform = CpuPlatform()  # no GPU that vLLM recognizes here
import kvarn_vllm
kvarn_vllm.register()
from vllm.entrypoints.openai.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
spec = importlib.util.spec_from_file_location("e2e_smoke", {str(SCRIPT)!r})
e2e = importlib.util.module_from_spec(spec)
sys.modules["e2e_smoke"] = e2e
spec.loader.exec_module(e2e)
cmd = e2e.serve_command("/m", "kvarn_k4v2_g128", 9000, 2048, 0.3, ["--served-model-name", "smollm2"])
args = make_arg_parser(FlexibleArgumentParser()).parse_args(cmd[5:])
assert args.kv_cache_dtype == "kvarn_k4v2_g128", args.kv_cache_dtype
assert args.port == 9000 and args.max_model_len == 2048, (args.port, args.max_model_len)
print("OK")
"""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "VLLM_LOGGING_LEVEL": "WARNING"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("OK")


def test_preempt_variant_sizes_the_cache_per_block_size(e2e):
    extra = e2e.MODE_VARIANTS["preempt"]
    kvarn = e2e._cache_kwargs("kvarn_k4v2_g128", {"max_num_seqs": 8, **extra})
    bf16 = e2e._cache_kwargs("auto", {"max_num_seqs": 8, **extra})
    assert kvarn["num_gpu_blocks_override"] == extra["_cache_tokens"] // 128
    assert bf16["num_gpu_blocks_override"] == extra["_cache_tokens"] // 16
    assert "_cache_tokens" not in kvarn and kvarn["disable_log_stats"] is False
    assert e2e._cache_kwargs("auto", {"seed": 0}) == {"seed": 0}


def test_preemptions_read_from_metrics(e2e):
    class Counter:
        def __init__(self, name, value):
            self.name, self.value = name, value

    class FakeLLM:
        def get_metrics(self):
            return [Counter("vllm:num_preemptions", 3), Counter("vllm:prompt_tokens", 99)]

    assert e2e._preemptions(FakeLLM()) == 3
    assert e2e._preemptions(object()) is None


def test_awq_shape_config_is_what_vllm_parses(e2e, tmp_path):
    from vllm.model_executor.layers.quantization import get_quantization_config

    path = e2e.awq_8b_config_dir(tmp_path)
    config = json.loads((path / "config.json").read_text())
    assert config["hidden_size"] == e2e.LLAMA_8B_SHAPE["hidden_size"]
    awq = get_quantization_config("awq").from_config(config["quantization_config"])
    assert (awq.weight_bits, awq.group_size, awq.zero_point) == (4, 128, True)
    # Every quantized projection's input width is a whole number of AWQ groups.
    for width in (config["hidden_size"], config["intermediate_size"]):
        assert width % awq.group_size == 0


def test_quant_phase_is_selectable(e2e):
    assert e2e.parse_args(["--out", "x", "--phase", "quant"]).phase == "quant"


def test_modes_batch1_runs_a_prefix_of_the_prompts(e2e, monkeypatch, tmp_path):
    """batch1 runs the first 25 prompts (one request at a time is slow) and is compared with
    the reference's first 25 outputs."""
    seen = {}

    def fake_run(name, kv, kwargs, prompts, max_tokens):
        seen[name] = (len(prompts), kwargs)
        outs = [[i, 1, 2] for i in range(len(prompts))]
        kvarn = kv != "auto"  # a kvarn run logs its staging and holds more tokens
        return e2e.RunResult(
            name,
            kv,
            dict(kwargs),
            ok=True,
            outputs=outs,
            staging_gib_logged=1.0 if kvarn else None,
            kv_cache_tokens_config=4000 if kvarn else 1000,
        )

    monkeypatch.setattr(e2e, "smoke_model", lambda args: tmp_path)
    monkeypatch.setattr(e2e, "_runner", lambda args, out: fake_run)
    args = e2e.parse_args(["--phase", "modes", "--mode-variants", "batch1", "--out", str(tmp_path)])
    assert e2e.phase_smoke(args, tmp_path)
    assert seen["auto/eager"][0] == args.num_prompts
    assert seen["auto/batch1"][0] == 25 and seen["auto/batch1"][1]["max_num_seqs"] == 1
    assert "_num_prompts" not in seen["auto/batch1"][1]
    pairs = json.loads((tmp_path / "modes.json").read_text())["mode_pairs"]
    assert pairs["auto: eager vs batch1"]["num_prompts"] == 25
    assert pairs["auto: eager vs batch1"]["exact_match"] == 1.0


def test_environment_records_kvarn_settings(e2e, monkeypatch):
    """Results carry the KVARN_* variables they ran under (batch-invariant mode, full
    speculative graphs, ...), and nothing else of the environment."""
    monkeypatch.setenv("KVARN_VLLM_SPEC_FULL_GRAPHS", "1")
    monkeypatch.setenv("KVARN_KERNELS_BATCH_INVARIANT", "1")
    monkeypatch.setenv("NOT_KVARN_X", "secret")
    env = e2e.environment()["kvarn_env"]
    assert env["KVARN_VLLM_SPEC_FULL_GRAPHS"] == "1"
    assert env["KVARN_KERNELS_BATCH_INVARIANT"] == "1"
    assert all(k.startswith("KVARN_") for k in env)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed process nobody reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_sigterm_to_the_script_stops_the_engine_group(tmp_path):
    """An outer ``timeout`` SIGTERMs the script while an engine runs in ``run_child``: the
    child's group (vLLM's engine core is a grandchild) is stopped before the script exits,
    so the next engine does not find its GPU memory taken (H200, 2026-12-03)."""
    import signal
    import subprocess
    import textwrap
    import time

    pid_file = tmp_path / "grandchild.pid"
    child = tmp_path / "child.py"
    child.write_text(
        textwrap.dedent(
            f"""
            import subprocess, sys, time
            g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            open({str(pid_file)!r}, "w").write(str(g.pid))
            time.sleep(600)
            """
        )
    )
    parent = tmp_path / "parent.py"
    parent.write_text(
        textwrap.dedent(
            f"""
            import importlib.util, sys
            spec = importlib.util.spec_from_file_location("e2e_smoke", {str(SCRIPT)!r})
            module = importlib.util.module_from_spec(spec)
            sys.modules["e2e_smoke"] = module
            spec.loader.exec_module(module)
            module.run_child([sys.executable, {str(child)!r}], 600)
            """
        )
    )
    proc = subprocess.Popen([sys.executable, str(parent)])
    deadline = time.monotonic() + 120
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, "the child never started"
        time.sleep(0.1)
    grandchild = int(pid_file.read_text())
    assert _running(grandchild)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 128 + signal.SIGTERM
    assert not _running(grandchild)
