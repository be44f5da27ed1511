"""What a random program's steps are drawn from: values in scope, views of them, ops and writes.

Every piece is drawn as Python text together with a dummy tensor of the value's shape, so that
the next step can be drawn with concrete indices. See NOTE [Random autograd programs].
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st

__all__ = [
    "BINARY",
    "CONSTANTS",
    "RECORDED_WRITES",
    "SHAPE",
    "UNARY",
    "WRITES",
    "Scope",
    "alias",
    "binary",
    "compute",
    "leaves_source",
    "pick",
    "unary",
    "write",
]

SHAPE = (4, 4)
UNARY = {
    "sin": "torch.sin({x})",  # saves its input
    "tanh": "torch.tanh({x})",  # saves its output
    "sigmoid": "torch.sigmoid({x})",  # saves its output
    "exp": "torch.exp({x})",  # saves its output
    "relu": "torch.relu({x})",  # saves its output
    "square": "{x} * {x}",  # saves its input twice
    "pow": "{x} ** 2",  # saves its input
    "custom_square": "Square.apply({x})",
    "custom_exp": "SavedOutputExp.apply({x} * 0.5)",
    "sum_keepdim": "{x}.sum(0, keepdim=True)",  # saves nothing
    "mean_scale": "{x}.mean() * {x}",
    "norm": "{x}.norm() * {x}",  # saves its input and its output
    "matmul_self": "{x} @ {x}.mT",  # 2-d only
    "softmax": "{x}.softmax(-1)",  # saves its output
}
BINARY = {
    "add": "{x} + {y}",
    "mul": "{x} * {y}",
    "matmul": "{x} @ {y}.mT",  # saves the view y.mT, made by the step itself
    "linear": "torch.nn.functional.linear({x}, {y})",  # saves y.t(), as nn.Linear does
}
WRITES = {
    "mul_": "{x}.mul_({c})",
    "add_": "{x}.add_({c})",
    "zero_": "{x}.zero_()",
    "fill_": "{x}.fill_({c})",
    "sin_": "{x}.sin_()",
    "copy_": "{x}.copy_(torch.full_like({x}, {c}))",
    "setitem": "{x}[...] = {c}",
    "out": "torch.mul(torch.ones_like({x}), {c}, out={x})",
}
# Writes autograd records when grad mode is on (on values that are not leaves).
RECORDED_WRITES = ("mul_", "add_", "sin_", "setitem")
CONSTANTS = (-1.5, -0.5, 0.75, 1.25, 2.0)


class Scope:
    """The values a step can read: names, a dummy of each shape, requires_grad, computed.

    A value is *computed* when an op made it (it is no leaf or constant), so autograd may record
    an in-place write on it.
    """

    __slots__ = ("computed", "dummies", "names", "requires_grad")

    def __init__(self) -> None:
        self.names: list[str] = []
        self.dummies: list[torch.Tensor] = []
        self.requires_grad: list[bool] = []
        self.computed: list[bool] = []

    def add(self, name: str, dummy: torch.Tensor, requires_grad: bool, computed: bool) -> int:
        """Add a value; return its index."""
        self.names.append(name)
        self.dummies.append(torch.empty(dummy.shape, dtype=torch.float64))
        self.requires_grad.append(requires_grad)
        self.computed.append(computed)
        return len(self.names) - 1


def leaves_source(seed: int, n_leaves: int) -> list[str]:
    """The lines defining a program's ``make_leaves()``: seeded float64 leaves, then two blanks."""
    return [
        "def make_leaves():",
        f"    generator = torch.Generator().manual_seed({seed})",
        "    return [",
        "        torch.randn(4, 4, dtype=torch.float64, generator=generator).requires_grad_()",
        f"        for _ in range({n_leaves})",
        "    ]",
        "",
        "",
    ]


def pick(draw: st.DrawFn, scope: Scope) -> int:
    """Draw a value of ``scope``, biased to recent ones so that programs are deep."""
    count = len(scope.names)
    return draw(st.integers(max(0, count - 5), count - 1) | st.integers(0, count - 1))


def alias(
    draw: st.DrawFn, name: str, dummy: torch.Tensor, *, for_recorded_write: bool = False
) -> tuple[str, torch.Tensor]:
    """Draw a chain of up to two views of ``name``: its expression and a dummy of its shape."""
    expr = name
    for _ in range(draw(st.integers(0, 2))):
        kinds = ["rows", "step", "cols", "t", "select", "diagonal", "flat"]
        if not for_recorded_write:
            kinds.append("as_strided")
        kind = draw(st.sampled_from(kinds))
        a, b = draw(st.integers(0, 7)), draw(st.integers(0, 7))
        view = _view(kind, a, b, dummy)
        if view is not None:
            suffix, dummy = view
            expr = f"{expr}{suffix}"
    return expr, dummy


def _view(kind: str, a: int, b: int, x: torch.Tensor) -> tuple[str, torch.Tensor] | None:  # noqa: PLR0911 (one return per kind)
    """The indexing suffix of one view of ``x`` and the view itself; None if inapplicable."""
    dims = x.dim()
    if kind == "rows" and dims >= 1 and x.size(0) > 1:
        start = a % x.size(0)
        stop = start + 1 + b % (x.size(0) - start)
        return f"[{start}:{stop}]", x[start:stop]
    if kind == "step" and dims >= 1 and x.size(0) > 1:
        return f"[{a % 2}::2]", x[a % 2 :: 2]
    if kind == "cols" and dims == 2 and x.size(1) > 1:
        start = a % x.size(1)
        stop = start + 1 + b % (x.size(1) - start)
        return f"[:, {start}:{stop}]", x[:, start:stop]
    if kind == "t" and dims == 2:
        return ".t()", x.t()
    if kind == "select" and dims == 2:
        return f"[{a % x.size(0)}]", x[a % x.size(0)]
    if kind == "diagonal" and dims == 2:
        return f".diagonal({a % 3 - 1})", x.diagonal(a % 3 - 1)
    if kind == "flat" and x.is_contiguous() and x.numel() > 1:
        start = a % x.numel()
        stop = start + 1 + b % (x.numel() - start)
        return f".view(-1)[{start}:{stop}]", x.view(-1)[start:stop]
    if kind == "as_strided":
        row_stride = 2 + a % 3
        room = x.untyped_storage().nbytes() // x.element_size() - (row_stride + 2)
        if room >= 0:
            offset = b % (room + 1)
            suffix = f".as_strided((2, 2), ({row_stride}, 1), {offset})"
            return suffix, x.as_strided((2, 2), (row_stride, 1), offset)
    return None


class _Shape:
    """Stands in for the custom Functions while shapes are computed."""

    @staticmethod
    def apply(x: torch.Tensor) -> torch.Tensor:
        return x * 1


_SHAPE_GLOBALS: dict[str, Any] = {"torch": torch, "Square": _Shape, "SavedOutputExp": _Shape}


def unary(draw: st.DrawFn, x: str, dummy: torch.Tensor) -> tuple[str, torch.Tensor]:
    """Draw an op of one operand ``x``: its expression and a dummy of its result."""
    op = draw(st.sampled_from(sorted(UNARY)))
    if op == "matmul_self" and dummy.dim() != 2:
        op = "sin"
    if op == "softmax" and dummy.dim() == 0:
        op = "tanh"
    with torch.no_grad():  # the shape of the result, from the op run on the dummy
        result = eval(UNARY[op].format(x="x"), _SHAPE_GLOBALS, {"x": dummy})
    return UNARY[op].format(x=x), result


def binary(
    draw: st.DrawFn, x: str, dummy: torch.Tensor, y: str, other: torch.Tensor
) -> tuple[str, torch.Tensor]:
    """Draw an op of ``x`` and ``y`` (reduced to a scalar if their shapes do not fit)."""
    op = draw(st.sampled_from(sorted(BINARY)))
    if op == "matmul" and not (
        dummy.dim() == 2 and other.dim() == 2 and dummy.size(1) == other.size(1)
    ):
        op = "mul"
    if op == "linear" and not (
        dummy.dim() >= 1 and other.dim() == 2 and dummy.size(-1) == other.size(1)
    ):
        op = "mul"
    if op in ("matmul", "linear"):
        result = torch.nn.functional.linear(dummy, other)
        return BINARY[op].format(x=x, y=y), result
    if dummy.shape != other.shape:
        y = f"{y}.sum()"
        other = torch.empty((), dtype=torch.float64)
    return BINARY[op].format(x=x, y=y), dummy * other


def write(draw: st.DrawFn, target: str, *, recorded: bool) -> str:
    """Draw an in-place write to ``target`` (one autograd records, if ``recorded``)."""
    kind = draw(st.sampled_from(RECORDED_WRITES if recorded else sorted(WRITES)))
    return WRITES[kind].format(x=target, c=draw(st.sampled_from(CONSTANTS)))


def compute(draw: st.DrawFn, scope: Scope) -> tuple[str, torch.Tensor, bool]:
    """Draw an op of aliases of ``scope``'s values: expression, result's dummy, requires grad."""
    index = pick(draw, scope)
    x, dummy = alias(draw, scope.names[index], scope.dummies[index])
    requires_grad = scope.requires_grad[index]
    if draw(st.booleans()):
        expr, result = unary(draw, x, dummy)
    else:
        other = pick(draw, scope)
        y, other_dummy = alias(draw, scope.names[other], scope.dummies[other])
        expr, result = binary(draw, x, dummy, y, other_dummy)
        requires_grad = requires_grad or scope.requires_grad[other]
    return expr, result, requires_grad
