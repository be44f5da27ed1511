"""State a region reaches outside its arguments: the modules it calls, its function's own slots.

See NOTE [State a region reaches].
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.parameter import is_lazy
from torch.utils.checkpoint import CheckpointError

from tensorhooks._core.errors import SavedTensorModifiedError
from tensorhooks._core.guards import PackHook, UnpackHook, modified_message
from tensorhooks._core.moves import moves
from tensorhooks._core.torch_compat import below_python_modes, storage_key

from .bindings import (
    MAX_ITEMS,
    RESTORABLE,
    Called,
    Mode,
    Rebinding,
    Slot,
    class_slots,
    function_slots,
    is_torchs,
    owning_module,
    slot_items,
    submodules,
)
from .messages import changed_message, describe

__all__ = ["CallWatch", "ReachedState", "tracked_form"]

# NOTE [State a region reaches]
#
# Recomputation runs the function again, and reads again whatever it reaches besides its
# arguments. It must read what the forward pass read, and leave behind what the forward pass
# left. The tensors that require grad among those reads are recorded by the graph, the tensors
# saved from outside by their positions (NOTE [What a region read] in reads.py); what the
# function reaches by name, and what it writes, is recorded here when the region starts, by
# structure (bindings.py):
#   - the module the function is, or is a method of (also through ``functools.partial``), and
#     every module under it;
#   - the function's own slots: its closure cells, the globals its code names, its defaults and
#     a partial's arguments, one level into the lists, tuples, dicts and plain objects there;
#     and the modules there, each with its children (an item of a ModuleDict, the block a
#     closure over the parent calls), not deeper: a closure over a whole model costs what one
#     level of it costs. Batch norm running deeper under such a module is found when the
#     forward pass ends, by its weights among the graph's leaves (`_norms_below`);
#   - for each module: the binding of every attribute and buffer (a shallow copy of its
#     ``__dict__`` and ``_buffers``; torch's own modules holding no buffers, only their
#     ``training`` flag), the versions of its tensors requiring no grad (buffers, plain tensor
#     attributes), and its class's tensors and its forward's names (`class_slots`).
# Parameters are not recorded here: the graph does (reads.py).
#
# What recomputation sees. It runs with every binding so recorded as it was at the call (a
# tensor, a number, a string, None or a tuple: the values code rebinds as state,
# ``self.hidden = h.detach()``, ``self.step += 1``), whoever rebound it since (the region itself,
# or the program between the forward pass and backward), and gets the present bindings back
# after: plain autograd's gradient, with the state the forward pass left. Keys the forward pass
# added (``self.mask = ...`` the first time) are absent while it recomputes. Values are never
# copied for this: what the call bound is held, as a saved tensor is, until backward.
#
# Writes. A tensor recorded here that the forward pass changed in place (a counter, a running
# mean, spectral norm's ``u``; batch norm's running statistics, which its kernels write without
# moving their version, count as written whenever the module trains with them) is read in
# recomputation through a stand-in holding its value before the write, and recomputation's own
# writes go to that stand-in (NOTE [Stand-ins for state a region wrote]). The value before the
# write is a copy taken at the call; a copy is taken the first time the regions of one code (a
# function's code object, a module's class: `code_of`) reach a tensor, and afterwards only of the
# tensors a region wrote before, so a read-only buffer or table is copied once per block type in
# the life of the program, never per call. Inside ``allow_mutation_on_saved_tensors`` the context
# keeps every recorded tensor's value instead. A tensor written with no copy (data-dependent
# control flow writing it for the first time) gets a stand-in starting from the value the
# forward pass left: writing it again harms nothing, and recomputation must not read it before
# its own write, nor after a write that does not give the same value again (a counter, unlike a
# renormalisation), or backward raises `CheckpointError` naming it; it is copied from then on.
# Batch norm found after the forward pass gets a stand-in of the statistics it left (its output
# in training does not read them).
#
# Checks. A recorded tensor the forward pass did not write, changed in place (or its data
# swapped) between the forward pass and backward, raises `SavedTensorModifiedError` naming it
# before anything recomputed is used (inside ``allow_mutation_on_saved_tensors``, the kept value
# is read instead).
#
# Cost, per region call: for each module recorded, two shallow dict copies (one flag for torch's
# own stateless modules) and the versions of its buffers; in recomputation, one comparison of
# those dicts with their copies; no tensor copied once each block has run once, but for state
# the region writes.

# Buffers that batch norm's kernels write without moving their version: in training mode
# ``native_batch_norm`` updates the running statistics although its schema declares no write.
_RUNNING_STATS = ("running_mean", "running_var")


class _Known:
    """What regions reached before (by code), and what a region wrote: by id, held weakly."""

    __slots__ = ("reached", "written")

    def __init__(self) -> None:
        self.reached: dict[tuple[int, object], weakref.ref[torch.Tensor]] = {}
        self.written: dict[int, weakref.ref[torch.Tensor]] = {}

    def first_reach(self, tensor: torch.Tensor, code: object) -> bool:
        """True the first time regions of ``code`` reach ``tensor`` (it is then remembered)."""
        key = (id(tensor), code)
        ref = self.reached.get(key)
        if ref is not None and ref() is tensor:
            return False
        self.reached[key] = weakref.ref(tensor, functools.partial(_forget, self.reached, key))
        return True

    def was_written(self, tensor: torch.Tensor) -> bool:
        ref = self.written.get(id(tensor))
        return ref is not None and ref() is tensor

    def note_written(self, tensor: torch.Tensor) -> None:
        key = id(tensor)
        self.written[key] = weakref.ref(tensor, functools.partial(_forget, self.written, key))


def _forget(table: dict[Any, Any], key: object, ref: weakref.ref[torch.Tensor]) -> None:
    if table.get(key) is ref:
        del table[key]


_known = _Known()


class _Read:
    """A tensor requiring no grad that the region reached, with what is known of its value."""

    __slots__ = (
        "at_call",
        "before",
        "handle",
        "name",
        "scratch",
        "storage",
        "swaps",
        "tensor",
        "version",
        "written",
    )

    def __init__(self, name: Callable[[], str], tensor: torch.Tensor, hidden: bool) -> None:
        self.name = name
        self.tensor = tensor
        self.at_call = self.version = tensor._version
        self.written = hidden  # batch norm's running statistics: written, whatever the version
        self.before: torch.Tensor | None = None  # its value at the call, where copied
        self.handle: Any = None  # what allow_mutation_on_saved_tensors kept of it
        # Found after the forward pass (batch norm's statistics, reached through a module the
        # function holds): recomputation writes a stand-in of the value the forward pass left.
        self.scratch = False
        self.storage: int | None = None  # recorded at seal, for the unwritten ones
        self.swaps = 0


def _tensors_of(module: torch.nn.Module) -> Iterator[tuple[Callable[[], str], torch.Tensor, bool]]:
    """The tensors requiring no grad a module holds: its buffers and tensor attributes."""
    kind = type(module)
    hidden = isinstance(module, _NormBase) and module.training and module.track_running_stats
    for key, buffer in module._buffers.items():
        if buffer is not None and not buffer.requires_grad:
            yield _attribute_name(kind, key), buffer, hidden and key in _RUNNING_STATS
    if is_torchs(kind):
        return  # torch's own modules keep tensors in buffers and parameters only
    for key, value in module.__dict__.items():
        if isinstance(value, torch.Tensor) and not value.requires_grad:
            yield _attribute_name(kind, key), value, False


def _attribute_name(kind: type, key: str) -> Callable[[], str]:
    return functools.partial(str.format, "{}.{}", kind.__name__, key)


def tracked_form(tensor: torch.Tensor) -> torch.Tensor:
    """What the save guard tracks for a recorded tensor: a weight itself, anything else detached.

    A weight (a leaf that requires grad, or a view of one) is handed over as it is: the context
    keeps the tensor before a write only for weights, and decides at the first read whether the
    write was one its author tells autograd changes nothing (FSDP2 refilling the unsharded
    parameters it freed after forward; NOTE [Writes autograd does not count] in
    `_mutation/saved_tensor.py`). A detached alias hides that it is a weight, so its clone, taken
    of the freed memory, would be final. Holding the weight costs nothing: it lives with the
    model, and its graph is at most a view of a leaf. Anything else is detached, so that its
    graph is not kept alive.
    """
    base = tensor if tensor._base is None else tensor._base
    return tensor if base.is_leaf and base.requires_grad else tensor.detach()


class CallWatch:
    """Records, when a region starts, the state it reaches by structure. See NOTE [State...]."""

    __slots__ = (
        "_called",
        "_cells",
        "_code",
        "_held",
        "_pair",
        "_read_ids",
        "_reads",
        "leaf_storages",
    )

    def __init__(
        self, function: Callable[..., Any], code: object, pair: tuple[PackHook, UnpackHook] | None
    ) -> None:
        self._pair = pair  # allow_mutation_on_saved_tensors' pack and unpack, inside it
        self._code = code  # what this region's calls share: `code_of`
        self._called: dict[int, Called | Mode] = {}
        self._reads: list[_Read] = []
        self._read_ids: set[int] = set()  # the reads hold their tensors: ids stay theirs
        self._held: list[torch.nn.Module] = []  # modules the function holds by name
        # The storage of each leaf found by name when the call started: one the forward pass
        # swapped (``p.data = ...``, a gather) is swapped again by recomputation.
        self.leaf_storages: dict[int, int | None] = {}
        self._cells: list[Slot] = []
        owner = owning_module(function)
        if owner is not None:  # the function is a module, or a method of one: all it holds
            for module in submodules(owner):
                self._call(module)
        for slot in function_slots(function):
            self._slot(slot, depth=0)

    def _slot(self, slot: Slot, *, depth: int) -> None:
        value = slot.at_call
        # A closure cell, or an item of a container it holds, is set back whatever it held (a
        # closure variable rebound is state changed); a global or a class attribute only where
        # it held a value code keeps state in (the others are functions, classes, modules).
        if (
            slot.kind == "cell"
            or (slot.kind == "item" and depth)
            or (slot.kind != "value" and isinstance(value, RESTORABLE))
        ):
            self._cells.append(slot)
        if isinstance(value, torch.Tensor):
            # A leaf requiring grad is the graph's to watch (reads.py); an activation read by
            # name is watched here, never copied (it is new at every step).
            if not value.requires_grad or value.grad_fn is not None:
                self._read(functools.partial(str, slot.label), value, hidden=False)
            else:
                self.leaf_storages[id(value)] = storage_key(value)
        elif isinstance(value, torch.nn.Module):
            # A module the function holds: it and its children (an item of a ModuleDict, the
            # block it calls), not deeper, so that a closure over a whole model costs what one
            # level of it costs. Batch norm deeper down is found after the forward pass.
            self._held.append(value)
            for module in (value, *list(value._modules.values())[:MAX_ITEMS]):
                if module is not None and id(module) not in self._called:
                    self._call(module)
        elif depth == 0:
            for item in slot_items(slot, value):
                self._slot(item, depth=1)

    def _call(self, module: torch.nn.Module) -> None:
        if self._pair is None and not module._buffers and is_torchs(type(module)):
            # torch's own module, holding no state of its own: only its mode can change.
            self._called[id(module)] = Mode(module)
            return
        self._called[id(module)] = Called(module)
        for name, tensor, hidden in _tensors_of(module):
            self._read(name, tensor, hidden=hidden)
        for parameter in module._parameters.values():
            # A lazy module's parameter has no data until its first call: none to hold.
            if parameter is not None and not is_lazy(parameter) and parameter.numel():
                self.leaf_storages[id(parameter)] = storage_key(parameter)
        for slot in class_slots(type(module)):
            self._slot(slot, depth=0)
        if self._pair is not None:  # weights too: the context keeps their value at the call
            for key, parameter in module._parameters.items():
                if parameter is not None:
                    self._read(_attribute_name(type(module), key), parameter, hidden=False)

    def _read(self, name: Callable[[], str], tensor: torch.Tensor, *, hidden: bool) -> None:
        if id(tensor) in self._read_ids:  # reached by two names: one record
            return
        if is_lazy(tensor):  # a lazy module's, with no value until the region gives it one
            return
        self._read_ids.add(id(tensor))
        read = _Read(name, tensor, hidden)
        if hidden or (
            self._pair is None
            and not tensor.requires_grad
            and (_known.first_reach(tensor, self._code) or _known.was_written(tensor))
        ):
            # Batch norm's kernels write without a version move the context could see.
            with below_python_modes(), torch.no_grad():
                read.before = tensor.clone()
        elif self._pair is not None:
            with below_python_modes():
                read.handle = self._pair[0](tracked_form(tensor))
        self._reads.append(read)

    def learn(self) -> None:
        """Only note what the forward pass wrote, so that the next region reaching it copies it.

        For a region that saved nothing: it is never recomputed.
        """
        for read in self._reads:
            if read.written or read.tensor._version != read.version:
                _known.note_written(read.tensor)

    def seal(
        self, input_storages: Callable[[], set[int | None]], leaves: Iterable[torch.Tensor]
    ) -> ReachedState | None:
        """What the forward pass left: the reads written, the bindings recomputation restores.

        ``input_storages``: the storages of the call's tensors, asked only if it wrote something.
        ``leaves``: the leaves of the region's graph, to find the batch norm modules that the
        region ran below a module it holds (NOTE [State a region reaches]).
        """
        if self._held:
            self._norms_below(leaves)
        reads = self._reads
        for read in reads:
            tensor = read.tensor
            if tensor._version != read.version:
                read.written = True
            if read.written:
                _known.note_written(tensor)
                read.version = tensor._version
            else:
                read.before = None  # not written: the tensor itself holds the value read
                read.storage = storage_key(tensor)
                read.swaps = moves(tensor)
        for called in self._called.values():
            called.seal()
        if not reads and not self._called and not self._cells:
            return None
        # Whether the region wrote an argument's storage, decided now: the call's tensors are
        # alive (a view made for the call, ``checkpoint(f, state[0:1])``, may die with it) and
        # the storages are those the forward pass wrote (``state.data = ...`` may swap them).
        written = [read for read in reads if read.written]
        inputs = input_storages() if written else set()
        through = next((read for read in written if storage_key(read.tensor) in inputs), None)
        return ReachedState(list(self._called.values()), reads, self._cells, self._pair, through)

    def _norms_below(self, leaves: Iterable[torch.Tensor]) -> None:
        """Batch norm the region ran below a module it holds, found by its weights."""
        for leaf in leaves:
            for held in self._held:
                owner = _owner_of(held, leaf)
                if owner is None or id(owner) in self._called:
                    continue
                self._called[id(owner)] = Mode(owner)
                if isinstance(owner, _NormBase) and owner.training and owner.track_running_stats:
                    for key, buffer in owner._buffers.items():
                        if buffer is not None and id(buffer) not in self._read_ids:
                            self._read_ids.add(id(buffer))
                            read = _Read(_attribute_name(type(owner), key), buffer, hidden=True)
                            read.scratch = True
                            self._reads.append(read)
                break


_OWNERS: weakref.WeakKeyDictionary[torch.nn.Module, dict[int, weakref.ref[torch.nn.Module]]] = (
    weakref.WeakKeyDictionary()
)


def _owner_of(held: torch.nn.Module, parameter: torch.Tensor) -> torch.nn.Module | None:
    """The module under ``held`` whose parameter ``parameter`` is (found once per ``held``)."""
    owners = _OWNERS.get(held)
    if owners is None:
        owners = _OWNERS[held] = {
            id(value): weakref.ref(module)
            for module in held.modules()
            for value in module._parameters.values()
            if value is not None
        }
    ref = owners.get(id(parameter))
    owner = None if ref is None else ref()
    if owner is None or not any(value is parameter for value in owner._parameters.values()):
        return None
    return owner


class ReachedState:
    """What one region call reached by name, kept for its recomputations."""

    __slots__ = ("_called", "_cells", "_pair", "_reads", "_through_an_argument")

    def __init__(
        self,
        called: list[Called | Mode],
        reads: list[_Read],
        cells: list[Slot],
        pair: tuple[PackHook, UnpackHook] | None,
        through_an_argument: _Read | None,
    ) -> None:
        self._called = called
        self._reads = reads
        self._cells = cells
        self._pair = pair
        self._through_an_argument = through_an_argument

    def name_of(self, tensor: torch.Tensor) -> str:
        """How the region reached ``tensor``, for a message: a module's attribute, a name."""
        return self.found(tensor) or describe(tensor)

    def found(self, tensor: torch.Tensor) -> str | None:
        """Where the region found ``tensor`` by name (a module's attribute, a closure cell)."""
        for called in self._called:
            for key, value in called.module._parameters.items():
                if value is tensor:
                    return f"{type(called.module).__name__}.{key}"
        for slot in self._cells:
            if slot.at_call is tensor:
                return slot.label
        for read in self._reads:
            if read.tensor is tensor:
                return read.name()
        return None

    def rebindings(self) -> list[Rebinding]:
        """The bindings recomputation must see as they were at the call."""
        found: list[Rebinding] = []
        for called in self._called:
            found.extend(called.changes())
        for slot in self._cells:
            change = slot.rebinding()
            if change is not None:
                found.append(change)
        return found

    def values(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
        """What recomputation reads in place of the live tensors, and the stand-ins to verify.

        Returns:
            ``(tensor, value)`` pairs (a stand-in for each), and the tensors whose stand-in
            starts from the value the forward pass left (written with no copy of their value
            before): recomputation must leave those stand-ins equal to it.

        Raises:
            SavedTensorModifiedError: if a tensor the forward pass read and did not write was
                changed in place, or had its data swapped, since.
        """
        values: list[tuple[torch.Tensor, torch.Tensor]] = []
        verify: list[torch.Tensor] = []
        if self._through_an_argument is not None:
            raise _written_through_an_argument(self._through_an_argument)
        for read in self._reads:
            tensor = read.tensor
            if read.scratch:
                values.append((tensor, tensor))
            elif read.before is not None:
                values.append((tensor, read.before))
            elif read.handle is not None:
                assert self._pair is not None
                value = self._pair[1](read.handle)
                if storage_key(value) != storage_key(tensor):
                    values.append((tensor, value))
            elif read.written:
                self._check_written(read)
                values.append((tensor, tensor))
                verify.append(tensor)
            else:
                _check_unchanged(read)
        return values, verify

    def _check_written(self, read: _Read) -> None:
        tensor = read.tensor
        if tensor._version != read.version:
            raise SavedTensorModifiedError(
                modified_message(tensor.type(), list(tensor.shape), tensor._version, read.version)
                + f" Hint: the checkpointed function reads {read.name()} and changed it in place"
                " in its forward pass, and it was changed again before backward, so "
                "recomputation cannot read what the forward pass read. Change it after backward."
            )

    def not_reproduced(self, tensor: torch.Tensor) -> CheckpointError:
        """The error for written state recomputation read without its value before the write."""
        name = next((read.name() for read in self._reads if read.tensor is tensor), "a tensor")
        return CheckpointError(
            f"tensorhooks.checkpoint: the checkpointed function changed {name} in place during "
            "its forward pass, for the first time since a checkpointed region first reached it, "
            "so its value before that write was not kept; and it reads it (before that write, or "
            "after a write that does not give the same value again), so recomputation cannot "
            "read what the forward pass read. From the next call on, its value is kept before the "
            "region runs. Make the write outside the checkpointed function, or run the step "
            "inside tensorhooks.allow_mutation_on_saved_tensors() (which keeps its value)."
        )


def _written_through_an_argument(read: _Read) -> SavedTensorModifiedError:
    tensor = read.tensor
    return SavedTensorModifiedError(
        modified_message(tensor.type(), list(tensor.shape), tensor._version, read.at_call)
        + f" Hint: the checkpointed function changed {read.name()} in place, which it reads both "
        "from outside its arguments and through an argument sharing its storage, so the reads "
        "before and after that write saw different values, which recomputation cannot give "
        f"both. Pass {read.name()} itself as the argument, or write to a copy of the argument."
    )


def _check_unchanged(read: _Read) -> None:
    tensor = read.tensor
    if tensor._version != read.version:
        raise SavedTensorModifiedError(
            changed_message(tensor, read.version, f"reads {read.name()}")
        )
    if storage_key(tensor) != read.storage and moves(tensor) == read.swaps:
        raise SavedTensorModifiedError(
            f"tensorhooks.checkpoint: the data of {read.name()}, which the checkpointed function "
            "reads from outside its arguments, was replaced between the forward pass and "
            "backward (tensor.data = ..., or set_ under no_grad), so recomputation would read "
            "other values than the forward pass did. Replace it after backward, or pass it to "
            "checkpoint as an argument."
        )
