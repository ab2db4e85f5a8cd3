"""The package map's arrows, read from the sources: each package imports only the packages below it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).parents[1] / "src" / "corral"

# package → packages it must never import (ARCHITECTURE.md: arrows point downward)
FORBIDDEN = {
    "engines": {"routing", "admission", "gateway", "cluster", "cache", "batch", "cli"},
    "admission": {"routing", "gateway", "cluster", "cli"},
    "routing": {"gateway", "cluster", "admission", "cli"},
    "batch": {"gateway", "cluster", "cli"},
    "store": {"batch", "gateway", "routing", "admission", "cluster", "cli"},
    "plan": {"gateway", "cli"},
    "bench": {"gateway", "cli"},
    "observe": {"gateway", "cli"},
    "deploy": {"gateway", "cli"},
    "gateway": {"cli"},
    "cluster": {"cli"},
}


def imported_packages(path: Path) -> set[str]:
    """The corral packages a module imports (at any depth: a function-local import counts too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        found |= {n.split(".")[1] for n in names if n.startswith("corral.") and n.count(".") >= 1}
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_nothing_above_it(package: str) -> None:
    wrong = {
        str(module.relative_to(SRC)): sorted(imported_packages(module) & FORBIDDEN[package])
        for module in (SRC / package).rglob("*.py")
    }
    assert {module: names for module, names in wrong.items() if names} == {}


def test_the_benchmark_scripts_have_one_folder_and_the_store_holds_no_lease_logic() -> None:
    root = SRC.parents[1]
    assert (root / "benchmarks").is_dir() and not (root / "bench").exists()
    store = " ".join(path.read_text() for path in (SRC / "store").glob("*.py"))
    assert "def lease" not in store and "def renew" not in store
