"""What a region reads from outside its arguments, recorded as it runs, checked in recomputation.

See NOTE [Reads recorded as the region runs].
"""

from __future__ import annotations

import gc
import sys
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.autograd.graph import Node

from tensorhooks._core.errors import SavedTensorModifiedError
from tensorhooks._core.torch_compat import next_sequence_nr, sequence_nr

__all__ = [
    "RecomputedReads",
    "describe",
    "graph_leaves",
    "not_written_message",
    "replaced_message",
    "watch_optimizer_steps",
]

# NOTE [Reads recorded as the region runs]
#
# Walking what the function holds (its closure, defaults, ``self``) finds the state it reaches
# by the usual ways, and each container it does not walk (a dict, a global, a plain object's
# attribute) or each rebinding (``module.weight = nn.Parameter(...)``, a closure variable bound
# to a new tensor) would be a new hole. So what the region read is also recorded as it runs, and
# recomputation is held to the same reads, whatever way the function reached them:
#   - each tensor the forward pass saves from outside the region (or the base of a view of one:
#     ``nn.Linear`` saves ``weight.t()``) is recorded by its position among the saves; at that
#     position recomputation must save from the same tensor object;
#   - each leaf the region's part of the autograd graph reaches (every parameter and every
#     tensor requiring grad that the region read, saved or not: a bias) is recorded from the
#     graph when the forward pass ends; the leaves of the graph recomputation builds must be
#     among them, or be its own inputs.
# Every tensor so recorded is then watched like the state found by the walk: its version and its
# storage (``param.data = ...`` swaps the storage and moves no version; a feature that swaps it
# for an equal copy, as `offload_parameters` does, counts the swap: _core/moves.py) must be
# those of the forward pass, or recomputation reads the value the forward pass read (inside
# ``allow_mutation_on_saved_tensors``), or it raises before backward uses anything recomputed.
# Tensors that require no grad and that the walk found are also held to their slot: the module
# attribute or the name where the forward pass left them must hold the same tensor.
#
# A tensor recomputation read that the forward pass did not may be one that the recomputation
# made itself (a leaf created inside the function, ``torch.ones(3, requires_grad=True)``): such
# a tensor is referenced only by the recomputation, and is dead once it ends, while a tensor
# read from outside is alive (something outside holds it: a module, a closure, a global). So a
# mismatch is kept weakly and reported only if its tensor outlives the recomputation.
#
# Fused optimizers (``torch.optim.Adam(fused=True)`` and the others with a ``fused`` option)
# write the parameters without moving their version counters, which no version check can see.
# A global post-step hook of torch.optim moves the versions of the parameters a fused step wrote,
# as the for-loop and foreach implementations do. Installed when tensorhooks is imported.
#
# Not recorded: a tensor that requires no grad, is not saved, and lies deeper than the walk looks
# (the walk also follows dicts, plain objects and the globals the code names, a few levels
# down). Its value reaches backward only through the tensors recomputed from it; see the
# Limits section of docs/checkpoint.md.


def describe(tensor: torch.Tensor) -> str:
    """A tensor named by its kind and shape, for a message."""
    kind = "a Parameter" if isinstance(tensor, torch.nn.Parameter) else "a tensor"
    return f"{kind} of shape {list(tensor.shape)}"


def graph_leaves(roots: Iterable[Node | None], start: int) -> list[torch.Tensor]:
    """The leaves (tensors requiring grad) read by the nodes numbered ``start`` or later.

    Walks down from ``roots`` through those nodes only: older nodes belong to tensors made
    before the region, whose own graph is not the region's business. It runs twice per region
    call (forward pass and recomputation), so it asks each node's class, not its attributes.
    """
    found: list[torch.Tensor] = []
    stack = [root for root in roots if root is not None and sequence_nr(root) >= start]
    # Keyed by id, holding the node objects: torch 2.11 makes a new Python object for a node at
    # each `next_functions` read, and a freed one's id would be taken by the next.
    seen = {id(node): node for node in stack}
    while stack:
        for following, _ in stack.pop().next_functions:
            if following is None or id(following) in seen:
                continue
            seen[id(following)] = following
            if type(following) is _ACCUMULATE_GRAD:
                found.append(following.variable)  # type: ignore[attr-defined]  # its leaf
            elif sequence_nr(following) >= start:
                stack.append(following)
    return found


def _accumulate_grad_class() -> type:
    """The class of autograd's leaf accumulators (not importable from Python by name)."""
    node = torch.ones(1, requires_grad=True).sum().grad_fn
    assert node is not None
    return type(node.next_functions[0][0])


_ACCUMULATE_GRAD = _accumulate_grad_class()


class RecomputedReads:
    """One recomputation's reads, checked against what the forward pass read."""

    __slots__ = ("_expected", "_inputs", "_known", "_mismatches", "_roots", "_start")

    def __init__(
        self,
        expected: dict[int, weakref.ref[torch.Tensor]],
        known: dict[int, torch.Tensor],
        inputs: Sequence[torch.Tensor],
    ) -> None:
        self._expected = expected  # position of a save -> the outside tensor saved there
        self._known = known  # ids of the outside tensors the forward pass read
        self._inputs = {id(tensor) for tensor in inputs}
        self._inputs.update(id(tensor._base) for tensor in inputs if tensor._base is not None)
        self._roots: list[torch.Tensor] = []  # what recomputation saved, with a graph
        self._mismatches: list[tuple[str, weakref.ref[torch.Tensor], torch.Tensor | None]] = []
        self._start = next_sequence_nr()

    def saved(self, index: int, tensor: torch.Tensor) -> None:
        """Recomputation saved ``tensor`` at position ``index``: note what it was read from."""
        if tensor.grad_fn is not None:
            # The tensor, not its node: on torch 2.11 a custom Function's node object does not
            # keep its graph alive, and asking it anything once the graph died raises.
            self._roots.append(tensor)
        ref = self._expected.get(index)
        if ref is None:
            return
        base = tensor if tensor._base is None else tensor._base
        if base is not ref() and id(base) not in self._inputs:
            self._mismatches.append(
                (f"the tensor saved at position {index}", weakref.ref(base), ref())
            )

    def check(self) -> None:
        """After the recomputation: raise if it read a tensor the forward pass did not.

        Raises:
            SavedTensorModifiedError: if recomputation read a tensor other than the one the
                forward pass read (replaced or rebound between the forward pass and backward).
        """
        self._mismatches.extend(self._unknown_leaves())
        self._roots = []  # drop the recomputation's graph: what only it made dies here
        if any(ref() is not None for _, ref, _ in self._mismatches):
            gc.collect()  # a cycle may hold what recomputation made; rare, so collect and see
        for what, ref, before in self._mismatches:
            now = ref()
            if now is not None:  # alive: held from outside, so read from outside
                raise SavedTensorModifiedError(replaced_message(what, now, before))

    def _unknown_leaves(self) -> list[tuple[str, weakref.ref[torch.Tensor], None]]:
        """The leaves of recomputation's graph the forward pass did not read, held weakly."""
        return [
            ("a tensor requiring grad", weakref.ref(leaf), None)
            for leaf in graph_leaves([root.grad_fn for root in self._roots], self._start)
            if self._known.get(id(leaf)) is not leaf and id(leaf) not in self._inputs
        ]


def replaced_message(what: str, now: torch.Tensor, before: torch.Tensor | None) -> str:
    """The error for a tensor read in recomputation in place of the one the forward pass read."""
    was = "" if before is None else f" where the forward pass read {describe(before)}"
    return (
        "tensorhooks.checkpoint: recomputation read a different tensor than the forward pass: "
        f"{what} came from {describe(now)}{was}, so the recomputed values, and the gradient, "
        "would differ from plain autograd's. Something the checkpointed function reads from "
        "outside its arguments was replaced between the forward pass and backward "
        "(module.weight = nn.Parameter(...), a reassigned buffer or closure variable, a module "
        "swapped in a dict or a global). Replace it after backward, or pass it to checkpoint "
        "as an argument."
    )


def not_written_message(name: str) -> str:
    """The error for a watched tensor whose storage was swapped (``.data = ...``)."""
    return (
        f"tensorhooks.checkpoint: the data of {name}, which the checkpointed function reads "
        "from outside its arguments, was replaced between the forward pass and backward "
        "(tensor.data = ..., or set_ under no_grad), so recomputation would read other values "
        "than the forward pass did. Replace it after backward, or pass it to checkpoint as an "
        "argument."
    )


_installed = threading.Lock()
_handle: list[Any] = []


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Move the versions of the parameters a fused step wrote, as the other steps do."""
    if torch.compiler.is_compiling():
        return
    written = [
        parameter
        for group in optimizer.param_groups
        if group.get("fused")
        for parameter in group["params"]
        if parameter.grad is not None
    ]
    if written:
        torch.autograd.graph.increment_version(written)


def watch_optimizer_steps() -> None:
    """Install, once, the post-step hook that makes fused steps visible to version checks.

    ``import torch`` imports torch.optim's optimizer module; were a build not to, no optimizer
    could exist yet, and each region's start tries again (one check of a list once installed).
    """
    if _handle or _OPTIMIZER not in sys.modules:
        return
    with _installed:
        if not _handle:
            hooks = sys.modules[_OPTIMIZER]
            _handle.append(hooks.register_optimizer_step_post_hook(_after_step))


_OPTIMIZER = "torch.optim.optimizer"
