"""MLA models: preset mapping, backend selection, page size and the start-up refusals."""

from __future__ import annotations

import pickle

import pytest
import torch
from kvarn_math.layout import PRESETS
from kvarn_math.mla import MLA_PRESETS, mla_layout
from kvarn_vllm import releases
from kvarn_vllm.mla_config import mla_preset_for, mla_preset_names, split_head_size

ON_026 = pytest.mark.skipif(
    releases.current() is None or releases.current().name != "vllm-0.26",
    reason="the MLA latent cache is served on vLLM 0.26.x only",
)


def test_every_kvarn_name_maps_to_an_mla_preset():
    expected = {
        "kvarn_k4v2_g128": "kvarn_mla_l4_g128",
        "kvarn_k4v4_g128": "kvarn_mla_l4_g128",
        "kvarn_k3v2_g128": "kvarn_mla_l4_g128",
        "kvarn_k4v2_g64": "kvarn_mla_l4_g64",
        "kvarn_k4v4_g64": "kvarn_mla_l4_g64",
        "kvarn_k2v2_g128": "kvarn_mla_l2_g128",
    }
    assert set(expected) == set(PRESETS)
    for dense, mla in expected.items():
        assert mla_preset_for(dense).name == mla
    for name in MLA_PRESETS:
        assert mla_preset_for(name).name == name
    assert mla_preset_names()[0] == "kvarn_mla_l4_g128"
    with pytest.raises(ValueError, match="no KVarN preset.*kvarn_mla_l4_g128"):
        mla_preset_for("kvarn_k9v9_g128")
    with pytest.raises(ValueError, match="unknown KVarN MLA preset"):
        mla_preset_for("kvarn_mla_l3_g128")


def test_head_size_split():
    assert split_head_size(576) == (512, 64)
    assert split_head_size(576, 512) == (512, 64)
    assert split_head_size(320) == (256, 64)
    with pytest.raises(ValueError, match="kv_lora_rank 448 \\+ qk_rope_head_dim 64"):
        split_head_size(512)


def _cfg(**overrides):
    from vllm.v1.attention.selector import AttentionSelectorConfig

    base = dict(
        head_size=576,
        dtype=torch.bfloat16,
        kv_cache_dtype="kvarn_k4v2_g128",
        block_size=None,
        use_mla=True,
    )
    base.update(overrides)
    return AttentionSelectorConfig(**base)


def _select(cfg, backend=None):
    from vllm.v1.attention import selector

    return selector._cached_get_attn_backend(backend, cfg, 16)


@ON_026
@pytest.mark.parametrize("name", sorted(PRESETS) + sorted(MLA_PRESETS))
def test_selection_page_and_shape(registered, name):
    """Every kvarn name on an MLA layer selects the latent backend of its MLA preset, whose
    cache shape and page are the record's bytes, not 576 * 2 a token."""
    from kvarn_vllm.mla_backend import mla_backend_class, mla_spec_class

    preset = mla_preset_for(name)
    cls = _select(_cfg(kv_cache_dtype=name))
    assert cls is mla_backend_class(preset.name, 512, 64)
    assert cls.is_mla() and cls.get_name() == "CUSTOM"
    g = preset.group_size
    assert cls.get_supported_kernel_block_sizes() == [g]
    assert cls.get_preferred_block_size(16) == g
    assert cls.supports_kv_cache_dtype(name) and not cls.supports_kv_cache_dtype("auto")
    tile = mla_layout(preset, 512, 64).tile_bytes
    assert cls.get_kv_cache_shape(7, g, 1, 576) == (7, tile)
    spec = mla_spec_class()(
        block_size=g,
        num_kv_heads=1,
        head_size=576,
        dtype=torch.uint8,
        cache_dtype_str=name,
        kvarn_mla_preset=preset.name,
        latent_dim=512,
    )
    assert spec.page_size_bytes == tile
    assert spec.page_size_bytes / g == {2: 202, 4: 330, 8: 586}[preset.latent_bits]
    merged = type(spec).merge([spec, spec])
    assert merged.page_size_bytes == tile and merged.kvarn_mla_preset == preset.name
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert pickle.loads(pickle.dumps(cls)) is cls


@ON_026
def test_vllm_planner_counts_tokens_from_records(registered):
    """vLLM's own planner sizes the pool from the record page: blocks = bytes / tile_bytes."""
    from kvarn_vllm.mla_backend import mla_spec_class
    from vllm.config import CacheConfig, DeviceConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups

    vc = VllmConfig(
        cache_config=CacheConfig(cache_dtype="kvarn_k4v2_g128", block_size=128),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=512, max_model_len=512, is_encoder_decoder=False
        ),
        device_config=DeviceConfig(device="cpu"),
    )
    spec = mla_spec_class()(
        block_size=128,
        num_kv_heads=1,
        head_size=576,
        dtype=torch.uint8,
        cache_dtype_str="kvarn_k4v2_g128",
        kvarn_mla_preset="kvarn_mla_l4_g128",
        latent_dim=512,
    )
    specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(3)}
    groups = get_kv_cache_groups(vc, specs)
    kv_cfg = get_kv_cache_config_from_groups(vc, groups, 500 * 3 * 42240 + 99)
    assert kv_cfg.num_blocks == 500  # 64,000 tokens at 330 B/token/layer


REFUSALS = [
    (dict(use_sparse=True), "sparse MLA"),
    (dict(head_size=512), "kv_lora_rank 448 + qk_rope_head_dim 64"),
    (dict(dtype=torch.float32), "model dtype is torch.float32"),
    (dict(block_size=16), "--block-size 16 conflicts with kvarn_mla_l4_g128"),
]


@ON_026
@pytest.mark.parametrize(("overrides", "needle"), REFUSALS)
def test_refusals_name_layer_reason_and_fallback(registered, overrides, needle):
    with pytest.raises(ValueError) as err:
        _select(_cfg(**overrides))
    msg = str(err.value)
    assert needle in msg
    assert "kvarn-vllm cannot serve attention layer" in msg and "(MLA latent cache" in msg
    assert "--kv-cache-dtype auto" in msg


def test_refused_on_a_release_without_the_mla_adapter(registered, monkeypatch):
    """On another served release (0.33's adapter) an MLA layer is refused at selection."""
    from kvarn_vllm.mla_backend import mla_unserved_reasons

    monkeypatch.setattr(releases, "check_supported", lambda version=None: releases.VLLM_033)
    monkeypatch.setattr(releases, "vllm_version", lambda: "0.33.0")
    reasons = mla_unserved_reasons(_cfg(), mla_preset_for("kvarn_k4v2_g128"))
    assert any("installed: vLLM 0.33.0 (vllm-0.33); served on vLLM 0.26.x" in r for r in reasons)


@ON_026
def test_refusals_from_the_engine_config(registered, monkeypatch):
    """Speculative decoding, context parallelism, skip layers, hybrid models and KV
    connectors are refused with what was found."""
    from types import SimpleNamespace

    from kvarn_vllm.mla_backend import mla_unserved_reasons

    config = SimpleNamespace(
        speculative_config=object(),
        parallel_config=SimpleNamespace(
            decode_context_parallel_size=2, prefill_context_parallel_size=1
        ),
        cache_config=SimpleNamespace(kv_cache_dtype_skip_layers=["0"]),
        model_config=SimpleNamespace(is_hybrid=True, hf_text_config=SimpleNamespace()),
        kv_transfer_config=object(),
    )
    text = "; ".join(mla_unserved_reasons(_cfg(), mla_preset_for("kvarn_k4v2_g128"), config))
    for needle in (
        "speculative decoding",
        "decode context parallelism",
        "--kv-cache-dtype-skip-layers",
        "hybrid",
        "KV connector",
    ):
        assert needle in text
    # the model's own kv_lora_rank decides the split
    config = SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(kv_lora_rank=384))
    )
    text = "; ".join(mla_unserved_reasons(_cfg(), mla_preset_for("kvarn_k4v2_g128"), config))
    assert "kv_lora_rank 384 + qk_rope_head_dim 192" in text


@ON_026
def test_other_backend_and_dense_layer_refused(registered):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    with pytest.raises(ValueError, match="--attention-backend TRITON_MLA"):
        _select(_cfg(), AttentionBackendEnum.TRITON_MLA)
    with pytest.raises(ValueError, match="is a dense attention layer; kvarn_mla_l4_g128"):
        _select(_cfg(use_mla=False, head_size=128, kv_cache_dtype="kvarn_mla_l4_g128"))


@ON_026
def test_other_dtypes_on_mla_go_to_vllm(registered):
    from kvarn_vllm import patches

    for name in ("auto", "fp8", "fp8_ds_mla"):
        assert patches._select_backend(None, _cfg(kv_cache_dtype=name), 16) is None


def _mla_layer(vllm_config, monkeypatch, num_heads=16, latent=512, rope=64, **kwargs):
    """vLLM's own MLAAttention layer (its MLA prefill backend stubbed: none imports on CPU)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention import mla_attention

    class _Prefill:
        def __init__(self, **kwargs):
            pass

    monkeypatch.setattr(mla_attention, "get_mla_prefill_backend", lambda config: _Prefill)
    kv_b_proj = torch.nn.Linear(latent, num_heads * 256, bias=False)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with set_current_vllm_config(vllm_config):
            return mla_attention.MLAAttention(
                num_heads=num_heads,
                scale=0.1,
                qk_nope_head_dim=128,
                qk_rope_head_dim=rope,
                v_head_dim=128,
                q_lora_rank=None,
                kv_lora_rank=latent,
                kv_b_proj=kv_b_proj,
                cache_config=vllm_config.cache_config,
                prefix="model.layers.3.self_attn.attn",
                **kwargs,
            )
    finally:
        torch.set_default_dtype(old)


@ON_026
@pytest.mark.parametrize(
    ("name", "tile"), [("kvarn_k2v2_g128", 25856), ("kvarn_mla_l4_g64", 21120)]
)
def test_real_mla_layer(vllm_config_factory, monkeypatch, name, tile):
    """vLLM's MLAAttention picks the kvarn backend and impl; its (patched) spec is the record."""
    from kvarn_vllm.mla_impl import KvarnMLAImpl

    vc = vllm_config_factory(name)
    group = mla_preset_for(name).group_size
    vc.cache_config.block_size = group  # what update_block_size_for_backend sets after load
    layer = _mla_layer(vc, monkeypatch)
    assert isinstance(layer.impl, KvarnMLAImpl)
    assert layer.attn_backend.get_preferred_block_size(16) == group
    spec = layer.get_kv_cache_spec(vc)
    assert spec.page_size_bytes == tile and spec.block_size == group
    assert spec.dtype is torch.uint8 and spec.head_size == 576
    vc.cache_config.block_size = 16
    with pytest.raises(ValueError, match="'model.layers.3.self_attn.attn'.*tile size"):
        layer.get_kv_cache_spec(vc)


@ON_026
def test_other_dtypes_keep_vllm_spec(vllm_config_factory, monkeypatch):
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend

    vc = vllm_config_factory("auto", block_size=16)
    layer = _mla_layer(vc, monkeypatch, attn_backend=TritonMLABackend)
    spec = layer.get_kv_cache_spec(vc)
    assert type(spec).__name__ == "MLAAttentionSpec"
    assert spec.page_size_bytes == 16 * 576 * 2
