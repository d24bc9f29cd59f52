"""The hybrid GPU evidence script's scheduling and report, on the CPU with a stand-in engine.

``packages/kvarn-eval/scripts/hybrid_evidence.py`` runs some 35 vLLM engines in one GPU call,
several side by side. Its GPU run happens once, so what can go wrong around the engines is
checked here with a stand-in for ``hybrid_engine.py`` (a small script that sleeps, logs the KV
capacity line as vLLM does and writes a result, or hangs, or fails): no more engines at once
than ``--parallel`` or the memory estimate allows, a hung engine stopped at its timeout, the
rest skipped when the budget is spent, and the report's arithmetic and greedy comparisons.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "kvarn-eval" / "scripts"

FAKE_ENGINE = textwrap.dedent(
    """
    import json, sys, time
    spec = json.load(open(sys.argv[1]))
    launched = time.time()
    cache, mode = spec["cache"], spec["mode"]
    if "hang" in spec["name"]:
        time.sleep(600)
    if cache == "fp8":
        print("ValueError: no fp8 here", flush=True)
        sys.exit(3)
    time.sleep(0.6)
    block = {"auto": 1040, "kvarn_k4v2_g128": 5120}[cache]
    page = {"auto": 4259840, "kvarn_k4v2_g128": 4346880}[cache]
    pool = spec["llm_kwargs"]["kv_cache_memory_bytes"]
    blocks = pool // (page * 4)
    per_request = {"auto": 38, "kvarn_k4v2_g128": 13}[cache]
    print(f"GPU KV cache size: {int(blocks / per_request * 32768):,} tokens", flush=True)
    up = time.time()
    outputs = [[1, 2, 3, 4]] * 3
    if cache != "auto" and mode == "eager-prefix":
        outputs = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 4]]
    result = {"name": spec["name"], "cache": cache, "ok": True, "launched": launched,
              "up": up, "startup_s": up - launched, "block_size": block,
              "num_gpu_blocks": blocks, "mamba_cache_mode": "none", "outputs": outputs}
    if spec.get("burst"):
        start = time.time(); time.sleep(0.2); end = time.time()
        result["burst"] = {"start": start, "end": end, "wall_s": end - start,
                           "output_tokens": 8, "output_tok_per_s": 40.0,
                           "total_tok_per_s": 100.0 if cache == "auto" else 150.0}
    result["seconds"] = time.time() - launched
    json.dump(result, open(sys.argv[2], "w"))
    """
)


def _script():
    sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location("hybrid_evidence", SCRIPTS / "hybrid_evidence.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_jobs_run_side_by_side_within_limits_and_report(tmp_path, registered):
    script = _script()
    fake = tmp_path / "fake_engine.py"
    fake.write_text(FAKE_ENGINE)
    out = tmp_path / "out"
    argv = ["--out", str(out), "--engine-script", str(fake), "--shapes", "nemotron-h-8b"]
    argv += ["--caches", "auto", "kvarn_k4v2_g128", "fp8", "--parallel", "2"]
    argv += ["--only", "kvarn_k4v2_g128|auto-eager-noprefix|auto-graphs-noprefix|fp8"]
    argv += ["--budget", "60", "--min-left", "1", "--bf16-backend", "none"]
    assert script.main(argv) == 1  # the fp8 engine fails: recorded, the rest carry on
    payload = json.loads((out / "hybrid.json").read_text())
    runs = {r["name"]: r for r in payload["runs"]}
    assert len(runs) == 7, sorted(runs)
    # Only results, the engines' log tails and the configs come back (no spec files).
    assert (out / "logs" / "nemotron-h-8b-fp8-eager-noprefix.log").read_text().strip()
    assert not list(out.rglob("*.spec.json"))
    failed = runs["nemotron-h-8b-fp8-eager-noprefix"]
    assert not failed["ok"] and "exit 3" in failed["error"] and "no fp8 here" in failed["error"]
    # Never more than two engines alive at once (launch to end, from the engines' own clocks).
    spans = [(r["launched"], r["launched"] + r["seconds"]) for r in runs.values() if r["ok"]]
    for t, _ in spans:
        assert sum(a <= t < b for a, b in spans) <= 2
    kvarn = runs["nemotron-h-8b-kvarn_k4v2_g128-eager-noprefix"]
    # The capacity is set beside the arithmetic of its pages in the same pool.
    assert kvarn["blocks_per_request"] == 13 and kvarn["measured_over_expected"] == 1
    assert kvarn["vs_first"] == pytest.approx(38 / 13 * 4259840 / 4346880, rel=0.02)
    assert kvarn["bits_per_element"] == pytest.approx(106.125 * 8 / 256, abs=0.01)
    # Greedy: each run against its cache's eager prefix-off run, and against bf16's.
    prefix = runs["nemotron-h-8b-kvarn_k4v2_g128-eager-prefix"]
    assert (prefix["agreement"], prefix["exact_prompts"]) == (round(11 / 12, 4), 2)
    assert runs["nemotron-h-8b-kvarn_k4v2_g128-graphs-prefix"]["agreement"] == 1
    assert kvarn["vs_bf16"] == 1
    table = (out / "hybrid.md").read_text()
    assert "| `kvarn_k4v2_g128` | 3.32 | 5,120 | 13 |" in table
    assert "against TurboQuant at equal or more bits (none measured): ahead" in table
    assert "| `kvarn_k4v2_g128` | 0.2" in table and "| 1.5 |" in table  # burst vs bf16
    assert "nemotron-h-8b-fp8-eager-noprefix: no result (exit 3): ValueError: no fp8" in table


def test_a_hung_engine_is_stopped_and_the_budget_skips_the_rest(tmp_path, registered):
    script = _script()
    fake = tmp_path / "fake_engine.py"
    fake.write_text(FAKE_ENGINE.replace('"hang" in spec["name"]', 'spec["cache"] == "auto"'))
    out = tmp_path / "out"
    argv = ["--out", str(out), "--engine-script", str(fake), "--shapes", "nemotron-h-8b"]
    argv += ["--caches", "auto", "kvarn_k4v2_g128", "--parallel", "1", "--budget", "8"]
    argv += ["--min-left", "2", "--engine-timeout", "3", "--only", "eager-noprefix"]
    argv += ["--bf16-backend", "none"]
    assert script.main(argv) == 1
    runs = {r["name"]: r for r in json.loads((out / "hybrid.json").read_text())["runs"]}
    hung = runs["nemotron-h-8b-auto-eager-noprefix"]
    assert not hung["ok"] and "stopped (time limit)" in hung["error"]
    assert runs["nemotron-h-8b-kvarn_k4v2_g128-eager-noprefix"]["ok"]
    # With 8 s and engines of 3 s (the hung one) the third job cannot start any more.
    skipped = [r for r in runs.values() if r.get("skipped")]
    assert all(r["error"] == "skipped: --budget spent" for r in skipped)


def test_dry_run_plans_every_row_of_the_issue(tmp_path, registered, capsys):
    script = _script()
    assert script.main(["--dry-run", "--out", str(tmp_path), "--bf16-backend", "none"]) == 0
    args = script.parse_args(["--bf16-backend", "none"])
    script._prepare(args, tmp_path)
    jobs = script.plan_jobs(args)
    names = {j["name"] for j in jobs}
    for shape in script.SHAPES:
        for cache in script.DEFAULT_CACHES:  # capacity of every cache
            assert any(n.startswith(f"{shape}-{cache}-") for n in names), (shape, cache)
        for mode in script.MODES:  # greedy under every mode for kvarn
            assert f"{shape}-kvarn_k4v2_g128-{mode}" in names
        bursts = {j["cache"] for j in jobs if j["shape"] == shape and j.get("burst")}
        assert bursts == {"auto", "turboquant_4bit_nc", "kvarn_k4v2_g128"}
    mtp = next(j for j in jobs if j["name"] == "qwen3-next-80b-kvarn_k4v2_g128-eager-noprefix-mtp")
    assert mtp["env"] == {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    assert mtp["llm_kwargs"]["speculative_config"]["method"] == "mtp"
    graphs = next(j for j in jobs if j["mode"] == "graphs-prefix")
    assert graphs["llm_kwargs"]["compilation_config"]["cudagraph_mode"] == "FULL_DECODE_ONLY"
    # Three engines fit the memory the scheduler allows at once.
    assert 3 * max(j["est_gib"] for j in jobs) <= args.gpu_gib
    # Every prompt shares a prefix longer than one kvarn block (so the second batch hits it).
    first, rest = args.batches["nemotron-h-8b"]
    assert all(p[:6144] == first[0][:6144] for p in rest) and len(rest) == 7
    assert "35 engines" in capsys.readouterr().out


def test_stop_waits_for_a_grandchild_that_outlives_the_child():
    """vLLM's engine core is a grandchild; one that outlives the engine's process would hold
    its GPU memory while the next engine checks for free memory."""
    import subprocess
    import time

    script = _script()
    code = "import subprocess; subprocess.Popen(['sleep', '60']); print('spawned', flush=True)"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    proc.wait(timeout=30)
    assert script._group_alive(proc.pid)  # the child is gone, its grandchild is not
    start = time.time()
    script._stop(proc)
    assert not script._group_alive(proc.pid) and time.time() - start < 10
