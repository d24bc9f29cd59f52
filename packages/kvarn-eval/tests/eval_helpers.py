"""Test helpers: a tiny randomly initialized Llama (no downloads) and a word-level tokenizer.

A module with a unique name rather than ``conftest``: several packages' test folders have a
``conftest.py`` and run in one pytest process.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

HEAD_DIM = 64  # the smallest head_dim KVarN presets support
VOCAB = [f"w{i}" for i in range(90)]


def tiny_llama(seed: int = 0, sliding_window: int | None = None) -> Any:
    """A 2-layer Llama (or Mistral when ``sliding_window``) with GQA, float32, eval mode."""
    torch.manual_seed(seed)
    common: dict[str, Any] = dict(
        vocab_size=len(VOCAB) + 4,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=HEAD_DIM,
        max_position_embeddings=2048,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    if sliding_window is not None:
        config = transformers.MistralConfig(sliding_window=sliding_window, **common)
    else:
        config = transformers.LlamaConfig(**common)
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # random init gives near-uniform attention; larger q/k weights make attention peaky so
    # that quantization errors visibly move the logits
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    return model.eval()


def word_tokenizer() -> Any:
    """A fast word-level tokenizer over :data:`VOCAB` (``<pad>=0, <s>=1, </s>=2, <unk>=3``)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({w: i + 4 for i, w in enumerate(VOCAB)})
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
    )


def word_text(num_words: int, seed: int = 0) -> str:
    """Deterministic pseudo-text over :data:`VOCAB` with some repetition structure."""
    import random

    rng = random.Random(seed)
    words = []
    for i in range(num_words):
        words.append(VOCAB[(i * 7) % len(VOCAB)] if rng.random() < 0.5 else rng.choice(VOCAB))
    return " ".join(words)


def task_part(first: int, rights: dict[str, list[int]], **settings: Any) -> dict[str, Any]:
    """A stored task result over items ``first..`` (ARC-Easy's settings): gold 0 on every
    item, a method right where its ``rights`` has 1."""
    n = len(rights["bf16"])
    return {
        "suite": "arc_easy", "kind": "multiple_choice", "primary_metric": "acc",
        "reference": "bf16", "block_size": 128, "exact_first_block": True, "sink_tokens": 128,
        "sink_requantize": False, "recent_blocks": 1, "kind_of_result": "task",
        "num_items": n, "first_item": first, "mean_context_tokens": 500.0 + first,
        "mean_shots": 10.0, "mean_quantized_fraction": 0.5, "golds": [0] * n, "seconds": 1.0,
        "rows": [
            {"method": m, "bits_per_element": 16.0 if m == "bf16" else 2.375,
             "accuracy_raw": sum(r) / n, "accuracy_per_char": 0.0,
             "predictions": [0 if x else 1 for x in r]}
            for m, r in rights.items()
        ],
        **settings,
    }  # fmt: skip
