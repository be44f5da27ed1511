"""Random programs that meet a known, not yet fixed, wrong result of tensorhooks.checkpoint.

Each predicate reads a program's source and names one class; the property tests skip programs
of a known class, and a reproducer of each class is an ``xfail(strict=True)`` test in
test_checkpoint_programs.py, so the skip goes when the class is fixed.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator

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


def reads_an_argument_through_its_closure(program: Program) -> bool:
    """A region reads, from its closure, a value one of its arguments aliases.

    Under a context that keeps saved values (allow_mutation_on_saved_tensors, a cloning pair),
    a write to that value after the forward pass reaches the closure's read in recomputation:
    a silently wrong gradient.
    """
    for function, arguments in regions(program):
        parameters = {argument.arg for argument in function.args.args}
        free = {
            node.id
            for node in ast.walk(function)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
        }
        if (free - parameters) & {root(argument) for argument in arguments}:
            return True
    return False


def strides_over_an_argument(program: Program) -> bool:
    """A region takes an ``as_strided`` window of one of its arguments.

    ``as_strided`` addresses the storage; under a context that copies the region's inputs,
    recomputation takes the window of the copy: other elements, a silently wrong gradient (or a
    torch-internal storage error).
    """
    for function, _ in regions(program):
        parameters = {argument.arg for argument in function.args.args}
        for node in ast.walk(function):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "as_strided"
                and root(node.value) in parameters
            ):
                return True
    return False


def writes_state_and_runs_backward_twice(program: Program) -> bool:
    """A region writes state, and backward runs twice over the graph (or double backward).

    Recomputation moves the version of the state it wrote (not its value), so a node that saved
    that state after the region raises autograd's in-place error in the second backward.
    """
    writes_state = "return [*grads, const, count]" in program.source
    twice = "retain_graph=True" in program.source or "create_graph=True" in program.source
    return writes_state and twice


def writes_a_view_as_state(program: Program) -> bool:
    """A region writes ``const`` in place: state that is a view (of ``linspace``'s result).

    Under allow_mutation_on_saved_tensors, when the region saved it before writing it and the
    program writes it again before backward, recomputation reads the value the region wrote: a
    silently wrong gradient.
    """
    for function, _ in regions(program):
        for node in ast.walk(function):
            if isinstance(node, ast.With):
                for statement in node.body:
                    call = statement.value if isinstance(statement, ast.Expr) else None
                    if isinstance(call, ast.Call) and root(call.func) == "const":
                        return True
                    if isinstance(statement, ast.Assign) and root(statement.targets[0]) == "const":
                        return True
    return False


KNOWN: dict[str, Callable[[Program], bool]] = {
    "closure reads an argument": reads_an_argument_through_its_closure,
    "as_strided of an argument": strides_over_an_argument,
    "state written, backward twice": writes_state_and_runs_backward_twice,
    "a view written as state": writes_a_view_as_state,
}


def known_limitation(program: Program) -> str | None:
    """The known class ``program`` belongs to, or None."""
    return next((name for name, meets in KNOWN.items() if meets(program)), None)
