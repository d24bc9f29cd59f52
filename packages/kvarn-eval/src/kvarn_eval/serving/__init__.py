"""Throughput, capacity, greedy fidelity and perplexity through vLLM (GPU), each engine in its own process.

:mod:`.shapes` writes dummy-weight model folders of real shapes, :mod:`.caches` names the KV
caches compared, :mod:`.runner` runs one engine per process, :mod:`.worker` is that process,
:mod:`.metrics` holds the arithmetic and :mod:`.suites` builds jobs and results. Nothing here
imports vLLM or torch in the calling process.
"""

from kvarn_eval.serving.caches import DEFAULT_CACHES, CacheSpec, parse_cache, parse_caches
from kvarn_eval.serving.metrics import (
    plan_requests,
    random_token_prompts,
    request_timing,
    summarize_burst,
)
from kvarn_eval.serving.options import ServingOptions
from kvarn_eval.serving.runner import Budget, EngineJob, parse_log, run_job
from kvarn_eval.serving.shapes import MODEL_SHAPES, ModelShape, get_shape, write_model_dir

__all__ = [
    "DEFAULT_CACHES",
    "MODEL_SHAPES",
    "Budget",
    "CacheSpec",
    "EngineJob",
    "ModelShape",
    "ServingOptions",
    "get_shape",
    "parse_cache",
    "parse_caches",
    "parse_log",
    "plan_requests",
    "random_token_prompts",
    "request_timing",
    "run_job",
    "summarize_burst",
    "write_model_dir",
]
