"""A Llama-style model in MLA form: one shared latent plus a decoupled RoPE key per token.

DeepSeek's multi-head latent attention caches, per token and layer, a latent ``c_kv`` of width
``kv_lora_rank`` (keys without RoPE and values are up-projections of it) and one RoPE key
``k_pe`` shared by every head. No model with trained MLA weights installs here, so this module
converts a real grouped-query model into that form from its own weights and activations (the
idea of TransMLA, arXiv:2502.07864, and MHA2MLA, arXiv:2502.14837), without training:

1. **Shared RoPE key** (TransMLA's RoRoPE): write each KV head's pre-RoPE key as ``D/2``
   complex numbers ``z[g, i] = k[g, i] + j k[g, i + D/2]`` (the ``rotate_half`` pairs). RoPE
   multiplies ``z[:, i]`` by one phase for every head, so a unitary mix ``U_i`` across the KV
   heads commutes with it: ``w[:, i] = U_i^H z[:, i]``, ``U_i`` the principal axes of ``z[:, i]``
   over calibration tokens. The ``rope_pairs`` components ``w[c, i]`` with the largest
   attention-weighted logit energy form the shared RoPE key (``k_pe``, width ``2 * rope_pairs``,
   after RoPE as DeepSeek caches it); a query of KV group ``g`` reads component ``(c, i)``
   through ``q_i * conj(U_i[g, c])``: exact.
2. **NoPE part**: the other components of the ``nope_freqs`` lowest frequencies turn by less
   than about a radian over 1K tokens, so they are kept without RoPE (pre-RoPE key and query),
   in the latent; the other components are dropped (the conversion's loss, with the rank).
3. **Latent** (data-aware low rank, not a weight SVD): ``[alpha * nope; v]`` over calibration
   tokens is factored by PCA into ``rank`` channels (``alpha`` balances the key and value energy),
   and each latent channel is scaled to unit variance (like the RMS-normalized latent of DeepSeek;
   the scales fold into the up-projections, exactly).

Measured on SmolLM2-135M (``docs/mla.md``): the model has no spare RoPE capacity; a 64-wide RoPE
key (32 of its 96 pairs, 0.65% of that logit energy dropped) costs +61% perplexity without
training, a 128-wide one +9%.

The attention of :class:`MLAAttention` is computed in float32 in the expanded form (keys and
values up-projected from the latent); the absorbed form gives the same numbers. With
:func:`latent_quantization` active, every key block before a query's own (except the first, the
sink) is read from the latent and RoPE key quantized by a latent method, as in the dense
pseudo-decode of :mod:`kvarn_eval.accuracy.pseudo_decode`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "LatentMethod",
    "LatentQuantization",
    "MLAConversion",
    "MLAAttention",
    "collect_attention_inputs",
    "convert_layer",
    "convert_model",
    "latent_quantization",
    "collected_latents",
]


class LatentMethod(Protocol):
    """A latent cache format: ``roundtrip(latent [T, L], rope [T, R]) -> (latent, rope)``
    (float32 numpy), quantizing tiles of ``group_size`` tokens."""

    name: str
    group_size: int

    def roundtrip(
        self, latent: np.ndarray, rope: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]: ...  # pragma: no cover - protocol


@dataclass(frozen=True)
class LatentQuantization:
    """How :class:`MLAAttention` reads earlier blocks: ``method`` (``None``: exact float32),
    ``block_size`` tokens per block, the first ``sink`` tokens always exact."""

    method: LatentMethod | None
    block_size: int = 128
    sink: int = 128


_ACTIVE: ContextVar[LatentQuantization | None] = ContextVar("kvarn_mla", default=None)
_COLLECT: ContextVar[list[tuple[int, np.ndarray, np.ndarray]] | None] = ContextVar(
    "kvarn_mla_collect", default=None
)


@contextlib.contextmanager
def latent_quantization(config: LatentQuantization) -> Iterator[LatentQuantization]:
    """Make every :class:`MLAAttention` forward pass in the block read quantized latents."""
    token = _ACTIVE.set(config)
    try:
        yield config
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def collected_latents() -> Iterator[list[tuple[int, np.ndarray, np.ndarray]]]:
    """Collect ``(layer, latent [T, L], k_pe [T, R])`` of batch row 0 of every forward pass."""
    out: list[tuple[int, np.ndarray, np.ndarray]] = []
    token = _COLLECT.set(out)
    try:
        yield out
    finally:
        _COLLECT.reset(token)


@dataclass(frozen=True)
class MLAConversion:
    """Settings of the conversion.

    Attributes:
        rank: latent width ``L`` (``kv_lora_rank``).
        rope_pairs: complex pairs of the shared RoPE key (its width ``R`` is twice this).
        nope_freqs: lowest RoPE frequencies whose pairs not in the RoPE key are kept without RoPE.
        balance: scale the NoPE keys to the values' mean energy before the PCA.
        whiten: scale each latent channel to unit variance.
    """

    rank: int
    rope_pairs: int = 32
    nope_freqs: int = 8
    balance: bool = True
    whiten: bool = True


def collect_attention_inputs(model: Any, chunks: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """The input of every layer's attention (after its input norm) over ``chunks``:
    ``[layers]`` of ``[tokens, hidden]`` float32, from the original model."""
    layers = model.model.layers
    store: list[list[torch.Tensor]] = [[] for _ in layers]
    hooks = [
        layer.self_attn.register_forward_pre_hook(
            lambda mod, args, kwargs, i=i: store[i].append(kwargs["hidden_states"][0].detach()),
            with_kwargs=True,
        )
        for i, layer in enumerate(layers)
    ]
    try:
        with torch.no_grad():
            for ids in chunks:
                model(torch.tensor([list(ids)]))
    finally:
        for h in hooks:
            h.remove()
    return [torch.cat(s) for s in store]


def _complex_pairs(k: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` real in ``rotate_half`` layout -> ``[..., D/2]`` complex."""
    half = k.shape[-1] // 2
    return torch.complex(k[..., :half], k[..., half:])


def _real_pairs(z: torch.Tensor) -> torch.Tensor:
    return torch.cat([z.real, z.imag], dim=-1)


class MLAAttention(nn.Module):
    """A converted attention layer: latent ``c = W_dkv x`` ``[L]``, RoPE key ``k_pe`` ``[D]``.

    Buffers (float32 unless noted): ``w_dkv [L, hidden]``, ``u_nope [n, L]`` (NoPE keys from the
    latent), ``u_v [G*D, L]`` (values from the latent), ``w_kpe [R, hidden]`` (pre-RoPE shared
    key), ``mix [D/2, G, G]`` complex64 (the per-frequency unitary), ``rope_c, rope_i`` and
    ``nope_c, nope_i`` (int64: the component and frequency of each RoPE and NoPE pair).
    """

    q_proj: nn.Module
    o_proj: nn.Module
    head_dim: int
    layer_idx: int
    scaling: float
    heads: int
    kv_heads: int
    # buffers (registered in __init__)
    w_dkv: torch.Tensor
    u_nope: torch.Tensor
    u_v: torch.Tensor
    w_kpe: torch.Tensor
    mix: torch.Tensor
    rope_c: torch.Tensor
    rope_i: torch.Tensor
    nope_c: torch.Tensor
    nope_i: torch.Tensor

    def __init__(self, original: Any, buffers: dict[str, torch.Tensor], heads: int) -> None:
        super().__init__()
        self.q_proj = original.q_proj
        self.o_proj = original.o_proj
        self.head_dim = original.head_dim
        self.layer_idx = original.layer_idx
        self.scaling = original.scaling
        self.heads = heads
        self.kv_heads = buffers["mix"].shape[-1]
        for name, value in buffers.items():
            self.register_buffer(name, value, persistent=False)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent ``[B, T, L]`` and RoPE key after RoPE ``[B, T, R]`` of hidden states ``x``."""
        latent = x @ self.w_dkv.T
        return latent, self._rope(x @ self.w_kpe.T, cos, sin)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on ``[..., R]`` in ``[Re | Im]`` layout, pair ``j`` at frequency ``rope_i[j]``."""
        half = self.head_dim // 2
        c = cos[..., :half][..., self.rope_i]
        s = sin[..., :half][..., self.rope_i]
        if x.dim() == 4:  # [B, T, H, R]
            c, s = c[:, :, None], s[:, :, None]
        return x * torch.cat([c, c], -1) + _rotate_half(x) * torch.cat([s, s], -1)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        b, t, _ = hidden_states.shape
        cos, sin = position_embeddings
        q = self.q_proj(hidden_states).view(b, t, self.heads, self.head_dim)
        group = torch.arange(self.heads) // (self.heads // self.kv_heads)
        u = self.mix[:, group]  # [D/2, H, G]: U_i[g(h), c]
        zq = _complex_pairs(q)  # [B, T, H, D/2], pre-RoPE
        # q' = zq_i * conj(U_i[g, c]) for each kept pair (c, i); RoPE commutes with the mix
        q_pe = zq[..., self.rope_i] * u[self.rope_i, :, self.rope_c].conj().T
        q_pe = self._rope(_real_pairs(q_pe), cos, sin)
        q_nope = _real_pairs(zq[..., self.nope_i] * u[self.nope_i, :, self.nope_c].conj().T)

        latent, k_pe = self.project(hidden_states, cos, sin)
        collect = _COLLECT.get()
        if collect is not None:
            collect.append((self.layer_idx, latent[0].numpy().copy(), k_pe[0].numpy().copy()))
        config = _ACTIVE.get()
        keys_q = torch.cat([q_pe, q_nope], dim=-1).transpose(1, 2)  # [B, H, T, R + n]
        k_exact, v_exact = self._expand(latent, k_pe)
        if config is None or config.method is None:
            keys, values = k_exact, v_exact
            mask = torch.ones(t, t, dtype=torch.bool).tril()
        else:
            lat_q, pe_q = _roundtrip(config, latent, k_pe)
            k_hat, v_hat = self._expand(lat_q, pe_q)
            keys = torch.cat([k_hat, k_exact], dim=2)
            values = torch.cat([v_hat, v_exact], dim=2)
            mask = _block_mask(t, config.block_size, config.sink)
        out = F.scaled_dot_product_attention(
            keys_q, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=True
        )
        out = out.transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(out), None

    def _expand(
        self, latent: torch.Tensor, k_pe: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[B, 1, T, D + n]`` (shared by every head) and values ``[B, G, T, D]``."""
        b, t, _ = latent.shape
        nope = latent @ self.u_nope.T
        keys = torch.cat([k_pe, nope], dim=-1)[:, None].expand(b, self.kv_heads, t, -1)
        values = (latent @ self.u_v.T).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return keys, values


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _roundtrip(
    config: LatentQuantization, latent: torch.Tensor, k_pe: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent and RoPE key of every batch row with its complete blocks after the sink
    quantized (the rest exact; the mask reads only what the method quantized)."""
    assert config.method is not None
    lat = latent.clone()
    pe = k_pe.clone()
    t = latent.shape[1]
    stop = (t // config.block_size) * config.block_size
    start = config.sink
    if stop > start:
        for row in range(latent.shape[0]):
            lq, pq = config.method.roundtrip(
                latent[row, start:stop].numpy(), k_pe[row, start:stop].numpy()
            )
            lat[row, start:stop] = torch.from_numpy(np.asarray(lq, dtype=np.float32))
            pe[row, start:stop] = torch.from_numpy(np.asarray(pq, dtype=np.float32))
    return lat, pe


def _block_mask(t: int, block: int, sink: int) -> torch.Tensor:
    """``[T, 2T]``: query ``i`` reads quantized key ``j`` (first half) when ``j`` lies in a
    block before ``i``'s and ``j >= sink``; exact key ``j`` (second half) when ``j <= i`` and
    ``j`` is in ``i``'s block or ``j < sink``."""
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    earlier = (j // block) < (i // block)
    quant = earlier & (j >= sink)
    exact = (j <= i) & (~earlier | (j < sink))
    return torch.cat([quant, exact], dim=1)


def _principal_mix(z: torch.Tensor) -> torch.Tensor:
    """Per frequency, the unitary ``U_i`` ``[D/2, G, G]`` whose columns are the principal axes
    of ``z[:, :, i]`` ``[N, G, D/2]`` complex, by decreasing energy."""
    cov = torch.einsum("ngi,nhi->igh", z, z.conj()) / z.shape[0]
    _, vecs = torch.linalg.eigh(cov)  # ascending
    return vecs.flip(-1)


def _pair_importance(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_k: torch.Tensor,
    mix: torch.Tensor,
    heads: int,
    rope_theta: float,
    chunk_len: int,
) -> torch.Tensor:
    """``[G, D/2]``: each mixed pair's attention-weighted logit energy,
    ``sum_{h,t} |q'_hci(t)|^2 sum_s p_h(t, s) |w_ci(s)|^2`` over the first two calibration
    chunks, ``p`` the original layer's causal attention (so a sink token that most queries
    attend to counts as much as it is read)."""
    d = mix.shape[0] * 2
    g = mix.shape[-1]
    group = torch.arange(heads) // (heads // g)
    u2 = mix[:, group].abs() ** 2  # [D/2, H, G]
    pos = torch.arange(chunk_len, dtype=torch.float64)
    inv = rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None] * inv[None, :]
    phase = torch.polar(torch.ones_like(ang), ang)  # [T, D/2]
    total = torch.zeros(g, d // 2, dtype=torch.float64)
    for start in range(0, min(x.shape[0], 2 * chunk_len), chunk_len):
        xc = x[start : start + chunk_len]
        zq = _complex_pairs((xc @ w_q.T).view(-1, heads, d))  # [T, H, D/2]
        zk = _complex_pairs((xc @ w_k.T).view(-1, g, d))  # [T, G, D/2]
        qr, kr = zq * phase[:, None], zk * phase[:, None]
        logits = torch.einsum("thi,shi->hts", qr, kr[:, group].conj()).real / math.sqrt(d)
        mask = torch.ones(chunk_len, chunk_len, dtype=torch.bool).tril()
        p = logits.masked_fill(~mask, float("-inf")).softmax(-1)  # [H, T, S]
        w2 = torch.einsum("igc,sgi->sci", mix.conj(), zk).abs() ** 2  # [S, G, D/2]
        read = torch.einsum("hts,sci->htci", p, w2)
        total += torch.einsum("thi,ihc,htci->ci", zq.abs() ** 2, u2, read)
    return total


def convert_layer(
    attn: Any,
    x: torch.Tensor,
    settings: MLAConversion,
    rope_theta: float,
    heads: int,
    chunk_len: int,
) -> tuple[MLAAttention, dict[str, float]]:
    """Convert one attention layer from its calibration inputs ``x`` ``[N, hidden]`` (chunks
    of ``chunk_len`` tokens, each from position 0).

    Each (component ``c``, frequency ``i``) pair of the mixed keys is scored by its
    attention-weighted logit energy (:func:`_pair_importance`); the ``rope_pairs`` best form the
    RoPE key, the others of the ``nope_freqs`` lowest frequencies go to the latent without RoPE,
    the rest are dropped. Returns the module and statistics: ``dropped_logit_share`` (share of
    that score dropped), ``nope_logit_share``, ``latent_energy`` (fraction of the balanced
    ``[nope; v]`` energy the latent keeps), ``nope_angle_per_1k_tokens`` (the largest RoPE angle
    a NoPE pair ignores over 1,024 tokens).
    """
    d = attn.head_dim
    half = d // 2
    w_k = attn.k_proj.weight.detach().double()  # [G*D, hidden]
    w_v = attn.v_proj.weight.detach().double()
    w_q = attn.q_proj.weight.detach().double()
    g = w_k.shape[0] // d
    xd = x.double()
    z = _complex_pairs((xd @ w_k.T).view(-1, g, d))  # [N, G, D/2]
    mix = _principal_mix(z)  # [D/2, G, G]
    score = _pair_importance(xd, w_q, w_k, mix, heads, rope_theta, chunk_len)  # [G, D/2]
    order = torch.argsort(score.flatten(), descending=True)
    rope_sel = torch.zeros(g * half, dtype=torch.bool)
    rope_sel[order[: settings.rope_pairs]] = True
    rope_sel = rope_sel.view(g, half)
    low = torch.arange(half) >= half - settings.nope_freqs
    nope_sel = ~rope_sel & low[None, :]
    rope_c, rope_i = rope_sel.nonzero(as_tuple=True)
    nope_c, nope_i = nope_sel.nonzero(as_tuple=True)
    # from the key weights' rows to components: w[c, i] = sum_g conj(U[i, g, c]) z[g, i]
    zw = _complex_pairs(w_k.T.reshape(-1, g, d))  # [hidden, G, D/2]
    comp = torch.einsum("igc,xgi->xci", mix.conj(), zw)  # [hidden, G, D/2]
    w_kpe = _real_pairs(comp[:, rope_c, rope_i]).T  # [R, hidden]
    w_nope = _real_pairs(comp[:, nope_c, nope_i]).T  # [n, hidden]

    nope = xd @ w_nope.T
    vals = xd @ w_v.T
    alpha = 1.0
    if settings.balance and nope.shape[1]:
        alpha = math.sqrt(float(vals.pow(2).sum() / nope.pow(2).sum()))
    stacked = torch.cat([alpha * nope, vals], dim=1)  # [N, n + G*D]
    evals, evecs = torch.linalg.eigh(stacked.T @ stacked / stacked.shape[0])
    evals, evecs = evals.flip(0), evecs.flip(1)
    p = evecs[:, : settings.rank]  # [n + G*D, L]
    w_dkv = p.T @ torch.cat([alpha * w_nope, w_v], dim=0)  # [L, hidden]
    up = p.clone()
    if settings.whiten:
        sigma = evals[: settings.rank].clamp_min(1e-12).sqrt()
        w_dkv = w_dkv / sigma[:, None]
        up = up * sigma[None, :]
    n = w_nope.shape[0]
    buffers = {
        "w_dkv": w_dkv.float(),
        "u_nope": (up[:n] / alpha).float(),
        "u_v": up[n:].float(),
        "w_kpe": w_kpe.float(),
        "mix": mix.to(torch.complex64),
        "rope_c": rope_c,
        "rope_i": rope_i,
        "nope_c": nope_c,
        "nope_i": nope_i,
    }
    total = float(score.sum())
    stats = {
        "dropped_logit_share": float(score[~rope_sel & ~nope_sel].sum()) / total,
        "nope_logit_share": float(score[nope_sel].sum()) / total,
        "latent_energy": float(evals[: settings.rank].sum() / evals.sum()),
        "nope_angle_per_1k_tokens": 1024 * rope_theta ** (-2 * (half - settings.nope_freqs) / d),
    }
    return MLAAttention(attn, buffers, heads), stats


def _cov(z: torch.Tensor) -> torch.Tensor:
    return torch.einsum("ngi,nhi->igh", z, z.conj()) / z.shape[0]


def convert_model(
    model: Any, calibration: Sequence[Sequence[int]], settings: MLAConversion
) -> list[dict[str, float]]:
    """Replace every attention layer of a Llama-style ``model`` by its :class:`MLAAttention`
    (in place); returns each layer's conversion statistics."""
    config = model.config
    rope = getattr(config, "rope_parameters", None) or {}
    theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    inputs = collect_attention_inputs(model, calibration)
    stats = []
    for layer, x in zip(model.model.layers, inputs, strict=True):
        new, st = convert_layer(
            layer.self_attn, x, settings, theta, config.num_attention_heads, len(calibration[0])
        )
        layer.self_attn = new
        stats.append(st)
    return stats
