"""Registration: entry point, idempotence, version gate, no CUDA at import."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

import pytest
from kvarn_vllm import compat, patches, plugin, releases


def test_entry_point_is_discoverable():
    eps = metadata.entry_points(group="vllm.general_plugins")
    kvarn = [ep for ep in eps if ep.name == "kvarn"]
    assert len(kvarn) == 1
    assert kvarn[0].value == "kvarn_vllm.plugin:register"
    assert kvarn[0].load() is plugin.register


def test_vllm_plugin_loader_finds_it():
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    loaded = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    assert loaded.get("kvarn") is plugin.register


def _patched_symbols():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.attention import selector

    return (
        selector._cached_get_attn_backend,
        Attention.get_kv_cache_spec,
        EngineArgs._set_default_max_num_seqs_and_batched_tokens_args,
    )


def _cache_dtype_names():
    from vllm.config import cache

    return tuple(cache.CacheDType.__args__), tuple(getattr(cache, "KV_CACHE_DTYPES", ()))


def test_register_is_idempotent(registered):
    """A second register() (vLLM calls it from several entry points) changes nothing; every
    wrapper wraps vLLM's own function once; exactly the installed release's ledger entries
    are applied; the kvarn presets are known cache dtypes once."""
    from kvarn_vllm.config import preset_names

    before = (_patched_symbols(), _cache_dtype_names())
    plugin.register()
    plugin.register()
    patches.apply_process_patches()
    assert (_patched_symbols(), _cache_dtype_names()) == before
    for fn in _patched_symbols():
        if compat.is_wrapped(fn):
            assert not compat.is_wrapped(fn.__kvarn_original__)
    adapter = releases.current()
    process = {p.name for p in patches.LEDGER if p.scope == "process"}
    assert process & set(adapter.patches) <= patches.applied()
    assert not (patches.applied() - set(adapter.patches)), "an entry of another release"
    selector_fn, spec_fn, _ = _patched_symbols()
    assert compat.is_wrapped(selector_fn)
    assert compat.is_wrapped(spec_fn) == ("kv-cache-spec" in adapter.patches)
    literal, registry = _cache_dtype_names()
    known = registry if "kv-cache-dtype-values" not in adapter.patches else literal
    for name in preset_names():
        assert known.count(name) == 1, name
    assert plugin.registered()


def test_custom_backend_registered(registered):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert AttentionBackendEnum.CUSTOM.get_path().startswith("kvarn_vllm.backend.")
    cls = AttentionBackendEnum.CUSTOM.get_class()
    assert cls.get_name() == "CUSTOM"
    assert AttentionBackendEnum[cls.get_name()] is AttentionBackendEnum.CUSTOM


def _resolve(dotted: str):
    """The object a ``vllm.a.b.C.d`` path names in the installed vLLM."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def test_ledger_entries_are_documented():
    """Every entry names its releases and what was checked on each; every vLLM symbol its
    target names exists in the installed vLLM when the installed release applies it; each
    series an entry lists has an adapter; every adapter's public extension points exist."""
    import re

    import vllm

    assert len({p.name for p in patches.LEDGER}) == len(patches.LEDGER)
    served = {name for adapter in releases.ADAPTERS for name in adapter.series_names()}
    installed = releases.current()
    for p in patches.LEDGER:
        assert p.scope in ("process", "worker"), p.name
        assert p.releases and set(p.releases) <= served, (p.name, p.releases)
        for series in p.releases:
            assert re.search(rf"\b{re.escape(series)}\.\d", p.checked), (p.name, series)
        if installed.series_names().isdisjoint(p.releases):
            continue
        # "vllm.m.Class.a / b / c" names Class.a, Class.b and Class.c
        symbols = []
        for first, rest in re.findall(r"(vllm(?:\.\w+)+)((?:\s*/\s*\w+)*)", p.target):
            parent = first.rsplit(".", 1)[0]
            symbols += [first, *(f"{parent}.{n}" for n in re.findall(r"\w+", rest))]
        assert symbols, f"{p.name}: its target names no vllm.* symbol"
        for symbol in symbols:
            try:
                _resolve(symbol)
            except (ImportError, AttributeError) as exc:
                raise AssertionError(f"{p.name}: {symbol} not in vLLM {vllm.__version__}") from exc
    for symbol in installed.public:
        _resolve(symbol)
    for adapter in releases.ADAPTERS:
        assert adapter.checked and all(adapter.covers(v) for v in adapter.checked), adapter


@pytest.mark.parametrize("version", ["0.26.0", "0.26.1", "0.26.2.dev5+gabc", "0.26.0rc1"])
def test_version_gate_accepts(version):
    """Every patch release of a served series gets that series' adapter."""
    adapter = releases.current(version)
    assert adapter is not None and (0, 26) in adapter.series
    assert compat.check_version(version)[:2] == (0, 26)


@pytest.mark.parametrize("version", ["0.25.1", "0.34.0", "1.0.0"])
def test_version_gate_refuses(version):
    with pytest.raises(compat.UnsupportedVllmVersion, match=version):
        compat.check_version(version)


def test_installed_vllm_is_supported():
    """The tests run against a release its adapter was checked against."""
    import vllm

    adapter = releases.current()
    assert adapter is not None, releases.unsupported_message()
    assert vllm.__version__ in adapter.checked, (vllm.__version__, adapter)
    assert plugin.registered()


def test_import_and_register_leave_cuda_alone():
    """In a fresh interpreter: import is vLLM-free; register() never initializes CUDA."""
    code = (
        "import sys, torch\n"
        "import kvarn_vllm\n"
        "assert 'vllm' not in sys.modules, 'importing kvarn_vllm imported vllm'\n"
        "assert 'triton' not in sys.modules, 'importing kvarn_vllm imported triton'\n"
        "import vllm.platforms as P\n"
        "from vllm.platforms.cpu import CpuPlatform\n"
        "P._current_platform = CpuPlatform()\n"
        "kvarn_vllm.register(); kvarn_vllm.register()\n"
        "assert 'kvarn_kernels' not in sys.modules, 'register imported the kernels'\n"
        "assert not torch.cuda.is_initialized()\n"
        # TRITON_CACHE_DIR as the process started, before vLLM points it elsewhere
        "import os\n"
        "from kvarn_vllm.plugin import kernel_cache_dir\n"
        "os.environ['TRITON_CACHE_DIR'] = '/vllm/torch_compile_cache/x/triton_cache'\n"
        "assert kernel_cache_dir() == '/start/triton', kernel_cache_dir()\n"
        "print('OK')\n"
    )
    env = {**os.environ, "TRITON_CACHE_DIR": "/start/triton"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("OK")


def test_first_tile_blocks_from_scheduler_block_ids():
    """The key a prefix-cache hit on tile 0 is matched by: tile 0's block per KV cache group;
    none when a group has no block or vLLM's null block (id 0) stands in for it."""
    assert compat.first_tile_blocks(([5, 9], [15, 19])) == (5, 15)
    assert compat.first_tile_blocks(([7],)) == (7,)
    assert compat.first_tile_blocks(([5, 9], [0, 19])) is None
    assert compat.first_tile_blocks(([5], [])) is None
    assert compat.first_tile_blocks(()) is None
    assert compat.first_tile_blocks(None) is None


def test_add_requests_hook_reports_rows_and_first_blocks(monkeypatch):
    """The hook reports each added request's row and tile-0 blocks after vLLM's own
    add_requests ran (here a stand-in: the real one needs a whole model runner)."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu import model_runner

    calls = []
    monkeypatch.setattr(
        model_runner.GPUModelRunner, "add_requests", lambda self, so: calls.append(so)
    )
    seen = []
    assert compat.wrap_v2_runner_add_requests(lambda rows, blocks: seen.append((rows, blocks)))
    runner = SimpleNamespace(req_states=SimpleNamespace(req_id_to_index={"a": 3, "b": 1}))
    out = SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id="a", block_ids=([4, 8], [14, 18])),
            SimpleNamespace(req_id="b", block_ids=([0], [11])),
            SimpleNamespace(req_id="gone", block_ids=([5], [15])),
        ]
    )
    model_runner.GPUModelRunner.add_requests(runner, out)
    assert calls == [out]
    assert seen == [([3, 1], [(4, 14), None])]
