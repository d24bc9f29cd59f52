"""Speculative decoding over the quantized cache: randomized accept/reject schedules.

A request runs verify steps of ``1 + d`` tokens (the sampled token and ``d`` drafts, 1 <= d <= 8)
of which the first ``1 + a`` are right; the ``d - a`` rejected drafts carry garbage K/V (x100) and
their positions are written again by later steps. Schedules cross tile boundaries, roll back into
a tile that a rejected draft completed, and may end right after a tile completes. Whatever the
schedule, the records must be byte-identical to storing only the accepted tokens once, and the
staging must hold exactly the accepted tokens of the open tiles.

Both planners are exercised: :func:`kvarn_kernels.plan_store` (host, committed length given) and
:func:`kvarn_kernels.plan_store_device` (the commit decided from the device lengths, as
kvarn-vllm runs it under speculative decoding).
"""

from __future__ import annotations

import kvarn_kernels as kk
import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from kernel_testing import examples, nan_like_staging, unwritten_cache
from kvarn_math import PRESETS, get_preset
from kvarn_math.testing import make_kv

MAX_DRAFTS = 8


@st.composite
def accept_reject_runs(draw: st.DrawFn, group_size: int, max_tiles: int) -> dict[str, object]:
    """Per request: the prompt length and the verify steps ``(num_drafts, num_accepted)``."""
    g = group_size
    reqs = []
    for _ in range(draw(st.integers(1, 2))):
        prompt = draw(st.integers(1, 2 * g))
        end = draw(st.integers(prompt + 1, max_tiles * g))
        end_on_tile = draw(st.booleans())
        if end_on_tile:
            end = -(-end // g) * g  # the last step completes a tile, then the request ends
        length, steps = prompt, []
        while length < end:
            drafts = draw(st.integers(1, MAX_DRAFTS))
            # Rejections dominate (they are what can go wrong); full acceptance happens too.
            accepted = draw(st.one_of(st.just(0), st.integers(0, drafts), st.just(drafts)))
            if end_on_tile and length + 1 + accepted > end:
                accepted = end - length - 1
            steps.append((drafts, accepted))
            length += 1 + accepted
        reqs.append({"prompt": prompt, "steps": steps, "length": length})
    return {"reqs": reqs, "seed": draw(st.integers(0, 2**16))}


def run_accept_reject(
    run: dict[str, object],
    preset: str,
    planner: str,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    window_keys: bool = True,
    key_frame: str = "rotated",
    staged_queries: bool = True,
) -> None:
    """Drive ``run`` through plan -> store_kv and compare with storing the accepted tokens once
    (``window_keys=False``: with the key ring of values-only windows apart).

    ``key_frame="auto"``: each position has a real query too (two query heads per KV head;
    rejected drafts carry garbage ones), and the tiles' key frames must come out as the one-shot
    store chose them from the tiles' last positions; ``staged_queries`` passes the store its
    frame queries (``frame_queries=``), which tiles completed by accepted drafts need."""
    p = get_preset(preset)
    g = p.group_size
    s_tiles = 2  # kvarn-vllm's S for up to G/2 drafts
    reqs = run["reqs"]
    n = len(reqs)
    seed = int(run["seed"])
    max_len = max(r["length"] for r in reqs) + MAX_DRAFTS + 1
    max_blocks = -(-max_len // g)
    h, d = num_kv_heads, head_dim
    # Real K/V of every position (accepted drafts carry exactly these).
    real = [
        (
            torch.from_numpy(make_kv((max_len, h, d), "outlier_channels", seed + 2 * i)).to(dtype),
            torch.from_numpy(make_kv((max_len, h, d), "gaussian", seed + 2 * i + 1)).to(dtype),
        )
        for i in range(n)
    ]
    auto = key_frame == "auto"
    hq = 2 * h
    queries = [
        torch.from_numpy(make_kv((max_len, hq, d), "outlier_channels", seed + 97 + i)).to(dtype)
        for i in range(n)
    ]
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n * max_blocks).astype(np.int32)
    table = perm.reshape(n, max_blocks)
    slots = np.array([2 * i + 1 for i in range(n)], dtype=np.int32)
    num_slots = 2 * n + 1
    shape = kk.cache_shape(n * max_blocks, h, d, p)
    cache = unwritten_cache(*shape, device)
    key_tiles = None if window_keys else s_tiles
    staging = nan_like_staging(
        kk.staging_shape(num_slots, h, d, p, staging_tiles=s_tiles, key_tiles=key_tiles),
        dtype,
        device,
    )
    frame_queries = None
    if auto and staged_queries:
        frame_queries = kk.allocate_frame_queries(
            num_slots, hq, d, p, dtype, device, staging_tiles=s_tiles, key_tiles=key_tiles
        ).fill_(float("nan"))
    dev_table = torch.from_numpy(table).to(device)
    length = [0] * n
    quant = [0] * n
    schedule = [[(r["prompt"], None)] + [(1 + dr, ac) for dr, ac in r["steps"]] for r in reqs]

    def step(rows: list[tuple[int, int, int | None]]) -> None:
        """rows: (request, num_new, num_accepted_drafts or None for a committed chunk)."""
        keys, vals, qs, cached, new, drafts = [], [], [], [], [], []
        for i, num, acc in rows:
            c = length[i]
            k, v = real[i][0][c : c + num], real[i][1][c : c + num]
            q = queries[i][c : c + num]
            if acc is not None:  # tokens past 1 + acc are rejected drafts: garbage
                bad = num - 1 - acc
                noise = torch.from_numpy(make_kv((bad, h, d), "gaussian", seed + c + 7) * 100)
                k = torch.cat([k[: 1 + acc], noise.to(dtype)])
                v = torch.cat([v[: 1 + acc], -noise.to(dtype)])
                q_noise = make_kv((bad, hq, d), "gaussian", seed + c + 11)
                q = torch.cat([q[: 1 + acc], torch.from_numpy(q_noise).to(dtype)])
            keys.append(k)
            vals.append(v)
            qs.append(q)
            cached.append(c)
            new.append(num)
            drafts.append(0 if acc is None else num - 1)
        batch_slots = slots[[i for i, _, _ in rows]]
        batch_table = table[[i for i, _, _ in rows]]
        seq = [c + m for c, m in zip(cached, new, strict=True)]
        q_before = [quant[i] for i, _, _ in rows]
        if planner == "host":
            plan = kk.plan_store(
                cached,
                new,
                [s - dr for s, dr in zip(seq, drafts, strict=True)],
                batch_slots,
                batch_table,
                p,
                staging_tiles=s_tiles,
                num_quantized=q_before,
                window_keys=window_keys,
            ).to(device)
        else:
            qsl = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)

            def t(x: object) -> torch.Tensor:
                return torch.tensor(np.asarray(x), dtype=torch.int32, device=device)

            plan = kk.plan_store_device(
                t(seq),
                t(qsl),
                t(drafts),
                t(q_before),
                t(batch_slots),
                dev_table[torch.tensor([i for i, _, _ in rows], device=device)],
                p,
                staging_tiles=s_tiles,
                max_tiles=len(rows) * (max_blocks + 1),
                max_writes=int(qsl[-1]) + 3,  # padding rows past the batch are skipped
                window_keys=window_keys,
            )
        key, val = torch.cat(keys).to(device), torch.cat(vals).to(device)
        query = torch.cat(qs).to(device) if auto else None
        kk.store_kv(
            key,
            val,
            cache,
            staging,
            plan,
            p,
            key_frame=key_frame,
            query=query,
            frame_queries=frame_queries,
        )
        got = plan.quantized_lens.cpu().tolist()
        for (i, num, acc), q in zip(rows, got, strict=True):
            quant[i] = q
            length[i] += num if acc is None else 1 + acc
            assert quant[i] % g == 0 and length[i] - quant[i] <= s_tiles * g

    for s in range(max(len(sch) for sch in schedule)):
        rows = [(i, *schedule[i][s]) for i in range(n) if s < len(schedule[i])]
        # Batch order varies from step to step, as vLLM's scheduler may reorder requests.
        rows = [rows[j] for j in rng.permutation(len(rows))]
        step(rows)

    # The staging holds exactly the accepted tokens of [quantized_len, length).
    ref_cache = unwritten_cache(*shape, device)
    ref_staging = nan_like_staging(kk.staging_shape(num_slots, h, d, p), dtype, device)
    for i, r in enumerate(reqs):
        assert length[i] == r["length"]
        once = kk.plan_store([0], [length[i]], None, [slots[i]], table[i : i + 1], p).to(device)
        kk.store_kv(
            real[i][0][: length[i]].to(device),
            real[i][1][: length[i]].to(device),
            ref_cache,
            ref_staging,
            once,
            p,
            key_frame=key_frame,
            query=queries[i][: length[i]].to(device) if auto else None,
        )
        want_q = length[i] // g * g
        # A tile completed by the last accepted tokens waits for the next step's commit.
        assert quant[i] in (want_q, want_q - g) if want_q else quant[i] == 0
        pos = torch.arange(quant[i], length[i])
        rows = (pos % (s_tiles * g)).to(device)
        if window_keys:
            got_staged = staging[slots[i], :, rows]
        else:  # the key ring (S tiles without recent ones), then the value rows
            got_staged = torch.stack(
                [staging[slots[i], rows], staging[slots[i], s_tiles * g + rows]]
            )
        ref_positions = torch.arange(want_q, length[i]) % g
        ref_staged = ref_staging[slots[i], :, ref_positions.to(device)]
        torch.testing.assert_close(got_staged[:, pos.numpy() >= want_q], ref_staged, rtol=0, atol=0)
        assert not got_staged.isnan().any()
    # A step with no new tokens commits what the requests have accepted (what the request's next
    # verify step would do), so every complete tile is a record.
    step([(i, 0, None) for i in range(n)])
    for i in range(n):
        assert quant[i] == length[i] // g * g
        for tile in range(quant[i] // g):
            blk = int(table[i, tile])
            assert torch.equal(cache[blk], ref_cache[blk]), f"request {i} tile {tile} differs"


PINNED = {
    # Drafts complete tile 0 and are rejected (roll back into it), twice; then the request
    # ends exactly on the tile boundary after a fully accepted step.
    "reqs": [{"prompt": 60, "steps": [(6, 0), (8, 1), (3, 0)], "length": 64}],
    "seed": 3,
}
SEED_ACCEPTED_LAST = 14  # one whose two queries pick different frames
# The same on 128-token tiles.
PINNED_128 = {
    "reqs": [{"prompt": 124, "steps": [(6, 0), (8, 1), (3, 0)], "length": 128}],
    "seed": 5,
}


# Accepted drafts complete tile 0 (position 63 is the fourth of six drafts); the next step
# commits it with every token staged, so its key frame is judged by the staged query.
ACCEPTED_LAST = {
    "reqs": [{"prompt": 60, "steps": [(6, 4), (2, 0)], "length": 66}],
    "seed": SEED_ACCEPTED_LAST,
}


@pytest.mark.interpreter
@pytest.mark.parametrize("planner", ["device", "host"])
@examples(12)
@given(
    run=accept_reject_runs(64, 3),
    preset=st.sampled_from(["kvarn_k4v2_g64", "kvarn_k4v4_g64"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    window_keys=st.booleans(),
    key_frame=st.sampled_from(["rotated", "auto"]),
)
@example(
    run=PINNED, preset="kvarn_k4v2_g64", dtype=torch.bfloat16, window_keys=True, key_frame="auto"
)
@example(
    run=PINNED,
    preset="kvarn_k4v2_g64",
    dtype=torch.bfloat16,
    window_keys=False,
    key_frame="rotated",
)
@example(
    run=ACCEPTED_LAST,
    preset="kvarn_k4v2_g64",
    dtype=torch.bfloat16,
    window_keys=True,
    key_frame="auto",
)
def test_accept_reject_records_equal_accepted_tokens_once(
    planner: str,
    run: dict[str, object],
    preset: str,
    dtype: torch.dtype,
    window_keys: bool,
    key_frame: str,
) -> None:
    run_accept_reject(run, preset, planner, 1, 64, dtype, "cpu", window_keys, key_frame)


@pytest.mark.interpreter
@pytest.mark.parametrize("window_keys", [True, False])
def test_tiles_completed_by_accepted_drafts_need_the_staged_query(window_keys: bool) -> None:
    """Without ``frame_queries`` the store judges a tile committed from staging by the step's
    first query, not its last position's; on this schedule that picks another key frame than
    writing the accepted tokens once does. With them the records match."""
    args = (ACCEPTED_LAST, "kvarn_k4v2_g64", "device", 1, 64, torch.bfloat16, "cpu")
    run_accept_reject(*args, window_keys, "auto")
    with pytest.raises(AssertionError, match="tile 0 differs"):
        run_accept_reject(*args, window_keys, "auto", staged_queries=False)


@pytest.mark.interpreter
@examples(4)
@given(
    run=accept_reject_runs(128, 3),
    preset=st.sampled_from(["kvarn_k2v2_g128", "kvarn_k3v2_g128"]),
    window_keys=st.booleans(),
)
@example(run=PINNED_128, preset="kvarn_k2v2_g128", window_keys=True)
@example(run=PINNED_128, preset="kvarn_k3v2_g128", window_keys=False)
def test_accept_reject_low_bit_keys(run: dict[str, object], preset: str, window_keys: bool) -> None:
    """The 2- and 3-bit-key presets (128-token tiles), which the test above does not draw."""
    run_accept_reject(run, preset, "device", 1, 64, torch.bfloat16, "cpu", window_keys)


@pytest.mark.gpu
@examples(25)
@given(
    run=accept_reject_runs(128, 6),
    preset=st.sampled_from(sorted(PRESETS)),
    window_keys=st.booleans(),
    key_frame=st.sampled_from(["rotated", "auto"]),
)
@example(run=ACCEPTED_LAST, preset="kvarn_k4v2_g64", window_keys=False, key_frame="auto")
def test_accept_reject_records_equal_accepted_tokens_once_gpu(
    run: dict[str, object], preset: str, window_keys: bool, key_frame: str
) -> None:
    run_accept_reject(run, preset, "device", 8, 128, torch.bfloat16, "cuda", window_keys, key_frame)
