"""The shape of kvarn-vllm's sources: a layered import graph and short functions.

Run as a script to print the measurements (import edges, cycles, longest functions):
``python packages/kvarn-vllm/tests/test_structure.py [--all-packages]``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "kvarn_vllm"
PACKAGES = Path(__file__).resolve().parents[2]
MAX_FUNCTION_LINES = 100


def _module_name(path: Path) -> str:
    return path.stem


def _kvarn_imports(tree: ast.Module, own: set[str]) -> dict[str, str]:
    """``{module: "top" | "lazy"}``: the package's modules this module imports, at module
    level (``top``) or only inside functions (``lazy``)."""
    found: dict[str, str] = {}

    def note(name: str, where: str) -> None:
        if name in own and found.get(name) != "top":
            found[name] = where

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inner = "lazy"
            if isinstance(child, ast.Import):
                for alias in child.names:
                    parts = alias.name.split(".")
                    if parts[0] == "kvarn_vllm" and len(parts) > 1:
                        note(parts[1], where)
            elif isinstance(child, ast.ImportFrom) and child.module:
                parts = child.module.split(".")
                if parts[0] == "kvarn_vllm" and child.level == 0:
                    if len(parts) > 1:
                        note(parts[1], where)
                    else:
                        for alias in child.names:
                            note(alias.name, where)
            visit(child, inner)

    visit(tree, "top")
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, dict[str, str]]:
    """``{module: {imported module: "top" | "lazy"}}`` for the package's modules."""
    files = {_module_name(p): p for p in sorted(package.glob("*.py"))}
    own = set(files) - {"__init__"}
    return {
        name: _kvarn_imports(ast.parse(path.read_text()), own - {name})
        for name, path in files.items()
    }


def cycles(graph: dict[str, dict[str, str]], kinds: tuple[str, ...]) -> list[list[str]]:
    """The strongly connected components of more than one module, over edges of ``kinds``."""
    edges = {m: [t for t, k in deps.items() if k in kinds] for m, deps in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, []):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            strongconnect(v)
    return found


def _walk(node: ast.AST, prefix: str, where: str, out: list[tuple[int, str]]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{child.name}"
            if not isinstance(child, ast.ClassDef):
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                out.append((lines, f"{where}:{name}"))
            _walk(child, name + ".", where, out)
        else:
            _walk(child, prefix, where, out)


def function_lengths(root: Path) -> list[tuple[int, str]]:
    """``(lines, "path:qualified name")`` of every function under ``root``, longest first;
    a function's lines include those of functions and classes defined inside it."""
    out: list[tuple[int, str]] = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())

        _walk(tree, "", str(path.relative_to(PACKAGES)), out)
    return sorted(out, reverse=True)


VLLM_SUBCLASSES = {"builder", "impl", "mla_impl"}
"""The modules that subclass vLLM's classes (so import vLLM): the backend names them only
when vLLM asks for its builder or implementation."""

CALL_TIME_BACK_EDGES = {
    # The builder applies the ledger's worker entries when vLLM builds it in a worker.
    ("builder", "patches"),
    # Warm-up compiles under the Triton folder register() found.
    ("warmup", "plugin"),
    # The release adapters pick the ledger's entries (issue 46).
    ("releases", "patches"),
}
"""Imports inside functions that point up the layers: they run at call time, never while a
module loads, and are the only edges that close a cycle (see the test below)."""


def _top_level_vllm_imports(path: Path) -> list[str]:
    found = []
    for node in ast.parse(path.read_text()).body:
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        found += [n for n in names if n.split(".")[0] == "vllm"]
    return found


def test_no_import_cycle_at_module_level():
    assert cycles(import_graph(), ("top",)) == []


def test_only_the_listed_call_time_imports_close_cycles():
    graph = import_graph()
    for source, target in CALL_TIME_BACK_EDGES:
        if target in graph.get(source, {}):
            assert graph[source][target] == "lazy", (source, target)
            del graph[source][target]
    assert cycles(graph, ("top", "lazy")) == []


def test_only_the_vllm_subclasses_import_vllm_at_module_level():
    importers = {p.stem for p in PACKAGE.glob("*.py") if _top_level_vllm_imports(p)}
    assert importers == VLLM_SUBCLASSES
    graph = import_graph()
    for module, deps in graph.items():
        for target in VLLM_SUBCLASSES & set(deps):
            assert deps[target] == "lazy", f"{module} imports {target} at module level"


LONG_FUNCTIONS_KNOWN = {
    # The backend class is still built in a closure (it grows with the release adapters of
    # issue 46); it goes to module level as the builder and the implementation did.
    "kvarn-vllm/src/kvarn_vllm/backend.py:_base_class",
}


def test_functions_are_short():
    long = {where for n, where in function_lengths(PACKAGE) if n > MAX_FUNCTION_LINES}
    assert long <= LONG_FUNCTIONS_KNOWN


def main(argv: list[str]) -> None:
    graph = import_graph()
    print("kvarn_vllm import graph (module -> imports; * = inside functions only):")
    for module, deps in sorted(graph.items()):
        shown = ", ".join(f"{d}{'*' if k == 'lazy' else ''}" for d, k in sorted(deps.items()))
        print(f"  {module}: {shown or '-'}")
    print("cycles, module-level imports:", cycles(graph, ("top",)))
    print("cycles, counting imports inside functions:", cycles(graph, ("top", "lazy")))
    roots = [p / "src" for p in sorted(PACKAGES.iterdir()) if (p / "src").is_dir()]
    if "--all-packages" not in argv:
        roots = [PACKAGE.parent]
    lengths = sorted((x for r in roots for x in function_lengths(r)), reverse=True)
    over = sum(n > MAX_FUNCTION_LINES for n, _ in lengths)
    print(f"functions over {MAX_FUNCTION_LINES} lines: {over}; the 15 longest:")
    for n, where in lengths[:15]:
        print(f"  {n:4d}  {where}")


if __name__ == "__main__":
    main(sys.argv[1:])
