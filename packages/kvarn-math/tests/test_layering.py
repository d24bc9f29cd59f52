import subprocess
import sys


def test_importing_kvarn_math_never_imports_torch() -> None:
    code = (
        "import sys, kvarn_math, kvarn_math.baselines, kvarn_math.metrics, kvarn_math.report;"
        "bad = [m for m in ('torch', 'triton', 'vllm', 'hypothesis') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
