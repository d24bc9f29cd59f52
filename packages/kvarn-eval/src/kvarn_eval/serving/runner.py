"""Each vLLM engine in its own process: GPU memory is freed between runs, a crash is a record.

:func:`run_job` writes the job as JSON, starts ``python -m kvarn_eval.serving.worker SPEC RESULT``
in a new session (its own process group, so that vLLM's engine-core and tensor-parallel workers
die with it), sends the worker's output to a log file, relays the worker's progress lines, and
kills the group when the job's time is up. The worker rewrites its result file after every
phase (start-up, each prompt length), so a killed run keeps what it finished. The record that
comes back merges that file with the status (``ok``, ``failed``, ``timeout``), the exit code,
what the log says (vLLM's ``GPU KV cache size``, kvarn's staging), and a log tail on failure.

:class:`Budget` spreads a ``--max-seconds`` budget over the runs: each gets at most what is left,
and runs that cannot get a useful minimum are skipped (recorded as such).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "PROGRESS_PREFIX",
    "Budget",
    "EngineJob",
    "finished_record",
    "group_members",
    "parse_log",
    "run_job",
    "sigterm_raises",
    "skipped_record",
    "slugify",
    "stop_process_group",
    "worker_command",
]

# worker lines starting with this are relayed to the terminal
PROGRESS_PREFIX = "[kvarn-eval worker]"
_KV_TOKENS = re.compile(r"GPU KV cache size:\s*([\d,]+)\s*tokens")
_STAGING = re.compile(r"kvarn: staging for open tiles: .*?= ([\d.]+) GiB")
_CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")


@dataclass
class EngineJob:
    """One engine's work, as the worker receives it (JSON).

    Attributes:
        suite: the suite that asked for it (``capacity``, ``throughput``, ``vllm_greedy``).
        name: unique within the run, e.g. ``llama-3.1-8b/tp1/kvarn_k4v2_g128``.
        cache: the cache's ``label``, ``kv_cache_dtype`` and ``backend``.
        llm_kwargs: every ``vllm.LLM`` keyword argument (the cache's included).
        workload: ``{"kind": "capacity" | "throughput" | "greedy", ...}`` (see the worker).
        meta: what tables need besides (model shape name, head_dim, layers, ...).
        env: extra environment variables of the worker.
    """

    suite: str
    name: str
    cache: dict[str, Any]
    llm_kwargs: dict[str, Any]
    workload: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    def engine_key(self) -> str:
        """Identifies the engine configuration (two jobs with one key start identical engines)."""
        return json.dumps([self.llm_kwargs, self.env], sort_keys=True)


def slugify(name: str) -> str:
    """A file-name-safe form of ``name``.

    Args:
        name: any run name.
    """
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "run"


def worker_command(spec_path: Path, result_path: Path) -> list[str]:
    """The worker's command line (this interpreter, so the same environment).

    Args:
        spec_path: the job's JSON.
        result_path: where the worker writes its result.
    """
    return [
        sys.executable,
        "-m",
        "kvarn_eval.serving.worker",
        str(spec_path),
        str(result_path),
    ]


def parse_log(text: str) -> dict[str, Any]:
    """What the worker's log says about the engine (``None`` where a line is absent).

    Args:
        text: the log's text.

    Returns:
        ``kv_cache_tokens_logged`` (vLLM's ``GPU KV cache size``), ``max_concurrency_logged``,
        ``staging_gib_logged`` (kvarn's staging for open tiles), the last of each.
    """
    tokens = _KV_TOKENS.findall(text)
    staging = _STAGING.findall(text)
    concurrency = _CONCURRENCY.findall(text)
    return {
        "kv_cache_tokens_logged": int(tokens[-1].replace(",", "")) if tokens else None,
        "max_concurrency_logged": float(concurrency[-1][1]) if concurrency else None,
        "staging_gib_logged": float(staging[-1]) if staging else None,
    }


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_process_group(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM to the process group of ``proc``, SIGKILL after ``grace`` seconds, reap ``proc``.

    Args:
        proc: a process started with ``start_new_session=True`` (it leads its group).
        grace: seconds between SIGTERM and SIGKILL.
    """
    _kill_group(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)
    _kill_group(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    # vLLM's engine core and workers are grandchildren: wait until they are gone, so that the
    # next engine does not find their GPU memory still in use
    deadline = time.monotonic() + 30
    while group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Inside, SIGTERM raises ``SystemExit`` (main thread only), so ``finally`` blocks stop the
    engine's process group when this process is killed.

    An outer ``timeout`` sends SIGTERM, whose default action ends the process without running
    them; vLLM's engine core, in a session of its own, then lives on and keeps its GPU memory
    from the next engine. A second SIGTERM during that clean-up is ignored.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``, from ``/proc`` (Linux).

    Args:
        pgid: the process group id.
    """
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # after the command name: state, ppid, pgrp
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


# vLLM's prefixes on an engine-core process's log lines: "(EngineCore pid=N) " and, on logged
# tracebacks, "ERROR MM-DD HH:MM:SS [core.py:1330] ".
_ENGINE_PREFIX = re.compile(r"^\((?:EngineCore|Worker)[^)]*\)\s*(?:ERROR \S+ \S+ \[[^\]]*\]\s*)?")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|OutOfResources)\b")
# The front end's wrapper for any engine start-up failure; the cause is earlier in the log.
_WRAPPER = "Engine core initialization failed"


def _error_summary(text: str, limit: int = 400) -> str:
    """The most telling line of a failure: the last exception line, else the last line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if _EXCEPTION_LINE.match(line):
            return line[:limit]
    return lines[-1][:limit] if lines else ""


def root_cause(text: str, limit: int = 400) -> str:
    """The engine core's own exception line in a worker log ("" if none), for failures that
    vLLM's front end reports only as "Engine core initialization failed. See root cause above."
    """
    for raw in reversed(text.strip().splitlines()):
        line = _ENGINE_PREFIX.sub("", raw.strip())
        if line != raw.strip() and _EXCEPTION_LINE.match(line) and _WRAPPER not in line:
            return line[:limit]
    return ""


def skipped_record(job: EngineJob, reason: str) -> dict[str, Any]:
    """The record of a job that was not started.

    Args:
        job: the job.
        reason: why (shown in tables).
    """
    return {
        **_identity(job),
        "status": "skipped",
        "error": reason,
        "seconds": 0.0,
    }


def _identity(job: EngineJob) -> dict[str, Any]:
    return {
        "suite": job.suite,
        "name": job.name,
        "cache": job.cache,
        "meta": job.meta,
        "settings": {k: v for k, v in job.llm_kwargs.items() if k != "model"},
        "workload": {k: v for k, v in job.workload.items() if k != "prompts"},
    }


def finished_record(job: EngineJob, workdir: Path) -> dict[str, Any] | None:
    """The record :func:`run_job` left in ``workdir`` for this same job, if that run finished
    ``ok``; else ``None`` (no record, another job under the same name, or a run that failed,
    timed out or was interrupted).

    Args:
        job: the job about to run.
        workdir: the folder :func:`run_job` writes to.
    """
    slug = slugify(job.name)
    spec = _read_json(workdir / f"{slug}.spec.json")
    record = _read_json(workdir / f"{slug}.json")
    if spec is None or record is None or record.get("status") != "ok":
        return None
    if spec != json.loads(json.dumps(asdict(job))):
        return None
    return {**record, "resumed": True}


def run_job(
    job: EngineJob,
    workdir: Path,
    timeout: float,
    *,
    command: Sequence[str] | None = None,
    echo: Callable[[str], None] | None = print,
    poll_seconds: float = 0.5,
    exit_grace: float = 60.0,
) -> dict[str, Any]:
    """Run ``job`` in a fresh process and return its record (also written to ``workdir``).

    Args:
        job: what to run.
        workdir: folder for ``<slug>.spec.json``, ``<slug>.json`` (the record) and ``<slug>.log``.
        timeout: seconds before the process group is killed (the record then says ``timeout``
            and keeps the phases the worker finished).
        command: the command line (default :func:`worker_command`); tests pass a stand-in.
        echo: receives the worker's progress lines and a status line (``None``: silent).
        poll_seconds: how often the worker is checked.
        exit_grace: seconds a worker that reported completion gets to exit before it is
            killed (vLLM's shutdown can hang with tensor-parallel workers).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    slug = slugify(job.name)
    spec_path = workdir / f"{slug}.spec.json"
    result_path = workdir / f"{slug}.json"
    log_path = workdir / f"{slug}.log"
    spec_path.write_text(json.dumps(asdict(job), indent=1))
    result_path.unlink(missing_ok=True)
    cmd = list(command) if command is not None else worker_command(spec_path, result_path)
    env = {**os.environ, **job.env, "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    status = "failed"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    relayed = 0
    completed_at: float | None = None
    killed_at = 0.0
    with sigterm_raises():
        try:
            while True:
                returncode = proc.poll()
                relayed = _relay(log_path, relayed, echo)
                if returncode is not None:
                    status = "ok" if returncode == 0 else "failed"
                    break
                now = time.monotonic()
                if now - start > timeout:
                    status = "timeout"
                    killed_at = time.time()
                    break
                if completed_at is None:
                    partial = _read_json(result_path)
                    if partial is not None and partial.get("complete"):
                        completed_at = now
                elif now - completed_at > exit_grace:
                    status = "ok"  # finished its work; only the exit hung
                    break
                time.sleep(poll_seconds)
        finally:
            stop_process_group(proc, grace=20.0)
            _relay(log_path, relayed, echo)
    seconds = time.monotonic() - start
    log_text = log_path.read_text(errors="replace")
    worker = _read_json(result_path) or {}
    record: dict[str, Any] = {**worker, **_identity(job)}
    if status == "ok" and not worker.get("complete"):
        status = "failed"
    record["status"] = status
    record["returncode"] = proc.returncode
    record["seconds"] = round(seconds, 1)
    record["timeout_s"] = timeout
    record["log"] = str(log_path)
    record.update(parse_log(log_text))
    if status != "ok":
        if status == "timeout":
            record["error"] = (
                f"killed after {timeout:.0f} s{_where(worker, killed_at)} (kept what finished)"
            )
        elif not record.get("error"):
            record["error"] = _error_summary(log_text) or f"exit status {proc.returncode}"
        if _WRAPPER in str(record.get("error", "")):
            cause = root_cause(log_text)
            if cause:
                record["error"] = f"engine start-up: {cause}"
        record["log_tail"] = log_text[-4000:]
    result_path.write_text(json.dumps(record, indent=1, default=str))
    if echo is not None:
        detail = "" if status == "ok" else f": {str(record.get('error', '')).splitlines()[0][:300]}"
        echo(f"[{status}] {job.name} ({seconds:.0f} s){detail}")
    return record


def _where(worker: dict[str, Any], killed_at: float) -> str:
    """`` during PHASE (N s into it)`` from the phase the worker last recorded, or ``""``."""
    phase, started = worker.get("phase"), worker.get("phase_started_at")
    if not phase or not isinstance(started, int | float):
        return ""
    done = ""
    progress = worker.get("phase_progress")
    if isinstance(progress, dict) and {"done", "total"} <= progress.keys():
        done = f", {progress['done']} of {progress['total']} requests finished"
    return f" during {phase} ({max(0.0, killed_at - started):.0f} s into it{done})"


def _relay(log_path: Path, offset: int, echo: Callable[[str], None] | None) -> int:
    """Echo the worker's progress lines written since ``offset``; returns the new offset."""
    if echo is None:
        return offset
    try:
        with open(log_path, "rb") as log:
            log.seek(offset)
            chunk = log.read()
    except OSError:
        return offset
    end = chunk.rfind(b"\n") + 1  # only whole lines
    for line in chunk[:end].decode(errors="replace").splitlines():
        if line.startswith(PROGRESS_PREFIX):
            echo(line[len(PROGRESS_PREFIX) :].strip())
    return offset + end


@dataclass
class Budget:
    """A wall-clock budget shared by runs (``max_seconds=None``: unlimited).

    Attributes:
        max_seconds: total seconds for everything, or ``None``.
        reserve_seconds: kept back at the end (writing results, plots).
        min_run_seconds: a run is not started with less than this.
        started: ``time.monotonic()`` at creation.
    """

    max_seconds: float | None = None
    reserve_seconds: float = 15.0
    min_run_seconds: float = 60.0
    started: float = field(default_factory=time.monotonic)

    def remaining(self) -> float:
        """Seconds left (``inf`` when unlimited)."""
        if self.max_seconds is None:
            return float("inf")
        return self.max_seconds - (time.monotonic() - self.started) - self.reserve_seconds

    def timeout_for(self, run_timeout: float) -> float | None:
        """The timeout of the next run, or ``None`` when too little time is left to start one.

        Args:
            run_timeout: the per-run limit.
        """
        left = min(run_timeout, self.remaining())
        return None if left < self.min_run_seconds else left
