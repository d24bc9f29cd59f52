"""CPU greedy fidelity (cached decoding under pseudo-decode) and the shared summary helpers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from eval_helpers import tiny_llama, word_text
from kvarn_eval import cli
from kvarn_eval.accuracy import install
from kvarn_eval.accuracy.greedy import evaluate_greedy, greedy_generate
from kvarn_eval.accuracy.methods import select_methods
from kvarn_eval.accuracy.perplexity import PerplexityResult
from kvarn_eval.accuracy.pseudo_decode import PseudoDecodeConfig, pseudo_decode
from kvarn_eval.accuracy.summary import agreement, binomial_se, mean_and_se
from kvarn_eval.accuracy.tasks import TaskResult, TaskRow
from kvarn_math.baselines import KIVI, KVarN

BLOCK = 64


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return install(tiny_llama(seed=3))


def _recompute(
    model: torch.nn.Module, ids: torch.Tensor, n: int, config: PseudoDecodeConfig
) -> list[list[int]]:
    """Greedy decoding the slow way: the whole sequence again at every step, no cache."""
    seq = ids.clone()
    with torch.inference_mode(), pseudo_decode(config):
        for _ in range(n):
            nxt = model(input_ids=seq, use_cache=False).logits[:, -1].argmax(-1)
            seq = torch.cat([seq, nxt[:, None]], dim=1)
    return seq[:, ids.shape[1] :].tolist()


@pytest.mark.parametrize(
    ("method", "block", "prompt"),
    [
        (KVarN.of("kvarn_k4v2_g64"), BLOCK, 150),
        # the key frame chosen from each tile's last query, as kvarn-vllm stores and the
        # benchmarks run it: the cached steps keep those queries for the tiles they complete
        (KVarN.of("kvarn_k4v2_g64", key_frame="auto"), BLOCK, 150),
        (KVarN.of("kvarn_k2v2_g128", key_frame="auto"), 128, 230),
        (KIVI(name="kivi_k2v2", group_size=BLOCK, key_bits=2, value_bits=2), BLOCK, 150),
    ],
)
def test_cached_greedy_equals_recomputing(
    model: torch.nn.Module, method: object, block: int, prompt: int
) -> None:
    # the prompt + 50 new tokens cross a block boundary (192, 256): a block completes during
    # decoding and is quantized from then on
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 94, (2, prompt), generator=gen)
    config = PseudoDecodeConfig(method, block)  # type: ignore[arg-type]
    assert greedy_generate(model, ids, 50, config) == _recompute(model, ids, 50, config)


def test_cached_greedy_past_the_sliding_window_equals_recomputing() -> None:
    # prompt 150 + 30 tokens against a window of 96: transformers' own cache for a window
    # layer would keep only the last 95 positions and shift every key's index
    windowed = install(tiny_llama(seed=2, sliding_window=96))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 94, (2, 150), generator=gen)
    config = PseudoDecodeConfig(
        KIVI(name="kivi_k2v2", group_size=BLOCK, key_bits=2, value_bits=2), BLOCK
    )
    assert greedy_generate(windowed, ids, 30, config) == _recompute(windowed, ids, 30, config)


def test_evaluate_greedy_rows(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(2)
    prompts = torch.randint(4, 94, (3, 200), generator=gen).tolist()
    methods = select_methods("fp32,bf16,kivi_k2v2", BLOCK)
    result = evaluate_greedy(model, prompts, methods, head_dim=64, new_tokens=24, block_size=BLOCK)
    bf16, fp32, kivi = result.row("bf16"), result.row("fp32"), result.row("kivi_k2v2")
    assert bf16.token_agreement == 1.0 and bf16.exact_match == 1.0 and bf16.mean_lcp == 24
    assert kivi.token_agreement < 1.0  # 2-bit keys move greedy tokens on the peaky tiny model
    assert fp32.token_agreement >= kivi.token_agreement
    assert [len(o) for o in kivi.outputs] == [24, 24, 24]
    data = result.to_dict()
    assert data["kind"] == "greedy" and data["prompt_len"] == 200
    with pytest.raises(ValueError, match="one length"):
        evaluate_greedy(model, [[5] * 10, [5] * 11], methods, head_dim=64, new_tokens=2)
    with pytest.raises(ValueError, match="reference 'bf16'"):
        evaluate_greedy(model, prompts, methods[:1], head_dim=64, new_tokens=2)


def test_summary_helpers() -> None:
    assert binomial_se(0.5, 25) == pytest.approx(0.1)
    assert agreement([1, 2, 3, 4], [1, 0, 3, 0]) == 0.5
    with pytest.raises(ValueError, match="one prediction per item"):
        agreement([1], [1, 2])
    mean, se = mean_and_se([1.0, 3.0])
    assert mean == 2.0 and se == pytest.approx(1.0)
    rows = [TaskRow("bf16", 16.0, 0.5, 0.1, 1.0, 0.5, 0.5)]
    task = TaskResult("piqa", "multiple_choice", "acc", "bf16", 2, 10.0, 1.0, 0.5, 64, True, rows)
    assert task.row("bf16") is rows[0]
    assert (
        task.to_dict()["kind_of_result"] == "task" and task.to_dict()["kind"] == "multiple_choice"
    )
    with pytest.raises(KeyError):
        task.row("fp8")
    ppl = PerplexityResult("text", "", "bf16", 1, 256, 64, True, 64, [])
    assert ppl.to_dict()["kind"] == "perplexity"


def test_greedy_suite_from_the_command_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_text(word_text(3000))
    out = tmp_path / "out"
    argv = [
        "bench", "--model", str(tiny_model_dir), "--suites", "greedy", "--text", str(text),
        "--task-methods", "bf16,kivi_k2v2", "--greedy-prompts", "2", "--greedy-prompt-len", "192",
        "--greedy-tokens", "8", "--block-size", "64", "--out", str(out), "--threads", "1",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    (result,) = json.loads((out / "results.json").read_text())["results"]
    assert [r["method"] for r in result["rows"]] == ["fp32", "bf16", "kivi_k2v2"]
    assert result["num_prompts"] == 2 and result["prompt_len"] == 192
    assert result["recent_blocks"] == 1  # kvarn-vllm's default window, for every method
    assert "greedy: 2 prompts of 192 tokens" in (out / "results.md").read_text()
    assert (out / "accuracy.png").stat().st_size > 0
    bad = cli.main([*argv[:-4], "--greedy-prompt-len", "100", "--out", str(out)])
    assert bad == 2  # shorter than 3 blocks: no quantized block would be read
