"""No import cycle inside any package: each package's module graph, computed from the source,
is acyclic.

An edge is an import at module level, ``if TYPE_CHECKING:`` blocks included (a type-only cycle
is still two modules that cannot be understood apart); an import inside a function is not an
edge (a deliberately lazy import, e.g. of torch). ``from pkg import name`` is an edge to the
module ``pkg.name`` when there is one, else to ``pkg`` itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("pswire", "pscore", "psserver", "psworker", "psctl")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(package: str) -> dict[str, Path]:
    """Every module of ``package`` (generated code included: it imports its siblings too)."""
    return {module_name(p): p for p in sorted((REPO / package).rglob("*.py"))}


def _module_level(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports run when the module is imported (or type-checked): module level, inside
    ``if``/``try``/``with`` blocks, not inside functions or classes' methods."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If | ast.Try | ast.With):
            for block in ("body", "orelse", "finalbody"):
                pending.extend(getattr(node, block, []))
            for handler in getattr(node, "handlers", []):
                pending.extend(handler.body)
        elif isinstance(node, ast.ClassDef):
            pending.extend(s for s in node.body if not isinstance(s, ast.FunctionDef))
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules among ``known`` that module ``name`` (at ``path``) imports."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in _module_level(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: from the module's own package upwards
                here = name.split(".") if is_package else name.split(".")[:-1]
                anchor = here[: len(here) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        for target in targets:
            # ``import a.b.c`` needs a.b.c (its parents are loaded on the way, not cycles).
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def import_graph(package: str) -> dict[str, set[str]]:
    mods = package_modules(package)
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_inside_a_package(package: str) -> None:
    graph = import_graph(package)
    assert len(graph) > 3, f"found only {sorted(graph)} in {package}"
    assert not cycles(graph), f"import cycles in {package}: {cycles(graph)}"


def test_no_import_cycle_between_the_wire_and_the_core() -> None:
    # pswire's messages import pscore's types; pscore reaches pswire only through
    # pswire.errors: together their modules form no cycle.
    mods = {**package_modules("pswire"), **package_modules("pscore")}
    graph = {name: imports_of(name, path, set(mods)) for name, path in mods.items()}
    assert "pscore.checks" in graph["pswire.codec"]
    assert not cycles(graph), f"import cycles between pswire and pscore: {cycles(graph)}"


def test_the_graph_sees_type_checking_and_relative_imports_but_not_lazy_ones(
    tmp_path: Path,
) -> None:
    # The checker itself: a cycle through a TYPE_CHECKING import is found; one closed only by
    # an import inside a function is not.
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import B\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\nB = 1\n"
    )
    (pkg / "c.py").write_text("from pkg import a\nC = 1\n")
    (pkg / "d.py").write_text("def f():\n    from pkg import a\n")
    mods = {
        ".".join(p.relative_to(tmp_path).with_suffix("").parts): p for p in sorted(pkg.glob("*.py"))
    }
    mods = {k.removesuffix(".__init__"): v for k, v in mods.items()}
    known = set(mods)
    graph = {name: imports_of(name, path, known) for name, path in mods.items()}
    assert graph["pkg.d"] == set()
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
