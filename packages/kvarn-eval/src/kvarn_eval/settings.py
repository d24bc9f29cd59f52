"""kvarn-eval's settings: the environment variables it reads, in one frozen object.

:meth:`EvalSettings.from_env` reads and validates them where a run needs them (finding data,
the model cache, the commit to record). The serving settings an engine runs with
(``KVARN_VLLM_*``, ``KVARN_KERNELS_*``) are kvarn-vllm's and kvarn-kernels' (a cache label's
``+setting`` sets them for its engine); every ``KVARN_*`` variable of a run is recorded in its
JSON (``report.environment_info``). ``docs/settings.md`` is generated from the fields'
metadata (``python docs/gen_tables.py``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["EvalSettings"]


def _setting(env: str, doc: str, allowed: str = "a folder") -> Any:
    """A text setting (unset or blank: None), with the metadata kvarn-kernels' settings carry
    (kvarn-eval does not depend on kvarn-kernels; ``docs/gen_tables.py`` reads both)."""
    meta = {"env": env, "parse": str, "allowed": allowed, "doc": doc, "use": "run"}
    return field(default=None, metadata=meta)


@dataclass(frozen=True)
class EvalSettings:
    """The benchmarks' environment settings (``docs/settings.md`` lists them)."""

    cache: str | None = _setting(
        "KVARN_CACHE",
        "root of kvarn-eval's caches (models converted or downloaded under `models/<name>`); "
        "unset: `~/.cache/kvarn`",
    )
    data: str | None = _setting(
        "KVARN_DATA",
        "the first folder searched for `wikitext-2-raw-test.txt` (then `../shared/data` "
        "beside the checkout, then the dataset hub)",
    )
    git_sha: str | None = _setting(
        "KVARN_GIT_SHA",
        "the commit a result records, for code run from an exported tree (no `.git`); unset: "
        "`git rev-parse HEAD` of the checkout, marked `-dirty` when it has changes",
        allowed="a commit id",
    )

    gpu_files: str | None = _setting(
        "KVARN_GPU_FILES",
        "the GPU machine's model files (`SmolLM2-135M-Instruct.Q4_1.gguf`, the Gemma-3 GGUF; "
        "the parts' `env.sh` sets it to `/tmp/kvarn-gpu/files`): the default folder of "
        "`--gguf` in `packages/kvarn-eval/scripts/e2e_smoke.py`, `e2e_spec.py` and `soak.py` "
        "(unset: the working folder) and of `tools/gpu/setup.sh`'s `GGUF` (unset: the parts' "
        "`files/`)",
    )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EvalSettings:
        """The settings in ``environ`` (default ``os.environ``), each stripped."""
        env = os.environ if environ is None else environ
        values = {}
        for f in fields(cls):
            raw = env.get(f.metadata["env"], "").strip()
            if raw:
                values[f.name] = raw
        return cls(**values)
