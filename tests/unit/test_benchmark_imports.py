"""Every name a benchmark imports from the project exists: the benchmarks are not run in CI, so a
move or a rename would otherwise break them unseen."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ("services", "deployments", "kvcache", "grammar_registry")


def _project_imports() -> list[tuple[str, str, str]]:
    found = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0):
                continue
            if node.module.split(".")[0] in PROJECT:
                found += [(path.name, node.module, alias.name) for alias in node.names]
    return found


def test_every_project_name_a_benchmark_imports_exists():
    imports = _project_imports()
    assert len(imports) > 50  # the reader sees the benchmarks' imports
    missing = []
    for script, module, name in imports:
        try:
            found = importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{script}: {module} ({exc})")
            continue
        if not hasattr(found, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{script}: {module}.{name}")
    assert not missing, "benchmarks import what is gone:\n" + "\n".join(missing)
