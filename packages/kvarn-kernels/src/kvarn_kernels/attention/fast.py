"""Fast decode attention over complete ``kvarn_k4v2_g128`` and ``kvarn_k4v4_g128`` tiles at
head_dim 128 (Gluon).

:func:`kvarn_kernels.decode_attention` uses this kernel for a batch's quantized tiles when the
shape allows it (:func:`kvarn_kernels.attention.launch.fast_decode_applies`) and the
``attention_partial_kernel`` for the rest (the sink rows and staging), merging the two partials.
Written in Gluon (``triton.experimental.gluon``, Triton 3.6), whose explicit layouts let the code
bytes go from global memory straight into the tensor cores' operand registers: no shared memory,
no barrier and no layout conversion in the loop, 128 registers per thread (4 CTAs per SM). On an
H200 it ran 2.2-2.5x faster than the Triton kernel's quantized loop (``docs/kernels.md``). Gluon
has no interpreter: the CPU tests compile it for sm_90, the GPU tests check it against the
Triton kernel.

Layout of the work (num_warps = 4, ``mma.sync`` m16n8k16, fp16 x fp16 -> fp32):

* The four warps are the *batch* dimension of a rank-3 ``NVMMADistributedLayout(warps_per_cta=
  [4, 1, 1], instr_shape=[1, 16, 8])``: warp ``w`` owns tokens ``[32 w, 32 w + 32)`` of every tile
  and keeps its own online softmax; the warps meet once, after the loop.
* ``S = Q K`` with M = query heads (padded to 16), N = 32 tokens per warp, K = 128 channels. The
  B operand (key codes) is loaded straight into the B fragment registers: lane ``(g, tig)``
  loads, for each of its 32 channels, the uint16 of that channel row that holds tokens
  ``4 c .. 4 c + 3`` with ``c = 8 w + g``; two channel rows (k, k + 1) form one 32-bit register.
  Logical token ``n`` of a warp is physical token ``32 w + 4 (n % 8) + n // 8``, logical channel
  ``k`` physical ``32 tig + 4 ks + 2 i + b`` (softmax does not care about order; scales and
  queries follow the same permutations).
* Only rows 0..7 of S are kept (GQA groups up to 8); their C registers are, element for
  element, the B fragment of ``P^T``, so ``O^T = V^T P^T`` (M = 128 channels, N = 8 heads,
  K = 32 tokens) takes P without any data movement. The value codes (the A operand) load
  straight into their fragment too; logical channel ``m`` is physical ``16 (m % 8) + m // 8``
  at either value width: a lane's 16 channels of a token are one 32-bit word of 2-bit codes,
  or two adjacent words of 4-bit codes.
* Unpacking leaves ``1024 + code`` (and powers of two of it) in the fp16 codes, the
  ``0x6400`` mantissa trick without its subtraction; the powers of two go into the per-token and
  per-channel scale exponents, the zero points and ``-1024 * sum`` of the same fp16 operands
  ride on extra tensor-core products, so the cancellation is exact up to fp32 accumulation.

Nothing here touches CUDA at import time; the module is imported only when the fast path runs.
"""

from __future__ import annotations

import torch
from kvarn_math.layout import tile_layout
from triton.experimental import gluon  # type: ignore[import-untyped]
from triton.experimental.gluon import language as gl  # type: ignore[import-untyped]
from triton.experimental.gluon._runtime import constexpr_function  # type: ignore[import-untyped]
from triton.experimental.gluon.language.nvidia.ampere import mma_v2  # type: ignore[import-untyped]

from kvarn_kernels._format import offset_constants

# The presets this kernel reads, by value bits (4-bit keys, 128-token tiles, head_dim 128).
PRESETS = {2: "kvarn_k4v2_g128", 4: "kvarn_k4v4_g128"}
HEAD_DIM = 128
MAX_GROUP = 8
NUM_WARPS = 4
# 4 CTAs of 4 warps per SM; uncapped (168 registers, 3 CTAs) ran 20-30% slower on the H200.
MAX_REGISTERS = 128
# Bytes per line of an L2 prefetch (``prefetch.global.L2``): one per thread, 128 threads cover a
# record of up to 16 KiB (``kvarn_k4v2_g128`` at head_dim 128: 13,568 bytes; the first 16 KiB of
# ``kvarn_k4v4_g128``'s 17,664).
PREFETCH_LINE: gl.constexpr = gl.constexpr(128)
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
KW_L = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 1, 0], [0, 8, 0], [0, 16, 0], [0, 32, 0], [0, 64, 0]],
        lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]],
        warp_bases=_WARPS,
        block_bases=[],
        shape=[4, 128, 8],
    )
)
# Value words [4 warps, 32 tokens k, 8 byte groups g] (uint32): the A fragment of [4, 128, 32]
# with the channel bits 3..6 (registers) removed; token bit 0 is register bit 0.
VW_L = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 1, 0], [0, 8, 0], [0, 16, 0]],
        lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]],
        warp_bases=_WARPS,
        block_bases=[],
        shape=[4, 32, 8],
    )
)
# Rows 0..7 of the S accumulator [4, 8 heads, 32 tokens] (the C layout without register bit
# "row + 8").
ST_L = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 8], [0, 0, 16]],
        lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=_WARPS,
        block_bases=[],
        shape=[4, 8, 32],
    )
)

# Load layouts whose dimensions are each all-register or all-lane, so that every address is one
# per-thread base plus a compile-time constant (ptxas folds it into the load's immediate).
# Key channel permutation: logical k = b + 2 tig + 8 i + 16 ks (b, i, ks registers, tig lanes)
# is physical channel 32 tig + 4 ks + 2 i + b, so each lane's 32 channels are contiguous.
# Key words [4, ks 8, i 2, tig 4, b 2, g 8] (uint16): reshaped, exactly KW_L.
KW6_L = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[
            [0, 0, 0, 0, 1, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 1, 0, 0, 0, 0],
            [0, 2, 0, 0, 0, 0],
            [0, 4, 0, 0, 0, 0],
        ],
        lane_bases=[
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 2, 0, 0],
            [0, 0, 0, 0, 0, 1],
            [0, 0, 0, 0, 0, 2],
            [0, 0, 0, 0, 0, 4],
        ],
        warp_bases=[[1, 0, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0]],
        block_bases=[],
        shape=[4, 8, 2, 4, 2, 8],
    )
)
# Value words [4, ks 2, i 2, tig 4, b 2, g 8] (uint32): reshaped, exactly VW_L.
VW6_L = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 0, 1, 0], [0, 0, 1, 0, 0, 0], [0, 1, 0, 0, 0, 0]],
        lane_bases=[
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 2, 0, 0],
            [0, 0, 0, 0, 0, 1],
            [0, 0, 0, 0, 0, 2],
            [0, 0, 0, 0, 0, 4],
        ],
        warp_bases=[[1, 0, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0]],
        block_bases=[],
        shape=[4, 2, 2, 4, 2, 8],
    )
)
# Per-channel key scales [4, tig 4, 32 contiguous channels]: one 64-byte run per lane.
KS_L = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 0, 16]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]],
        warp_bases=_WARPS,
        block_bases=[],
        shape=[4, 4, 32],
    )
)
# Per-token fields [4, tig 4, 8 contiguous tokens 32 w + 8 tig + j].
TOK_L = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]],
        warp_bases=_WARPS,
        block_bases=[],
        shape=[4, 4, 8],
    )
)
# Query rows [4, 16 rows m, tig 4, 32 contiguous channels j]: lane (g, tig) holds rows g and
# g + 8 and physical channels 32 tig + j, the registers of its A fragment (j = 4 ks + 2 i + b:
# register bits b, row bit 3, i, ks), so one 64-byte run per row and lane.
QS_L = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[
            [0, 0, 0, 1],
            [0, 8, 0, 0],
            [0, 0, 0, 2],
            [0, 0, 0, 4],
            [0, 0, 0, 8],
            [0, 0, 0, 16],
        ],
        lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]],
        warp_bases=[[1, 0, 0, 0], [2, 0, 0, 0]],
        block_bases=[],
        shape=[4, 16, 4, 32],
    )
)
# Value channel scales [4, g 8, 16 contiguous channels 16 g + q].
VC_L = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8]],
        lane_bases=[[0, 0, 0], [0, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=_WARPS,
        block_bases=[],
        shape=[4, 8, 16],
    )
)

# Unpacking.  K: one 32-bit register = uint16 of channel k (low half) and of channel k + 1 (high
# half), each holding 4 tokens (nibble j = token 4c + j).
# No shifts for nibbles 0 and 1 of each byte pair: lop3 (w & mask) | 0x6400 leaves
# 1024 + code (mask 0x000F000F) or 1024 + 16 code (mask 0x00F000F0; exact in fp16, < 2048); the
# factor 16 of tokens j = 1, 3 is taken out of their k_token_scale exponent, and the 1024 is
# subtracted through the bias MMA.  One SHF and four LOP3 per register pair.
_K_ASM = gl.constexpr("""
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


def _v_asm() -> str:
    """V: inputs $16 (token k, 4 bytes = channels 16g..16g+15) and $17 (token k + 1); output
    4a + e = crumb e of byte a of both tokens (channel 16 g + 4 a + e) as fp16x2: one lop3
    ``(d & (3 << 2e)) | 0x6400``, i.e. 1024 + 4^e code (exact in fp16); 4^-e goes into the
    channel's scale exponent and the 1024 is subtracted through the zero-point MMA."""
    lines = ["{", ".reg .b32 d, k;", "mov.b32 k, 0x64006400;"]
    for a in range(4):
        sel = a | ((4 + a) << 8)
        lines.append(f"prmt.b32 d, $16, $17, {hex(sel)};")
        for e in range(4):
            mask = (3 << (2 * e)) | (3 << (16 + 2 * e))
            lines.append(f"lop3.b32 ${4 * a + e}, d, {hex(mask)}, k, 0xEA;")
    lines.append("}")
    return "\n".join(lines)


_V_ASM = gl.constexpr(_v_asm())


def _v4_asm() -> str:
    """V at 4 bits, one of a lane's two words: inputs $8 (token k, 4 bytes = channels
    8 u .. 8 u + 7 of its word u) and $9 (token k + 1); output 2a + e = nibble e of byte a of
    both tokens (channel 8 u + 2 a + e) as fp16x2: one lop3 ``(d & (15 << 4e)) | 0x6400``,
    i.e. 1024 + 16^e code (exact in fp16); 16^-e goes into the channel's scale exponent."""
    lines = ["{", ".reg .b32 d, k;", "mov.b32 k, 0x64006400;"]
    for a in range(4):
        sel = a | ((4 + a) << 8)
        lines.append(f"prmt.b32 d, $8, $9, {hex(sel)};")
        for e in range(2):
            mask = (15 << (4 * e)) | (15 << (16 + 4 * e))
            lines.append(f"lop3.b32 ${2 * a + e}, d, {hex(mask)}, k, 0xEA;")
    lines.append("}")
    return "\n".join(lines)


_V4_ASM = gl.constexpr(_v4_asm())


# One lane per line of an L2 prefetch: [128] over the CTA's 4 warps.
PF_L = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))

# Ask L2 for the line at a global address; no register is written and nothing waits on it.
_PREFETCH_ASM = gl.constexpr("prefetch.global.L2 [$1];\nmov.u32 $0, 0;")


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
def _idx2(S0: gl.constexpr, S1: gl.constexpr, L: gl.constexpr):
    i0 = gl.arange(0, S0, layout=gl.SliceLayout(1, L))
    i1 = gl.arange(0, S1, layout=gl.SliceLayout(0, L))
    return gl.expand_dims(i0, 1), gl.expand_dims(i1, 0)


@gluon.jit
def _vchan(m):
    # Physical value channel of logical PV row m.
    return 16 * (m % 8) + m // 8


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
def _log8_shift(codes, shift):
    # 2^(n/16 - 1 - shift): a log8 factor with a power of two taken out (shift constant per register).
    return gl.exp2(codes.to(gl.float32) * 0.0625 - (1.0 + shift))


@gluon.jit
def _bcast_cols4_pair(x_even, x_odd):
    # [4, 16, 8] x 2 -> [4, 16, 32]: column n = g + 8 j takes x_odd[g] for odd j, else x_even[g].
    y = gl.join(
        gl.join(x_even, x_odd), gl.join(x_even, x_odd)
    )  # [4, 16, 8, 2(i), 2(jj)], j = i + 2 jj
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
def _prefetch_record(cache_u8_ptr, bt_row, t, head_base, stride_cb, lines):
    """L2 prefetch of the record of tile ``t`` (``lines``: byte offsets of its lines, PF_L)."""
    blk = gl.load(bt_row + t).to(gl.int64)
    addr = (cache_u8_ptr + blk * stride_cb + head_base + lines).to(gl.int64, bitcast=True)
    gl.inline_asm_elementwise(
        asm=_PREFETCH_ASM,
        constraints="=r,l",
        args=[addr],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _key_operand(kw):
    """uint16 words [4, 128, 8] (KW_L) -> fp16 B operand [4, 128 channels, 32 tokens]."""
    o0, o1, o2, o3 = gl.inline_asm_elementwise(
        asm=_K_ASM,
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
def _value_operand(vw, vw_hi, VALUE_BITS: gl.constexpr):
    """uint32 words [4, 32 tokens, 8 groups] (VW_L) -> fp16 A operand [4, 128 channels, 32].
    At 2 bits ``vw`` holds group ``g``'s 16 channels (``vw_hi`` is unused); at 4 bits ``vw``
    holds its channels 16 g .. 16 g + 7 and ``vw_hi`` the next 8."""
    if VALUE_BITS == 2:
        o = gl.inline_asm_elementwise(
            asm=_V_ASM,
            constraints="=r," * 16 + "r,r",
            args=[vw],
            dtype=(gl.float16,) * 16,
            is_pure=True,
            pack=2,
        )
    else:
        lo = gl.inline_asm_elementwise(
            asm=_V4_ASM,
            constraints="=r," * 8 + "r,r",
            args=[vw],
            dtype=(gl.float16,) * 8,
            is_pure=True,
            pack=2,
        )
        hi = gl.inline_asm_elementwise(
            asm=_V4_ASM,
            constraints="=r," * 8 + "r,r",
            args=[vw_hi],
            dtype=(gl.float16,) * 8,
            is_pure=True,
            pack=2,
        )
        o = (lo[0], lo[1], lo[2], lo[3], lo[4], lo[5], lo[6], lo[7],
             hi[0], hi[1], hi[2], hi[3], hi[4], hi[5], hi[6], hi[7])  # fmt: skip
    # o[q][w, k, g] = code of channel 16 g + q, token k.  Join tree: index q = i0 + 2 i1 + 4 i2 + 8 i3.
    j0 = gl.join(
        gl.join(gl.join(o[0], o[1]), gl.join(o[2], o[3])),
        gl.join(gl.join(o[4], o[5]), gl.join(o[6], o[7])),
    )
    j1 = gl.join(
        gl.join(gl.join(o[8], o[9]), gl.join(o[10], o[11])),
        gl.join(gl.join(o[12], o[13]), gl.join(o[14], o[15])),
    )
    y = gl.join(j0, j1)  # [4, 32(k), 8(g), i0, i1, i2, i3]
    y = gl.permute(y, (0, 6, 5, 4, 3, 2, 1))  # [4, i3, i2, i1, i0, g, k]
    y = gl.reshape(y, [4, 128, 32])  # m = 8 q + g  ->  channel 16 g + q
    return gl.convert_layout(y, A_OP, assert_trivial=True)


# ---------------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------------
@gluon.jit
def _load_query(
    qs_ptr, qa_ptr, seq, hkv, frame, num_q_heads, NUM_FRAMES: gl.constexpr, GROUP: gl.constexpr
):
    """The prepared query rows of KV head ``hkv`` in frame ``frame``: fp16 ``q / max|q|`` as
    the A operand ``[4, 16, 128]`` (rows >= GROUP zero, channels in the key permutation) and
    ``max|q|`` of rows 0..7 in the layout of the kept score rows."""
    D: gl.constexpr = 128
    row0 = (seq.to(gl.int64) * NUM_FRAMES + frame) * num_q_heads + hkv * GROUP
    mq = gl.arange(0, 16, layout=_dim_layout(QS_L, 1, 4))
    mq = gl.expand_dims(gl.expand_dims(gl.expand_dims(mq, 0), 2), 3)
    q_off = _offsets(QS_L, (4, 16, 4, 32), (0, D, 32, 1))
    qs = gl.load(qs_ptr + row0 * D + q_off, mask=mq < GROUP, other=0.0)  # [4, 16, tig, j]
    qs = gl.reshape(qs, [4, 16, 4, 8, 2, 2])  # [w, m, tig, ks, i, b]
    qs = gl.permute(qs, (0, 1, 3, 4, 2, 5))  # [w, m, ks, i, tig, b]: logical k
    qs = gl.convert_layout(gl.reshape(qs, [4, 16, D]), A_OP, assert_trivial=True)
    wa, ha = _idx2(4, 8, gl.SliceLayout(2, ST_L))
    qa = gl.load(qa_ptr + row0 + ha + wa * 0, mask=ha < GROUP, other=1.0)
    return qs, qa


# Values that change from step to step (with the batch) are not specialized: a new value class
# (1, a multiple of 16) would otherwise compile a variant mid-serving.
_STEP_VARYING = ("num_splits", "part_splits", "split0", "split_tiles")


@gluon.jit(do_not_specialize=_STEP_VARYING)
def fast_decode_partial_kernel(
    qs_ptr,  # fp16 [B, NUM_FRAMES, Hq, D]: q * scale * log2(e) / max|q|, frame 0 rotated
    qa_ptr,  # fp32 [B, NUM_FRAMES, Hq]: max|q| of those rows
    cache_u8_ptr,  # the same cache viewed as uint8 / int16 / int32 / fp16
    cache_u16_ptr,
    cache_u32_ptr,
    cache_f16_ptr,
    stride_cb,  # bytes per block (= Hkv * tile_bytes)
    stride_ch,  # bytes per KV head record (= tile_bytes)
    block_table_ptr,
    stride_bt,
    qlens_ptr,  # int32 [B]: tokens read from records (tiles [first, qlen / G))
    sink_lens_ptr,  # int32 [B]: G where tile 0 is read from the sink rows instead (SINK)
    acc_ptr,  # fp32 [B, Hq, part_splits, D], unnormalized
    ml_ptr,  # fp32 [B, Hq, part_splits, 2]: running max (log2 units), denominator
    num_q_heads,
    num_splits,
    part_splits,
    split0,
    split_tiles,  # FIXED: tiles per split (split s walks tiles [s, s + 1) * split_tiles)
    GROUP: gl.constexpr,
    NUM_FRAMES: gl.constexpr,
    SINK: gl.constexpr,
    FIXED: gl.constexpr,
    OFF_KC: gl.constexpr,
    OFF_KS: gl.constexpr,
    OFF_KZ: gl.constexpr,
    OFF_KT: gl.constexpr,
    OFF_VC: gl.constexpr,
    OFF_VCS: gl.constexpr,
    OFF_VS: gl.constexpr,
    OFF_VZ: gl.constexpr,
    OFF_FL: gl.constexpr,
    PREFETCH: gl.constexpr,
    VALUE_BITS: gl.constexpr = 2,
):
    """Partial decode attention of one (sequence, KV head, split) over its complete quantized
    tiles ``[first, qlen / G)`` (``first`` = 1 where the sink rows replace tile 0), in the
    partial format of ``attention_partial_kernel`` (split ``s`` at index ``split0 + s``).
    ``NUM_FRAMES = 2``: each tile's ``KEYS_UNROTATED`` flag picks frame 1 (the query in its
    own channels) for it. The splits divide each sequence's tiles evenly, or with ``FIXED``
    sit at fixed positions (``split_tiles`` tiles each, from tile 0), so that a row's bits do
    not depend on the batch (batch-invariant mode). ``PREFETCH`` > 0: while tile ``t`` is
    read, the record of tile ``t + PREFETCH`` (the split's last, near its end) is prefetched
    into L2, so that more of the cache is in flight than one tile per CTA. ``VALUE_BITS``: 2
    (``kvarn_k4v2_g128``) or 4 (``kvarn_k4v4_g128``); the keys are 4-bit either way."""
    D: gl.constexpr = 128
    G: gl.constexpr = 128
    seq = gl.program_id(0)
    hkv = gl.program_id(1)
    split = gl.program_id(2)

    n_tiles = gl.load(qlens_ptr + seq) // G
    first = n_tiles * 0
    if SINK:
        first = gl.minimum(gl.load(sink_lens_ptr + seq) // G, n_tiles)
    if FIXED:
        t0 = gl.maximum(split * split_tiles, first)
        t1 = gl.minimum((split + 1) * split_tiles, n_tiles)
    else:
        per = gl.cdiv(n_tiles - first, num_splits)
        t0 = first + split * per
        t1 = gl.minimum(t0 + per, n_tiles)

    # ---- per-tile offsets (loop invariant; each a per-thread base plus constants)
    kw_off = _offsets(KW6_L, (4, 8, 2, 4, 2, 8), (8, 128, 64, 1024, 32, 1))  # uint16 units
    # Value words: a token's row is 8 words at 2 bits (group g: word g), 16 at 4 (group g:
    # words 2 g and 2 g + 1, the second at offset + 1).
    TW: gl.constexpr = 4 * VALUE_BITS  # uint32 words per token row
    GW: gl.constexpr = VALUE_BITS // 2  # words per group
    vw_off = _offsets(
        VW6_L, (4, 2, 2, 4, 2, 8), (32 * TW, 2 * TW, TW, 8 * TW, 4 * TW, GW)
    )  # uint32 units
    ks_off = _offsets(KS_L, (4, 4, 32), (0, 32, 1))  # channel 32 tig + j
    tk_off = _offsets(TOK_L, (4, 4, 8), (32, 8, 1))  # token 32 w + 8 tig + j
    vc_off = _offsets(VC_L, (4, 8, 16), (0, 16, 1))  # channel 16 g + q

    # Powers of two the unpacking leaves in the codes (constants per register).
    n_s = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, ST_L)))
    m_v = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA)))
    kt_shift = gl.expand_dims((4 * ((n_s >> 3) & 1)).to(gl.float32), 0)  # tokens j = 1, 3: 16 code
    if VALUE_BITS == 2:
        vc_shift = gl.expand_dims((2 * ((m_v >> 3) & 3)).to(gl.float32), 0)  # crumb e: 4^e code
    else:
        vc_shift = gl.expand_dims((4 * ((m_v >> 3) & 1)).to(gl.float32), 0)  # nibble e: 16^e
    zero_c8 = gl.zeros([4, 16, 8], gl.float32, MMA)
    neg1024_b = gl.full([4, D, 8], -1024.0, gl.float16, B_OP)
    neg1024_a = gl.full([4, 16, 32], -1024.0, gl.float16, A_OP)
    # 4 (2-bit values) or 16 (4-bit) on rows 8..15 of the value zero-point sums, in fp32 (the
    # factor times v_zero in fp16 could overflow: v_zero is an fp16 row minimum, saturated at
    # +-65504).
    rr = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA)))
    ROW_F: gl.constexpr = 4.0 if VALUE_BITS == 2 else 16.0
    row4 = gl.expand_dims(gl.expand_dims(gl.where(rr >= 8, ROW_F, 1.0), 0), 2)

    m_i = gl.full([4, 8], NEG_BIG, gl.float32, gl.SliceLayout(2, ST_L))
    l_i = gl.zeros([4, 8], gl.float32, gl.SliceLayout(2, ST_L))
    acc = gl.zeros([4, D, 8], gl.float32, MMA)

    bt_row = block_table_ptr + seq.to(gl.int64) * stride_bt
    head_base = hkv.to(gl.int64) * stride_ch
    if PREFETCH > 0:
        # Lines past the record's end read its last line again (a prefetch is only a hint).
        lines = gl.minimum(gl.arange(0, 128, layout=PF_L) * PREFETCH_LINE, stride_ch - 1)
        last = gl.maximum(t1 - 1, t0)
        for j in gl.static_range(1, PREFETCH):
            if t0 + j < t1:
                _prefetch_record(cache_u8_ptr, bt_row, t0 + j, head_base, stride_cb, lines)
    for t in range(t0, t1):
        if PREFETCH > 0:
            _prefetch_record(
                cache_u8_ptr, bt_row, gl.minimum(t + PREFETCH, last), head_base, stride_cb, lines
            )
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
        if VALUE_BITS == 4:
            vw_hi = gl.load(u32 + OFF_VC // 4 + 1 + vw_off)
            vw_hi = gl.convert_layout(gl.reshape(vw_hi, [4, 32, 8]), VW_L, assert_trivial=True)
        else:
            vw_hi = vw
        ks = _key_channels(gl.load(f16 + OFF_KS // 2 + ks_off))  # [4, 128] fp16
        kz = _key_channels(gl.load(f16 + OFF_KZ // 2 + ks_off))
        kz = gl.convert_layout(kz, gl.SliceLayout(2, B_OP), assert_trivial=True)
        kt = _s_tokens(gl.load(u8 + OFF_KT + tk_off))  # [4, 32] log8 codes
        vs = _s_tokens(gl.load(f16 + OFF_VS // 2 + tk_off))  # [4, 32] fp16
        vz = _a_tokens(gl.load(f16 + OFF_VZ // 2 + tk_off))  # [4, 32] fp16
        vc = _v_channels(gl.load(u8 + OFF_VCS + vc_off))  # [4, 128] log8 codes
        # The query rows of the tile's frame, loaded per tile (from L1 after the first; the
        # compiler keeps a single frame's rows in registers). A tile whose keys are stored in
        # their own channels (its KEYS_UNROTATED flag, kvarn_math.format) is scored with the
        # query as it comes.
        if NUM_FRAMES == 2:
            frame = (gl.load(u8 + OFF_FL) & 1).to(gl.int32)
        else:
            frame = 0
        qs, qa = _load_query(qs_ptr, qa_ptr, seq, hkv, frame, num_q_heads, NUM_FRAMES, GROUP)

        # ---- scores: S = (qs * k_scale) codes + qs k_zero  (rows 0..15; 0..7 kept)
        qn = qs * gl.expand_dims(ks, 1)  # fp16, |qs| <= 1
        kz_b = gl.convert_layout(
            gl.expand_dims(kz, 2).broadcast_to([4, D, 8]), B_OP, assert_trivial=True
        )
        bias = mma_v2(qs, kz_b, zero_c8)  # [4, 16, 8], every column = sum_d qs k_zero
        # Codes stay 1024 + code (tokens j even) or 1024 + 16 code (j odd, whose k_token_scale
        # exponent is lowered by 4): start from -1024 sum_d qn plus the bias, x16 for odd j.
        corr = mma_v2(qn, neg1024_b, zero_c8)
        init = _bcast_cols4_pair(bias + corr, bias * 16.0 + corr)
        kb = _key_operand(kw)
        s = mma_v2(qn, kb, init)  # [4, 16, 32]
        s = gl.permute(gl.reshape(s, [4, 2, 8, 32]), (0, 2, 3, 1))
        s, _s_hi = gl.split(s)
        s = gl.convert_layout(s, ST_L, assert_trivial=True)  # [4, 8 heads, 32 tokens]
        s = s * (gl.expand_dims(qa, 2) * gl.expand_dims(_log8_shift(kt, kt_shift), 1))

        # ---- online softmax (base 2) per warp
        m_new = gl.maximum(m_i, gl.max(s, axis=2))
        alpha = gl.exp2(m_i - m_new)
        # s - m_new <= 0 up to rounding: the max and this difference may contract the score
        # product differently (an ulp of a score of 2e5 is 0.016), and p * v_scale must fit
        # fp16 even when v_scale is 65504.
        p = gl.exp2(gl.minimum(s - gl.expand_dims(m_new, 2), 0.0))
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
        # 2-bit codes stay 1024 + 4^e code (e = bits 3, 4 of the row m; the channel scale
        # exponent is lowered by 2 e): start from -1024 sum_t pn plus 4^e sum_t p v_zero.  Rows
        # 8..15 of the sums get a factor 4, bit 4 a factor 16 on the result.  4-bit codes stay
        # 1024 + 16^e code (e = bit 3 of m; exponent lowered by 4 e): rows 8..15 get 16.
        pz = mma_v2(vz_a, pt, zero_c8) * row4  # [4, 16, 8]: rows ROW_F^(row >> 3) sum p v_zero
        corr = mma_v2(neg1024_a, pnt, zero_c8)
        if VALUE_BITS == 2:
            init = _bcast_rows8_pair(pz + corr, pz * 16.0 + corr)
        else:
            init = _bcast_rows8_pair(pz + corr, pz + corr)
        va = _value_operand(vw, vw_hi, VALUE_BITS)
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
    part = (seq.to(gl.int64) * num_q_heads + hkv * GROUP + oh) * part_splits + split0 + split
    gl.store(acc_ptr + part * D + _vchan(om), out, mask=(oh < GROUP) & (om < D))
    MLL: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, ST_L))
    hh = gl.arange(0, 8, layout=MLL)
    mpart = (seq.to(gl.int64) * num_q_heads + hkv * GROUP + hh) * part_splits + split0 + split
    gl.store(ml_ptr + mpart * 2, gl.convert_layout(m_all, MLL), mask=hh < GROUP)
    gl.store(ml_ptr + mpart * 2 + 1, gl.convert_layout(l_all, MLL), mask=hh < GROUP)


def launch_fast_decode(
    prepared: tuple[torch.Tensor, torch.Tensor],
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    quantized_lens: torch.Tensor,
    sink_lens: torch.Tensor | None,
    acc: torch.Tensor,
    ml: torch.Tensor,
    split0: int,
    num_splits: int,
    split_tiles: int = 0,
    prefetch: int = 0,
    value_bits: int = 2,
) -> None:
    """Write splits ``[split0, split0 + num_splits)`` of the partials ``acc`` / ``ml`` (the
    layout of ``attention_partial_kernel``'s) with the quantized tiles of each sequence: each
    sequence's tiles divided evenly among the splits, or with ``split_tiles > 0`` split ``s``
    over tiles ``[s * split_tiles, (s + 1) * split_tiles)`` (batch-invariant).
    ``prepared``: the query rows from :func:`kvarn_kernels.attention.prep.prepare_queries`
    (two frames where tiles may hold their keys unrotated). ``prefetch``: tiles ahead of the
    one being read whose record is prefetched into L2 (0: none; the launcher passes
    :func:`kvarn_kernels.attention.launch.fast_prefetch`, 1 by default). ``value_bits``: the
    preset's (2: ``kvarn_k4v2_g128``, 4: ``kvarn_k4v4_g128``, :data:`PRESETS`)."""
    if not 0 <= prefetch <= 4:
        raise ValueError(f"prefetch must be 0..4 tiles ahead, got {prefetch}")
    if value_bits not in PRESETS:
        raise ValueError(f"the fast decode kernel reads 2- or 4-bit values, got {value_bits}")
    qs, qa = prepared
    b, frames, hq, _ = qs.shape
    hkv = kv_cache.shape[1]
    # The kernel takes base pointers and addresses records from the strides (16-byte aligned).
    fast_decode_partial_kernel[(b, hkv, num_splits)](
        qs,
        qa,
        kv_cache,
        kv_cache.view(torch.int16),
        kv_cache.view(torch.int32),
        kv_cache.view(torch.float16),
        kv_cache.stride(0),
        kv_cache.stride(1),
        block_table,
        block_table.stride(0),
        quantized_lens,
        quantized_lens if sink_lens is None else sink_lens,  # unread without a sink
        acc,
        ml,
        hq,
        num_splits,
        acc.shape[2],
        split0,
        split_tiles,
        GROUP=hq // hkv,
        NUM_FRAMES=frames,
        SINK=sink_lens is not None,
        FIXED=split_tiles > 0,
        PREFETCH=prefetch,
        VALUE_BITS=value_bits,
        **offset_constants(tile_layout(PRESETS[value_bits], HEAD_DIM)),
        num_warps=NUM_WARPS,
        maxnreg=MAX_REGISTERS,
    )


__all__ = [
    "HEAD_DIM",
    "MAX_GROUP",
    "PRESETS",
    "fast_decode_partial_kernel",
    "launch_fast_decode",
]
