"""Test setup for kvarn-vllm (CPU, vLLM 0.26 installed, no GPU).

* Without a GPU, ``TRITON_INTERPRET=1`` is set before anything imports Triton: the
  forward-pass tests run the kvarn-kernels Triton kernels in Triton's interpreter on CPU
  tensors. With a GPU (``nox -s gpu`` collects every package's tests in one session) the
  environment is left alone, so other packages' GPU tests keep compiled Triton.
* vLLM resolves its platform from the hardware; this host has none it recognizes, so the
  tests install vLLM's CPU platform (only ``device_type`` and config defaults are used).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import pytest


def _install_cpu_platform() -> None:
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    if not isinstance(platforms._current_platform, CpuPlatform):
        platforms._current_platform = CpuPlatform()


@pytest.fixture(scope="session", autouse=True)
def registered():
    """vLLM's CPU platform installed and the plugin registered, once per session."""
    _install_cpu_platform()
    import kvarn_vllm

    kvarn_vllm.register()
    return True


@pytest.fixture(autouse=True)
def fresh_step_state():
    """Each test starts with a new worker's step state. The step channel (the last step's
    record, staging slots by request id) and the sink table are process-global, as a vLLM
    worker serves one engine; tests build many engines' layers in one process, and one
    test's requests must not leave sink rows or slots for the next one to read."""
    from kvarn_vllm import sink, step

    step.STEP.__init__()  # in place: the runner hooks hold its bound methods
    sink.reset()


@pytest.fixture(autouse=True)
def default_dtype_restored():
    """torch's default dtype as each test found it: vLLM's ``set_default_torch_dtype`` does
    not restore it when the model build inside it raises (a refusal test), and the next test
    in the process would then make bf16 tensors where it asked for float32."""
    before = torch.get_default_dtype()
    yield
    torch.set_default_dtype(before)


@pytest.fixture
def vllm_config_factory(registered):
    """Build a real VllmConfig with a kvarn (or any) cache dtype, on the CPU device."""
    from vllm.config import CacheConfig, DeviceConfig, SchedulerConfig, VllmConfig

    def make(
        cache_dtype: str = "kvarn_k4v2_g64",
        block_size: int | None = None,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 512,
        **cache_kwargs,
    ):
        cache = CacheConfig(cache_dtype=cache_dtype, block_size=block_size, **cache_kwargs)
        sched = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_num_batched_tokens,
            is_encoder_decoder=False,
        )
        return VllmConfig(
            cache_config=cache, scheduler_config=sched, device_config=DeviceConfig(device="cpu")
        )

    return make
