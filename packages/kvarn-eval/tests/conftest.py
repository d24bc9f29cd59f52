"""Fixtures of kvarn-eval's tests (helpers live in ``eval_helpers``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from eval_helpers import tiny_llama, word_tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved Hugging Face folder of the tiny Llama and its tokenizer."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama().save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return path
