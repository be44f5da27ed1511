"""Reading a drawn program's source: its checkpointed regions and what their arguments name."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from tensorhooks.testing import Program


def root(node: ast.expr) -> str | None:
    """The name an expression such as ``v3[0:2].t()`` starts from."""
    while not isinstance(node, ast.Name):
        if isinstance(node, ast.Attribute | ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        else:
            return None
    return node.id


def regions(program: Program) -> Iterator[tuple[ast.FunctionDef, list[ast.expr]]]:
    """Each region's function and the arguments of its ``checkpoint`` call."""
    tree = ast.parse(program.source)
    functions = {node.name: node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and root(node.func) == "checkpoint":
            function, *arguments = node.args
            assert isinstance(function, ast.Name)
            yield functions[function.id], arguments
