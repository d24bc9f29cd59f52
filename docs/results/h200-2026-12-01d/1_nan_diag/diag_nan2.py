import os, sys, numpy as np, torch
sys.path.insert(0, "tests")
sys.path.insert(0, "../../.gpurun")
from diag_nan import scen, fast, DEV, g, d
torch.manual_seed(0)
def run(cache, table, q, label):
    acc = torch.full((1, 4, 1, d), 7.0, device=DEV); ml = torch.full((1, 4, 1, 2), 7.0, device=DEV)
    fast.launch_fast_decode(q, cache, table, torch.tensor([g], dtype=torch.int32, device=DEV), None, d ** -0.5, False, acc, ml, 0, 1)
    torch.cuda.synchronize()
    a = acc[0, :, 0]
    print(label, "finite frac", float(torch.isfinite(a).float().mean()), "nan rows per head", [int((~torch.isfinite(a[h])).sum()) for h in range(4)], "absmax", float(a.abs().nan_to_num(0, 0, 0).max()), "ml", [round(x, 2) for x in ml.flatten().tolist()[:4]])
for dtype in (torch.float16, torch.bfloat16):
    cache, staging, table, t, lay = scen("fp16_max", dtype)
    off = lay.offsets
    q = torch.randn(1, 4, d, device=DEV, dtype=dtype)
    def setf(c, name, n, val):
        c = c.clone(); c[2, 0, off[name]:off[name] + 2 * n].view(torch.float16).fill_(val); return c
    run(cache, table, q, f"{dtype} as stored")
    for vs in (65504.0, 60000.0, 40000.0, 32768.0, 16384.0):
        run(setf(cache, "v_scale", g, vs), table, q, f"{dtype} vs={vs}")
    run(setf(setf(cache, "v_scale", g, 65504.0), "v_zero", g, 0.0), table, q, f"{dtype} vs=65504 vz=0")
    run(setf(setf(cache, "v_scale", g, 1000.0), "v_zero", g, -65504.0), table, q, f"{dtype} vs=1000 vz=-65504")
    c2 = cache.clone(); c2[2, 0, off["v_codes"]:off["v_codes"] + g * d // 4] = 0
    run(c2, table, q, f"{dtype} vcodes=0")
    c3 = cache.clone(); c3[2, 0, off["v_channel_scale"]:off["v_channel_scale"] + d] = 16
    run(c3, table, q, f"{dtype} vc=16")
