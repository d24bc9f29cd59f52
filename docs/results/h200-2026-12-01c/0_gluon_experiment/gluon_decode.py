"""Experiment: Gluon decode attention over kvarn_k4v2_g128 records with register-only MMA operands.

Scope (see README.md): the quantized-tile part of decode attention only. 4-bit keys, 2-bit values,
tiles of G = 128 tokens, head_dim D = 128, GQA group <= 8 (4 in the benchmark), fp16 queries already
in the rotated frame, every tile complete and visible, keys stored rotated (flags ignored).

Layout of the work (num_warps = 4, mma.sync m16n8k16, fp16 x fp16 -> fp32):

* The four warps are the *batch* dimension of a rank-3 ``NVMMADistributedLayout(warps_per_cta=
  [4, 1, 1], instr_shape=[1, 16, 8])``: warp ``w`` owns tokens ``[32 w, 32 w + 32)`` of every tile
  and keeps its own online softmax; the warps meet once, after the loop. No barrier, no shared
  memory in the loop.
* ``S = Q K`` with M = query heads (padded to 16), N = 32 tokens per warp, K = 128 channels. The
  B operand (key codes) is loaded straight from global memory into the B fragment registers: lane
  ``(g, tig)`` loads, for each of its 32 channels, the one uint16 of that channel row that holds
  tokens ``4 c .. 4 c + 3`` with ``c = 8 w + g``; two channel rows (k, k + 1) form one 32-bit
  register and four AND/OR (+ one HSUB2 each) give the four fp16x2 B registers of those tokens.
  Logical token ``n`` of a warp is physical token ``32 w + 4 (n % 8) + n // 8``.
* Only rows 0..7 of S are kept (``split``); their C registers are, element for element, the B
  fragment of ``P^T`` (tokens x heads), so ``O^T = V^T P^T`` (M = 128 channels, N = 8 heads,
  K = 32 tokens) takes P without any data movement.
* The A operand of that product (value codes, transposed) is loaded straight into registers too:
  lane ``(g, tig)`` loads the uint32 holding channels ``16 g .. 16 g + 15`` of each of its 8
  tokens; logical channel ``m`` is physical channel ``16 (m % 8) + m // 8``.
* Zero points and the mantissa-trick offset ride on the tensor cores: the key bias
  ``sum_d q[d] k_zero[d]`` is an extra 8-column MMA of the (unscaled) fp16 query against k_zero,
  the value bias ``sum_t p[t] v_zero[t]`` an extra 16-row MMA of v_zero against fp16 P; with
  ``FOLD_K`` / ``FOLD_V`` the codes stay ``1024 + code`` (no HSUB2) and ``-1024 * sum`` of the
  same fp16 operands is accumulated by one more MMA.

Nothing here touches CUDA at import time.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import constexpr_function
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

PRESET = "kvarn_k4v2_g128"
G_TOK = 128
HEAD_DIM = 128
NUM_WARPS = 4
LOG2E = 1.4426950408889634
NEG_BIG: gl.constexpr = gl.constexpr(-1.0e30)

# ---------------------------------------------------------------------------------------------
# Layouts (all for num_warps = 4; warps are dimension 0, the batch of the batched mma).
# ---------------------------------------------------------------------------------------------
_MMA = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8])
MMA = gl.constexpr(_MMA)
A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA, k_width=2))
B_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=_MMA, k_width=2))
_WARPS = [[1, 0, 0], [2, 0, 0]]
# Key words [4 warps, 128 channels k, 8 column groups g] (uint16): exactly the B fragment of
# [4, 128, 32] with the token bits 3, 4 (registers) removed; channel bit 0 is register bit 0, so
# channels k and k + 1 share one 32-bit register (what the unpacking asm wants).
KW_L = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1, 0], [0, 8, 0], [0, 16, 0], [0, 32, 0], [0, 64, 0]],
    lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]],
    warp_bases=_WARPS,
    block_bases=[],
    shape=[4, 128, 8],
))
# Value words [4 warps, 32 tokens k, 8 byte groups g] (uint32): the A fragment of [4, 128, 32]
# with the channel bits 3..6 (registers) removed; token bit 0 is register bit 0.
VW_L = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1, 0], [0, 8, 0], [0, 16, 0]],
    lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]],
    warp_bases=_WARPS,
    block_bases=[],
    shape=[4, 32, 8],
))
# Rows 0..7 of the S accumulator [4, 8 heads, 32 tokens] (the C layout without register bit
# "row + 8").
ST_L = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 8], [0, 0, 16]],
    lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
    warp_bases=_WARPS,
    block_bases=[],
    shape=[4, 8, 32],
))

# Load layouts whose dimensions are each all-register or all-lane, so that every address is one
# per-thread base plus a compile-time constant (ptxas folds it into the load's immediate).
# Key channel permutation: logical k = b + 2 tig + 8 i + 16 ks (b, i, ks registers, tig lanes)
# is physical channel 32 tig + 4 ks + 2 i + b, so each lane's 32 channels are contiguous.
# Key words [4, ks 8, i 2, tig 4, b 2, g 8] (uint16): reshaped, exactly KW_L.
KW6_L = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 0, 0, 1, 0], [0, 0, 1, 0, 0, 0], [0, 1, 0, 0, 0, 0], [0, 2, 0, 0, 0, 0],
               [0, 4, 0, 0, 0, 0]],
    lane_bases=[[0, 0, 0, 1, 0, 0], [0, 0, 0, 2, 0, 0], [0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 2],
                [0, 0, 0, 0, 0, 4]],
    warp_bases=[[1, 0, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0]],
    block_bases=[],
    shape=[4, 8, 2, 4, 2, 8],
))
# Value words [4, ks 2, i 2, tig 4, b 2, g 8] (uint32): reshaped, exactly VW_L.
VW6_L = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 0, 0, 1, 0], [0, 0, 1, 0, 0, 0], [0, 1, 0, 0, 0, 0]],
    lane_bases=[[0, 0, 0, 1, 0, 0], [0, 0, 0, 2, 0, 0], [0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 2],
                [0, 0, 0, 0, 0, 4]],
    warp_bases=[[1, 0, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0]],
    block_bases=[],
    shape=[4, 2, 2, 4, 2, 8],
))
# Per-channel key scales [4, tig 4, 32 contiguous channels]: one 64-byte run per lane.
KS_L = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 0, 16]],
    lane_bases=[[0, 1, 0], [0, 2, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]],
    warp_bases=_WARPS,
    block_bases=[],
    shape=[4, 4, 32],
))
# Per-token fields [4, tig 4, 8 contiguous tokens 32 w + 8 tig + j].
TOK_L = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4]],
    lane_bases=[[0, 1, 0], [0, 2, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]],
    warp_bases=_WARPS,
    block_bases=[],
    shape=[4, 4, 8],
))
# Value channel scales [4, g 8, 16 contiguous channels 16 g + q].
VC_L = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8]],
    lane_bases=[[0, 0, 0], [0, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
    warp_bases=_WARPS,
    block_bases=[],
    shape=[4, 8, 16],
))

# Unpacking.  K: one 32-bit register = uint16 of channel k (low half) and of channel k + 1 (high
# half), each holding 4 tokens (nibble j = token 4c + j).  (w >> 4j) & 0x000F000F puts nibble j of
# both channels in the two fp16 lanes; | 0x6400 makes them 1024 + code exactly; the HSUB2 leaves
# the code (skipped with FOLD_K).
_K_ASM_SUB = gl.constexpr("""
{
.reg .b32 t, k;
mov.b32 k, 0x64006400;
and.b32 t, $4, 0x000F000F;
or.b32 t, t, k;
sub.f16x2 $0, t, k;
shr.u32 t, $4, 4;
and.b32 t, t, 0x000F000F;
or.b32 t, t, k;
sub.f16x2 $1, t, k;
shr.u32 t, $4, 8;
and.b32 t, t, 0x000F000F;
or.b32 t, t, k;
sub.f16x2 $2, t, k;
shr.u32 t, $4, 12;
and.b32 t, t, 0x000F000F;
or.b32 t, t, k;
sub.f16x2 $3, t, k;
}
""")
# FOLD_K: no shifts for nibbles 0 and 1 of each byte pair: lop3 (w & mask) | 0x6400 leaves
# 1024 + code (mask 0x000F000F) or 1024 + 16 code (mask 0x00F000F0; exact in fp16, < 2048); the
# factor 16 of tokens j = 1, 3 is taken out of their k_token_scale exponent, and the 1024 is
# subtracted through the bias MMA.  One SHF and four LOP3 per register pair.
_K_ASM_FOLD = gl.constexpr("""
{
.reg .b32 t, k;
mov.b32 k, 0x64006400;
lop3.b32 $0, $4, 0x000F000F, k, 0xEA;
lop3.b32 $1, $4, 0x00F000F0, k, 0xEA;
shr.u32 t, $4, 8;
lop3.b32 $2, t, 0x000F000F, k, 0xEA;
lop3.b32 $3, t, 0x00F000F0, k, 0xEA;
}
""")



def _v_asm(fold: bool) -> str:
    """V: inputs $16 (token k, 4 bytes = channels 16g..16g+15) and $17 (token k + 1); output
    4a + e = crumb e of byte a of both tokens (channel 16 g + 4 a + e) as fp16x2.  Without fold:
    the exact code (shift, mask, or, sub).  With fold: one lop3 ``(d & (3 << 2e)) | 0x6400``,
    i.e. 1024 + 4^e code (exact in fp16); 4^-e goes into the channel's scale exponent and the
    1024 is subtracted through the zero-point MMA."""
    lines = ["{", ".reg .b32 d, t, k;", "mov.b32 k, 0x64006400;"]
    for a in range(4):
        sel = a | ((4 + a) << 8)
        lines.append(f"prmt.b32 d, $16, $17, {hex(sel)};")
        for e in range(4):
            q = 4 * a + e
            if fold:
                mask = (3 << (2 * e)) | (3 << (16 + 2 * e))
                lines.append(f"lop3.b32 ${q}, d, {hex(mask)}, k, 0xEA;")
            else:
                src = "d"
                if e:
                    lines.append(f"shr.u32 t, d, {2 * e};")
                    src = "t"
                lines.append(f"and.b32 t, {src}, 0x00030003;")
                lines.append("or.b32 t, t, k;")
                lines.append(f"sub.f16x2 ${q}, t, k;")
    lines.append("}")
    return "\n".join(lines)


_V_ASM_SUB = gl.constexpr(_v_asm(False))
_V_ASM_FOLD = gl.constexpr(_v_asm(True))


# ---------------------------------------------------------------------------------------------
# Index helpers
# ---------------------------------------------------------------------------------------------
@constexpr_function
def _dim_layout(layout, dim, rank):
    """The 1-D layout of dimension ``dim`` of ``layout`` (every other dimension sliced away)."""
    out = layout
    for j in reversed(range(rank)):
        if j != dim:
            out = gl.SliceLayout(j, out)
    return out


@gluon.jit
def _offsets(L: gl.constexpr, SHAPE: gl.constexpr, STRIDES: gl.constexpr):
    """sum_d arange(SHAPE[d]) * STRIDES[d], broadcast to SHAPE in layout L (int32).  A dimension
    held only in registers contributes compile-time constants, one held only in lanes or warps
    a per-thread value: each element is a per-thread base plus a constant."""
    RANK: gl.constexpr = len(SHAPE)
    off = gl.zeros(SHAPE, gl.int32, L)
    for d in gl.static_range(RANK):
        a = gl.arange(0, SHAPE[d], layout=_dim_layout(L, d, RANK)) * STRIDES[d]
        for j in gl.static_range(RANK):
            if j != d:
                a = gl.expand_dims(a, j)
        off = off + a
    return off


@gluon.jit
def _idx3(S0: gl.constexpr, S1: gl.constexpr, S2: gl.constexpr, L: gl.constexpr):
    i0 = gl.arange(0, S0, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
    i1 = gl.arange(0, S1, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))
    i2 = gl.arange(0, S2, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))
    i0 = gl.expand_dims(gl.expand_dims(i0, 1), 2)
    i1 = gl.expand_dims(gl.expand_dims(i1, 0), 2)
    i2 = gl.expand_dims(gl.expand_dims(i2, 0), 1)
    return i0, i1, i2


@gluon.jit
def _idx2(S0: gl.constexpr, S1: gl.constexpr, L: gl.constexpr):
    i0 = gl.arange(0, S0, layout=gl.SliceLayout(1, L))
    i1 = gl.arange(0, S1, layout=gl.SliceLayout(0, L))
    return gl.expand_dims(i0, 1), gl.expand_dims(i1, 0)


@gluon.jit
def _tok(w, n):
    # Physical token (within the tile) of warp w's logical token n.
    return 32 * w + 4 * (n % 8) + n // 8


@gluon.jit
def _vchan(m):
    # Physical value channel of logical PV row m.
    return 16 * (m % 8) + m // 8


@gluon.jit
def _kchan(k):
    # Physical key channel of logical QK channel k (b + 2 tig + 8 i + 16 ks -> 32 tig + 4 ks + 2 i + b).
    return 32 * ((k >> 1) & 3) + 4 * (k >> 4) + 2 * ((k >> 3) & 1) + (k & 1)


@gluon.jit
def _key_channels(x):
    # [4, tig, 32 contiguous channels] (KS_L) -> [4, 128 logical k] in SliceLayout(1, A_OP).
    y = gl.reshape(x, [4, 4, 8, 2, 2])  # [w, tig, ks, i, b]
    y = gl.permute(y, (0, 2, 3, 1, 4))  # [w, ks, i, tig, b]
    return gl.convert_layout(gl.reshape(y, [4, 128]), gl.SliceLayout(1, A_OP), assert_trivial=True)


@gluon.jit
def _s_tokens(x):
    # [4, tig, 8 tokens j = 4 b + r] (TOK_L) -> [4, 32 logical n = b + 2 tig + 8 r] on S columns.
    y = gl.reshape(x, [4, 4, 2, 4])  # [w, tig, b, r]
    y = gl.permute(y, (0, 3, 1, 2))  # [w, r, tig, b]
    return gl.convert_layout(gl.reshape(y, [4, 32]), gl.SliceLayout(1, ST_L))  # registers only


@gluon.jit
def _a_tokens(x):
    # [4, tig, 8 tokens j = 4 b + 2 ks + i] (TOK_L) -> [4, 32 logical k] in SliceLayout(1, A_OP).
    y = gl.reshape(x, [4, 4, 2, 2, 2])  # [w, tig, b, ks, i]
    y = gl.permute(y, (0, 3, 4, 1, 2))  # [w, ks, i, tig, b]
    return gl.convert_layout(gl.reshape(y, [4, 32]), gl.SliceLayout(1, A_OP))  # registers only


@gluon.jit
def _v_channels(x):
    # [4, g, 16 channels 16 g + q] (VC_L) -> [4, 128 logical m = 8 q + g] in SliceLayout(2, MMA).
    y = gl.permute(x, (0, 2, 1))
    return gl.convert_layout(gl.reshape(y, [4, 128]), gl.SliceLayout(2, MMA), assert_trivial=True)


@gluon.jit
def _log8(codes):
    return gl.exp2(codes.to(gl.float32) * 0.0625 - 1.0)


@gluon.jit
def _log8_shift(codes, shift):
    # 2^(n/16 - 1 - shift): a log8 factor with a power of two taken out (shift constant per register).
    return gl.exp2(codes.to(gl.float32) * 0.0625 - (1.0 + shift))


@gluon.jit
def _bcast_cols4(x):
    # [4, 16, 8] (C layout) -> [4, 16, 32]: column n = x column n % 8 (token bits 3, 4 are new
    # register bits, which is where the C layout of [4, 16, 32] keeps them).
    y = gl.join(gl.join(x, x), gl.join(x, x))  # [4, 16, 8, 2, 2]
    y = gl.permute(y, (0, 1, 4, 3, 2))  # [4, 16, 2, 2, 8]
    return gl.convert_layout(gl.reshape(y, [4, 16, 32]), MMA, assert_trivial=True)


@gluon.jit
def _bcast_cols4_pair(x_even, x_odd):
    # [4, 16, 8] x 2 -> [4, 16, 32]: column n = g + 8 j takes x_odd[g] for odd j, else x_even[g].
    y = gl.join(gl.join(x_even, x_odd), gl.join(x_even, x_odd))  # [4, 16, 8, 2(i), 2(jj)], j = i + 2 jj
    y = gl.permute(y, (0, 1, 4, 3, 2))
    return gl.convert_layout(gl.reshape(y, [4, 16, 32]), MMA, assert_trivial=True)


@gluon.jit
def _bcast_rows8_pair(x0, x1):
    # [4, 16, 8] x 2 -> [4, 128, 8]: row m takes x1[m % 16] where bit 4 of m is set, else x0.
    y = gl.join(gl.join(x0, x1), gl.join(x0, x1))  # [4, 16, 8, 2(i0), 2(i1)]
    y = gl.join(y, y)  # [4, 16, 8, i0, i1, i2]
    y = gl.permute(y, (0, 5, 4, 3, 1, 2))  # m = ((i2 * 2 + i1) * 2 + i0) * 16 + row
    return gl.convert_layout(gl.reshape(y, [4, 128, 8]), MMA, assert_trivial=True)


@gluon.jit
def _bcast_rows8(x):
    # [4, 16, 8] (C layout) -> [4, 128, 8]: row m = x row m % 16.
    y = gl.join(gl.join(x, x), gl.join(x, x))  # [4, 16, 8, 2, 2]
    y = gl.join(y, y)  # [4, 16, 8, 2, 2, 2]
    y = gl.permute(y, (0, 5, 4, 3, 1, 2))  # [4, 2, 2, 2, 16, 8]
    return gl.convert_layout(gl.reshape(y, [4, 128, 8]), MMA, assert_trivial=True)


@gluon.jit
def _key_operand(kw, FOLD_K: gl.constexpr):
    """uint16 words [4, 128, 8] (KW_L) -> fp16 B operand [4, 128 channels, 32 tokens]."""
    o0, o1, o2, o3 = gl.inline_asm_elementwise(
        asm=_K_ASM_FOLD if FOLD_K else _K_ASM_SUB,
        constraints="=r,=r,=r,=r,r",
        args=[kw],
        dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
        is_pure=True,
        pack=2,
    )
    # o_j[w, k, g] = code of channel k, token 4 (8 w + g) + j.  Logical token n = g + 8 j.
    y = gl.join(gl.join(o0, o1), gl.join(o2, o3))  # [4, 128, 8, 2(i), 2(jj)], j = i + 2 jj
    y = gl.permute(y, (0, 1, 4, 3, 2))  # [4, 128, jj, i, g]
    y = gl.reshape(y, [4, 128, 32])
    return gl.convert_layout(y, B_OP, assert_trivial=True)


@gluon.jit
def _value_operand(vw, FOLD_V: gl.constexpr):
    """uint32 words [4, 32 tokens, 8 groups] (VW_L) -> fp16 A operand [4, 128 channels, 32]."""
    o = gl.inline_asm_elementwise(
        asm=_V_ASM_FOLD if FOLD_V else _V_ASM_SUB,
        constraints="=r," * 16 + "r,r",
        args=[vw],
        dtype=(gl.float16,) * 16,
        is_pure=True,
        pack=2,
    )
    # o[q][w, k, g] = code of channel 16 g + q, token k.  Join tree: index q = i0 + 2 i1 + 4 i2 + 8 i3.
    j0 = gl.join(gl.join(gl.join(o[0], o[1]), gl.join(o[2], o[3])),
                 gl.join(gl.join(o[4], o[5]), gl.join(o[6], o[7])))
    j1 = gl.join(gl.join(gl.join(o[8], o[9]), gl.join(o[10], o[11])),
                 gl.join(gl.join(o[12], o[13]), gl.join(o[14], o[15])))
    y = gl.join(j0, j1)  # [4, 32(k), 8(g), i0, i1, i2, i3]
    y = gl.permute(y, (0, 6, 5, 4, 3, 2, 1))  # [4, i3, i2, i1, i0, g, k]
    y = gl.reshape(y, [4, 128, 32])  # m = 8 q + g  ->  channel 16 g + q
    return gl.convert_layout(y, A_OP, assert_trivial=True)


# ---------------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------------
@gluon.jit
def gluon_decode_partial_kernel(
    q_ptr,  # fp16 [B, Hq, D], rotated frame
    cache_u8_ptr,  # the same cache viewed as uint8 / int16 / int32 / fp16
    cache_u16_ptr,
    cache_u32_ptr,
    cache_f16_ptr,
    stride_cb,  # bytes per block (= Hkv * tile_bytes)
    stride_ch,  # bytes per KV head record (= tile_bytes)
    block_table_ptr,
    stride_bt,
    num_tiles_ptr,
    acc_ptr,  # fp32 [B, Hq, num_splits, D], unnormalized
    ml_ptr,  # fp32 [B, Hq, num_splits, 2]: running max (log2 units), denominator
    num_q_heads,
    num_splits,
    qk_scale,  # softmax scale * log2(e)
    GROUP: gl.constexpr,
    OFF_KC: gl.constexpr,
    OFF_KS: gl.constexpr,
    OFF_KZ: gl.constexpr,
    OFF_KT: gl.constexpr,
    OFF_VC: gl.constexpr,
    OFF_VCS: gl.constexpr,
    OFF_VS: gl.constexpr,
    OFF_VZ: gl.constexpr,
    FOLD_K: gl.constexpr,
    FOLD_V: gl.constexpr,
):
    D: gl.constexpr = 128
    seq = gl.program_id(0)
    hkv = gl.program_id(1)
    split = gl.program_id(2)

    n_tiles = gl.load(num_tiles_ptr + seq)
    per = gl.cdiv(n_tiles, num_splits)
    t0 = split * per
    t1 = gl.minimum(t0 + per, n_tiles)

    # ---- queries: A operand [4, 16, 128], rows >= GROUP zero; rows divided by their max |q|.
    wq, mq, kq = _idx3(4, 16, D, A_OP)
    head = hkv * GROUP + mq
    q_off = (seq.to(gl.int64) * num_q_heads + head) * D + _kchan(kq) + wq * 0
    q = gl.load(q_ptr + q_off, mask=(mq < GROUP) & (kq < D), other=0.0).to(gl.float32)
    q = q * qk_scale
    q_amax = gl.max(gl.abs(q), axis=2)  # [4, 16]
    q_amax = gl.where(q_amax > 0, q_amax, 1.0)
    qs = (q / gl.expand_dims(q_amax, 2)).to(gl.float16)  # |qs| <= 1
    # q_amax of rows 0..7 in the layout of the kept S rows.
    qa = gl.reshape(gl.convert_layout(q_amax, gl.SliceLayout(2, MMA)), [4, 2, 8])
    qa = gl.permute(qa, (0, 2, 1))
    qa, _qa_hi = gl.split(qa)
    qa = gl.convert_layout(qa, gl.SliceLayout(2, ST_L))

    # ---- per-tile offsets (loop invariant; each a per-thread base plus constants)
    kw_off = _offsets(KW6_L, (4, 8, 2, 4, 2, 8), (8, 128, 64, 1024, 32, 1))  # uint16 units
    vw_off = _offsets(VW6_L, (4, 2, 2, 4, 2, 8), (256, 16, 8, 64, 32, 1))  # uint32 units
    ks_off = _offsets(KS_L, (4, 4, 32), (0, 32, 1))  # channel 32 tig + j
    tk_off = _offsets(TOK_L, (4, 4, 8), (32, 8, 1))  # token 32 w + 8 tig + j
    vc_off = _offsets(VC_L, (4, 8, 16), (0, 16, 1))  # channel 16 g + q

    # Powers of two the FOLD unpacking leaves in the codes (constants per register).
    n_s = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, ST_L)))
    m_v = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA)))
    if FOLD_K:
        kt_shift = gl.expand_dims((4 * ((n_s >> 3) & 1)).to(gl.float32), 0)  # tokens j = 1, 3: 16 code
    else:
        kt_shift = gl.expand_dims((n_s * 0).to(gl.float32), 0)
    if FOLD_V:
        vc_shift = gl.expand_dims((2 * ((m_v >> 3) & 3)).to(gl.float32), 0)  # crumb e: 4^e code
    else:
        vc_shift = gl.expand_dims((m_v * 0).to(gl.float32), 0)
    zero_c8 = gl.zeros([4, 16, 8], gl.float32, MMA)
    if FOLD_K:
        neg1024_b = gl.full([4, D, 8], -1024.0, gl.float16, B_OP)
    if FOLD_V:
        neg1024_a = gl.full([4, 16, 32], -1024.0, gl.float16, A_OP)
        rr = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, A_OP)))
        vz_rowf = gl.expand_dims(gl.expand_dims(gl.where(rr >= 8, 4.0, 1.0).to(gl.float16), 0), 2)

    m_i = gl.full([4, 8], NEG_BIG, gl.float32, gl.SliceLayout(2, ST_L))
    l_i = gl.zeros([4, 8], gl.float32, gl.SliceLayout(2, ST_L))
    acc = gl.zeros([4, D, 8], gl.float32, MMA)

    bt_row = block_table_ptr + seq.to(gl.int64) * stride_bt
    head_base = hkv.to(gl.int64) * stride_ch
    for t in range(t0, t1):
        blk = gl.load(bt_row + t).to(gl.int64)
        rec = blk * stride_cb + head_base  # bytes, a multiple of 16
        u8 = cache_u8_ptr + rec
        u16 = cache_u16_ptr + rec // 2
        u32 = cache_u32_ptr + rec // 4
        f16 = cache_f16_ptr + rec // 2

        # ---- every load of the tile, issued up front
        kw = gl.load(u16 + OFF_KC // 2 + kw_off)  # [4, 8, 2, 4, 2, 8] int16
        kw = gl.convert_layout(gl.reshape(kw, [4, D, 8]), KW_L, assert_trivial=True)
        vw = gl.load(u32 + OFF_VC // 4 + vw_off)  # [4, 2, 2, 4, 2, 8] int32
        vw = gl.convert_layout(gl.reshape(vw, [4, 32, 8]), VW_L, assert_trivial=True)
        ks = _key_channels(gl.load(f16 + OFF_KS // 2 + ks_off))  # [4, 128] fp16
        kz = _key_channels(gl.load(f16 + OFF_KZ // 2 + ks_off))
        kz = gl.convert_layout(kz, gl.SliceLayout(2, B_OP), assert_trivial=True)
        kt = _s_tokens(gl.load(u8 + OFF_KT + tk_off))  # [4, 32] log8 codes
        vs = _s_tokens(gl.load(f16 + OFF_VS // 2 + tk_off))  # [4, 32] fp16
        vz = _a_tokens(gl.load(f16 + OFF_VZ // 2 + tk_off))  # [4, 32] fp16
        vc = _v_channels(gl.load(u8 + OFF_VCS + vc_off))  # [4, 128] log8 codes

        # ---- scores: S = (qs * k_scale) codes + qs k_zero  (rows 0..15; 0..7 kept)
        qn = qs * gl.expand_dims(ks, 1)  # fp16, |qs| <= 1
        kz_b = gl.convert_layout(
            gl.expand_dims(kz, 2).broadcast_to([4, D, 8]), B_OP, assert_trivial=True
        )
        bias = mma_v2(qs, kz_b, zero_c8)  # [4, 16, 8], every column = sum_d qs k_zero
        if FOLD_K:
            # Codes stay 1024 + code (tokens j even) or 1024 + 16 code (j odd, whose k_token_scale
            # exponent is lowered by 4): start from -1024 sum_d qn plus the bias, x16 for odd j.
            corr = mma_v2(qn, neg1024_b, zero_c8)
            init = _bcast_cols4_pair(bias + corr, bias * 16.0 + corr)
        else:
            init = _bcast_cols4(bias)
        kb = _key_operand(kw, FOLD_K)
        s = mma_v2(qn, kb, init)  # [4, 16, 32]
        s = gl.permute(gl.reshape(s, [4, 2, 8, 32]), (0, 2, 3, 1))
        s, _s_hi = gl.split(s)
        s = gl.convert_layout(s, ST_L, assert_trivial=True)  # [4, 8 heads, 32 tokens]
        s = s * (gl.expand_dims(qa, 2) * gl.expand_dims(_log8_shift(kt, kt_shift), 1))

        # ---- online softmax (base 2) per warp
        m_new = gl.maximum(m_i, gl.max(s, axis=2))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - gl.expand_dims(m_new, 2))
        l_i = l_i * alpha + gl.sum(p, axis=2)
        m_i = m_new

        # ---- P^T as the B operand: same registers
        p16 = p.to(gl.float16)
        pn16 = p16 * gl.expand_dims(vs, 1)  # p <= 1: fits fp16
        pt = gl.convert_layout(gl.permute(p16, (0, 2, 1)), B_OP, assert_trivial=True)
        pnt = gl.convert_layout(gl.permute(pn16, (0, 2, 1)), B_OP, assert_trivial=True)

        # ---- O^T += v_channel_scale * (V^T (p v_scale) + sum_t p v_zero)
        vz_a = gl.convert_layout(
            gl.expand_dims(vz, 1).broadcast_to([4, 16, 32]), A_OP, assert_trivial=True
        )
        if FOLD_V:
            # Codes stay 1024 + 4^e code (e = bits 3, 4 of the row m; the channel scale exponent
            # is lowered by 2 e): start from -1024 sum_t pn plus 4^e sum_t p v_zero.  Rows 8..15
            # of the A operand carry 4 v_zero (exact), bit 4 is a factor 16 on the result.
            vz_a = vz_a * vz_rowf
            pz = mma_v2(vz_a, pt, zero_c8)  # [4, 16, 8]: rows = 4^(row >> 3) sum_t p v_zero
            corr = mma_v2(neg1024_a, pnt, zero_c8)
            init = _bcast_rows8_pair(pz + corr, pz * 16.0 + corr)
        else:
            pz = mma_v2(vz_a, pt, zero_c8)  # [4, 16, 8], every row = sum_t p v_zero
            init = _bcast_rows8(pz)
        va = _value_operand(vw, FOLD_V)
        o = mma_v2(va, pnt, init)  # [4, 128, 8]
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, MMA))
        acc = acc * gl.expand_dims(alpha_o, 1) + o * gl.expand_dims(_log8_shift(vc, vc_shift), 2)

    # ---- merge the four warps, write the split's partial (unnormalized, rotated frame)
    m_all = gl.max(m_i, axis=0)  # [8]
    wgt = gl.exp2(m_i - gl.expand_dims(m_all, 0))  # [4, 8]
    l_all = gl.sum(l_i * wgt, axis=0)
    wgt_o = gl.convert_layout(wgt, gl.SliceLayout(1, MMA))
    out = gl.sum(acc * gl.expand_dims(wgt_o, 1), axis=0)  # [128 (m), 8 (heads)]
    OL: gl.constexpr = gl.SliceLayout(0, MMA)
    om = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(1, OL)), 1)
    oh = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, OL)), 0)
    part = (seq.to(gl.int64) * num_q_heads + hkv * GROUP + oh) * num_splits + split
    gl.store(acc_ptr + part * D + _vchan(om), out, mask=(oh < GROUP) & (om < D))
    MLL: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, ST_L))
    hh = gl.arange(0, 8, layout=MLL)
    mpart = (seq.to(gl.int64) * num_q_heads + hkv * GROUP + hh) * num_splits + split
    gl.store(ml_ptr + mpart * 2, gl.convert_layout(m_all, MLL), mask=hh < GROUP)
    gl.store(ml_ptr + mpart * 2 + 1, gl.convert_layout(l_all, MLL), mask=hh < GROUP)


@triton.jit
def gluon_decode_combine_kernel(
    acc_ptr, ml_ptr, out_ptr, num_splits, D: tl.constexpr, BLOCK_S: tl.constexpr
):
    """Plain Triton: merge the splits of one (sequence, query head) row and normalize."""
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, BLOCK_S)
    sm = sp < num_splits
    m = tl.load(ml_ptr + (row * num_splits + sp) * 2, mask=sm, other=NEG_BIG)
    l = tl.load(ml_ptr + (row * num_splits + sp) * 2 + 1, mask=sm, other=0.0)
    mx = tl.max(m, axis=0)
    w = tl.exp2(m - mx)
    w = tl.where(sm, w, 0.0)
    den = tl.sum(w * l, axis=0)
    den = tl.where(den > 0, den, 1.0)
    d = tl.arange(0, D)
    a = tl.load(
        acc_ptr + (row * num_splits + sp)[:, None] * D + d[None, :], mask=sm[:, None], other=0.0
    )
    o = tl.sum(a * w[:, None], axis=0) / den
    tl.store(out_ptr + row * D + d, o)


def tile_constants() -> dict[str, int]:
    from kvarn_math import tile_layout

    off = tile_layout(PRESET, HEAD_DIM).offsets
    return {
        "OFF_KC": off["k_codes"],
        "OFF_KS": off["k_scale"],
        "OFF_KZ": off["k_zero"],
        "OFF_KT": off["k_token_scale"],
        "OFF_VC": off["v_codes"],
        "OFF_VCS": off["v_channel_scale"],
        "OFF_VS": off["v_scale"],
        "OFF_VZ": off["v_zero"],
    }


def default_splits(batch: int, num_kv_heads: int, max_tiles: int, num_sms: int) -> int:
    """About 4 programs per SM, as the Triton kernel's launcher aims for, at most one tile per split."""
    want = max(1, (4 * num_sms) // max(1, batch * num_kv_heads))
    return max(1, min(want, max_tiles, 64))


def gluon_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    num_tiles: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    fold_k: bool = True,
    fold_v: bool = True,
    max_tiles: int | None = None,
    maxnreg: int | None = 128,
) -> torch.Tensor:
    """Decode attention over complete kvarn_k4v2_g128 tiles.

    Args:
        q: fp16 ``[B, Hq, 128]`` queries in the rotated frame (the frame of the stored keys).
        cache: uint8 ``[num_blocks, Hkv, tile_bytes]``.
        block_table: int32 ``[B, max_tiles]``.
        num_tiles: int32 ``[B]`` complete tiles per sequence (all attended).
        scale: softmax scale.
        num_splits: split-K factor (default: about 4 programs per SM).
        fold_k, fold_v: keep 1024 (and powers of two) in the unpacked codes and cancel them
            through extra MMAs (fewer unpacking instructions; see README).
        maxnreg: register cap per thread (128: 4 CTAs of 4 warps per SM; None: uncapped).

    Returns:
        fp32 ``[B, Hq, 128]``, normalized attention output in the rotated frame.
    """
    from kvarn_math import tile_layout

    b, hq, d = q.shape
    nb, hkv, tb = cache.shape
    assert d == HEAD_DIM and tb == tile_layout(PRESET, HEAD_DIM).tile_bytes
    assert q.dtype == torch.float16 and cache.dtype == torch.uint8 and cache.is_contiguous()
    group = hq // hkv
    assert group * hkv == hq and group <= 8
    if num_splits is None:
        mt = max_tiles if max_tiles is not None else block_table.shape[1]
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        num_splits = default_splits(b, hkv, mt, sms)
    q = q.contiguous()
    acc = torch.empty((b, hq, num_splits, d), dtype=torch.float32, device=q.device)
    ml = torch.empty((b, hq, num_splits, 2), dtype=torch.float32, device=q.device)
    flat = cache.view(-1)
    gluon_decode_partial_kernel[(b, hkv, num_splits)](
        q,
        flat,
        flat.view(torch.int16),
        flat.view(torch.int32),
        flat.view(torch.float16),
        cache.stride(0),
        cache.stride(1),
        block_table,
        block_table.stride(0),
        num_tiles,
        acc,
        ml,
        hq,
        num_splits,
        float(scale) * LOG2E,
        GROUP=group,
        FOLD_K=fold_k,
        FOLD_V=fold_v,
        num_warps=NUM_WARPS,
        **({"maxnreg": maxnreg} if maxnreg else {}),
        **tile_constants(),
    )
    out = torch.empty((b, hq, d), dtype=torch.float32, device=q.device)
    gluon_decode_combine_kernel[(b * hq,)](
        acc, ml, out, num_splits, D=d, BLOCK_S=triton.next_power_of_2(num_splits), num_warps=4
    )
    return out


__all__ = [
    "gluon_decode_attention",
    "gluon_decode_combine_kernel",
    "gluon_decode_partial_kernel",
    "default_splits",
    "tile_constants",
]
