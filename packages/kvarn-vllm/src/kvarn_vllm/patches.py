"""The patch ledger: every change to vLLM behaviour that is not a public extension point.

Each entry says why it exists, how it works, when it can go, on which vLLM release series it
is applied (``releases``) and against which releases it was checked (``checked``). All of them
touch private vLLM symbols only through :mod:`kvarn_vllm.compat`; the adapter of the installed
release (:mod:`kvarn_vllm.releases`) applies the entries listing its series and nothing else,
and no entry is applied on a release no adapter covers. Applying is idempotent: a second call
finds the wrappers in place and does nothing.

Public extension points used besides the ledger (no patching): the ``vllm.general_plugins``
entry point and ``register_backend(AttentionBackendEnum.CUSTOM, ...)`` on every release;
``AttentionBackend.customize_spec`` on 0.29-0.33; ``register_kv_cache_dtype`` on 0.33.

Private vLLM symbols read without patching, each through one :mod:`kvarn_vllm.compat`
function: the running forward's context (``vllm.forward_context``: ``current_forward_context``,
``forward_context_layer``), the builder base class's ``_init_reorder_batch_threshold``
(``init_reorder_batch_threshold``), FlashAttention's and Triton's prefill kernels
(``flash_attn_prefill``, ``triton_prefill``), the compilation model tag of a DFlash drafter
(``building_dflash_drafter``) and the constructing layer's ``prefix`` on the call stack
(``calling_layer_name``, for error messages).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kvarn_vllm import compat, releases
from kvarn_vllm.config import is_kvarn_dtype, parse_kv_cache_dtype, preset_names
from kvarn_vllm.mla_config import is_mla_dtype, mla_preset_names

__all__ = ["LEDGER", "Patch", "applied", "apply_process_patches", "apply_worker_patches"]

logger = logging.getLogger("vllm.kvarn")  # inherits vLLM's handler and level


@dataclass
class Patch:
    """One ledger entry.

    Attributes:
        name: short identifier.
        target: the vLLM symbol(s) changed.
        why: what breaks without it.
        how: what the patch does.
        remove_when: the vLLM release (or condition) that makes it unnecessary.
        scope: ``process`` (every process, at ``register()``) or ``worker`` (applied by the
            metadata builder, in GPU workers only).
        apply: does it; idempotent.
        releases: the vLLM release series it is applied on (``"0.26"``, ``"0.33"``); the
            adapter of each series (:mod:`kvarn_vllm.releases`) applies exactly these.
        checked: against which releases it was checked, and how (sources read, CPU tests,
            GPU runs).
    """

    name: str
    target: str
    why: str
    how: str
    remove_when: str
    scope: str
    apply: Callable[[], object] = field(repr=False)
    releases: tuple[str, ...] = ("0.26",)
    checked: str = "0.26.0: sources read, CPU tests, H200/H100 runs"


# --- the hooks the patches install ------------------------------------------------------


def _select_backend(selected_backend, cfg, num_heads):
    """Backend selection for ``kvarn_*`` dtypes; None leaves others to vLLM."""
    if not is_kvarn_dtype(cfg.kv_cache_dtype):
        return None
    from kvarn_vllm.backend import backend_class, unsupported_reasons
    from kvarn_vllm.mla_backend import select_mla_backend

    layer = compat.calling_layer_name() or "<unknown layer>"
    if cfg.use_mla:  # latent records (kvarn_vllm.mla_backend), from any kvarn_* name
        return select_mla_backend(selected_backend, cfg, layer)
    if is_mla_dtype(cfg.kv_cache_dtype):
        raise ValueError(
            f"attention layer {layer!r} is a dense attention layer; {cfg.kv_cache_dtype} is "
            f"the MLA latent format. Use a dense preset ({', '.join(preset_names())})."
        )
    config = parse_kv_cache_dtype(cfg.kv_cache_dtype)
    adapter = releases.check_supported()
    unserved = adapter.unserved()
    if unserved:
        raise ValueError(
            f"attention layer {layer!r}: kvarn-vllm on vLLM {releases.vllm_version()} "
            f"({adapter.name}) does not serve {'; '.join(unserved)}. Use kv_cache_dtype auto "
            "or fp8 for this model and these settings."
        )
    name = getattr(selected_backend, "name", selected_backend)
    if selected_backend is not None and name != "CUSTOM":
        raise ValueError(
            f"attention layer {layer!r}: kv_cache_dtype={config.name} is read only by the "
            f"kvarn backend, but --attention-backend {name} was requested. Drop "
            "--attention-backend (kvarn selects its backend itself) or pass CUSTOM."
        )
    reasons = unsupported_reasons(cfg, config.preset, compat.building_dflash_drafter())
    if reasons:
        raise ValueError(
            f"kvarn-vllm cannot serve attention layer {layer!r} with kv_cache_dtype="
            f"{config.name}: {'; '.join(reasons)}. To serve this model, use "
            "kv_cache_dtype auto or fp8 (or fix the setting named above)."
        )
    return backend_class(config.name)


def _make_spec(layer, vllm_config):
    """``Attention.get_kv_cache_spec`` for layers with a ``kvarn_*`` dtype; else None."""
    if not is_kvarn_dtype(getattr(layer, "kv_cache_dtype", None)):
        return None
    from kvarn_vllm.spec import make_layer_spec

    if layer.attn_type in ("encoder_only", "encoder"):
        return None  # vLLM gives these no KV cache; keep its answer
    cache_config = vllm_config.cache_config
    model_config = vllm_config.model_config
    config = parse_kv_cache_dtype(layer.kv_cache_dtype)
    where = f"attention layer {layer.layer_name!r} ({config.name})"
    if cache_config.kv_cache_dtype_skip_layers:
        raise ValueError(
            f"{where}: --kv-cache-dtype-skip-layers is not supported with KVarN yet (mixed "
            "page formats in one pool); remove it"
        )
    block_size = cache_config.block_size
    try:
        spec = make_layer_spec(
            config,
            block_size=block_size,
            num_kv_heads=layer.num_kv_heads,
            head_size=layer.head_size,
            head_size_v=layer.head_size_v,
            sliding_window=layer.sliding_window,
            hybrid=model_config is not None and getattr(model_config, "is_hybrid", False),
        )
    except ValueError as exc:
        hint = ""
        if cache_config.user_specified_block_size and block_size != config.block_size:
            hint = (
                f" --block-size {block_size} was given; drop it (kvarn sets the block "
                f"size to the tile) or pass --block-size {config.block_size}"
            )
        raise ValueError(f"{where}: {exc}.{hint}") from None
    from kvarn_vllm.hybrid import hybrid_page_mismatch

    reason = hybrid_page_mismatch(vllm_config, spec.page_size_bytes)
    if reason is not None:
        raise ValueError(f"{where}: {reason}")
    return spec


def _make_mla_spec(layer, vllm_config):
    """``MLAAttention.get_kv_cache_spec`` for layers on the kvarn MLA backend; else None."""
    from kvarn_vllm.mla_backend import make_mla_spec

    return make_mla_spec(layer, vllm_config)


def _align_hybrid(vllm_config, backend_cls, backends):
    """``Platform._align_hybrid_block_size`` for ``kvarn_*`` dtypes; else None."""
    from kvarn_vllm.hybrid import align_hybrid_block_size

    return align_hybrid_block_size(vllm_config, backend_cls, backends)


DEFAULT_MAX_NUM_SEQS = 256

# The release series of each adapter (kvarn_vllm.releases), for the ledger's releases fields.
_CUSTOMIZE_SPEC_LITERAL = ("0.29", "0.30", "0.31", "0.32")  # vllm-0.29: customize_spec, Literal
_ALL = ("0.26", "0.27", *_CUSTOMIZE_SPEC_LITERAL, "0.33")


def _default_max_num_seqs(engine_args, was_unset: bool) -> None:
    """With a ``kvarn_*`` cache and no ``--max-num-seqs``, use at most 256 request slots.

    vLLM 0.26 defaults to 1024 on 70+ GiB GPUs; kvarn allocates exact staging per slot (32 GiB
    for the Llama-3.1-8B shape at 1024 slots, a quarter of the KV budget). A value the user
    gave is never changed.
    """
    if not (was_unset and is_kvarn_dtype(getattr(engine_args, "kv_cache_dtype", None))):
        return
    current = engine_args.max_num_seqs
    if current is not None and current > DEFAULT_MAX_NUM_SEQS:
        engine_args.max_num_seqs = DEFAULT_MAX_NUM_SEQS
        logger.info(
            "kvarn: max_num_seqs not given; using %d instead of vLLM's default %d, since "
            "kvarn keeps exact staging for each request slot (pass --max-num-seqs to choose; "
            "more slots take KV capacity)",
            DEFAULT_MAX_NUM_SEQS,
            current,
        )


def _widen_cache_dtype():
    import torch

    names = preset_names() + mla_preset_names()
    compat.widen_cache_dtype_literal(names)
    compat.add_torch_dtypes(names, torch.uint8)
    compat.clear_cli_kwargs_cache()


def _install_step_hook():
    from kvarn_vllm.step import STEP

    compat.wrap_v2_runner_attn_preparation(STEP.report_real, STEP.report_dummy)
    compat.wrap_v2_runner_add_requests(STEP.report_added)


def _install_v1_step_hook():
    from kvarn_vllm.step import STEP

    compat.wrap_v1_runner_steps(
        STEP.report_v1_schedule, STEP.report_v1_batch, STEP.report_dummy_rows
    )


def _install_draft_hook():
    from kvarn_vllm.step import STEP

    compat.wrap_draft_decode_metadata(STEP.draft_steps)


def _install_dflash_hook():
    from kvarn_vllm.step import STEP

    compat.wrap_dflash_propose(STEP.proposing)


LEDGER: tuple[Patch, ...] = (
    Patch(
        name="kv-cache-dtype-values",
        target="vllm.config.cache.CacheDType (Literal), CacheConfig/SpeculativeConfig "
        "pydantic schemas, vllm.engine.arg_utils._compute_kwargs cache, "
        "vllm.utils.torch_utils.STR_DTYPE_TO_TORCH_DTYPE",
        why="vLLM 0.26 closes kv_cache_dtype to a typing.Literal: argparse choices, "
        "pydantic validation and the selector's assertion all reject an unknown name, and "
        "Attention.__init__ maps the name to a torch dtype through a fixed dict.",
        how="Extend the Literal's __args__ in place with the kvarn_* preset names (every "
        "module holding it sees them, so --help lists them), rebuild the two pydantic "
        "dataclasses that embed it, drop the memoized argparse kwargs, and map each name "
        "to torch.uint8.",
        remove_when="vLLM >= 0.33: register_kv_cache_dtype() does all of this publicly.",
        scope="process",
        apply=_widen_cache_dtype,
        releases=("0.26", "0.27", *_CUSTOMIZE_SPEC_LITERAL),
        checked="0.26.0: sources read, CPU tests, H200/H100 runs. 0.27.0, 0.30.0: sources "
        "read, CPU tests. 0.27.1, 0.29.0, 0.31.0, 0.32.0: sources read (the same Literal, "
        "pydantic fields and memoized kwargs). Not applied on 0.33: the vllm-0.33 adapter "
        "calls vllm.config.cache.register_kv_cache_dtype instead",
    ),
    Patch(
        name="default-max-num-seqs",
        target="vllm.engine.arg_utils.EngineArgs._set_default_max_num_seqs_and_batched_tokens_args",
        why="On GPUs with 70+ GiB vLLM 0.26 defaults to max_num_seqs 1024; kvarn allocates "
        "exact staging for every request slot, so that default spends about a quarter of an "
        "H200's KV budget on staging for the Llama-3.1-8B shape (capacity ~3.3x bf16 instead "
        "of 4.36x at 256).",
        how="Wrap the method: when the user gave no max_num_seqs and kv_cache_dtype is "
        "kvarn_*, lower vLLM's default to 256 and log it. A given --max-num-seqs is kept.",
        remove_when="kvarn's staging no longer scales with max_num_seqs (slots drawn from the "
        "KV pool) or vLLM lets a KV-cache dtype suggest scheduler defaults.",
        scope="process",
        apply=lambda: compat.wrap_default_max_num_seqs(_default_max_num_seqs),
        releases=_ALL,
        checked="0.26.0: sources read, CPU tests, H200/H100 runs. 0.27.0, 0.30.0, 0.33.0: "
        "sources read (same signature, defaults still 1024 on large GPUs), CPU tests. 0.27.1, "
        "0.29.0, 0.31.0, 0.32.0: sources read",
    ),
    Patch(
        name="backend-selection",
        target="vllm.v1.attention.selector._cached_get_attn_backend",
        why="vLLM 0.26 picks a CUDA backend from a fixed priority list with no place for an "
        "out-of-tree backend; without this a kvarn dtype finds no valid backend, or the user "
        "needs a second flag (--attention-backend CUSTOM).",
        how="Wrap the module-level function: for kvarn_* dtypes return the preset's backend "
        "class, or raise a start-up error naming the layer, the reason and the fix "
        "(MLA, sinks, head_dim, dtype, conflicting --block-size or --attention-backend). "
        "Every other dtype goes to vLLM unchanged.",
        remove_when="vLLM lets a registered KV-cache dtype choose its attention backend "
        "(not yet in 0.33; a platform plugin is the alternative).",
        scope="process",
        apply=lambda: compat.wrap_backend_selection(_select_backend),
        releases=_ALL,
        checked="0.26.0: sources read, CPU tests, H200/H100 runs. 0.27.0, 0.30.0, 0.33.0: "
        "sources read, CPU tests. 0.27.1, 0.29.0, 0.31.0, 0.32.0: sources read (0.31.0 on: "
        "a keyword-only _run_kv_cache_dtype, passed through)",
    ),
    Patch(
        name="kv-cache-spec",
        target="vllm.model_executor.layers.attention.attention.Attention.get_kv_cache_spec",
        why="vLLM 0.26 derives the page size from dtype and head size; a tile record "
        "(kvarn_math.layout) is neither, so pages would be sized wrong.",
        how="Wrap the method: for layers whose kv_cache_dtype is kvarn_* return "
        "KvarnFullAttentionSpec / KvarnSlidingWindowSpec (uint8, page = num_kv_heads * "
        "tile_bytes, block_size = G, or whole tiles in a hybrid model); also refuse "
        "skip-layers, and a hybrid page the alignment (hybrid-block-size) did not match, "
        "clearly.",
        remove_when="vLLM >= 0.29: AttentionBackend.customize_spec (state_content_bytes, "
        "tokens_per_state); removed there.",
        scope="process",
        apply=lambda: compat.wrap_attention_kv_cache_spec(_make_spec),
        releases=("0.26", "0.27"),
        checked="0.26.0: sources read, CPU tests, H200/H100 runs. 0.27.0: sources read, CPU "
        "tests; 0.27.1: sources read. Not applied on 0.29-0.33: the backend's public "
        "customize_spec gives the page there (0.28's customize_spec has no tokens_per_state "
        "and no adapter serves 0.28)",
    ),
    Patch(
        name="mla-kv-cache-spec",
        target="vllm.model_executor.layers.attention.mla_attention.MLAAttention.get_kv_cache_spec",
        why="vLLM 0.26 sizes an MLA page as block_size * (kv_lora_rank + rope) * dtype size; "
        "a latent record (kvarn_math.mla) is 330 bytes a token at 512 + 64, not 576 of any "
        "dtype, so pages would be sized wrong.",
        how="Wrap the method: for layers on the kvarn MLA backend return KvarnMLASpec "
        "(uint8, page = tile_bytes of the MLA preset per block of G tokens); refuse a block "
        "size other than G clearly. Other layers go to vLLM unchanged.",
        remove_when="vLLM's MLA layer applies the backend's customize_spec (not in 0.33).",
        scope="process",
        apply=lambda: compat.wrap_mla_kv_cache_spec(_make_mla_spec),
        checked="0.26.0: sources read, CPU tests. Not applied on 0.33 (the MLA latent cache "
        "is refused there at start-up)",
    ),
    Patch(
        name="hybrid-block-size",
        target="vllm.platforms.interface.Platform._align_hybrid_block_size",
        why="In a hybrid model (Mamba-2 or gated delta net beside attention) one block of an "
        "attention layer must take the bytes of one recurrent state. vLLM 0.26 computes the "
        "block from bytes per token of the dtype; 0.33 from the backend's customize_spec on "
        "a one-token spec, but a tile record has no whole bytes per token (106.125 for "
        "kvarn_k4v2_g128 at head_dim 128). Either way the attention page would not match the "
        "padded state page, and vLLM would pad it back to the state's size or refuse.",
        how="Wrap the classmethod: for kvarn_* dtypes kvarn_vllm.hybrid computes the block as "
        "the fewest whole tiles (times vLLM's kernel, chunk and checkpoint alignment) whose "
        "page covers one recurrent state, sets block_size, mamba_block_size and "
        "mamba_page_size_padded as vLLM does; other dtypes go to vLLM unchanged.",
        remove_when="vLLM's hybrid alignment takes a backend's page per block of tiles "
        "(a customize_spec that may declare tokens_per_state > 1), not in 0.33.",
        scope="process",
        apply=lambda: compat.wrap_hybrid_block_alignment(_align_hybrid),
        releases=("0.26", "0.27", "0.33"),
        checked="0.26.0: sources read, CPU tests, H200/H100 runs. 0.27.0: sources read, CPU "
        "tests; 0.27.1: sources read. 0.33.0: sources read, CPU tests (the alignment against "
        "0.33's planner, test_hybrid_v033; the layer views in kernel blocks of one tile, "
        "test_releases_v033); no GPU run. Not applied on 0.29-0.32 (hybrid models refused)",
    ),
    Patch(
        name="request-rows",
        target="vllm.v1.worker.gpu.model_runner.GPUModelRunner.prepare_attn / "
        "prepare_dummy_attn / add_requests",
        why="Staging for open tiles must follow a request across steps; vLLM 0.26's "
        "CommonAttentionMetadata carries no request identity, no per-row draft count and "
        "no sign that a row's request is new (under speculative decoding the per-row count "
        "of quantized tiles lives on the GPU and must be reset for a new or resumed request).",
        how="Wrap prepare_attn / prepare_dummy_attn to hand the step's "
        "InputBatch.idx_mapping_np (request-state rows, fixed for a request's life) and "
        "num_draft_tokens_per_req to kvarn's builder before vLLM builds metadata; wrap "
        "add_requests to report the rows (re)assigned this step and the block ids of each "
        "added request's first tile (so a prefix-cache hit on tile 0 can read the exact "
        "copy its owner keeps in staging).",
        remove_when="vLLM >= 0.33: CommonAttentionMetadata.req_idx (the draft count and the "
        "new-request signal would still be needed for speculative decoding).",
        scope="worker",
        apply=_install_step_hook,
        releases=_ALL,
        checked="0.26.0: sources read, CPU tests, H200/H100 runs. 0.27.0, 0.30.0, 0.33.0: "
        "sources read, CPU tests; no GPU run. 0.27.1, 0.29.0, 0.31.0, 0.32.0: sources read "
        "(0.30.0 on: prepare_dummy_attn gained valid_state_slots, passed through)",
    ),
    Patch(
        name="request-ids-v1",
        target="vllm.v1.worker.gpu_model_runner.GPUModelRunner._update_states / "
        "_build_attention_metadata",
        why="The V1 model runner (vLLM's choice for n-gram speculation and other features "
        "its V2 runner lacks) moves requests between batch rows as others finish or are "
        "reordered, so no row index follows a request; CommonAttentionMetadata carries no "
        "request identity or draft count either.",
        how="Wrap _update_states to see each step's SchedulerOutput (new, resumed, finished and "
        "preempted requests, each one's first-tile block ids and drafts) and give each live "
        "request a staging slot by request id (lowest free, released on finish or "
        "preemption); wrap _build_attention_metadata to hand the step's rows, as slots and "
        "draft counts, to kvarn's builder (or mark a dummy batch when no step is scheduled).",
        remove_when="vLLM >= 0.33: CommonAttentionMetadata.req_idx (the draft count and the "
        "new-request signal would still be needed for speculative decoding).",
        scope="worker",
        apply=_install_v1_step_hook,
        releases=_ALL,
        checked="0.26.0: sources read, CPU tests, H200/H100 runs. 0.27.0, 0.30.0, 0.33.0: "
        "sources read, CPU tests (n-gram verify steps); no GPU run. 0.27.1, 0.29.0, 0.31.0, "
        "0.32.0: sources read (_build_attention_metadata's arguments change; num_reqs is "
        "found by name)",
    ),
    Patch(
        name="draft-steps",
        target="vllm.v1.worker.gpu.spec_decode.speculator.DraftModelSpeculator."
        "_build_draft_attn_metadata",
        why="A drafter's decode steps 2..k (EAGLE, EAGLE-3, MTP) build metadata through the "
        "same builder call as a target step; their single token per row is a draft that "
        "must go to staging without committing anything, and kvarn cannot tell such a "
        "build from a target decode step.",
        how="Wrap the method so that builds inside it run in STEP.draft_steps(); kvarn's "
        "builder then plans a staging write at seq_len - 1 per row and no tile.",
        remove_when="vLLM passes a draft/verify flag (or per-row committed lengths) in "
        "CommonAttentionMetadata (not in 0.33).",
        scope="worker",
        apply=_install_draft_hook,
        releases=("0.26", "0.27"),
        checked="0.26.0: sources read, CPU tests, H200/H100 runs. 0.27.0: sources read (the "
        "method gained seq_lens_cpu_upper_bound, step, query_start_loc_np, passed through), "
        "CPU tests; 0.27.1: sources read. Absent from 0.30.0 on (drafters build metadata "
        "through _build_attn_metadata(step=...)): drafter-model speculation is refused "
        "at start-up on 0.29-0.33",
    ),
    Patch(
        name="dflash-context-store",
        target="vllm.v1.worker.gpu.spec_decode.dflash.speculator.DFlashSpeculator.propose",
        why="A DFlash drafter writes its context K/V (every token of the target step) through "
        "attn.impl.do_kv_cache_update with only a slot mapping, outside any forward; kvarn "
        "stores from a per-request plan, which that call does not carry.",
        how="Wrap propose so that its attn_metadata argument (the target step's metadata by "
        "layer name, draft layers included) is STEP.target_metadata while it runs; kvarn's "
        "do_kv_cache_update stores with the plan for its layer. The backend selector accepts "
        "non-causal layers while vLLM builds a DFlash drafter (compilation model tag "
        "'dflash_head').",
        remove_when="vLLM passes the step's attention metadata (or per-row committed "
        "lengths) to do_kv_cache_update (not in 0.33).",
        scope="worker",
        apply=_install_dflash_hook,
        releases=("0.26", "0.27"),
        checked="0.26.0: sources read, CPU tests, H200 runs. 0.27.0: sources read, CPU "
        "tests; 0.27.1: sources read. Not applied on 0.29-0.33 (drafter-model speculation "
        "with kvarn is refused there)",
    ),
)

_lock = threading.Lock()
_applied: set[str] = set()


def applied() -> frozenset[str]:
    """Names of the ledger entries applied in this process."""
    return frozenset(_applied)


def _apply(scope: str) -> None:
    series = releases.check_supported().series_names()
    with _lock:
        for patch in LEDGER:
            wanted = patch.scope == scope and not series.isdisjoint(patch.releases)
            if wanted and patch.name not in _applied:
                patch.apply()
                _applied.add(patch.name)
                logger.debug("kvarn: applied patch %s", patch.name)


def apply_process_patches() -> None:
    """Apply the ``process`` entries the installed release's adapter needs (``register()``)."""
    _apply("process")


def apply_worker_patches() -> None:
    """Apply the ``worker`` entries the installed release's adapter needs (called by the
    metadata builder, in GPU workers)."""
    _apply("worker")
