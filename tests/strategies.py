"""Hypothesis strategies shared by the test modules: random autograd programs and hook sets."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from hypothesis import strategies as st

# --- autograd programs --------------------------------------------------------------------------
#
# A program starts from a few leaves of shape (4, 4) and appends one value per step, each computed
# from earlier values. Every op keeps the shape (4, 4), so any value can feed any later op. The op
# set covers elementwise ops, matmul, reductions (broadcast back), views (transpose, reshape round
# trips, slices, unbind) and a custom autograd.Function with save_for_backward.

SHAPE = (4, 4)


class Square(torch.autograd.Function):
    """x * x through save_for_backward, to exercise custom Functions' saved tensors."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return 2 * x * grad


class FailingBackward(torch.autograd.Function):
    """Identity forward whose backward raises, to exercise graph tasks that fail part-way."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        raise BackwardFailedError("backward failed on purpose")


class BackwardFailedError(RuntimeError):
    """Raised by FailingBackward."""


UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sin": torch.sin,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "exp": lambda x: torch.exp(x.clamp(-3, 3)),
    "square": lambda x: x * x,
    "custom_square": Square.apply,
    "transpose": lambda x: x.t(),
    "reshape": lambda x: x.reshape(2, 8).reshape(SHAPE),
    "slice_cat": lambda x: torch.cat([x[2:], x[:2]]),
    "unbind_stack": lambda x: torch.stack(x.unbind(0)[::-1]),
    "sum_rows": lambda x: x.sum(dim=0, keepdim=True).expand(SHAPE),
    "mean_scale": lambda x: x.mean(dim=1, keepdim=True) * x,
}
BINARY: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "add": torch.add,
    "mul": torch.mul,
    "matmul": lambda x, y: 0.5 * (x @ y),
}


@dataclass(frozen=True)
class Step:
    """One op: its name and the indices of the earlier values it reads."""

    op: str
    args: tuple[int, ...]


@dataclass(frozen=True)
class Program:
    """A random autograd program over ``n_leaves`` leaves."""

    n_leaves: int
    steps: tuple[Step, ...]
    seed: int
    fail_at: int | None = None  # step whose output goes through FailingBackward

    @property
    def n_values(self) -> int:
        return self.n_leaves + len(self.steps)

    def leaves(self, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
        """Fresh leaves, the same values on every call."""
        generator = torch.Generator().manual_seed(self.seed)
        return [
            torch.randn(SHAPE, generator=generator, dtype=dtype).requires_grad_()
            for _ in range(self.n_leaves)
        ]

    def run(self, leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Every value of the program: the leaves, then one per step."""
        values = list(leaves)
        for index, step in enumerate(self.steps):
            operands = [values[i] for i in step.args]
            out = UNARY[step.op](*operands) if step.op in UNARY else BINARY[step.op](*operands)
            if index == self.fail_at:
                out = FailingBackward.apply(out)  # type: ignore[no-untyped-call]
            values.append(out)
        return values

    @staticmethod
    def loss(values: Sequence[torch.Tensor]) -> torch.Tensor:
        """A scalar that depends on the last value (and so on every value feeding it)."""
        return values[-1].sum()


@st.composite
def programs(
    draw: st.DrawFn, *, min_steps: int = 1, max_steps: int = 8, may_fail: bool = False
) -> Program:
    """Random programs of ``min_steps`` to ``max_steps`` ops over 1 to 3 leaves."""
    n_leaves = draw(st.integers(1, 3))
    n_steps = draw(st.integers(min_steps, max_steps))
    steps = []
    for i in range(n_steps):
        available = n_leaves + i
        op = draw(st.sampled_from(sorted(UNARY) + sorted(BINARY)))
        arity = 1 if op in UNARY else 2
        # Bias towards recent values so that programs are deep rather than wide.
        args = tuple(draw(st.integers(max(0, available - 4), available - 1)) for _ in range(arity))
        steps.append(Step(op, args))
    fail_at = draw(st.one_of(st.none(), st.integers(0, n_steps - 1))) if may_fail else None
    return Program(n_leaves, tuple(steps), draw(st.integers(0, 2**16)), fail_at)


# --- backward variants --------------------------------------------------------------------------


@dataclass(frozen=True)
class Backward:
    """How to run backward: plain, with ``inputs=``, as ``autograd.grad``, or twice."""

    kind: str  # "backward" | "backward_inputs" | "grad" | "twice"
    inputs: tuple[int, ...] = field(default=())

    def run(self, loss: torch.Tensor, values: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """Run it; return the gradient of every value in ``inputs`` (or of every leaf)."""
        chosen = [values[i] for i in self.inputs]
        if self.kind == "grad":
            return list(torch.autograd.grad(loss, chosen, allow_unused=True))
        if self.kind == "backward_inputs":
            for tensor in chosen:
                tensor.retain_grad()
            loss.backward(inputs=chosen)
            return [tensor.grad for tensor in chosen]
        loss.backward(retain_graph=self.kind == "twice")
        if self.kind == "twice":
            loss.backward()
        return []


@st.composite
def backwards(draw: st.DrawFn, program: Program) -> Backward:
    """A random way of running backward through ``program``."""
    kind = draw(st.sampled_from(["backward", "backward_inputs", "grad", "twice"]))
    if kind in ("backward", "twice"):
        return Backward(kind)
    # Inputs of autograd.grad / backward(inputs=) must require grad: every value does here.
    candidates = list(range(program.n_values))
    inputs = draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=3, unique=True))
    return Backward(kind, tuple(sorted(inputs)))


def hook_sets(program: Program) -> st.SearchStrategy[list[int]]:
    """Random groups of values (possibly with repeats) to put one multi-grad hook on."""
    return st.lists(st.integers(0, program.n_values - 1), min_size=1, max_size=5)


def assert_same_grads(
    expected: Sequence[torch.Tensor | None], got: Sequence[torch.Tensor | None]
) -> None:
    """Gradients are bitwise equal, and None exactly where the reference has None."""
    assert len(expected) == len(got)
    for index, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert (want is None) == (have is None), f"gradient {index}: {want} vs {have}"
        if want is not None:
            assert have is not None
            assert torch.equal(want, have), f"gradient {index} differs: {want} vs {have}"


# --- save_on_cpu -------------------------------------------------------------------------------

# Ops of the random programs run under save_on_cpu: every value is a square matrix, so any two
# values combine. Unary ops save their input or result; binary ops save one or both operands;
# "t" saves nothing but makes later saves of a transposed (dense, non-contiguous) view; "slice"
# saves a strided, non-dense view; "mul_" changes a value in place after it may have been saved.
OFFLOAD_UNARY_OPS = ("sin", "tanh", "sigmoid", "relu", "square", "exp", "t", "slice")
OFFLOAD_BINARY_OPS = ("mul", "add", "matmul")
OFFLOAD_INPLACE_OPS = ("mul_",)


class OffloadProgram(NamedTuple):
    """A random autograd program: ``ops`` over ``n``x``n`` values seeded by ``seed``.

    Values 0 and 1 are leaves (an input that requires grad and an ``nn.Parameter``); op ``k``
    appends value ``k + 2``. Each op is ``(name, i, j)`` with ``i, j`` indices of earlier values
    (``j`` unused by unary ops). The loss is the sum of the values in ``outputs``.
    """

    n: int
    seed: int
    ops: tuple[tuple[str, int, int], ...]
    outputs: tuple[int, ...]


@st.composite
def offload_programs(draw: st.DrawFn, *, inplace: bool = False) -> OffloadProgram:
    """Random programs for save_on_cpu; with ``inplace``, some ops change values in place."""
    # In-place ops are drawn often enough that some change a value already saved.
    names = OFFLOAD_UNARY_OPS + OFFLOAD_BINARY_OPS + (OFFLOAD_INPLACE_OPS * 4 if inplace else ())
    length = draw(st.integers(1, 8))
    ops = []
    for k in range(length):
        values = k + 2
        name = draw(st.sampled_from(names))
        # Leaves (0 and 1) cannot be changed in place: aim in-place ops at computed values.
        low = 2 if name in OFFLOAD_INPLACE_OPS and values > 2 else 0
        ops.append((name, draw(st.integers(low, values - 1)), draw(st.integers(0, values - 1))))
    total = length + 2
    outputs = draw(st.lists(st.integers(2, total - 1), min_size=1, max_size=3, unique=True))
    return OffloadProgram(
        n=draw(st.integers(2, 5)),
        seed=draw(st.integers(0, 2**16)),
        ops=tuple(ops),
        outputs=tuple(outputs),
    )


def offload_options() -> st.SearchStrategy[dict[str, object]]:
    """Keyword options of save_on_cpu, small thresholds so that test tensors get copied."""
    return st.fixed_dictionaries(
        {
            "pin_memory": st.booleans(),
            "min_offload_bytes": st.sampled_from([0, 16, 40, 1 << 20]),
            "offload_parameters": st.booleans(),
            "prefetch": st.integers(0, 3),
            "max_in_flight": st.integers(0, 5),
        }
    )


# --- tensorhooks.distributed --------------------------------------------------------------------
#
# Parameter sets for bucket assignment: a few tensors of random sizes and dtypes, some frozen.

DISTRIBUTED_DTYPES = (torch.float32, torch.float64, torch.float16)


@st.composite
def distributed_params(draw: st.DrawFn) -> list[torch.nn.Parameter]:
    """Between 1 and 12 parameters of 1 to 600 elements, of mixed dtypes, some frozen."""
    params = []
    for _ in range(draw(st.integers(1, 12))):
        numel = draw(st.integers(1, 600))
        dtype = draw(st.sampled_from(DISTRIBUTED_DTYPES))
        requires_grad = draw(st.booleans() | st.just(True))
        params.append(torch.nn.Parameter(torch.zeros(numel, dtype=dtype), requires_grad))
    return params


def bucket_cap_bytes() -> st.SearchStrategy[int]:
    """Bucket caps from one byte to a little over a tensor of 600 float64 elements."""
    return st.integers(1, 6000)
