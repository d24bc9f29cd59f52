"""Options of the GPU suites (capacity, throughput, greedy fidelity and perplexity through vLLM,
kernels)."""

from __future__ import annotations

from dataclasses import dataclass

from kvarn_eval.serving.caches import parse_caches
from kvarn_eval.serving.shapes import get_shape

# kvarn_kernels.bench's --key-frame and --windows choices (not imported: kvarn-eval runs the
# bench in a child process and does not need the kernels installed; a test compares)
KERNEL_KEY_FRAMES: tuple[str, ...] = ("auto", "rotated")
KERNEL_WINDOWS: tuple[str, ...] = ("open", "keys", "values")

__all__ = ["ServingOptions"]


@dataclass
class ServingOptions:
    """What the GPU suites were asked for (validated).

    Attributes:
        gpu_models: model shapes (dummy weights) of the capacity and throughput suites.
        caches: KV caches of capacity and throughput (see ``parse_caches``).
        prompt_lens: prompt tokens of each throughput burst.
        output_len: generated tokens per request.
        requests: a fixed number of requests per burst (``None``: fill the cache).
        fill: share of the KV cache a burst fills when ``requests`` is ``None``.
        max_num_seqs: vLLM's concurrency limit (kvarn allocates staging per slot).
        gpu_memory_utilization: share of GPU memory vLLM may use (capacity, throughput).
        tensor_parallel_size: GPUs per engine.
        enforce_eager: no CUDA graphs in capacity and throughput runs.
        cudagraph_capture_sizes: the batch sizes vLLM captures CUDA graphs for in capacity and
            throughput runs (``None``: vLLM's 51 default sizes up to 512). Fewer sizes start an
            engine sooner where capturing is slow (TurboQuant's took 204 s on the
            Llama-3.1-8B shape); a batch between two sizes runs padded to the larger.
        run_timeout: seconds before one engine run is killed.
        max_seconds: wall-clock budget of all GPU runs (``None``: unlimited).
        resume: keep each engine run of an earlier bench in the same output folder that
            finished ``ok`` with the same job (model, cache, engine arguments, workload,
            environment), and run only the others.
        engine_in_process: run vLLM's engine core inside the worker process
            (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) instead of its own process.
        greedy_model: model of the vLLM greedy and perplexity suites (``None``: the bench's
            ``--model``).
        greedy_caches: caches of the vLLM greedy suite; the first bf16 one is the reference.
        greedy_prompts: prompts of the fixed prompt set.
        greedy_tokens: greedy tokens generated per prompt.
        greedy_context_tokens: put a distinct passage of this many tokens of the text
            (``--text``) before each prompt, so that the prompts read quantized tiles (0: the
            prompt set alone, which stays inside the exact first tile, window and open tile).
        greedy_noise_max_num_seqs: the reference cache again with this concurrency limit
            (other batch shapes, other rounding): the bf16-vs-bf16 noise floor (0: skip).
        greedy_gpu_memory_utilization: memory share of the (small) greedy model's engines
            (the perplexity suite's too).
        ppl_caches: caches of the vLLM perplexity suite; the first bf16 one is the reference.
        ppl_chunks: text chunks it scores.
        ppl_tokens: tokens per chunk.
        ppl_chunk_size: prefill chunk, tokens of each text per step (all texts side by side;
            vLLM's ``long_prefill_token_threshold``): every chunk of a text attends to the cache
            its earlier chunks wrote, as decoding would (pseudo-decode; 128 is a kvarn tile).
        kernel_quick: the kernel microbenchmark's ``--quick`` grid.
        kernel_presets: kvarn presets of the kernel microbenchmark (comma-separated).
        kernel_key_frame: its ``--key-frame`` (``auto``: each tile's key frame chosen, as
            kvarn-vllm stores; ``rotated``: the plain format).
        kernel_windows: its ``--windows`` (:data:`KERNEL_WINDOWS`; ``values``: the exact first
            and recent tiles staged with their values only, kvarn-vllm's default for 4-bit keys;
            ``keys``: with their keys too, its default for 2- and 3-bit keys; ``open``: only
            the open tile).
    """

    gpu_models: tuple[str, ...] = ("llama-3.1-8b", "qwen3-8b", "qwen3-32b")
    caches: str = "default"
    prompt_lens: tuple[int, ...] = (4096, 16384, 32768)
    output_len: int = 1024
    requests: int | None = None
    fill: float = 1.0
    max_num_seqs: int = 256
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    run_timeout: float = 1800.0
    max_seconds: float | None = None
    resume: bool = False
    engine_in_process: bool = False
    greedy_model: str | None = None
    greedy_caches: str = "bf16@TRITON_ATTN,fp8@TRITON_ATTN,turboquant,kvarn"
    greedy_prompts: int = 100
    greedy_tokens: int = 64
    greedy_context_tokens: int = 0
    greedy_noise_max_num_seqs: int = 8
    greedy_gpu_memory_utilization: float = 0.3
    ppl_caches: str = "bf16@TRITON_ATTN,fp8@TRITON_ATTN,turboquant_4bit_nc,kvarn"
    ppl_chunks: int = 8
    ppl_tokens: int = 1024
    ppl_chunk_size: int = 128
    kernel_quick: bool = False
    kernel_presets: str = "kvarn_k4v2_g128"
    kernel_key_frame: str = "auto"
    kernel_windows: str = "values"

    def __post_init__(self) -> None:
        for name in self.gpu_models:
            get_shape(name)
        if not self.gpu_models:
            raise ValueError("gpu_models must name at least one model shape")
        parse_caches(self.caches)
        parse_caches(self.greedy_caches)
        parse_caches(self.ppl_caches)
        if not self.prompt_lens or min(self.prompt_lens) < 1:
            raise ValueError(f"prompt_lens must be positive, got {self.prompt_lens}")
        for name in (
            "output_len",
            "max_num_seqs",
            "tensor_parallel_size",
            "greedy_prompts",
            "greedy_tokens",
            "ppl_chunks",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.greedy_context_tokens < 0:
            raise ValueError(
                f"greedy_context_tokens must be >= 0, got {self.greedy_context_tokens}"
            )
        if self.kernel_key_frame not in KERNEL_KEY_FRAMES:
            raise ValueError(
                f"kernel_key_frame must be one of {', '.join(KERNEL_KEY_FRAMES)}, got "
                f"{self.kernel_key_frame!r}"
            )
        if self.kernel_windows not in KERNEL_WINDOWS:
            raise ValueError(
                f"kernel_windows must be one of {', '.join(KERNEL_WINDOWS)}, got "
                f"{self.kernel_windows!r}"
            )
        sizes = self.cudagraph_capture_sizes
        if sizes is not None:
            if not sizes or min(sizes) < 1 or list(sizes) != sorted(set(sizes)):
                raise ValueError(
                    "cudagraph_capture_sizes must be distinct positive batch sizes in "
                    f"increasing order, got {sizes}"
                )
            if self.enforce_eager:
                raise ValueError("cudagraph_capture_sizes has no effect with enforce_eager")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"requests must be >= 1, got {self.requests}")
        if not 0.0 < self.fill <= 1.0:
            raise ValueError(f"fill must be in (0, 1], got {self.fill}")
        for name in ("gpu_memory_utilization", "greedy_gpu_memory_utilization"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.run_timeout <= 0:
            raise ValueError(f"run_timeout must be > 0, got {self.run_timeout}")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise ValueError(f"max_seconds must be > 0, got {self.max_seconds}")
        if self.ppl_tokens < 2 or self.ppl_chunk_size < 1:
            raise ValueError(
                f"ppl_tokens must be >= 2 and ppl_chunk_size >= 1, got {self.ppl_tokens} and "
                f"{self.ppl_chunk_size}"
            )
        if self.greedy_noise_max_num_seqs < 0:
            raise ValueError(
                f"greedy_noise_max_num_seqs must be >= 0, got {self.greedy_noise_max_num_seqs}"
            )
        for shape_name in self.gpu_models:
            limit = get_shape(shape_name).max_position_embeddings
            if self.max_model_len > limit:
                raise ValueError(
                    f"prompt_lens {max(self.prompt_lens)} + output_len {self.output_len} (+16, rounded "
                    f"up to {self.max_model_len}) exceed "
                    f"{shape_name}'s {limit} positions"
                )

    @property
    def max_model_len(self) -> int:
        """vLLM's ``max_model_len`` for capacity and throughput engines: the longest request
        plus a margin of 16 tokens, rounded up to a multiple of 256.

        vLLM logs its "GPU KV cache size" as whole ``max_model_len`` requests, each rounded up
        to its last block; a length that is a multiple of every block size in use (16 for
        bf16, the tile of 64, 128 or 256 tokens for kvarn) makes that number the pool's
        tokens for every cache, instead of penalizing the larger blocks."""
        return -(-(max(self.prompt_lens) + self.output_len + 16) // 256) * 256
