"""The package boundaries the architecture promises, checked on the source: psserver never
imports torch or psworker; psworker and psctl never import psserver; pswire (the wire) may
import pscore (the core whose types it encodes) but none of the others; pscore computes with
numpy alone: no grpc, protobuf or torch, and of pswire only the exception family
(``pswire.errors``, which imports nothing of ours); torch stays out of psworker's numpy-level
modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Packages and the top-level names their modules must never import.
FORBIDDEN = {
    "pswire": {"psserver", "psworker", "psctl", "torch"},
    "pscore": {"psserver", "psworker", "psctl", "torch", "grpc", "google"},
    "psserver": {"psworker", "psctl", "torch"},
    "psworker": {"psserver", "psctl"},
    "psctl": {"psserver"},
}
# psworker modules that may import torch (torch is imported only where tensors are touched).
TORCH_MODULES = {
    "psworker/torch.py",
    "psworker/torch_optim.py",
    "psworker/torch_staging.py",
    "psworker/torch_tables.py",
}


def imported_roots(path: Path) -> set[str]:
    """The top-level package of every import in ``path`` (module level or not)."""
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def modules(package: str) -> list[Path]:
    return sorted(p for p in (REPO / package).rglob("*.py") if "proto" not in p.parts)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_packages_import_only_what_the_architecture_allows(package: str) -> None:
    bad = {}
    for path in modules(package):
        rel = path.relative_to(REPO).as_posix()
        forbidden = FORBIDDEN[package] - ({"torch"} if rel in TORCH_MODULES else set())
        hit = imported_roots(path) & forbidden
        if hit:
            bad[rel] = sorted(hit)
    assert not bad, f"forbidden imports: {bad}"


def imported_modules(path: Path) -> set[str]:
    """The full dotted name of every absolute import in ``path`` (``from a.b import c``:
    ``a.b.c`` when that is a module of ours, else ``a.b``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names.add(full if (REPO / f"{full.replace('.', '/')}.py").exists() else node.module)
    return names


def test_the_core_reaches_the_wire_only_through_its_errors() -> None:
    # pscore is below pswire: of pswire it may import only the exception family, and that
    # module imports nothing of ours, so no chain of imports leads back into pscore.
    allowed = {"pswire.errors"}
    bad = {}
    for path in modules("pscore"):
        hit = {m for m in imported_modules(path) if m.split(".")[0] == "pswire"} - allowed
        if hit:
            bad[path.relative_to(REPO).as_posix()] = sorted(hit)
    assert not bad, f"pscore modules importing pswire beyond its errors: {bad}"
    ours = {*FORBIDDEN, "pscore"}
    errors_imports = {m.split(".")[0] for m in imported_modules(REPO / "pswire/errors.py")}
    assert not errors_imports & ours, f"pswire/errors.py imports {errors_imports & ours}"


def test_the_numpy_sdk_imports_without_torch() -> None:
    # psworker's numpy-level client must work where torch is not installed: import it in a
    # child whose torch import fails, and use the local client end to end.
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np, psworker\n"
        "c = psworker.connect(mode='local')\n"
        "c.init({'w': np.ones(2, np.float32)}, psworker.SGD(lr=1.0))\n"
        "print(c.push_pull({'w': np.ones(2, np.float32)})['w'].tolist())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[0.0, 0.0]"


def test_every_module_opens_with_the_role_it_holds() -> None:
    # Split by role, never by length (../shared/STYLE.md): a module is one role, said in the
    # first line of its docstring; a long cohesive class is fine, so no line count is held.
    missing = []
    for package in (*FORBIDDEN, "bench", "examples"):
        for path in modules(package):
            doc = ast.get_docstring(ast.parse(path.read_text(), str(path)))
            if not doc or not doc.splitlines()[0].strip():
                missing.append(path.relative_to(REPO).as_posix())
    assert not missing, f"modules with no docstring saying their role: {missing}"


def stub_classes(path: Path) -> list[str]:
    """Classes in ``path`` that declare methods only to raise NotImplementedError (stand-ins
    for what another class holds), Protocols aside."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ClassDef):
            continue
        if any(getattr(b, "id", getattr(b, "attr", "")) == "Protocol" for b in node.bases):
            continue
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and any(
                isinstance(s, ast.Raise)
                and "NotImplementedError" in ast.unparse(s.exc or ast.Constant(None))
                for s in item.body
            ):
                found.append(f"{path.relative_to(REPO).as_posix()}:{node.name}.{item.name}")
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_class_declares_stubs_for_another_classs_state(package: str) -> None:
    stubs = [s for p in modules(package) for s in stub_classes(p)]
    # pscore.optim.Optimizer.apply is an abstract method each optimizer overrides: not a stub
    # for another class's state.
    stubs = [s for s in stubs if not s.startswith("pscore/optim.py:Optimizer.")]
    assert not stubs, f"stub declarations: {stubs}"
