"""Hypothesis strategies shared by the test modules: random autograd programs and hook sets."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from hypothesis import strategies as st

from tensorhooks.testing import Square

# --- autograd programs --------------------------------------------------------------------------
#
# A program starts from a few leaves of shape (4, 4) and appends one value per step, each computed
# from earlier values. Every op keeps the shape (4, 4), so any value can feed any later op. The op
# set covers elementwise ops, matmul, reductions (broadcast back), views (transpose, reshape round
# trips, slices, unbind) and a custom autograd.Function with save_for_backward.

SHAPE = (4, 4)


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


# --- allow_mutation_on_saved_tensors: writes through aliases of saved tensors --------------------
#
# A mutation program starts from ``base = leaf * 1`` of shape (4, 6) and runs steps that either
# save (apply an op that saves its input or its output to some alias of an earlier tensor) or
# write (change some alias of an earlier tensor in place: in-place ops, ``out=``, foreach,
# ``__setitem__``, a write through a dtype view). Aliases are chains of one or two views: slices,
# strided slices, transposes, selects, diagonals, flat slices and ``as_strided`` windows anywhere in
# the storage (so bases and unrelated-looking views are hit too); saving ops may also read a
# negative view (same elements, other values; not every write accepts one). The loss sums the
# outputs of the saving ops, each taken right after it ran, so its gradient only depends on the
# values each op saw. ``isolated=True`` runs the reference: every saving op gets a clone of its
# input and hands out a clone of its output, so no write can reach what backward reads and no
# context is needed.

MUTATION_SHAPE = (4, 6)

VIEW_KINDS = (
    "full",
    "narrow",
    "step",
    "last",
    "transpose",
    "select",
    "diagonal",
    "flat",
    "as_strided",
)
SAVE_VIEW_KINDS = (*VIEW_KINDS, "neg")


@dataclass(frozen=True)
class View:
    """One view op with its integer parameters; falls back to the tensor itself if inapplicable."""

    kind: str
    a: int
    b: int

    def apply(self, x: torch.Tensor) -> torch.Tensor:  # noqa: PLR0911 (one return per kind)
        """Return the view of ``x``."""
        kind, a, b = self.kind, self.a, self.b
        dims = x.dim()
        if kind == "narrow" and dims >= 1 and x.size(0) > 1:
            start = a % x.size(0)
            return x.narrow(0, start, 1 + b % (x.size(0) - start))
        if kind == "step" and dims >= 1:
            return x[a % 2 :: 2]
        if kind == "last" and dims >= 1 and x.size(-1) > 0:
            start = a % x.size(-1)
            return x[..., start : start + 1 + b % (x.size(-1) - start)]
        if kind == "transpose" and dims >= 2:
            return x.transpose(0, 1)
        if kind == "select" and dims >= 1 and x.size(0) > 0:
            return x[a % x.size(0)]
        if kind == "diagonal" and dims >= 2:
            return x.diagonal(offset=a % 3 - 1)
        if kind == "flat" and x.is_contiguous() and x.numel() > 0:
            flat = x.view(-1)
            start = a % flat.numel()
            return flat[start : start + 1 + b % (flat.numel() - start)]
        if kind == "as_strided":
            # A 2 x 2 window anywhere in the storage, rows ``row_stride`` elements apart.
            row_stride = 2 + a % 3
            elements = x.untyped_storage().nbytes() // x.element_size()
            room = elements - (row_stride + 2)
            if room >= 0:
                return x.as_strided((2, 2), (row_stride, 1), b % (room + 1))
        if kind == "neg":
            return torch._neg_view(x)
        return x


def views(kinds: Sequence[str] = VIEW_KINDS) -> st.SearchStrategy[tuple[View, ...]]:
    """Chains of one or two views of the given kinds."""
    view = st.builds(View, st.sampled_from(kinds), st.integers(0, 7), st.integers(0, 7))
    return st.lists(view, min_size=1, max_size=2).map(tuple)


def _matmul_self(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 2:
        return x @ x.transpose(0, 1)
    if x.dim() == 1:
        return x @ x
    return x * x


SAVING_OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "pow": lambda x: x**2,  # saves its input
    "sin": torch.sin,  # saves its input
    "tanh": torch.tanh,  # saves its output
    "sigmoid": torch.sigmoid,  # saves its output
    "relu": torch.relu,  # saves its output
    "self_mul": lambda x: x * x,  # saves its input twice
    "matmul_self": _matmul_self,  # saves its input and a transposed view of it
    "custom_square": Square.apply,  # save_for_backward
}
WRITE_KINDS = (
    "mul_",
    "add_",
    "zero_",
    "fill_",
    "sin_",
    "copy_",
    "setitem",
    "out",
    "foreach",
    "dtype_view",
)
# Writes that record autograd history when run with grad mode on.
DIFFERENTIABLE_WRITES = frozenset({"mul_", "add_", "sin_", "foreach", "setitem", "zero_"})


@dataclass(frozen=True)
class SaveStep:
    """Apply ``SAVING_OPS[op]`` to an alias of tensor ``target`` (index modulo their number)."""

    target: int
    view: tuple[View, ...]
    op: str


@dataclass(frozen=True)
class WriteStep:
    """Write in place to an alias of tensor ``target``; foreach also writes ``other_view``."""

    target: int
    view: tuple[View, ...]
    kind: str
    value: float
    other_target: int
    other_view: tuple[View, ...]
    grad_mode: bool


def _alias(tensors: Sequence[torch.Tensor], target: int, chain: Sequence[View]) -> torch.Tensor:
    x = tensors[target % len(tensors)]
    for view in chain:
        x = view.apply(x)
    return x


def _write(step: WriteStep, tensors: Sequence[torch.Tensor]) -> None:
    x = _alias(tensors, step.target, step.view)
    kind, value = step.kind, step.value
    differentiable = step.grad_mode and kind in DIFFERENTIABLE_WRITES
    with torch.set_grad_enabled(differentiable):
        if kind == "mul_":
            x.mul_(value)
        elif kind == "add_":
            x.add_(value)
        elif kind == "zero_":
            x.zero_()
        elif kind == "fill_":
            x.fill_(value)
        elif kind == "sin_":
            x.sin_()
        elif kind == "copy_":
            x.copy_(torch.full_like(x, value))
        elif kind == "setitem":
            x[...] = value
        elif kind == "out":
            torch.mul(torch.full_like(x, 1.0), value, out=x)
        elif kind == "foreach":
            torch._foreach_mul_([x, _alias(tensors, step.other_target, step.other_view)], value)
        elif kind == "dtype_view":
            x.view(torch.int64).bitwise_xor_(1 << 40)
        else:
            raise AssertionError(kind)


@dataclass(frozen=True)
class MutationProgram:
    """Saves and in-place writes through aliases, from one leaf of shape ``MUTATION_SHAPE``."""

    steps: tuple[SaveStep | WriteStep, ...]
    seed: int

    def leaf(self) -> torch.Tensor:
        """A fresh leaf, the same values on every call."""
        generator = torch.Generator().manual_seed(self.seed)
        return torch.randn(
            MUTATION_SHAPE, generator=generator, dtype=torch.float64
        ).requires_grad_()

    def run(self, leaf: torch.Tensor, *, isolated: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run the program; return the loss and every tensor it made (base first)."""
        tensors = [leaf * 1]
        terms = []
        for index, step in enumerate(self.steps):
            if isinstance(step, WriteStep):
                _write(step, tensors)
                continue
            x = _alias(tensors, step.target, step.view)
            out = SAVING_OPS[step.op](x.clone() if isolated else x)
            terms.append((out * (1.0 + 0.125 * index)).sum())
            tensors.append(out.clone() if isolated else out)
        loss = torch.stack(terms).sum() if terms else leaf.sum()
        return loss, tensors


@st.composite
def mutation_programs(draw: st.DrawFn, *, max_steps: int = 8) -> MutationProgram:
    """Random mutation programs of 2 to ``max_steps`` steps, at least one of them a save."""
    n_steps = draw(st.integers(2, max_steps))
    steps: list[SaveStep | WriteStep] = [
        SaveStep(
            draw(st.integers(0, 3)),
            draw(views(SAVE_VIEW_KINDS)),
            draw(st.sampled_from(sorted(SAVING_OPS))),
        )
    ]
    for _ in range(n_steps - 1):
        target = draw(st.integers(0, 7))
        if draw(st.booleans()):
            steps.append(
                SaveStep(
                    target, draw(views(SAVE_VIEW_KINDS)), draw(st.sampled_from(sorted(SAVING_OPS)))
                )
            )
        else:
            steps.append(
                WriteStep(
                    target,
                    draw(views()),
                    draw(st.sampled_from(WRITE_KINDS)),
                    draw(st.sampled_from([-1.5, -0.5, 0.75, 1.25, 2.0])),
                    draw(st.integers(0, 7)),
                    draw(views()),
                    draw(st.booleans()),
                )
            )
    return MutationProgram(tuple(steps), draw(st.integers(0, 2**16)))


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
