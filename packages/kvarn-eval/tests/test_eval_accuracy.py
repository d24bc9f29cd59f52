"""Perplexity and task scoring on the tiny model: metrics, noise estimates, bookkeeping."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from eval_helpers import HEAD_DIM, task_part, tiny_llama, word_text, word_tokenizer
from kvarn_eval.accuracy import (
    Unquantized,
    build_prompt,
    evaluate_perplexity,
    evaluate_task,
    install,
    mean_and_se,
    prepare_items,
    quantized_fraction,
    select_methods,
    supported_for,
)
from kvarn_eval.accuracy.perplexity import compare_logits
from kvarn_eval.accuracy.pool import pool_item_ranges, pool_task_results, stored_golds
from kvarn_eval.accuracy.summary import paired_change, weighted_mean_and_se
from kvarn_eval.data import TaskItem
from kvarn_math.baselines import KIVI, Exact, KVarN
from kvarn_math.metrics import kl_divergence

BLOCK = 64
KIVI2 = KIVI(name="kivi_k2v2", group_size=BLOCK, key_bits=2, value_bits=2)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return install(tiny_llama(seed=4))


def test_compare_logits_matches_numpy_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(7, 11, generator=gen)
    other = ref + 0.3 * torch.randn(7, 11, generator=gen)
    targets = torch.randint(0, 11, (7,), generator=gen)
    same, dist = compare_logits(ref, None, targets, rows_per_step=3)
    assert dist is not None
    torch.testing.assert_close(dist.probs, torch.softmax(ref.double(), -1))
    assert same.kl == 0.0 and same.top1 == 1.0
    lp_ref = torch.log_softmax(ref.double(), -1)
    assert same.nll == pytest.approx(float(-lp_ref[torch.arange(7), targets].mean()), rel=1e-12)
    # the reference against itself through the other path: KL 0 up to rounding
    self_scores, _ = compare_logits(ref, dist, targets, rows_per_step=4)
    assert self_scores.kl == pytest.approx(0.0, abs=1e-12) and self_scores.top1 == 1.0
    scores, none = compare_logits(other, dist, targets, rows_per_step=3)
    assert none is None
    assert scores.kl == pytest.approx(kl_divergence(ref.numpy(), other.numpy()), rel=1e-6)
    lp = torch.log_softmax(other.double(), -1)
    assert scores.nll == pytest.approx(float(-lp[torch.arange(7), targets].mean()), rel=1e-9)
    agree = (ref.argmax(-1) == other.argmax(-1)).double().mean()
    assert scores.top1 == pytest.approx(float(agree))
    assert scores.tokens == 7


def test_mean_and_se() -> None:
    mean, se = mean_and_se([1.0, 2.0, 3.0, 6.0])
    assert mean == 3.0
    assert se == pytest.approx(np.std([1, 2, 3, 6], ddof=1) / 2)
    assert math.isnan(mean_and_se([1.0])[1])


def test_weighted_mean_and_se() -> None:
    values = [1.0, 4.0, 2.0, 7.0]
    assert weighted_mean_and_se(values, [3.0] * 4) == pytest.approx(mean_and_se(values))
    mean, se = weighted_mean_and_se([1.0, 3.0], [1.0, 3.0])
    assert mean == pytest.approx(2.5)
    # sqrt(n / (n - 1) * (1 * 1.5^2 + 9 * 0.5^2)) / 4
    assert se == pytest.approx(math.sqrt(2 * (2.25 + 2.25)) / 4)
    assert math.isnan(weighted_mean_and_se([2.0], [5.0])[1])
    with pytest.raises(ValueError, match="one weight per value"):
        weighted_mean_and_se([1.0, 2.0], [1.0])


def test_paired_change() -> None:
    """Per-chunk NLL differences 0.1, 0.2, 0.3: exp(0.2) - 1 in percent, its se propagated."""
    pct, se = paired_change([1.1, 2.2, 3.3], [1.0, 2.0, 3.0])
    assert pct == pytest.approx(100 * (math.exp(0.2) - 1))
    assert se == pytest.approx(100 * math.exp(0.2) * 0.1 / math.sqrt(3))
    with pytest.raises(ValueError):
        paired_change([1.0, 2.0], [1.0])


def test_perplexity_reference_and_quantized_rows(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(1)
    chunks = torch.randint(4, 94, (3, 3 * BLOCK), generator=gen).tolist()
    methods = [Unquantized(), Exact(), KIVI2]
    steps: list[str] = []
    result = evaluate_perplexity(
        model, chunks, methods, head_dim=HEAD_DIM, block_size=BLOCK, advance=steps.append
    )
    assert steps[:3] == ["bf16", "fp32", "kivi_k2v2"] and len(steps) == 9
    ref = result.row("bf16")
    assert ref.delta_pct == 0.0 and ref.kl == pytest.approx(0.0, abs=1e-7) and ref.top1 == 1.0
    kivi = result.row("kivi_k2v2")
    assert kivi.kl > result.row("fp32").kl > 0
    assert kivi.top1 < 1.0
    assert not math.isnan(kivi.delta_se_pct) and kivi.delta_se_pct > 0
    # perplexity is exp of the token-weighted mean NLL of the chunks
    assert kivi.perplexity == pytest.approx(math.exp(np.mean(kivi.chunk_nll)))
    assert kivi.bits_per_element == pytest.approx(KIVI2.bits_per_element(HEAD_DIM))
    assert [r.method for r in result.rows] == ["fp32", "bf16", "kivi_k2v2"]


def test_perplexity_sink_tokens(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(2)
    chunks = torch.randint(4, 94, (2, 3 * BLOCK), generator=gen).tolist()
    methods = [Exact(), KIVI2]

    def run(**kwargs: object):  # type: ignore[no-untyped-def]
        return evaluate_perplexity(
            model, chunks, methods, head_dim=HEAD_DIM, block_size=BLOCK, **kwargs
        )

    default, no_sink = run(), run(exact_first_block=False)
    assert default.sink_tokens == BLOCK and no_sink.sink_tokens == 0
    full, zero = run(sink_tokens=BLOCK), run(sink_tokens=0, sink_requantize=True)
    assert full.row("kivi_k2v2").chunk_nll == default.row("kivi_k2v2").chunk_nll
    assert zero.row("kivi_k2v2").chunk_nll == no_sink.row("kivi_k2v2").chunk_nll
    partial = run(sink_tokens=4, sink_requantize=True)
    assert partial.sink_tokens == 4 and partial.to_dict()["sink_requantize"] is True
    assert partial.row("kivi_k2v2").chunk_nll != default.row("kivi_k2v2").chunk_nll


def test_perplexity_rejects_bad_input(model: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="reference 'bf16'"):
        evaluate_perplexity(model, [[5] * 200], [KIVI2], head_dim=HEAD_DIM, block_size=BLOCK)
    with pytest.raises(ValueError, match="share one length"):
        evaluate_perplexity(
            model, [[5] * 200, [5] * 199], [Exact()], head_dim=HEAD_DIM, block_size=BLOCK
        )
    with pytest.raises(ValueError, match="chunk 1: scored_from 199 leaves no scored token"):
        evaluate_perplexity(
            model, [[5] * 200, [5] * 199], [Exact()], head_dim=HEAD_DIM, scored_from=[10, 199]
        )
    with pytest.raises(ValueError, match="one scored_from per chunk: 1 for 2"):
        evaluate_perplexity(model, [[5] * 9] * 2, [Exact()], head_dim=HEAD_DIM, scored_from=[3])


def test_perplexity_of_chunk_tails(model: torch.nn.Module) -> None:
    """``scored_from``: only each chunk's tail is scored (GSM8K's solutions after their prompt),
    exactly the NLL of those positions in a pass over the whole chunk; chunks weigh by tokens."""
    from kvarn_eval.accuracy.pseudo_decode import PseudoDecodeConfig, pseudo_decode

    gen = torch.Generator().manual_seed(3)
    chunks = [torch.randint(4, 94, (n,), generator=gen).tolist() for n in (300, 250, 280)]
    firsts = [200, 180, 279]
    result = evaluate_perplexity(
        model, chunks, [Exact(), KIVI2], head_dim=HEAD_DIM, block_size=BLOCK,
        recent_blocks=1, scored_from=firsts,
    )  # fmt: skip
    kivi = result.row("kivi_k2v2")
    config = PseudoDecodeConfig(KIVI2, BLOCK, True, None, False, 1)
    for chunk, first, nll in zip(chunks, firsts, kivi.chunk_nll, strict=True):
        ids = torch.tensor([chunk])
        with torch.inference_mode(), pseudo_decode(config):
            logits = model(input_ids=ids, use_cache=False).logits[0, first - 1 : -1].double()
        want = torch.nn.functional.cross_entropy(logits, ids[0, first:]).item()
        assert nll == pytest.approx(want, rel=1e-5)
    tokens = [n - f for n, f in zip((300, 250, 280), firsts)]
    assert kivi.perplexity == pytest.approx(math.exp(np.average(kivi.chunk_nll, weights=tokens)))
    assert result.mean_scored_tokens == pytest.approx(sum(tokens) / 3)
    assert result.mean_context_tokens == pytest.approx(sum(firsts) / 3)
    assert 0 < result.mean_quantized_fraction < 1 and result.chunk_len == 300
    assert kivi.kl > 0 and result.row("bf16").delta_pct == 0.0
    from kvarn_eval.report import markdown_table

    assert "text: 3 items, 57 tokens scored after 220 of context, " in markdown_table(
        result.to_dict()
    )


def _items(n: int) -> list[TaskItem]:
    return [
        TaskItem(
            query=word_text(12, seed=i),
            choices=(" w1 w2", " w3", " w5 w6 w7"),
            gold=i % 3,
            doc_id=i,
        )
        for i in range(n)
    ]


def test_build_prompt_fills_with_other_items() -> None:
    items = _items(10)
    prompt, shots = build_prompt(items, 9, 40, lambda s: len(s.split()))
    assert prompt.endswith(items[9].query)
    assert shots == 3  # 12 words each: 12 + 3 * 14 >= 40
    assert prompt.startswith(items[0].query + items[0].choices[items[0].gold])
    assert items[9].choices[items[9].gold] not in prompt.split("\n\n")[-1]
    short, none = build_prompt(items, 0, 5, lambda s: len(s.split()))
    assert none == 0 and short == items[0].query


def test_quantized_fraction() -> None:
    assert quantized_fraction(10, 64, True) == 0.0
    assert quantized_fraction(100, 64, True) == 0.0  # block 1 reads only the exact sink
    assert quantized_fraction(150, 64, True) == pytest.approx(64 / 151)
    assert quantized_fraction(200, 64, False) == pytest.approx(192 / 201)
    # one recent block exact too: the query at 200 (block 3) reads blocks 2 and 3 exact
    assert quantized_fraction(200, 64, True, recent_blocks=1) == pytest.approx(64 / 201)
    assert quantized_fraction(150, 64, True, recent_blocks=1) == 0.0
    assert quantized_fraction(100, 64, True, sink_tokens=4) == pytest.approx(60 / 101)
    assert quantized_fraction(200, 64, False, sink_tokens=64) == pytest.approx(128 / 201)


def test_items_from_an_index_are_prompted_as_in_one_longer_run() -> None:
    """``start`` extends a run: items 7..11 get the prompts a 12-item run gives them."""
    items, tok = _items(20), word_tokenizer()
    whole = prepare_items(items, 12, tok, min_context_tokens=150)
    assert prepare_items(items, 5, tok, min_context_tokens=150, start=7) == whole[7:]
    assert (
        prepare_items(items, 50, tok, min_context_tokens=150, start=18)
        == (prepare_items(items, 20, tok, min_context_tokens=150)[18:])
    )
    assert prepare_items(items, 5, tok, min_context_tokens=150, start=20) == []
    with pytest.raises(ValueError, match="start must be >= 0, got -1"):
        prepare_items(items, 5, tok, min_context_tokens=150, start=-1)


def test_task_scoring(model: torch.nn.Module) -> None:
    items = prepare_items(_items(20), 4, word_tokenizer(), min_context_tokens=150)
    assert len(items) == 4 and all(len(it.context) >= 150 for it in items)
    methods = [Exact(), KIVI2]
    result = evaluate_task(
        model,
        "toy",
        "multiple_choice",
        items,
        methods,
        head_dim=HEAD_DIM,
        pad_id=0,
        block_size=BLOCK,
    )
    ref = result.row("bf16")
    assert ref.agreement == 1.0
    assert all(0 <= p < 3 for p in ref.predictions)
    assert ref.accuracy == pytest.approx(
        np.mean([p == it.gold for p, it in zip(ref.predictions, items)])
    )
    assert result.mean_quantized_fraction > 0
    assert ref.change == 0.0 and ref.change_se == 0.0
    # the paired change: per item (KIVI-2 right) - (bf16 right), its mean and standard error
    kivi = result.row("kivi_k2v2")
    diff = [
        int(p == it.gold) - int(q == it.gold)
        for p, q, it in zip(kivi.predictions, ref.predictions, items)
    ]
    assert (
        kivi.change == pytest.approx(kivi.accuracy - ref.accuracy) == pytest.approx(np.mean(diff))
    )
    assert kivi.change_se == pytest.approx(np.std(diff, ddof=1) / np.sqrt(len(diff)))
    lambada = evaluate_task(
        model,
        "toy_lw",
        "last_word",
        items,
        methods,
        head_dim=HEAD_DIM,
        pad_id=0,
        block_size=BLOCK,
    )
    assert set(lambada.row("kivi_k2v2").predictions) <= {0, 1}


def test_padding_does_not_change_scores(model: torch.nn.Module) -> None:
    """A choice scored alone equals the same choice scored in a right-padded batch."""
    from kvarn_eval.accuracy.pseudo_decode import PseudoDecodeConfig, pseudo_decode
    from kvarn_eval.accuracy.tasks import PreparedItem, _score_batch

    ctx = tuple(range(4, 4 + 80)) * 2
    both = PreparedItem(ctx, ((5,), (6, 7, 8, 9, 10)), (2, 10), 0, 0)
    alone = PreparedItem(ctx, ((5,),), (2,), 0, 0)
    with torch.inference_mode(), pseudo_decode(PseudoDecodeConfig(KIVI2, BLOCK)):
        sums_both, _ = _score_batch(model, both, pad_id=0)
        sums_alone, _ = _score_batch(model, alone, pad_id=0)
    assert sums_both[0] == pytest.approx(sums_alone[0], abs=1e-4)


@pytest.mark.parametrize(
    ("method", "window", "context", "recent", "sink"),
    [
        # continuations end inside the context's last block, and cross into the next one
        (KIVI2, None, 150, 0, None),
        (KIVI2, None, 187, 1, None),
        # key frames chosen from each tile's last query (kept from the context's pass)
        (KVarN.of("kvarn_k4v2_g64", key_frame="auto"), None, 187, 0, None),
        (KVarN.of("kvarn_k4v4_g64", key_frame="auto"), None, 250, 1, 4),
        (None, None, 187, 0, None),  # no quantization
        # a sliding window shorter than the context: the cache must keep every position
        (KIVI2, 96, 187, 0, None),
        (KVarN.of("kvarn_k4v2_g64", key_frame="auto"), 96, 250, 1, None),
    ],
)
def test_shared_context_scores_equal_the_batch(
    method: object, window: int | None, context: int, recent: int, sink: int | None
) -> None:
    """Choices after one context score the same from its cache as in one padded batch."""
    from kvarn_eval.accuracy.pseudo_decode import PseudoDecodeConfig, pseudo_decode
    from kvarn_eval.accuracy.tasks import PreparedItem, _score_batch, _score_item, _score_shared

    lm = install(tiny_llama(seed=5, sliding_window=window))
    gen = torch.Generator().manual_seed(context)
    ctx = tuple(torch.randint(4, 94, (context,), generator=gen).tolist())
    conts = ((7,), (9, 10, 11, 12, 13), tuple(range(20, 20 + 11)), (30, 31))
    item = PreparedItem(ctx, conts, (1, 5, 11, 2), 0, 0)
    config = PseudoDecodeConfig(method, BLOCK, sink_tokens=sink, recent_blocks=recent)  # type: ignore[arg-type]
    with torch.inference_mode(), pseudo_decode(config):
        batch_sums, batch_greedy = _score_batch(lm, item, pad_id=0)
        shared_sums, shared_greedy = _score_shared(lm, item, pad_id=0)
        assert _score_item(lm, item, pad_id=0) == (shared_sums, shared_greedy)
    assert shared_sums == pytest.approx(batch_sums, abs=1e-3)
    assert shared_greedy == batch_greedy
    # the continuations' scores differ, so a mix-up of rows would show
    assert len({round(x, 2) for x in batch_sums}) == len(conts)


def test_method_selection() -> None:
    names = [m.name for m in select_methods("all")]
    assert names[:2] == ["fp32", "bf16"] and "kvarn_k4v2_g128" in names and "kivi_k2v2" in names
    kvarn = select_methods("kvarn")
    assert kvarn and all(m.name.startswith("kvarn_") for m in kvarn)
    assert [m.name for m in select_methods("bf16, kivi_k2v2,bf16")] == ["bf16", "kivi_k2v2"]
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        select_methods("bf16,nope")
    ok, skipped = supported_for(select_methods("bf16,kvarn_k4v2_g128"), 96)
    assert [m.name for m in ok] == ["bf16"] and "head_dim" in skipped["kvarn_k4v2_g128"]


class SuccessorModel:
    """A stand-in language model that always predicts token ``id + 1`` (logit 10, others 0)."""

    vocab = 94

    def __call__(
        self,
        input_ids: torch.Tensor,
        use_cache: bool = False,
        logits_to_keep: int = 0,
        cache: object = None,
    ) -> SimpleNamespace:
        nxt = torch.nn.functional.one_hot((input_ids + 1) % self.vocab, self.vocab).float()
        return SimpleNamespace(logits=10.0 * nxt[:, -logits_to_keep:])  # 0 keeps every row


def test_build_prompt_skips_shots_of_the_same_group() -> None:
    items = [
        TaskItem(f"w{i} w{i}", (" w1",), 0, i, group="twins" if i < 2 else "") for i in range(5)
    ]
    prompt, shots = build_prompt(items, 0, 9, lambda s: len(s.split()))
    assert shots == 3  # items 2, 3, 4 (2 + 3 * 3 words >= 9): the twin, item 1, is skipped
    assert prompt == "w2 w2 w1\n\nw3 w3 w1\n\nw4 w4 w1\n\nw0 w0"


def test_partial_scoring_picks_the_option_whose_context_predicts_the_rest() -> None:
    """Winogrande form: one context per option, the same continuation scored after each."""
    tok = word_tokenizer()
    # successor model: only "... w5" continues as " w6 w7" (w5 -> id 9, w6 -> id 10)
    items = [
        TaskItem(
            "w1 w2 w5",
            (" w6 w7", " w6 w7"),
            gold,
            i,
            contexts=("w1 w2 w3", "w1 w2 w5") if gold == 1 else ("w1 w2 w5", "w1 w2 w3"),
        )
        for i, gold in enumerate([1, 0, 1])
    ]
    prepared = prepare_items(items, 3, tok, min_context_tokens=12)
    assert prepared[0].shots == 2 and len(prepared[0].contexts) == 2
    ids = tok("w1 w2 w5 w6 w7\n\nw1 w2 w5 w6 w7\n\nw1 w2 w3")["input_ids"]
    assert prepared[0].contexts[0] == tuple(ids) == prepared[0].context
    result = evaluate_task(
        SuccessorModel(),
        "winogrande",
        "multiple_choice",
        prepared,
        [Exact(), KIVI2],
        head_dim=HEAD_DIM,
        pad_id=0,
        block_size=BLOCK,
    )
    row = result.row("bf16")
    assert result.primary_metric == "acc"
    assert row.predictions == [1, 0, 1] and row.accuracy == 1.0 and row.agreement == 1.0


def test_mmlu_primary_metric_is_per_character() -> None:
    """Raw log-likelihood and per-character normalization disagree; MMLU reports the latter."""
    # " w7": one wrong token (about -10); " w6 w7 w8 w0 w1": four right, one wrong, 15 characters
    item = TaskItem("w1 w2 w5", (" w7", " w6 w7 w8 w0 w1"), 1, 0)
    prepared = prepare_items([item], 1, word_tokenizer(), min_context_tokens=0)
    results = {
        suite: evaluate_task(
            SuccessorModel(),
            suite,
            "multiple_choice",
            prepared,
            [Exact()],
            head_dim=HEAD_DIM,
            pad_id=0,
            block_size=BLOCK,
        )
        for suite in ("mmlu", "arc_easy")
    }
    mmlu = results["mmlu"].row("bf16")
    assert results["mmlu"].primary_metric == "acc_per_char"
    assert mmlu.predictions == [1] and mmlu.accuracy == 1.0
    assert mmlu.accuracy_raw == 0.0 and mmlu.accuracy_per_char == 1.0
    assert results["arc_easy"].row("bf16").predictions == [0]


def test_per_choice_contexts_score_as_if_alone(model: torch.nn.Module) -> None:
    """Contexts of different lengths in one right-padded batch score like each alone."""
    from kvarn_eval.accuracy.pseudo_decode import PseudoDecodeConfig, pseudo_decode
    from kvarn_eval.accuracy.tasks import PreparedItem, _score_batch

    long_ctx = tuple(range(4, 4 + 80)) * 2
    short_ctx = long_ctx[:-7]
    conts = ((11, 12, 13), (5, 6))
    both = PreparedItem(long_ctx, conts, (9, 6), 0, 0, contexts=(long_ctx, short_ctx))
    with torch.inference_mode(), pseudo_decode(PseudoDecodeConfig(KIVI2, BLOCK)):
        sums_both, greedy_both = _score_batch(model, both, pad_id=0)
        alone = [
            _score_batch(model, PreparedItem(ctx, (c,), (1,), 0, 0), pad_id=0)
            for ctx, c in zip((long_ctx, short_ctx), conts)
        ]
    assert sums_both == pytest.approx([s[0][0] for s in alone], abs=1e-4)
    assert greedy_both == [g[1][0] for g in alone]


def _scored(model: torch.nn.Module, count: int, start: int = 0) -> dict[str, Any]:
    items = prepare_items(_items(20), count, word_tokenizer(), min_context_tokens=150, start=start)
    result = evaluate_task(
        model, "toy", "multiple_choice", items, [Exact(), KIVI2], head_dim=HEAD_DIM, pad_id=0,
        block_size=BLOCK,
    )  # fmt: skip
    result.first_item = start
    return result.to_dict()


def test_runs_over_consecutive_items_pool_into_the_longer_run(model: torch.nn.Module) -> None:
    whole = _scored(model, 8)
    parts = [_scored(model, 3), _scored(model, 5, start=3)]
    pooled = pool_task_results(parts, [p["golds"] for p in parts])
    assert pooled["num_items"] == 8 and pooled["first_item"] == 0
    assert pooled["golds"] == whole["golds"] == [i % 3 for i in range(8)]
    for got, want in zip(pooled["rows"], whole["rows"], strict=True):
        assert got["predictions"] == want["predictions"]
        for key in ("accuracy", "accuracy_se", "agreement", "accuracy_raw", "accuracy_per_char"):
            assert got[key] == pytest.approx(want[key]), key
        assert got["change"] == pytest.approx(want["change"])
        assert got["change_se"] == pytest.approx(want["change_se"], nan_ok=True)
    for key in ("mean_context_tokens", "mean_shots", "mean_quantized_fraction"):
        assert pooled[key] == pytest.approx(whole[key]), key


def test_pooled_rows_are_computed_over_every_item() -> None:
    a = task_part(0, {"bf16": [1, 1, 0, 0], "kivi_k2v2": [1, 0, 0, 0]})
    b = task_part(4, {"bf16": [1, 0], "kivi_k2v2": [0, 1]})
    pooled = pool_task_results([a, b], [[0] * 4, [0] * 2])
    bf16, kivi = pooled["rows"]
    assert bf16["accuracy"] == pytest.approx(3 / 6) and kivi["accuracy"] == pytest.approx(2 / 6)
    # stored fractions are weighted by items: (1/4 * 4 + 1/2 * 2) / 6
    assert kivi["accuracy_raw"] == pytest.approx(2 / 6)
    assert kivi["agreement"] == pytest.approx(3 / 6)  # right or wrong alike on items 0, 2, 3
    diffs = [0, -1, 0, 0, -1, 1]
    assert kivi["change"] == pytest.approx(np.mean(diffs))
    assert kivi["change_se"] == pytest.approx(np.std(diffs, ddof=1) / math.sqrt(6))
    assert pooled["mean_context_tokens"] == pytest.approx((500 * 4 + 504 * 2) / 6)
    assert pooled["seconds"] == 2.0


@pytest.mark.parametrize(
    "second, message",
    [
        (
            task_part(5, {"bf16": [1], "kivi_k2v2": [1]}),
            r"items \[0, 4\) and \[5, 6\) do not follow",
        ),
        (
            task_part(3, {"bf16": [1], "kivi_k2v2": [1]}),
            r"items \[0, 4\) and \[3, 4\) do not follow",
        ),
        (task_part(4, {"bf16": [1], "kivi_k2v2": [1]}, block_size=64), "block_size differs"),
        (task_part(4, {"bf16": [1], "kvarn_k2v2_g128": [1]}), "the methods differ"),
    ],
)
def test_pooling_refuses_runs_that_are_not_one(second: dict[str, Any], message: str) -> None:
    first = task_part(0, {"bf16": [1, 1, 0, 0], "kivi_k2v2": [1, 0, 0, 0]})
    with pytest.raises(ValueError, match=message):
        pool_task_results([first, second], [first["golds"], second["golds"]])
    # kvarn-eval report keeps them apart and says why
    results, notes = pool_item_ranges([first, {**second, "suite": "arc_easy"}])
    if "block_size" in message:  # different settings are different groups: nothing to say
        assert len(results) == 2 and notes == []
    else:
        assert len(results) == 2 and "kept apart" in notes[0]


def test_report_pooling_groups_by_model_and_reads_golds_where_not_stored() -> None:
    a = task_part(0, {"bf16": [1, 1], "kivi_k2v2": [1, 0]}, model="m1")
    b = task_part(2, {"bf16": [1, 0], "kivi_k2v2": [0, 1]}, model="m1")
    other = task_part(2, {"bf16": [1], "kivi_k2v2": [1]}, model="m2")
    perplexity = {"suite": "wikitext", "kind_of_result": "perplexity"}
    results, notes = pool_item_ranges([perplexity, b, other, a])
    assert [r.get("num_items") for r in results] == [None, 4, 1]
    assert notes == ["arc_easy (m1): items [0, 2), [2, 4) pooled into 4 items"]
    # a result stored before golds were kept: LAMBADA's are 1, the others' read from the data
    assert stored_golds({"kind": "last_word", "suite": "lambada", "num_items": 3}) == [1, 1, 1]
    with pytest.raises(ValueError, match="depend on --mmlu-subjects"):
        stored_golds({"kind": "multiple_choice", "suite": "mmlu", "num_items": 3})
