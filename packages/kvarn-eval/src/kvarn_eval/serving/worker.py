"""The process that runs one vLLM engine: ``python -m kvarn_eval.serving.worker SPEC RESULT``.

Started by :func:`kvarn_eval.serving.runner.run_job`, never imported by the parent. It builds
``vllm.LLM(**llm_kwargs)``, records the KV cache capacity vLLM configured, then runs the
workload, rewriting ``RESULT`` (atomically) after each phase:

* ``capacity``: a short generation (8 random prompts of 300 tokens, 16 out) proving the cache
  works.
* ``throughput``: a warm-up, then one burst per prompt length: requests planned by
  :func:`~kvarn_eval.serving.metrics.plan_requests` from the capacity just configured, random
  token prompts, greedy, ``ignore_eos`` so each request generates exactly ``output_len`` tokens;
  wall time, tokens per second, and TTFT / TPOT from ``RequestOutput.metrics``.
* ``greedy``: text prompts, greedy, the generated token ids (compared with the bf16 run by
  the parent).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvarn_eval.serving.metrics import (
    plan_requests,
    random_token_prompts,
    request_timing,
    summarize_burst,
)
from kvarn_eval.serving.runner import PROGRESS_PREFIX

__all__ = ["main"]


def _say(message: str) -> None:
    print(f"{PROGRESS_PREFIX} {message}", flush=True)


def _phase(record: dict[str, Any], save: Callable[[], None], name: str) -> None:
    """Record (and save) the phase now starting, so that a killed run says where it was."""
    record["phase"] = name
    record["phase_started_at"] = time.time()
    record.pop("phase_progress", None)
    save()


def _progress_bar(
    record: dict[str, Any],
    save: Callable[[], None],
    label: str,
    save_every: float = 1.0,
    say_every: float = 10.0,
) -> Any:
    """A tqdm class for ``LLM.generate(use_tqdm=...)`` that draws nothing: vLLM counts finished
    requests on its "Processed prompts" bar, and this one keeps the count in
    ``record["phase_progress"]``, saved at most every ``save_every`` seconds (so a killed run
    keeps it, at the cost of a small file write) and said every ``say_every`` seconds."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    class Progress(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["file"] = open(os.devnull, "w")  # noqa: SIM115 (closed in close())
            super().__init__(*args, **kwargs)
            self._saved = self._said = time.monotonic()

        def update(self, n: float | None = 1) -> bool | None:
            out = super().update(n)
            if str(self.desc).startswith("Processed") and self.total:
                record["phase_progress"] = {"done": int(self.n), "total": int(self.total)}
                now, last = time.monotonic(), self.n >= self.total
                if now - self._saved >= save_every or last:
                    self._saved = now
                    save()
                if now - self._said >= say_every or last:
                    self._said = now
                    _say(f"{label}: {int(self.n)} of {int(self.total)} requests finished")
            return out

        def close(self) -> None:
            file = self.fp
            super().close()
            file.close()

    return Progress


def _write(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str))
    os.replace(tmp, path)


def _capacity(llm: Any) -> dict[str, Any]:
    cache = llm.llm_engine.vllm_config.cache_config
    blocks = cache.num_gpu_blocks
    return {
        "num_gpu_blocks": blocks,
        "block_size": cache.block_size,
        "kv_cache_tokens_config": blocks * cache.block_size if blocks else None,
    }


def _generate_tokens(
    llm: Any, prompts: list[list[int]], max_tokens: int, progress: Any = False
) -> list[Any]:
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
    )
    batch = [{"prompt_token_ids": p} for p in prompts]
    return list(llm.generate(batch, params, use_tqdm=progress))


def _run_capacity(llm: Any, job: dict[str, Any], record: dict[str, Any]) -> None:
    vocab = int(job["workload"]["vocab_size"])
    outs = _generate_tokens(llm, random_token_prompts(8, 300, vocab, seed=1), 16)
    record["check_generation"] = {
        "requests": len(outs),
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
    }


def _run_throughput(
    llm: Any, job: dict[str, Any], record: dict[str, Any], save: Callable[[], None]
) -> None:
    work = job["workload"]
    vocab = int(work["vocab_size"])
    output_len = int(work["output_len"])
    capacity = record["capacity"]
    tokens = capacity["kv_cache_tokens_config"] or 0
    block_size = capacity["block_size"] or 16
    _phase(record, save, "warm-up")
    start = time.perf_counter()
    _generate_tokens(llm, random_token_prompts(4, 512, vocab, seed=2), 16)
    record["warmup_seconds"] = round(time.perf_counter() - start, 2)
    _say(f"{job['name']}: warm-up {record['warmup_seconds']} s")
    record["bursts"] = {}
    for prompt_len in work["prompt_lens"]:
        n = plan_requests(
            tokens,
            block_size,
            prompt_len,
            output_len,
            max_num_seqs=int(work["max_num_seqs"]),
            fill=float(work.get("fill", 1.0)),
            requests=work.get("requests"),
        )
        key = str(prompt_len)
        if n == 0:
            record["bursts"][key] = {
                "error": f"one request of {prompt_len + output_len} tokens "
                f"does not fit in {tokens} KV cache tokens"
            }
            save()
            continue
        _say(f"{job['name']}: burst of {n} x {prompt_len} tokens, {output_len} out")
        _phase(record, save, f"the {prompt_len}-token burst ({n} requests)")
        prompts = random_token_prompts(n, prompt_len, vocab, seed=prompt_len)
        progress = _progress_bar(record, save, f"{job['name']}: {prompt_len} tokens")
        start = time.perf_counter()
        outs = _generate_tokens(llm, prompts, output_len, progress)
        seconds = time.perf_counter() - start
        summary = summarize_burst(
            [len(o.prompt_token_ids or []) for o in outs],
            [len(o.outputs[0].token_ids) for o in outs],
            [request_timing(getattr(o, "metrics", None)) for o in outs],
            seconds,
        )
        record["bursts"][key] = summary
        save()
        _say(
            f"{job['name']}: {prompt_len} tokens: {seconds:.1f} s, "
            f"{summary['total_tok_per_s']:.0f} tok/s total, "
            f"{summary['output_tok_per_s']:.0f} out tok/s"
        )


def _run_greedy(llm: Any, job: dict[str, Any], record: dict[str, Any]) -> None:
    from vllm import SamplingParams

    work = job["workload"]
    params = SamplingParams(
        temperature=0.0, max_tokens=int(work["max_tokens"]), ignore_eos=True, seed=0
    )
    start = time.perf_counter()
    outs = llm.generate(list(work["prompts"]), params, use_tqdm=False)
    record["generate_seconds"] = round(time.perf_counter() - start, 2)
    record["outputs"] = [list(o.outputs[0].token_ids) for o in outs]
    record["sample_texts"] = [o.outputs[0].text for o in outs[:3]]


def _run_perplexity(llm: Any, job: dict[str, Any], record: dict[str, Any]) -> None:
    """Score every chunk's tokens (``prompt_logprobs``): mean NLL per chunk, and the model's
    top-1 token at every scored position."""
    from vllm import SamplingParams

    chunks = [list(c) for c in job["workload"]["chunks"]]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, seed=0)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": c} for c in chunks], params, use_tqdm=False)
    record["generate_seconds"] = round(time.perf_counter() - start, 2)
    nll, top1 = [], []
    for out, chunk in zip(outs, chunks, strict=True):
        losses, best = [], []
        for pos, entry in enumerate(out.prompt_logprobs or []):
            if entry is None:  # the first token has no prediction
                continue
            losses.append(-float(entry[chunk[pos]].logprob))
            best.append(int(min(entry.items(), key=lambda kv: kv[1].rank)[0]))
        if not losses:
            raise RuntimeError("vLLM returned no prompt logprobs for a chunk")
        nll.append(sum(losses) / len(losses))
        top1.append(best)
    record["chunk_nll"] = nll
    record["top1"] = top1


def run(job: dict[str, Any], record: dict[str, Any], save: Callable[[], None]) -> None:
    """Start the engine of ``job`` and run its workload, filling ``record``.

    Args:
        job: the job (``EngineJob`` as a dict).
        record: the result so far, updated in place.
        save: writes ``record`` (called after every phase).
    """
    from vllm import LLM

    kind = job["workload"]["kind"]
    _say(f"{job['name']}: starting the engine ({job['cache']['label']})")
    _phase(record, save, "engine start-up")
    start = time.perf_counter()
    llm = LLM(**job["llm_kwargs"])
    record["startup_seconds"] = round(time.perf_counter() - start, 1)
    record["capacity"] = _capacity(llm)
    save()
    _say(
        f"{job['name']}: engine up in {record['startup_seconds']} s, "
        f"{record['capacity']['kv_cache_tokens_config']} KV cache tokens"
    )
    if kind != "throughput":  # the throughput workload names its own phases
        _phase(record, save, f"the {kind} workload")
    if kind == "capacity":
        _run_capacity(llm, job, record)
    elif kind == "throughput":
        _run_throughput(llm, job, record, save)
    elif kind == "greedy":
        _run_greedy(llm, job, record)
    elif kind == "perplexity":
        _run_perplexity(llm, job, record)
    elif kind == "longctx":
        from kvarn_eval.gpu_longctx import run_workload

        run_workload(llm, job, record, save)
    else:
        raise ValueError(f"unknown workload kind {kind!r}")


def main(argv: list[str] | None = None) -> int:
    """Run the job in ``argv[0]`` and write its result to ``argv[1]``; returns the exit status.

    Args:
        argv: ``[SPEC, RESULT]`` (default ``sys.argv[1:]``).
    """
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m kvarn_eval.serving.worker SPEC.json RESULT.json", file=sys.stderr)
        return 2
    job = json.loads(Path(args[0]).read_text())
    result_path = Path(args[1])
    record: dict[str, Any] = {"name": job["name"], "complete": False, "pid": os.getpid()}

    def save() -> None:
        _write(result_path, record)

    save()
    status = 0
    try:
        run(job, record, save)
        record["complete"] = True
    except BaseException as exc:  # recorded for the parent, which carries on
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc()
        status = 1
    save()
    _say(f"{job['name']}: {'done' if status == 0 else 'FAILED: ' + record['error'][:300]}")
    sys.stdout.flush()
    sys.stderr.flush()
    # vLLM's exit handlers can hang with tensor-parallel workers; the parent kills the process
    # group (engine core and workers included) once this process is gone.
    os._exit(status)


if __name__ == "__main__":  # pragma: no cover
    main()
