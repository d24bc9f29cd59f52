"""Does Triton compile in parallel from threads? Compiles the first four store variants of
``tests/sm90_compile.py`` (head_dim 128) for sm_90 into an empty Triton cache, one after the
other (``seq``) or from N threads (``N``). Run from packages/kvarn-kernels with
TRITON_INTERPRET=0:  python threaded_compile.py seq; python threaded_compile.py 2
"""

import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
sys.path.insert(0, str(Path.cwd() / "tests"))
import sm90_compile as s  # noqa: E402

calls = []
compile_kernel = s.compile_kernel
s.compile_kernel = lambda *a, **k: calls.append((a, k)) or {}
s.store_rows((128,))
s.compile_kernel = compile_kernel
calls = [c for c in calls if c[0][4].startswith("store ")][:4]
print([c[0][4] for c in calls])
mode = sys.argv[1]
start = time.time()
if mode == "seq":
    rows = [compile_kernel(*a, **k) for a, k in calls]
else:
    with ThreadPoolExecutor(int(mode)) as pool:
        rows = list(pool.map(lambda c: compile_kernel(*c[0], **c[1]), calls))
print([(r["kernel"], r["seconds"], r.get("error")) for r in rows])
print(mode, "wall", round(time.time() - start, 1), "s")
