"""Regenerate the tables in the docs from the code (``--check``: fail if they are stale).

Blocks between ``<!-- BEGIN generated: NAME -->`` and ``<!-- END generated: NAME -->`` are
replaced with the output of the generator called NAME.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import re
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvarn_math.layout import PRESETS, format_fields, format_table
from kvarn_math.report import format_report, measure

DOCS = Path(__file__).parent


def _fields() -> str:
    parts = [format_fields(p, d) for p in PRESETS for d in (64, 128, 256, 512)]
    return "\n\n".join(parts)


# The caches of kvarn-eval's `--caches default` (kvarn_eval.serving.caches.DEFAULT_CACHES, not
# imported: the docs session installs kvarn-math alone), in its order, as the tables label them.
GPU_TABLE_CACHES = (
    "bf16@FLASH_ATTN",
    "bf16@TRITON_ATTN",
    "fp8",
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
    *PRESETS,
)
GPU_TABLE_MODELS = ("llama-3.1-8b", "qwen3-8b", "qwen3-32b", "qwen3-32b tp2")
GPU_TABLE_CELLS = ("capacity", "4K", "16K", "32K")


def _gpu_coverage() -> str:
    """Which cells of the capacity and throughput tables (model x cache, and prompt length for
    throughput) the H200 results under ``docs/results/`` hold, per model ``capacity / 4K / 16K
    / 32K``: ``yes`` where a burst finished or an engine logged its pool, ``tried`` where runs
    started and none did, ``-`` where none ran (or was skipped). Rows with a kvarn setting (``+recent0``, ...) are left out; a burst's engine counts
    for capacity too (it records the pool it ran with)."""
    done: set[tuple[str, str, str]] = set()
    tried: set[tuple[str, str, str]] = set()
    models: list[str] = list(GPU_TABLE_MODELS)
    for path in sorted((DOCS / "results").glob("h200-*/**/results.json")):
        try:
            results = json.loads(path.read_text()).get("results") or []
        except (OSError, ValueError) as err:
            raise SystemExit(f"{path}: not readable JSON ({err})") from None
        for result in results:
            if result.get("suite") not in ("capacity", "throughput"):
                continue
            for row in result.get("rows") or []:
                cache = "fp8" if str(row.get("cache")).startswith("fp8") else row.get("cache")
                if cache not in GPU_TABLE_CACHES or str(row.get("status")).startswith("skipped"):
                    continue  # a skipped row's run never started
                tp = int(row.get("tensor_parallel_size") or 1)
                model = str(row.get("model")) + (f" tp{tp}" if tp > 1 else "")
                if model not in models:
                    models.append(model)
                cells = [("capacity", row.get("kv_cache_tokens"))]
                if result["suite"] == "throughput":
                    cells.append((f"{int(row['prompt_len']) // 1024}K", row.get("total_tok_per_s")))
                for what, value in cells:
                    tried.add((model, what, cache))
                    # a pool is measured once the engine started, whatever became of its burst
                    if value is not None and (what == "capacity" or row.get("status") == "ok"):
                        done.add((model, what, cache))
    lines = [
        "| cache | " + " | ".join(models) + " |",
        "| --- |" + " :---: |" * len(models),
    ]
    for cache in GPU_TABLE_CACHES:
        cells = [
            " / ".join(
                "yes" if (m, w, cache) in done else "tried" if (m, w, cache) in tried else "-"
                for w in GPU_TABLE_CELLS
            )
            for m in models
        ]
        lines.append(f"| `{cache}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


PACKAGES = DOCS.parent / "packages"
# (package, source folder, settings module, class) of every settings object.
SETTINGS = (
    ("kvarn_kernels", "kvarn-kernels", "kvarn_kernels.settings", "KernelSettings"),
    ("kvarn_vllm", "kvarn-vllm", "kvarn_vllm.settings", "VllmSettings"),
    ("kvarn_eval", "kvarn-eval", "kvarn_eval.settings", "EvalSettings"),
)
USES = {
    "engine": "serving knob",
    "legacy": "keeps an older path",
    "measurement": "measurements",
    "run": "where a run finds or records things",
}


def _settings_class(package: str, folder: str, module: str, name: str) -> Any:
    """The settings class of ``module`` without running its package's ``__init__`` (which
    needs torch and vLLM, absent from the docs session): the package is entered as an empty
    namespace over its source folder, and the settings modules import the standard library,
    kvarn-math and each other only."""
    if package not in sys.modules:
        stub = types.ModuleType(package)
        stub.__path__ = [str(PACKAGES / folder / "src" / package)]
        sys.modules[package] = stub
    return getattr(importlib.import_module(module), name)


def _default(value: Any) -> str:
    if value is None or value == ():
        return "unset"
    if isinstance(value, bool):
        return f"`{int(value)}`"
    return f"`{value}`"


def _settings_table(which: str) -> str:
    """The variables of one package's settings object: default, accepted values, use and why."""
    (spec,) = [s for s in SETTINGS if s[0] == which]
    cls = _settings_class(*spec)
    lines = [
        "| variable | default | accepts | use | what it does |",
        "| --- | --- | --- | --- | --- |",
    ]
    for f in dataclasses.fields(cls):
        m = f.metadata
        lines.append(
            f"| `{m['env']}` | {_default(f.default)} | {m['allowed']} | {USES[m['use']]} "
            f"| {m['doc']} |"
        )
    return "\n".join(lines)


RESULTS = DOCS / "results"
CARDS = {"cpu": "CPU", "h200": "H200"}


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


def _results_index() -> str:
    """One row per run folder under ``docs/results/``, newest first: the folder (its README when
    it has one), card, date, title (the README's heading), files, size, and the pages citing it."""
    pages = sorted(DOCS.glob("*.md"))
    texts = {page: page.read_text() for page in pages}
    lines = [
        "| run | card | date | what | files | size | cited by |",
        "| --- | --- | --- | --- | ---: | ---: | --- |",
    ]
    runs = [d for d in RESULTS.iterdir() if d.is_dir()]
    for run in sorted(runs, key=lambda d: (d.name.split("-", 1)[1], d.name), reverse=True):
        kind, _, rest = run.name.partition("-")
        date = rest[:10]
        files = [f for f in run.rglob("*") if f.is_file()]
        readme = run / "README.md"
        if readme.is_file():
            title = readme.read_text().splitlines()[0].lstrip("# ").strip()
            name = f"[{run.name}]({run.name}/README.md)"
        else:
            shown = sorted(f.name for f in files if f.parent == run)[:4]
            title = "no README; files: " + ", ".join(f"`{f}`" for f in shown)
            name = run.name
        cited = [f"[{p.stem}](../{p.name})" for p in pages if f"results/{run.name}/" in texts[p]]
        size = _size(sum(f.stat().st_size for f in files))
        lines.append(
            f"| {name} | {CARDS.get(kind, kind)} | {date} | {title.replace('|', '/')} "
            f"| {len(files)} | {size} | {', '.join(cited) or '-'} |"
        )
    return "\n".join(lines)


GENERATORS: dict[str, Callable[[], str]] = {
    "presets": format_table,
    "fields-default": lambda: format_fields("kvarn_k4v2_g128", 128),
    "fields-all": _fields,
    "report": lambda: format_report(measure()),
    "gpu-coverage": _gpu_coverage,
    "results-index": _results_index,
    **{f"settings-{p}": (lambda p=p: _settings_table(p)) for p, *_ in SETTINGS},
}

BLOCK = re.compile(
    r"(<!-- BEGIN generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- END generated: (?P=name) -->)",
    re.S,
)


def render(text: str) -> str:
    def replace(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in GENERATORS:
            raise SystemExit(f"unknown generated block {name!r}; known: {sorted(GENERATORS)}")
        return f"{m.group(1)}{GENERATORS[name]()}\n{m.group(4)}"

    return BLOCK.sub(replace, text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a page is out of date")
    args = parser.parse_args()
    stale = []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        new = render(text)
        if new != text:
            stale.append(page.relative_to(DOCS))
            if not args.check:
                page.write_text(new)
    if args.check and stale:
        print(
            f"stale generated tables in {', '.join(map(str, stale))}: run python docs/gen_tables.py"
        )
        return 1
    print("generated tables are up to date" if args.check else f"updated {len(stale)} page(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
