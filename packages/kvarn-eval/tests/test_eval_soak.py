"""The soak (scripts/soak.py, its client kvarn_eval.serving.soak) against a fake
OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from kvarn_eval.serving import soak

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "soak.py"


def _load():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("soak_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak_script"] = module
    spec.loader.exec_module(module)
    return module


script = _load()


class FakeServer:
    """/health, /metrics and /v1/completions (streamed as chunked server-sent events, or one
    JSON body), deterministic text; ``nan_every`` answers NaN log-probabilities,
    ``fail_every`` a 500, ``drift`` changes greedy answers after the first ``drift`` probes."""

    def __init__(
        self,
        nan_every: int = 0,
        fail_every: int = 0,
        drift: int = 0,
        bad_token_every: int = 0,
        first_token_drift: bool = False,
    ) -> None:
        self.nan_every, self.fail_every, self.drift = nan_every, fail_every, drift
        self.bad_token_every, self.first_token_drift = bad_token_every, first_token_drift
        self.completions = self.aborted = self.preemptions = 0
        self.greedy_prompts: list[str] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request_line = (await reader.readline()).decode().split()
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        body = json.loads(await reader.readexactly(length)) if length else None
        path = request_line[1]
        try:
            if path == "/health":
                await self._send(writer, 200, b"")
            elif path == "/metrics":
                text = (
                    "# HELP vllm:num_preemptions_total x\n"
                    f'vllm:num_preemptions_total{{model_name="m"}} {self.preemptions}.0\n'
                    f'vllm:generation_tokens_total{{model_name="m"}} {4 * self.completions}.0\n'
                    'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n'
                )
                await self._send(writer, 200, text.encode(), "text/plain")
            else:
                await self._complete(writer, body)
        except ConnectionError:
            self.aborted += 1
        finally:
            writer.close()

    async def _send(self, writer: asyncio.StreamWriter, status: int, data: bytes, kind="") -> None:
        head = f"HTTP/1.1 {status} X\r\nContent-Length: {len(data)}\r\n"
        writer.write((head + (f"Content-Type: {kind}\r\n" if kind else "") + "\r\n").encode())
        writer.write(data)
        await writer.drain()

    async def _complete(self, writer: asyncio.StreamWriter, body: dict[str, Any]) -> None:
        self.completions += 1
        n = self.completions
        self.preemptions += n % 3 == 0
        if self.fail_every and n % self.fail_every == 0:
            await self._send(writer, 500, b'{"error": "boom"}')
            return
        text = f" answer to {body['prompt'][-12:]!r}"
        ids = [len(body["prompt"]) % 100, 7, 8]  # greedy answers depend on the prompt only
        if body.get("temperature") == 0.0 and not body.get("stream"):
            self.greedy_prompts.append(body["prompt"])
            if self.drift and len(self.greedy_prompts) > self.drift:
                text += " drifted"
            if self.first_token_drift and len(self.greedy_prompts) > 12:
                ids[0] += 1  # the load's repeats start differently from the probes
        if self.bad_token_every and n % self.bad_token_every == 0:
            ids[1] = 10**6
        choices: list[dict[str, Any]] = []
        for index in range(int(body.get("n", 1))):
            choice: dict[str, Any] = {"index": index, "text": text, "finish_reason": "length"}
            if body.get("return_token_ids"):
                choice["token_ids"] = ids
            if body.get("logprobs"):
                bad = self.nan_every and n % self.nan_every == 0
                choice["logprobs"] = {"token_logprobs": [-0.5, float("nan") if bad else -1.0]}
            choices.append(choice)
        if not body.get("stream"):
            await self._send(writer, 200, json.dumps({"choices": choices}).encode())
            return
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        pieces = text.split(" ")
        for i, piece in enumerate([*pieces, None]):
            delta = {"text": piece, "token_ids": ids[i : i + 1] if i < len(pieces) - 1 else []}
            event = "[DONE]" if piece is None else json.dumps({"choices": [delta]})
            data = f"data: {event}\n\n".encode()
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            await writer.drain()
            await asyncio.sleep(0.002)
        writer.write(b"0\r\n\r\n")
        await writer.drain()


async def _with_server(fake: FakeServer, body):  # type: ignore[no-untyped-def]
    server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        return await body(f"http://127.0.0.1:{port}")
    finally:
        server.close()
        await server.wait_closed()


def _args(**kw: Any):  # type: ignore[no-untyped-def]
    defaults = dict(
        minutes=2.0 / 60,
        concurrency=4,
        seed=1,
        long_repeats=2,
        probe_tokens=8,
        poll_seconds=0.5,
        warmup_seconds=0.0,
        memory_slack_mib=256.0,
    )
    return type("Args", (), defaults | kw)()


def test_soak_client_passes_on_a_healthy_server() -> None:
    fake = FakeServer()
    # 10 s of load: enough requests for every kind even on a loaded 2-core CI machine (2 s gave
    # 7 requests there), so the assertions below do not depend on the machine's speed
    result = asyncio.run(_with_server(fake, lambda base: soak.soak(base, _args(minutes=10 / 60))))
    load = result["load"]
    assert result["passed"], result
    assert load["requests"] >= 8 and load["failed"] == 0
    assert load["cancelled"] > 0 and fake.aborted + load["cancelled"] > 0
    kinds = set(load["by_kind"])
    assert {"long-plain", "short-plain", "long-stream", "short-stream"} <= kinds
    assert any(k.endswith("-cancelled") for k in kinds)
    assert any(k.endswith("-n") for k in kinds) and "repeat" in kinds
    assert result["probes_same"] == result["probes"] == 6
    repeats = result["repeats"]
    assert repeats["count"] == load["by_kind"]["repeat"] and repeats["distinct"] == 1
    assert repeats["first_token_differs"] == 0 and repeats["min_common_prefix"] == 3
    delta = result["metrics_delta"]
    assert delta["vllm:num_preemptions"] > 0
    assert delta["vllm:generation_tokens"] == 4 * load["requests"] + 4 * 6  # + the probes after
    assert len(result["samples"]) >= 2 and result["healthy_after"]


@pytest.mark.parametrize(
    ("fake", "what"),
    [
        (FakeServer(nan_every=2), "non-finite log-probability"),
        (FakeServer(fail_every=7), "status 500"),
        (FakeServer(bad_token_every=3), "token ids outside [0, 49152)"),
    ],
)
def test_soak_client_reports_bad_answers(fake: FakeServer, what: str) -> None:
    # long enough for the 7th request (fail_every=7) on a loaded machine
    args = _args(minutes=6 / 60, vocab=49152)
    result = asyncio.run(_with_server(fake, lambda base: soak.soak(base, args)))
    assert not result["passed"]
    problems = [p for f in result["load"]["failures"] for p in f["problems"]]
    assert any(what in p for p in problems), problems


def test_soak_client_reports_probes_that_change() -> None:
    fake = FakeServer(drift=12)  # the two runs before the load agree, the one after does not
    result = asyncio.run(_with_server(fake, lambda base: soak.soak(base, _args())))
    assert not result["passed"] and result["probes_same"] == 0
    assert result["probe_mismatches"][0]["after"].endswith("drifted")


def test_soak_client_fails_repeats_that_start_differently() -> None:
    fake = FakeServer(first_token_drift=True)  # garbage-like: even the first token changes
    result = asyncio.run(_with_server(fake, lambda base: soak.soak(base, _args(minutes=6 / 60))))
    assert result["load"]["failed"] == 0 and result["repeats"]["count"] > 0
    assert result["repeats"]["first_token_differs"] == result["repeats"]["count"]
    assert not result["passed"]


def test_completion_problems_checks_choices_and_ids() -> None:
    spec = {"stream": False, "payload": {"n": 2, "return_token_ids": True}}
    one = {"index": 0, "text": "a", "token_ids": [1, 2], "finish_reason": "length"}
    assert soak.completion_problems(soak.Reply(200, {"choices": [one]}), spec, 10) == [
        "1 choices, asked for 2"
    ]
    two = {**one, "index": 1, "token_ids": None}
    assert soak.completion_problems(soak.Reply(200, {"choices": [one, two]}), spec, 10) == [
        "choice 1: no token ids"
    ]
    # an answer that stopped at once is fine; one cut by length with nothing in it is not
    stop = {"index": 0, "text": "", "token_ids": [], "finish_reason": "stop"}
    plain = {"stream": False, "payload": {}}
    assert soak.completion_problems(soak.Reply(200, {"choices": [stop]}), plain) == []
    empty = {**stop, "finish_reason": "length"}
    assert soak.completion_problems(soak.Reply(200, {"choices": [empty]}), plain)


def test_repeat_summary_and_load_seconds() -> None:
    serial = [[5, 6, 7], [5, 6, 9]]
    got = soak.repeat_summary([[5, 6, 7], [5, 6, 8], [4, 6, 7]], serial)
    assert got == {
        "count": 3,
        "distinct": 3,
        "equal_to_a_serial_answer": 1,
        "min_common_prefix": 0,
        "first_token_differs": 1,
    }
    args = soak.argparse.Namespace(minutes=8.0, budget_minutes=8.0, reserve_seconds=90.0)
    args.started = soak.time.monotonic() - 150  # a 150 s start-up: 8 min - 150 s - 90 s left
    assert 235 < soak.load_seconds(args) <= 240
    args.budget_minutes = None
    assert soak.load_seconds(args) == 480


def test_metrics_and_memory_helpers() -> None:
    totals = soak.parse_metrics('# c\na_total{x="1"} 2\na_total{x="2"} 3.5\nb 1e3\n')
    assert soak.metric(totals, "a") == 5.5 and soak.metric(totals, "b") == 1000.0
    assert soak.metric(totals, "c") is None
    samples = [{"t": 0, "gpu_mib": 10.0}, {"t": 5, "gpu_mib": 500.0}, {"t": 9, "gpu_mib": 600}]
    assert soak.memory_steady(samples, 4, 256) is True
    assert soak.memory_steady(samples, 0, 256) is False
    assert soak.memory_steady([{"t": 1, "gpu_mib": None}], 0, 1) is None


def test_serve_command_has_the_soaks_settings() -> None:
    args = script.parse_args(["--out", "x", "--", "--enforce-eager"])
    cmd = script.serve_command("/m", args)
    text = " ".join(cmd)
    assert "--kv-cache-dtype kvarn_k4v2_g128" in text and "--enable-prefix-caching" in text
    assert "--enable-chunked-prefill --max-num-batched-tokens 384" in text
    assert "--num-gpu-blocks-override 48" in text  # 6144 tokens in 128-token tiles
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec["method"] == "ngram" and cmd[-1] == "--enforce-eager"
    args = script.parse_args(["--out", "x", "--no-speculation"])
    assert "--speculative-config" not in script.serve_command("/m", args)


def test_model_helpers_and_log_counts(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 49152}))
    assert script.vocab_size(str(tmp_path)) == 49152 and script.vocab_size("/nowhere") is None
    log = "INFO ok: no ERROR here\nTraceback (most recent call last):\n"
    log += "(EngineCore pid=7) ERROR 12-06 16:01:02 [core.py:1] boom\nERROR 12-06 16:01:03 x\n"
    log += "WARNING 12-06 16:01:04 kvarn: keys or values ... were stored saturated; ...\n"
    counts = script.log_counts(log)
    assert counts == {"tracebacks": 1, "error_lines": 2, "kvarn_saturation_warnings": 1}
    # the converter beside the script is found (not run: no GGUF here)
    args = script.parse_args(["--out", "x", "--gguf", str(tmp_path / "missing.gguf")])
    with pytest.raises(SystemExit, match="GGUF not found"):
        script.resolve_model(args)


def test_script_main_against_a_running_server(tmp_path: Path) -> None:
    """The script's main with ``--url`` (no launch): soak.json written, exit status 0."""
    import threading

    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def start() -> None:
        server = await asyncio.start_server(FakeServer().handle, "127.0.0.1", 0)
        box["port"] = server.sockets[0].getsockname()[1]
        box["server"] = server
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()))
    thread.start()
    try:
        assert ready.wait(10)
        argv = [
            "--out", str(tmp_path), "--url", f"http://127.0.0.1:{box['port']}", "--minutes",
            str(3 / 60), "--concurrency", "2", "--poll-seconds", "0.5", "--warmup-seconds", "0",
        ]  # fmt: skip
        assert script.main(argv) == 0
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    result = json.loads((tmp_path / "soak.json").read_text())
    assert result["passed"] and result["load"]["requests"] >= 4 and result["command"] == argv
    assert "startup_seconds" in result and "server_log" not in result  # nothing launched
