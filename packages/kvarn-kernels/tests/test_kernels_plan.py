"""plan_store, checked by simulating its plans on token identities (no kernels, fast).

Each token is identified by ``(position, version)``: a speculative token that is rejected is
later rewritten at the same position with a new version.  Applying the plans in order (tiles
first, then staging writes, as store_kv launches them) must leave every quantized tile holding
exactly the final committed tokens of its positions, each tile quantized once, and the staging
holding ``[read_len, seq_len)``: the open tokens, and with recent tiles the complete tiles before
the step's first new token too (``kvarn_math.recent_window_start``), from the first position the
request wrote itself (a prefix-cache hit stays records only).
"""

from __future__ import annotations

import os
from dataclasses import fields, replace

import kvarn_kernels as kk
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_testing import examples, set_env
from kvarn_kernels import StorePlan, plan_store, plan_store_device
from kvarn_kernels import plan as plan_module
from kvarn_math.attention import key_window_start, recent_window_start

G = 64


class Sim:
    """The cache and staging of a batch of requests, holding token identities (keys and values
    apart: with values-only windows they have their own rings)."""

    def __init__(
        self,
        num_requests: int,
        staging_tiles: int,
        sink: bool = False,
        key_tiles: int | None = None,
    ) -> None:
        self.sg = staging_tiles * G
        self.base = G if sink else 0  # sink rows in front of the ring
        self.ksg = None if key_tiles is None else key_tiles * G  # the key ring (no sink rows)
        self.staging: dict[tuple[int, int], tuple[int, int]] = {}  # values
        self.key_staging: dict[tuple[int, int], tuple[int, int]] = {}
        self.blocks: dict[int, list[tuple[int, int]]] = {}  # values
        self.key_blocks: dict[int, list[tuple[int, int]]] = {}
        self.writes_per_block: dict[int, int] = {}

    def apply(self, plan, batch: list[tuple[int, int]]) -> None:  # type: ignore[no-untyped-def]
        tiles = plan.tiles.numpy()
        # Quantize launch: reads staging and batch as they are before this step's writes.
        for block, slot, start, staged, fresh in tiles:
            if block < 0:
                continue
            fresh_toks = [batch[fresh + i] for i in range(G - staged)]
            vals = [self.staging[(slot, self.row(start + i))] for i in range(staged)]
            keys = [self.key_staging[(slot, self.key_row(start + i))] for i in range(staged)]
            self.blocks[int(block)] = vals + fresh_toks
            self.key_blocks[int(block)] = keys + fresh_toks
            self.writes_per_block[int(block)] = self.writes_per_block.get(int(block), 0) + 1
        for token, slot, pos, kpos in plan.writes.numpy():
            if token < 0:
                continue
            if pos >= 0:
                self.staging[(int(slot), int(pos))] = batch[token]
            if kpos >= 0:
                self.key_staging[(int(slot), int(kpos))] = batch[token]

    def row(self, pos: int) -> int:
        return pos if pos < self.base else self.base + (pos - self.base) % self.sg

    def key_row(self, pos: int) -> int:
        return self.row(pos) if self.ksg is None else pos % self.ksg


@st.composite
def schedules(draw: st.DrawFn) -> dict[str, object]:
    """Per request: a list of steps (num_new, num_accepted_drafts) after the prompt."""
    n = draw(st.integers(1, 3))
    spec = draw(st.booleans())
    reqs = []
    for _ in range(n):
        steps = []
        for _ in range(draw(st.integers(1, 8))):
            if spec:
                drafts = draw(st.integers(0, 5))
                steps.append((1 + drafts, draw(st.integers(0, drafts))))
            else:
                steps.append((draw(st.sampled_from([1, 1, 2, G - 1, G, G + 1, 3 * G + 7])), 0))
        reqs.append(steps)
    return {
        "spec": spec,
        "reqs": reqs,
        "prompt": [draw(st.integers(0, 3 * G)) for _ in range(n)],
        "sink": draw(st.booleans()),
        "recent": draw(st.integers(0, 2)),
        "hits": [draw(st.sampled_from([0, 0, G, 2 * G])) for _ in range(n)],
        "window_keys": draw(st.booleans()),
    }


@examples(200)
@given(schedules())
def test_plans_fill_every_tile_with_its_committed_tokens(sched: dict[str, object]) -> None:
    reqs, spec = sched["reqs"], sched["spec"]
    n = len(reqs)
    recent = int(sched["recent"])
    s_tiles = (2 if spec else 1) + recent
    sink = bool(sched.get("sink", False))
    window_keys = bool(sched.get("window_keys", True))
    key_tiles = None if window_keys else s_tiles - recent
    sim = Sim(n, s_tiles, sink, key_tiles)
    table = np.arange(n * 64, dtype=np.int32).reshape(n, 64) * 7 % (n * 64)
    slots = list(range(n))[::-1]
    # A prefix-cache hit of `hits[i]` tokens: records another request wrote, nothing staged.
    hits = list(sched["hits"])
    cached = list(hits)
    quant = list(hits)
    version = [dict() for _ in range(n)]  # position -> version of the token now there
    committed_tok: list[dict[int, tuple[int, int]]] = [dict() for _ in range(n)]
    # Step 0: prompts (committed); then each request's steps, all requests batched together.
    plans_steps = [[(p, 0)] for p in sched["prompt"]]
    for i in range(n):
        plans_steps[i] += reqs[i]
    for step in range(max(len(s) for s in plans_steps)):
        new, committed_after, batch = [], [], []
        accepted = []
        for i in range(n):
            num, acc = plans_steps[i][step] if step < len(plans_steps[i]) else (0, 0)
            toks = []
            for j in range(num):
                pos = cached[i] + j
                assert pos >= hits[i]
                version[i][pos] = version[i].get(pos, -1) + 1
                toks.append((pos, version[i][pos]))
            batch += toks
            new.append(num)
            # Only the first token of a speculative step is known good (the sampled one).
            first_committed = 1 if (spec and step > 0 and num) else num
            committed_after.append(cached[i] + min(num, first_committed))
            accepted.append(acc if (spec and step > 0 and num) else 0)
            for t in toks[: min(num, first_committed) + accepted[-1]]:
                committed_tok[i][t[0]] = t
        plan = plan_store(
            cached,
            new,
            committed_after,
            slots,
            table,
            "kvarn_k4v2_g64",
            staging_tiles=s_tiles,
            num_quantized=quant,
            sink=sink,
            recent_tiles=recent,
            exact_start=hits,
            window_keys=window_keys,
        )
        assert plan.key_tiles == key_tiles
        assert_device_plan_equals(
            plan,
            cached,
            new,
            committed_after,
            slots,
            table,
            s_tiles,
            quant,
            sink,
            recent,
            hits,
            window_keys,
        )
        sim.apply(plan, batch)
        quant = plan.quantized_lens.tolist()
        read = plan.attention_lens.tolist()
        key_read = read if window_keys else plan.key_read_lens.tolist()
        for i in range(n):
            total = cached[i] + new[i]
            assert read[i] == recent_window_start(
                cached[i], total, quant[i], G, recent, s_tiles, hits[i]
            )
            if not window_keys:
                assert key_read[i] == key_window_start(
                    cached[i], total, quant[i], G, s_tiles - recent, hits[i]
                )
            # staging holds [read_len, seq_len): attention reads exact tokens from there
            for pos in range(read[i], cached[i] + new[i]):
                assert sim.staging[(slots[i], sim.row(pos))] == (pos, version[i][pos])
            # and the keys from key_read_len on (the same positions with window keys)
            for pos in range(key_read[i], cached[i] + new[i]):
                assert sim.key_staging[(slots[i], sim.key_row(pos))] == (pos, version[i][pos])
            # accepted drafts become committed; rejected ones are dropped from the length
            keep = min(new[i], 1 if (spec and step > 0 and new[i]) else new[i]) + accepted[i]
            cached[i] += keep
    for i in range(n):
        for t in range(hits[i] // G, quant[i] // G):
            block = int(table[i, t])
            assert sim.writes_per_block[block] == 1
            want = [committed_tok[i][p] for p in range(t * G, (t + 1) * G)]
            assert sim.blocks[block] == want
            assert sim.key_blocks[block] == want
        assert quant[i] == (max(committed_tok[i], default=-1) + 1) // G * G or spec
        if sink:  # the sink rows hold the request's committed first tile, for good
            for pos in range(hits[i], min(G, cached[i])):
                assert sim.staging[(slots[i], pos)] == committed_tok[i][pos]


def assert_plans_identical(a, b) -> None:  # type: ignore[no-untyped-def]
    """Two StorePlans with the same fields and the same tensors, element for element."""
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype, f.name
            assert torch.equal(x.cpu(), y.cpu()), (f.name, x, y)
        else:
            assert x == y, (f.name, x, y)


def assert_device_plan_equals(  # type: ignore[no-untyped-def]
    plan,
    cached,
    new,
    committed,
    slots,
    table,
    s_tiles,
    quant,
    sink=False,
    recent=0,
    hits=None,
    window_keys=True,
) -> None:
    """plan_store_device, given the committed count as ``num_drafts``, makes the same plan."""
    n = len(cached)
    seq = np.add(cached, new)
    qsl = np.concatenate([[0], np.cumsum(new)])

    def t(x: object) -> torch.Tensor:
        return torch.tensor(np.asarray(x), dtype=torch.int32)

    args = (t(seq), t(qsl), t(seq - np.asarray(committed)), t(quant), t(slots))
    kwargs = {
        "staging_tiles": s_tiles,
        "max_tiles": plan.num_tiles + 2,
        "max_writes": int(qsl[-1]) + 2,
        "sink": sink,
        "recent_tiles": recent,
        "exact_start": None if hits is None else t(hits),
        "window_keys": window_keys,
    }
    dev = plan_store_device(*args, torch.from_numpy(table[:n]), "kvarn_k4v2_g64", **kwargs)
    # Under the interpreter (CI) that was the Triton planner: bit for bit its torch twin.
    torch_plan = plan_module._plan_store_device_torch(
        *args, torch.from_numpy(table[:n]), G, **kwargs
    )
    assert_plans_identical(dev, torch_plan)
    tiles, writes = dev.tiles.numpy(), dev.writes.numpy()
    np.testing.assert_array_equal(tiles[: plan.num_tiles], plan.tiles.numpy())
    assert (tiles[plan.num_tiles :] == -1).all()
    np.testing.assert_array_equal(writes[writes[:, 0] >= 0], plan.writes.numpy())
    assert (writes[writes[:, 0] < 0] == -1).all()
    np.testing.assert_array_equal(dev.quantized_lens.numpy(), plan.quantized_lens.numpy())
    np.testing.assert_array_equal(dev.seq_lens.numpy(), plan.seq_lens.numpy())
    np.testing.assert_array_equal(dev.attention_lens.numpy(), plan.attention_lens.numpy())
    if window_keys:
        assert dev.key_read_lens is None and plan.key_read_lens is None
    else:
        np.testing.assert_array_equal(dev.key_read_lens.numpy(), plan.key_read_lens.numpy())


def planner_case(rows: int, sink: bool, recent: int, window_keys: bool, device: str) -> None:
    """The Triton planner (two launches) against the torch operations, on ``device``: a batch
    of random speculative rows with padding rows between them (``rows`` of them: more than one
    program's block, or none at all), a block table with a row stride wider than its columns,
    spare tile and write rows."""
    rng = np.random.default_rng(rows)
    s_tiles = 2 + recent
    new = rng.integers(1, 6, rows) * (rng.random(rows) < 0.8)  # 0: a padding row
    drafts = np.minimum(rng.integers(0, 5, rows), np.maximum(new - 1, 0))
    q_before = rng.integers(0, 40, rows) * G
    seq = np.where(new > 0, q_before + rng.integers(0, G, rows) + new, 0)
    q_before = np.where(new > 0, q_before, 0)
    if rows:  # row 0 completes a tile
        new[0] = max(new[0], 1)
        drafts[0] = min(drafts[0], new[0] - 1)
        seq[0] = q_before[0] + G + new[0]
    qsl = np.concatenate([[0], np.cumsum(new)])
    wide = torch.from_numpy(rng.integers(0, 10_000, (rows, 80)).astype(np.int32)).to(device)
    table = wide[:, :50]
    assert table.stride(0) == 80 or not rows

    def t(x: object) -> torch.Tensor:
        return torch.tensor(np.asarray(x), dtype=torch.int32, device=device)

    exact = t(np.where(rng.random(rows) < 0.5, q_before, 0))
    args = (t(seq), t(qsl), t(drafts), t(q_before), t(rng.permutation(rows)), table)
    kwargs = {
        "staging_tiles": s_tiles,
        "max_tiles": rows + 3,
        "max_writes": int(qsl[-1]) + 5,
        "sink": sink,
        "recent_tiles": recent,
        "exact_start": exact,
        "window_keys": window_keys,
    }
    got = plan_module._plan_store_device_triton(*args, G, **kwargs)
    want = plan_module._plan_store_device_torch(*args, G, **kwargs)
    assert_plans_identical(got, want)
    # Into views of one buffer (a CUDA graph's metadata), by either planner: the same plan,
    # read_lens written even without recent tiles (the attention lengths).
    previous = os.environ.get("KVARN_KERNELS_TORCH_PLANNER")
    for torch_planner in ("0", "1"):
        out = _out_views(rows, kwargs["max_tiles"], kwargs["max_writes"], window_keys, device)
        os.environ["KVARN_KERNELS_TORCH_PLANNER"] = torch_planner
        try:
            placed = plan_store_device(*args, "kvarn_k4v2_g64", **kwargs, out=out)
        finally:
            if previous is None:
                del os.environ["KVARN_KERNELS_TORCH_PLANNER"]
            else:
                os.environ["KVARN_KERNELS_TORCH_PLANNER"] = previous
        assert placed.tiles is out.tiles and placed.seq_lens is out.seq_lens
        assert_plans_identical(placed, want)
        assert torch.equal(out.read_lens.cpu(), want.attention_lens.cpu())
    if rows:  # the case quantizes some tiles
        assert int((got.tiles[:, 0] >= 0).sum()) > 0


def _out_views(
    rows: int, max_tiles: int, max_writes: int, window_keys: bool, device: str
) -> StorePlan:
    """A plan's tensors as views of one int32 buffer filled with 77."""
    sizes = [max_tiles * 5, max_writes * 4, rows, rows, rows, rows]
    buf = torch.full((sum(sizes) + 4,), 77, dtype=torch.int32, device=device)
    cut = np.concatenate([[0], np.cumsum(sizes)])
    part = [buf[cut[i] : cut[i + 1]] for i in range(len(sizes))]
    return StorePlan(
        tiles=part[0].view(max_tiles, 5),
        writes=part[1].view(max_writes, 4),
        seq_lens=part[2],
        quantized_lens=part[3],
        read_lens=part[4],
        key_read_lens=None if window_keys else part[5],
        num_tiles=max_tiles,
        num_writes=max_writes,
        group_size=G,
        staging_tiles=2,
    )


PLANNER_CASES = [
    (rows, *flags)
    for rows in (0, 1, 5, 300)
    for flags in ((False, 0, True), (True, 1, False), (True, 0, False))
]


@pytest.mark.parametrize(("rows", "sink", "recent", "window_keys"), PLANNER_CASES)
def test_triton_planner_matches_its_torch_twin(
    rows: int, sink: bool, recent: int, window_keys: bool
) -> None:
    from kvarn_kernels import _triton

    if not _triton.INTERPRET:
        pytest.skip("the Triton planner runs on CPU tensors only under TRITON_INTERPRET=1")
    planner_case(rows, sink, recent, window_keys, "cpu")


def test_planner_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """``plan_store_device`` takes the Triton planner on CUDA and under the interpreter, the
    torch operations on CPU tensors otherwise or with ``KVARN_KERNELS_TORCH_PLANNER=1``."""
    cpu = torch.zeros(1)
    monkeypatch.setattr(plan_module, "INTERPRET", True)
    assert plan_module._triton_planner(cpu)
    set_env(monkeypatch, "KVARN_KERNELS_TORCH_PLANNER", "1")
    assert not plan_module._triton_planner(cpu)
    set_env(monkeypatch, "KVARN_KERNELS_TORCH_PLANNER", "0")
    monkeypatch.setattr(plan_module, "INTERPRET", False)
    assert not plan_module._triton_planner(cpu)


def test_device_plan_padding_rows_and_shapes() -> None:
    """Rows without tokens (CUDA-graph padding) plan nothing; shapes are the fixed maxima."""
    t = torch.tensor
    dev = plan_store_device(
        t([70, 0], dtype=torch.int32),
        t([0, 7, 7], dtype=torch.int32),
        t([5, 0], dtype=torch.int32),
        t([0, 0], dtype=torch.int32),
        t([3, 1], dtype=torch.int32),
        t([[4, 9], [0, 0]], dtype=torch.int32),
        "kvarn_k4v2_g64",
        staging_tiles=2,
        max_tiles=3,
        max_writes=9,
    )
    assert dev.tiles.shape == (3, 5) and dev.writes.shape == (9, 4)
    # committed = 70 - 5 = 65: tile 0 (block 4), 63 staged tokens + batch row 0 (position 63)
    assert dev.tiles[0].tolist() == [4, 3, 0, 63, 0]
    assert (dev.tiles[1:] == -1).all()
    # tokens 1..6 (positions 64..69) go to staging, token 0 is in the tile; rows 7, 8 padding
    assert dev.writes[:, 0].tolist() == [-1, 1, 2, 3, 4, 5, 6, -1, -1]
    assert dev.writes[1].tolist() == [1, 3, 64, 64]
    assert dev.quantized_lens.tolist() == [64, 0]


def test_chunked_prefill_plan_takes_full_tiles_from_the_batch() -> None:
    plan = plan_store([10], [3 * G], None, [2], [[4, 5, 6, 7]], "kvarn_k4v2_g64")
    tiles = plan.tiles.numpy()
    assert tiles.tolist() == [[4, 2, 0, 10, 0], [5, 2, G, 0, G - 10], [6, 2, 2 * G, 0, 2 * G - 10]]
    assert plan.quantized_lens.tolist() == [3 * G]
    assert plan.writes.numpy()[:, 2].tolist() == list(range(10))  # positions 3G..3G+9
    assert plan.num_tiles == 3 and plan.num_writes == 10


def test_padding_for_cuda_graphs() -> None:
    plan = plan_store(
        [G - 1], [1], None, [0], [[3, 9]], "kvarn_k4v2_g64", max_tiles=4, max_writes=8
    )
    assert plan.tiles.shape == (4, 5) and plan.writes.shape == (8, 4)
    assert plan.tiles[1:, 0].eq(-1).all() and plan.writes[:, 0].eq(-1).all()
    with pytest.raises(ValueError, match="max_tiles=0 is smaller"):
        plan_store([G - 1], [1], None, [0], [[3, 9]], "kvarn_k4v2_g64", max_tiles=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_committed": [5]}, "num_committed\\[0\\] must lie in"),
        ({"num_quantized": [3]}, "num_quantized\\[0\\] must be a multiple"),
        ({"block_table": [[-1, -1]]}, "a tile needs a block"),
        ({"block_table": [[]]}, "needs 1 blocks but block_table has 0"),
        ({"num_new": [G + 80], "num_committed": [10]}, "raise staging_tiles"),
        ({"num_cached": [-1]}, "num_cached must be >= 0"),
        ({"staging_tiles": 0}, "staging_tiles must be a positive int"),
        ({"recent_tiles": 1}, "recent_tiles must be an int in \\[0, staging_tiles=1\\)"),
        ({"exact_start": [5]}, "exact_start\\[0\\] must be a multiple of G=64"),
        (
            {"staging_tiles": 2, "recent_tiles": 1, "num_new": [G + 80], "num_committed": [10]},
            "\\(2 - 1\\)\\*64",
        ),
        ({"preset": "nope"}, "unknown KVarN preset"),
    ],
)
def test_bad_plans_raise(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {
        "num_cached": [10],
        "num_new": [G],
        "num_committed": None,
        "staging_slots": [0],
        "block_table": [[1, 2]],
        "preset": "kvarn_k4v2_g64",
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        plan_store(**args)  # type: ignore[arg-type]


def draft_planner_case(
    rows: int, n: int, sink: bool, recent: int, window_keys: bool, device: str
) -> None:
    """``plan_draft_device``'s Triton kernel against its torch operations on ``device``: rows
    with random lengths (some shorter than ``n``, so positions below 0 write nothing), padding
    rows after ``live`` and padding tokens after them, outputs written into views of one
    buffer (as a CUDA graph's metadata is)."""
    rng = np.random.default_rng(100 + rows + n)
    s_tiles = 2 + recent
    slots_total = rows + 7
    live = max(rows - 2, 0)
    seq = np.where(np.arange(rows) < live, rng.integers(0, 40 * G, rows), 0)
    seq[: min(rows, 2)] = [1, n + 3][: min(rows, 2)]
    slots = rng.permutation(slots_total)[:rows]
    slot_quant = rng.integers(0, 40, slots_total) * G
    slot_start = rng.integers(0, 3, slots_total) * G
    num_tokens = rows * n + 3

    def t(x: object) -> torch.Tensor:
        return torch.tensor(np.asarray(x), dtype=torch.int32, device=device)

    def outs() -> kk.StorePlan:
        buf = torch.full((rows * 9 + num_tokens * 4 + 8,), 77, dtype=torch.int32, device=device)
        cut = np.cumsum([rows * 5, num_tokens * 4, rows, rows, rows, rows])
        return kk.StorePlan(
            tiles=buf[: cut[0]].view(rows, 5),
            writes=buf[cut[0] : cut[1]].view(num_tokens, 4),
            seq_lens=buf[cut[1] : cut[2]],
            quantized_lens=buf[cut[2] : cut[3]],
            read_lens=buf[cut[3] : cut[4]],
            key_read_lens=None if window_keys else buf[cut[4] : cut[5]],
            num_tiles=rows,
            num_writes=num_tokens,
            group_size=G,
            staging_tiles=s_tiles,
            sink=sink,
            recent_tiles=recent,
            window_keys=window_keys,
        )

    args = (t(seq), t(slots), t(slot_quant), t(slot_start), "kvarn_k4v2_g64")
    kwargs = {
        "tokens_per_row": n,
        "num_tokens": num_tokens,
        "live_rows": live,
        "staging_tiles": s_tiles,
        "sink": sink,
        "recent_tiles": recent,
        "window_keys": window_keys,
    }
    got = kk.plan_draft_device(*args, **kwargs, out=outs())
    want = outs()
    key_tiles = 0 if window_keys else s_tiles - recent
    plan_module._plan_draft_torch(
        *args[:4],
        want,
        g=G,
        n=n,
        num_tokens=num_tokens,
        live_rows=live,
        staging_tiles=s_tiles,
        sink=sink,
        recent_tiles=recent,
        key_tiles=key_tiles,
    )
    assert_plans_identical(got, want)
    if live:  # the case writes drafts and skips positions below 0
        w = got.writes.cpu().numpy()
        assert (w[:, 0] >= 0).any() and (w[:, 0] < 0).any()
    assert (got.tiles.cpu() == -1).all()


DRAFT_PLANNER_CASES = [
    (rows, n, *flags)
    for rows, n in ((1, 1), (5, 1), (5, 5), (300, 1), (40, 3))
    for flags in ((False, 0, True), (True, 1, False))
]


@pytest.mark.parametrize(("rows", "n", "sink", "recent", "window_keys"), DRAFT_PLANNER_CASES)
def test_draft_planner_matches_its_torch_twin(
    rows: int, n: int, sink: bool, recent: int, window_keys: bool
) -> None:
    from kvarn_kernels import _triton

    if not _triton.INTERPRET:
        pytest.skip("the Triton planner runs on CPU tensors only under TRITON_INTERPRET=1")
    draft_planner_case(rows, n, sink, recent, window_keys, "cpu")


def test_draft_planner_refuses_bad_outputs() -> None:
    t = torch.zeros(3, dtype=torch.int32)
    args = (t, t, torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32))
    kwargs = {"num_tokens": 3, "live_rows": 3, "staging_tiles": 2}
    with pytest.raises(ValueError, match="tokens_per_row"):
        kk.plan_draft_device(*args, "kvarn_k4v2_g64", tokens_per_row=0, **kwargs)
    plan = kk.plan_draft_device(*args, "kvarn_k4v2_g64", tokens_per_row=1, **kwargs)
    with pytest.raises(ValueError, match=r"out.key_read_lens must be int32 \[3\], got None"):
        kk.plan_draft_device(
            *args, "kvarn_k4v2_g64", tokens_per_row=1, window_keys=False, out=plan, **kwargs
        )
    with pytest.raises(ValueError, match="out.seq_lens must be a contiguous int32 tensor"):
        kk.plan_draft_device(
            *args,
            "kvarn_k4v2_g64",
            tokens_per_row=1,
            out=replace(plan, seq_lens=torch.zeros(6, dtype=torch.int32)[::2]),
            **kwargs,
        )
    with pytest.raises(ValueError, match=r"out.tiles must be int32 \[3, 5\], got \[2, 5\]"):
        kk.plan_draft_device(
            *args,
            "kvarn_k4v2_g64",
            tokens_per_row=1,
            out=replace(plan, tiles=torch.zeros(2, 5, dtype=torch.int32)),
            **kwargs,
        )
