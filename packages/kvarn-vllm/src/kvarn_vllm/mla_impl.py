"""The MLA attention implementation over a KVarN latent cache (vLLM 0.26's MLA common impl).

vLLM's ``MLAAttention.forward_impl`` keeps its structure: it splits a step into decode tokens
(``forward_mqa``, the absorbed query in latent space, then ``W_UV``) and prefill tokens
(``forward_mha``: ``kv_b_proj`` up-projects the latent and vLLM's MLA prefill backend attends).
This impl changes where the latent comes from:

* **write** (``do_kv_cache_update``, before attention): every token's latent and RoPE key are
  quantized into row ``slot % G`` of its block's record (``kvarn_kernels.mla.store_latent``,
  where vLLM's ``concat_and_cache_mla`` writes). Rows are quantized from their own token only,
  so a record's bytes do not depend on chunking, batching, order or rewrites: a rejected or
  recomputed token's row is simply written again.
* **decode** (``forward_mqa``): ``kvarn_kernels.mla.mla_decode_attention`` reads the complete
  tiles from their records and the open tile's rows from a ring that is that tile's record
  dequantized in this step (``dequantize_latent``, one tile a sequence). Every position is read
  at the records' precision, and all shapes are fixed by the batch: CUDA-graph safe.
* **prefill**: vLLM's path stays; the step's own tokens are attended through the values their
  records hold (stored, then read back: the same bytes), and cached context (chunked prefill,
  prefix-cache hits) is dequantized from the records into vLLM's context workspace where vLLM
  gathers its bf16 cache. So every read of a latent, in prefill or decode, with prefix caching
  on or off, sees the same values.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
)
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.ops.merge_attn_states import merge_attn_states
from vllm.v1.attention.ops.triton_merge_attn_states import mask_empty_context

from kvarn_vllm.mla_config import mla_preset_for

__all__ = ["KvarnMLAImpl", "KvarnMLAMetadataBuilder", "context_rows"]


class KvarnMLAMetadataBuilder(MLACommonMetadataBuilder[MLACommonMetadata]):
    """vLLM's MLA metadata: decode reads ``decode.block_table`` and ``decode.seq_lens``
    (device tensors of fixed shape), so single-token decode batches run in full CUDA graphs."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )


def context_rows(
    records: torch.Tensor,
    block_table: torch.Tensor,
    chunk_lens: list[int],
    chunk_start: int,
    preset: Any,
    latent_dim: int,
    rope_dim: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """Dequantize one context chunk of each prefill into ``out`` (vLLM's context workspace).

    Prefill ``s`` contributes its positions ``[chunk_start, chunk_start + chunk_lens[s])``, in
    order after the previous prefills' rows (vLLM's ``cu_seq_lens`` of the chunk).

    Args:
        records: uint8 ``[num_blocks, tile_bytes]`` one layer's cache.
        block_table: int32 ``[num_prefills, max_blocks]`` the prefills' rows.
        chunk_lens: host ints, context positions of each prefill in this chunk.
        chunk_start: first context position of the chunk (a multiple of ``G``: vLLM aligns
            context chunks to the block size).
        preset: the MLA preset.
        latent_dim, rope_dim: ``L``, ``R``.
        out: ``[>= sum(chunk_lens), L + R]`` in the model dtype, last dim contiguous.

    Returns:
        ``out[:sum(chunk_lens)]``.
    """
    from kvarn_kernels.mla import dequantize_latent

    g = preset.group_size
    if chunk_start % g:
        raise ValueError(f"chunk_start must be a multiple of G={g}, got {chunk_start}")
    first = chunk_start // g
    offset = 0
    for row, count in enumerate(chunk_lens):
        full, rest = divmod(count, g)
        if full:
            dequantize_latent(
                records,
                block_table[row, first : first + full],
                preset,
                latent_dim,
                rope_dim,
                dtype=out.dtype,
                out=out[offset : offset + full * g],
            )
        if rest:
            tail = dequantize_latent(
                records,
                block_table[row, first + full : first + full + 1],
                preset,
                latent_dim,
                rope_dim,
                dtype=out.dtype,
            )
            out[offset + full * g : offset + count].copy_(tail[:rest])
        offset += count
    return out[:offset]


class KvarnMLAImpl(MLACommonImpl[MLACommonMetadata]):
    """MLA over KVarN latent records: quantize-on-write, latent-space decode on the kvarn
    kernel, vLLM's prefill over the records' values."""

    can_return_lse_for_decode: bool = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        **mla_args: Any,
    ) -> None:
        super().__init__(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            alibi_slopes,
            sliding_window,
            kv_cache_dtype,
            logits_soft_cap,
            attn_type,
            kv_sharing_target_layer_name,
            **mla_args,
        )
        unsupported = {
            "alibi_slopes": alibi_slopes,
            "sliding_window": sliding_window,
            "logits_soft_cap": logits_soft_cap,
        }
        given = [name for name, value in unsupported.items() if value]
        if given:
            raise ValueError(f"the kvarn MLA backend does not serve {', '.join(given)}")
        self.mla_preset = mla_preset_for(kv_cache_dtype)
        self.rope_dim = head_size - self.kv_lora_rank
        from kvarn_math.mla import mla_layout

        self.tile_bytes = mla_layout(self.mla_preset, self.kv_lora_rank, self.rope_dim).tile_bytes
        # the query stays in the model dtype: the kernel dequantizes records itself
        self.supports_quant_query_input = False

    def _records(self, kv_cache: torch.Tensor) -> torch.Tensor:
        records = kv_cache if kv_cache.dtype == torch.uint8 else kv_cache.view(torch.uint8)
        if records.dim() != 2 or records.shape[1] != self.tile_bytes:
            raise ValueError(
                f"kv_cache must be [num_blocks, {self.tile_bytes}] uint8 records of "
                f"{self.mla_preset.name}, got {tuple(kv_cache.shape)} {kv_cache.dtype}"
            )
        return records

    def do_kv_cache_update(
        self,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache_dtype: str,
        k_scale: torch.Tensor,
    ) -> None:
        """Quantize each token ``[T, L]`` latent / ``[T, 1, R]`` RoPE key into its record row
        (``slot_mapping`` ``[T]``; ``< 0`` is padding and writes nothing)."""
        if kv_cache.numel() == 0:  # the profiling run, before the cache exists
            return
        from kvarn_kernels.mla import store_latent

        slots = slot_mapping.flatten()
        count = slots.shape[0]
        rope = k_pe.reshape(k_pe.shape[0], -1)
        store_latent(
            kv_c_normed[:count], rope[:count], self._records(kv_cache), slots, self.mla_preset
        )

    def _through_records(
        self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The values the records hold for these tokens: stored into scratch records and read
        back with the same kernels (rows depend on their own token only, so these are the bytes
        ``do_kv_cache_update`` wrote)."""
        from kvarn_kernels.mla import dequantize_latent, store_latent

        count, g = kv_c_normed.shape[0], self.mla_preset.group_size
        tiles = -(-count // g)
        device = kv_c_normed.device
        scratch = torch.empty((tiles, self.tile_bytes), dtype=torch.uint8, device=device)
        rope = k_pe.reshape(count, -1)
        slots = torch.arange(count, dtype=torch.int64, device=device)
        store_latent(kv_c_normed, rope, scratch, slots, self.mla_preset)
        blocks = torch.arange(tiles, dtype=torch.int32, device=device)
        rows = dequantize_latent(
            scratch,
            blocks,
            self.mla_preset,
            self.kv_lora_rank,
            self.rope_dim,
            dtype=kv_c_normed.dtype,
        )[:count]
        return rows[:, : self.kv_lora_rank], rows[:, self.kv_lora_rank :].view(k_pe.shape)

    def forward_mha(  # type: ignore[override]
        self,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: MLACommonMetadata,
        k_scale: torch.Tensor,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
    ) -> None:
        """vLLM's MLA prefill with the step's tokens read through their records."""
        latent, rope = self._through_records(kv_c_normed, k_pe)
        super().forward_mha(
            q, latent, rope, kv_c_and_k_pe_cache, attn_metadata, k_scale, output, output_scale
        )

    def _compute_prefill_context(  # type: ignore[override]
        self,
        q: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: MLACommonMetadata,
        k_scale: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of the prefill queries to their cached context, chunk by chunk as vLLM
        plans it; each chunk's latents come from the records (:func:`context_rows`) instead of
        vLLM's bf16 gather, then ``kv_b_proj`` and vLLM's prefill backend as in vLLM, the
        chunks merged by their log-sum-exp."""
        prefill = attn_metadata.prefill
        assert prefill is not None and prefill.chunked_context is not None
        chunks = prefill.chunked_context
        backend = prefill.prefill_backend
        assert backend is not None
        records = self._records(kv_c_and_k_pe_cache)
        lens = chunks.seq_lens  # host [num_chunks, num_prefills]
        # vLLM starts chunk i of every prefill at i * max_chunk (block-aligned)
        max_chunk = int(lens[0].max())
        output: torch.Tensor | None = None
        lse: torch.Tensor | None = None
        for i in range(len(chunks.seq_tot)):
            rows = context_rows(
                records,
                prefill.block_table,
                [int(n) for n in lens[i]],
                i * max_chunk,
                self.mla_preset,
                self.kv_lora_rank,
                self.rope_dim,
                chunks.workspace,
            )
            latent = rows[:, : self.kv_lora_rank]
            rope = rows[:, self.kv_lora_rank :].unsqueeze(1)
            kv_nope = self.kv_b_proj(latent)[0].view(
                -1, self.num_heads, self.qk_nope_head_dim + self.v_head_dim
            )
            k_nope, v = kv_nope.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
            k = self._concat_k_nope_k_pe(k_nope, rope)
            part, part_lse = backend.run_prefill_context_chunk(chunk_idx=i, q=q, k=k, v=v)
            if chunks.has_empty_context[i]:
                mask_empty_context(part_lse, part, prefill.query_start_loc, chunks.cu_seq_lens[i])
            if output is None or lse is None:
                output, lse = part, part_lse
                continue
            merged, merged_lse = torch.empty_like(output), torch.empty_like(lse)
            merge_attn_states(
                output=merged,
                output_lse=merged_lse,
                prefix_output=output,
                prefix_lse=lse,
                suffix_output=part,
                suffix_lse=part_lse,
            )
            output, lse = merged, merged_lse
        assert output is not None and lse is not None
        return output, lse

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: MLACommonMetadata,
        layer: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode: ``q`` is ``([B, H, L] absorbed no-RoPE query, [B, H, R] RoPE query)`` (or
        both concatenated); returns ``([B, H, L]`` output in latent space, ``None)``."""
        from kvarn_kernels.mla import dequantize_latent, mla_decode_attention

        decode = attn_metadata.decode
        assert decode is not None
        if isinstance(q, tuple):
            q_latent, q_rope = q
        else:
            q_latent, q_rope = q.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        records = self._records(kv_c_and_k_pe_cache)
        batch, g = q_latent.shape[0], self.mla_preset.group_size
        seq_lens = decode.seq_lens[:batch]
        block_table = decode.block_table[:batch]
        # the open tile: its record's rows, dequantized into a ring of one tile per sequence
        open_tile = ((seq_lens - 1).clamp(min=0) // g).long()
        open_blocks = block_table.gather(1, open_tile[:, None]).squeeze(1)
        ring = dequantize_latent(
            records,
            open_blocks,
            self.mla_preset,
            self.kv_lora_rank,
            self.rope_dim,
            dtype=q_latent.dtype,
        ).view(batch, g, self.kv_lora_rank + self.rope_dim)
        quantized_lens = (seq_lens // g) * g
        ring_slots = torch.arange(batch, dtype=torch.int32, device=q_latent.device)
        out = torch.empty(
            (batch, q_latent.shape[1], self.kv_lora_rank),
            dtype=q_latent.dtype,
            device=q_latent.device,
        )
        mla_decode_attention(
            q_latent,
            q_rope,
            records,
            ring,
            block_table,
            seq_lens,
            quantized_lens,
            ring_slots,
            self.mla_preset,
            self.scale,
            out=out,
        )
        return out, None
