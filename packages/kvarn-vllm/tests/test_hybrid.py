"""Hybrid models over a KVarN cache: the real vLLM 0.26 layers and KV cache specs of small
Nemotron-H (Mamba-2, head_dim 128) and Qwen3-Next (gated delta net, head_dim 256) configs.

No weights and no kernels: each test builds the model's layers on the CPU, runs vLLM's block
size update (whose hybrid alignment kvarn-vllm computes from the tile), takes every layer's
spec and plans the pool the way the engine does. The page arithmetic must hold exactly:
attention pages of whole tiles, recurrent states padded to them, one page for every group,
and the bytes saved showing up as more tokens per block and per request.
"""

from __future__ import annotations

import json
import math
import socket
from dataclasses import replace

import _releases
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvarn_vllm.hybrid import (
    hybrid_page_mismatch,
    mamba_page_bytes,
    plan_hybrid_block,
    tile_page_bytes,
)

# Small configs of the two families' shapes: head_dim, KV heads and the layer pattern of the
# real models (Nemotron-H-8B: Mamba-2, attention, MLP layers, head_dim 128; Qwen3-Next-80B-A3B:
# three gated-delta-net layers per full-attention layer, 2 KV heads of 256), with narrow
# layers so that building them on the CPU is quick. Recurrent states of 0.3-1.1 MB per layer
# need several tiles per block, as the real models' 1.1-4.3 MB do.
NEMOTRON_H = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 8,
    "hybrid_override_pattern": "M-M*M-M*",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "mamba_num_heads": 32,
    "mamba_head_dim": 64,
    "ssm_state_size": 64,
    "n_groups": 2,
    "conv_kernel": 4,
    "expand": 2,
    "chunk_size": 128,
    "vocab_size": 1024,
    "max_position_embeddings": 8192,
    "mlp_hidden_act": "relu2",
    "mamba_hidden_act": "silu",
    "layer_norm_epsilon": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 8,
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "vocab_size": 1024,
    "max_position_embeddings": 8192,
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000000,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
FAMILIES = {"nemotron_h": NEMOTRON_H, "qwen3_next": QWEN3_NEXT}
MAX_MODEL_LEN = 8192


@pytest.fixture(scope="module")
def model_parallel(registered):
    """vLLM's tensor-parallel group of one CPU process (gloo), which model layers read."""
    from vllm.config import VllmConfig
    from vllm.config.vllm import set_current_vllm_config
    from vllm.distributed import parallel_state

    if parallel_state._TP is not None:  # another module of this session set it up
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        parallel_state.init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=0,
            backend="gloo",
        )
        parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = {}
    for name, config in FAMILIES.items():
        folder = tmp_path_factory.mktemp(name)
        (folder / "config.json").write_text(json.dumps(config))
        dirs[name] = str(folder)
    return dirs


def _silu_and_mul_without_op(self, *, compile_native: bool = True) -> None:
    from vllm.model_executor.layers.activation import SiluAndMul

    super(SiluAndMul, self).__init__(compile_native=compile_native)


def _build(
    model_dir: str,
    cache_dtype: str,
    prefix_caching: bool,
    align: bool = True,
    max_num_batched_tokens: int = MAX_MODEL_LEN,
):
    """The layers of the model, its block size updated as a worker does, and every layer's
    spec: ``(vllm_config, {layer name: layer}, {layer name: spec})``."""
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        LoadConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.config.vllm import set_current_vllm_config
    from vllm.model_executor.layers import activation
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.platforms.interface import Platform
    from vllm.utils.torch_utils import set_default_torch_dtype

    model_config = ModelConfig(
        model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=MAX_MODEL_LEN
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(cache_dtype=cache_dtype, enable_prefix_caching=prefix_caching),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=MAX_MODEL_LEN,
            is_encoder_decoder=False,
            enable_chunked_prefill=True,
        ),
        device_config=DeviceConfig(device="cpu"),
        load_config=LoadConfig(load_format="dummy"),
    )
    with (
        set_current_vllm_config(vllm_config),
        set_default_torch_dtype(model_config.dtype),
        torch.device("cpu"),
        pytest.MonkeyPatch.context() as patch,
    ):
        # SiluAndMul binds vLLM's compiled op at construction, which this CPU install lacks;
        # no forward runs here, so the MLPs of Qwen3-Next go without it.
        patch.setattr(activation.SiluAndMul, "__init__", _silu_and_mul_without_op)
        initialize_model(vllm_config=vllm_config)
    if align:
        # What every GPU worker runs after building the model (CUDA's platform inherits it).
        Platform.update_block_size_for_backend(vllm_config)
    layers = {
        name: layer
        for name, layer in vllm_config.compilation_config.static_forward_context.items()
        if isinstance(layer, AttentionLayerBase)
    }
    specs = {name: layer.get_kv_cache_spec(vllm_config) for name, layer in layers.items()}
    return vllm_config, layers, specs


def _capacity(vllm_config, specs, memory: int) -> tuple[int, int]:
    """``(num_blocks, tokens)`` of a pool of ``memory`` bytes, planned as the engine core
    plans it (tokens: concurrency at max_model_len times max_model_len)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity, get_kv_cache_configs

    (config,) = get_kv_cache_configs(vllm_config, [specs], [memory])
    return config.num_blocks, get_kv_cache_capacity(vllm_config, config)[0]


# --- the arithmetic alone ------------------------------------------------------------------


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    tile_tokens=st.sampled_from([64, 128]),
    tile_page=st.integers(1_000, 200_000),
    mamba_page=st.integers(1, 10_000_000),
    alignment=st.sampled_from([1, 16, 64, 128, 256]),
    chunk_size=st.sampled_from([None, 128, 256]),
    min_block_size=st.integers(0, 4096),
)
def test_plan_is_the_smallest_aligned_block_covering_a_state(
    tile_tokens, tile_page, mamba_page, alignment, chunk_size, min_block_size
):
    plan = plan_hybrid_block(
        tile_tokens=tile_tokens,
        tile_page=tile_page,
        mamba_page=mamba_page,
        alignment=alignment,
        chunk_size=chunk_size,
        min_block_size=min_block_size,
    )
    unit = math.lcm(tile_tokens, alignment, chunk_size or 1)
    assert plan.block_size % unit == 0 and plan.block_size >= max(min_block_size, 1)
    assert plan.attention_page_bytes == plan.block_size // tile_tokens * tile_page
    assert plan.attention_page_bytes >= mamba_page
    smaller = plan.block_size - unit
    # One unit less would either not hold a state or fall under the block vLLM already had.
    assert smaller < max(min_block_size, 1) or smaller // tile_tokens * tile_page < mamba_page
    assert plan.mamba_padding_bytes == plan.attention_page_bytes - mamba_page


def test_plan_names_a_bad_size():
    with pytest.raises(ValueError, match="mamba_page must be >= 1, got 0"):
        plan_hybrid_block(tile_tokens=128, tile_page=1000, mamba_page=0)
    with pytest.raises(ValueError, match="num_kv_heads must be >= 1, got 0"):
        tile_page_bytes("kvarn_k4v2_g128", 0, 128)


# --- real layers and specs, one test per family ----------------------------------------------


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix", "prefix"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hybrid_pages_follow_the_tile(model_parallel, model_dirs, family, prefix_caching):
    from kvarn_math.layout import get_preset, tile_layout
    from kvarn_vllm.backend import BACKEND_NAME
    from kvarn_vllm.spec import spec_classes
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    bf16, _, bf16_specs = _build(model_dirs[family], "auto", prefix_caching)
    bf16_page = next(iter(bf16_specs.values())).page_size_bytes
    bf16_block = bf16.cache_config.block_size
    memory = 64 * bf16_page * 8  # a pool of some 64 blocks per layer slot
    bf16_blocks, bf16_tokens = _capacity(bf16, bf16_specs, memory)
    bf16_groups = get_kv_cache_groups(bf16, bf16_specs)
    bf16_attention = {n for n, s in bf16_specs.items() if isinstance(s, AttentionSpec)}
    bf16_per_request = _blocks_per_request(bf16, bf16_groups, bf16_attention, bf16_block)
    assert bf16_tokens == int(bf16_blocks / bf16_per_request * MAX_MODEL_LEN)
    for preset in ("kvarn_k4v2_g128", "kvarn_k4v4_g64"):
        vllm_config, layers, specs = _build(model_dirs[family], preset, prefix_caching)
        cache = vllm_config.cache_config
        attention = {n: s for n, s in specs.items() if isinstance(s, AttentionSpec)}
        recurrent = {n: s for n, s in specs.items() if isinstance(s, MambaSpec)}
        assert len(attention) == 2 and len(recurrent) in (4, 6), (family, sorted(specs))
        # Only the attention layers are kvarn's; the recurrent ones keep vLLM's backends.
        for name, layer in layers.items():
            is_kvarn = layer.get_attn_backend().get_name() == BACKEND_NAME
            assert is_kvarn == (name in attention), name
        group = get_preset(preset).group_size
        layout = tile_layout(get_preset(preset), attention[next(iter(attention))].head_size)
        block = cache.block_size
        assert block % group == 0 and block > group
        page = block // group * layout.page_bytes(2)
        for spec in attention.values():
            assert isinstance(spec, spec_classes()[0]) and spec.kvarn_preset == preset
            assert (spec.block_size, spec.page_size_bytes) == (block, page)
        state = mamba_page_bytes(vllm_config)
        for spec in recurrent.values():
            assert spec.page_size_bytes == page == cache.mamba_page_size_padded
            assert replace(spec, page_size_padded=None).page_size_bytes == state
        # The page is the fewest whole tiles (in the mamba chunk, in 'all' mode) that hold a state.
        unit = group
        if cache.mamba_cache_mode == "all":
            unit = math.lcm(group, vllm_config.model_config.get_mamba_chunk_size())
            assert cache.mamba_block_size == block
        assert page >= state > page - unit // group * layout.page_bytes(2)
        # One page for every group: vLLM plans the pool without rescaling or padding kvarn's.
        groups = get_kv_cache_groups(vllm_config, specs)
        assert {g.kv_cache_spec.page_size_bytes for g in groups} == {page}
        assert {g.kv_cache_spec.block_size for g in groups if g.layer_names[0] in attention} == {
            block
        }
        # Tokens per block: the state's bytes at the tile's bytes per token, against bf16's.
        bytes_ratio = bf16_page / bf16_block / (layout.page_bytes(2) / group)
        # Both pages are one state rounded up to their alignment, so the blocks differ by the
        # bytes ratio (3.6-4.9x) times the two roundings.
        assert block / bf16_block == pytest.approx(bytes_ratio * page / bf16_page, rel=1e-9)
        assert page / bf16_page == pytest.approx(1, abs=0.25)
        # The same memory holds more tokens: a request takes fewer blocks of about the same
        # bytes (vLLM's accounting: concurrency = blocks / blocks per request).
        num_blocks, tokens = _capacity(vllm_config, specs, memory)
        per_request = _blocks_per_request(vllm_config, groups, attention, block)
        assert tokens == int(num_blocks / per_request * MAX_MODEL_LEN)
        assert per_request < bf16_per_request
        gain = bf16_per_request / per_request * bf16_page / page
        assert tokens / bf16_tokens == pytest.approx(gain, rel=0.02)


def _blocks_per_request(vllm_config, groups, attention, block: int) -> int:
    """Blocks of the pool one request of max_model_len tokens takes, by vLLM's accounting:
    its attention blocks plus its recurrent-state blocks (1 in 'none' mode, 2 in 'align', one
    per block of tokens in 'all')."""
    mode = vllm_config.cache_config.mamba_cache_mode
    per_state = {"none": 1, "align": 2}.get(mode, math.ceil(MAX_MODEL_LEN / block))
    return sum(
        math.ceil(MAX_MODEL_LEN / block) if g.layer_names[0] in attention else per_state
        for g in groups
    )


def test_unaligned_hybrid_page_is_refused_naming_the_layer(model_parallel, model_dirs):
    """Without the alignment (a platform that skips or overrides vLLM's) the attention page
    cannot match the recurrent states: the spec is refused at start-up, naming the layer and
    the reason, rather than vLLM padding kvarn's pages back to the state's size."""
    import re

    from kvarn_math.layout import get_preset, tile_layout

    vllm_config, layers, _ = _build(model_dirs["nemotron_h"], "kvarn_k4v2_g128", False)
    name = next(n for n, layer in layers.items() if n.endswith(".attn"))
    cache = vllm_config.cache_config
    aligned = cache.mamba_page_size_padded
    cache.mamba_page_size_padded = aligned - 1
    with pytest.raises(ValueError, match=re.escape(f"attention layer {name!r}")) as info:
        layers[name].get_kv_cache_spec(vllm_config)
    assert f"differs from the {aligned - 1:,} bytes" in str(info.value)
    cache.mamba_page_size_padded = None
    cache.block_size = 128
    with pytest.raises(ValueError, match="hybrid block alignment .* has not run"):
        layers[name].get_kv_cache_spec(vllm_config)
    page = tile_layout(get_preset("kvarn_k4v2_g128"), 128).page_bytes(2)
    assert hybrid_page_mismatch(vllm_config, page) is not None
    cache.mamba_page_size_padded = page
    assert hybrid_page_mismatch(vllm_config, page) is None


def test_hybrid_sliding_window_layers_follow_the_dense_policy():
    """A hybrid's sliding-window attention layers get kvarn's sliding-window spec with the
    hybrid block (whole tiles), as dense models' do with one tile."""
    from kvarn_vllm.config import parse_kv_cache_dtype
    from kvarn_vllm.spec import make_layer_spec, spec_classes

    config = parse_kv_cache_dtype("kvarn_k4v2_g64")
    shape = dict(num_kv_heads=2, head_size=128, head_size_v=128, sliding_window=512)
    spec = make_layer_spec(config, block_size=640, hybrid=True, **shape)
    assert isinstance(spec, spec_classes()[1]) and spec.block_size == 640
    assert (
        spec.page_size_bytes == 10 * make_layer_spec(config, block_size=64, **shape).page_size_bytes
    )
    with pytest.raises(ValueError, match="multiple of the kvarn_k4v2_g64 tile .* got 96"):
        make_layer_spec(config, block_size=96, hybrid=True, **shape)
    with pytest.raises(ValueError, match="must equal the kvarn_k4v2_g64 tile size 64"):
        make_layer_spec(config, block_size=640, **shape)


def test_align_mode_block_over_the_step_budget_is_refused(model_parallel, model_dirs):
    """Qwen3-Next caches recurrent states in vLLM's 'align' mode under prefix caching, which
    schedules whole blocks: a kvarn block longer than a step's token budget is a start-up
    error naming the block, the budget and both ways out (vLLM would stop on an assertion)."""
    bf16, _, _ = _build(model_dirs["qwen3_next"], "auto", True, max_num_batched_tokens=512)
    assert bf16.cache_config.mamba_cache_mode == "align"
    assert bf16.cache_config.block_size <= 512  # bf16's block fits the budget
    with pytest.raises(ValueError, match=r"takes (\d+) tokens of this cache") as info:
        _build(model_dirs["qwen3_next"], "kvarn_k4v2_g128", True, max_num_batched_tokens=512)
    message = str(info.value)
    assert "max_num_batched_tokens is 512" in message
    assert "--max-num-batched-tokens" in message and "--no-enable-prefix-caching" in message


# hybrid models, where the release applies that entry: where the 'hybrid-block-size' ledger entry applies
# and vLLM 0.26/0.27's planner and layer specs (0.33's alignment: test_hybrid_v033.py,
# test_releases_adapters.py)
pytestmark = [_releases.needs("hybrid-block-size"), _releases.needs("kv-cache-spec")]
