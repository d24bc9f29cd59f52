"""kvarn-eval: accuracy (and, with a GPU, throughput and capacity) benchmarks for KV-cache formats.

The CPU accuracy path simulates each method inside transformers (:mod:`kvarn_eval.accuracy`),
on models and data that install from PyPI (:mod:`kvarn_eval.models`, :mod:`kvarn_eval.data`);
:mod:`kvarn_eval.report` writes tables, JSON and plots; ``kvarn-eval bench`` runs it all.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
