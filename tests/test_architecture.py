"""The package's shape: imports run one way (CLI -> driver -> launch/train -> tracking -> spec),
no import cycles, and no module too long to read. Read from the source with `ast`, so lazy
imports inside functions count too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import REPO

PACKAGE = REPO / "rayapp"
MAX_LINES = 400

# What each stage may import of rayapp besides itself and rayapp.errors. Nothing may import the CLI.
ALLOWED = {
    "rayapp.spec": set(),
    "rayapp.tracking": {"rayapp.spec"},
    "rayapp.train": {"rayapp.spec", "rayapp.tracking"},
    "rayapp.reports": {"rayapp.spec", "rayapp.tracking"},
    "rayapp.launch": {"rayapp.spec", "rayapp.tracking"},
    "rayapp.driver": {
        "rayapp.spec",
        "rayapp.tracking",
        "rayapp.train",
        "rayapp.launch",
        "rayapp.reports",
    },
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def rayapp_imports(path: Path, modules: set[str]) -> set[str]:
    """Every rayapp module `path` imports, at module level or inside functions."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("rayapp"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rayapp"):
            # `from rayapp.train import checkpoint` imports the submodule rayapp.train.checkpoint;
            # it takes nothing from the package's own namespace, so that is no edge to the package.
            submodules = {f"{node.module}.{alias.name}" for alias in node.names}
            found.update(submodules & modules)
            if not submodules <= modules:
                found.add(node.module)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {
        name: {m for m in rayapp_imports(path, set(modules)) if m in modules and m != name}
        for name, path in modules.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def stage(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_nothing_imports_the_cli():
    offenders = sorted(
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        if stage(module) not in ("rayapp.cli",) and module != "rayapp.__main__"
        for target in targets
        if stage(target) == "rayapp.cli"
    )
    assert not offenders, offenders


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_stage_imports_only_what_comes_after_it(package):
    allowed = ALLOWED[package] | {package, "rayapp.errors", "rayapp"}
    offenders = sorted(
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        if stage(module) == package
        for target in targets
        if stage(target) not in allowed
    )
    assert not offenders, offenders


@pytest.mark.parametrize("folder", ["rayapp", "benchmarks"])
def test_no_file_over_400_lines(folder):
    long = {
        str(p.relative_to(REPO)): n
        for p in (REPO / folder).rglob("*.py")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, long
