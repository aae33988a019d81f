"""Every name a benchmark script imports from splitserve exists: the scripts are not run by
the suite, so a renamed helper would otherwise break one unnoticed until someone measures."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def splitserve_imports(script: Path) -> list[tuple[str, str]]:
    tree = ast.parse(script.read_text(), filename=str(script))
    return [
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "splitserve"
        for alias in node.names
    ]


@pytest.mark.parametrize("script", sorted(BENCHMARKS.glob("*.py")), ids=lambda path: path.name)
def test_every_splitserve_name_a_benchmark_imports_exists(script: Path) -> None:
    missing = []
    for module_name, name in splitserve_imports(script):
        module = importlib.import_module(module_name)
        if not hasattr(module, name) and importlib.util.find_spec(f"{module_name}.{name}") is None:
            missing.append(f"{module_name}.{name}")
    assert not missing, f"{script.name} imports names that do not exist: {missing}"
