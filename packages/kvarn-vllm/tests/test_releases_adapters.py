"""The adapters of :mod:`kvarn_vllm.releases`, release by release.

Which adapter each vLLM release from 0.26 to 0.34 gets, which ledger entries it applies, and
what it refuses at start-up, from configurations shaped like vLLM's (no engine, any
installed release). Where vLLM 0.33 is installed (``nox -s "vllm_release(0.33.0)"``), the
hybrid alignment and the layer views it leads to, against 0.33's own code.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kvarn_vllm import releases

ALL_ENTRIES = {
    "kv-cache-dtype-values",
    "default-max-num-seqs",
    "backend-selection",
    "kv-cache-spec",
    "hybrid-block-size",
    "request-rows",
    "request-ids-v1",
    "draft-steps",
    "dflash-context-store",
}
# Entries every adapter applies; and each one's own (the MLA entry is 0.26's alone).
COMMON = {"default-max-num-seqs", "backend-selection", "request-rows", "request-ids-v1"}
LEDGERS = {
    "vllm-0.26": ALL_ENTRIES | {"mla-kv-cache-spec"},
    "vllm-0.27": ALL_ENTRIES,
    "vllm-0.29": COMMON | {"kv-cache-dtype-values"},
    "vllm-0.33": COMMON | {"hybrid-block-size"},
}


@pytest.mark.parametrize(
    ("version", "adapter"),
    [
        ("0.25.1", None),
        ("0.26.0", "vllm-0.26"),
        ("0.27.0", "vllm-0.27"),
        ("0.27.1", "vllm-0.27"),
        ("0.28.0", None),
        ("0.29.0", "vllm-0.29"),
        ("0.30.0", "vllm-0.29"),
        ("0.31.0", "vllm-0.29"),
        ("0.32.0", "vllm-0.29"),
        ("0.33.0", "vllm-0.33"),
        ("0.34.0", None),
    ],
)
def test_each_release_gets_its_adapter(version, adapter):
    found = releases.current(version)
    assert (found and found.name) == adapter


def test_each_adapter_applies_its_ledger():
    """The ledger's releases fields give each adapter exactly its entries."""
    assert {a.name: set(a.patches) for a in releases.ADAPTERS} == LEDGERS


def test_a_release_inside_the_range_says_why_it_is_not_served():
    message = releases.unsupported_message("0.28.0")
    assert "found vLLM 0.28.0 (vLLM 0.28 sizes pages" in message
    assert "tokens_per_state" in message and "get_kv_cache_shape" in message
    assert "0.27.x, 0.29.x" in message
    for series in releases.NOT_SERVED:
        assert releases.current("{}.{}.0".format(*series)) is None


def _config(method=None, v2=False, skip=(), hybrid=False, modules=1):
    """A VllmConfig's fields the adapters read."""
    spec = None
    if method is not None:
        spec = SimpleNamespace(method=method, use_multi_module_mtp=lambda: modules > 1)
    return SimpleNamespace(
        speculative_config=spec,
        use_v2_model_runner=v2,
        cache_config=SimpleNamespace(kv_cache_dtype_skip_layers=list(skip)),
        model_config=SimpleNamespace(is_hybrid=hybrid),
    )


DRAFTER = "_build_attn_metadata(step=...)"
CASES = [
    # (configuration, {adapter: the words its refusal must contain, or None: served})
    (_config(), {"vllm-0.26": None, "vllm-0.27": None, "vllm-0.29": None, "vllm-0.33": None}),
    (
        _config("eagle", v2=True),
        {"vllm-0.26": None, "vllm-0.27": None, "vllm-0.29": DRAFTER, "vllm-0.33": DRAFTER},
    ),
    (
        _config("mtp", v2=True, modules=2),
        {
            "vllm-0.26": None,
            "vllm-0.27": "multi-module MTP",
            "vllm-0.29": DRAFTER,
            "vllm-0.33": DRAFTER,
        },
    ),
    (_config("mtp", v2=True), {"vllm-0.27": None, "vllm-0.33": DRAFTER}),
    (_config("dflash", v2=True), {"vllm-0.27": None, "vllm-0.29": DRAFTER}),
    (_config("ngram"), {"vllm-0.26": None, "vllm-0.29": None, "vllm-0.33": None}),
    (_config("ngram_gpu"), {"vllm-0.33": None}),
    (
        _config("ngram", v2=True),
        {"vllm-0.29": "VLLM_USE_V2_MODEL_RUNNER=0", "vllm-0.33": "VLLM_USE_V2_MODEL_RUNNER=0"},
    ),
    (
        _config(skip=["model.layers.0"]),
        {
            "vllm-0.26": None,  # 0.26/0.27: the kv-cache-spec entry refuses it per layer
            "vllm-0.29": "--kv-cache-dtype-skip-layers",
            "vllm-0.33": "--kv-cache-dtype-skip-layers",
        },
    ),
    (
        _config(hybrid=True),
        {"vllm-0.27": None, "vllm-0.29": "hybrid (Mamba/linear-attention)", "vllm-0.33": None},
    ),
]


@pytest.mark.parametrize(("config", "expected"), CASES)
def test_start_up_refusals_by_release(config, expected):
    """What each adapter refuses (the backend selection raises with it, naming the layer)
    and what it serves; every refusal says where the feature is served, or why nowhere."""
    adapters = {a.name: a for a in releases.ADAPTERS}
    for name, words in expected.items():
        reasons = adapters[name].unserved(config)
        if words is None:
            assert reasons == [], (name, reasons)
        else:
            assert len(reasons) == 1 and words in reasons[0], (name, reasons)
            assert "served" in reasons[0].lower(), reasons[0]


on_033 = pytest.mark.skipif(
    releases.current() is not releases.VLLM_033, reason="vLLM 0.33's planner and views"
)


@on_033
def test_hybrid_alignment_against_033(registered):
    """kvarn's alignment (ledger entry hybrid-block-size) on vLLM 0.33's Platform: the
    Nemotron-H and Qwen3-Next configs of test_hybrid get blocks of whole tiles whose page is
    the padded recurrent-state page, which 0.33's page unification leaves alone."""
    from test_hybrid import FAMILIES
    from test_hybrid_v033 import _check

    results = _check(FAMILIES)
    assert len(results) == 8, sorted(results)
    for key, r in results.items():
        assert r["block"] % r["tile_tokens"] == 0 and r["block"] > r["tile_tokens"], (key, r)
        assert r["page"] == r["mamba_padded"] >= r["mamba_real"], (key, r)
        assert r["unified_unchanged"] and r["unified_pages"] == [r["page"]], (key, r)
        assert r["customize_spec_page"] == r["page"], (key, r)


@on_033
@pytest.mark.parametrize("tiles", [1, 4])
def test_hybrid_block_views_are_tile_records_on_033(tiles):
    """A block of ``tiles`` tiles (a hybrid model's) in 0.33's views: vLLM splits it into
    kernel blocks of one tile (the backend's only kernel block size), so every layout the
    backend declares gives kvarn ``[blocks * tiles, heads, tile_bytes]`` contiguous records."""
    import torch
    from kvarn_math.layout import tile_layout
    from kvarn_vllm import compat
    from kvarn_vllm.backend import backend_class
    from kvarn_vllm.config import parse_kv_cache_dtype
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        create_kv_cache_views,
    )

    config = parse_kv_cache_dtype("kvarn_k4v2_g128")
    backend = backend_class(config.name)
    heads, head_dim, group, blocks = 2, 128, config.preset.group_size, 3
    plain = FullAttentionSpec(
        block_size=tiles * group, num_kv_heads=heads, head_size=head_dim, dtype=torch.uint8
    )
    spec = backend.customize_spec(plain)
    tile = tile_layout(config.preset, head_dim).tile_bytes
    assert spec.page_size_bytes == tiles * heads * tile
    (kernel_block,) = backend.get_supported_kernel_block_sizes(spec)
    for layout in backend.supported_kv_cache_layouts():
        page = spec.page_size_bytes
        raw = torch.arange(page * blocks, dtype=torch.int32).to(torch.int8)
        tensor = KVCacheTensor(
            size=raw.numel(), layers=["layer"], layer_stride=page * blocks, block_stride=page
        )
        (view,) = create_kv_cache_views(raw, spec, blocks, layout, tensor, kernel_block)
        records = compat.cache_records(view)
        assert tuple(records.shape) == (blocks * tiles, heads, tile), layout
        assert records.is_contiguous(), (layout, records.stride())
        assert records.data_ptr() == raw.data_ptr()
