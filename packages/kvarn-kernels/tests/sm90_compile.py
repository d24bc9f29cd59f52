"""Compile the kernels for sm_90 (H100/H200) on a machine without a GPU, and report resources.

Triton compiles ahead of time for a named target with the ptxas its wheel ships, so what a kernel
needs of an SM (shared memory, registers, spills) is known on the CPU. A store kernel that needed
more shared memory than an SM has once passed every CPU test and failed only inside vLLM's warmup
on the GPU; ``test_kernels_sm90.py`` runs this script (Triton's interpreter must be off, so in a
subprocess) and checks every launch the kernels make at the supported head sizes.

    TRITON_INTERPRET=0 python tests/sm90_compile.py store attention  # one JSON line per kernel

The constants mirror the launchers: ``default_launch`` for attention, the quantize launcher's
warp count, ``tile_layout`` offsets. Pointers and strides are declared 16-divisible, as real
cache and activation tensors are, since vectorized layouts change what goes through shared memory.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import triton  # type: ignore[import-untyped]
from kvarn_kernels._format import offset_constants
from kvarn_kernels._triton import INTERPRET
from kvarn_math import PRESETS, get_preset, tile_layout
from kvarn_math.varnorm import DEFAULT_ITERATIONS
from triton.backends.compiler import GPUTarget  # type: ignore[import-untyped]
from triton.compiler import ASTSource  # type: ignore[import-untyped]

TARGET = GPUTarget("cuda", 90, 32)
HEAD_DIMS = (64, 128, 256)
FLOAT_ARGS = ("rsqrt_d", "qk_scale")


def _tile_consts(preset: str, d: int) -> dict[str, int]:
    """The constants every kernel that reads or writes a record takes: G, D, bits, offsets."""
    p = get_preset(preset)
    return {
        "G": p.group_size,
        "D": d,
        "KEY_BITS": p.key_bits,
        "VALUE_BITS": p.value_bits,
        **offset_constants(tile_layout(preset, d)),
    }


def _ptxas_usage(ptx: str, loop: bool = False) -> dict[str, int]:
    """Registers and spill bytes as ptxas reports them (``ptxas -v``) for sm_90a; ``loop``:
    also the SASS instructions of the longest loop (:func:`_longest_loop`)."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        out = subprocess.run(
            [str(ptxas), "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "kernel.cubin")],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
        loop_instructions = _longest_loop(Path(tmp) / "kernel.cubin") if loop else None
    regs = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores", out)
    extra = {} if loop_instructions is None else {"loop_instructions": loop_instructions}
    return {
        **extra,
        "registers": int(regs.group(1)) if regs else -1,
        "spill_store_bytes": int(spills.group(1)) if spills else 0,
    }


def _longest_loop(cubin: Path) -> int:
    """SASS instructions in the longest loop of ``cubin`` (per warp and iteration; ``nvdisasm``
    from Triton's wheel): from a backward branch's target to the branch."""
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    sass = subprocess.run(
        [str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    order: dict[int, int] = {}
    labels: dict[str, int] = {}
    pending: list[str] = []
    branches: list[tuple[int, str]] = []
    for line in sass.splitlines():
        label = re.match(r"^\s*\.(L\w+):", line)
        if label:
            pending.append(label.group(1))
            continue
        ins = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?);", line)
        if ins:
            addr = int(ins.group(1), 16)
            order[addr] = len(order)
            labels.update((p, addr) for p in pending)
            pending = []
            target = re.search(r"BRA.*?`\(\.(L\w+)\)", ins.group(2))
            if target:
                branches.append((addr, target.group(1)))
    spans = [order[a] - order[labels[t]] + 1 for a, t in branches if t in labels and labels[t] < a]
    return max(spans, default=0)


def compile_kernel(
    fn: Any,
    pointers: dict[str, str],
    consts: dict[str, Any],
    options: dict[str, int],
    label: str,
    source: Any = ASTSource,
    loop: bool = False,
) -> dict[str, Any]:
    """Compile ``fn`` for sm_90; pointers not named in ``pointers`` are ``*i32``. ``source``:
    ``GluonASTSource`` for a Gluon kernel."""
    params = list(fn.arg_names)
    sig: dict[str, str] = {}
    attrs: dict[tuple[int], list[list[Any]]] = {}
    for i, name in enumerate(params):
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = pointers.get(name, "*i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in FLOAT_ARGS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    start = time.time()
    row: dict[str, Any] = {"kernel": label, **options}
    try:
        k = triton.compile(
            source(fn, sig, consts, attrs),
            target=TARGET,
            options=options,
        )
        row["shared"] = int(k.metadata.shared)
        row.update(_ptxas_usage(k.asm["ptx"], loop))
        row["wgmma"] = k.asm["ptx"].count("wgmma.mma_async")
        row["l2_prefetches"] = k.asm["ptx"].count("prefetch.global.L2")
    except Exception as exc:  # a kernel that does not compile is a result too
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    row["seconds"] = round(time.time() - start, 1)
    return row


def store_rows(head_dims: tuple[int, ...] = HEAD_DIMS) -> list[dict[str, Any]]:
    from kvarn_kernels.quantize.kernel import quantize_tiles_kernel, stage_tokens_kernel
    from kvarn_kernels.quantize.launch import _num_warps

    rows = []
    ptrs = {"key_ptr": "*bf16", "value_ptr": "*bf16", "stage_ptr": "*bf16", "q_ptr": "*bf16"}
    ptrs |= {"fq_ptr": "*bf16"}
    ptrs |= {"cache_u8_ptr": "*u8", "cache_f16_ptr": "*fp16", "frames_ptr": "*i8"}
    for name in PRESETS:
        g = get_preset(name).group_size
        for d in head_dims:
            consts = dict(
                _tile_consts(name, d),
                SG=g,
                SINK_ROWS=g,
                KSG=g,
                KSINK=0,  # the key ring of values-only windows (the default layout: g)
                GROUP=4,
                KEY_FRAME=1,  # chosen from the queries: both frames quantized, the most code
                ITERS=DEFAULT_ITERATIONS,
                FRESH_ROTATED=False,
                PRECISE=True,
                STAGED_QUERIES=True,  # speculative decoding's variant: the query's two sources
            )
            opts = {"num_warps": _num_warps(tile_layout(name, d))}  # as launched: default stages
            rows.append(
                compile_kernel(quantize_tiles_kernel, ptrs, consts, opts, f"store {name} D{d}")
            )
    for d in head_dims:
        consts = {"D": d, "BLOCK_T": 16, "G": 128, "GROUP": 4, "STAGED_QUERIES": True}
        rows.append(
            compile_kernel(
                stage_tokens_kernel, ptrs, consts, {"num_warps": 4}, f"stage_tokens D{d}"
            )
        )
    return rows


def dequantize_rows(head_dims: tuple[int, ...] = HEAD_DIMS) -> list[dict[str, Any]]:
    from kvarn_kernels.dequantize.kernel import dequantize_kernel
    from kvarn_kernels.dequantize.launch import _num_warps

    rows = []
    ptrs = {"cache_u8_ptr": "*u8", "cache_f16_ptr": "*fp16"}
    ptrs |= {"k_out_ptr": "*bf16", "v_out_ptr": "*bf16"}
    for name in ("kvarn_k4v2_g128", "kvarn_k3v2_g128"):
        for d in head_dims:
            consts = dict(_tile_consts(name, d), UNROTATE=True)
            opts = {"num_warps": _num_warps(tile_layout(name, d))}
            rows.append(
                compile_kernel(dequantize_kernel, ptrs, consts, opts, f"dequantize {name} D{d}")
            )
    return rows


def attention_rows(head_dims: tuple[int, ...] = HEAD_DIMS) -> list[dict[str, Any]]:
    from kvarn_kernels.attention.kernel import (
        attention_combine_kernel,
        attention_partial_kernel,
        default_launch,
    )
    from kvarn_kernels.attention.launch import _MAX_SPLITS, _next_pow2

    rows = []
    ptrs = {"q_ptr": "*bf16", "stage_ptr": "*bf16", "cache_u8_ptr": "*u8"}
    ptrs |= {"cache_f16_ptr": "*fp16", "acc_ptr": "*fp32", "ml_ptr": "*fp32"}
    ptrs |= {"fk_ptr": "*bf16", "fv_ptr": "*bf16", "pq_ptr": "*fp16", "pa_ptr": "*fp32"}
    # (preset, decode): the 4-bit-key path and the generic one, decode and multi-query blocks
    # of 16 query tokens at GQA group 4 (as the launcher sizes them); multi-query with the
    # step's own K/V (FRESH, what kvarn-vllm launches; without it is a subset).
    cases = [("kvarn_k4v2_g128", True), ("kvarn_k3v2_g128", True), ("kvarn_k4v4_g64", True)]
    cases += [("kvarn_k4v2_g128", False), ("kvarn_k3v2_g128", False)]
    for name, decode in cases:
        p = get_preset(name)
        for d in head_dims:
            launch = default_launch(decode, d, p.group_size, (p.key_bits, p.value_bits))
            group, block_h = 4, 4
            block_q = 1 if decode else 16
            consts = dict(
                _tile_consts(name, d),
                SG=p.group_size,
                SINK_ROWS=p.group_size,
                KSG=p.group_size,
                KSINK=p.group_size,
                VWIN=False,
                GROUP=group,
                BLOCK_H=block_h,
                BLOCK_Q=block_q,
                BLOCK_M=max(16, block_q * block_h),
                DECODE=decode,
                FP32=False,
                SUB=launch["SUB"],
                PHASED=p.key_bits == 4 and p.value_bits in (2, 4),
                FRESH=not decode,
                RAW_KEYS=True,
                QUANT=True,
                PREPARED=False,
            )
            opts = {k: v for k, v in launch.items() if k != "SUB"}
            label = f"attention {'decode' if decode else 'multi-query'} {name} D{d}"
            rows.append(compile_kernel(attention_partial_kernel, ptrs, consts, opts, label))
            if name == "kvarn_k4v2_g128" and d == 128:
                # Values-only exact windows (the key ring apart, window keys from records).
                vconsts = {**consts, "KSINK": 0, "VWIN": True}
                rows.append(
                    compile_kernel(
                        attention_partial_kernel, ptrs, vconsts, opts, f"{label} value windows"
                    )
                )
                if decode:
                    # Beside the fast decode kernel: the staged splits only (QUANT=False), with
                    # the prepared query rows and one stage, as the launcher runs them.
                    for wname, wconsts in (("keys", consts), ("value windows", vconsts)):
                        rows.append(
                            compile_kernel(
                                attention_partial_kernel,
                                ptrs,
                                {**wconsts, "QUANT": False, "PREPARED": True},
                                {**opts, "num_stages": 1},
                                f"{label} staged splits, {wname}",
                            )
                        )
            if d == max(head_dims) and name == "kvarn_k4v2_g128":
                # Other query dtypes at the largest head size: fp16, and fp32 (exact dots).
                for dt in ("fp16", "fp32"):
                    dptrs = {**ptrs, "q_ptr": f"*{dt}", "stage_ptr": f"*{dt}"}
                    dptrs |= {"fk_ptr": f"*{dt}", "fv_ptr": f"*{dt}"}
                    dconsts = {**consts, "FP32": dt == "fp32"}
                    rows.append(
                        compile_kernel(
                            attention_partial_kernel,
                            dptrs,
                            dconsts,
                            opts,
                            label.replace(f" D{d}", f" {dt} D{d}"),
                        )
                    )
    for d in head_dims:
        for decode in (True, False):
            consts = {"D": d, "GROUP": 4, "BLOCK_H": 4, "DECODE": decode}
            consts["BLOCK_S"] = _next_pow2(_MAX_SPLITS)  # as the launcher compiles it
            cptrs = {"acc_ptr": "*fp32", "ml_ptr": "*fp32", "out_ptr": "*bf16"}
            rows.append(
                compile_kernel(
                    attention_combine_kernel,
                    cptrs,
                    consts,
                    {"num_warps": 4},
                    f"combine {'decode' if decode else 'multi-query'} D{d}",
                )
            )
    return rows


def fast_rows(head_dims: tuple[int, ...] = HEAD_DIMS) -> list[dict[str, Any]]:
    """The Gluon decode kernel (kvarn_k4v2_g128 and kvarn_k4v4_g128, head_dim 128 only), as
    the launcher compiles it: GQA 4 and 8, one frame and two (the key-frame flag read per
    tile), with a sink, and the batch-invariant launch's fixed splits."""
    from kvarn_kernels.attention import fast
    from triton.experimental.gluon._runtime import GluonASTSource  # type: ignore[import-untyped]

    if fast.HEAD_DIM not in head_dims:
        return []
    ptrs = {"qs_ptr": "*fp16", "qa_ptr": "*fp32", "cache_u8_ptr": "*u8"}
    ptrs |= {"cache_u16_ptr": "*i16", "cache_u32_ptr": "*i32", "cache_f16_ptr": "*fp16"}
    ptrs |= {"acc_ptr": "*fp32", "ml_ptr": "*fp32"}
    rows = []
    # (the batch-invariant launch, FIXED splits, once: it changes only the split bounds; L2
    # prefetch, KVARN_KERNELS_FAST_PREFETCH, 1 and 2 tiles ahead; 4-bit values with the
    # default launch's settings and batch-invariant)
    for group, frames, fixed, prefetch, vbits in (
        (4, 2, False, 0, 2),
        (8, 2, False, 0, 2),
        (4, 1, False, 0, 2),
        (4, 2, True, 0, 2),
        (4, 2, False, 1, 2),
        (8, 2, True, 2, 2),
        (4, 2, False, 1, 4),
        (8, 1, True, 1, 4),
    ):
        preset = fast.PRESETS[vbits]
        tile = offset_constants(tile_layout(preset, fast.HEAD_DIM))
        consts = dict(
            tile,
            GROUP=group,
            NUM_FRAMES=frames,
            SINK=True,
            FIXED=fixed,
            PREFETCH=prefetch,
            VALUE_BITS=vbits,
        )
        opts = {"num_warps": fast.NUM_WARPS, "maxnreg": fast.MAX_REGISTERS}
        label = f"fast decode {preset} D{fast.HEAD_DIM} group {group} frames {frames}"
        label += " fixed splits" if fixed else ""
        label += f" prefetch {prefetch}" if prefetch else ""
        rows.append(
            compile_kernel(
                fast.fast_decode_partial_kernel, ptrs, consts, opts, label, GluonASTSource
            )
        )
    from kvarn_kernels.attention.prep import prepare_queries_kernel

    pptrs = {"q_ptr": "*bf16", "qs_ptr": "*fp16", "qa_ptr": "*fp32"}
    pconsts = {"D": fast.HEAD_DIM, "BLOCK_R": 16, "FRAMES": 2}
    rows.append(
        compile_kernel(
            prepare_queries_kernel, pptrs, pconsts, {"num_warps": 4}, "prepare_queries D128"
        )
    )
    return rows


def tiles_rows(head_dims: tuple[int, ...] = HEAD_DIMS) -> list[dict[str, Any]]:
    """The Triton tiles decode kernel (``attention/tiles.py``) for every preset and head size as
    the launcher compiles it (GQA 4, both key frames, sink rows; the window is a runtime
    argument), with its launch parameters (``tiles_launch``)."""
    from kvarn_kernels.attention.tiles import TILES_N, tiles_decode_partial_kernel, tiles_launch

    ptrs = {"qs_ptr": "*fp16", "qa_ptr": "*fp32", "cache_u8_ptr": "*u8"}
    ptrs |= {"cache_f16_ptr": "*fp16", "acc_ptr": "*fp32", "ml_ptr": "*fp32"}
    rows = []
    for preset in PRESETS:
        for d in head_dims:
            consts = _tile_consts(preset, d)
            consts |= {"GROUP": 4, "BLOCK_H": 4, "BLOCK_Q": 1, "N": TILES_N, "DECODE": True}
            consts |= {"FRESH": False, "FRAMES": 2, "SINK": True, "FIXED": False}
            opts = tiles_launch(d, consts["KEY_BITS"])
            label = f"tiles decode {preset} D{d}"
            rows.append(
                compile_kernel(tiles_decode_partial_kernel, ptrs, consts, opts, label, loop=True)
            )
    # Multi-query blocks (verify, chunk continuation): 8 tokens x GQA 4, the step's own K/V.
    for preset in ("kvarn_k4v2_g128", "kvarn_k2v2_g128"):
        consts = _tile_consts(preset, 128) | {"GROUP": 4, "BLOCK_H": 4, "BLOCK_Q": 8, "N": 32}
        consts |= {"DECODE": False, "FRESH": True, "FRAMES": 2, "SINK": True, "FIXED": False}
        opts = tiles_launch(128, consts["KEY_BITS"], 32)
        label = f"tiles multi-query {preset} D128"
        rows.append(
            compile_kernel(tiles_decode_partial_kernel, ptrs, consts, opts, label, loop=True)
        )
    return rows


def legacy_decode_rows(head_dims: tuple[int, ...] = HEAD_DIMS) -> list[dict[str, Any]]:
    """For comparison with ``tiles``: ``attention_partial_kernel`` reading the records itself
    (``QUANT=True``, the decode path before the tiles kernel, ``set_tiles_decode(False)``) for
    every preset and head size, GQA 4, the open tile only, with its longest loop's SASS count.
    Not part of the CPU tests (a few minutes)."""
    from kvarn_kernels.attention.kernel import attention_partial_kernel, default_launch

    ptrs = {"q_ptr": "*bf16", "stage_ptr": "*bf16", "cache_u8_ptr": "*u8"}
    ptrs |= {"cache_f16_ptr": "*fp16", "acc_ptr": "*fp32", "ml_ptr": "*fp32"}
    ptrs |= {"fk_ptr": "*bf16", "fv_ptr": "*bf16", "pq_ptr": "*fp16", "pa_ptr": "*fp32"}
    rows = []
    for name in PRESETS:
        p = get_preset(name)
        for d in head_dims:
            launch = default_launch(True, d, p.group_size, (p.key_bits, p.value_bits))
            consts = dict(
                _tile_consts(name, d),
                SG=p.group_size, SINK_ROWS=0, KSG=p.group_size, KSINK=0, VWIN=False, GROUP=4,
                BLOCK_H=4, BLOCK_Q=1, BLOCK_M=16, DECODE=True, FP32=False, SUB=launch["SUB"],
                PHASED=p.key_bits == 4 and p.value_bits in (2, 4), FRESH=False, RAW_KEYS=True,
                QUANT=True, PREPARED=False,
            )  # fmt: skip
            opts = {k: v for k, v in launch.items() if k != "SUB"}
            label = f"legacy decode {name} D{d} SUB {launch['SUB']}"
            rows.append(
                compile_kernel(attention_partial_kernel, ptrs, consts, opts, label, loop=True)
            )
    return rows


def rotation_rows(head_dims: tuple[int, ...] = HEAD_DIMS) -> list[dict[str, Any]]:
    from kvarn_kernels.rotation.kernel import rotate_rows_kernel

    rows = []
    ptrs = {"x_ptr": "*bf16", "out_ptr": "*bf16", "signs_ptr": "*fp32"}
    for d in (*head_dims, 512):
        consts = {"D": d, "BLOCK_R": 16, "SIGNS_FIRST": True, "SIGNS_LAST": False}
        rows.append(
            compile_kernel(rotate_rows_kernel, ptrs, consts, {"num_warps": 4}, f"rotate D{d}")
        )
    return rows


FAMILIES = {
    "store": store_rows,
    "dequantize": dequantize_rows,
    "attention": attention_rows,
    "fast": fast_rows,
    "tiles": tiles_rows,
    "legacy_decode": legacy_decode_rows,
    "rotation": rotation_rows,
}


def main(argv: list[str]) -> int:
    if INTERPRET:
        print("sm90_compile.py needs TRITON_INTERPRET unset or 0", file=sys.stderr)
        return 2
    for family in argv or list(FAMILIES):
        for row in FAMILIES[family]():
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
