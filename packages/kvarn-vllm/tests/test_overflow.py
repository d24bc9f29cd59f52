"""The store's saturation counters, per layer: wired into the layer's store, read without a
host sync once per poll interval, reported once (issue 50).

The first test runs a real vLLM ``Attention`` layer of a bf16 model and kvarn's builder on CPU
(the kernels in Triton's interpreter): a prompt whose keys reach 1e20 in one KV head goes
through ``forward``, and the warning names the layer.
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import _releases
import numpy as np
import pytest
import torch
from kvarn_vllm import overflow
from kvarn_vllm.step import STEP

PRESET = "kvarn_k4v4_g64"
G, HQ, HKV, D = 64, 4, 2, 64
LAYER = "model.layers.12.self_attn.attn"


class _Capture(logging.Handler):
    """The warnings of ``vllm.kvarn`` (vLLM's logger does not propagate to pytest's)."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def warnings_of_kvarn():
    handler = _Capture()
    logger = logging.getLogger("vllm.kvarn")
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


@pytest.fixture
def counters(monkeypatch):
    """A fresh set of counters for this test (the process's own is global)."""
    fresh = overflow.OverflowCounters(interval=10.0)
    monkeypatch.setattr(overflow, "COUNTERS", fresh)
    return fresh


def _bf16_layer(vllm_config_factory, monkeypatch):
    """A kvarn layer of a bf16 model (its staging in bf16), its builder and a cache."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention

    vc = vllm_config_factory(PRESET, max_num_seqs=2, max_num_batched_tokens=256)
    vc.cache_config.block_size = G
    torch.set_default_dtype(torch.bfloat16)
    try:
        with set_current_vllm_config(vc):
            layer = Attention(
                num_heads=HQ,
                head_size=D,
                scale=D**-0.5,
                num_kv_heads=HKV,
                cache_config=vc.cache_config,
                prefix=LAYER,
            )
    finally:
        torch.set_default_dtype(torch.float32)
    assert layer.impl.staging.dtype == torch.bfloat16
    spec = _releases.worker_spec(layer, vc)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    builder = layer.attn_backend.get_builder_cls()(spec, [layer.layer_name], vc, "cpu")
    cache = _releases.layer_cache(layer.attn_backend, spec, 4)
    return layer, builder, cache


def _prefill(layer, builder, cache, key, value):
    """One step: a fresh prompt of ``key.shape[0]`` tokens in slot 0, blocks 1 and 2."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    n = key.shape[0]
    STEP.report_real(SimpleNamespace(num_reqs=1, idx_mapping_np=np.array([0], dtype=np.int32)))
    qsl = torch.tensor([0, n], dtype=torch.int32)
    seq = torch.tensor([n], dtype=torch.int32)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=seq,
        num_reqs=1,
        num_actual_tokens=n,
        max_query_len=n,
        max_seq_len=n,
        block_table_tensor=torch.tensor([[1, 2]], dtype=torch.int32),
        slot_mapping=torch.zeros(n, dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq,
    )
    meta = builder.build(0, cam)
    q = torch.randn(n, HQ, D).to(torch.bfloat16)
    out = torch.empty(n, HQ, D, dtype=torch.bfloat16)
    layer.impl.forward(layer, q, key, value, cache, meta, output=out)
    return meta, out


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="runs the kvarn kernels on CPU tensors: needs TRITON_INTERPRET=1",
)
def test_a_layer_counts_and_names_its_saturated_tiles(
    vllm_config_factory, monkeypatch, counters, warnings_of_kvarn
):
    layer, builder, cache = _bf16_layer(vllm_config_factory, monkeypatch)
    impl = layer.impl
    assert impl.overflow_count.shape == (1,) and impl.overflow_count.dtype == torch.int32
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(G + 5, HKV, D, generator=gen)
    value = torch.randn(G + 5, HKV, D, generator=gen)
    key[3, 1, 7] = 1e20  # one key element of KV head 1 in the first tile: past any record
    meta, out = _prefill(layer, builder, cache, key.to(torch.bfloat16), value.to(torch.bfloat16))
    assert meta.plan.num_tiles == 1  # the first tile was quantized in this step
    assert int(impl.overflow_count.item()) == 1  # KV head 1's keys; values and head 0 held
    assert not warnings_of_kvarn  # nothing read yet: the builder's first poll came before
    # the builder's next poll after the interval enqueues a copy; the one after reads it
    counters.poll(now=1e9)
    counters.poll(now=2e9)
    (message,) = warnings_of_kvarn
    assert f"{LAYER}: 1" in message and "5.4e8" in message and "saturated" in message
    counters.poll(now=3e9)  # reported once per layer
    assert len(warnings_of_kvarn) == 1
    # the exit report repeats a layer only when its count grew
    assert counters.report_now() == {LAYER: 1} and len(warnings_of_kvarn) == 1
    impl.overflow_count += 2
    assert counters.report_now() == {LAYER: 3}
    assert "in total so far" in warnings_of_kvarn[-1] and f"{LAYER}: 3" in warnings_of_kvarn[-1]


def test_counters_are_views_of_one_buffer_per_device(counters, warnings_of_kvarn):
    a = counters.allocate("layers.0", "cpu")
    b = counters.allocate(None, "cpu")
    assert a.data_ptr() + 16 == b.data_ptr() and a.dtype == torch.int32  # 16-byte aligned
    for i in range(overflow.CHUNK):  # a full buffer starts another
        counters.allocate(f"more.{i}", "cpu")
    assert len(counters._buffers) == 2
    b += 4
    assert counters.report_now() == {"<attention layer 1 of buffer 1>": 4}
    assert counters.report_now() == {"<attention layer 1 of buffer 1>": 4}
    assert len(warnings_of_kvarn) == 1  # nothing new the second time


def test_poll_looks_at_the_clock_only_between_intervals(counters, monkeypatch):
    counter = counters.allocate("layers.0", "cpu")
    copies = []
    monkeypatch.setattr(counters, "_copy", lambda buf: copies.append(buf))
    counters.poll(now=100.0)
    counters.poll(now=105.0)
    assert len(copies) == 1
    counters.poll(now=110.0)
    assert len(copies) == 2 and int(counter.item()) == 0
