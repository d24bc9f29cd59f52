"""Real model shapes with dummy weights: a ``config.json`` is all vLLM needs.

vLLM's ``load_format="dummy"`` initializes random weights of the configured shape, so capacity and
throughput at 8B and 32B scale need no weight files (``skip_tokenizer_init=True`` and token-id
prompts: no tokenizer either). The configurations below are the published ones of each model
(architecture, layer and head counts, sizes, vocabulary, RoPE).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["MODEL_SHAPES", "ModelShape", "get_shape", "write_model_dir"]


@dataclass(frozen=True)
class ModelShape:
    """A model's ``config.json`` under a short name.

    Attributes:
        name: what ``--gpu-models`` takes.
        description: the model it copies.
        config: the Hugging Face configuration.
    """

    name: str
    description: str
    config: dict[str, Any]

    @property
    def num_layers(self) -> int:
        """Decoder layers."""
        return int(self.config["num_hidden_layers"])

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads per layer."""
        return int(self.config["num_key_value_heads"])

    @property
    def head_dim(self) -> int:
        """Channels per head."""
        return int(self.config["head_dim"])

    @property
    def vocab_size(self) -> int:
        """Vocabulary size (random prompts draw from it)."""
        return int(self.config["vocab_size"])

    @property
    def max_position_embeddings(self) -> int:
        """The longest context the configuration allows."""
        return int(self.config["max_position_embeddings"])


_LLAMA_31_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "max_window_layers": layers,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "sliding_window": None,
        "use_sliding_window": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    }


MODEL_SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape(
            "llama-3.1-8b", "Llama-3.1-8B (32 layers, 8 KV heads, head_dim 128)", _LLAMA_31_8B
        ),
        ModelShape(
            "qwen3-8b",
            "Qwen3-8B (36 layers, 8 KV heads, head_dim 128)",
            _qwen3(4096, 12288, 36, 32),
        ),
        ModelShape(
            "qwen3-32b",
            "Qwen3-32B (64 layers, 8 KV heads, head_dim 128)",
            _qwen3(5120, 25600, 64, 64),
        ),
    )
}


def get_shape(name: str) -> ModelShape:
    """The shape called ``name``.

    Args:
        name: a key of :data:`MODEL_SHAPES`.

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    try:
        return MODEL_SHAPES[name]
    except KeyError:
        raise ValueError(
            f"unknown model shape {name!r}; expected one of {', '.join(MODEL_SHAPES)}"
        ) from None


def write_model_dir(shape: ModelShape, root: Path) -> Path:
    """Write ``shape``'s ``config.json`` into ``root/<name>`` and return that folder.

    Args:
        shape: the model shape.
        root: parent folder (created if needed).
    """
    path = root / shape.name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(shape.config, indent=2, sort_keys=True) + "\n")
    return path
