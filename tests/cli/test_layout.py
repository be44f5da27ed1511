"""The command line's layout: no import circle among its modules, none over 800 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import tensorhooks.cli

CLI = Path(tensorhooks.cli.__file__).parent
PACKAGE = "tensorhooks.cli"


def _name(path: Path) -> str:
    parts = path.relative_to(CLI).with_suffix("").parts
    return ".".join((PACKAGE, *(parts[:-1] if parts[-1] == "__init__" else parts)))


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The CLI's modules ``path`` imports, at the top or inside a function."""
    here = _name(path) if path.name == "__init__.py" else _name(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = ".".join(filter(None, (base, node.module)))
            else:
                source = node.module or ""
            found.add(source)
            found.update(f"{source}.{alias.name}" for alias in node.names)
    return (found & modules) - {_name(path)}


def _graph() -> dict[str, set[str]]:
    paths = {_name(path): path for path in CLI.rglob("*.py")}
    return {name: _imports(path, set(paths)) for name, path in paths.items()}


def _circle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of ``graph``, or [] when there is none (depth-first search)."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(name: str) -> list[str]:
        state[name] = "open"
        path.append(name)
        for imported in sorted(graph[name]):
            if state.get(imported) == "open":
                return [*path[path.index(imported) :], imported]
            if imported not in state and (found := visit(imported)):
                return found
        state[name] = "done"
        path.pop()
        return []

    for name in sorted(graph):
        if name not in state and (found := visit(name)):
            return found
    return []


def test_no_import_circle() -> None:
    """No module of the command line imports, through others, itself (lazy imports included)."""
    graph = _graph()
    assert len(graph) > 20
    assert _circle(graph) == []
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_module_over_800_lines() -> None:
    """Every module of the command line has at most 800 lines."""
    sizes = {path.name: len(path.read_text().splitlines()) for path in CLI.rglob("*.py")}
    assert max(sizes.values()) <= 800, sizes
