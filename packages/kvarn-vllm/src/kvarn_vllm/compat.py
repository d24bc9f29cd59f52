"""The one place that touches vLLM's private symbols, behind a version gate.

Each function is used by exactly one entry of the ledger in :mod:`kvarn_vllm.patches`, which
says on which vLLM releases it is applied and against which it was checked; the adapters of
:mod:`kvarn_vllm.releases` pick the entries per release, and :func:`check_version` refuses a
release no adapter covers.

Nothing here imports vLLM at module import time: importing ``kvarn_vllm`` stays cheap
and never initializes CUDA.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable, Iterable
from typing import Any

from kvarn_vllm.releases import (
    UnsupportedVllmVersion,
    check_supported,
    parse_version,
    vllm_version,
)

__all__ = [
    "UnsupportedVllmVersion",
    "add_torch_dtypes",
    "cache_records",
    "calling_layer_name",
    "check_version",
    "flash_attn_prefill",
    "forward_context_layer",
    "clear_cli_kwargs_cache",
    "is_wrapped",
    "vllm_version",
    "widen_cache_dtype_literal",
    "wrap_attention_kv_cache_spec",
    "wrap_backend_selection",
    "wrap_hybrid_block_alignment",
    "wrap_mla_kv_cache_spec",
    "triton_prefill",
    "wrap_draft_decode_metadata",
    "wrap_v1_runner_steps",
    "wrap_v2_runner_attn_preparation",
    "wrap_v2_runner_add_requests",
]

_WRAPPED = "__kvarn_wrapped__"


def check_version(version: str | None = None) -> tuple[int, int, int]:
    """The parsed ``version`` (default: the installed vLLM); raises
    :class:`UnsupportedVllmVersion` unless an adapter of :mod:`kvarn_vllm.releases` covers it."""
    version = vllm_version() if version is None else version
    check_supported(version)
    return parse_version(version)


def is_wrapped(obj: Any) -> bool:
    """True when ``obj`` is one of this module's wrappers."""
    return getattr(obj, _WRAPPED, False)


def _mark(wrapper: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    setattr(wrapper, _WRAPPED, True)
    wrapper.__kvarn_original__ = original  # type: ignore[attr-defined]
    return wrapper


# --- kv_cache_dtype values -------------------------------------------------------------


def widen_cache_dtype_literal(names: Iterable[str]) -> tuple[str, ...]:
    """Add ``names`` to vLLM's closed ``CacheDType`` Literal and revalidate its users.

    ``vllm.config.cache.CacheDType`` is one ``typing.Literal`` object imported by name into
    about twenty modules (the selector's assertion, argparse choices, pydantic schemas).
    Its ``__args__`` is extended in place so every holder sees the new values; the
    pydantic dataclasses whose compiled schemas embed it are rebuilt.

    Returns:
        The Literal's values after the change.
    """
    from pydantic.dataclasses import rebuild_dataclass
    from vllm.config import cache as cache_module
    from vllm.config.cache import CacheConfig

    literal: Any = cache_module.CacheDType  # a typing.Literal, extended in place
    current = tuple(literal.__args__)
    added = tuple(n for n in names if n not in current)
    if added:
        literal.__args__ = current + added
        rebuild_dataclass(CacheConfig, force=True)  # type: ignore[arg-type]
        from vllm.config.speculative import SpeculativeConfig

        rebuild_dataclass(SpeculativeConfig, force=True)  # type: ignore[arg-type]
    return tuple(literal.__args__)


def clear_cli_kwargs_cache() -> None:
    """Drop vLLM's memoized argparse kwargs so ``--kv-cache-dtype`` choices are rebuilt."""
    arg_utils = sys.modules.get("vllm.engine.arg_utils")
    if arg_utils is not None:  # not imported yet: nothing memoized to drop
        arg_utils._compute_kwargs.cache_clear()


def add_torch_dtypes(names: Iterable[str], torch_dtype: Any) -> None:
    """Map each of ``names`` to ``torch_dtype`` in ``STR_DTYPE_TO_TORCH_DTYPE``."""
    from vllm.utils import torch_utils

    for name in names:
        torch_utils.STR_DTYPE_TO_TORCH_DTYPE.setdefault(name, torch_dtype)


# --- backend selection -----------------------------------------------------------------


SelectFn = Callable[[Any, Any, "int | None"], "type | None"]


def wrap_backend_selection(select: SelectFn) -> bool:
    """Route attention-backend selection through ``select`` first.

    ``vllm.v1.attention.selector.get_attn_backend`` calls the module-global
    ``_cached_get_attn_backend(backend, attn_selector_config, num_heads)``; the wrapper
    calls ``select(backend, attn_selector_config, num_heads)`` and falls back to vLLM's own
    selection when it returns None.

    Returns:
        True when the wrapper was installed now, False when it already was.
    """
    from vllm.v1.attention import selector

    original = selector._cached_get_attn_backend
    if is_wrapped(original):
        return False

    @functools.wraps(original)
    def _cached_get_attn_backend(backend, attn_selector_config, num_heads=None, **kwargs):
        # kwargs: 0.33's keyword-only _run_kv_cache_dtype (part of its cache key)
        chosen = select(backend, attn_selector_config, num_heads)
        if chosen is not None:
            return chosen
        return original(backend, attn_selector_config, num_heads, **kwargs)

    wrapped = _mark(_cached_get_attn_backend, original)
    selector._cached_get_attn_backend = wrapped  # type: ignore[assignment]
    return True


def wrap_default_max_num_seqs(adjust: Callable[[Any, bool], None]) -> bool:
    """Let ``adjust(engine_args, was_unset)`` revise ``max_num_seqs`` after vLLM fills its
    defaults (``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args``);
    ``was_unset`` says the user gave none.

    Returns:
        True when the wrapper was installed now, False when it already was.
    """
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs._set_default_max_num_seqs_and_batched_tokens_args
    if is_wrapped(original):
        return False

    @functools.wraps(original)
    def _set_default_max_num_seqs_and_batched_tokens_args(self, *args, **kwargs):
        was_unset = self.max_num_seqs is None
        result = original(self, *args, **kwargs)
        adjust(self, was_unset)
        return result

    wrapped = _mark(_set_default_max_num_seqs_and_batched_tokens_args, original)
    EngineArgs._set_default_max_num_seqs_and_batched_tokens_args = wrapped  # type: ignore[method-assign]
    return True


def calling_layer_name() -> str | None:
    """The ``prefix`` of the attention layer whose ``__init__`` is on the call stack.

    Used only to name the layer in start-up errors raised during backend selection.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name == "__init__":
                prefix = frame.f_locals.get("prefix")
                owner = frame.f_locals.get("self")
                if isinstance(prefix, str) and owner is not None and hasattr(owner, "forward"):
                    return prefix
            frame = frame.f_back
        return None
    finally:
        del frame


def building_dflash_drafter() -> bool:
    """Whether vLLM is building a DFlash drafter right now: vLLM 0.26's ``load_dflash_model``
    builds it under the compilation model tag ``"dflash_head"`` (DSpark's is
    ``"dspark_head"``, the target's ``"backbone"``). Its layers are non-causal."""
    from vllm.compilation import backends

    return getattr(backends, "model_tag", None) == "dflash_head"


def wrap_dflash_propose(scope: Callable[[Any], Any]) -> bool:
    """Run ``DFlashSpeculator.propose`` inside ``scope(attn_metadata)``.

    vLLM 0.26's DFlash drafter writes its context K/V through ``do_kv_cache_update`` with only
    a slot mapping; the target step's metadata for the draft layers (which kvarn stores with)
    is the ``attn_metadata`` argument of ``propose`` (its second, after ``input_batch``).
    """
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    original = DFlashSpeculator.propose
    if is_wrapped(original):
        return False

    @functools.wraps(original)
    def propose(self, input_batch, attn_metadata, *args, **kwargs):
        with scope(attn_metadata):
            return original(self, input_batch, attn_metadata, *args, **kwargs)

    DFlashSpeculator.propose = _mark(propose, original)  # type: ignore[method-assign]
    return True


# --- KV cache spec ---------------------------------------------------------------------


SpecFn = Callable[[Any, Any], Any]


def wrap_attention_kv_cache_spec(make_spec: SpecFn) -> bool:
    """Let ``make_spec(layer, vllm_config)`` answer ``Attention.get_kv_cache_spec`` first.

    vLLM 0.26 has no hook for a backend to declare its page size (0.28 adds
    ``AttentionBackend.customize_spec``); the layer builds a ``FullAttentionSpec`` from
    dtype and head size. ``make_spec`` returns None for layers it does not own.
    """
    from vllm.model_executor.layers.attention.attention import Attention

    original = Attention.get_kv_cache_spec
    if is_wrapped(original):
        return False

    @functools.wraps(original)
    def get_kv_cache_spec(self, vllm_config):
        spec = make_spec(self, vllm_config)
        if spec is not None:
            return spec
        return original(self, vllm_config)

    Attention.get_kv_cache_spec = _mark(get_kv_cache_spec, original)  # type: ignore[method-assign]
    return True


def wrap_mla_kv_cache_spec(make_spec: SpecFn) -> bool:
    """Let ``make_spec(layer, vllm_config)`` answer ``MLAAttention.get_kv_cache_spec`` first
    (vLLM 0.26 sizes an MLA page from ``head_size`` and the dtype); ``make_spec`` returns None
    for layers it does not own.

    Returns:
        True when the wrapper was installed now, False when it already was.
    """
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    original = MLAAttention.get_kv_cache_spec
    if is_wrapped(original):
        return False

    @functools.wraps(original)
    def get_kv_cache_spec(self, vllm_config):
        spec = make_spec(self, vllm_config)
        return spec if spec is not None else original(self, vllm_config)

    MLAAttention.get_kv_cache_spec = _mark(get_kv_cache_spec, original)  # type: ignore[method-assign]
    return True


def wrap_hybrid_block_alignment(align: Callable[[Any, Any, list[Any]], Any]) -> bool:
    """Let ``align(vllm_config, backend_cls, backends)`` answer the private classmethod
    ``Platform._align_hybrid_block_size`` first (vLLM 0.26 and 0.33; CUDA and CPU
    platforms inherit it); vLLM's own alignment runs when it returns None.

    ``backends`` are the model's non-recurrent backends (``Platform._find_non_ssm_backends``
    where it exists, 0.33), else ``[backend_cls]``.

    Returns:
        True when the wrapper was installed now, False when it already was.
    """
    from vllm.platforms.interface import Platform

    original = Platform.__dict__["_align_hybrid_block_size"].__func__
    if is_wrapped(original):
        return False

    @functools.wraps(original)
    def _align_hybrid_block_size(cls, vllm_config, backend_cls):
        find = getattr(cls, "_find_non_ssm_backends", None)
        backends = list(find(vllm_config)) if find is not None else [backend_cls]
        if align(vllm_config, backend_cls, backends) is None:
            original(cls, vllm_config, backend_cls)

    patched = classmethod(_mark(_align_hybrid_block_size, original))
    Platform._align_hybrid_block_size = patched  # type: ignore[method-assign,assignment]
    return True


# --- model runner V2: request-stable indices -------------------------------------------


StepFn = Callable[[Any], None]


def _runner_class(module_name: str) -> Any:
    """``GPUModelRunner`` of vLLM's V2 (``vllm.v1.worker.gpu.model_runner``) or V1
    (``vllm.v1.worker.gpu_model_runner``) runner module."""
    module = sys.modules.get(module_name) or importlib.import_module(module_name)
    return module.GPUModelRunner


def wrap_v2_runner_attn_preparation(on_real_batch: StepFn, on_dummy_batch: StepFn) -> bool:
    """Report each step's ``InputBatch`` to kvarn before attention metadata is built.

    vLLM 0.26's ``CommonAttentionMetadata`` carries no request identity (0.33 adds
    ``req_idx``). The V2 runner's ``InputBatch.idx_mapping_np`` maps batch rows to
    request-state rows that stay fixed for a request's life; kvarn keys staging slots
    by it. ``GPUModelRunner.prepare_attn`` / ``prepare_dummy_attn`` run right before
    ``model_state.prepare_attn`` builds the metadata in ``execute_model``.
    """
    runner_cls = _runner_class("vllm.v1.worker.gpu.model_runner")
    original_real = runner_cls.prepare_attn
    if is_wrapped(original_real):
        return False
    original_dummy = runner_cls.prepare_dummy_attn

    @functools.wraps(original_real)
    def prepare_attn(self, input_batch):
        on_real_batch(input_batch)
        return original_real(self, input_batch)

    @functools.wraps(original_dummy)
    def prepare_dummy_attn(self, input_batch, *args, **kwargs):
        # args: 0.30+'s valid_state_slots
        on_dummy_batch(input_batch)
        return original_dummy(self, input_batch, *args, **kwargs)

    runner_cls.prepare_attn = _mark(prepare_attn, original_real)
    runner_cls.prepare_dummy_attn = _mark(prepare_dummy_attn, original_dummy)
    return True


def first_tile_blocks(block_ids: Any) -> tuple[int, ...] | None:
    """The block ids of a request's first tile, one per KV cache group, from the scheduler's
    ``NewRequestData.block_ids``; None if a group has no block yet or its first block is
    vLLM's null block (id 0, e.g. a sliding-window group past its window)."""
    try:
        firsts = tuple(int(group[0]) for group in block_ids)
    except (TypeError, IndexError, ValueError):
        return None
    return None if not firsts or 0 in firsts else firsts


def wrap_v2_runner_add_requests(on_added: Callable[..., None]) -> bool:
    """Report the request-state rows the V2 runner (re)assigns in ``add_requests``, with the
    block ids of each request's first tile (:func:`first_tile_blocks`).

    New and resumed (after preemption) requests both come through
    ``GPUModelRunner.add_requests(scheduler_output)`` in vLLM 0.26's V2 runner; a
    resumed request may get the same row it had, so the row alone cannot tell.
    """
    runner_cls = _runner_class("vllm.v1.worker.gpu.model_runner")
    original = runner_cls.add_requests
    if is_wrapped(original):
        return False

    @functools.wraps(original)
    def add_requests(self, scheduler_output):
        result = original(self, scheduler_output)
        index = self.req_states.req_id_to_index
        added = [r for r in scheduler_output.scheduled_new_reqs if r.req_id in index]
        on_added(
            [index[r.req_id] for r in added],
            [first_tile_blocks(getattr(r, "block_ids", None)) for r in added],
        )
        return result

    runner_cls.add_requests = _mark(add_requests, original)
    return True


# --- model runner V1: request identity per step -----------------------------------------


def wrap_v1_runner_steps(
    on_schedule: Callable[[Any, Any], None],
    on_real_batch: Callable[[Any, list[str]], None],
    on_dummy_batch: Callable[[int], None],
) -> bool:
    """Report each step's scheduler output and batch order on vLLM 0.26's V1 model runner.

    The V1 runner (``vllm.v1.worker.gpu_model_runner.GPUModelRunner``) moves a request
    between batch rows as others finish (``InputBatch.condense``) and reorders them
    (``swap_states``), so no row index is stable for a request's life. kvarn keys staging by
    request id instead: ``_update_states(scheduler_output)`` runs once per step before the
    batch is laid out, and gets ``on_schedule(runner, scheduler_output)`` (new, resumed,
    finished and preempted requests, drafts per request); ``_build_attention_metadata`` then
    gets ``on_real_batch(runner, req_ids)``, the batch rows' request ids in row order, when
    called for a scheduled step (``num_scheduled_tokens`` given), and
    ``on_dummy_batch(num_reqs)`` for profiling, warm-up and CUDA-graph capture batches.
    """
    runner_cls = _runner_class("vllm.v1.worker.gpu_model_runner")
    original_update = runner_cls._update_states
    if is_wrapped(original_update):
        return False
    original_build = runner_cls._build_attention_metadata
    num_reqs_at = list(inspect.signature(original_build).parameters).index("num_reqs") - 1

    @functools.wraps(original_update)
    def _update_states(self, scheduler_output):
        on_schedule(self, scheduler_output)
        return original_update(self, scheduler_output)

    @functools.wraps(original_build)
    def _build_attention_metadata(self, *args, **kwargs):
        num_reqs = int(kwargs["num_reqs"] if "num_reqs" in kwargs else args[num_reqs_at])
        if kwargs.get("num_scheduled_tokens") is not None:
            on_real_batch(self, list(self.input_batch.req_ids[:num_reqs]))
        else:
            on_dummy_batch(num_reqs)
        return original_build(self, *args, **kwargs)

    runner_cls._update_states = _mark(_update_states, original_update)
    runner_cls._build_attention_metadata = _mark(_build_attention_metadata, original_build)
    return True


def wrap_draft_decode_metadata(scope: Callable[[], Any]) -> bool:
    """Run ``DraftModelSpeculator._build_draft_attn_metadata`` inside ``scope()``.

    vLLM 0.26's V2 drafters (EAGLE, EAGLE-3, MTP) build attention metadata for their
    decode steps 2..k with that method, through the same builder interface as a target
    step; nothing in ``CommonAttentionMetadata`` says the step's tokens are all drafts.
    """
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator

    original = DraftModelSpeculator._build_draft_attn_metadata
    if is_wrapped(original):
        return False

    @functools.wraps(original)
    def _build_draft_attn_metadata(self, *args, **kwargs):
        with scope():
            return original(self, *args, **kwargs)

    wrapped = _mark(_build_draft_attn_metadata, original)
    DraftModelSpeculator._build_draft_attn_metadata = wrapped  # type: ignore[method-assign]
    return True


# --- vLLM's own attention kernels and forward context (internal modules, not extension API) -


def flash_attn_prefill(head_size: int) -> tuple[Callable[..., Any], int] | None:
    """``(flash_attn_varlen_func, fa_version)`` when this vLLM install can run FlashAttention
    on the current GPU for ``head_size``, else None (e.g. no compiled FA library)."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        from vllm.v1.attention.backends.fa_utils import (
            flash_attn_varlen_func,
            get_flash_attn_version,
        )
        from vllm.vllm_flash_attn.flash_attn_interface import is_fa_version_supported

        version = get_flash_attn_version(head_size=head_size)
        if version is None or not is_fa_version_supported(version):
            return None
        return flash_attn_varlen_func, version
    except Exception:  # no compiled FlashAttention in this install
        return None


def triton_prefill() -> Callable[..., Any] | None:
    """vLLM's Triton varlen causal prefill kernel ``context_attention_fwd``, or None when
    vLLM runs without a usable Triton (no GPU driver)."""
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        return None
    from vllm.v1.attention.ops.triton_prefill_attention import context_attention_fwd

    return context_attention_fwd


def cache_records(kv_cache: Any) -> Any:
    """A layer's KV cache as ``[num_blocks, num_kv_heads, tile_bytes]`` uint8 records.

    vLLM 0.26 allocates it in that shape (the backend's ``get_kv_cache_shape``); from 0.29 on
    vLLM hands every layer a ``[B, H, N, C]`` view, here ``[num_blocks, num_kv_heads, 1,
    tile_bytes]`` (one state of ``G`` tokens per block and head, ``customize_spec``), whose
    state axis this drops. Any other tensor is returned unchanged.
    """
    if getattr(kv_cache, "dim", None) is not None and kv_cache.dim() == 4:
        if kv_cache.shape[2] != 1:
            raise ValueError(
                f"a kvarn KV cache view must hold one tile per block and head, got shape "
                f"{tuple(kv_cache.shape)}"
            )
        return kv_cache[:, :, 0]
    return kv_cache


def forward_context_layer(layer_name: str) -> Any:
    """The attention layer module ``layer_name`` of the running forward pass."""
    from vllm.forward_context import get_forward_context

    return get_forward_context().no_compile_layers[layer_name]


def current_forward_context() -> Any:
    """The running forward pass's ``ForwardContext`` (``vllm.forward_context``, internal),
    or None outside one. kvarn keys per-forward memos on it (a context group's decode rows,
    computed by the step's first layer for the others)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    return get_forward_context() if is_forward_context_available() else None


def init_reorder_batch_threshold(builder: Any, threshold: int) -> None:
    """``AttentionMetadataBuilder._init_reorder_batch_threshold(threshold)`` (a protected
    helper of vLLM's builder base class): rows of at most ``threshold`` query tokens are
    decodes, ordered first in the batch."""
    builder._init_reorder_batch_threshold(threshold)
