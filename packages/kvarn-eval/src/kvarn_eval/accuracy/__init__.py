"""CPU accuracy benchmarks: simulated KV-cache quantization inside transformers.

:mod:`~kvarn_eval.accuracy.pseudo_decode` hooks the model's attention; :mod:`.perplexity` and
:mod:`.tasks` run the methods of :mod:`.methods` and compare them with the bf16 reference.
"""

from kvarn_eval.accuracy.methods import (
    Unquantized,
    available_methods,
    select_methods,
    supported_for,
)
from kvarn_eval.accuracy.perplexity import (
    PerplexityResult,
    PerplexityRow,
    evaluate_perplexity,
    mean_and_se,
)
from kvarn_eval.accuracy.pseudo_decode import (
    ATTENTION_NAME,
    PseudoDecodeConfig,
    install,
    pseudo_decode,
    pseudo_decode_mask,
    quantize_kv,
)
from kvarn_eval.accuracy.tasks import (
    TaskResult,
    TaskRow,
    build_prompt,
    evaluate_task,
    prepare_items,
    quantized_fraction,
)

__all__ = [
    "ATTENTION_NAME",
    "PerplexityResult",
    "PerplexityRow",
    "PseudoDecodeConfig",
    "TaskResult",
    "TaskRow",
    "Unquantized",
    "available_methods",
    "build_prompt",
    "evaluate_perplexity",
    "evaluate_task",
    "install",
    "mean_and_se",
    "prepare_items",
    "pseudo_decode",
    "pseudo_decode_mask",
    "quantize_kv",
    "quantized_fraction",
    "select_methods",
    "supported_for",
]
