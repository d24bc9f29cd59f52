"""kvarn_vllm.hybrid against vLLM 0.33's sources (run by 0.33's interpreter in a subprocess).

vLLM 0.33 aligns a hybrid model's blocks through the backend's ``customize_spec`` on a
one-token spec; a KVarN page has no whole bytes per token, so that path pads the recurrent
states to a page the attention layers do not have. Here the same small Nemotron-H and
Qwen3-Next configs as ``test_hybrid.py`` go through :func:`align_hybrid_block_size` (installed
by ``compat.wrap_hybrid_block_alignment``, as the ledger entry does) on 0.33: the attention
page in 0.33's terms (one state of ``G`` tokens per head, ``tile_bytes`` each) must equal the
padded state page, and 0.33's ``unify_kv_cache_spec_page_size`` must leave it alone.

Skipped where no vLLM 0.33 interpreter is found (``KVARN_V033_PYTHON``, default
``/work/venvs/v033/bin/python``); CI runs vLLM 0.26 only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

V033_PYTHON = os.environ.get("KVARN_V033_PYTHON", "/work/venvs/v033/bin/python")
PACKAGES = Path(__file__).resolve().parents[2]


def test_hybrid_alignment_on_vllm_033():
    import pytest
    from test_hybrid import FAMILIES

    if not Path(V033_PYTHON).exists():
        pytest.skip(f"no vLLM 0.33 interpreter at {V033_PYTHON} (KVARN_V033_PYTHON)")
    out = subprocess.run(
        [V033_PYTHON, __file__, json.dumps(FAMILIES)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "CUDA_VISIBLE_DEVICES": ""},
    )
    assert out.returncode == 0, out.stderr[-4000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(results) == 8, sorted(results)
    for key, r in results.items():
        assert r["version"].startswith("0.33"), r
        assert r["block"] % r["tile_tokens"] == 0 and r["block"] > r["tile_tokens"], (key, r)
        assert r["page"] == r["mamba_padded"] >= r["mamba_real"], (key, r)
        assert r["page"] - r["unit_page"] < r["mamba_real"], (key, r)
        assert r["unified_unchanged"] and r["unified_pages"] == [r["page"]], (key, r)
        if r["customize_spec_page"] is not None:  # the backend's own 0.33 page agrees
            assert r["customize_spec_page"] == r["page"], (key, r)


def _check(families: dict) -> dict:
    """Runs under vLLM 0.33: the alignment of each family, preset and cache mode."""
    import math
    import tempfile

    import torch
    import vllm
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()
    from kvarn_math.layout import get_preset, tile_layout
    from kvarn_vllm import compat
    from kvarn_vllm.backend import backend_class
    from kvarn_vllm.config import preset_names
    from kvarn_vllm.hybrid import align_hybrid_block_size, mamba_page_bytes
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.config.cache import get_kv_cache_dtype_handler, register_kv_cache_dtype
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms.interface import Platform
    from vllm.v1.core.kv_cache_planning import unify_kv_cache_spec_page_size
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, MambaSpec

    for name in preset_names():  # what the 0.33 adapter does through the public API
        if get_kv_cache_dtype_handler(name) is None:
            members = {
                "name": name,
                "torch_dtype": lambda self: torch.uint8,
                "quant_mode": lambda self: KVQuantMode.NONE,
            }
            register_kv_cache_dtype(name)(type("KvarnCacheDType", (), members))
    compat.wrap_hybrid_block_alignment(align_hybrid_block_size)
    results = {}
    for family, hf_config in families.items():
        folder = tempfile.mkdtemp()
        Path(folder, "config.json").write_text(json.dumps(hf_config))
        for preset in ("kvarn_k4v2_g128", "kvarn_k4v4_g64"):
            for prefix_caching in (False, True):
                model_config = ModelConfig(
                    model=folder, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=8192
                )
                vllm_config = VllmConfig(
                    model_config=model_config,
                    cache_config=CacheConfig(
                        cache_dtype=preset, enable_prefix_caching=prefix_caching
                    ),
                    scheduler_config=SchedulerConfig(
                        max_num_seqs=8,
                        max_num_batched_tokens=8192,
                        max_model_len=8192,
                        is_encoder_decoder=False,
                    ),
                    device_config=DeviceConfig(device="cpu"),
                )
                backend = backend_class(preset)
                cache = vllm_config.cache_config
                group = get_preset(preset).group_size
                cache.block_size = group  # phase 1: the backend's preferred block
                Platform._align_hybrid_block_size(vllm_config, backend)  # the wrapped one
                heads = model_config.get_num_kv_heads(vllm_config.parallel_config)
                layout = tile_layout(get_preset(preset), model_config.get_head_size())
                shape = dict(num_kv_heads=heads, head_size=layout.head_dim, dtype=torch.uint8)
                spec = FullAttentionSpec(
                    block_size=cache.block_size,
                    state_content_bytes=layout.tile_bytes,
                    tokens_per_state=group,
                    **shape,
                )
                custom = getattr(backend, "customize_spec", None)
                custom_page = (
                    None
                    if custom is None
                    else custom(
                        FullAttentionSpec(block_size=cache.block_size, **shape)
                    ).page_size_bytes
                )
                model_cls, _ = ModelRegistry.resolve_model_cls(
                    model_config.architecture, model_config=model_config
                )
                mamba = MambaSpec(
                    shapes=model_cls.get_mamba_state_shape_from_config(vllm_config),
                    dtypes=model_cls.get_mamba_state_dtype_from_config(vllm_config),
                    block_size=cache.mamba_block_size or cache.block_size,
                    page_size_padded=cache.mamba_page_size_padded,
                )
                unified = unify_kv_cache_spec_page_size({"attn": spec, "mamba": mamba})
                unit = group
                if cache.mamba_cache_mode == "all":
                    unit = math.lcm(group, model_config.get_mamba_chunk_size())
                key = f"{family}/{preset}/{'prefix' if prefix_caching else 'no-prefix'}"
                results[key] = dict(
                    version=vllm.__version__,
                    mode=cache.mamba_cache_mode,
                    tile_tokens=group,
                    block=cache.block_size,
                    page=spec.page_size_bytes,
                    unit_page=unit // group * heads * layout.tile_bytes,
                    customize_spec_page=custom_page,
                    mamba_padded=cache.mamba_page_size_padded,
                    mamba_real=mamba_page_bytes(vllm_config),
                    unified_unchanged=unified["attn"] == spec,
                    unified_pages=sorted({s.page_size_bytes for s in unified.values()}),
                )
    return results


if __name__ == "__main__":
    sys.path[:0] = [
        str(PACKAGES / p / "src") for p in ("kvarn-vllm", "kvarn-math", "kvarn-kernels")
    ]
    print(json.dumps(_check(json.loads(sys.argv[1]))))
