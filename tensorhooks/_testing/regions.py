"""Checkpoint regions of random programs: a nested function, checkpointed on aliases of values.

See NOTE [Random autograd programs] and NOTE [Random checkpoint regions].
"""

from __future__ import annotations

from typing import Protocol

import torch
from hypothesis import strategies as st

from .drawing import Scope, alias, binary, compute, pick, write
from .hooked import module_region
from .reached import reach
from .stateful import STATEFUL_KINDS, Held, stateful_step

__all__ = ["POLICY_CHOICES", "REGION_KINDS", "Region", "draw_region", "policy_source"]

# NOTE [Random checkpoint regions]
#
# A region is a function defined inside ``program`` and called through ``checkpoint(region, *args,
# use_reentrant=False)``, where ``checkpoint`` is a global of the program's source
# (``tensorhooks.checkpoint`` as printed; a checker may bind another implementation, or plain
# calls for the reference). Its arguments are one to three aliases of earlier values; its body is
# one to four operations on its arguments and its own intermediates, returning the last one it
# computed. The kinds of REGION_KINDS add what silently wrong recomputations have come from:
#   - "aliasing": arguments alias each other (two aliases of one value: a tensor and a view of
#     it, overlapping slices);
#   - "inplace": the region writes its arguments and its intermediates in place (attention's
#     ``scores.mul_(scale)``), recorded by autograd or under ``no_grad``;
#   - "outside": an op reads an earlier value from outside the arguments, through a view made
#     inside the region (``h @ w.mT``, ``linear(h, w)``, ``h * w[1]``: the way ``nn.Linear``
#     saves ``weight.t()``). Later writes of the program favour the values regions read so;
#   - "policy": the call passes ``context_fn=contexts``: tensorhooks' selective checkpointing
#     with a random policy (one choice per op, drawn from POLICY_CHOICES and the same for every
#     call of the op), with ``allow_cache_entry_mutation`` drawn once per program;
#   - "state": the region writes state in place (``const``, a scalar ``count``, or a value that
#     needs no gradient) under ``no_grad``, and often reads it back right after: a buffer
#     written then read, read (saved) then written, a counter. Half the time an op reads the
#     state beside a value the region computed just before the update (an EMA), and the op's
#     result is then often saved (``sin``), written in place, and read again by an op that
#     saves it: the first recomputation meets the write and runs again, and both runs must
#     read the state as it was at the call. The program then also returns
#     ``const`` and ``count``, so state written twice is seen even where no gradient reads it;
#   - "reached": an op reads an earlier value through a holder (a list, a tuple, a dict, a
#     plain object, a global, a module, a ModuleDict), and the program changes what regions
#     read between their forward pass and backward: a new tensor bound in the holder or the
#     closure, swapped data, optimizer steps of each implementation. See NOTE [Reached,
#     replaced, stepped] in reached.py;
#   - "module": the region is a module's forward, checkpointed by ``checkpoint_module`` with
#     forward hooks and pre-hooks registered around it. See NOTE [Checkpointed modules and their
#     hooks] in hooked.py;
#   - the kinds of STATEFUL_KINDS ("data", "kept", "lazy", "norm", "parent", "rebound",
#     "swapped"): the region keeps or reaches state in Python objects (a mask on a module, a
#     swapped ``.data``, a lazy module, a rebound attribute, a layer of a pair swapped before
#     backward, a block reached through its parent, BatchNorm). See NOTE [State a region keeps
#     in Python objects] in stateful.py. With "kept", a function region may return its mask
#     inside a nested output (``return h, (mask,)``, ``return {'out': h, 'masks': [mask]}``).
# Writes inside a region ("inplace", "state", "norm") are drawn only for programs drawn with
# writes.

_FIRST_KINDS = ("aliasing", "inplace", "module", "outside", "policy", "reached", "state")
REGION_KINDS = tuple(sorted((*_FIRST_KINDS, *STATEFUL_KINDS)))
POLICY_CHOICES = (
    "MUST_SAVE",
    "PREFER_SAVE",
    "MUST_RECOMPUTE",
    "PREFER_RECOMPUTE",
    "MUST_CPU_OFFLOAD",
    "PREFER_CPU_OFFLOAD",
)
_ARGUMENTS = "xyz"


class Region(Protocol):
    """What drawing a region needs of the program being drawn."""

    draw: st.DrawFn
    scope: Scope
    lines: list[str]
    kinds: frozenset[str]
    writes: bool
    regions: int
    outside_reads: list[int]
    writes_state: bool
    uses_policy: bool
    n_leaves: int
    rebinds: list[tuple[str, int]]
    modules: int
    global_hooks: bool
    held: Held

    def add_value(self, expr: str, dummy: torch.Tensor, requires_grad: bool) -> None:
        """Append ``v<n> = expr`` and its term of the loss."""


def draw_region(program: Region) -> None:
    """Draw one region and its call; the call's result becomes the program's next value."""
    draw, outer = program.draw, program.scope
    name = f"region{program.regions}"
    program.regions += 1
    local = Scope()
    arguments = []
    for index in _argument_values(draw, outer, "aliasing" in program.kinds):
        expr, dummy = alias(draw, outer.names[index], outer.dummies[index])
        arguments.append(expr)
        parameter = _ARGUMENTS[len(local.names)]
        local.add(parameter, dummy, outer.requires_grad[index], outer.computed[index])
    body = _Body(program, local)
    masks = len(program.held.masks)
    for _ in range(draw(st.integers(1, 4))):
        body.step()
    if body.result is None:
        body.compute()
    assert body.result is not None  # compute() always sets it
    parameters = local.names[: len(arguments)]
    body_lines = [*body.lines, f"return {local.names[body.result]}"]
    if "module" in program.kinds and draw(st.booleans()):
        lines, call, global_hooks = module_region(draw, name, parameters, arguments, body_lines)
        program.lines.extend(lines)
        program.modules += 1
        program.global_hooks |= global_hooks
        program.add_value(call, local.dummies[body.result], local.requires_grad[body.result])
        return
    policy = ""
    if "policy" in program.kinds and draw(st.booleans()):
        program.uses_policy = True
        policy = ", context_fn=contexts"
    call = f"checkpoint({name}, {', '.join(arguments)}, use_reentrant=False{policy})"
    kept = program.held.masks[masks:]
    if len(kept) > 0 and draw(st.booleans()):  # the mask also returned, inside a nested output
        body_lines[-1], taken = _nested_return(draw, local.names[body.result], kept[-1])
        call += taken
    program.lines.append(f"def {name}({', '.join(parameters)}):")
    program.lines.extend(f"    {line}" for line in body_lines)
    program.add_value(call, local.dummies[body.result], local.requires_grad[body.result])


def _nested_return(draw: st.DrawFn, result: str, mask: str) -> tuple[str, str]:
    """A return of ``result`` and ``mask`` in a nested output; how the call takes ``result``."""
    if draw(st.booleans()):
        return f"return {result}, ({mask},)", "[0]"
    return f"return {{'out': {result}, 'masks': [{mask}]}}", "['out']"


def _argument_values(draw: st.DrawFn, outer: Scope, aliasing: bool) -> list[int]:
    """The values the arguments alias; with ``aliasing``, some twice (aliasing arguments)."""
    values = [pick(draw, outer)]
    for _ in range(draw(st.integers(0, 2))):
        if aliasing and draw(st.booleans()):
            values.append(draw(st.sampled_from(values)))
        else:
            values.append(pick(draw, outer))
    return values


class _Body:
    """The lines of a region's body, drawn one operation at a time."""

    def __init__(self, program: Region, local: Scope) -> None:
        self.program = program
        self.draw = program.draw
        self.local = local
        self.n_arguments = len(local.names)
        self.lines: list[str] = []
        self.result: int | None = None  # the last value the body computed
        self.last_state: int | None = None  # the outer value the body last wrote

    def step(self) -> None:
        """Draw one operation of a kind the program allows."""
        kinds = ["compute"]
        if self.program.kinds & {"outside", "reached"} or self.last_state is not None:
            kinds.append("outside")
        if self.program.writes:
            kinds.extend(kind for kind in ("inplace", "state") if kind in self.program.kinds)
        stateful = [k for k in STATEFUL_KINDS if k in self.program.kinds]
        if not self.program.writes and "norm" in stateful:
            stateful.remove("norm")  # BatchNorm writes its running statistics in place
        kind = self.draw(st.sampled_from([*kinds, *stateful]))
        if kind in STATEFUL_KINDS:
            self.stateful(kind)
        else:
            getattr(self, kind)()

    def stateful(self, kind: str) -> None:
        """A step over state kept in Python objects.

        See NOTE [State a region keeps in Python objects] in stateful.py.
        """
        name = f"h{len(self.local.names) - self.n_arguments}"
        lines, dummy, requires_grad = stateful_step(self.program, kind, self.local, name)
        self.lines.extend(lines)
        self.result = self.local.add(name, dummy, requires_grad, computed=True)

    def compute(self) -> None:
        """An op of the region's own values."""
        self._add(*compute(self.draw, self.local))

    def outside(self) -> None:
        """An op of a region value and a view, made here, of a value outside the arguments."""
        draw, local, outer = self.draw, self.local, self.program.scope
        index = pick(draw, local)
        x, dummy = alias(draw, local.names[index], local.dummies[index])
        read = self.last_state  # read back the state just written
        if read is None or (self.program.kinds & {"outside", "reached"} and draw(st.booleans())):
            read = pick(draw, outer)
        self.program.outside_reads.append(read)
        source = outer.names[read]
        if "reached" in self.program.kinds and draw(st.booleans()):
            source = reach(self.program, read)
        y, other = alias(draw, source, outer.dummies[read])
        expr, result = binary(draw, x, dummy, y, other)
        self._add(expr, result, local.requires_grad[index] or outer.requires_grad[read])

    def inplace(self) -> None:
        """An in-place write to an argument or an intermediate of the region."""
        draw, local = self.draw, self.local
        index = pick(draw, local)
        recorded = local.computed[index] and draw(st.booleans())
        target, _ = alias(
            draw, local.names[index], local.dummies[index], for_recorded_write=recorded
        )
        self._write(write(draw, target, recorded=recorded), recorded=recorded)

    def state(self) -> None:
        """An in-place write, under ``no_grad``, to outer state (a value needing no gradient)."""
        draw, outer, local = self.draw, self.program.scope, self.local
        candidates = [i for i, flag in enumerate(outer.requires_grad) if not flag]
        index = draw(st.sampled_from(candidates))
        computed = [i for i, flag in enumerate(local.computed) if flag]
        read = len(computed) > 0 and draw(st.booleans())
        if read:  # an EMA: read beside a value of the region (and saved), before its update
            operand = draw(st.sampled_from(computed))
            y, other = alias(draw, outer.names[index], outer.dummies[index])
            name = local.names[operand]
            expr, result = binary(draw, name, local.dummies[operand], y, other)
            self._add(expr, result, local.requires_grad[operand])
        target, _ = alias(draw, outer.names[index], outer.dummies[index])
        self._write(write(draw, target, recorded=False), recorded=False)
        if read and draw(st.booleans()):
            # The op's result saved (``sin``), written in place, then read by an op saving it
            # again (so that recomputation goes past the write): the first recomputation meets
            # the write and runs again, and must read the state as at the call once more.
            made = len(local.names) - 1
            self._add(f"torch.sin({local.names[made]})", result, local.requires_grad[made])
            recorded = local.requires_grad[made] and draw(st.booleans())
            self._write(write(draw, local.names[made], recorded=recorded), recorded=recorded)
            self._add(*_product(local, len(local.names) - 1, made))
        self.last_state = index
        self.program.writes_state = True

    def _write(self, line: str, *, recorded: bool) -> None:
        self.lines.extend([line] if recorded else ["with torch.no_grad():", f"    {line}"])

    def _add(self, expr: str, dummy: torch.Tensor, requires_grad: bool) -> None:
        name = f"h{len(self.local.names) - self.n_arguments}"
        self.lines.append(f"{name} = {expr}")
        self.result = self.local.add(name, dummy, requires_grad, computed=True)


def _product(local: Scope, a: int, b: int) -> tuple[str, torch.Tensor, bool]:
    """``a * b`` of two of ``local``'s values (``b`` summed where the shapes do not broadcast)."""
    first, second = local.dummies[a], local.dummies[b]
    grad = local.requires_grad[a] or local.requires_grad[b]
    try:
        return f"{local.names[a]} * {local.names[b]}", first * second, grad
    except RuntimeError:  # shapes that do not broadcast
        return f"{local.names[a]} * {local.names[b]}.sum()", first.clone(), grad


def policy_source(draw: st.DrawFn) -> list[str]:
    """The module-level lines defining ``contexts``, the random selective policy's context_fn."""
    choices = draw(st.lists(st.sampled_from(POLICY_CHOICES), min_size=1, max_size=3, unique=True))
    salt = draw(st.integers(0, 6))
    allow = draw(st.booleans())
    listed = ", ".join(f"CheckpointPolicy.{choice}" for choice in choices)
    return [
        f"CHOICES = [{listed}]",
        "",
        "",
        "def policy(ctx, op, *args, **kwargs):",
        "    # A random choice per op, the same for every call of the op.",
        f"    return CHOICES[(sum(map(ord, str(op))) + {salt}) % len(CHOICES)]",
        "",
        "",
        "def contexts():",
        "    return create_selective_checkpoint_contexts(",
        f"        policy, allow_cache_entry_mutation={allow}",
        "    )",
    ]
