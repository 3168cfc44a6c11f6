"""The import graph keeps its layers: a package imports only its own layer and those below it, no
module imports itself back through others at run time, and only `deployments/` imports ray.

Imports are read from the source (nothing is imported): every `import` counts, inside functions
too (a lazy import is still an arrow), except those under `if TYPE_CHECKING:` (type-only).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ("services", "kvcache", "grammar_registry", "deployments")

# Lowest first. A unit is a top-level package, or a package or module directly in `services/`.
LAYERS = (
    {"services", "services.settings", "grammar_registry"},
    {"kvcache", "services.telemetry", "services.sandbox", "services.batches"},
    {"services.models", "services.lora"},  # the model, and adapters on it
    {"services.grammar", "services.dialects"},  # grammars, and answers in a dialect (README)
    {"services.compiler"},
    {"services.engine"},
    {"services.demo", "deployments"},
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for pkg in CORE for p in sorted((ROOT / pkg).rglob("*.py"))}


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[str]:
    """Every module named by an import that runs (type-only ones left out)."""
    found: list[str] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # `from pkg import module` names the module
                inner = f"{node.module}.{alias.name}"
                found.append(inner if inner in MODULES else node.module)
        stack.extend(ast.iter_child_nodes(node))
    return found


GRAPH = {name: _imports(ast.parse(path.read_text())) for name, path in MODULES.items()}


def _unit(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "services" and len(parts) > 1 else parts[0]


def _layer(module: str) -> int:
    unit = _unit(module)
    return next(i for i, layer in enumerate(LAYERS) if unit in layer)


def test_every_core_unit_has_a_layer():
    missing = {_unit(m) for m in MODULES if not any(_unit(m) in layer for layer in LAYERS)}
    assert not missing, f"place these in LAYERS: {sorted(missing)}"


def test_no_import_runs_up_a_layer():
    up = [
        f"{src} -> {dst}"
        for src, targets in GRAPH.items()
        for dst in targets
        if dst in MODULES and _layer(dst) > _layer(src)
    ]
    assert not up, "imports into a higher layer:\n" + "\n".join(sorted(set(up)))


def test_the_grammar_layer_stands_on_none_of_its_users():
    users = ("services.engine", "services.compiler", "deployments")
    wrong = [
        f"{src} -> {dst}"
        for src, targets in GRAPH.items()
        if src.startswith("services.grammar")
        for dst in targets
        if dst.startswith(users)
    ]
    assert not wrong


def test_no_import_cycle_at_run_time():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in (m for m in GRAPH[node] if m in MODULES):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in GRAPH:
        if module not in index:
            visit(module)
    assert not cycles, f"import cycles: {cycles}"


def test_only_deployments_imports_ray():
    wrong = [
        f"{src} -> {dst}"
        for src, targets in GRAPH.items()
        if not src.startswith("deployments")
        for dst in targets
        if dst == "ray" or dst.startswith("ray.")
    ]
    assert not wrong


def test_the_layer_test_sees_what_it_checks():
    """Guards the reader above: it finds the arrows this project is known to have."""
    assert "services.grammar.structured" in GRAPH["services.engine.params"]
    assert "services.grammar.provider" in GRAPH["services.engine.engine"]
    assert any(m.startswith("ray") for m in GRAPH["deployments.app"])
