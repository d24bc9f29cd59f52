#!/usr/bin/env python3
"""kvarn's MLA decode glue on the GPU, without an engine (``mla_evidence.py``'s ``impl`` phase).

``KvarnMLAImpl.forward_mqa`` (the open tile's record dequantized into a ring, then
``mla_decode_attention``) at the DeepSeek shape (latent 512 + RoPE 64) with 16 and 128 query heads,
8 sequences of up to 8K tokens on shuffled blocks, bf16: eager against an fp32 reference over the
records' values (``dequantize_latent``), then captured in a CUDA graph and replayed with other
lengths and block tables, as vLLM's full decode graphs replay it. Prints the relative errors.

    python mla_decode_check.py [kvarn_mla_l4_g128]
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace
from typing import Any

KVARN = "kvarn_mla_l4_g128"


def decode_case(
    impl: Any, seed: int, device: str = "cuda", dtype: Any = None, batch: int = 8, blocks: int = 64
) -> dict[str, Any]:
    """kvarn's MLA decode (``KvarnMLAImpl.forward_mqa``) at a real shape on the GPU, eager against
    an fp32 reference over the records' values, then captured in a CUDA graph and replayed with
    other lengths and block tables (what vLLM's full decode graphs do)."""
    import torch
    from kvarn_kernels.mla import dequantize_latent

    dtype = dtype or torch.bfloat16
    heads, g, dev = impl.num_heads, impl.mla_preset.group_size, device
    gen = torch.Generator(device=dev).manual_seed(seed)
    num_blocks = 2 * batch * blocks
    cache = torch.zeros((num_blocks, impl.tile_bytes), dtype=torch.uint8, device=dev)
    rows = torch.randn(num_blocks * g, 576, generator=gen, device=dev, dtype=dtype)
    slots = torch.arange(num_blocks * g, device=dev)
    impl.do_kv_cache_update(rows[:, :512], rows[:, None, 512:], cache, slots, "", None)

    def inputs(step: int) -> tuple[Any, Any]:
        perm = torch.randperm(num_blocks, generator=gen, device=dev)[: batch * blocks]
        table = perm.view(batch, blocks).to(torch.int32)
        lens = torch.randint(1, blocks * g, (batch,), generator=gen, device=dev).to(torch.int32)
        lens[0] = 1 + step  # a single key, then a few
        return table, lens

    q_lat = torch.randn(batch, heads, 512, generator=gen, device=dev, dtype=dtype)
    q_pe = torch.randn(batch, heads, 64, generator=gen, device=dev, dtype=dtype)

    def reference(table: Any, lens: Any) -> Any:
        outs = []
        for b in range(batch):
            n = int(lens[b])
            got = dequantize_latent(
                cache, table[b, : -(-n // g)], impl.mla_preset, dtype=torch.float32
            )[:n]
            scores = impl.scale * (
                q_lat[b].float() @ got[:, :512].T + q_pe[b].float() @ got[:, 512:].T
            )
            outs.append(torch.softmax(scores, -1) @ got[:, :512])
        return torch.stack(outs)

    def rel(a: Any, b: Any) -> float:
        return float((a.float() - b).norm() / b.norm())

    table, lens = inputs(0)
    meta = SimpleNamespace(decode=SimpleNamespace(block_table=table.clone(), seq_lens=lens.clone()))
    eager, _ = impl.forward_mqa((q_lat, q_pe), cache, meta, None)
    result = {"heads": heads, "eager_rel_err": rel(eager, reference(table, lens))}
    if dev != "cuda":
        return result
    impl.forward_mqa((q_lat, q_pe), cache, meta, None)  # warm-up before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, _ = impl.forward_mqa((q_lat, q_pe), cache, meta, None)
    errors = []
    for step in range(1, 4):
        table, lens = inputs(step)
        meta.decode.block_table.copy_(table)
        meta.decode.seq_lens.copy_(lens)
        graph.replay()
        errors.append(rel(captured, reference(table, lens)))
    result["graph_replay_rel_err"] = max(errors)
    return result


def impl_check(cache_dtype: str = KVARN) -> dict[str, Any]:
    """The decode glue at 16 (DeepSeek-V2-Lite) and 128 (DeepSeek-V3) heads, no engine."""
    return {"cases": [decode_case(make_impl(h, cache_dtype), seed=h) for h in (16, 128)]}


def make_impl(heads: int, cache_dtype: str = KVARN, device: str = "cuda") -> Any:
    """A ``KvarnMLAImpl`` of the DeepSeek MLA shape (latent 512 + RoPE 64) outside an engine."""
    import torch
    from kvarn_vllm.mla_impl import KvarnMLAImpl
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device=device))):
        return KvarnMLAImpl(
            num_heads=heads, head_size=576, scale=192**-0.5, num_kv_heads=1,
            alibi_slopes=None, sliding_window=None, kv_cache_dtype=cache_dtype,
            logits_soft_cap=None, attn_type="decoder", kv_sharing_target_layer_name=None,
            q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
            qk_head_dim=192, v_head_dim=128, kv_b_proj=torch.nn.Linear(512, 8, bias=False),
        )  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(impl_check(*sys.argv[1:2]), indent=1))
