"""The package's house rules, read from its source: each subpackage says what it is for and what it may import,
and imports go one way, down (call and shard above the engine, tp above call, all of them above axis and integration,
those above wire, and the leaf modules at the bottom)."""

import ast
from pathlib import Path
from typing import Dict, Set

import pytest

PKG = Path(__file__).resolve().parent.parent / "colossalai_cmap"
SEAM = "torch_internals"  # the one module that names torch internals; it imports nothing from the package
LEAVES = {"errors", "faults", "stats", "digests", "nesting", SEAM}
# what each part of the package may import from the package (besides itself)
ALLOWED: Dict[str, Set[str]] = {
    "wire": LEAVES,
    "axis": {"wire"} | LEAVES,
    "integration": {"wire"} | LEAVES,
    "engine": {"axis", "integration", "wire"} | LEAVES,
    "call": {"engine", "axis", "integration", "wire"} | LEAVES,
    "tp": {"call", "engine", "axis", "integration", "wire"} | LEAVES,
    "shard": {"engine", "axis", "integration", "wire"} | LEAVES,
    **{leaf: {SEAM} for leaf in LEAVES - {SEAM}},
    SEAM: set(),
}
SUBPACKAGES = ("call", "engine", "wire", "axis", "tp", "shard", "integration")


def _part(path: Path) -> str:
    """The part of the package a file belongs to: its subpackage, or its own name for a top-level module."""
    return path.relative_to(PKG).parts[0].removesuffix(".py")


def _imported_parts(path: Path) -> Set[str]:
    """The parts of the package that ``path`` imports, lazily or not (relative imports resolved)."""
    here = list(path.relative_to(PKG).parent.parts)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here[: len(here) - (node.level - 1)]
            target = base + (node.module.split(".") if node.module else [])
            names = [target] if target else [[alias.name] for alias in node.names]
            found.update(t[0].removesuffix(".py") for t in names if t)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            for name in [module] if module else [a.name for a in node.names]:
                if name and name.startswith("colossalai_cmap."):
                    found.add(name.split(".")[1])
    return found


MODULES = sorted(p for p in PKG.rglob("*.py") if p.parent != PKG or p.name != "__init__.py")


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(PKG)) for p in MODULES])
def test_imports_go_down(path: Path) -> None:
    part = _part(path)
    if part not in ALLOWED:
        pytest.fail(f"{path.relative_to(PKG)} is in no known part of the package; add it to a subpackage")
    upward = _imported_parts(path) - ALLOWED[part] - {part}
    assert not upward, f"{path.relative_to(PKG)} ({part}) imports {sorted(upward)}: imports go down only"


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_each_subpackage_says_what_it_is_for(name: str) -> None:
    doc = ast.get_docstring(ast.parse((PKG / name / "__init__.py").read_text()))
    assert doc and "May import" in doc, f"{name}/__init__.py must say what the subpackage is for and may import"


def test_top_level_holds_only_the_public_names_and_leaf_modules() -> None:
    top = {p.stem for p in PKG.glob("*.py")} - {"__init__"}
    assert top == LEAVES, f"top-level modules {sorted(top - LEAVES)} belong in a subpackage"


def _torch_internals(path: Path) -> Set[str]:
    """The torch internals ``path`` names: an underscore part of a ``torch`` import or attribute chain (dunders such
    as ``torch.__file__`` aside), or a private tensor or autograd-node attribute."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            if "._" in node.module:
                found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_"))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("torch.") and "._" in a.name)
        elif isinstance(node, ast.Attribute):
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            private = [n for n in chain if n.startswith("_") and not n.startswith("__")]
            if isinstance(inner, ast.Name) and inner.id in ("torch", "dist", "fwAD") and private:
                found.add(".".join([inner.id, *reversed(chain)]))
            elif node.attr in ("_version", "_sequence_nr", "_execution_engine"):
                found.add(node.attr)
    return found


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(PKG)) for p in MODULES])
def test_only_the_seam_names_torch_internals(path: Path) -> None:
    """A torch upgrade that moves an internal changes one file: every other module asks ``torch_internals``."""
    if path.stem == SEAM and path.parent == PKG:
        return
    named = _torch_internals(path)
    assert not named, f"{path.relative_to(PKG)} names torch internals {sorted(named)}: add them to {SEAM}.py and use it"


TESTS = Path(__file__).resolve().parent


@pytest.mark.parametrize("path", sorted(TESTS.glob("*.py")), ids=lambda p: p.name)
def test_no_test_imports_the_benchmarks(path: Path) -> None:
    """Test support lives in ``tests/``; the benchmarks may use it, never the other way round."""
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        names += [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        bad = [n for n in names if n == "benchmarks" or n.startswith("benchmarks.")]
        assert not bad, f"tests/{path.name} imports {bad}: move what it needs into tests/"


def _imported_names(path: Path):
    """(module part, name) for each ``from X import name`` in ``path`` that names a module of the package."""
    here = list(path.relative_to(PKG).parent.parts)
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            target = here[: len(here) - (node.level - 1)] + (node.module.split(".") if node.module else [])
        elif node.module and node.module.startswith("colossalai_cmap."):
            target = node.module.split(".")[1:]
        else:
            continue
        for alias in node.names:
            yield (target[0].removesuffix(".py") if target else alias.name), alias.name


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(PKG)) for p in MODULES])
def test_no_private_name_crosses_a_subpackage(path: Path) -> None:
    """A name with a leading underscore is its module's own: another part of the package never imports it."""
    part = _part(path)
    crossing = [name for where, name in _imported_names(path) if where != part and name.startswith("_")]
    assert not crossing, f"{path.relative_to(PKG)} imports private names {crossing} from another part of the package"


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(PKG)) for p in MODULES])
def test_colossalai_is_imported_only_in_integration(path: Path) -> None:
    """Where cmap meets Colossal-AI is ``integration/``; every other part reaches colossalai through it."""
    if _part(path) == "integration":
        return
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        names += [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        found += [n for n in names if n == "colossalai" or n.startswith("colossalai.")]
    assert not found, f"{path.relative_to(PKG)} imports {found}: colossalai belongs in integration/"
