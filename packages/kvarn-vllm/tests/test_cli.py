"""--kv-cache-dtype on vLLM's own argument parser and config validation."""

from __future__ import annotations

import _releases
import pytest
import torch
from kvarn_math.layout import PRESETS

# vLLM 0.26's closed Literal, widened by the ledger; 0.33's registry: test_releases.py
on_literal = _releases.needs("kv-cache-dtype-values")


@pytest.fixture(scope="module")
def parser(registered):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return EngineArgs.add_cli_args(FlexibleArgumentParser())


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_cli_accepts_every_preset(parser, name):
    from vllm.engine.arg_utils import EngineArgs

    args = parser.parse_args(["--kv-cache-dtype", name])
    assert args.kv_cache_dtype == name
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.kv_cache_dtype == name


@on_literal
def test_cli_rejects_unknown_kvarn_name(parser, capsys):
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "kvarn_k9v9_g128"])
    assert "invalid choice" in capsys.readouterr().err


def test_cli_still_accepts_vllm_dtypes(parser):
    assert parser.parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"


@on_literal
def test_help_lists_presets(parser):
    action = next(a for a in parser._actions if "--kv-cache-dtype" in a.option_strings)
    assert set(PRESETS) <= set(action.choices)
    assert "kvarn_k4v2_g128" in parser.format_help()


def test_cache_config_validates(registered):
    from pydantic import ValidationError
    from vllm.config import CacheConfig

    assert CacheConfig(cache_dtype="kvarn_k4v2_g128").cache_dtype == "kvarn_k4v2_g128"
    with pytest.raises(ValidationError):
        CacheConfig(cache_dtype="kvarn_bogus")


@on_literal
def test_speculative_config_schema_accepts_presets(registered):
    from vllm.config.speculative import SpeculativeConfig

    schema = str(SpeculativeConfig.__pydantic_core_schema__)
    assert "kvarn_k4v2_g128" in schema


def test_torch_dtype_mapping(registered):
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE, kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import KVQuantMode, get_kv_quant_mode

    for name in PRESETS:
        assert STR_DTYPE_TO_TORCH_DTYPE[name] is torch.uint8
        assert kv_cache_dtype_str_to_dtype(name, None) is torch.uint8
        # vLLM's own quantization modes stay off: the kvarn backend owns its format.
        assert get_kv_quant_mode(name) is KVQuantMode.NONE


@on_literal
def test_selector_literal_accepts_presets(registered):
    from typing import get_args

    from vllm.v1.attention import selector

    assert set(PRESETS) <= set(get_args(selector.CacheDType))


def test_engine_args_build_cache_config(registered):
    """LLM(kv_cache_dtype=...) goes through EngineArgs -> CacheConfig; no model needed here."""
    from vllm.config import CacheConfig
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model="unused", kv_cache_dtype="kvarn_k4v4_g128")
    cache = CacheConfig(cache_dtype=args.kv_cache_dtype, block_size=args.block_size)
    assert cache.cache_dtype == "kvarn_k4v4_g128"
    assert not cache.user_specified_block_size


@pytest.mark.parametrize(
    ("dtype", "given", "expected"),
    [
        ("kvarn_k4v2_g128", None, 256),  # vLLM's 1024 lowered, logged
        ("kvarn_k4v2_g128", 1024, 1024),  # a given value is kept
        ("kvarn_k4v2_g128", 64, 64),
        ("auto", None, 1024),  # other caches keep vLLM's default
    ],
)
def test_default_max_num_seqs(registered, monkeypatch, caplog, dtype, given, expected):
    from types import SimpleNamespace

    from kvarn_vllm import patches
    from vllm.engine.arg_utils import EngineArgs

    assert "default-max-num-seqs" in patches.applied()
    # An H200-like platform's defaults (the CPU platform's would be 256 already).
    monkeypatch.setattr(
        EngineArgs, "get_batch_defaults", classmethod(lambda cls, ws: ({None: 8192}, {None: 1024}))
    )
    args = EngineArgs(model="unused", kv_cache_dtype=dtype, max_num_seqs=given)
    args.max_num_batched_tokens = 8192
    with caplog.at_level("INFO", logger="vllm.kvarn"):
        args._set_default_max_num_seqs_and_batched_tokens_args(
            None, SimpleNamespace(max_model_len=4096), SimpleNamespace(use_batched_dp_moe=False)
        )
    assert args.max_num_seqs == expected
    lowered = [r for r in caplog.records if "max_num_seqs not given" in r.getMessage()]
    assert bool(lowered) == (dtype.startswith("kvarn") and given is None)
