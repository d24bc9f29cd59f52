"""Test setup: hypothesis profiles, the interpreter/GPU split, NaN-filled allocation helpers.

CPU tests run the kernels in Triton's interpreter and need ``TRITON_INTERPRET=1`` in the
environment before Triton is imported (``TRITON_INTERPRET=1 pytest ...``); without it they are
skipped.  Tests marked ``gpu`` need CUDA and a compiled (non-interpreted) Triton.
"""

from __future__ import annotations

import os

import pytest
import torch
from kvarn_math.testing import register_profiles

register_profiles()

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@pytest.fixture(autouse=True)
def _settings_from_the_environment():
    """The kernels read their settings once (``kvarn_kernels.settings``); a test that changes
    them does so through ``kernel_testing.set_env``, and every test ends by re-reading them
    from the environment monkeypatch restored (autouse: torn down after monkeypatch)."""
    yield
    from kvarn_kernels import settings

    settings.reload()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_cpu = pytest.mark.skip(reason="CPU kernel tests need TRITON_INTERPRET=1")
    skip_gpu = pytest.mark.skip(reason="needs CUDA and TRITON_INTERPRET unset")
    gpu_ok = torch.cuda.is_available() and not INTERPRET
    for item in items:
        if "gpu" in item.keywords:
            if not gpu_ok:
                item.add_marker(skip_gpu)
        elif "interpreter" in item.keywords and not INTERPRET:
            item.add_marker(skip_cpu)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU")
    config.addinivalue_line("markers", "interpreter: runs Triton kernels in the CPU interpreter")
