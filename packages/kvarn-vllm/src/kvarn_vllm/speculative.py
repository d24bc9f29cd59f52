"""Speculative decoding: the methods served, and the store plans made on the device.

Under speculative decoding the host knows only upper bounds of the rows' lengths (accepted
drafts are known on the GPU), so a target step's store plan is made on the device from
``seq_lens - num_drafts`` (:func:`device_plan`), and a drafter's step, whose tokens are all
drafts, sends them to staging without committing anything (:func:`draft_step`). The
planner (:class:`kvarn_vllm.planning.StepPlanner`) calls both; the runner hooks that mark a
drafter's step or a DFlash proposal report to :data:`kvarn_vllm.step.STEP`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvarn_vllm import kernels
from kvarn_vllm.metadata import KvarnMetadata, RowGroup
from kvarn_vllm.sink import sink_rows_for

__all__ = ["SPEC_METHODS", "check_spec_method", "device_plan", "draft_step", "spec_state"]

SPEC_METHODS = {"v2": ("eagle", "eagle3", "mtp", "dflash"), "v1": ("ngram", "ngram_gpu")}
"""Speculative methods served, by vLLM 0.26 model runner: V2 drafts EAGLE, EAGLE-3 and MTP one
token per step (each draft step marked by :data:`kvarn_vllm.step.STEP`), DFlash a non-causal
block of ``1 + k`` tokens per step (its context K/V stored with the target step's plan,
:meth:`STEP.proposing <kvarn_vllm.step._StepChannel.proposing>`); V1 runs n-gram (prompt
lookup), whose drafts are only verified on the GPU: ``ngram`` proposes them on the host (vLLM
then schedules synchronously), ``ngram_gpu`` on the GPU under async scheduling (the host's
lengths are upper bounds, and the step's plan is made on the device as for EAGLE). On vLLM
0.26.x and 0.27.x all of them are served; on 0.29.x-0.33.x only the V1 runner's n-gram methods
(:mod:`kvarn_vllm.releases` refuses the drafter models and n-gram on V2 at start-up, saying why)."""


def check_spec_method(spec_cfg: Any, use_v2_runner: bool, layer_names: list[str]) -> int:
    """The number of speculative tokens of vLLM's ``SpeculativeConfig`` (0 without one).

    Raises:
        ValueError: for a method kvarn does not serve on this model runner, naming the
            runner that serves it where one does.
    """
    if spec_cfg is None:
        return 0
    runner = "v2" if use_v2_runner else "v1"
    method = getattr(spec_cfg, "method", None)
    if method not in SPEC_METHODS[runner]:
        other = [r for r, methods in SPEC_METHODS.items() if method in methods]
        hint = (
            f" kvarn serves {method!r} on vLLM's {other[0].upper()} model runner, "
            f"and this configuration runs the {runner.upper()} runner (vLLM logs "
            "why: 'Model Runner V2 does not yet support ...'; "
            "VLLM_USE_V2_MODEL_RUNNER=1 or 0 chooses)."
            if other
            else ""
        )
        raise ValueError(
            f"kvarn-vllm serves speculative decoding with the methods "
            f"{', '.join(SPEC_METHODS['v2'])} (vLLM's V2 model runner) and "
            f"{', '.join(SPEC_METHODS['v1'])} (V1); got method {method!r} (layers "
            f"{layer_names[:2]}...).{hint} Use one of those methods, or "
            "kv_cache_dtype auto/fp8 for this one."
        )
    return int(spec_cfg.num_speculative_tokens or 0)


# Per-process device state of speculative decoding, shared by every builder of the process
# (target groups, the drafter's own builders): tokens in quantized tiles per request-state
# row, and its value before the current step (so that every builder of a step, whichever
# runs first, plans from the same starting point); and per row the first position its
# request wrote itself (after its prefix-cache hit: where its exact copy in staging begins).
_SPEC_STATE: dict[str, Any] = {}


def spec_state(device: Any, num_rows: int) -> dict[str, Any]:
    """This process's speculative state on ``device`` (``[num_rows]`` int32 tensors
    ``quantized``, ``before``, ``start``, and the ``serial`` of the step ``before`` is of)."""
    import torch

    key = str(device)
    state = _SPEC_STATE.get(key)
    if state is None or state["quantized"].numel() < num_rows:
        quantized = torch.zeros(num_rows, dtype=torch.int32, device=device)
        state = {
            "quantized": quantized,
            "before": quantized.clone(),
            "start": quantized.clone(),
            "serial": -1,
        }
        _SPEC_STATE[key] = state
    return state


def device_plan(planner: Any, cam: Any, record: Any, num_reqs: int, num_tokens: int, buf: Any):
    """A target step's store plan from the device lengths, on the planner's buffer ``buf``.

    ``cam.seq_lens`` is exact on the device; the committed length of a row is
    ``seq_len - num_drafts``. Tiles already quantized come from the shared per-row state,
    reset for requests (re)added this step. ``record`` None: a CUDA graph capture, whose
    plan has the real step's shapes and writes nothing.
    """
    import torch

    config = planner.config
    g = planner.preset.group_size
    seq = cam.seq_lens[:num_reqs].to(torch.int32)
    qsl = planner.view(buf, "qsl", num_reqs + 1)
    slots = planner.view(buf, "slots", num_reqs)
    drafts = planner.view(buf, "drafts", num_reqs)
    new_rows = planner.view(buf, "new_rows", num_reqs)
    spec = planner.spec
    if record is not None and spec["serial"] != record.serial:
        spec["before"].copy_(spec["quantized"])
        spec["serial"] = record.serial
    floor = (seq - (qsl[1:] - qsl[:-1])) // g * g
    before = spec["before"][slots.long()]
    before = torch.where(new_rows > 0, floor, torch.minimum(before, floor))
    real = 0 if record is None else min(record.num_reqs, num_reqs)
    start = torch.where(new_rows > 0, floor, spec["start"][slots.long()])
    if config.recent_tiles or not config.window_keys:
        spec["start"].index_copy_(0, slots[:real].long(), start[:real])
    out = planner.buffers.plan_out(config, num_reqs, planner.max_tiles, num_tokens)
    tiles, writes = out.tiles, out.writes
    plan = kernels.plan_store_device(
        seq,
        qsl,
        drafts,
        before,
        slots,
        cam.block_table_tensor[:num_reqs],
        planner.preset,
        staging_tiles=config.ring_tiles,
        max_tiles=planner.max_tiles,
        max_writes=num_tokens,
        sink=config.sink,
        recent_tiles=config.recent_tiles,
        exact_start=start,
        window_keys=config.window_keys,
        out=out,
    )
    if record is None:
        tiles.fill_(-1)
        writes.fill_(-1)
    spec["quantized"].index_copy_(0, slots[:real].long(), plan.quantized_lens[:real])
    return planner.buffers.plan_views(plan, num_reqs, tiles, writes)


def _draft_shape(cam: Any) -> tuple[np.ndarray, int, bool]:
    """A drafter step's ``(query_start_loc, tokens per row, causal)``.

    Raises:
        ValueError: when the rows bring different numbers of tokens, or the causal flag
            is not one bool.
    """
    num_reqs = int(cam.num_reqs)
    qsl = cam.query_start_loc_cpu[: num_reqs + 1].numpy().astype(np.int32)
    qlens = np.diff(qsl)
    n = max(1, int(qlens.max(initial=0)))
    live = int(np.count_nonzero(qlens))
    if np.any(qlens[:live] != n) or np.any(qlens[live:] != 0):
        raise ValueError(
            "kvarn-vllm: a drafter step whose requests bring different numbers of "
            f"query tokens ({sorted(set(qlens.tolist()))}) is not supported"
        )
    causal = getattr(cam, "causal", True)
    if not isinstance(causal, bool):
        raise ValueError(
            f"kvarn-vllm: a drafter step's causal flag must be one bool, got {causal!r}"
        )
    return qsl, n, causal


def _upload_draft_rows(planner: Any, record: Any, qsl: np.ndarray, real: int) -> None:
    """A drafter step's per-row vectors (slots, sinks, query starts) to the device buffer;
    the draft planner writes the plan regions."""
    num_reqs = qsl.size - 1
    buffers = planner.buffers
    host = buffers.host()
    rslots = record.slots
    if rslots is not None and real:
        host[buffers.start("slots") :][:real] = rslots[:real]
        if planner.config.sink:
            # Rows were (re)added in the target step of this record, which already
            # decided their sink; num_cached does not matter here.
            lens, sink_slots = sink_rows_for(
                record,
                np.asarray(rslots[:real], dtype=np.int32),
                np.zeros(real, dtype=np.int32),
                planner.preset.group_size,
                planner.max_num_reqs,
            )
            host[buffers.start("sink_lens") :][:real] = lens
            host[buffers.start("sink_slots") :][:real] = sink_slots
    host[buffers.start("qsl") :][: num_reqs + 1] = qsl
    # The per-row vectors only: the draft planner writes the plan regions.
    buffers.upload(host, buffers.start("seq_lens"), buffers.start("qsl") + num_reqs + 1)


def draft_step(planner: Any, cam: Any, record: Any, capture: bool = False) -> KvarnMetadata:
    """A drafter's step: ``n`` draft tokens per row at its last ``n`` positions, one
    for EAGLE/MTP steps 2..k, a block of ``1 + k`` for DFlash (non-causal when
    ``cam.causal`` is False). Rows without tokens (padding) come last.

    Its tokens are drafts: they go to staging and nothing is committed (the drafter's
    layers commit with the target's plan of the next step, which rewrites these
    positions). ``capture``: a CUDA graph capture, which keeps the (empty) store plan so
    that the graph holds the store; write rows cover every token of the padded step.
    """
    config = planner.config
    num_reqs = int(cam.num_reqs)
    qsl, n, causal = _draft_shape(cam)
    num_tokens = max(int(qsl[-1]), int(cam.num_actual_tokens))
    real = min(record.num_reqs, num_reqs) if record.slots is not None else 0
    _upload_draft_rows(planner, record, qsl, real)
    buf = planner.buffers.device_buf
    seq = cam.seq_lens[:num_reqs]
    if not real:  # dummy (profiling) draft step: attend the row's own tokens only
        seq = seq.clamp(max=n)
    slots = planner.view(buf, "slots", num_reqs)
    out = planner.buffers.plan_out(config, num_reqs, num_reqs, num_tokens)
    # Every draft goes to staging, nothing is quantized; one launch writes the
    # lengths, windows and write rows into the step's buffer views.
    plan = kernels.plan_draft_device(
        seq,
        slots,
        planner.spec["quantized"],
        planner.spec["start"],
        planner.preset,
        tokens_per_row=n,
        num_tokens=num_tokens,
        live_rows=real,
        staging_tiles=config.ring_tiles,
        sink=config.sink,
        recent_tiles=config.recent_tiles,
        window_keys=config.window_keys,
        out=out,
    )
    sink = config.sink
    group = RowGroup(
        rows=None,
        token_index=None,
        query_start_loc=planner.view(buf, "qsl", num_reqs + 1),
        seq_lens=out.seq_lens,
        quantized_lens=out.read_lens,
        staging_slots=slots,
        block_table=cam.block_table_tensor[:num_reqs],
        max_query_len=n,
        max_seq_len=int(cam.max_seq_len),
        num_tokens=num_tokens,
        query_start_loc_host=qsl,
        sink_lens=planner.view(buf, "sink_lens", num_reqs) if sink else None,
        sink_slots=planner.view(buf, "sink_slots", num_reqs) if sink else None,
        key_lens=out.key_read_lens,
    )
    # One token per row attends as decode; a block as context rows (multi-query).
    block = n > 1 or not causal
    return KvarnMetadata(
        num_reqs=num_reqs,
        num_actual_tokens=int(cam.num_actual_tokens),
        plan=plan if real or capture else None,
        decode=None if block else group,
        fresh=None,
        context=group if block else None,
        causal=causal,
    )
