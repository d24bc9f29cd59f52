"""What a KVarN record holds: the largest power-of-two magnitude each kind of tile is stored at
without overflow, with the relative error it has at magnitude 1 (docs/reliability.md).

    python packages/kvarn-eval/scripts/record_range.py   # about 11 minutes on 2 CPU cores
"""

import kvarn_math as km
import numpy as np
from kvarn_math.metrics import relative_error
from kvarn_math.testing.strategies import make_kv

results = {}
for preset in ("kvarn_k4v2_g128", "kvarn_k2v2_g128", "kvarn_k4v4_g64"):
    g = km.get_preset(preset).group_size
    for d in (64, 128, 256):
        for dist in ("gaussian", "heavy_tailed", "outlier_channels", "single_outlier", "one_token"):
            worst = 200
            for seed in range(4):
                if dist == "single_outlier":
                    x = make_kv((g, d), "gaussian", seed)
                    x[seed * 7 % g, seed * 5 % d] = 1e4
                elif dist == "one_token":
                    x = make_kv((g, d), "gaussian", seed) * 1e-3
                    x[seed % g] *= 1e6
                else:
                    x = make_kv((g, d), dist, seed)
                x = x / np.abs(x).max()
                base = km.dequantize_tiles(km.quantize_tiles(x, x, preset), preset, d)
                for e in range(0, 128):
                    y = (x * np.float32(2.0**e)).astype(np.float32)
                    if not np.isfinite(y).all():
                        break
                    try:
                        rec = km.quantize_tiles(y, y, preset)
                    except ValueError:
                        worst = min(worst, e - 1)
                        break
                    k, v = km.dequantize_tiles(rec, preset, d)
                    # held: the relative error it has at magnitude 1 (within 1%)
                    for got, want in ((k, base[0]), (v, base[1])):
                        eg, ew = relative_error(y, got), relative_error(x, want)
                        assert eg <= ew * 1.01 + 1e-6, (preset, d, dist, e, eg, ew)
            results[(preset, d, dist)] = worst
            print(preset, d, dist, "largest 2^e held:", worst, f"({2.0**worst:.3g})", flush=True)
print("min over all:", min(results.values()))
