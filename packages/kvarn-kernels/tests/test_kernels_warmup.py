"""warmup(): every kernel variant compiled before serving (CPU: it runs; GPU: nothing compiles after)."""

from __future__ import annotations

import kvarn_kernels as kk
import numpy as np
import pytest
import torch
from kernel_testing import set_env
from kvarn_kernels import settings as kernel_settings
from kvarn_kernels.attention.launch import _query_block, query_block_sizes


@pytest.mark.parametrize("group", [1, 3, 4, 8, 16])
def test_query_block_sizes_cover_every_query_length(group: int) -> None:
    sizes = query_block_sizes(group)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1
    for n in range(1, 300):
        assert _query_block(n, group, False) in sizes, n
    assert len(sizes) == 1 + int(np.log2(max(1, 64 // (1 << (group - 1).bit_length()))))


def test_query_block_sizes_batch_invariant(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, "KVARN_KERNELS_BATCH_INVARIANT", "1")
    assert query_block_sizes(4) == [4]  # 16 rows, as a decode block
    assert query_block_sizes(16) == [1]


@pytest.mark.interpreter
@pytest.mark.parametrize(("sink", "window"), [(False, None), (True, 40)])
def test_warmup_runs_every_path(sink: bool, window: int | None) -> None:
    summary = kk.warmup(
        "kvarn_k4v4_g64", 64, 4, 2, torch.float32, "cpu", sink=sink, sliding_window=window
    )
    paths = 1 + int(window is not None)  # unmasked and windowed
    assert summary["query_block_sizes"] == [1, 2, 4, 8, 16, 32]
    assert summary["launches"] == 2 + paths * 2 * (1 + 2 * 6) + 3  # MQA with and without fresh_kv
    only = kk.warmup(
        "kvarn_k4v4_g64", 64, 4, 2, torch.float32, "cpu", own_kv=(True,), key_frame="auto"
    )
    assert only["launches"] == 2 + 2 * (1 + 6) + 3
    assert summary["seconds"] > 0
    assert kk.compiled_variants() == {}  # the interpreter compiles nothing


@pytest.mark.interpreter
def test_warmup_with_values_only_windows() -> None:
    """The values-only layout (a 4-D staging area, the key ring of the open tile apart)."""
    summary = kk.warmup(
        "kvarn_k4v2_g64", 64, 4, 2, torch.float32, "cpu", staging_tiles=2, sink=True, key_tiles=1
    )
    assert summary["launches"] == 2 + 2 * (1 + 2 * 6) + 3


def test_warmup_rejects_a_bad_head_split() -> None:
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        kk.warmup("kvarn_k4v2_g128", 128, 6, 4, torch.float16, "cpu")
    with pytest.raises(ValueError, match="kvarn_k9"):
        kk.warmup("kvarn_k9v9_g1", 128, 8, 8, torch.float16, "cpu")
    with pytest.raises(ValueError, match="key_frame must be one of"):
        kk.warmup("kvarn_k4v2_g128", 128, 8, 8, torch.float16, "cpu", key_frame="raw")


def test_warmup_threads_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvarn_kernels._triton import INTERPRET
    from kvarn_kernels.warmup import WARMUP_THREADS_ENV, warmup_threads

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    set_env(monkeypatch, WARMUP_THREADS_ENV, None)
    assert warmup_threads(None, cuda) == (1 if INTERPRET else 4)  # the default
    assert warmup_threads(8, cpu) == 1  # off CUDA: one at a time
    assert warmup_threads(8, cuda) == (1 if INTERPRET else 8)
    set_env(monkeypatch, WARMUP_THREADS_ENV, "6")
    assert warmup_threads(None, cuda) == (1 if INTERPRET else 6)
    set_env(monkeypatch, "KVARN_KERNELS_AUTOTUNE", "1")
    assert warmup_threads(None, cuda) == 1  # autotuning times launches: one at a time
    set_env(monkeypatch, "KVARN_KERNELS_AUTOTUNE", None)
    for bad in ("0", "-2", "many", "1.5"):
        monkeypatch.setenv(WARMUP_THREADS_ENV, bad)
        with pytest.raises(ValueError, match=f"{WARMUP_THREADS_ENV} must be a positive.*{bad}"):
            kernel_settings.reload()
    for bad_arg in (0, True, 2.0):
        with pytest.raises(ValueError, match="warm-up threads must be a positive integer"):
            warmup_threads(bad_arg, cpu)  # type: ignore[arg-type]


def test_warmup_task_pool_runs_every_task_and_raises_errors() -> None:
    """The pool behind ``threads > 1`` (here on the CPU, with plain tasks)."""
    import threading

    from kvarn_kernels.warmup import _run

    seen: list[tuple[int, int]] = []
    tasks = [lambda i=i: seen.append((i, threading.get_ident())) for i in range(12)]
    _run(tasks, torch.device("cpu"), 3)
    assert sorted(i for i, _ in seen) == list(range(12))
    seen.clear()
    _run(tasks, torch.device("cpu"), 1)
    assert [i for i, _ in seen] == list(range(12))  # in order, in this thread
    assert {t for _, t in seen} == {threading.get_ident()}

    def fails() -> None:
        raise RuntimeError("compile failed (fake)")

    with pytest.raises(RuntimeError, match="compile failed"):
        _run([*tasks, fails], torch.device("cpu"), 4)


@pytest.mark.gpu
@pytest.mark.parametrize("sink", [False, True])
def test_nothing_compiles_after_warmup(sink: bool) -> None:
    """After warmup, serving-like calls of every size (batch, query length, window, rows)
    launch only kernels already compiled (the store choosing key frames, attention reading
    them: kvarn-vllm's default)."""
    preset, d, hq, hkv, dtype, dev = "kvarn_k4v2_g128", 128, 32, 8, torch.bfloat16, "cuda"
    kk.warmup(preset, d, hq, hkv, dtype, dev, sink=sink, sliding_window=700, key_frame="auto")
    before = kk.compiled_variants()
    assert before and all(n >= 1 for n in before.values()), before
    g = 128
    gen = torch.Generator(device="cpu").manual_seed(1)
    batch, max_blocks = 37, 21  # neither 1 nor a multiple of 16
    cache = kk.allocate_cache(batch * max_blocks + 1, hkv, d, preset, dev)
    staging = kk.allocate_staging(batch, hkv, d, preset, dtype, dev, sink=sink)
    lens_host = np.array([1 + (i * 997) % (max_blocks * g - 1) for i in range(batch)])
    table_host = np.arange(1, batch * max_blocks + 1, dtype=np.int32).reshape(batch, max_blocks)
    for chunk in (1, 17, 160):  # stage writes of 1, 17 and 160 rows per request
        cached = np.maximum(lens_host - chunk, 0)
        new = lens_host - cached
        total = int(new.sum())
        k = torch.randn((total, hkv, d), generator=gen).to(dev, dtype)
        q = torch.randn((total, hq, d), generator=gen).to(dev, dtype)
        plan = kk.plan_store(cached, new, None, np.arange(batch), table_host, preset, sink=sink)
        kk.store_kv(k, k.clone(), cache, staging, plan.to(dev), preset, key_frame="auto", query=q)
    table = torch.as_tensor(table_host, device=dev)
    lens = torch.as_tensor(lens_host, dtype=torch.int32, device=dev)
    quant = (lens // g) * g
    slots = torch.arange(batch, dtype=torch.int32, device=dev)
    sink_lens = torch.where(lens >= g, g, 0).to(torch.int32) if sink else None
    sink_slots = slots if sink else None
    # Batches (and steps sized by split_batch) whose Gluon split counts fall in every value
    # class: 1 (37 sequences), a multiple of 16 (4, or 3 sized as 4), and others.
    for b, step in ((1, None), (4, None), (5, None), (16, None), (37, None), (3, 3), (5, 100)):
        for window in (None, 700, 33):
            q = torch.randn((b, hq, d), generator=gen).to(dev, dtype)
            kk.decode_attention(
                q, cache, staging, table[:b], lens[:b], quant[:b], slots[:b], preset, d**-0.5,
                sliding_window=window, sink_lens=None if not sink else sink_lens[:b],
                sink_slots=None if not sink else sink_slots[:b], split_batch=step,
            )  # fmt: skip
    for n in (1, 2, 3, 7, 9, 33, 64, 100):
        rows = slice(1, 4)  # 998, 1995 and 305 tokens
        qlen = min(n, int(lens_host[rows].min()))
        q = torch.randn((3 * qlen, hq, d), generator=gen).to(dev, dtype)
        qsl = torch.arange(0, 3 * qlen + 1, qlen, dtype=torch.int32, device=dev)
        kk.multi_query_attention(
            q, qsl, cache, staging, table[rows], lens[rows], quant[rows], slots[rows], preset,
            d**-0.5, max_query_len=qlen, sink_lens=None if not sink else sink_lens[rows],
            sink_slots=None if not sink else sink_slots[rows],
        )  # fmt: skip
    for rows in (1, 16, 129):
        x = torch.randn((rows, hq, d), generator=gen).to(dev, dtype)
        kk.unrotate(kk.rotate(x))
    kk.dequantize(cache, table[0, :3].contiguous(), preset, d, dtype=dtype)
    torch.cuda.synchronize()
    assert kk.compiled_variants() == before


def test_per_sequence_metadata_is_not_specialized_on_alignment() -> None:
    """Every per-sequence metadata pointer of the attention kernel is exempt from Triton's
    alignment specialization: an engine passes row slices (kvarn-vllm's runs of verify blocks
    start at any row), and a slice starting off a 16-byte boundary would compile a new variant
    mid-serving (an H200 engine did, for ``key_lens_ptr``, 2026-12-02)."""
    import inspect

    from kvarn_kernels.attention import kernel as k

    fn = getattr(k.attention_partial_kernel, "fn", k.attention_partial_kernel)
    params = list(inspect.signature(fn).parameters)
    metadata = [
        p
        for p in params
        if p in ("qstart_ptr", "block_table_ptr") or p.endswith(("lens_ptr", "slots_ptr"))
    ]
    assert len(metadata) == 8, metadata
    assert set(metadata) <= set(k._METADATA), sorted(set(metadata) - set(k._METADATA))
    assert set(k._METADATA) <= set(params)


def test_fast_decode_kernel_does_not_specialize_on_the_split_layout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Gluon decode kernel takes the split layout (split count, partial count, first split,
    fixed split length) unspecialized: they change with the batch from step to step, and a new
    value class (1, a multiple of 16) would compile a variant mid-serving. ``compiled_variants``
    counts the fast path's two kernels too (checked here with stand-ins holding two compiled
    variants each, since the interpreter compiles nothing), so the GPU tests above see such a
    compile."""
    import importlib
    from types import SimpleNamespace

    from kvarn_kernels.attention import fast

    exempt = [p.name for p in fast.fast_decode_partial_kernel.params if p.do_not_specialize]
    assert exempt == ["num_splits", "part_splits", "split0", "split_tiles"]
    # The Triton kernel's part of the fast path: its partial count follows the Gluon splits
    # (an H200 warm-up test compiled a variant mid-serving while it was specialized).
    from kvarn_kernels.attention import kernel as attn

    kernel = attn.attention_partial_kernel
    if hasattr(kernel, "params"):  # compiled
        exempt = [p.name for p in kernel.params if p.do_not_specialize]
    else:  # Triton's interpreter keeps the decorator's arguments
        exempt = list(kernel.kwargs["do_not_specialize"])
    assert sorted(exempt) == ["num_splits", "part_splits", "split_steps", "stride_bt", "window"]
    modules = {
        "attention.kernel": ("attention_partial_kernel", "attention_combine_kernel"),
        "attention.prep": ("prepare_queries_kernel",),
        "attention.fast": ("fast_decode_partial_kernel",),
        "attention.tiles": ("tiles_decode_partial_kernel",),
        "quantize.kernel": ("quantize_tiles_kernel", "stage_tokens_kernel"),
        "dequantize.kernel": ("dequantize_kernel",),
        "rotation.kernel": ("rotate_rows_kernel",),
    }
    for module, names in modules.items():
        mod = importlib.import_module(f"kvarn_kernels.{module}")
        for name in names:
            stand_in = SimpleNamespace(__name__=name, device_caches={0: ({"a": 1, "b": 2},)})
            monkeypatch.setattr(mod, name, stand_in)
    counts = kk.compiled_variants()
    assert counts["fast_decode_partial_kernel"] == counts["prepare_queries_kernel"] == 2
    assert len(counts) == 9


@pytest.mark.gpu
@pytest.mark.parametrize("invariant", [False, True])
def test_nothing_compiles_after_warmup_on_row_slices(invariant: bool) -> None:
    """kvarn-vllm's engine settings for SmolLM2 (head_dim 64, 9 query / 3 KV heads: the
    multi-query kernel, no Gluon), values-only exact windows, a sink, two open tiles (speculative
    decoding, so the store stages frame queries): after warmup, the store and calls on row
    slices that start at any row (batch-invariant runs of verify blocks) with their
    ``key_lens`` sliced too compile nothing."""
    preset, d, hq, hkv, dtype, dev = "kvarn_k4v2_g128", 64, 9, 3, torch.bfloat16, "cuda"
    s_tiles, recent = 3, 1
    kk.warmup(
        preset, d, hq, hkv, dtype, dev, staging_tiles=s_tiles, sink=True,
        batch_invariant=invariant, own_kv=(False,), key_frame="auto", key_tiles=s_tiles - recent,
        frame_queries=True,
    )  # fmt: skip
    before = kk.compiled_variants()
    g, batch, max_blocks = 128, 13, 9
    gen = torch.Generator(device="cpu").manual_seed(2)
    cache = kk.allocate_cache(batch * max_blocks + 1, hkv, d, preset, dev)
    staging = kk.allocate_staging(
        batch, hkv, d, preset, dtype, dev, s_tiles, True, s_tiles - recent
    )
    lens_host = np.array([40 + (i * 331) % (max_blocks * g - 40) for i in range(batch)])
    table_host = np.arange(1, batch * max_blocks + 1, dtype=np.int32).reshape(batch, max_blocks)
    k = torch.randn((int(lens_host.sum()), hkv, d), generator=gen).to(dev, dtype)
    q_all = torch.randn((k.shape[0], hq, d), generator=gen).to(dev, dtype)
    plan = kk.plan_store(
        [0] * batch, lens_host, None, np.arange(batch), table_host, preset,
        staging_tiles=s_tiles, sink=True, recent_tiles=recent, window_keys=False,
    ).to(dev)  # fmt: skip
    fq = kk.allocate_frame_queries(
        batch, hq, d, preset, dtype, dev, s_tiles, True, s_tiles - recent
    )
    kk.store_kv(
        k, k.clone(), cache, staging, plan, preset, key_frame="auto", query=q_all, frame_queries=fq
    )
    table = torch.as_tensor(table_host, device=dev)
    slots = torch.arange(batch, dtype=torch.int32, device=dev)
    sink_lens = torch.where(plan.seq_lens >= g, g, 0).to(torch.int32)
    common = dict(batch_invariant=invariant, raw_keys=True, key_tiles=s_tiles - recent)
    for lo, hi in ((0, 13), (1, 4), (3, 5), (5, 12)):
        rows = slice(lo, hi)
        args = (
            cache, staging, table[rows], plan.seq_lens[rows], plan.attention_lens[rows],
            slots[rows], preset, d**-0.5,
        )  # fmt: skip
        meta = dict(sink_lens=sink_lens[rows], sink_slots=slots[rows],
                    key_lens=plan.key_read_lens[rows], **common)  # fmt: skip
        q = torch.randn((hi - lo, hq, d), generator=gen).to(dev, dtype)
        kk.decode_attention(q, *args, **meta)
        for n in (1, 5, 20):
            qsl = torch.arange(0, (hi - lo) * n + 1, n, dtype=torch.int32, device=dev)
            q = torch.randn(((hi - lo) * n, hq, d), generator=gen).to(dev, dtype)
            kk.multi_query_attention(q, qsl, *args, max_query_len=n, **meta)
    torch.cuda.synchronize()
    assert kk.compiled_variants() == before


@pytest.mark.gpu
def test_warmup_compiles_into_compile_cache_and_a_new_process_reuses_it(tmp_path) -> None:
    """vLLM points TRITON_CACHE_DIR at a folder per engine configuration: under
    ``compile_cache`` the warm-up writes its kernels to the stable folder instead, and a second
    process (another engine) finds them all there, compiling nothing new."""
    import os
    import subprocess
    import sys
    import textwrap

    engine, stable = tmp_path / "engine", tmp_path / "stable"
    code = textwrap.dedent(
        f"""
        import os, torch, kvarn_kernels as kk
        os.environ["TRITON_CACHE_DIR"] = {str(engine)!r}
        with kk.compile_cache({str(stable)!r}):
            kk.warmup("kvarn_k4v2_g128", 128, 32, 8, torch.bfloat16, "cuda", staging_tiles=2,
                      sink=True, key_tiles=1, key_frame="auto")
        assert os.environ["TRITON_CACHE_DIR"] == {str(engine)!r}
        print("OK")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}

    def run() -> set[str]:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
        )
        assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]
        return {str(p.relative_to(stable)) for p in stable.rglob("*") if p.is_file()}

    first = run()
    assert first, "nothing compiled into the stable folder"
    assert not engine.exists() or not any(engine.rglob("*.cubin"))
    assert run() == first  # the second process loaded every kernel from disk


@pytest.mark.gpu
def test_threaded_warmup_compiles_the_same_variants(tmp_path) -> None:
    """A cold warm-up (empty Triton cache, fresh process) from 4 threads compiles exactly the
    variants the one-thread warm-up does; both times are printed (``pytest -s``)."""
    import json
    import os
    import subprocess
    import sys
    import textwrap

    def run(threads: int) -> dict:
        code = textwrap.dedent(
            f"""
            import json, torch, kvarn_kernels as kk
            with kk.compile_cache({str(tmp_path / f"cache{threads}")!r}):
                out = kk.warmup("kvarn_k4v2_g128", 128, 32, 8, torch.bfloat16, "cuda",
                                staging_tiles=2, sink=True, key_tiles=1, key_frame="auto",
                                sliding_window=700, threads={threads})
            print(json.dumps({{"variants": kk.compiled_variants(), **out}}))
            """
        )
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=400, env=env
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    one, four = run(1), run(4)
    print(f"cold warm-up: 1 thread {one['seconds']:.1f} s, 4 threads {four['seconds']:.1f} s")
    assert four["threads"] == 4 and one["threads"] == 1
    assert four["launches"] == one["launches"]
    assert four["variants"] == one["variants"] and all(n >= 1 for n in one["variants"].values())
