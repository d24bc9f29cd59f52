"""kvarn-vllm's settings: every ``KVARN_VLLM_*`` environment variable in one frozen object.

:meth:`VllmSettings.from_env` reads and validates them when an engine parses its
``kv_cache_dtype`` (:func:`kvarn_vllm.config.parse_kv_cache_dtype`), so every process vLLM
starts reads the environment it inherited, once per engine; a bad value raises ``ValueError``
naming the variable, the values it accepts and what arrived. ``docs/settings.md`` is generated
from the fields' metadata (``python docs/gen_tables.py``).

No setting is needed: each changes one default, set before vLLM starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvarn_math.envsettings import parse_flag, read_environment, setting
from kvarn_math.tile import KEY_FRAMES

__all__ = ["MAX_RECENT_TILES", "VllmSettings"]

MAX_RECENT_TILES = 4


def _recent(raw: str) -> int:
    if not raw.isdigit() or int(raw) > MAX_RECENT_TILES:
        raise ValueError(raw)
    return int(raw)


def _key_frame(raw: str) -> str:
    if raw not in KEY_FRAMES:
        raise ValueError(raw)
    return raw


@dataclass(frozen=True)
class VllmSettings:
    """The plugin's environment settings (``docs/settings.md`` lists them)."""

    exact_sink: bool = setting(
        "KVARN_VLLM_EXACT_SINK",
        True,
        parse_flag,
        "0 or 1",
        "`1` keeps each request's first tile exact in staging (and lets prefix-cache hits "
        "read it); `0` gives those `G` staging tokens per request and layer to the KV cache "
        "instead",
    )
    recent_tiles: int = setting(
        "KVARN_VLLM_RECENT_TILES",
        1,
        _recent,
        f"an integer from 0 to {MAX_RECENT_TILES} (complete tiles read exact from staging)",
        "complete tiles before the one a step's first token sits in that stay exact in "
        "staging besides their records, and that attention reads there. Each tile costs `G` "
        "staging tokens per request slot and layer: at 256 slots the Llama-3.1-8B shape holds "
        "3,810,608 tokens against 3,968,293 with `0` (-4.0%, ninth H200 run); it buys "
        "`kvarn_k4v2_g128` perplexity +1.22% -> +0.45% on SmolLM2 and +1.03% -> +0.14% on "
        "Gemma-3 (pseudo-decode, CPU)",
    )
    key_frame: str = setting(
        "KVARN_VLLM_KEY_FRAME",
        "auto",
        _key_frame,
        f"one of {', '.join(KEY_FRAMES)} (each tile's key frame chosen from the queries, "
        "or always rotated)",
        "`auto`: the store keeps each tile's keys Hadamard-rotated or in their own channels, "
        "whichever its estimate of the attention-score error over the step's queries says "
        "loses less (the record's `KEYS_UNROTATED` flag); `rotated`: every tile rotated, and "
        "attention skips the flag ([Format](format.md#the-key-frame-of-a-record)). `auto` takes Gemma-3's `kvarn_k2v2_g128` from +7.45% to "
        "+0.65% through vLLM and leaves SmolLM2 and k4v2 unchanged within noise; it costs "
        "2.4-3.2% of decode attention time and about 29 us per layer in a decode step that "
        "completes a tile (H200, twelfth run)",
    )
    window_keys: bool | None = setting(
        "KVARN_VLLM_WINDOW_KEYS",
        None,
        parse_flag,
        "0 or 1",
        "unset: `0` for 4-bit keys, `1` for 2- and 3-bit keys. `0`: the exact windows (first "
        "tile, recent tile) keep only their values exact and attention scores them from their "
        "records, which takes staging from 3 to 2 tiles per slot (4.47x bf16's tokens instead "
        "of 4.29x on the Llama-3.1-8B shape, H200); `1`: keys too. Through vLLM on SmolLM2: "
        "k4v2 +0.69% with `0`, +0.46% with `1`; k2v2 +16.02% with `0`, +4.38% with `1` "
        "(H200, fifteenth run)",
    )
    verify_as_decode: bool | None = setting(
        "KVARN_VLLM_VERIFY_AS_DECODE",
        None,
        parse_flag,
        "0 or 1",
        "unset: on with speculative decoding. On: verify blocks (at most 16 tokens per "
        "request) run as decode rows, one per token, through the kernel and launch that decode "
        "without speculation; `0`: through the multi-query kernel (the default until "
        "2026-12-04). Greedy agreement with no speculation (H200, thirty-third run, commit "
        "`35d7ba9`, SmolLM2, n-gram): 94.4% (k4v2, twice, the same to the last digit) and "
        "95.3% (k4v4) on, 87.0% with `0`, bf16 93.0-96.0% in the same session. A verify step "
        "of 5 tokens per request at the Llama-3.1-8B shape (`python -m kvarn_kernels.bench "
        "--verify 4`) takes 0.28-0.45x the multi-query kernel's time where the Gluon kernel "
        "decodes (k4v2, k4v4 at head_dim 128), 2.1-2.5x where the Triton kernel decodes alone "
        "(k2v2: each row reads the context, which the multi-query kernel reads once per block)",
    )
    spec_full_graphs: bool = setting(
        "KVARN_VLLM_SPEC_FULL_GRAPHS",
        True,
        parse_flag,
        "0 or 1",
        "with speculative decoding, declare full CUDA graphs for uniform batches (vLLM's "
        "`UNIFORM_BATCH`), so that verify and drafter steps keep full graphs; `0` declares "
        "single-token decodes only, as before 2026-12-03, and kvarn's attention then runs "
        "eagerly in every layer of a speculative step: DFlash ran at 349.3 tokens/s that way "
        "against 1,456.4 with full graphs, the same greedy output (H200)",
        use="legacy",
    )
    dense_context: bool = setting(
        "KVARN_VLLM_DENSE_CONTEXT",
        True,
        parse_flag,
        "0 or 1",
        "continuation chunks of 64+ tokens dequantize their context into a workspace and run "
        "FlashAttention; `0` sends them through `multi_query_attention`",
        use="legacy",
    )
    warmup: bool = setting(
        "KVARN_VLLM_WARMUP",
        True,
        parse_flag,
        "0 or 1",
        "compile every kernel variant when the engine starts (logged with its time; 23 s for "
        "the Llama-3.1-8B shape on an H200 in the seventh run, 55.3 s of a 156.2 s engine "
        "start on a fresh machine in the twenty-eighth, with more variants since), so that "
        "none compiles inside the first requests (about 11 s of the first 16K burst without "
        "it); `0` skips it. Triton keeps the compiled kernels on disk for later starts. vLLM "
        "0.26 points `TRITON_CACHE_DIR` at a folder of its torch.compile cache, one per engine "
        "configuration, so every new configuration compiled them again (20-37 s per kvarn "
        "engine start in the H200 logs); since 2026-12-03 the warm-up compiles in the folder "
        "`TRITON_CACHE_DIR` named when the process started (Triton's default `~/.triton/cache` "
        "when unset), shared by every configuration (a second process found every kernel "
        "there on the H200, twenty-sixth run)",
    )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> VllmSettings:
        """The settings in ``environ`` (default ``os.environ``), validated.

        Raises:
            ValueError: a variable holds a value it does not accept, naming it.
        """
        return read_environment(cls, environ)  # type: ignore[no-any-return]
