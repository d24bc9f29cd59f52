"""Nineteenth run: per-kernel CUDA time of one decode-attention call (kernel bench cases,
Llama-3.1-8B shape, kvarn_k4v2_g128, key frames per tile), with the staged pass reading the
prepared query rows (491482e): keys too and values only at batch 16 and 64 x 4K, and batch 256
x 4K (a 4K burst's decode batch) with values-only windows, the staged splits uncapped and
capped at one per sequence and KV head (KVARN_KERNELS_STAGED_SPLITS=1). torch.profiler,
50 calls each, after the CUDA-graph time of the call."""
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from kvarn_kernels.bench import _Case, _template_records

dev = torch.device("cuda")
tmpl = _template_records("kvarn_k4v2_g128", 128, 8, torch.bfloat16, dev, mixed=True)
CASES = [
    ("", 64, 4096, "keys"),
    ("", 64, 4096, "values"),
    ("", 16, 4096, "values"),
    ("", 256, 4096, "values"),
    ("1", 256, 4096, "values"),
    ("1", 64, 4096, "values"),
]
for splits, b, ctx, w in CASES:
    if splits:
        os.environ["KVARN_KERNELS_STAGED_SPLITS"] = splits
    else:
        os.environ.pop("KVARN_KERNELS_STAGED_SPLITS", None)
    launch = f"staged_splits={splits or 'auto'}"
    case = _Case("kvarn_k4v2_g128", 32, 8, 128, b, ctx, torch.bfloat16, dev, tmpl, True, w)
    for _ in range(5):
        case.run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        case.run()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        case.run()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    st.record()
    for _ in range(50):
        g.replay()
    en.record()
    torch.cuda.synchronize()
    total = st.elapsed_time(en) / 50 * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(50):
            case.run()
        torch.cuda.synchronize()
    parts = []
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0) > 0:
            t = getattr(e, "self_device_time_total", 0) / 50
            if t > 0:
                parts.append(f"{e.key[:40]}={t:.1f}")
    print(f"launch[{launch or 'default'}] b={b} ctx={ctx} {w}: graph {total:.1f} us | " + " ".join(parts), flush=True)
    del case, g
    torch.cuda.empty_cache()
