"""The MLA conversion of a Llama-style model (a tiny random one) and its latent pseudo-decode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvarn_eval.accuracy.mla import (  # noqa: E402
    LatentQuantization,
    MLAConversion,
    _block_mask,
    collected_latents,
    convert_model,
    latent_quantization,
)
from kvarn_math.mla_recipes import LatentRecipe  # noqa: E402


def _tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=96,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_theta=1000.0,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    return model


def _ids(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 97, size=n).tolist()]


def test_full_conversion_reproduces_the_model() -> None:
    """Every pair kept (in the RoPE key or exactly) and a full-rank latent: same logits."""
    model = _tiny_llama()
    ids = torch.tensor(_ids(40, 1))
    with torch.no_grad():
        want = model(ids).logits
    stats = convert_model(model, _ids(256, 2), MLAConversion(rank=32, rope_pairs=16, nope_freqs=0))
    assert all(s["dropped_logit_share"] == pytest.approx(0.0, abs=1e-12) for s in stats)
    assert all(s["latent_energy"] == pytest.approx(1.0) for s in stats)
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_partial_conversion_and_latent_quantization() -> None:
    model = _tiny_llama()
    ids = torch.tensor(_ids(64, 3))
    with torch.no_grad():
        want = model(ids).logits
    stats = convert_model(model, _ids(256, 4), MLAConversion(rank=24, rope_pairs=8, nope_freqs=2))
    assert all(0 < s["dropped_logit_share"] < 1 for s in stats)
    with torch.no_grad(), collected_latents() as seen:
        exact = model(ids).logits
    assert [layer for layer, _, _ in seen] == [0, 1]
    assert seen[0][1].shape == (64, 24) and seen[0][2].shape == (64, 16)
    # whitened latent: unit variance per channel on the calibration data, roughly here too
    assert 0.2 < float(np.mean(seen[0][1] ** 2)) < 5
    assert not torch.allclose(exact, want)  # a lossy conversion changes the model
    recipe = LatentRecipe("rtn2", bits=2, group=8, tile=16, rope="bf16")
    with torch.no_grad(), latent_quantization(LatentQuantization(recipe, 16, 16)):
        quant = model(ids).logits
    assert not torch.allclose(quant, exact)
    # the first block is exact for every method: its logits do not change
    torch.testing.assert_close(quant[:, :16], exact[:, :16], rtol=1e-5, atol=1e-5)
    with torch.no_grad(), latent_quantization(LatentQuantization(None, 16, 16)):
        torch.testing.assert_close(model(ids).logits, exact)


def test_block_mask() -> None:
    mask = _block_mask(6, 2, 2)
    # query 5 (block 2): quantized keys 2, 3 (block 1); exact sink 0, 1 and its own 4, 5
    quantized, exact = mask[5, :6].tolist(), mask[5, 6:].tolist()
    assert quantized == [False, False, True, True, False, False]
    assert exact == [True, True, False, False, True, True]
    assert mask[1, :6].sum() == 0 and mask[1, 6:].tolist() == [
        True,
        True,
        False,
        False,
        False,
        False,
    ]


def _script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "mla_convert.py"
    spec = importlib.util.spec_from_file_location("mla_convert", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_helpers() -> None:
    script = _script()
    names = [m.name for m in script.sweep_recipes()]
    assert len(names) == len(set(names))
    budget = {m.name: m.bytes_per_token(512, 64) for m in script.pseudo_decode_methods()}
    assert budget["kvarn_mla_l4_g128"] == 330 and budget["fp8_ds_mla"] == 656
    assert budget["rtn4_g1_int8"] <= 330  # plain RTN at (no more than) the default's bytes
    padded = script.Padded(LatentRecipe("r", group=256, rope="int8", tile=16))
    lat = np.random.default_rng(0).standard_normal((32, 200)).astype(np.float32)
    pe = np.ones((32, 8), np.float32)
    back, _ = padded.roundtrip(lat, pe)
    assert back.shape == lat.shape and np.abs(back - lat).max() < 0.5
    logp = [torch.log_softmax(torch.randn(5, 11), -1)]
    same = script.score(logp, logp, [[0, 1, 2, 3, 4, 5]])
    assert same["kl"] == pytest.approx(0.0, abs=1e-6) and same["top1"] == 1.0
