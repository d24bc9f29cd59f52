"""vLLM's metadata builder for KVarN layers: hands each step to the planner.

This module subclasses vLLM's ``AttentionMetadataBuilder``, so it imports vLLM; the
backend class names it (``get_builder_cls``) only when vLLM asks, in a worker. The planning
itself lives in :mod:`kvarn_vllm.planning` (vLLM-free).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.attention.backend import AttentionCGSupport, AttentionMetadataBuilder

from kvarn_vllm import compat, overflow, speculative, warmup
from kvarn_vllm.config import KvarnConfig, parse_kv_cache_dtype, spec_full_graphs
from kvarn_vllm.metadata import KvarnMetadata
from kvarn_vllm.planning import StepPlanner
from kvarn_vllm.staging import log_staging_once

__all__ = ["KvarnMetadataBuilder"]


class KvarnMetadataBuilder(AttentionMetadataBuilder[KvarnMetadata]):
    """Plans each step once for every KVarN layer of a KV cache group.

    Attributes:
        config: the engine's kvarn settings.
        preset: ``config.preset``.
        planner: the :class:`~kvarn_vllm.planning.StepPlanner` of this group.
    """

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        """Full CUDA graphs for batches of single-token decodes (every tensor the kernels read
        lives in a persistent buffer at a fixed offset, refreshed by :meth:`build`); with speculative decoding (unless
        ``KVARN_VLLM_SPEC_FULL_GRAPHS=0``), uniform batches of any length (verify steps,
        drafter steps), whose capture metadata :meth:`build_for_cudagraph_capture` lays
        out on the buffers a real step of that shape uses."""
        if getattr(vllm_config, "speculative_config", None) is not None and spec_full_graphs():
            return AttentionCGSupport.UNIFORM_BATCH
        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        from kvarn_vllm import patches

        spec_cfg = vllm_config.speculative_config
        num_spec = speculative.check_spec_method(
            spec_cfg, vllm_config.use_v2_model_runner, layer_names
        )
        patches.apply_worker_patches()
        log_staging_once()
        preset_name = getattr(kv_cache_spec, "kvarn_preset", "")
        self.config: KvarnConfig = parse_kv_cache_dtype(
            preset_name, num_speculative_tokens=num_spec
        )
        self.preset = self.config.preset
        sched = vllm_config.scheduler_config
        # Full CUDA graphs for uniform speculative batches: vLLM captures the target's
        # verify steps of 1 + k tokens per request.
        spec_graphs = (
            self.get_cudagraph_support(vllm_config, kv_cache_spec)
            == AttentionCGSupport.UNIFORM_BATCH
        )
        self.planner = StepPlanner(
            self.config,
            max_num_reqs=int(sched.max_num_seqs),
            max_num_tokens=max(
                int(sched.max_num_batched_tokens),
                int(getattr(sched, "max_num_scheduled_tokens", 0) or 0),
            ),
            device=device,
            spec_decode=spec_cfg is not None,
            spec_graphs=spec_graphs,
            verify_len=1 + num_spec,
        )
        # Verify rows (1 + k tokens) are "context" rows: multi_query_attention.
        compat.init_reorder_batch_threshold(self, 1)
        warmup.warm_kernels(self.config, kv_cache_spec, vllm_config, device)
        if spec_cfg is not None:
            warmup.warm_planners(self.config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False):
        """This step's metadata (:meth:`StepPlanner.plan`); every few seconds, a look at the
        layers' saturation counters (:meth:`kvarn_vllm.overflow.OverflowCounters.poll`, no
        host sync)."""
        overflow.COUNTERS.poll()
        return self.planner.plan(common_attn_metadata)

    def build_for_cudagraph_capture(self, common_attn_metadata: Any):
        """A capture's metadata on the buffers a real step of its shape uses
        (:meth:`StepPlanner.plan_capture`)."""
        return self.planner.plan_capture(common_attn_metadata)
