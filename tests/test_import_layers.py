"""The layers of the code, read from its imports (ast), not from what it claims.

- launch -> models -> hybrid: no module imports from a layer above its own;
- inside hybrid, the library never imports an instrument (hybrid.instruments looks at the
  library from outside: the library must run without it);
- no import circle among the modules of hybrid/, models/ and launch/, counting imports
  inside functions and under TYPE_CHECKING (a circle kept alive by a late import is still
  a circle in the design).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hybrid", "models", "launch")
LAYER = {"hybrid": 0, "models": 1, "launch": 2}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports(path: Path, known: set[str]) -> set[str]:
    """The project's modules `path` imports (a `from P import N` of a module N counts as
    P.N; of a name, as P). Relative imports are resolved against the file's package."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {name for name in found if name in known}


def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    edges = {name: imports(path, known) for name, path in found.items()}
    # A package's __init__ is run by importing any of its modules: not an edge of the
    # module itself, so `a.b` importing `a.c` does not pass through `a`.
    return {name: {t for t in targets if t != name} for name, targets in edges.items()}


def test_no_import_goes_up_a_layer() -> None:
    upward = [
        f"{a} imports {b}"
        for a, targets in graph().items()
        for b in targets
        if LAYER[b.split(".")[0]] > LAYER[a.split(".")[0]]
    ]
    assert not upward, upward


def test_the_library_never_imports_an_instrument() -> None:
    wrong = [
        f"{a} imports {b}"
        for a, targets in graph().items()
        if a.startswith("hybrid.") and not a.startswith("hybrid.instruments")
        for b in targets
        if b.startswith("hybrid.instruments")
    ]
    assert not wrong, wrong


def find_circle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules in order, the first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (circle := visit(target)):
                return circle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (circle := visit(node)):
            return circle
    return None


def test_no_import_circle() -> None:
    assert find_circle(graph()) is None, " -> ".join(find_circle(graph()) or [])


def test_the_circle_finder_finds_a_circle() -> None:
    # The check above can fail: a circle of three is found, a chain is not.
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
