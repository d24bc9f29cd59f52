"""Never breaking vLLM: the plugin on releases it does not serve, and on unexpected errors.

vLLM calls every general plugin in every process without catching its errors, so these run
``vllm.plugins.load_general_plugins()`` itself, each in a fresh interpreter (registration is
once per process, and this session's conftest already registered the plugin).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import _releases
import pytest
import torch
from kvarn_vllm import releases

# Common prologue: vLLM's CPU platform (this host has no GPU vLLM recognizes), a handler
# counting the plugin's log records, and a snapshot of everything the plugin may change.
_PROLOGUE = """
import logging
import vllm.platforms as P
from vllm.platforms.cpu import CpuPlatform
P._current_platform = CpuPlatform()

records = []
class _Keep(logging.Handler):
    def emit(self, record):
        records.append(record)
logging.getLogger("vllm.kvarn").addHandler(_Keep(level=logging.DEBUG))

from kvarn_vllm import plugin, releases

def snapshot():
    from vllm.config import cache
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.utils import torch_utils
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.engine.arg_utils import EngineArgs
    try:
        custom = AttentionBackendEnum.CUSTOM.get_path()
    except ValueError:
        custom = None
    return (
        selector._cached_get_attn_backend,
        Attention.get_kv_cache_spec,
        EngineArgs._set_default_max_num_seqs_and_batched_tokens_args,
        tuple(cache.CacheDType.__args__),
        tuple(getattr(cache, "KV_CACHE_DTYPES", ())),
        dict(torch_utils.STR_DTYPE_TO_TORCH_DTYPE),
        custom,
    )

def configs_still_build():
    from vllm.config import CacheConfig
    from vllm.engine.arg_utils import EngineArgs
    for dtype in ("auto", "fp8", "bfloat16"):
        assert CacheConfig(cache_dtype=dtype).cache_dtype == dtype
    EngineArgs(model="facebook/opt-125m", kv_cache_dtype="auto")

def load_plugins_afresh():
    # What a new vLLM process does: load and call every general plugin.
    import vllm.plugins

    plugin._attempted = plugin._done = False
    vllm.plugins.plugins_loaded = False
    vllm.plugins.load_general_plugins()
"""


def test_plugin_never_breaks_vllm():
    """In one fresh interpreter (importing vLLM costs a minute on a loaded 2-core CI host),
    as each new vLLM process would see it:

    * a bug in registration: load_general_plugins() returns, the error is logged once with
      its traceback, vLLM is unchanged and its configs build;
    * releases no adapter covers (older, 0.28 inside the range, newer): one warning naming the
      installed and the served releases, nothing changed, every other dtype builds, vLLM
      refuses kvarn_*;
    * the installed release: loads without a warning when served and kvarn_* then builds.
    """
    code = _PROLOGUE + textwrap.dedent(_SCENARIOS) + "\nprint('OK')\n"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"},
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert out.stdout.strip().endswith("OK")


_SCENARIOS = """
def of_level(level):
    return [r for r in records if r.levelno == level]

# 1. An unexpected error inside register().
adapter = releases.current()
pristine = snapshot()
if adapter is not None:
    original_public = adapter.register_public
    def boom():
        raise RuntimeError("simulated registration bug")
    object.__setattr__(adapter, "register_public", boom)
    load_plugins_afresh()
    assert not plugin.registered()
    errors = of_level(logging.ERROR)
    assert len(errors) == 1 and errors[0].exc_info is not None, errors
    assert "simulated registration bug" in str(errors[0].exc_info[1])
    assert snapshot() == pristine, "a failed registration left vLLM changed"
    configs_still_build()
    object.__setattr__(adapter, "register_public", original_public)
    records.clear()

# 2. Releases no adapter covers.
installed = releases.vllm_version
for version in ("0.25.1", "0.28.0", "0.99.0"):
    releases.vllm_version = lambda: version
    load_plugins_afresh()
    plugin.register()  # a second entry point in the same process stays silent
    assert not plugin.registered()
    assert snapshot() == pristine, f"the plugin changed vLLM on {version}"
    warnings = of_level(logging.WARNING)
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    assert version in message and releases.supported_releases() in message, message
    assert not of_level(logging.ERROR)
    configs_still_build()
    from vllm.config import CacheConfig
    try:
        CacheConfig(cache_dtype="kvarn_k4v2_g128")
    except Exception as exc:
        assert "kvarn_k4v2_g128" in str(exc), exc
    else:
        raise AssertionError(f"vLLM accepted kvarn_k4v2_g128 with the plugin off ({version})")
    records.clear()
releases.vllm_version = installed

# 3. The installed release.
load_plugins_afresh()
served = releases.current() is not None
assert plugin.registered() == served
assert len(of_level(logging.WARNING)) == (0 if served else 1)
assert not of_level(logging.ERROR), [r.getMessage() for r in of_level(logging.ERROR)]
configs_still_build()
if served:
    from vllm.config import CacheConfig
    assert CacheConfig(cache_dtype="kvarn_k4v2_g128").cache_dtype == "kvarn_k4v2_g128"
"""


@pytest.mark.parametrize(
    ("version", "parsed"),
    [
        ("0.26.0", (0, 26, 0)),
        ("0.26.2.dev5+gabc", (0, 26, 2)),
        ("0.26.0rc1", (0, 26, 0)),
        ("0.33.1", (0, 33, 1)),
        ("1.0", (1, 0, 0)),
    ],
)
def test_parse_version(version, parsed):
    assert releases.parse_version(version) == parsed


@pytest.mark.parametrize("version", ["0.25.1", "0.28.0", "0.34.0", "1.0.0", "0.9.26"])
def test_no_adapter_outside_the_served_series(version):
    assert releases.current(version) is None
    with pytest.raises(releases.UnsupportedVllmVersion, match=version.replace(".", r"\.")):
        releases.check_supported(version)


def _attention_layer(vllm_config, head_dim, num_kv_heads, sliding_window=None):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention

    torch.set_default_dtype(torch.float16)
    try:
        with set_current_vllm_config(vllm_config):
            return Attention(
                num_heads=2 * num_kv_heads,
                head_size=head_dim,
                scale=head_dim**-0.5,
                num_kv_heads=num_kv_heads,
                cache_config=vllm_config.cache_config,
                per_layer_sliding_window=sliding_window,
                prefix="model.layers.0.self_attn.attn",
            )
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize(
    ("preset", "head_dim", "sliding_window"),
    [("kvarn_k4v2_g128", 128, None), ("kvarn_k2v2_g128", 64, None), ("kvarn_k4v2_g64", 128, 256)],
)
def test_layer_spec_and_cache_follow_the_tile_layout(
    vllm_config_factory, preset, head_dim, sliding_window
):
    """On the installed release, a kvarn layer gets the kvarn backend, a spec whose page is
    num_kv_heads tile records, and a cache vLLM's way that kvarn views as records, each
    block's records one contiguous page."""
    from kvarn_math.layout import tile_layout
    from kvarn_vllm.backend import backend_class
    from kvarn_vllm.config import parse_kv_cache_dtype

    config = parse_kv_cache_dtype(preset)
    vc = vllm_config_factory(preset)
    vc.cache_config.block_size = config.block_size
    layer = _attention_layer(vc, head_dim, num_kv_heads=2, sliding_window=sliding_window)
    assert layer.attn_backend is backend_class(preset)
    spec = _releases.worker_spec(layer, vc)
    expected = "KvarnSlidingWindowSpec" if sliding_window else "KvarnFullAttentionSpec"
    assert type(spec).__name__ == expected and spec.kvarn_preset == preset
    tile = tile_layout(config.preset, head_dim).tile_bytes
    assert spec.dtype is torch.uint8 and spec.block_size == config.block_size
    assert spec.page_size_bytes == 2 * tile
    cache = _releases.layer_cache(layer.attn_backend, spec, num_blocks=3)
    recs = _releases.records(cache)
    assert tuple(recs.shape) == (3, 2, tile) and recs.dtype in (torch.uint8, torch.int8)
    assert recs.stride() == (2 * tile, tile, 1)


@pytest.mark.skipif(
    releases.current() is not releases.VLLM_033, reason="vLLM 0.33's public dtype registry"
)
def test_presets_through_the_public_registry_on_033(registered):
    """On 0.33 the presets are registered through register_kv_cache_dtype (no Literal patch):
    vLLM's CLI and CacheConfig accept them, storage is uint8, kvarn's quant mode is NONE, and
    an unknown kvarn_* name is refused by CacheConfig with the name in the message."""
    from kvarn_math.layout import PRESETS
    from pydantic import ValidationError
    from vllm.config import CacheConfig
    from vllm.config.cache import KV_CACHE_DTYPES, get_kv_cache_dtype_handler
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.kv_cache_interface import KVQuantMode, get_kv_quant_mode

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    for name in PRESETS:
        assert KV_CACHE_DTYPES.count(name) == 1
        assert get_kv_cache_dtype_handler(name).name == name
        assert STR_DTYPE_TO_TORCH_DTYPE[name] is torch.uint8
        assert get_kv_quant_mode(name) is KVQuantMode.NONE
        assert parser.parse_args(["--kv-cache-dtype", name]).kv_cache_dtype == name
        assert CacheConfig(cache_dtype=name).cache_dtype == name
    with pytest.raises(ValidationError, match="kvarn_k9v9_g128"):
        CacheConfig(cache_dtype="kvarn_k9v9_g128")
    assert "kv-cache-dtype-values" not in releases.current().patches
