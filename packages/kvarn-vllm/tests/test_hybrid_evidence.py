"""The hybrid GPU evidence script's arithmetic against vLLM 0.26's own planner, on the real
Nemotron-H-8B and Qwen3-Next-80B-A3B shapes (CPU: specs and planning only, no layers built).

``packages/kvarn-eval/scripts/hybrid_evidence.py`` sets each cache's measured capacity beside
what its pages give in the bf16 run's pool (:func:`arithmetic`). Here vLLM plans one pool of
the same bytes for bf16 and a kvarn preset, from specs made as the engine makes them (the
block alignment, kvarn's spec, the model's recurrent state), and the script's numbers must be
vLLM's: blocks per request, and the capacity in tokens to the token.

    python packages/kvarn-vllm/tests/test_hybrid_evidence.py   # prints the real shapes' pages
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import _releases
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "kvarn-eval" / "scripts" / "hybrid_evidence.py"
POOL_BYTES = 60 * 2**30  # a KV pool of 60 GiB, about what an 80 GB GPU leaves at 8B weights


def _script():
    spec = importlib.util.spec_from_file_location("hybrid_evidence", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plan(
    shape: str, cache: str, folder: Path, max_model_len: int = 32768, prefix: bool = False
) -> dict:
    """vLLM's plan of a :data:`POOL_BYTES` pool for ``shape`` with ``cache``: block size,
    page, blocks and capacity in tokens, as a GPU engine would compute them (FlashAttention's
    kernel blocks for bf16, kvarn's for a preset); ``prefix``: with prefix caching (vLLM's
    'all' or 'align' Mamba cache mode)."""
    from kvarn_vllm.backend import backend_class
    from kvarn_vllm.config import is_kvarn_dtype, parse_kv_cache_dtype
    from kvarn_vllm.spec import make_layer_spec
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity, get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    config = _script().SHAPES[shape]
    (folder / "config.json").write_text(json.dumps(config))
    model_config = ModelConfig(
        model=str(folder), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=max_model_len
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(cache_dtype=cache, enable_prefix_caching=prefix),
        device_config=DeviceConfig(device="cpu"),
    )
    # A GPU engine's step budget (vLLM's default on an H100 is 8,192 or more; this CPU's is
    # 2,048, under which Qwen3-Next's kvarn block is refused in the 'align' mode).
    vllm_config.scheduler_config.max_num_batched_tokens = 8192
    kvarn = is_kvarn_dtype(cache)
    backend = backend_class(cache) if kvarn else FlashAttentionBackend
    cache_config = vllm_config.cache_config
    cache_config.block_size = backend.get_preferred_block_size(16)  # phase 1 on a GPU
    Platform._align_hybrid_block_size(vllm_config, backend)  # phase 2 (kvarn's for presets)
    block = cache_config.block_size
    heads = model_config.get_num_kv_heads(vllm_config.parallel_config)
    head_dim = model_config.get_head_size()
    if kvarn:
        attention = make_layer_spec(
            parse_kv_cache_dtype(cache),
            block_size=block,
            num_kv_heads=heads,
            head_size=head_dim,
            head_size_v=head_dim,
            sliding_window=None,
            hybrid=True,
        )
    else:
        attention = FullAttentionSpec(
            block_size=block, num_kv_heads=heads, head_size=head_dim, dtype=model_config.dtype
        )
    model_cls, _ = ModelRegistry.resolve_model_cls(
        model_config.architecture, model_config=model_config
    )
    recurrent = MambaSpec(
        shapes=model_cls.get_mamba_state_shape_from_config(vllm_config),
        dtypes=model_cls.get_mamba_state_dtype_from_config(vllm_config),
        block_size=cache_config.mamba_block_size,
        page_size_padded=cache_config.mamba_page_size_padded,
    )
    num_attention, num_recurrent = _script().layer_counts(config)
    specs = {f"attn.{i}": attention for i in range(num_attention)}
    specs |= {f"mamba.{i}": recurrent for i in range(num_recurrent)}
    (kv_config,) = get_kv_cache_configs(vllm_config, [specs], [POOL_BYTES])
    tokens, _ = get_kv_cache_capacity(vllm_config, kv_config)
    return {
        "cache": cache,
        "block_size": block,
        "page_bytes": cache_config.mamba_page_size_padded,
        "state_bytes": replace_padding(recurrent),
        "num_gpu_blocks": kv_config.num_blocks,
        "kv_cache_tokens": tokens,
        "mamba_cache_mode": cache_config.mamba_cache_mode,
        "ok": True,
    }


def replace_padding(spec) -> int:
    from dataclasses import replace

    return replace(spec, page_size_padded=None).page_size_bytes


@pytest.mark.parametrize("shape", ["nemotron-h-8b", "qwen3-next-80b"])
def test_evidence_arithmetic_is_vllms(registered, tmp_path, shape):
    script = _script()
    runs = [plan(shape, cache, tmp_path) for cache in ("auto", "kvarn_k4v2_g128", "kvarn_k4v4_g64")]
    config = script.SHAPES[shape]
    script.arithmetic(runs, config, 32768)
    for run in runs:
        # The script's accounting is vLLM's: blocks per request give the tokens vLLM logs,
        # and the bf16 pool cut into this cache's pages gives its capacity (the pools differ
        # only by what each page size leaves over of the same bytes).
        blocks = run["num_gpu_blocks"]
        assert run["kv_cache_tokens"] == int(blocks / run["blocks_per_request"] * 32768), run
        assert run["measured_over_expected"] == pytest.approx(1, abs=1e-3), run
    bf16, k4v2, k4v4 = runs
    assert k4v2["block_size"] > k4v4["block_size"] > bf16["block_size"]
    # Pages differ only by each cache's rounding of one recurrent state.
    for run in runs:
        assert run["state_bytes"] <= run["page_bytes"] < run["state_bytes"] * 1.05
    # Capacity at 32K tokens per request: kvarn's blocks hold 3.6-4.9x bf16's tokens, but every
    # request also holds its recurrent states (the same bytes under every cache).
    assert 1.5 < k4v4["vs_first"] < k4v2["vs_first"] < 5
    assert k4v2["blocks_per_request"] < bf16["blocks_per_request"]


@pytest.mark.parametrize("shape", ["nemotron-h-8b", "qwen3-next-80b"])
def test_evidence_page_is_the_padded_state_page(registered, tmp_path, shape):
    """The page the script recomputes for each cache (the front-end process is not told the
    worker's padding) is the one vLLM's alignment pads the recurrent states to."""
    from kvarn_vllm.backend import backend_class
    from kvarn_vllm.hybrid import mamba_page_bytes
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionBackend

    script = _script()
    (tmp_path / "config.json").write_text(json.dumps(script.SHAPES[shape]))
    model_config = ModelConfig(
        model=str(tmp_path), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=8192
    )
    for cache in ("auto", "fp8", "turboquant_4bit_nc", "turboquant_k3v4_nc", "kvarn_k4v2_g64"):
        vllm_config = VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(cache_dtype=cache, enable_prefix_caching=False),
            device_config=DeviceConfig(device="cpu"),
        )
        backend = FlashAttentionBackend
        if cache.startswith("turboquant_"):
            backend = TurboQuantAttentionBackend
        elif cache.startswith("kvarn_"):
            backend = backend_class(cache)
        vllm_config.cache_config.block_size = backend.get_preferred_block_size(16)
        Platform._align_hybrid_block_size(vllm_config, backend)
        block = vllm_config.cache_config.block_size
        page = script.attention_page_bytes(cache, block, script.SHAPES[shape])
        # vLLM pads nothing when the page equals the state (fp8 at Qwen3-Next's shape).
        padded = vllm_config.cache_config.mamba_page_size_padded
        assert page == (padded or mamba_page_bytes(vllm_config)), (cache, block)


def main() -> None:
    """Print the real shapes' page arithmetic (the table in docs/serving.md)."""
    import tempfile

    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()
    import kvarn_vllm

    kvarn_vllm.register()
    script = _script()
    caches = ("auto", "kvarn_k4v2_g128", "kvarn_k4v4_g128", "kvarn_k4v2_g64", "kvarn_k4v4_g64")
    caches += ("kvarn_k3v2_g128", "kvarn_k2v2_g128")
    for shape in script.SHAPES:
        for max_model_len in (8192, 32768):
            with tempfile.TemporaryDirectory() as folder:
                runs = [plan(shape, c, Path(folder), max_model_len) for c in caches]
            script.arithmetic(runs, script.SHAPES[shape], max_model_len)
            for r in runs:
                print(
                    f"{shape} L={max_model_len} {r['cache']}: block {r['block_size']} "
                    f"page {r['page_bytes']:,} state {r['state_bytes']:,} "
                    f"blocks/request {r['blocks_per_request']} tokens {r['kv_cache_tokens']:,} "
                    f"x{r.get('vs_first')}"
                )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()


# hybrid models, where the release applies that entry: where the 'hybrid-block-size' ledger entry applies
# and vLLM 0.26/0.27's planner and layer specs (0.33's alignment: test_hybrid_v033.py,
# test_releases_adapters.py)
pytestmark = [_releases.needs("hybrid-block-size"), _releases.needs("kv-cache-spec")]
