"""The package's layout keeps its rules: no import cycle, no upward import, no oversized module.

See "Where things live" in docs/design.md.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tensorhooks"
FACES = {
    "tensorhooks",
    "tensorhooks.checkpointing",
    "tensorhooks.distributed",
    "tensorhooks.integrations",
    "tensorhooks.integrations.accelerate",
    "tensorhooks.integrations.transformers",
    "tensorhooks.testing",
    "tensorhooks.__main__",
}
MAX_LINES = 800


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _resolve(module: str, node: ast.ImportFrom) -> list[str]:
    """The tensorhooks modules an import statement in ``module`` names (functions included)."""
    if node.level:
        is_package = MODULES[module].name == "__init__.py"
        base = module.split(".")
        base = base if is_package else base[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join([*base, node.module] if node.module else base)
    else:
        target = node.module or ""
    names = [f"{target}.{alias.name}" for alias in node.names]
    found = [name for name in names if name in MODULES]  # `from package import module`
    return found or ([target] if target in MODULES else [])


def imports_of(module: str) -> set[str]:
    """Every tensorhooks module ``module`` imports, at the top or inside a function."""
    tree = ast.parse(MODULES[module].read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found.update(_resolve(module, node))
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in MODULES)
    found.discard(module)
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def _wing(module: str) -> str | None:
    """The private subpackage a module belongs to (``_core``, ``_mutation``, ...), or None."""
    parts = module.split(".")
    if len(parts) < 2 or not parts[1].startswith("_"):
        return None
    package = MODULES.get(f"tensorhooks.{parts[1]}")
    return parts[1] if package is not None and package.name == "__init__.py" else None


def test_no_import_cycle() -> None:
    """No module imports, directly or not, a module that imports it (the CLI included)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert cycles == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_is_at_most_800_lines(module: str) -> None:
    """No module passes 800 lines: a longer one holds more than one concern."""
    assert len(MODULES[module].read_text().splitlines()) <= MAX_LINES


def test_core_imports_no_feature() -> None:
    """tensorhooks._core stands on torch alone: it imports nothing else of the package."""
    outside = {
        (module, target)
        for module, targets in GRAPH.items()
        if _wing(module) == "_core"
        for target in targets
        if _wing(target) != "_core"
    }
    assert outside == set()


def test_wings_meet_through_their_packages() -> None:
    """A wing reaches another wing only through that wing's package, never its modules."""
    reaches = {
        (module, target)
        for module, targets in GRAPH.items()
        for target in targets
        if _wing(module) is not None
        and _wing(target) not in (None, "_core", _wing(module))
        and target != f"tensorhooks.{_wing(target)}"
    }
    assert reaches == set()


def test_nothing_imports_upward() -> None:
    """No private module imports a public face or the CLI."""
    upward = {
        (module, target)
        for module, targets in GRAPH.items()
        if _wing(module) is not None
        for target in targets
        if target in FACES or target.startswith("tensorhooks.cli")
    }
    assert upward == set()
