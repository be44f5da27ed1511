"""Region steps over state a model keeps in Python: kept masks, swapped data, lazy modules, more.

See NOTE [State a region keeps in Python objects].
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
from hypothesis import strategies as st

from .drawing import CONSTANTS, Scope, alias, binary, pick

__all__ = ["STATEFUL_KINDS", "Held", "Stateful", "outside_block", "stateful_step", "swap"]

# NOTE [State a region keeps in Python objects]
#
# Training code keeps state in Python objects that a checkpoint cannot see as arguments: a mask
# on ``self``, a cache dict, a counter, a hidden state, a module reached through its parent. The
# region kinds of STATEFUL_KINDS draw a step of a region's body that does so (``Held`` names the
# objects, made in the program before the region's ``def``):
#   - "kept": the region makes a tensor without grad and keeps it (a mask on a module's
#     attribute, a mask cached per shape in a dict attribute, a buffer registered in forward or
#     a dict in the closure, a constant rebuilt each call on an attribute or in that dict), then
#     reads it (``masked_fill`` and ``mul`` save it). The holders are shared by every region of
#     the program, so a later region rebuilds what an earlier one kept; a region may also return
#     its mask inside a nested output (a tuple in a tuple, a list in a dict);
#   - "data": the region swaps a leaf's data idempotently before reading it, as sharded-weight
#     code does: a gather (``leaf.data = full.clone()``, a fresh copy of the same values each
#     call), a max-norm renormalisation (``leaf.data = torch.renorm(leaf.data, 2, 0, 1.0)``), or
#     a pointer into one flat buffer of every leaf (``leaf.data = flat[a:b].view(4, 4)``);
#   - "lazy": the region makes the first call of a ``torch.nn.LazyLinear``, which materialises
#     and initialises its weight in place;
#   - "rebound": the region reads state from a module's attribute and rebinds it: a hidden state
#     (``cell.h = out.detach()``), a running mean (``cell.m = 0.9 * cell.m + 0.1 * x``), an int
#     or tensor counter (``cell.step = cell.step + 1``, read inside a saved op); a later step may
#     use the same cell again, as a recurrent model does at each position;
#   - "swapped": the region calls a layer of a pair (two ``nn.Linear`` in a dict, a
#     ``ModuleList``, or a list), and the program swaps the pair (or their weights,
#     ``a.weight, b.weight = b.weight, a.weight``) between the forward pass and backward (`swap`,
#     drawn among the program's steps and, half the time, once more before the loss);
#   - "parent": the region reaches its block through a parent module shared by every region
#     (``model.blocks[i](x)``, as ``checkpoint(lambda h: self.layers[i](h), h)`` does), blocks
#     with BatchNorm in training mode among them; the program also runs blocks outside regions
#     (`outside_block`), as a model checkpointing some of its blocks does;
#   - "norm": the region runs a ``BatchNorm1d`` in training mode, whose kernel writes the running
#     statistics without moving their version counter; a later step may use the same layer.
# The program returns, after its gradients, the state these objects hold at the end (hidden
# states, counters, running statistics), so state written twice is seen. Programs with modules
# seed torch's generator first, so that every run initialises them alike. Right results are
# plain autograd's; an error is right only where the program changed what a region read after
# its forward pass and before backward (a layer swapped, a cell used again): see NOTE [What
# explains a checkpoint's error] in explained.py.

STATEFUL_KINDS = ("data", "kept", "lazy", "norm", "parent", "rebound", "swapped")
_KEPT = ("mask", "cache", "buffer", "closure", "constant", "closure_constant")
_DATA = ("gather", "renorm", "flat")
_REBOUND = ("hidden", "mean", "detached_mean", "int", "tensor")
_PAIRS = ("dict", "module_list", "weights")
_LINEAR = "torch.nn.Linear(4, 4, dtype=torch.float64)"
_NORM = "torch.nn.BatchNorm1d(4, dtype=torch.float64)"
_BLOCKS = (
    f"torch.nn.Sequential({_LINEAR}, {_NORM}, torch.nn.Tanh())",
    _LINEAR,
    f"torch.nn.Sequential({_NORM}, {_LINEAR})",
)
# How each pair of layers is made, read and swapped.
_PAIR_SOURCE = {
    "dict": ("{{'a': {linear}, 'b': {linear}}}", "{pair}['a']", "{pair}['a'], {pair}['b']"),
    "module_list": (
        "torch.nn.ModuleList([{linear}, {linear}])",
        "{pair}[0]",
        "{pair}[0], {pair}[1]",
    ),
    "weights": ("[{linear}, {linear}]", "{pair}[0]", "{pair}[0].weight, {pair}[1].weight"),
}


class Held:
    """The Python objects a program's stateful steps made, by name, and what it returns of them."""

    __slots__ = (
        "cells",
        "counts",
        "flat",
        "kept",
        "masks",
        "norms",
        "pairs",
        "parent",
        "seeded",
        "state",
        "thread",
    )

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}  # objects made, by prefix
        self.state: list[str] = []  # expressions the program returns after its gradients
        self.pairs: list[tuple[str, str]] = []  # (the pair's name, its kind), for `swap`
        self.cells: list[tuple[str, str, tuple[int, ...]]] = []  # (name, kind, shape)
        self.norms: list[str] = []
        self.kept = False  # whether the shared holders exist
        self.masks: list[str] = []  # where "kept" steps read their masks, for nested outputs
        self.flat = False  # whether the flat buffer of the leaves exists
        self.parent = False  # whether the parent module exists
        self.seeded = False  # whether the program seeds torch's generator
        self.thread = False  # whether backward runs on a worker thread

    def name(self, prefix: str) -> str:
        """A new name ``<prefix><n>``."""
        count = self.counts.get(prefix, 0)
        self.counts[prefix] = count + 1
        return f"{prefix}{count}"


class Stateful(Protocol):
    """What a stateful step needs of the program being drawn."""

    draw: st.DrawFn
    scope: Scope
    lines: list[str]
    n_leaves: int
    held: Held


class _Step(NamedTuple):
    """A drawn step: the value's expression, its dummy and requires_grad, the lines around it."""

    expr: str
    dummy: torch.Tensor
    requires_grad: bool
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()  # ``{name}`` stands for the value's name


def stateful_step(
    program: Stateful, kind: str, local: Scope, name: str
) -> tuple[list[str], torch.Tensor, bool]:
    """Draw a step of ``kind`` (one of STATEFUL_KINDS) computing ``name`` from ``local``'s values.

    Returns the body's lines (which assign ``name``), the value's dummy and requires_grad. The
    objects the step needs are made in ``program.lines``, before the region's ``def``.
    """
    index = pick(program.draw, local)
    x, dummy = alias(program.draw, local.names[index], local.dummies[index])
    step = _STEPS[kind](program, x, dummy, local.requires_grad[index])
    after = [line.format(name=name) for line in step.after]
    return [*step.before, f"{name} = {step.expr}", *after], step.dummy, step.requires_grad


def _kept(program: Stateful, x: str, dummy: torch.Tensor, grad: bool) -> _Step:
    draw, held = program.draw, program.held
    if not held.kept:
        held.kept = True
        program.lines.extend(["kept = torch.nn.Module()", "kept.masks = {}", "cache = {}"])
    shape = tuple(dummy.shape)
    key = "_".join(map(str, shape)) or "scalar"
    mask = f"torch.arange({max(1, dummy.numel())}).reshape({shape}) % 3 == 0"
    c = draw(st.sampled_from(CONSTANTS))
    form = draw(st.sampled_from(_KEPT))
    if form in ("constant", "closure_constant"):
        made = f"torch.full({shape}, {c}, dtype=torch.float64)"
        where = "kept.scale" if form == "constant" else f"cache['scale_{key}']"
        return _Step(f"{x} * {where}", dummy.clone(), grad, (f"{where} = {made}",))
    if form == "mask":
        where, lines = "kept.mask", [f"kept.mask = {mask}"]
    elif form == "buffer":
        where = f"kept.mask_{key}"
        lines = [
            f"if not hasattr(kept, 'mask_{key}'):",
            f"    kept.register_buffer('mask_{key}', {mask}, persistent=False)",
        ]
    else:
        cache = "kept.masks" if form == "cache" else "cache"
        where = f"{cache}['{key}']"
        lines = [f"if '{key}' not in {cache}:", f"    {where} = {mask}"]
    held.masks.append(where)
    return _Step(f"{x}.masked_fill({where}, {c})", dummy.clone(), grad, tuple(lines))


def _data(program: Stateful, x: str, dummy: torch.Tensor, grad: bool) -> _Step:
    draw, held = program.draw, program.held
    leaf = draw(st.integers(0, program.n_leaves - 1))
    form = draw(st.sampled_from(_DATA))
    if form == "gather":
        full = held.name("full")
        program.lines.append(f"{full} = leaf{leaf}.detach().clone()")
        swapped = f"leaf{leaf}.data = {full}.clone()"
    elif form == "renorm":
        swapped = f"leaf{leaf}.data = torch.renorm(leaf{leaf}.data, 2, 0, 1.0)"
    else:
        if not held.flat:
            held.flat = True
            leaves = ", ".join(f"leaf{i}.detach().reshape(-1)" for i in range(program.n_leaves))
            program.lines.append(f"flat = torch.cat([{leaves}])")
        swapped = f"leaf{leaf}.data = flat[{16 * leaf}:{16 * leaf + 16}].view(4, 4)"
    y, other = alias(draw, f"leaf{leaf}", torch.empty(4, 4, dtype=torch.float64))
    expr, result = binary(draw, x, dummy, y, other)
    return _Step(expr, result, True, (swapped,))


def _as_features(x: str, dummy: torch.Tensor) -> tuple[str, tuple[int, ...]]:
    """``x`` as an input of a layer of 4 features, and the layer's output shape."""
    if dummy.dim() >= 1 and dummy.size(-1) == 4:
        return x, tuple(dummy.shape)
    return f"{x}.sum().expand(4)", (4,)


def _as_batch(x: str, dummy: torch.Tensor) -> str:
    """``x`` as a batch of at least two rows of 4 features, for BatchNorm in training mode."""
    if dummy.dim() == 2 and dummy.size(1) == 4 and dummy.size(0) >= 2:
        return x
    return f"({x}.sum() * torch.linspace(-1, 1, 16, dtype=torch.float64).reshape(4, 4))"


def _lazy(program: Stateful, x: str, dummy: torch.Tensor, grad: bool) -> _Step:
    layer = program.held.name("lazy")
    program.held.seeded = True
    program.lines.append(f"{layer} = torch.nn.LazyLinear(4, dtype=torch.float64)")
    if dummy.dim() == 0:
        x, dummy = f"{x}.reshape(1)", dummy.reshape(1)
    shape = (*dummy.shape[:-1], 4)
    return _Step(f"{layer}({x})", torch.empty(shape, dtype=torch.float64), True)


def _rebound(program: Stateful, x: str, dummy: torch.Tensor, grad: bool) -> _Step:
    draw, held = program.draw, program.held
    form = draw(st.sampled_from(_REBOUND))
    shape = tuple(dummy.shape)
    same = [cell for cell, kind, size in held.cells if kind == form and size == shape]
    if len(same) > 0 and draw(st.booleans()):
        cell = draw(st.sampled_from(same))  # the same cell again, as at a recurrent model's step
    else:
        cell = held.name("cell")
        held.cells.append((cell, form, shape))
        program.lines.extend(_cell_source(cell, form, shape))
        held.state.append(_cell_state(cell, form))
    if form == "hidden":  # read, then rebound to the new state
        after = (f"{cell}.h = {{name}}.detach()",)
        return _Step(f"torch.tanh({x} + {cell}.h)", dummy.clone(), grad, after=after)
    if form in ("mean", "detached_mean"):
        new = f"{x}.detach()" if form == "detached_mean" else x
        before = (f"{cell}.m = 0.9 * {cell}.m + 0.1 * {new}",)
        return _Step(f"torch.sin({x} - {cell}.m)", dummy.clone(), grad, before)
    attribute = "step" if form == "int" else "t"
    before = (f"{cell}.{attribute} = {cell}.{attribute} + 1",)
    return _Step(f"torch.sin({x} * {cell}.{attribute})", dummy.clone(), grad, before)


def _cell_source(cell: str, form: str, shape: tuple[int, ...]) -> list[str]:
    zeros = f"torch.zeros({shape}, dtype=torch.float64)"
    value = {
        "hidden": ("h", zeros),
        "mean": ("m", zeros),
        "detached_mean": ("m", zeros),
        "int": ("step", "0"),
        "tensor": ("t", "torch.zeros((), dtype=torch.float64)"),
    }[form]
    return [f"{cell} = torch.nn.Module()", f"{cell}.{value[0]} = {value[1]}"]


def _cell_state(cell: str, form: str) -> str:
    return {
        "hidden": f"{cell}.h",
        "mean": f"{cell}.m.detach()",
        "detached_mean": f"{cell}.m",
        "int": f"torch.tensor(float({cell}.step), dtype=torch.float64)",
        "tensor": f"{cell}.t",
    }[form]


def _swapped(program: Stateful, x: str, dummy: torch.Tensor, grad: bool) -> _Step:
    held = program.held
    form = program.draw(st.sampled_from(_PAIRS))
    pair = held.name("pair")
    held.seeded = True
    held.pairs.append((pair, form))
    make, read, _ = _PAIR_SOURCE[form]
    program.lines.append(f"{pair} = {make.format(linear=_LINEAR)}")
    x, shape = _as_features(x, dummy)
    layer = read.format(pair=pair)
    return _Step(f"{layer}({x})", torch.empty(shape, dtype=torch.float64), True)


def swap(program: Stateful) -> None:
    """Between the forward pass and backward: swap a pair of layers, or their weights."""
    pair, form = program.draw(st.sampled_from(program.held.pairs))
    slots = _PAIR_SOURCE[form][2].format(pair=pair)
    first, second = slots.split(", ")
    program.lines.append(f"{slots} = {second}, {first}")


def _parent(program: Stateful, x: str, dummy: torch.Tensor, grad: bool) -> _Step:
    held = program.held
    if not held.parent:
        held.parent = True
        held.seeded = True
        program.lines.extend(
            [
                "model = torch.nn.Module()",
                f"model.blocks = torch.nn.ModuleList([{', '.join(_BLOCKS)}])",
            ]
        )
        held.state.append("*(buffer.clone() for buffer in model.buffers())")
    block = program.draw(st.integers(0, len(_BLOCKS) - 1))
    return _Step(f"model.blocks[{block}]({_as_batch(x, dummy)})", _rows(dummy), True)


def outside_block(program: Stateful) -> tuple[str, torch.Tensor]:
    """A block of the parent module run outside any region: the expression and its dummy."""
    draw, scope = program.draw, program.scope
    index = pick(draw, scope)
    x, dummy = alias(draw, scope.names[index], scope.dummies[index])
    block = draw(st.integers(0, len(_BLOCKS) - 1))
    return f"model.blocks[{block}]({_as_batch(x, dummy)})", _rows(dummy)


def _rows(dummy: torch.Tensor) -> torch.Tensor:
    """The dummy of a layer's output on ``_as_batch`` of ``dummy``."""
    if dummy.dim() == 2 and dummy.size(1) == 4 and dummy.size(0) >= 2:
        return dummy.clone()
    return torch.empty(4, 4, dtype=torch.float64)


def _norm(program: Stateful, x: str, dummy: torch.Tensor, grad: bool) -> _Step:
    draw, held = program.draw, program.held
    if len(held.norms) > 0 and draw(st.booleans()):
        norm = draw(st.sampled_from(held.norms))  # the same layer again: its statistics twice
    else:
        norm = held.name("norm")
        held.norms.append(norm)
        program.lines.append(f"{norm} = {_NORM}")
        held.state.append(f"*(buffer.clone() for buffer in {norm}.buffers())")
    return _Step(f"{norm}({_as_batch(x, dummy)})", _rows(dummy), True)


_STEPS = {
    "data": _data,
    "kept": _kept,
    "lazy": _lazy,
    "norm": _norm,
    "parent": _parent,
    "rebound": _rebound,
    "swapped": _swapped,
}
