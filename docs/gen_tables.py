"""Regenerate the tables in the docs from the code (``--check``: fail if they are stale).

Blocks between ``<!-- BEGIN generated: NAME -->`` and ``<!-- END generated: NAME -->`` are
replaced with the output of the generator called NAME.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

from kvarn_math.layout import PRESETS, format_fields, format_table
from kvarn_math.report import format_report, measure

DOCS = Path(__file__).parent


def _fields() -> str:
    parts = [format_fields(p, d) for p in PRESETS for d in (64, 128, 256, 512)]
    return "\n\n".join(parts)


GENERATORS: dict[str, Callable[[], str]] = {
    "presets": format_table,
    "fields-default": lambda: format_fields("kvarn_k4v2_g128", 128),
    "fields-all": _fields,
    "report": lambda: format_report(measure()),
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
