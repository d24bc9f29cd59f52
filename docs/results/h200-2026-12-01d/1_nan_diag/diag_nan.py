import os, sys, numpy as np, torch
sys.path.insert(0, "tests")
import kvarn_kernels as kk
from kvarn_kernels.attention import fast, launch
from kvarn_math.layout import tile_layout
from test_kernels_gpu import _adversarial
DEV = "cuda"
preset, d, g = "kvarn_k4v2_g128", 128, 128
def scen(kind, dtype, tiles=(0, 1)):
    x = _adversarial(kind, g, d)
    t = 2 * g + 3
    k = np.concatenate([x, x, x[:3]])[:, None, :]
    v = np.concatenate([x[::-1], x, x[:3]])[:, None, :]
    lay = tile_layout(preset, d)
    cache = torch.zeros(4, 1, lay.tile_bytes, dtype=torch.uint8, device=DEV)
    staging = torch.zeros(kk.staging_shape(1, 1, d, preset), dtype=dtype, device=DEV)
    table = np.array([[2, 0, 1]], dtype=np.int32)
    plan = kk.plan_store([0], [t], None, [0], table, preset).to(DEV)
    kk.store_kv(torch.from_numpy(k).to(DEV, dtype), torch.from_numpy(v).to(DEV, dtype), cache, staging, plan, preset)
    return cache, staging, torch.from_numpy(table).to(DEV), t, lay
if __name__ == '__main__':
    torch.manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        cache, staging, table, t, lay = scen("fp16_max", dtype)
        rec = cache[[2, 0]].cpu().numpy()
        off = lay.offsets
        for i in range(2):
            r = rec[i, 0]
            def f16(name, n): return r[off[name]:off[name] + 2 * n].view(np.float16).astype(np.float32)
            print(dtype, "tile", i, {nm: (float(f16(nm, n).min()), float(f16(nm, n).max())) for nm, n in [("k_scale", d), ("k_zero", d), ("v_scale", g), ("v_zero", g)]},
                  "kt", int(r[off["k_token_scale"]:off["k_token_scale"] + g].min()), int(r[off["k_token_scale"]:off["k_token_scale"] + g].max()),
                  "vc", int(r[off["v_channel_scale"]:off["v_channel_scale"] + d].min()), int(r[off["v_channel_scale"]:off["v_channel_scale"] + d].max()),
                  "flag", int(r[off["flags"]]))
        q = torch.randn(1, 4, d, device=DEV, dtype=dtype)
        for fastflag in ("0", "1"):
            os.environ["KVARN_KERNELS_FAST_DECODE"] = fastflag
            out = kk.decode_attention(q, cache, staging, table, torch.tensor([t], dtype=torch.int32, device=DEV),
                                      torch.tensor([2 * g], dtype=torch.int32, device=DEV), torch.tensor([0], dtype=torch.int32, device=DEV), preset, d ** -0.5)
            print(dtype, "FAST", fastflag, "finite", bool(torch.isfinite(out).all()), "absmax", float(out.float().abs().nan_to_num().max()))
        for ql in (g, 2 * g):
            for raw in (False, True):
                acc = torch.full((1, 4, 1, d), 7.0, device=DEV); ml = torch.full((1, 4, 1, 2), 7.0, device=DEV)
                fast.launch_fast_decode(q, cache, table, torch.tensor([ql], dtype=torch.int32, device=DEV), None, d ** -0.5, raw, acc, ml, 0, 1)
                torch.cuda.synchronize()
                print(dtype, "fast partial ql", ql, "raw", raw, "acc finite", bool(torch.isfinite(acc).all()), "ml", ml.flatten().tolist()[:4], "acc absmax", float(acc.abs().nan_to_num().max()))
        qs, qa = fast.prepare_queries(q, d ** -0.5, True)
        print(dtype, "qs finite", bool(torch.isfinite(qs).all()), "qa", qa.flatten().tolist())
