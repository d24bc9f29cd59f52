"""The builder's per-step planning against kvarn-kernels' plan_store on random schedules.

No kernels run here: the builder's device tensors (CPU in this test) must equal what
plan_store gives when handed the real block table, row kinds must partition the batch,
and the gathered token indices must select exactly each kind's query rows.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kvarn_vllm import sink, warmup
from kvarn_vllm.sink import sink_rows_for
from kvarn_vllm.step import STEP, StepRecord

G = 64
MAX_REQS, MAX_TOKENS, MAX_BLOCKS = 6, 384, 12


@pytest.fixture(scope="module")
def builder(registered):
    import os

    from kvarn_vllm.backend import backend_class
    from kvarn_vllm.config import parse_kv_cache_dtype
    from kvarn_vllm.spec import make_layer_spec
    from vllm.config import CacheConfig, DeviceConfig, SchedulerConfig, VllmConfig

    vc = VllmConfig(
        cache_config=CacheConfig(cache_dtype="kvarn_k4v2_g64"),
        scheduler_config=SchedulerConfig(
            max_num_seqs=MAX_REQS,
            max_num_batched_tokens=MAX_TOKENS,
            max_model_len=MAX_BLOCKS * G,
            is_encoder_decoder=False,
        ),
        device_config=DeviceConfig(device="cpu"),
    )
    spec = make_layer_spec(
        parse_kv_cache_dtype("kvarn_k4v2_g64"),
        block_size=G,
        num_kv_heads=2,
        head_size=64,
        head_size_v=64,
        sliding_window=None,
    )
    old = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    try:
        return backend_class("kvarn_k4v2_g64").get_builder_cls()(
            spec, ["layer"], vc, torch.device("cpu")
        )
    finally:
        if old is None:
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER")
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = old


@st.composite
def batches(draw):
    n = draw(st.integers(1, MAX_REQS))
    slots = draw(st.permutations(range(MAX_REQS)))[:n]
    reqs, budget = [], MAX_TOKENS
    for slot in slots:
        cached = draw(st.sampled_from([0, 0, draw(st.integers(0, 5 * G))]))
        new = draw(st.sampled_from([1, 1, draw(st.integers(0, min(budget, 3 * G)))]))
        new = min(new, budget, MAX_BLOCKS * G - cached)
        budget -= new
        reqs.append((slot, cached, new))
    return reqs


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(reqs=batches(), seed=st.integers(0, 2**16))
# A batch of one kind plus a padding row (no tokens): it used to be treated as "the whole batch".
@example(reqs=[(0, 0, 2), (1, 0, 1), (2, 0, 1), (3, 0, 0)], seed=0)
def test_builder_matches_plan_store(builder, reqs, seed):
    from kvarn_kernels import plan_store
    from vllm.v1.attention.backend import CommonAttentionMetadata

    rng = np.random.default_rng(seed)
    n = len(reqs)
    slots = np.array([r[0] for r in reqs], dtype=np.int32)
    cached = np.array([r[1] for r in reqs], dtype=np.int32)
    new = np.array([r[2] for r in reqs], dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    table = rng.permutation(1000)[: n * MAX_BLOCKS].reshape(n, MAX_BLOCKS).astype(np.int32)
    STEP.report_real(SimpleNamespace(num_reqs=n, idx_mapping_np=slots))
    cam = CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(qsl),
        query_start_loc_cpu=torch.from_numpy(qsl),
        seq_lens=torch.from_numpy(cached + new),
        num_reqs=n,
        num_actual_tokens=int(qsl[-1]),
        max_query_len=int(new.max()),
        max_seq_len=int((cached + new).max()),
        block_table_tensor=torch.from_numpy(table),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
        seq_lens_cpu_upper_bound=torch.from_numpy(cached + new),
    )
    meta = builder.build(0, cam)
    uniform_decode = bool((new <= 1).all()) and bool((new == 1).any())
    want = plan_store(
        cached,
        new,
        None,
        slots,
        table,
        "kvarn_k4v2_g64",
        query_start_loc=qsl,
        max_tiles=n if uniform_decode else None,
        max_writes=n if uniform_decode else None,
        sink=builder.config.sink,
        staging_tiles=builder.config.ring_tiles,
        recent_tiles=builder.config.recent_tiles,
        exact_start=np.zeros(n, dtype=np.int64),  # no row was (re)added: all began at 0
        window_keys=builder.config.window_keys,
    )
    assert torch.equal(meta.plan.tiles, want.tiles)
    assert torch.equal(meta.plan.writes, want.writes)
    assert torch.equal(meta.plan.quantized_lens, want.quantized_lens)
    assert torch.equal(meta.plan.seq_lens, want.seq_lens)

    seen_rows: list[int] = []
    for kind in ("decode", "fresh", "context"):
        g = getattr(meta, kind)
        if g is None:
            continue
        rows = np.arange(n) if g.rows is None else g.rows.numpy()
        seen_rows += rows.tolist()
        tokens = np.arange(int(qsl[-1])) if g.token_index is None else g.token_index.numpy()
        expect = (
            np.concatenate([np.arange(qsl[r], qsl[r + 1]) for r in rows])
            if len(rows)
            else np.zeros(0)
        )
        if g.token_index is not None or kind != "decode":
            assert tokens.tolist() == expect.tolist()
        assert g.seq_lens.tolist() == (cached + new)[rows].tolist()
        assert g.staging_slots.tolist() == slots[rows].tolist()
        # attention's split: the plan's read_lens (the recent tile comes from staging)
        assert g.quantized_lens.tolist() == want.attention_lens.numpy()[rows].tolist()
        assert torch.equal(g.block_table, torch.from_numpy(table)[torch.from_numpy(rows)])
        lens = np.diff(g.query_start_loc.numpy())
        assert lens.tolist() == new[rows].tolist()
        assert g.max_query_len == int(new[rows].max(initial=0))
        if kind == "fresh":
            assert (cached[rows] == 0).all()
        if kind == "context":
            assert ((cached[rows] > 0) & (new[rows] > 1)).all()
    # Every row with a query is in exactly one kind; a uniform decode batch keeps them all.
    expected = list(range(n)) if uniform_decode else np.flatnonzero(new > 0).tolist()
    assert sorted(seen_rows) == expected


def _sink_lens(rec, num_cached, g):
    return sink_rows_for(rec, rec.slots, np.asarray(num_cached), g, 8)[0].tolist()


def test_sink_lens_follow_how_each_request_started():
    """A request keeps its exact first tile iff it computed tile 0 itself; a prefix-cache hit
    on tile 0 (first step starting at >= G cached tokens) with no known first-tile blocks
    reads the quantized record."""
    g = 64
    sink.reset()
    rec = StepRecord(
        serial=101,
        num_reqs=3,
        slots=np.array([4, 1, 2], np.int32),
        new_rows=np.array([True, True, False]),
    )
    # new from scratch, new after a prefix hit, unknown row
    assert _sink_lens(rec, [0, 2 * g, 0], g) == [g, 0, 0]
    # Later steps keep each row's decision, however many tokens are cached by then.
    rec2 = StepRecord(serial=102, num_reqs=2, slots=np.array([1, 4], np.int32))
    assert _sink_lens(rec2, [300, 500], g) == [0, g]
    # A new request in row 4 after a prefix hit loses the sink; the same record twice (a second
    # builder of the step) does not decide again.
    rec3 = StepRecord(
        serial=103, num_reqs=1, slots=np.array([4], np.int32), new_rows=np.array([True])
    )
    assert _sink_lens(rec3, [g], g) == [0]
    assert _sink_lens(rec3, [0], g) == [0]


def test_prefix_hits_read_the_exact_first_tile_of_its_owner():
    """A request that hit the prefix cache on tile 0 reads the sink rows of the slot whose
    request computed that tile (same first-tile block ids), while those rows hold it."""
    g = 64
    sink.reset()
    serial = iter(range(200, 300))

    def step(slots, new, cached, blocks=None):
        rec = StepRecord(
            serial=next(serial),
            num_reqs=len(slots),
            slots=np.array(slots, np.int32),
            new_rows=np.array(new),
            first_blocks=blocks,
        )
        lens, src = sink_rows_for(rec, rec.slots, np.array(cached), g, 8)
        return lens.tolist(), src.tolist()

    # Owner (slot 4) and a hitter (slot 1) added in the same step: the hitter reads slot 4.
    got = step([1, 4], [True, True], [2 * g, 0], {4: (10, 30), 1: (10, 30)})
    assert got == ([g, g], [4, 4])
    # Another hitter later; one whose first tile is held nowhere reads its record.
    blocks = {2: (10, 30), 5: (11, 31)}
    got = step([4, 1, 2, 5], [False, False, True, True], [0, 0, 3 * g, g], blocks)
    assert got == ([g, g, g, 0], [4, 4, 4, 5])
    # Slot 4 gets a new request computing its own tile 0: the readers of its old rows fall
    # back to the record, and the old first tile is held nowhere any more.
    got = step([1, 2, 4], [False, False, True], [0, 0, 0], {4: (12, 32)})
    assert got == ([0, 0, g], [1, 2, 4])
    assert step([6], [True], [g], {6: (10, 30)}) == ([0], [6])
    # The same blocks computed again elsewhere (freed, refilled): the older copy is stale.
    step([3], [True], [0], {3: (40, 50)})
    step([7], [True], [0], {7: (40, 50)})
    assert step([0], [True], [g], {0: (40, 50)}) == ([g], [7])
    # A hit with unknown first blocks reads its record.
    assert step([5], [True], [g], None) == ([0], [5])


def test_buffer_regions_start_on_16_bytes(builder):
    # The kernels compiled by warm_kernels on fresh (aligned) scratch tensors must be the
    # ones the builder's views select: Triton specializes pointers on 16-byte alignment.
    layout = builder.planner.buffers.layout
    assert all(start % 4 == 0 for start, _ in layout.values()), layout
    ends = sorted((start, start + size) for start, size in layout.values())
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ends))  # no overlap


def _warm_args(device_type: str):
    from kvarn_vllm.config import parse_kv_cache_dtype

    config = parse_kv_cache_dtype("kvarn_k4v2_g128")
    spec = SimpleNamespace(head_size=128, num_kv_heads=8, sliding_window=4096)
    model = SimpleNamespace(dtype=torch.bfloat16, get_num_attention_heads=lambda parallel: 32)
    vllm_config = SimpleNamespace(model_config=model, parallel_config=None)
    return config, spec, vllm_config, SimpleNamespace(type=device_type)


def test_warm_kernels_once_per_shape_on_gpus_only(monkeypatch, tmp_path):
    import os

    from kvarn_vllm import kernels, plugin

    calls, folders = [], []

    def fake_warmup(*args, **kwargs):
        calls.append((args, kwargs))
        folders.append(os.environ["TRITON_CACHE_DIR"])
        return {"launches": 17, "seconds": 0.5, "query_block_sizes": [1, 2, 4, 8, 16], "threads": 1}

    monkeypatch.setattr(kernels, "warmup", fake_warmup)
    # vLLM points TRITON_CACHE_DIR at a folder per engine configuration after the plugin
    # registered; the kernels compile in the folder the process started with.
    monkeypatch.setattr(plugin, "_triton_cache_dir", str(tmp_path / "stable"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "vllm-config-hash"))
    monkeypatch.setattr(warmup, "_WARMED", set())
    monkeypatch.setenv("KVARN_VLLM_RECENT_TILES", "1")
    monkeypatch.delenv("KVARN_VLLM_KEY_FRAME", raising=False)
    assert warmup.warm_kernels(*_warm_args("cpu")) is None and not calls
    args = _warm_args("cuda")
    assert warmup.warm_kernels(*args)["launches"] == 17
    assert warmup.warm_kernels(*args) is None  # once per process and shape
    assert folders == [str(tmp_path / "stable")]
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "vllm-config-hash")
    ((positional, keywords),) = calls
    assert positional[:5] == ("kvarn_k4v2_g128", 128, 32, 8, torch.bfloat16)
    assert keywords == {
        "staging_tiles": 2,  # the ring: the open tile and the recent one
        "key_tiles": 1,  # values-only windows (the default): the open tile's keys
        "sink": True,
        "sliding_window": 4096,
        "batch_invariant": False,
        "own_kv": (True,),  # no KV-sharing layer: multi-query only with the step's K/V
        "key_frame": "auto",  # the store chooses key frames, attention reads them
        "frame_queries": False,  # staged last-position queries: speculative decoding only
        "count_overflow": True,  # every layer counts saturated tiles (kvarn_vllm.overflow)
    }
    # With a KV-sharing layer both multi-query variants; batch-invariant mode, only without.
    from kvarn_vllm import staging

    monkeypatch.setitem(staging._STAGING, "shared_layers", 2)
    monkeypatch.setattr(warmup, "_WARMED", set())
    warmup.warm_kernels(*args)
    assert calls[-1][1]["own_kv"] == (False, True)
    monkeypatch.setenv("KVARN_KERNELS_BATCH_INVARIANT", "1")
    monkeypatch.setattr(warmup, "_WARMED", set())
    warmup.warm_kernels(*_warm_args("cuda"))
    assert calls[-1][1]["own_kv"] == (False,) and calls[-1][1]["batch_invariant"]
    del calls[1:]
    monkeypatch.setattr(warmup, "_WARMED", set())
    monkeypatch.setenv("KVARN_VLLM_WARMUP", "0")
    assert warmup.warm_kernels(*args) is None and len(calls) == 1
    monkeypatch.setenv("KVARN_VLLM_WARMUP", "yes")
    with pytest.raises(ValueError, match="KVARN_VLLM_WARMUP must be 0 or 1"):
        warmup.warm_kernels(*args)


def test_warm_planners_on_gpus_only(monkeypatch, tmp_path):
    """Speculative engines compile both device planners at start-up on GPUs (one scratch
    row each, the engine's ring, sink, recent tiles and window setting), in Triton's own cache
    folder; CPU engines and ``KVARN_VLLM_WARMUP=0`` skip it. The launches themselves run here
    under the interpreter."""
    import os

    from kvarn_vllm import kernels, plugin
    from kvarn_vllm.config import parse_kv_cache_dtype

    monkeypatch.setenv("KVARN_VLLM_RECENT_TILES", "1")
    config = parse_kv_cache_dtype("kvarn_k4v2_g128", num_speculative_tokens=4)
    seen, folders = [], []

    def fake_launch(c, d):
        seen.append((c, d))
        folders.append(os.environ.get("TRITON_CACHE_DIR"))

    monkeypatch.setattr(warmup, "launch_planners", fake_launch)
    monkeypatch.setattr(plugin, "_triton_cache_dir", None)  # unset at start: Triton's default
    monkeypatch.setenv("TRITON_HOME", str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "vllm-config-hash"))
    assert not warmup.warm_planners(config, SimpleNamespace(type="cpu"))
    monkeypatch.setenv("KVARN_VLLM_WARMUP", "0")
    assert not warmup.warm_planners(config, SimpleNamespace(type="cuda"))
    monkeypatch.delenv("KVARN_VLLM_WARMUP")
    gpu = SimpleNamespace(type="cuda")
    assert warmup.warm_planners(config, gpu) and seen == [(config, gpu)]
    assert folders == [str(tmp_path / ".triton" / "cache")]
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "vllm-config-hash")
    monkeypatch.undo()
    monkeypatch.setenv("KVARN_VLLM_RECENT_TILES", "1")
    calls = []
    for name in ("plan_store_device", "plan_draft_device"):
        real = getattr(kernels, name)
        monkeypatch.setattr(
            kernels,
            name,
            lambda *a, _real=real, _n=name, **k: calls.append((_n, k)) or _real(*a, **k),
        )
    warmup.launch_planners(config, torch.device("cpu"))
    assert [n for n, _ in calls] == ["plan_store_device", "plan_draft_device"]
    for _, k in calls:
        assert k["staging_tiles"] == config.ring_tiles and k["recent_tiles"] == 1
        assert k["sink"] == config.sink and k["window_keys"] == config.window_keys
