"""What a region read from outside its arguments, found by structure; recomputation held to it.

See NOTE [What a region read].
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.autograd.graph import Node

from tensorhooks._core.errors import SavedTensorModifiedError
from tensorhooks._core.guards import PackHook, UnpackHook, modified_message
from tensorhooks._core.moves import moves
from tensorhooks._core.torch_compat import below_python_modes, sequence_nr, storage_key

from .messages import (
    changed_message,
    describe,
    not_written_message,
    replaced_message,
    saved_then_written_message,
)
from .state import tracked_form

__all__ = [
    "GraphReads",
    "RecomputedReads",
    "describe",
    "not_written_message",
    "replaced_message",
    "tensors_in",
    "unpacked",
    "watch_optimizer_steps",
]

# NOTE [What a region read]
#
# Recomputation must read what the forward pass read. Three records tell what that was, each
# read off a structure autograd builds anyway, none by walking what the function might reach:
#   - the *inputs*, saved the way a node saves its inputs (arguments.py);
#   - the *region's part of the graph*: when the forward pass ends, the graph is walked down from
#     every tensor the region returned (however nested: lists, tuples, dicts, dataclasses) to
#     where it enters the region: the nodes of its inputs, the leaves (every parameter and every
#     tensor requiring grad it read, saved or not: a bias), and the nodes of tensors made before
#     it (an activation read through a closure). The forward pass is one call on the calling
#     thread, and the region's nodes are the ones that thread made during that call: their
#     numbers lie between the thread's counter before the call and after it. That is the only
#     place a node number is read; recomputation may run on any thread (CUDA's engine runs device
#     nodes on a worker thread of its own) and never compares numbers: the graph it builds ends
#     where it meets the nodes recorded here, or the inputs it was given;
#   - the *saved positions*: each tensor the forward pass saved that comes from outside the
#     region (a leaf requiring grad, or the base of a view of one: ``nn.Linear`` saves
#     ``weight.t()``; or a tensor requiring no grad that the region found bound at the call:
#     state.py) is recorded by its position among the saves; at that position recomputation must
#     save from the same tensor, so two layers swapped, or a weight exchanged with another, are
#     told apart although each tensor is one the forward pass read somewhere.
# Each leaf so recorded is watched: its version and storage (``param.data = ...`` swaps the
# storage and moves no version; a feature that swaps it for an equal copy, as
# `offload_parameters` does, counts the swap: _core/moves.py) must be those the forward pass left,
# or backward raises `SavedTensorModifiedError` before anything recomputed is used (inside
# ``allow_mutation_on_saved_tensors``, the value the forward pass left is read instead).
# Recomputation's own writes to a weight (``nn.Embedding(max_norm=...)`` renormalises it again)
# are its own: the versions watched are those recomputation leaves.
#
# A leaf recomputation read that the forward pass did not, or a different tensor at a saved
# position, may be one recomputation made itself (``torch.ones(3, requires_grad=True)`` inside
# the function): such a tensor is referenced only by the recomputation and is dead once it ends,
# while a tensor read from outside is alive, held by a module, a closure, a global. So a
# mismatch is held weakly and reported only if its tensor outlives the recomputation.
#
# Fused optimizers (``torch.optim.Adam(fused=True)`` and the others with a ``fused`` option)
# write the parameters without moving their version counters, which no version check can see.
# A global post-step hook of torch.optim moves the versions of the parameters a fused step wrote,
# as the for-loop and foreach implementations do. Installed when tensorhooks is imported.


def tensors_in(value: object) -> list[torch.Tensor]:
    """The tensors in what a region returned: in lists, tuples, dicts and dataclasses, any depth."""
    if isinstance(value, torch.Tensor):
        return [value]
    found: list[torch.Tensor] = []
    _collect(value, found, 0)
    return found


_MAX_NESTING = 32


def _collect(value: object, found: list[torch.Tensor], depth: int) -> None:
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif depth >= _MAX_NESTING:
        return
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, found, depth + 1)
    elif isinstance(value, dict):
        for item in value.values():
            _collect(item, found, depth + 1)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            _collect(getattr(value, field.name, None), found, depth + 1)


_UNPACKED = "_tensorhooks_unpacked"


def unpacked(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """A recomputation's unpacked inputs, the new leaves among them marked as recomputation's.

    An input saved through hooks comes back as a new leaf (a copy, or a detached alias) where it
    was one. A recomputation nested in this one, or a gradient with ``create_graph=True``
    through it, may keep it alive past the recomputation: it is still never a tensor read from
    outside, and the mark says so to every check that meets it.
    """
    for tensor in inputs:
        if tensor.is_leaf and tensor.requires_grad:
            tensor.__dict__[_UNPACKED] = True
    return inputs


def _accumulate_grad_class() -> type:
    """The class of autograd's leaf accumulators (not importable from Python by name)."""
    node = torch.ones(1, requires_grad=True).sum().grad_fn
    assert node is not None
    return type(node.next_functions[0][0])


_ACCUMULATE_GRAD = _accumulate_grad_class()


def _leaf_of(accumulator: Node) -> torch.Tensor:
    """The leaf an accumulator node accumulates into."""
    leaf: torch.Tensor = accumulator.variable  # type: ignore[attr-defined]  # AccumulateGrad's
    return leaf


class _Leaf:
    """A leaf the region's graph reads, with what the forward pass left of it."""

    __slots__ = ("handle", "storage", "swaps", "tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.version = tensor._version
        # A weight left empty by the forward pass is gathered for each use and released after
        # (ZeRO-3's hooks swap ``p.data``): what recomputation reads is what those hooks gather
        # then, and its storage before backward says nothing.
        self.storage = storage_key(tensor) if tensor.numel() else None
        self.swaps = moves(tensor)
        self.handle: Any = None


_Namer = Callable[[torch.Tensor], str]


class _Saved:
    """A tensor from outside the region saved at one position, held as a node holds it."""

    __slots__ = ("at_end", "by_value", "storage", "swaps", "tensor", "version")

    def __init__(self, tensor: torch.Tensor, version: int, *, by_value: bool) -> None:
        self.tensor = tensor
        self.version = version  # when saved
        self.at_end = tensor._version  # when the forward pass ended
        self.by_value = by_value  # requires no grad: an equal tensor in its place will do
        # ``tensor.data = ...`` swaps the storage, moving no version (a leaf's is watched as such)
        self.storage = storage_key(tensor) if by_value else None
        self.swaps = moves(tensor) if by_value else 0


class GraphReads:
    """The region's part of the graph, where it enters: leaves and older nodes.

    See NOTE [What a region read].
    """

    __slots__ = (
        "handles",
        "inputs",
        "leaves",
        "outer",
        "positions",
        "written_after_save",
        "written_arguments",
        "written_inputs",
    )

    def __init__(self, inputs: Sequence[torch.Tensor]) -> None:
        # Where the region's graph starts from its inputs, read when the call starts: each
        # input's node then (an input changed in place inside the region gets a node of the
        # region's, which must not be held: it holds the region), or the input itself if a leaf.
        self.inputs: dict[int, object] = {}
        for tensor in inputs:
            for entry in (tensor, tensor._base):
                if entry is None:
                    continue
                if entry.grad_fn is not None:
                    self.inputs[id(entry.grad_fn)] = entry.grad_fn
                elif entry.is_leaf:
                    self.inputs[id(entry)] = entry
        self.leaves: dict[int, _Leaf] = {}
        self.outer: dict[int, Node] = {}
        self.positions: dict[int, _Saved] = {}
        # Leaves the region saved and then changed in place: plain autograd raises at backward.
        self.written_after_save: list[tuple[torch.Tensor, int]] = []
        # Inside allow_mutation_on_saved_tensors: what the context keeps of each tensor watched.
        self.handles: list[tuple[torch.Tensor, Any]] = []
        # The storages of the inputs the region wrote, with their versions at the call.
        self.written_inputs: dict[int | None, int] = {}
        self.written_arguments: set[int] = set()

    def inputs_written(self, changed: list[tuple[torch.Tensor, int]]) -> None:
        """The forward pass wrote these inputs in place.

        A leaf on their storage that the function also reads otherwise than through them (a
        weight whose row it was given) saw two values, which recomputation cannot give both.
        """
        self.written_inputs = {storage_key(tensor): version for tensor, version in changed}
        self.written_arguments = {id(tensor) for tensor, _ in changed}

    def walk(self, outputs: list[torch.Tensor], start: int, end: int) -> None:
        """At the end of the forward pass: record where its graph enters the region."""
        self._walk([t.grad_fn for t in outputs if t.grad_fn is not None], start, end)

    def _walk(self, roots: list[Node], start: int, end: int) -> None:
        inputs, leaves, outer = self.inputs, self.leaves, self.outer
        accumulator = _ACCUMULATE_GRAD
        stack = [root for root in roots if id(root) not in inputs and start <= sequence_nr(root)]
        # Every node met is held: torch 2.11 makes a new Python object for a node at each
        # `next_functions` read, and a freed one's id would be taken by the next.
        seen = {id(node): node for node in stack}
        while stack:
            for following, _ in stack.pop().next_functions:
                if following is None:
                    continue
                key = id(following)
                if key in seen:
                    continue
                seen[key] = following
                if type(following) is accumulator:
                    # An input that is a leaf too: the function may also read it by name.
                    leaf = _leaf_of(following)
                    leaves[id(leaf)] = _Leaf(leaf)
                elif key in inputs:
                    continue
                elif start <= sequence_nr(following) < end:
                    stack.append(following)
                else:
                    outer[key] = following

    def swapped_by_the_region(self, at_call: dict[int, int | None]) -> None:
        """Leaves whose data the forward pass swapped are not held to their storage.

        ``at_call``: the storage of each leaf found by name when the call started. Recomputation
        swaps it again (a gather, a renormalisation), so what it reads does not depend on the
        storage the leaf has before backward.
        """
        for key, leaf in self.leaves.items():
            storage = at_call.get(key, leaf.storage)
            if storage != leaf.storage:
                leaf.storage = None

    def note_saved(self, index: int, base: torch.Tensor, version: int, outputs: set[int]) -> None:
        """The forward pass saved ``base`` (at ``version``) at ``index``: note it if from outside.

        What outlived the forward pass and the region did not make (a leaf, an older activation
        or an input, or a tensor requiring no grad that the region did not return) is held, as
        the node that saved it would hold it in plain autograd.
        """
        key = id(base)
        if key in self.leaves:
            self.positions[index] = _Saved(base, version, by_value=False)
            if base._version != version:
                self.written_after_save.append((base, version))
        elif key in outputs:
            return
        elif base.requires_grad:
            node = base.grad_fn
            if node is not None and (id(node) in self.outer or id(node) in self.inputs):
                self.positions[index] = _Saved(base, version, by_value=False)
        else:
            self.positions[index] = _Saved(base, version, by_value=True)

    def _watched(self) -> dict[int, torch.Tensor]:
        watched = {key: leaf.tensor for key, leaf in self.leaves.items()}
        watched.update((id(saved.tensor), saved.tensor) for saved in self.positions.values())
        return watched

    def watch(self, pair: tuple[PackHook, UnpackHook] | None) -> None:
        """Inside ``allow_mutation_on_saved_tensors``: let the context keep what was read."""
        if pair is None:
            return
        with below_python_modes():
            self.handles = [
                (tensor, pair[0](tracked_form(tensor))) for tensor in self._watched().values()
            ]

    def values(
        self,
        pair: tuple[PackHook, UnpackHook] | None,
        namer: _Namer,
        found: Callable[[torch.Tensor], str | None],
    ) -> list[tuple[torch.Tensor, Any]]:
        """Before recomputation: the tensors it must read in place of their present value.

        Raises:
            SavedTensorModifiedError: if a leaf was changed in place, or its data swapped, since
                the forward pass (outside ``allow_mutation_on_saved_tensors``).
        """
        for leaf in self.leaves.values():
            tensor = leaf.tensor
            swapped = leaf.storage is not None and storage_key(tensor) != leaf.storage
            if swapped and moves(tensor) == leaf.swaps:
                raise SavedTensorModifiedError(not_written_message(namer(tensor)))
            if (
                leaf.storage in self.written_inputs
                and id(tensor) not in self.written_arguments
                and found(tensor) is not None
            ):
                raise SavedTensorModifiedError(
                    modified_message(
                        tensor.type(),
                        list(tensor.shape),
                        tensor._version,
                        self.written_inputs[leaf.storage],
                    )
                    + f" Hint: the checkpointed function writes an argument in place that shares "
                    f"its storage with {namer(tensor)}, which it also reads from outside its "
                    "arguments, so recomputation cannot read what the forward pass read. Pass "
                    f"{namer(tensor)} itself as the argument, or write to a copy of the argument."
                )
        if pair is not None:
            kept = []
            for tensor, handle in self.handles:
                value = pair[1](handle)
                if storage_key(value) != storage_key(tensor):
                    kept.append((tensor, value))
            return kept
        if self.written_after_save:
            tensor, version = self.written_after_save[0]
            raise SavedTensorModifiedError(
                saved_then_written_message(tensor, version, namer(tensor))
            )
        for leaf in self.leaves.values():
            tensor = leaf.tensor
            if tensor._version != leaf.version:
                raise SavedTensorModifiedError(
                    changed_message(tensor, leaf.version, f"reads {namer(tensor)}")
                )
        return []

    def check_saved(self, substituted: set[int | None], namer: _Namer) -> None:
        """Before recomputation: a tensor saved from outside must be as it was when saved.

        Raises:
            SavedTensorModifiedError: if one was changed in place since (plain autograd, which
                holds what it saved, raises too), unless recomputation reads a kept value.
        """
        leaves = self.leaves
        for saved in self.positions.values():
            tensor = saved.tensor
            if id(tensor) in leaves:
                continue  # checked as a leaf (and, written after saving, as such)
            swapped = saved.by_value and storage_key(tensor) != saved.storage
            if swapped and moves(tensor) == saved.swaps:
                raise SavedTensorModifiedError(not_written_message(namer(tensor)))
            if tensor._version == saved.version or storage_key(tensor) in substituted:
                continue
            if saved.at_end != saved.version:  # written by the region itself, after the save
                message = saved_then_written_message(tensor, saved.version, namer(tensor))
            else:
                message = changed_message(
                    tensor, saved.version, f"saved {namer(tensor)}, which it reads"
                )
            raise SavedTensorModifiedError(message)

    def recomputed(self) -> None:
        """After a recomputation: its own writes to the leaves (a renormalisation) are its own."""
        for leaf in self.leaves.values():
            leaf.version = leaf.tensor._version


class RecomputedReads:
    """One recomputation's reads, checked against what the forward pass read."""

    __slots__ = ("_entries", "_expected", "_known", "_mismatches", "_roots")

    def __init__(self, graph: GraphReads, inputs: Sequence[torch.Tensor]) -> None:
        self._expected = graph.positions
        self._known = graph.leaves
        # Where recomputation's graph meets the forward pass's: the nodes the forward pass's
        # graph entered by, and the inputs recomputation was given (unpacked: new objects whose
        # graph leads to the inputs' own nodes and accumulators).
        self._entries: dict[int, object] = dict(graph.outer)
        self._entries.update(graph.inputs)
        for tensor in inputs:
            self._enter(tensor)
            base = tensor._base
            if base is not None:
                self._enter(base)
                # Inputs laid out again on a copy of their storage (arguments.py): the copy's
                # graph is a clone of a leaf made for it, before recomputation started.
                if base.grad_fn is not None:
                    for following, _ in base.grad_fn.next_functions:
                        if following is not None and type(following) is _ACCUMULATE_GRAD:
                            self._enter(_leaf_of(following))
        self._roots: list[torch.Tensor] = []  # what recomputation saved, with a graph
        self._mismatches: list[tuple[str, weakref.ref[torch.Tensor], torch.Tensor | None]] = []

    def _enter(self, tensor: torch.Tensor) -> None:
        self._entries[id(tensor)] = tensor
        if tensor.grad_fn is not None:
            self._entries[id(tensor.grad_fn)] = tensor.grad_fn

    def saved(self, index: int, tensor: torch.Tensor) -> None:
        """Recomputation saved ``tensor`` at position ``index``: note what it was read from."""
        if tensor.grad_fn is not None:
            # The tensor, not its node: on torch 2.11 a custom Function's node object does not
            # keep its graph alive, and asking it anything once the graph died raises.
            self._roots.append(tensor)
        saved = self._expected.get(index)
        if saved is None:
            return
        base = tensor if tensor._base is None else tensor._base
        before = saved.tensor
        if id(base) in self._entries:
            return
        if base is before:
            # ``view.data = ...`` on a view between the two leaves its base as it was: the
            # storage the recomputation read tells.
            if not saved.by_value or storage_key(tensor) == saved.storage:
                return
        elif saved.by_value and _equal(base, before):
            return  # made again by recomputation (a mask built each call): the same values
        self._mismatches.append(
            (f"the tensor saved at position {index}", weakref.ref(base), before)
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

    def _unknown_leaves(self) -> Iterator[tuple[str, weakref.ref[torch.Tensor], None]]:
        """The leaves of recomputation's graph the forward pass did not read, held weakly."""
        known, entries = self._known, self._entries
        accumulator = _ACCUMULATE_GRAD
        stack: list[Node] = [
            node
            for root in self._roots
            if (node := root.grad_fn) is not None and id(node) not in entries
        ]
        seen: dict[int, Node] = {id(node): node for node in stack}
        while stack:
            for following, _ in stack.pop().next_functions:
                if following is None:
                    continue
                key = id(following)
                if key in seen or key in entries:
                    continue
                seen[key] = following
                if type(following) is not accumulator:
                    stack.append(following)
                    continue
                leaf = _leaf_of(following)
                record = known.get(id(leaf))
                unknown = record is None or record.tensor is not leaf
                if unknown and id(leaf) not in entries and _UNPACKED not in leaf.__dict__:
                    yield ("a tensor requiring grad", weakref.ref(leaf), None)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    with below_python_modes():
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


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
