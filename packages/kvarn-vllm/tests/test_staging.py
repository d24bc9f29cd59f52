"""What kvarn logs once about the staging it allocated: its size, what that costs in
cache tokens, and under speculative decoding how verify blocks run."""

from __future__ import annotations

import logging

import pytest


def _staging_log(caplog, **fields) -> str:
    """What ``log_staging_once`` logs for a process whose staging report has ``fields``
    (the report restored afterwards)."""
    from kvarn_vllm import staging

    saved = dict(staging._STAGING)
    staging._STAGING.update(logged=False, **fields)
    try:
        with caplog.at_level(logging.INFO, logger="vllm.kvarn"):
            staging.log_staging_once()
    finally:
        staging._STAGING.clear()
        staging._STAGING.update(saved)
    return caplog.text


def test_staging_log_says_what_it_costs_in_cache_tokens(caplog):
    """The Qwen3-32B shape's staging at 256 slots (eighth H200 run: 16 GiB), in tokens of
    kvarn_k4v2_g128 cache: 64 layers x 8 KV heads x 106.125 bytes per token."""
    text = _staging_log(
        caplog, bytes=16 * 2**30, layers=64, slots=256, tokens=256,
        cache_bytes_per_token=64 * 8 * 13584 / 128,
    )  # fmt: skip
    assert "about 316,178 tokens of this KV cache (1,235 per request slot)" in text


@pytest.mark.parametrize(
    ("invariant", "as_decode"), [(False, False), (True, False), (False, True), (True, True)]
)
def test_speculative_staging_log_says_how_to_agree_with_plain_serving(caplog, invariant, as_decode):
    """Under speculative decoding the start-up log says how verify blocks run: as decode rows
    (the default) with what that costs and how to turn it off; through the multi-query kernel
    (``KVARN_VLLM_VERIFY_AS_DECODE=0``) that outputs can differ from a run without speculation
    and which settings make them agree; in batch-invariant mode neither."""
    text = _staging_log(
        caplog, bytes=2**30, layers=2, slots=4, tokens=384, staging_tiles=3, group_size=128,
        batch_invariant=invariant, verify_as_decode=as_decode,
    )  # fmt: skip
    assert "staging holds S=3 open tiles" in text
    said = "Unset it to run them as decode rows" in text
    assert said is not (invariant or as_decode)
    assert ("KVARN_KERNELS_BATCH_INVARIANT=1 for this run and the one to compare" in text) is said
    rows = "Set KVARN_VLLM_VERIFY_AS_DECODE=0 for the multi-query kernel" in text
    assert rows is (as_decode and not invariant)


def test_speculative_staging_log_counts_the_frame_queries(caplog):
    text = _staging_log(
        caplog, bytes=2**30, layers=2, slots=4, tokens=384, staging_tiles=3, group_size=128,
        frame_query_bytes=2**29,
    )  # fmt: skip
    assert "last-position query (0.500 GiB of the total above)" in text


def test_budget_warning_names_the_share_and_the_slot_cost():
    """The Llama-3.1-8B shape at 256 slots on a 24 GiB budget: 8 GiB of staging is a third of
    what vLLM may use (the pool then gets none, docs/capacity.md); on an 80 GB H100 at 0.9
    (71.26 GiB) it is 11%, under the warning's 20%."""
    from kvarn_vllm.staging import staging_budget_warning

    text = staging_budget_warning(8 * 2**30, layers=32, slots=256, budget_bytes=24 * 2**30)
    assert text is not None
    assert "8.00 GiB after 32 layer(s) at 256 request slots" in text
    assert "33% of the 24.0 GiB" in text
    assert "Each slot costs 1.00 MiB per layer" in text
    assert staging_budget_warning(8 * 2**30, 32, 256, 71.26 * 2**30) is None
    assert staging_budget_warning(8 * 2**30, 32, 256, 0) is None


def test_budget_check_warns_once_inside_an_engine_on_cuda(caplog, monkeypatch):
    """The check reads vLLM's gpu_memory_utilization and the card's total memory (both stood in
    for here), warns once past the share, and does nothing for a CPU device."""
    from types import SimpleNamespace

    import torch
    import vllm.config
    from kvarn_vllm import staging

    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(gpu_memory_utilization=0.5))
    monkeypatch.setattr(vllm.config, "get_current_vllm_config", lambda: vllm_config)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 48 * 2**30))
    saved = dict(staging._STAGING)
    try:
        staging._STAGING.update(bytes=8 * 2**30, layers=32, slots=256, budget_warned=False)
        with caplog.at_level(logging.WARNING, logger="vllm.kvarn"):
            staging._warn_if_over_budget(torch.device("cpu"))
            assert "staging has reached" not in caplog.text
            staging._warn_if_over_budget(torch.device("cuda"))
            staging._warn_if_over_budget(torch.device("cuda"))
    finally:
        staging._STAGING.clear()
        staging._STAGING.update(saved)
    assert caplog.text.count("staging has reached 8.00 GiB") == 1
    assert "33% of the 24.0 GiB vLLM may use" in caplog.text
