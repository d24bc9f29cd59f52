"""Hybrid models' MTP drafters and sliding-window layers over a KVarN cache (vLLM 0.26, CPU).

* MTP: Qwen3-Next's multi-token-prediction layer is one more full-attention layer of the
  target's shape. Built here from vLLM's real ``Qwen3NextMTP`` beside the target's layers,
  it must take kvarn's backend and the target's aligned spec, so that vLLM plans one page for
  every group (a bf16 drafter page would become the largest and undo the alignment). vLLM
  0.26 runs hybrids on its V1 model runner, where kvarn does not draft: a start-up error
  names ``VLLM_USE_V2_MODEL_RUNNER=1``.
* Sliding windows: a Nemotron-H config with ``sliding_window`` (vLLM gives every attention
  layer that window) follows the dense policy: quantized, kvarn's sliding-window spec, the
  window handed to the kernels, with the hybrid block.
"""

from __future__ import annotations

import json

import _releases
import pytest
from test_hybrid import (
    MAX_MODEL_LEN,
    NEMOTRON_H,
    QWEN3_NEXT,
    _silu_and_mul_without_op,
    model_parallel,  # noqa: F401 (fixture)
)

WINDOW = 4096


def _build(tmp_path, config: dict, cache_dtype: str, prefix: bool, mtp: bool = False, v2=False):
    """Target layers (and the MTP drafter's), the block size updated as a worker does:
    ``(vllm_config, {name: layer}, {name: spec}, draft layer names)``. ``v2``: as on vLLM's
    V2 model runner (``VLLM_USE_V2_MODEL_RUNNER=1``, which needs Triton's GPU driver to
    validate; here the config answers V2 once built)."""
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        LoadConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.config.vllm import set_current_vllm_config
    from vllm.model_executor.layers import activation
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.platforms.interface import Platform
    from vllm.utils.torch_utils import set_default_torch_dtype

    (tmp_path / "config.json").write_text(json.dumps(config))
    model_config = ModelConfig(
        model=str(tmp_path), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=MAX_MODEL_LEN
    )
    parallel = ParallelConfig()
    speculative = None
    if mtp:
        speculative = SpeculativeConfig(
            method="mtp",
            num_speculative_tokens=1,
            target_model_config=model_config,
            target_parallel_config=parallel,
        )
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(cache_dtype=cache_dtype, enable_prefix_caching=prefix),
        parallel_config=parallel,
        speculative_config=speculative,
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=MAX_MODEL_LEN,
            max_model_len=MAX_MODEL_LEN,
            is_encoder_decoder=False,
            enable_chunked_prefill=True,
        ),
        device_config=DeviceConfig(device="cpu"),
        load_config=LoadConfig(load_format="dummy"),
    )
    context = vllm_config.compilation_config.static_forward_context
    with (
        set_current_vllm_config(vllm_config),
        set_default_torch_dtype(model_config.dtype),
        torch.device("cpu"),
        pytest.MonkeyPatch.context() as patch,
    ):
        patch.setattr(activation.SiluAndMul, "__init__", _silu_and_mul_without_op)
        if v2:
            patch.setattr(VllmConfig, "use_v2_model_runner", property(lambda self: True))
        initialize_model(vllm_config=vllm_config)
        target = set(context)
        if mtp:  # as vLLM's speculator loads the drafter: the target's config, its model
            initialize_model(vllm_config=vllm_config, model_config=speculative.draft_model_config)
        Platform.update_block_size_for_backend(vllm_config)
    layers = {n: m for n, m in context.items() if isinstance(m, AttentionLayerBase)}
    specs = {name: layer.get_kv_cache_spec(vllm_config) for name, layer in layers.items()}
    return vllm_config, layers, specs, sorted(set(layers) - target)


def _pool(vllm_config, specs, memory: int):
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    (config,) = get_kv_cache_configs(vllm_config, [specs], [memory])
    return config


@pytest.mark.parametrize("prefix", [False, True], ids=["no-prefix", "prefix"])
def test_mtp_drafter_takes_the_aligned_kvarn_page(model_parallel, tmp_path, prefix):  # noqa: F811
    from kvarn_vllm.backend import BACKEND_NAME
    from kvarn_vllm.spec import spec_classes
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    config = {**QWEN3_NEXT, "num_nextn_predict_layers": 1}
    vllm_config, layers, specs, drafter = _build(
        tmp_path, config, "kvarn_k4v2_g128", prefix, mtp=True, v2=True
    )
    cache = vllm_config.cache_config
    assert cache.mamba_cache_mode == ("align" if prefix else "none")
    # One attention layer more: the MTP layer, on kvarn's backend, with the target's spec.
    (draft,) = [n for n in drafter if isinstance(specs[n], AttentionSpec)]
    assert draft.startswith("mtp.") and layers[draft].get_attn_backend().get_name() == BACKEND_NAME
    target = [n for n, s in specs.items() if isinstance(s, AttentionSpec) and n != draft]
    assert len(target) == 2
    assert isinstance(specs[draft], spec_classes()[0])
    assert all(specs[draft] == specs[n] for n in target)
    page = specs[draft].page_size_bytes
    assert specs[draft].block_size == cache.block_size and page == cache.mamba_page_size_padded
    # The recurrent states keep a block for the draft (vLLM's num_speculative_blocks).
    states = [s for s in specs.values() if isinstance(s, MambaSpec)]
    assert states and all(s.num_speculative_blocks == 1 for s in states)
    # vLLM plans one page for every group, the drafter in the target's attention group, and
    # the pool's tensors are that page: no padding of kvarn's pages, no rescaled block.
    kv = _pool(vllm_config, specs, 64 * page * 8)
    assert {g.kv_cache_spec.page_size_bytes for g in kv.kv_cache_groups} == {page}
    group = next(g for g in kv.kv_cache_groups if draft in g.layer_names)
    assert (
        set(target) <= set(group.layer_names) and group.kv_cache_spec.block_size == cache.block_size
    )
    assert all(t.size % page == 0 for t in kv.kv_cache_tensors)


def test_mtp_on_the_v1_runner_is_refused_naming_v2(model_parallel, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    config = {**QWEN3_NEXT, "num_nextn_predict_layers": 1}
    with pytest.raises(ValueError, match="drafts 'mtp' on vLLM's V2 model runner") as info:
        _build(tmp_path, config, "kvarn_k4v2_g128", False, mtp=True)
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in str(info.value)
    assert "kv_cache_dtype auto/fp8" in str(info.value)


def test_sliding_window_layers_of_a_hybrid_follow_the_dense_policy(model_parallel, tmp_path):  # noqa: F811
    from kvarn_math.layout import get_preset, tile_layout
    from kvarn_vllm.backend import BACKEND_NAME
    from kvarn_vllm.spec import spec_classes
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    config = {**NEMOTRON_H, "sliding_window": WINDOW}
    vllm_config, layers, specs, _ = _build(tmp_path, config, "kvarn_k4v2_g128", False)
    block = vllm_config.cache_config.block_size
    windows = {n: s for n, s in specs.items() if isinstance(s, SlidingWindowSpec)}
    states = [s for s in specs.values() if isinstance(s, MambaSpec)]
    assert len(windows) == 2 and len(states) == 4
    page = block // 128 * tile_layout(get_preset("kvarn_k4v2_g128"), 128).page_bytes(2)
    for name, spec in windows.items():
        # Quantized like a dense model's window layer: kvarn's backend and window spec, the
        # window in the kernels (the impl's), the hybrid block of whole tiles.
        layer = layers[name]
        assert layer.get_attn_backend().get_name() == BACKEND_NAME
        assert isinstance(spec, spec_classes()[1]) and spec.sliding_window == WINDOW
        assert layer.impl.sliding_window == WINDOW
        assert (spec.block_size, spec.page_size_bytes) == (block, page)
    assert all(s.page_size_bytes == page for s in states) and block % 128 == 0
    # One page for every group, the window layers in a group of the hybrid block.
    kv = _pool(vllm_config, specs, 64 * page * 8)
    assert {g.kv_cache_spec.page_size_bytes for g in kv.kv_cache_groups} == {page}
    group = next(g for g in kv.kv_cache_groups if set(windows) & set(g.layer_names))
    assert isinstance(group.kv_cache_spec, SlidingWindowSpec)
    assert group.kv_cache_spec.block_size == block


# vLLM 0.26/0.27's planner and layer specs (where kvarn's spec patch applies)
pytestmark = [_releases.needs("hybrid-block-size"), _releases.needs("kv-cache-spec")]
