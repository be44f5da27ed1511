"""Compiled programs: forward (and backward) inside ``torch.compile``, a context entered inside.

See NOTE [Compiled programs].
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from .drawing import SHAPE, Scope, alias, compute, leaves_source, write

__all__ = ["COMPILED_BACKWARDS", "COMPILED_CONTEXTS", "compiled_source"]

# NOTE [Compiled programs]
#
# With ``programs(compile=True)``, a program's steps run inside a function compiled with
# ``torch.compile(backend="aot_eager")`` (``compiler`` as printed), and a tensorhooks context, one
# of COMPILED_CONTEXTS, is entered inside that function after zero to two steps (``context`` as
# printed), so Dynamo breaks the graph there and the hooks it pushes run while a compiled frame is
# on the stack. One to three steps compute inside the context; then, half the time, a value
# computed before or inside it (one an op saved, often) is written in place, recorded by
# autograd or under ``no_grad``. Backward runs as
# one of COMPILED_BACKWARDS: inside the context, after it in the compiled function, or outside the
# compiled function on the loss it returns (inside only, under
# ``allow_mutation_on_saved_tensors``, which releases what it saved when it exits). The reference
# is the same program with ``compiler`` and ``context`` doing nothing: plain autograd, eager.
# Shapes are fixed and small and programs short: each program compiles, which costs seconds.

COMPILED_CONTEXTS = {
    "saved_tensors_hooks": "tensorhooks.saved_tensors_hooks(lambda t: t, lambda t: t)",
    "copying_hooks": "tensorhooks.saved_tensors_hooks(lambda t: t.clone(), lambda t: t)",
    "save_on_cpu": "tensorhooks.save_on_cpu()",
    "allow_mutation": "tensorhooks.allow_mutation_on_saved_tensors()",
}
COMPILED_BACKWARDS = ("inside", "after", "outside")


def compiled_source(draw: st.DrawFn, n_leaves: int, seed: int) -> str:
    """The source of a compiled program with ``n_leaves`` leaves."""
    scope = Scope()
    empty = torch.empty(SHAPE, dtype=torch.float64)
    for index in range(n_leaves):
        scope.add(f"leaf{index}", empty, requires_grad=True, computed=False)
    scope.add("const", empty, requires_grad=False, computed=False)
    before = _steps(draw, scope, draw(st.integers(0, 2)))
    inside = _steps(draw, scope, draw(st.integers(1, 3)))
    if draw(st.booleans()):
        computed = [i for i, flag in enumerate(scope.computed) if flag]
        index = computed[-1] if draw(st.booleans()) else draw(st.sampled_from(computed))
        recorded = draw(st.booleans())
        target, _ = alias(
            draw, scope.names[index], scope.dummies[index], for_recorded_write=recorded
        )
        line = write(draw, target, recorded=recorded)
        inside += [line] if recorded else ["with torch.no_grad():", f"    {line}"]
    inside.append("loss = torch.stack(terms).sum()")
    leaves = ", ".join(f"leaf{i}" for i in range(n_leaves))
    grad = f"grads = list(torch.autograd.grad(loss, [{leaves}], allow_unused=True))"
    after: list[str] = []
    outside = [f"grads = compiled({leaves})"]
    kind = draw(st.sampled_from(sorted(COMPILED_CONTEXTS)))
    backward = draw(st.sampled_from(COMPILED_BACKWARDS))
    if kind == "allow_mutation":
        backward = "inside"  # its saved tensors are released when it exits, as torch's
    if backward == "inside":
        inside += [grad, "return grads"]
    elif backward == "after":
        after = [grad, "return grads"]
    else:
        after = ["return loss"]
        outside = [f"loss = compiled({leaves})", grad]
    context = COMPILED_CONTEXTS[kind]
    return "\n".join(
        [
            "import contextlib",
            "",
            "import torch",
            "import tensorhooks",
            "from tensorhooks.testing import SavedOutputExp, Square",
            "",
            "",
            "def compiler(function):",
            '    return torch.compile(function, backend="aot_eager")',
            "",
            "",
            "def context():",
            f"    return {context}",
            "",
            "",
            *leaves_source(seed, n_leaves),
            "def program(leaves):",
            f"    {leaves}, = leaves",
            "",
            f"    def step({leaves}):",
            "        const = torch.linspace(-1, 1, 16, dtype=torch.float64).reshape(4, 4)",
            "        terms = []",
            *(f"        {line}" for line in before),
            "        with context():",
            *(f"            {line}" for line in inside),
            *(f"        {line}" for line in after),
            "",
            "    compiled = compiler(step)",
            *(f"    {line}" for line in outside),
            "    return grads",
            "",
        ]
    )


def _steps(draw: st.DrawFn, scope: Scope, count: int) -> list[str]:
    lines: list[str] = []
    for _ in range(count):
        expr, dummy, requires_grad = compute(draw, scope)
        name = f"v{len(scope.names)}"
        lines += [f"{name} = {expr}", f"terms.append({name}.sum() * {1 + len(scope.names) / 8})"]
        scope.add(name, dummy, requires_grad, computed=True)
    return lines
