"""kvarn on vLLM's V1 model runner: staging slots by request id, and n-gram verify steps.

The V1 runner (vLLM 0.26 runs n-gram speculation only there) moves requests between batch
rows, so kvarn keeps its own slot per request id (``STEP.report_v1_schedule`` /
``report_v1_batch``, fed by the ``request-ids-v1`` patch). These tests drive that channel
with scheduler outputs shaped like vLLM's, and n-gram verify steps (1 + k tokens, random
rejections, rows reordered between steps, a finished request's slot reused) through the
builder and a real Attention layer, checked against kvarn-math.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import _releases
import numpy as np
import pytest
import torch
from kvarn_vllm import compat
from kvarn_vllm.step import STEP, _StepChannel


class _Runner:
    """Stands in for a V1 GPUModelRunner (the channel keeps a weak reference to it)."""


def _new(req_id, blocks=((4, 8),)):
    return SimpleNamespace(req_id=req_id, block_ids=tuple(list(b) for b in blocks))


def _schedule(new=(), cached=(), resumed=(), finished=(), preempted=(), drafts=None):
    """A SchedulerOutput with the fields kvarn reads. cached: (req_id, new_block_ids)."""
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _ in cached],
            new_block_ids=[b for _, b in cached],
            resumed_req_ids=set(resumed),
        ),
        finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
        scheduled_spec_decode_tokens={r: [0] * n for r, n in (drafts or {}).items()},
    )


def test_v1_slots_follow_requests_not_rows():
    ch = _StepChannel()
    runner = _Runner()
    ch.report_v1_schedule(runner, _schedule(new=[_new("a", ((3, 7),)), _new("b", ((0, 9),))]))
    ch.report_v1_batch(runner, ["a", "b"])
    rec = ch.record
    assert rec.slots.tolist() == [0, 1] and rec.new_rows.tolist() == [True, True]
    assert rec.first_blocks == {0: (3,), 1: None}  # vLLM's null block 0: no key
    assert rec.num_drafts.tolist() == [0, 0]

    # c joins; the runner reorders its rows; a has 3 drafts.
    ch.report_v1_schedule(
        runner,
        _schedule(new=[_new("c")], cached=[("a", None), ("b", None)], drafts={"a": 3}),
    )
    ch.report_v1_batch(runner, ["c", "a", "b"])
    rec = ch.record
    assert rec.slots.tolist() == [2, 0, 1]
    assert rec.new_rows.tolist() == [True, False, False]
    assert rec.num_drafts.tolist() == [0, 3, 0]

    # b finishes, a is preempted: d takes the lowest free slot; c keeps its slot although
    # it moves to row 0... and is then left out of a step (no tokens), keeping it still.
    ch.report_v1_schedule(
        runner, _schedule(new=[_new("d")], cached=[("c", None)], finished={"b"}, preempted={"a"})
    )
    ch.report_v1_batch(runner, ["c", "d"])
    assert ch.record.slots.tolist() == [2, 0]
    ch.report_v1_schedule(runner, _schedule(cached=[("d", None)]))
    ch.report_v1_batch(runner, ["d"])
    assert ch.record.slots.tolist() == [0] and ch.record.new_rows.tolist() == [False]

    # a resumes after preemption: a new slot, counted as added, its first tile from the
    # block ids the scheduler sends with it; c is back with its old slot.
    ch.report_v1_schedule(
        runner,
        _schedule(cached=[("c", None), ("a", ([5, 6],)), ("d", None)], resumed={"a"}),
    )
    ch.report_v1_batch(runner, ["a", "c", "d"])
    rec = ch.record
    assert rec.slots.tolist() == [1, 2, 0]
    assert rec.new_rows.tolist() == [True, False, False]
    assert rec.first_blocks == {1: (5,)}

    # A request aborted and resubmitted under the same id in one step: a fresh start.
    ch.report_v1_schedule(runner, _schedule(new=[_new("c")], finished={"c"}))
    ch.report_v1_batch(runner, ["c"])
    assert ch.record.new_rows.tolist() == [True]

    # A request the channel never saw scheduled is a bug, said as such.
    with pytest.raises(RuntimeError, match=r"\['zz'\] are in the V1 model runner's batch"):
        ch.report_v1_batch(runner, ["zz"])

    # Another runner (a new engine in this process) starts from no slots.
    other = _Runner()
    ch.report_v1_schedule(other, _schedule(new=[_new("x")]))
    ch.report_v1_batch(other, ["x"])
    assert ch.record.slots.tolist() == [0]
    with pytest.raises(RuntimeError, match="without a staging slot"):
        ch.report_v1_batch(runner, ["a"])  # the old runner's requests are gone

    ch.report_dummy_rows(5)
    assert ch.record.slots is None and ch.record.num_reqs == 5


def test_v1_hook_reports_schedule_and_batch():
    """The ledger's worker patch wraps vLLM's real V1 runner methods: the hook sees the
    scheduler output before vLLM's ``_update_states`` runs on it, and the batch's request ids
    for a scheduled step's metadata (a dummy batch otherwise), and vLLM's own methods then
    run with the same arguments. The runner is a stand-in holding what vLLM's methods read
    first: ``_update_states`` drops the finished requests, then stops at the first attribute
    the stand-in lacks; ``_build_attention_metadata`` returns at once for a runner without
    KV cache groups (an attention-free model)."""
    from kvarn_vllm import patches
    from vllm.v1.worker import gpu_model_runner as v1

    patches.apply_worker_patches()
    runner_cls = v1.GPUModelRunner
    assert compat.is_wrapped(runner_cls._update_states)
    assert compat.is_wrapped(runner_cls._build_attention_metadata)
    assert not compat.wrap_v1_runner_steps(print, print, print)  # once only
    runner = _Runner()
    runner.requests = {"gone": object(), "kept": object()}
    runner.num_prompt_logprobs = {"gone": 1}
    so = _schedule(new=[_new("r0"), _new("r1", ((5, 9),))], finished=["gone"])
    # vLLM's method ran past the finished requests (0.26: late_interaction_runner is the
    # first attribute the stand-in lacks; 0.33: _on_request_state_removed)
    with pytest.raises(AttributeError, match="'_Runner' object has no attribute"):
        runner_cls._update_states(runner, so)
    assert list(runner.requests) == ["kept"]  # vLLM's own method dropped the finished one
    runner.input_batch = SimpleNamespace(req_ids=["r1", "r0", None])
    runner.kv_cache_config = SimpleNamespace(kv_cache_groups=[])
    sched = {"r0": 1, "r1": 1}
    built = runner_cls._build_attention_metadata(
        runner, num_tokens=2, num_reqs=2, max_query_len=1, num_scheduled_tokens=sched
    )
    assert built == ({}, None)
    record = STEP.record
    assert record.num_reqs == 2 and record.slots.tolist() == [1, 0]  # r0 took slot 0
    assert record.new_rows.tolist() == [True, True]
    assert record.first_blocks == {0: (4,), 1: (5,)}
    assert runner_cls._build_attention_metadata(runner, 4, 3, 1, for_cudagraph_capture=True) == (
        {},
        None,
    )
    record = STEP.record
    assert record.slots is None and record.num_reqs == 3  # a dummy batch of 3 rows


_interp = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="runs the kvarn kernels on CPU tensors: needs TRITON_INTERPRET=1",
)


def _group_of(meta, row):
    """The row group serving batch row ``row``'s queries, and the row's index in it (a
    per-token group: its first token's)."""
    for group in (meta.context, meta.decode):
        if group is not None and (group.rows is None or row in group.rows.tolist()):
            return group, row if group.rows is None else group.rows.tolist().index(row)
    raise AssertionError(f"row {row} is in no attention group")


@_interp
@pytest.mark.parametrize("method", ["ngram", "ngram_gpu"])
def test_ngram_verify_steps_on_v1_rows(vllm_config_factory, monkeypatch, method):
    """n-gram verify steps of two requests whose rows swap between steps, with random
    rejections and draft counts (n-gram proposes up to K tokens, or none: a step of verify
    blocks of different lengths and decode rows, whose short blocks run as decode rows, one
    per token, beside the decode rows); then one finishes and a new request takes its slot.
    Every query's output matches kvarn-math over that request's accepted tokens. The host's
    lengths are upper bounds (every draft accepted), as under the async scheduling
    ``ngram_gpu`` runs with."""
    from test_speculative import HKV, D, G, K, SpecHarness, assert_matches

    monkeypatch.setenv("KVARN_VLLM_EXACT_SINK", "1")
    monkeypatch.setenv("KVARN_VLLM_RECENT_TILES", "1")
    h = SpecHarness(vllm_config_factory, monkeypatch, method=method)
    runner = _Runner()
    rng = np.random.default_rng(0)
    cached: dict[str, int] = {}
    slot_of: dict[str, int] = {}

    kinds: list[str] = []  # how each step ran its verify rows

    def step(order, new=(), finished=()):
        """One step: prompts for ``new`` (id, length), verify rows of 1 + d for the rest,
        d drafts in {0, 2, K}."""
        new_ids = dict(new)
        verify = [r for r in order if r not in new_ids]
        drafts = {r: int(rng.choice([0, 2, K])) for r in verify}
        STEP.report_v1_schedule(
            runner,
            _schedule(
                new=[_new(r) for r in new_ids],
                cached=[(r, None) for r in verify],
                finished=finished,
                drafts=drafts,
            ),
        )
        STEP.report_v1_batch(runner, list(order))
        slots = STEP.record.slots.tolist()
        for r, s in zip(order, slots):
            slot_of[r] = s
        num_new = [new_ids.get(r, 1 + drafts.get(r, 0)) for r in order]
        before = [0 if r in new_ids else cached[r] for r in order]
        # Host lengths: upper bounds, as under async scheduling.
        upper = [0 if r in new_ids else K for r in order]
        meta = h.builder.build(0, h.cam(slots, before, num_new, upper))
        kv = [(h.rand(n, HKV, D), h.rand(n, HKV, D)) for n in num_new]
        q, out = h.run(meta, [(s, c, x) for s, c, x in zip(slots, before, kv)])
        at = 0
        for i, r in enumerate(order):
            s, n = slots[i], num_new[i]
            if r in new_ids:
                h.kv[s] = kv[i]
                cached[r] = n
                at += n
                continue
            ak, av = h.kv[s]
            step_k, step_v = torch.cat([ak, kv[i][0]]), torch.cat([av, kv[i][1]])
            ctx, g = _group_of(meta, i)
            kinds.append(
                "tokens" if ctx.per_token else "context" if ctx is meta.context else "decode"
            )
            quantized = int(ctx.quantized_lens[g])
            key_lens = ctx.key_lens
            for j in range(n):
                pos = cached[r] + j
                assert_matches(
                    h,
                    out[at + j : at + j + 1],
                    step_k[: pos + 1],
                    step_v[: pos + 1],
                    quantized,
                    q[at + j : at + j + 1],
                    (r, len(cached), j),
                    s,
                    None if key_lens is None else int(key_lens[g]),
                )
            accepted = int(rng.integers(0, n))
            h.kv[s] = (step_k[: cached[r] + 1 + accepted], step_v[: cached[r] + 1 + accepted])
            cached[r] += 1 + accepted
            at += n

    step(["a", "b"], new=[("a", 61), ("b", 110)])
    assert slot_of == {"a": 0, "b": 1}
    for i in range(14):
        step(["b", "a"] if i % 2 else ["a", "b"])
    assert "tokens" in kinds  # some step's verify blocks ran as decode rows beside others
    assert cached["a"] > G  # a's verify steps crossed a tile boundary
    assert cached["b"] > 2 * G  # b quantized more tiles than c will have
    # b finishes; c arrives and takes b's slot: its state starts afresh (b's count of
    # quantized tiles would have c read records it never wrote).
    step(["c", "a"], new=[("c", 70)], finished={"b"})
    assert slot_of["c"] == 1
    for i in range(4):
        step(["a", "c"] if i % 2 else ["c", "a"])


# n-gram speculation on the V1 runner: where the 'request-ids-v1' ledger entry applies
pytestmark = _releases.needs("request-ids-v1")
