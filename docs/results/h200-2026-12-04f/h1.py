"""Host time of one decode_attention call on the GPU machine (the Python wrapper and the
launches), and where it goes (cProfile), for the Gluon path (k4v2) and Triton alone (k2v2)."""
import cProfile, pstats, sys, time, torch
from kvarn_kernels import bench
dev = torch.device("cuda")
for preset in ("kvarn_k4v2_g128", "kvarn_k2v2_g128"):
    t = bench._template_records(preset, 128, 8, torch.bfloat16, dev, mixed=True)
    case = bench._Case(preset, 32, 8, 128, 16, 4096, torch.bfloat16, dev, t, True, "values")
    for _ in range(5):
        case.run()
    torch.cuda.synchronize()
    n = 300
    t0 = time.perf_counter()
    for _ in range(n):
        case.run()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(f"{preset}: host {1e6*(t1-t0)/n:.1f} us per call (enqueue), with sync {1e6*(t2-t0)/n:.1f}")
    pr = cProfile.Profile(); pr.enable()
    for _ in range(100):
        case.run()
    pr.disable(); torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(22)
