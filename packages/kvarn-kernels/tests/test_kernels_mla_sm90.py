"""The MLA decode kernel compiles for sm_90 (H100/H200) as the launcher runs it, without spills;
so do the dequantize and combine kernels.

Runs on the CPU: Triton compiles for a named target with the ptxas its wheel ships (in a
subprocess, this file run as a script, since Triton's interpreter has to be off). The
interpreter cannot run the kernel's inline PTX (the 4- and 2-bit codes unpacked two a register)
nor tell a spilling or shared-memory-hungry launch: this test and the GPU tests can.

    TRITON_INTERPRET=0 python tests/test_kernels_mla_sm90.py  # one JSON line per launch
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton  # type: ignore[import-untyped]

HERE = Path(__file__).parent
SM90_MAX_SHARED = 232448  # sm_90's largest shared memory per block (227 KiB)
# (preset, heads, query dtype): the default launch at 16 and 128 heads, the 2-bit preset with
# fp16 queries (the other magic number), all with the PTX unpack
CASES = [
    ("kvarn_mla_l4_g128", 16, "bf16"),
    ("kvarn_mla_l4_g128", 128, "bf16"),
    ("kvarn_mla_l2_g128", 16, "fp16"),
]
# the transposed dots (tokens on M, wgmma) the benchmark's sweep measures: compiles (spills
# allowed: an alternative, not the default)
TOKENS_M_CASE = ("kvarn_mla_l4_g128", 16, "bf16", {"BLOCK_T": 64}, {"num_warps": 4})


def _compile_cases() -> list[dict]:
    import torch
    import triton.language as tl  # type: ignore[import-untyped]
    from kvarn_kernels.mla.decode import mla_decode_kernel
    from kvarn_kernels.mla.launch import (
        _codes_as_floats,
        _decode_config,
        _offsets,
        default_heads_per_program,
    )
    from kvarn_math.mla import mla_layout
    from sm90_compile import TARGET, _ptxas_usage
    from triton.compiler import ASTSource  # type: ignore[import-untyped]

    dtypes = {"bf16": (torch.bfloat16, tl.bfloat16), "fp16": (torch.float16, tl.float16)}
    pointers = {"ql_ptr", "qpe_ptr", "st_ptr", "table_ptr", "seq_lens_ptr", "qlens_ptr"}
    pointers |= {"slots_ptr", "cache_u8", "cache_f16", "cache_i8", "ws_acc", "ws_ml"}
    rows = _other_kernels(TARGET, _ptxas_usage, ASTSource)
    launches = [(*c, {}, {}) for c in CASES] + [TOKENS_M_CASE]
    for preset, heads, dt, const_over, opt_over in launches:
        lay = mla_layout(preset)
        p = lay.preset
        hb = default_heads_per_program(heads)
        cfg = _decode_config(hb, p.latent_bits, p.group_size)
        magic, offset, asm, asm_c = _codes_as_floats(dtypes[dt][0], p.latent_bits)
        consts = dict(
            L=512,
            R=64,
            G=p.group_size,
            BITS=p.latent_bits,
            W=p.channel_group,
            HB=hb,
            BLOCK_T=cfg["block_tokens"],
            MAGIC=magic,
            OFF=offset,
            HALF=float(1 << (p.latent_bits - 1)),
            DOT_T=dtypes[dt][1],
            ASM=asm,
            ASM_C=asm_c,
            TOKENS_M=bool(const_over),
            **_offsets(lay),
        )
        consts.update(const_over)
        types = {
            "ql_ptr": f"*{dt}",
            "qpe_ptr": f"*{dt}",
            "st_ptr": f"*{dt}",
            "cache_u8": "*u8",
            "cache_f16": "*fp16",
            "cache_i8": "*i8",
            "ws_acc": "*fp32",
            "ws_ml": "*fp32",
        }
        sig, attrs = {}, {}
        for i, name in enumerate(mla_decode_kernel.arg_names):
            if name in consts:
                sig[name] = "constexpr"
            elif name in pointers:
                sig[name] = types.get(name, "*i32")
                attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                sig[name] = "fp32" if name == "sm_scale" else "i32"
                # the strides of q, the cache (tile_bytes) and the staging ring are multiples
                # of 16 in real use (Triton specializes on it); the block table's width need not
                if "stride" in name and name != "table_stride":
                    attrs[(i,)] = [["tt.divisibility", 16]]
        opts = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"], **opt_over}
        label = f"{preset} H{heads} {dt}" + (" tokens on M" if const_over else "")
        row = {"case": label, "asm": bool(asm), **opts}
        try:
            k = triton.compile(ASTSource(mla_decode_kernel, sig, consts, attrs), TARGET, opts)
            row["shared"] = int(k.metadata.shared)
            row.update(_ptxas_usage(k.asm["ptx"]))
            row["asm_in_ptx"] = "lop3.b32" in k.asm["ptx"]
        except Exception as exc:  # a launch that does not compile is a result too
            row["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        rows.append(row)
    return rows


def _other_kernels(target, usage, source) -> list[dict]:
    """The dequantize kernel (every preset, bf16 rows, as launched) and the combine kernel."""
    from kvarn_kernels.mla.decode import mla_combine_kernel
    from kvarn_kernels.mla.kernel import mla_dequantize_kernel
    from kvarn_kernels.mla.launch import _offsets
    from kvarn_math.mla import MLA_PRESETS, mla_layout

    launches = []
    types = {"cache_u8": "*u8", "cache_f16": "*fp16", "cache_i8": "*i8", "block_ptr": "*i32"}
    types |= {"out_ptr": "*bf16", "ws_acc": "*fp32", "ws_ml": "*fp32"}
    for preset in MLA_PRESETS:
        p = mla_layout(preset).preset
        consts = dict(L=512, R=64, G=p.group_size, BITS=p.latent_bits, W=p.channel_group)
        consts |= dict(BLOCK_T=32, **_offsets(mla_layout(preset)))
        launches.append((f"dequantize {preset}", mla_dequantize_kernel, consts))
    launches.append(("combine", mla_combine_kernel, {"L": 512, "SPLITS_P2": 64}))
    rows = []
    for label, fn, consts in launches:
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        # pointers and strides: multiples of 16 in real use, as Triton specializes them
        attrs = {
            (i,): [["tt.divisibility", 16]]
            for i, n in enumerate(fn.arg_names)
            if n in types or "stride" in n
        }
        row: dict = {"case": label, "asm": None}
        try:
            k = triton.compile(source(fn, sig, consts, attrs), target, {"num_warps": 4})
            row["shared"] = int(k.metadata.shared)
            row.update(usage(k.asm["ptx"]))
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        rows.append(row)
    return rows


def test_decode_compiles_for_sm90_without_spills() -> None:
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.is_file():
        pytest.skip(f"this Triton wheel ships no ptxas ({ptxas})")
    proc = subprocess.run(
        [sys.executable, __file__],
        capture_output=True,
        text=True,
        env={**os.environ, "TRITON_INTERPRET": "0", "KVARN_KERNELS_NO_ASM": "0"},
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    # + the transposed launch, 4 dequantize, 1 combine
    assert len(rows) == len(CASES) + 6, proc.stderr[-3000:]
    bad = [
        r
        for r in rows
        if "error" in r
        or r["shared"] > SM90_MAX_SHARED
        or (r["spill_store_bytes"] and "tokens on M" not in r["case"])
        or (r["asm"] is not None and not (r["asm"] and r["asm_in_ptx"]))
    ]
    assert not bad, "\n".join(json.dumps(r) for r in bad)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    for r in _compile_cases():
        print(json.dumps(r), flush=True)
