"""Page size from kvarn-math, spec/shape agreement, backend selection through vLLM."""

from __future__ import annotations

import math
import pickle

import _releases
import pytest
import torch
from kvarn_math.layout import PRESETS, tile_layout
from kvarn_vllm.backend import backend_class
from kvarn_vllm.config import SERVED_HEAD_DIMS, parse_kv_cache_dtype
from kvarn_vllm.spec import kvarn_page_bytes, make_layer_spec

CASES = [(name, d, h) for name in sorted(PRESETS) for d in SERVED_HEAD_DIMS for h in (1, 2, 8)]


@pytest.mark.parametrize(("name", "head_dim", "kv_heads"), CASES)
def test_page_bytes_and_shape_agree(registered, name, head_dim, kv_heads):
    cfg = parse_kv_cache_dtype(name)
    layout = tile_layout(name, head_dim)
    spec = make_layer_spec(
        cfg,
        block_size=cfg.block_size,
        num_kv_heads=kv_heads,
        head_size=head_dim,
        head_size_v=head_dim,
        sliding_window=None,
    )
    assert spec.dtype is torch.uint8
    assert spec.block_size == layout.group_size
    assert spec.page_size_bytes == layout.page_bytes(kv_heads) == kv_heads * layout.tile_bytes
    assert spec.page_size_bytes == kvarn_page_bytes(cfg, cfg.block_size, kv_heads, head_dim)
    backend = backend_class(name)
    num_blocks = 7
    shape = backend.get_kv_cache_shape(num_blocks, cfg.block_size, kv_heads, head_dim)
    assert shape == (num_blocks, kv_heads, layout.tile_bytes)
    # vLLM views the raw per-layer buffer as spec.dtype and reshapes it to this shape.
    assert math.prod(shape) == num_blocks * spec.page_size_bytes
    assert backend.get_kv_cache_block_dim(cfg.block_size, kv_heads, head_dim) == 0


def test_bytes_per_token_beat_bf16():
    """The page of a ``kvarn_k4v2_g128`` layer at head_dim 128 with 8 KV heads, against a byte
    count made by hand from the record's definition (docs/format.md), not from the layout code:
    per KV head, 4-bit key codes 128 x 128 / 2 = 8,192, fp16 key scale and zero per channel
    256 + 256, one-byte token factors 128, 2-bit value codes 128 x 128 / 4 = 4,096, one-byte
    channel factors 128, fp16 value scale and zero per token 256 + 256, flags 16: 13,584 bytes
    (every field a multiple of 16, so no padding), 106.125 bytes per token and head against
    bf16's 512."""
    cfg = parse_kv_cache_dtype("kvarn_k4v2_g128")
    spec = make_layer_spec(
        cfg, block_size=128, num_kv_heads=8, head_size=128, head_size_v=128, sliding_window=None
    )
    record = 8_192 + 256 + 256 + 128 + 4_096 + 128 + 256 + 256 + 16
    assert record == 13_584
    assert spec.page_size_bytes == 8 * record
    bf16_page = 128 * 8 * 2 * 128 * 2  # tokens x heads x (K, V) x head_dim x 2 bytes
    assert bf16_page / spec.page_size_bytes == pytest.approx(512 / 106.125)  # 4.82x
    assert bf16_page / spec.page_size_bytes > 4.5


def test_sliding_window_spec(registered):
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    cfg = parse_kv_cache_dtype("kvarn_k4v4_g128")
    spec = make_layer_spec(
        cfg, block_size=128, num_kv_heads=4, head_size=256, head_size_v=256, sliding_window=512
    )
    assert isinstance(spec, SlidingWindowSpec)
    assert spec.sliding_window == 512
    assert spec.page_size_bytes == tile_layout(cfg.preset, 256).page_bytes(4)


def test_spec_errors():
    cfg = parse_kv_cache_dtype("kvarn_k4v2_g128")
    kw = dict(num_kv_heads=2, head_size=128, head_size_v=128, sliding_window=None)
    with pytest.raises(ValueError, match="block_size must equal .* 128 .* got 16"):
        make_layer_spec(cfg, block_size=16, **kw)
    with pytest.raises(ValueError, match="head_size_v"):
        make_layer_spec(cfg, block_size=128, **{**kw, "head_size_v": 64})
    with pytest.raises(ValueError, match="head_dim"):
        make_layer_spec(cfg, block_size=128, **{**kw, "head_size": 96, "head_size_v": 96})
    with pytest.raises(ValueError, match="multiple of the kvarn_k4v2_g128 tile"):
        kvarn_page_bytes(cfg, 100, 2, 128)


def test_spec_merge_and_pickle(registered):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    cfg = parse_kv_cache_dtype("kvarn_k4v2_g64")
    specs = [
        make_layer_spec(
            cfg, block_size=64, num_kv_heads=2, head_size=64, head_size_v=64, sliding_window=None
        )
        for _ in range(3)
    ]
    merged = type(specs[0]).merge(specs)
    assert merged == specs[0] and merged.page_size_bytes == specs[0].page_size_bytes
    assert isinstance(merged, FullAttentionSpec)
    clone = pickle.loads(pickle.dumps(merged))
    assert clone == merged and clone.page_size_bytes == merged.page_size_bytes
    other = make_layer_spec(
        parse_kv_cache_dtype("kvarn_k4v4_g64"),
        block_size=64,
        num_kv_heads=2,
        head_size=64,
        head_size_v=64,
        sliding_window=None,
    )
    with pytest.raises((ValueError, AssertionError)):
        type(specs[0]).merge([specs[0], other])


def test_vllm_kv_cache_config_counts_true_tokens(vllm_config_factory):
    """vLLM's own planner sizes the pool from our page: tokens = blocks * G."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups

    vc = vllm_config_factory("kvarn_k4v2_g128", block_size=128)
    cfg = parse_kv_cache_dtype("kvarn_k4v2_g128")
    specs = {
        f"model.layers.{i}.self_attn.attn": make_layer_spec(
            cfg, block_size=128, num_kv_heads=8, head_size=128, head_size_v=128, sliding_window=None
        )
        for i in range(4)
    }
    page = next(iter(specs.values())).page_size_bytes
    groups = get_kv_cache_groups(vc, specs)
    assert len(groups) == 1
    available = 1000 * 4 * page + 123
    kv_cfg = get_kv_cache_config_from_groups(vc, groups, available)
    assert kv_cfg.num_blocks == 1000
    assert sum(t.size for t in kv_cfg.kv_cache_tensors) == 1000 * 4 * page


def _selector_cfg(**overrides):
    from vllm.v1.attention.selector import AttentionSelectorConfig

    base = dict(
        head_size=128, dtype=torch.bfloat16, kv_cache_dtype="kvarn_k4v2_g128", block_size=None
    )
    base.update(overrides)
    return AttentionSelectorConfig(**base)


def test_selector_returns_preset_backend(registered):
    from vllm.v1.attention import selector

    for name in PRESETS:
        cls = selector._cached_get_attn_backend(None, _selector_cfg(kv_cache_dtype=name), 32)
        assert cls is backend_class(name)
        assert cls.get_name() == "CUSTOM"
        assert cls.get_supported_kernel_block_sizes() == [PRESETS[name].group_size]
        assert cls.get_preferred_block_size(16) == PRESETS[name].group_size
        assert cls.supports_kv_cache_dtype(name)
        assert not cls.supports_kv_cache_dtype("auto")


def test_selector_through_get_attn_backend(vllm_config_factory):
    """vLLM's public selector entry point, with the config set as in a worker."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    vc = vllm_config_factory("kvarn_k4v4_g64")
    with set_current_vllm_config(vc):
        cls = get_attn_backend(64, torch.float16, "kvarn_k4v4_g64")
    assert cls is backend_class("kvarn_k4v4_g64")


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (dict(use_mla=True), "MLA"),
        (dict(block_size=16), "--block-size 16 conflicts with kvarn_k4v2_g128"),
        (dict(head_size=80), "head_dim is 80"),
        (dict(dtype=torch.float32), "model dtype"),
        (dict(has_sink=True), "sinks"),
        (dict(attn_type="encoder_only"), "attention type"),
        (dict(use_non_causal=True), "attends non-causal blocks only in a DFlash drafter"),
        (dict(use_non_causal=True), "methods eagle, eagle3, mtp, dflash, ngram, ngram_gpu"),
    ],
)
def test_selector_errors_say_why(registered, overrides, needle):
    from vllm.v1.attention import selector

    with pytest.raises(ValueError) as err:
        selector._cached_get_attn_backend(None, _selector_cfg(**overrides), 32)
    assert needle in str(err.value)
    assert "kvarn-vllm cannot serve attention layer" in str(err.value)


def test_selector_accepts_non_causal_layers_of_a_dflash_drafter(registered, monkeypatch):
    """While vLLM builds a DFlash drafter (compilation model tag "dflash_head"), its
    non-causal layers get kvarn's backend; a DSpark drafter's and a target's are refused."""
    from vllm.compilation import backends
    from vllm.v1.attention import selector

    cfg = _selector_cfg(use_non_causal=True)
    for tag, ok in (("dflash_head", True), ("dspark_head", False), ("backbone", False)):
        monkeypatch.setattr(backends, "model_tag", tag)
        if ok:
            cls = selector._cached_get_attn_backend(None, cfg, 32)
            assert cls is backend_class("kvarn_k4v2_g128")
        else:
            with pytest.raises(ValueError, match="non-causal"):
                selector._cached_get_attn_backend(None, cfg, 32)


def test_selector_refuses_other_backend_with_kvarn_dtype(registered):
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    with pytest.raises(ValueError, match="--attention-backend FLASH_ATTN"):
        selector._cached_get_attn_backend(AttentionBackendEnum.FLASH_ATTN, _selector_cfg(), 32)
    cls = selector._cached_get_attn_backend(AttentionBackendEnum.CUSTOM, _selector_cfg(), 32)
    assert cls is backend_class("kvarn_k4v2_g128")


def test_selector_leaves_other_dtypes_to_vllm(registered):
    from vllm.v1.attention import selector

    cls = selector._cached_get_attn_backend(None, _selector_cfg(kv_cache_dtype="auto"), 32)
    assert not cls.__module__.startswith("kvarn_vllm")


def _attention(vc, head_size=64, num_heads=4, num_kv_heads=2, prefix="model.layers.0.attn", **kw):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        with set_current_vllm_config(vc):
            return Attention(
                num_heads=num_heads,
                head_size=head_size,
                scale=head_size**-0.5,
                num_kv_heads=num_kv_heads,
                cache_config=vc.cache_config,
                prefix=prefix,
                **kw,
            )
    finally:
        torch.set_default_dtype(old)


def test_real_attention_layer(vllm_config_factory):
    """vLLM's Attention picks the kvarn backend; its spec and impl agree with the layout."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    vc = vllm_config_factory("kvarn_k4v2_g64", max_num_seqs=6)
    vc.cache_config.block_size = 64  # what update_block_size_for_backend sets after load
    layer = _attention(vc)
    assert layer.attn_backend is backend_class("kvarn_k4v2_g64")
    assert layer.backend is AttentionBackendEnum.CUSTOM
    assert layer.kv_cache_torch_dtype is torch.uint8
    # values-only windows (the default): the key ring (the open tile), then the sink rows
    # and the value ring (the open tile and the recent one)
    assert layer.impl.staging.shape == (6, 64 + 3 * 64, 2, 64)
    assert layer.impl.staging.dtype is torch.float16
    spec = layer.get_kv_cache_spec(vc)
    assert spec.page_size_bytes == tile_layout("kvarn_k4v2_g64", 64).page_bytes(2)
    assert layer.attn_backend.get_kv_cache_shape(3, 64, 2, 64) == (
        3,
        2,
        tile_layout("kvarn_k4v2_g64", 64).tile_bytes,
    )


def test_real_attention_sliding_window_layer(vllm_config_factory):
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    vc = vllm_config_factory("kvarn_k4v4_g64")
    vc.cache_config.block_size = 64
    layer = _attention(vc, per_layer_sliding_window=128, prefix="model.layers.1.attn")
    spec = layer.get_kv_cache_spec(vc)
    assert isinstance(spec, SlidingWindowSpec) and spec.sliding_window == 128
    assert spec.block_size == 64


def test_real_attention_error_names_layer(vllm_config_factory):
    vc = vllm_config_factory("kvarn_k4v2_g64")
    with pytest.raises(ValueError) as err:
        _attention(vc, head_size=96, prefix="model.layers.7.self_attn.attn")
    assert "'model.layers.7.self_attn.attn'" in str(err.value)
    assert "head_dim is 96" in str(err.value)


def test_block_size_conflict_is_a_clear_error(vllm_config_factory):
    vc = vllm_config_factory("kvarn_k4v2_g64", block_size=16)
    assert vc.cache_config.user_specified_block_size
    with pytest.raises(ValueError) as err:
        _attention(vc, prefix="model.layers.0.attn")
    msg = str(err.value)
    assert "--block-size 16 conflicts with kvarn_k4v2_g64" in msg
    assert "--block-size 64" in msg


def test_matching_user_block_size_is_fine(vllm_config_factory):
    vc = vllm_config_factory("kvarn_k4v2_g64", block_size=64)
    layer = _attention(vc)
    assert layer.get_kv_cache_spec(vc).block_size == 64


def test_block_size_follows_preset_via_vllm(vllm_config_factory):
    """vLLM's update_block_size_for_backend (phase 1) sets the tile size for us."""
    from types import SimpleNamespace

    from vllm.platforms.interface import Platform

    vc = vllm_config_factory("kvarn_k4v4_g128")
    vc.cache_config.block_size = 16  # vLLM's CPU platform already bumped it; undo that
    assert not vc.cache_config.user_specified_block_size
    backend = backend_class("kvarn_k4v4_g128")
    vc.model_config = SimpleNamespace(is_hybrid=False)  # only is_hybrid is read here

    class _OnePlatform(Platform):
        @classmethod
        def _find_non_ssm_backend(cls, vllm_config):
            return backend

    _OnePlatform.update_block_size_for_backend(vc)
    assert vc.cache_config.block_size == 128


def test_skip_layers_refused(vllm_config_factory):
    vc = vllm_config_factory("kvarn_k4v2_g64", kv_cache_dtype_skip_layers=["0"])
    vc.cache_config.block_size = 64
    layer = _attention(vc, prefix="model.layers.1.attn")
    with pytest.raises(ValueError, match="skip-layers"):
        layer.get_kv_cache_spec(vc)


def test_soft_capped_layer_error_names_layer(vllm_config_factory):
    vc = vllm_config_factory("kvarn_k4v2_g64")
    with pytest.raises(ValueError) as err:
        _attention(vc, prefix="model.layers.3.self_attn.attn", logits_soft_cap=50.0)
    assert "'model.layers.3.self_attn.attn'" in str(err.value)
    assert "soft-capping" in str(err.value)


# vLLM 0.26's spec patch and its get_kv_cache_shape allocation: where the 'kv-cache-spec' ledger entry applies
pytestmark = _releases.needs("kv-cache-spec")
