"""Random autograd programs for `tensorhooks.testing`, drawn by hypothesis as Python source.

A program is drawn step by step and written down as the Python it runs: the source shown when a
check fails is exactly the code that ran. See NOTE [Random autograd programs].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import strategies as st

__all__ = ["Program", "SavedOutputExp", "Square", "programs"]

# NOTE [Random autograd programs]
#
# A program starts from one to three leaves of shape (4, 4) (float64, requiring grad, seeded)
# and a constant that does not require grad. Each step either computes a new value from aliases
# of earlier values, or writes in place through an alias. An alias is a chain of zero to two
# views (row and column slices, strided slices, transposes, selects, diagonals, flat slices,
# ``as_strided`` windows), so writes reach saved tensors through views of views, bases and
# unrelated-looking windows of the same storage. Ops cover elementwise functions that save their
# input or their output, matmul, reductions, and two custom Functions (one saves its input, one
# its output). Writes are in-place ops, ``out=`` into a view, and (on computed values) in-place
# ops recorded by autograd. The loss sums every computed value, each taken right after it is
# made. Backward runs one of: ``backward()``, ``backward(inputs=...)``, ``autograd.grad``,
# ``backward(retain_graph=True)`` twice, or a double backward through ``create_graph=True``.
# With ``checkpoint=True`` a third of the computing steps run as a ``tensorhooks.checkpoint``
# region of their inputs.
#
# Shapes are tracked while drawing by applying each view to an empty tensor of the value's
# shape, so every line is written with concrete indices.


class Square(torch.autograd.Function):
    """``x * x`` saving its input with ``save_for_backward``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        """Return ``x * x``."""
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        """Return ``2 * x * grad``."""
        (x,) = ctx.saved_tensors
        result: torch.Tensor = 2 * x * grad
        return result


class SavedOutputExp(torch.autograd.Function):
    """``exp(x)`` saving its output with ``save_for_backward``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        """Return ``exp(x)``."""
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        """Return ``grad * exp(x)``."""
        (y,) = ctx.saved_tensors
        result: torch.Tensor = grad * y
        return result


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
BINARY = {"add": "{x} + {y}", "mul": "{x} * {y}", "matmul": "{x} @ {y}.mT"}
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
BACKWARDS = ("backward", "inputs", "grad", "twice", "double")


@dataclass(frozen=True)
class Program:
    """A random autograd program: Python source defining ``make_leaves()`` and ``program(leaves)``.

    ``program(leaves)`` runs the forward pass and one backward variant, and returns the
    gradients that variant produced (a list of tensors or None).
    """

    source: str
    n_leaves: int = field(compare=False)

    def __repr__(self) -> str:
        return f"Program(<{self.source.count(chr(10))} lines of Python>)"

    def _namespace(self) -> dict[str, Any]:
        namespace: dict[str, Any] = {"__name__": "tensorhooks_testing_program"}
        exec(compile(self.source, "<random autograd program>", "exec"), namespace)
        return namespace

    def make_leaves(self) -> list[torch.Tensor]:
        """Fresh leaves, with the same values on every call."""
        leaves: list[torch.Tensor] = self._namespace()["make_leaves"]()
        return leaves

    def run(self, leaves: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Run forward and backward on ``leaves``; return the gradients."""
        grads: list[torch.Tensor | None] = self._namespace()["program"](leaves)
        return grads


class _Builder:
    """Writes a program's lines while tracking each value's shape, leafness and requires_grad."""

    def __init__(self, draw: st.DrawFn, n_leaves: int, *, checkpoint: bool = False) -> None:
        self.draw = draw
        self.checkpoint = checkpoint  # may wrap a step in a tensorhooks.checkpoint region
        self.checkpointed = False  # whether some step was wrapped
        self.lines: list[str] = []
        self.names = [f"leaf{i}" for i in range(n_leaves)] + ["const"]
        self.shapes: list[torch.Tensor] = [torch.empty(SHAPE, dtype=torch.float64)] * (n_leaves + 1)
        self.requires_grad = [True] * n_leaves + [False]
        self.computed = [False] * (n_leaves + 1)

    def value(self) -> int:
        """Draw an earlier value, biased to recent ones so that programs are deep."""
        count = len(self.names)
        return self.draw(st.integers(max(0, count - 5), count - 1) | st.integers(0, count - 1))

    def alias(self, index: int, *, for_recorded_write: bool = False) -> tuple[str, torch.Tensor]:
        """Draw a chain of up to two views of value ``index``: its expression and a dummy."""
        expr, dummy = self.names[index], self.shapes[index]
        for _ in range(self.draw(st.integers(0, 2))):
            kinds = ["rows", "step", "cols", "t", "select", "diagonal", "flat"]
            if not for_recorded_write:
                kinds.append("as_strided")
            kind = self.draw(st.sampled_from(kinds))
            a, b = self.draw(st.integers(0, 7)), self.draw(st.integers(0, 7))
            view = _view(kind, a, b, dummy)
            if view is not None:
                suffix, dummy = view
                expr = f"{expr}{suffix}"
        return expr, dummy

    def add_value(self, expr: str, dummy: torch.Tensor, requires_grad: bool) -> None:
        name = f"v{len(self.names)}"
        weight = 1 + len(self.names) / 8
        self.lines.append(f"{name} = {expr}")
        self.lines.append(f"terms.append({name}.sum() * {weight})")
        self.names.append(name)
        self.shapes.append(torch.empty(dummy.shape, dtype=torch.float64))
        self.requires_grad.append(requires_grad)
        self.computed.append(True)


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


def _compute(builder: _Builder) -> None:
    draw = builder.draw
    index = builder.value()
    x, dummy = builder.alias(index)
    requires_grad = builder.requires_grad[index]
    if draw(st.booleans()):
        op = draw(st.sampled_from(sorted(UNARY)))
        if op == "matmul_self" and dummy.dim() != 2:
            op = "sin"
        if op == "softmax" and dummy.dim() == 0:
            op = "tanh"
        expr = _region(builder, UNARY[op].format(x="x"), [x]) or UNARY[op].format(x=x)
        with torch.no_grad():  # the shape of the result, from the op run on the dummy alias
            result = eval(UNARY[op].format(x="x"), _SHAPE_GLOBALS, {"x": dummy})
        builder.add_value(expr, result, requires_grad)
        return
    other = builder.value()
    y, other_dummy = builder.alias(other)
    op = draw(st.sampled_from(sorted(BINARY)))
    if op == "matmul" and not (
        dummy.dim() == 2 and other_dummy.dim() == 2 and dummy.size(1) == other_dummy.size(1)
    ):
        op = "mul"
    reduce = ""
    if op != "matmul" and dummy.shape != other_dummy.shape:
        reduce = ".sum()"
        other_dummy = torch.empty((), dtype=torch.float64)
    region = _region(builder, BINARY[op].format(x="x", y=f"y{reduce}"), [x, y])
    expr = region or BINARY[op].format(x=x, y=f"{y}{reduce}")
    result = dummy @ other_dummy.mT if op == "matmul" else dummy * other_dummy
    builder.add_value(expr, result, requires_grad or builder.requires_grad[other])


def _region(builder: _Builder, body: str, inputs: list[str]) -> str | None:
    """Sometimes (when allowed) ``body`` as a checkpointed function of ``inputs``, else None."""
    if not builder.checkpoint or builder.draw(st.integers(0, 2)) != 0:
        return None
    builder.checkpointed = True
    names = ", ".join("xy"[: len(inputs)])
    return (
        f"tensorhooks.checkpoint(lambda {names}: {body}, {', '.join(inputs)}, use_reentrant=False)"
    )


class _Shape:
    """Stands in for the custom Functions while shapes are computed."""

    @staticmethod
    def apply(x: torch.Tensor) -> torch.Tensor:
        return x * 1


_SHAPE_GLOBALS = {"torch": torch, "Square": _Shape, "SavedOutputExp": _Shape}


def _write(builder: _Builder) -> None:
    draw = builder.draw
    index = builder.value()
    recorded = draw(st.booleans()) and builder.computed[index]
    x, _ = builder.alias(index, for_recorded_write=recorded)
    kind = draw(st.sampled_from(RECORDED_WRITES if recorded else sorted(WRITES)))
    value = draw(st.sampled_from([-1.5, -0.5, 0.75, 1.25, 2.0]))
    line = WRITES[kind].format(x=x, c=value)
    if recorded:
        builder.lines.append(line)
    else:
        builder.lines.extend(["with torch.no_grad():", f"    {line}"])


def _backward(builder: _Builder, n_leaves: int) -> list[str]:
    draw = builder.draw
    kind = draw(st.sampled_from(BACKWARDS))
    leaves = ", ".join(f"leaf{i}" for i in range(n_leaves))
    if kind in ("inputs", "grad"):
        wanted = [i for i, flag in enumerate(builder.requires_grad) if flag]
        chosen = draw(st.lists(st.sampled_from(wanted), min_size=1, max_size=3, unique=True))
        inputs = ", ".join(builder.names[i] for i in sorted(chosen))
        if kind == "grad":
            return [f"return list(torch.autograd.grad(loss, [{inputs}], allow_unused=True))"]
        retain = [f"{builder.names[i]}.retain_grad()" for i in sorted(chosen) if i >= n_leaves]
        return [
            *retain,
            f"loss.backward(inputs=[{inputs}])",
            f"return [t.grad for t in [{inputs}]]",
        ]
    if kind == "twice":
        return [
            "loss.backward(retain_graph=True)",
            "loss.backward()",
            f"return [t.grad for t in [{leaves}]]",
        ]
    if kind == "double":
        return [
            f"grads = torch.autograd.grad(loss, [{leaves}], create_graph=True, allow_unused=True)",
            "second = sum((g * g).sum() for g in grads if g is not None and g.requires_grad)",
            "if isinstance(second, torch.Tensor):",
            "    second.backward()",
            (
                "return [*(g.detach() if g is not None else None for g in grads), "
                f"*(t.grad for t in [{leaves}])]"
            ),
        ]
    return ["loss.backward()", f"return [t.grad for t in [{leaves}]]"]


@st.composite
def programs(
    draw: st.DrawFn, *, max_steps: int = 8, writes: bool = True, checkpoint: bool = False
) -> Program:
    """Random autograd programs of 1 to ``max_steps`` steps; ``writes`` allows in-place writes.

    With ``checkpoint``, some computing steps run inside a `tensorhooks.checkpoint` region (so
    their inputs are saved by the region, and in-place writes can reach them afterwards).

    Example:
        >>> from hypothesis import given, settings
        >>> from tensorhooks.testing import programs
        >>> @settings(max_examples=3, database=None)
        ... @given(programs())
        ... def test(program):
        ...     print(program.source.splitlines()[0])
        >>> test()  # doctest: +ELLIPSIS
        import torch
        ...
    """
    n_leaves = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**16))
    builder = _Builder(draw, n_leaves, checkpoint=checkpoint)
    n_steps = draw(st.integers(1, max_steps))
    for _ in range(n_steps):
        if writes and draw(st.integers(0, 2)) == 0:
            _write(builder)
        else:
            _compute(builder)
    if not any(builder.computed):
        _compute(builder)
    body = [
        "terms = []",
        *builder.lines,
        "loss = torch.stack(terms).sum() if terms else leaf0.sum()",
        *_backward(builder, n_leaves),
    ]
    leaves = ", ".join(f"leaf{i}" for i in range(n_leaves))
    source = "\n".join(
        [
            "import torch",
            *(["import tensorhooks"] if builder.checkpointed else []),
            "from tensorhooks.testing import SavedOutputExp, Square",
            "",
            "",
            "def make_leaves():",
            f"    generator = torch.Generator().manual_seed({seed})",
            "    return [",
            "        torch.randn(4, 4, dtype=torch.float64, generator=generator).requires_grad_()",
            f"        for _ in range({n_leaves})",
            "    ]",
            "",
            "",
            "def program(leaves):",
            f"    {leaves}, = leaves",
            "    const = torch.linspace(-1, 1, 16, dtype=torch.float64).reshape(4, 4)",
            *(f"    {line}" for line in body),
            "",
        ]
    )
    return Program(source, n_leaves)
