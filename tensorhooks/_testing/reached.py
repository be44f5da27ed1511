"""State a region reaches through containers, and its changes between forward and backward.

See NOTE [Reached, replaced, stepped].
"""

from __future__ import annotations

from typing import Protocol

from hypothesis import strategies as st

from .drawing import Scope

__all__ = ["CONTAINERS", "OPTIMIZERS", "Reaching", "change", "reach"]

# NOTE [Reached, replaced, stepped]
#
# With the region kind "reached", a region reads a value of the program not only by its name in
# the closure but through each kind of holder a model keeps state in: a list, a tuple, a dict,
# a plain object's attribute, a global, a module's buffer, a module inside a ModuleDict (each of
# CONTAINERS). Between the forward pass and backward the program then changes what the region
# read in each way a training loop does: it binds the holder's slot (or the closure variable) to
# a new tensor, swaps the tensor's data (``t.data = ...``), or steps an optimizer over a leaf
# with each implementation of OPTIMIZERS (the fused one writes without moving the version
# counter). Plain autograd keeps what the forward pass read; a checkpoint must give its answer
# or raise.

CONTAINERS = ("list", "tuple", "dict", "object", "global", "module", "moduledict")
OPTIMIZERS = {
    "for-loop": "foreach=False",
    "foreach": "foreach=True",
    "fused": "fused=True",
}

# (the lines that make the holder, the expression reading the value, the line binding a new one)
_HOLDERS = {
    "list": (["{box} = [{value}]"], "{box}[0]", "{box}[0] = {new}"),
    "tuple": (["{box} = ({value},)"], "{box}[0]", "{box} = ({new},)"),
    "dict": (["{box} = {{'t': {value}}}"], "{box}['t']", "{box}['t'] = {new}"),
    "object": (["{box} = types.SimpleNamespace(t={value})"], "{box}.t", "{box}.t = {new}"),
    "global": (["globals()['{box}'] = {value}"], "{box}", "globals()['{box}'] = {new}"),
    "module": (
        ["{box} = torch.nn.Module()", "{box}.register_buffer('t', {value})"],
        "{box}.t",
        "{box}.t = {new}",
    ),
    "moduledict": (
        [
            "{box} = torch.nn.ModuleDict({{'m': torch.nn.Module()}})",
            "{box}['m'].register_buffer('t', {value})",
        ],
        "{box}['m'].t",
        "{box}['m']._buffers['t'] = {new}",
    ),
}


class Reaching(Protocol):
    """What reaching values and changing them needs of the program being drawn."""

    draw: st.DrawFn
    scope: Scope
    lines: list[str]
    n_leaves: int
    rebinds: list[tuple[str, int]]  # the line binding a new tensor, and the value it replaces


def reach(program: Reaching, index: int) -> str:
    """An expression reading value ``index`` through a drawn holder, made just before."""
    name = program.scope.names[index]
    kind = program.draw(st.sampled_from(("closure", *CONTAINERS)))
    if kind == "closure":
        program.rebinds.append((f"{name} = {{new}}", index))
        return name
    box = f"box{len(program.rebinds)}"
    make, read, rebind = _HOLDERS[kind]
    program.lines.extend(line.format(box=box, value=name) for line in make)
    program.rebinds.append((rebind.replace("{box}", box), index))
    return read.format(box=box)


def change(program: Reaching) -> None:
    """One change between a region's forward pass and backward: rebind, swap data, or step."""
    draw = program.draw
    kinds = ["step"] + (["rebind", "data"] if program.rebinds else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "step":
        leaf = f"leaf{draw(st.integers(0, program.n_leaves - 1))}"
        options = OPTIMIZERS[draw(st.sampled_from(sorted(OPTIMIZERS)))]
        program.lines.extend(
            [
                f"{leaf}.grad = torch.ones_like({leaf})",
                f"torch.optim.Adam([{leaf}], lr=0.25, {options}).step()",
                f"{leaf}.grad = None",
            ]
        )
        return
    line, index = draw(st.sampled_from(program.rebinds))
    name = program.scope.names[index]
    grad = program.scope.requires_grad[index]
    new = f"({name}.detach() * 0.5 + 0.25).requires_grad_({grad})"
    if kind == "data":
        program.lines.append(f"{name}.data = {new}")
    else:
        program.lines.append(line.format(new=new))
