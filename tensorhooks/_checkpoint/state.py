"""What a region reads and writes outside its arguments, and what recomputation must see of it.

See NOTE [Tensors a region reaches outside its arguments].
"""

from __future__ import annotations

import functools
import itertools
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.checkpoint import CheckpointError

from tensorhooks._core.errors import SavedTensorModifiedError
from tensorhooks._core.guards import PackHook, UnpackHook, current_save_guard, modified_message
from tensorhooks._core.moves import moves
from tensorhooks._core.torch_compat import (
    TorchDispatchMode,
    below_python_modes,
    next_sequence_nr,
    returns_alias,
    sequence_nr,
    set_version_counters,
    storage_key,
)

from .reads import (
    RecomputedReads,
    describe,
    graph_leaves,
    not_written_message,
    replaced_message,
    watch_optimizer_steps,
)

__all__ = ["OutsideState", "Substitution"]

# NOTE [Tensors a region reaches outside its arguments]
#
# Recomputation runs the function again and reads, besides the saved inputs, whatever the
# function reaches by other ways: a module's parameters and buffers, a closure's tensors. Plain
# autograd saves what it needs when the forward pass runs; recomputation reads it again in
# backward. It must read the values the forward pass read, and leave behind what the forward
# pass left. Three ways that fails, each silent in torch's checkpoint:
#   1. a tensor changed between the forward pass and backward (an optimizer or EMA step, a
#      pipeline schedule): ``nn.Linear`` saves ``weight.t()``, a view that dies with the forward
#      pass, so a check on saved tensors alone never sees the weight;
#   2. state the region writes itself (a running statistic, a counter, the power iteration of
#      ``spectral_norm``): recomputation reads the written value, and writes a second time;
#   3. either of those through a view or an alias of the tensor.
#
# What is watched. When the region starts, the state the function reaches: the parameters and
# buffers of a module (the function itself, the ``self`` of a bound method, or a module found
# in the closure, the defaults or a ``functools.partial``'s arguments) and the tensors found
# there, each with its version. When the forward pass ends, also the tensors it saved that are
# still alive, and the bases of the views it saved (``weight.t()`` gives ``weight``), minus the
# region's own inputs, which their saved form checks.
#
# What recomputation sees. A *substitution* maps a storage to a replacement holding the values
# the forward pass read. A dispatch mode around recomputation reads every op's tensor arguments
# on a substituted storage from the replacement (writes go there too, so the real tensor is left
# as the forward pass left it), and the tensors recomputation saves are taken from it as well.
# View ops pass through, so autograd's view tracking and the gradient's path to the real tensor
# are untouched. Where the replacement comes from:
#   - inside ``allow_mutation_on_saved_tensors`` every watched tensor is tracked by the
#     context's save guard from the start, which clones it before any write, the region's own
#     included: the clone is the value the forward pass read (case 1 and 2 alike); a weight
#     freed and refilled with its version counter put back (FSDP) is read as refilled
#     (`_tracked_form`);
#   - otherwise a tensor that is state (neither a ``Parameter`` nor requiring grad: buffers,
#     counters) is cloned when the region starts and the clone kept if the forward pass wrote it
#     (case 2); one the forward pass did not write is only checked.
# What cannot be seen is refused: a watched tensor changed after the forward pass outside that
# context raises autograd's in-place error naming it (plain autograd raises too when it saved
# the tensor; a silently recomputed new value is never used), and a weight that the region
# itself wrote (``nn.Embedding(max_norm=...)``) raises a `CheckpointError` naming it, since its
# value before the write was never copied. The walk is one way to find what the region reads;
# the other records it as the region runs (the tensors it saves, the leaves of its graph), and
# holds recomputation to the same tensors: NOTE [Reads recorded as the region runs] in reads.py.
# Cost: one version and one storage read per watched tensor per call, clones of the state a
# module holds, a walk of the region's graph, and the dispatch mode only in recomputations that
# substitute something.

_MAX_DEPTH = 2  # closure -> partial -> module, at most
_MAX_ITEMS = 64  # items of one container, attributes of one object: the walk runs every call
_NOT_PLAIN = frozenset({"builtins", "typing", "abc", "functools"})


class _Watched:
    """A tensor the region reaches outside its arguments, with what is known of its value."""

    __slots__ = (
        "aliases_input",
        "handle",
        "hidden",
        "moves",
        "name",
        "ref",
        "start",
        "start_version",
        "storage",
        "version",
        "written",
    )

    def __init__(self, name: str | _InModule, tensor: torch.Tensor, hidden: bool) -> None:
        self.name = name
        self.ref = weakref.ref(tensor)
        self.version = tensor._version
        self.start_version = tensor._version
        self.storage = storage_key(tensor)  # ``tensor.data = ...`` swaps it, moving no version
        self.moves = moves(tensor)  # swaps for an equal copy (`offload_parameters`) are counted
        self.aliases_input = False  # shares its storage with an argument of the region
        self.hidden = hidden  # torch may write it without moving its version
        self.handle: Any = None  # what the save guard's pack returned, inside allow_mutation
        self.start: torch.Tensor | None = None  # its value when the region started (state only)
        self.written = False  # by the region's forward pass


def _is_state(tensor: torch.Tensor) -> bool:
    return not isinstance(tensor, torch.nn.Parameter) and not tensor.requires_grad


# (name, tensor, whether torch's kernels may write it without moving its version)
class _InModule:
    """The name of a module's parameter or buffer, spelled out only when an error needs it."""

    __slots__ = ("attribute", "owner", "prefix", "root")

    def __init__(self, prefix: str, root: torch.nn.Module, owner: torch.nn.Module, attribute: str):
        self.prefix = prefix
        self.root = root
        self.owner = owner
        self.attribute = attribute

    def __str__(self) -> str:
        path = next(
            (name for name, module in self.root.named_modules() if module is self.owner), "?"
        )
        return f"{self.prefix}{path}.{self.attribute}" if path else f"{self.prefix}{self.attribute}"


_Found = tuple["str | _InModule", torch.Tensor, bool]

# Buffers that torch's batch-norm kernels write without moving their version: in training mode
# ``native_batch_norm`` (and its cuDNN and MIOpen variants) update the running statistics
# although their schema declares no write, so the version counter cannot tell.
_RUNNING_STATS = frozenset({"running_mean", "running_var"})


def _submodules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """``module`` and every module under it, each once."""
    found = [module]
    seen = {id(module)}
    for owner in found:  # grows while it is walked: breadth first
        for child in owner._modules.values():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                found.append(child)
    return found


def _module_tensors(prefix: str, module: torch.nn.Module) -> Iterator[_Found]:
    # The modules' own dicts, not modules() or named_parameters(): this runs on every call of
    # checkpoint, and their generators cost several times as much.
    for owner in _submodules(module):
        hidden = isinstance(owner, _NormBase) and owner.training
        for name, parameter in owner._parameters.items():
            if parameter is not None:
                yield _InModule(prefix, module, owner, name), parameter, False
        for name, buffer in owner._buffers.items():
            if buffer is not None:
                yield (
                    _InModule(prefix, module, owner, name),
                    buffer,
                    hidden and name in _RUNNING_STATS,
                )


def _reached(name: str, value: object, depth: int) -> Iterator[_Found]:
    """The tensors (and modules' tensors) ``value`` is or holds, as far as `_MAX_DEPTH`."""
    if isinstance(value, torch.Tensor):
        yield name, value, False
    elif isinstance(value, torch.nn.Module):
        yield from _module_tensors(f"{name}.", value)
        if depth < _MAX_DEPTH:
            yield from _forward_tensors(value, depth + 1)
    elif depth >= _MAX_DEPTH:
        return
    elif isinstance(value, types.MethodType):
        yield from _reached(type(value.__self__).__name__, value.__self__, depth + 1)
    elif isinstance(value, types.FunctionType):
        yield from _function_tensors(value, depth + 1)
    elif isinstance(value, functools.partial):  # transparent: its function and arguments
        for label, item in _members(name, value):
            yield from _reached(label, item, depth)
    else:
        for label, item in _members(name, value):
            yield from _reached(label, item, depth + 1)


def _members(name: str, value: object) -> list[tuple[str, object]]:
    """What a partial, a container or a plain object holds, each with its name; a few only."""
    if isinstance(value, functools.partial):
        return [
            (f"{name}.func", value.func),
            *((f"{name}.args[{index}]", item) for index, item in enumerate(value.args)),
            *((f"{name}.keywords[{key!r}]", item) for key, item in value.keywords.items()),
        ]
    if isinstance(value, (list, tuple)):
        return [(f"{name}[{index}]", item) for index, item in enumerate(value[:_MAX_ITEMS])]
    if isinstance(value, dict):
        return [(f"{name}[{key!r}]", item) for key, item in list(value.items())[:_MAX_ITEMS]]
    if _is_plain_object(value):
        return [(f"{name}.{key}", item) for key, item in list(vars(value).items())[:_MAX_ITEMS]]
    return []


def _is_plain_object(value: object) -> bool:
    """An instance of a user's class, whose attributes the function may read."""
    kind = type(value)
    return (
        hasattr(value, "__dict__")
        and kind.__module__ not in _NOT_PLAIN
        and not isinstance(
            value, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)
        )
    )


def _function_tensors(function: types.FunctionType, depth: int) -> Iterator[_Found]:
    names = function.__code__.co_freevars
    for name, cell in zip(names, function.__closure__ or (), strict=True):
        try:
            value = cell.cell_contents
        except ValueError:  # not bound yet
            continue
        yield from _reached(name, value, depth)
    for index, value in enumerate(function.__defaults__ or ()):
        yield from _reached(f"default[{index}]", value, depth)
    # The globals its code names: a module or a tensor defined at the top of a file.
    names_in_code = function.__globals__
    for name in function.__code__.co_names:
        value = names_in_code.get(name)
        if isinstance(value, (torch.Tensor, torch.nn.Module, list, tuple, dict)) or (
            _is_plain_object(value)
        ):
            yield from _reached(name, value, depth)


def _forward_tensors(module: torch.nn.Module, depth: int) -> Iterator[_Found]:
    """What a module's own ``forward`` reaches by its closure, defaults and globals.

    A class defined inside a function reads that function's tensors from its closure; any
    forward may read a tensor or a module defined at the top of its file.
    """
    forward = getattr(type(module), "forward", None)
    if isinstance(forward, types.FunctionType):
        yield from _function_tensors(forward, depth)


def reachable_state(function: Callable[..., Any]) -> list[_Found]:
    """The tensors ``function`` reaches besides its arguments, each once, with a name."""
    found: dict[int, _Found] = {}
    if isinstance(function, torch.nn.Module):
        items: Iterator[_Found] = itertools.chain(
            _module_tensors(f"{type(function).__name__}.", function),
            _forward_tensors(function, 1),
        )
    else:
        items = _reached(getattr(function, "__name__", "function"), function, 0)
    for item in items:
        found.setdefault(id(item[1]), item)
    return list(found.values())


class OutsideState:
    """The tensors one region call reaches outside its arguments. See NOTE [Tensors a region...]."""

    __slots__ = (
        "_function",
        "_inputs",
        "_pair",
        "_skip",
        "_slots",
        "_start",
        "positions",
        "watched",
    )

    def __init__(self, function: Callable[..., Any], inputs: Sequence[torch.Tensor]) -> None:
        watch_optimizer_steps()  # installed at import; see NOTE [Reads recorded as the region runs]
        guard = current_save_guard()
        self._pair: tuple[PackHook, UnpackHook] | None = (
            guard.wrap(_identity, _identity) if guard.lets_saved_tensors_change else None
        )
        self._skip = {id(t) for t in inputs} | {id(t._base) for t in inputs if t._base is not None}
        self._inputs = [weakref.ref(t) for t in inputs]  # their storages are asked at seal only
        self._start = next_sequence_nr()  # nodes made from here on are the region's
        self.watched: list[_Watched] = []
        self._function = function
        # Where the walk found each tensor that requires no grad, to tell a replaced one in
        # recomputation (the graph tells those that require grad).
        self._slots: list[tuple[object, weakref.ref[torch.Tensor]]] = []
        # Position of a save -> the tensor from outside the region saved there (or its base).
        self.positions: dict[int, weakref.ref[torch.Tensor]] = {}
        # Inputs reached from the function too (a closure reading a tensor also passed as an
        # argument) are watched: recomputation reads them through the closure, not the argument.
        for name, tensor, hidden in reachable_state(function):
            self._watch(name, tensor, hidden=hidden, at_start=True)
            if not tensor.requires_grad:
                self._slots.append((_slot(name), self.watched[-1].ref))

    def _watch(
        self, name: str | _InModule, tensor: torch.Tensor, *, hidden: bool, at_start: bool
    ) -> None:
        watched = _Watched(name, tensor, hidden)
        self._skip.add(id(tensor))
        if self._pair is not None and not hidden:
            with below_python_modes():
                watched.handle = self._pair[0](_tracked_form(tensor))
        elif at_start and _is_state(tensor):
            with below_python_modes():
                watched.start = tensor.clone()
        self.watched.append(watched)

    def seal(self, saved: Sequence[tuple[int, torch.Tensor, int]], output: object) -> None:
        """At the end of the forward pass: note what it wrote, and watch what it read.

        ``saved``: the tensors the forward pass saved that are still alive, each with its
        position and its version when saved; those the region made (its outputs, or what a node
        of the region produced) are the recomputation's own and are not watched. See NOTE
        [Reads recorded as the region runs] in reads.py.
        """
        outputs = _tensors_in(output)
        self._skip.update(id(value) for value in outputs)
        for watched in self.watched:
            tensor = watched.ref()
            if tensor is None:
                continue
            if tensor._version != watched.version or watched.hidden:
                watched.written = True
                watched.aliases_input = storage_key(tensor) in self._input_storages()
                watched.version = tensor._version
                watched.storage = storage_key(tensor)
            elif watched.start is not None:
                watched.start = None  # not written: the tensor itself holds the value
        # A module may bind a new buffer in its own forward pass (a cache grown): recomputation
        # must find what the forward pass left there.
        self._slots = [
            (
                slot,
                weakref.ref(now)
                if isinstance(slot, tuple) and (now := _in_module(slot)) is not None
                else ref,
            )
            for slot, ref in self._slots
        ]
        watched_storages: set[int | None] | None = None  # read only if a saved tensor needs it
        watched_ids = {id(watched.ref()) for watched in self.watched}
        for index, tensor, version in saved:
            base = tensor if tensor._base is None else tensor._base
            if id(base) in watched_ids:
                self.positions[index] = weakref.ref(base)
            if id(base) in self._skip or self._made_here(base):
                continue  # an input or an output, or made by the region
            self.positions[index] = weakref.ref(base)
            if watched_storages is None:
                watched_storages = {storage_key(alive) for alive in self._alive()}
            if storage_key(base) in watched_storages:
                continue  # watched since the call started, through another tensor
            name = f"a tensor of shape {list(base.shape)}"
            self._watch(name, base, hidden=False, at_start=False)
            if tensor._version != version:  # the region changed it after saving it
                self.watched[-1].written = True
                self.watched[-1].handle = None  # tracked too late to hold the saved value
        for leaf in graph_leaves([tensor.grad_fn for tensor in outputs], self._start):
            if id(leaf) not in self._skip:
                self._watch(describe(leaf), leaf, hidden=False, at_start=False)

    def reads(self, inputs: Sequence[torch.Tensor]) -> RecomputedReads:
        """What one recomputation must read: checked as it saves, and when it ends."""
        # Held, not only their ids, so no other tensor takes an id while recomputation runs. The
        # region's own inputs are there too: a leaf input unpacked from its saved form is a new
        # object whose graph leads to the input itself.
        known = {id(tensor): tensor for tensor in self._alive()}
        for ref in self._inputs:
            tensor = ref()
            if tensor is not None:
                known[id(tensor)] = tensor
                if tensor._base is not None:
                    known[id(tensor._base)] = tensor._base
        return RecomputedReads(self.positions, known, inputs)

    def _input_storages(self) -> set[int | None]:
        return {storage_key(tensor) for ref in self._inputs if (tensor := ref()) is not None}

    def _made_here(self, tensor: torch.Tensor) -> bool:
        node = tensor.grad_fn
        return node is not None and sequence_nr(node) >= self._start

    def _alive(self) -> list[torch.Tensor]:
        return [tensor for watched in self.watched if (tensor := watched.ref()) is not None]

    def substitution(self) -> Substitution | None:
        """The values recomputation must read instead of the live ones; None if there are none.

        Raises:
            SavedTensorModifiedError: if a watched tensor was changed since the forward pass
                and its value then was not kept.
            CheckpointError: if the forward pass wrote a weight it reached from outside.
        """
        self._check_slots()
        values: list[tuple[torch.Tensor, torch.Tensor]] = []
        for watched in self.watched:
            tensor = watched.ref()
            if tensor is None:
                continue
            value = self._value(watched, tensor)
            if value is not None:
                values.append((tensor, value))
        return Substitution(values) if values else None

    def _check_slots(self) -> None:
        """Raise if a tensor requiring no grad that the walk found was replaced in its slot.

        A module's slot is read directly; a name in the closure (or deeper) by walking again,
        only if there is one.
        """
        if not self._slots:
            return
        now: dict[object, torch.Tensor] = {}
        if any(not isinstance(slot, tuple) for slot, _ in self._slots):
            now = {_slot(name): tensor for name, tensor, _ in reachable_state(self._function)}
        for slot, ref in self._slots:
            tensor = _in_module(slot) if isinstance(slot, tuple) else now.get(slot)
            if tensor is not None and tensor is not ref():
                raise SavedTensorModifiedError(replaced_message(str(_name_of(slot)), tensor, ref()))

    def _value(self, watched: _Watched, tensor: torch.Tensor) -> torch.Tensor | None:
        if storage_key(tensor) != watched.storage and moves(tensor) == watched.moves:
            raise SavedTensorModifiedError(not_written_message(str(watched.name)))
        if watched.aliases_input and watched.written:
            # Written through the argument that shares its storage: reads of it before the
            # write and after it saw different values, which one replacement cannot give.
            raise SavedTensorModifiedError(
                modified_message(
                    tensor.type(), list(tensor.shape), tensor._version, watched.start_version
                )
                + f" Hint: the checkpointed function writes an argument in place that shares "
                f"its storage with {watched.name}, which it also reads from outside its "
                "arguments, so recomputation cannot read what the forward pass read. Pass "
                f"{watched.name} itself as the argument, or write to a copy of the argument."
            )
        if watched.handle is not None:
            assert self._pair is not None
            value = self._pair[1](watched.handle)
            return None if storage_key(value) == storage_key(tensor) else value
        if watched.start is not None:
            return watched.start
        if watched.written:
            raise CheckpointError(
                f"tensorhooks.checkpoint: the checkpointed function changed {watched.name} in "
                "place during the forward pass; it reaches this tensor from outside its "
                "arguments, and its value before the write was not copied (a weight, a "
                "Parameter or a tensor requiring grad, is not; nor is a tensor it reaches other "
                "than through a module, a closure or a functools.partial), so recomputation "
                "cannot read what the forward pass read. Run the forward pass and backward "
                "inside tensorhooks.allow_mutation_on_saved_tensors() (which keeps the value of "
                "what a module or closure holds), pass the tensor as an argument, make the "
                "write outside the checkpointed function, or do not checkpoint it."
            )
        if tensor._version != watched.version:
            raise SavedTensorModifiedError(
                modified_message(
                    tensor.type(), list(tensor.shape), tensor._version, watched.version
                )
                + f" Hint: the checkpointed function reads {watched.name} from outside its "
                "arguments, and it was changed in place between the forward pass and backward, "
                "so recomputation would use the changed value. Change it after backward, pass it "
                "to checkpoint as an argument, or run the forward pass and backward inside "
                "tensorhooks.allow_mutation_on_saved_tensors() (which keeps its value)."
            )
        return None


def _identity(value: Any) -> Any:
    return value


def _tracked_form(tensor: torch.Tensor) -> torch.Tensor:
    """What the save guard tracks for a watched tensor: a weight itself, anything else detached.

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


def _slot(name: str | _InModule) -> object:
    """Where the walk found a tensor: a module's attribute, or a path of names."""
    return (name.owner, name.attribute) if isinstance(name, _InModule) else name


def _in_module(slot: tuple[torch.nn.Module, str]) -> torch.Tensor | None:
    """The buffer (or parameter) a module holds under a name now."""
    owner, attribute = slot
    found = owner._buffers.get(attribute)
    return owner._parameters.get(attribute) if found is None else found


def _name_of(slot: object) -> str:
    if isinstance(slot, tuple):
        owner, attribute = slot
        return f"{type(owner).__name__}.{attribute}"
    return str(slot)


def _tensors_in(output: object) -> list[torch.Tensor]:
    """The tensors a region returned, also in lists, tuples and dicts (one level)."""
    if isinstance(output, torch.Tensor):
        return [output]
    items = output.values() if isinstance(output, dict) else output
    if not isinstance(items, (list, tuple, type({}.values()))):
        return []
    return [item for item in items if isinstance(item, torch.Tensor)]


def _over(storage: torch.UntypedStorage, like: torch.Tensor) -> torch.Tensor:
    """A tensor with ``like``'s dtype and geometry on ``storage``."""
    tensor = torch.empty(0, dtype=like.dtype, device=like.device)
    return tensor.set_(storage, like.storage_offset(), like.size(), like.stride())


def _copy(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    copy: torch.UntypedStorage = storage.clone()  # type: ignore[no-untyped-call]  # untyped in torch
    return copy


class Substitution:
    """Replacement storages holding what the forward pass read, for the storages watched."""

    __slots__ = ("storages", "tensors", "versions")

    def __init__(self, values: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.storages: dict[int | None, torch.UntypedStorage] = {}
        self.tensors = tuple(tensor for tensor, _ in values)
        self.versions = tuple(tensor._version for tensor in self.tensors)
        with below_python_modes(), torch.no_grad():
            for tensor, value in values:
                key = storage_key(tensor)
                storage = self.storages.get(key)
                if storage is None:
                    storage = self.storages[key] = _copy(tensor.untyped_storage())
                _over(storage, tensor).copy_(value)

    def swap(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, read from its replacement if its storage has one."""
        storage = self.storages.get(storage_key(tensor))
        if storage is None:
            return tensor
        with below_python_modes():
            return _over(storage, tensor)

    def saved(self, tensor: torch.Tensor) -> torch.Tensor:
        """What recomputation keeps of a saved ``tensor``: a copy of its replacement's value.

        A copy, as the recomputation may write the replacement after saving it (a buffer saved,
        then updated), and the saved value must stay the one read.
        """
        swapped = self.swap(tensor)
        if swapped is tensor:
            return tensor
        with below_python_modes():
            return swapped.clone()

    def restore_versions(self) -> None:
        """Undo the version moves of the real tensors: the recomputation wrote the replacements.

        Autograd moves the version counter of a tensor an in-place op names, although the write
        went to its replacement; left moved, it would make a later unpack of the unchanged
        tensor raise autograd's in-place error.
        """
        set_version_counters(self.tensors, self.versions)

    def mode(self) -> _Substitute:
        """The dispatch mode that makes recomputation's ops read the replacements."""
        return _Substitute(self)


class _Substitute(TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped base
    """Reads (and writes) substituted storages from their replacements; views pass through."""

    def __init__(self, substitution: Substitution) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's __init__ is untyped
        self.substitution = substitution

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = {} if kwargs is None else kwargs
        aliased, writes = returns_alias(func)
        if aliased and not writes:  # a view: keep autograd's view of the real tensor
            return func(*args, **kwargs)
        originals: dict[int, torch.Tensor] = {}

        def swap(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                swapped = self.substitution.swap(value)
                if swapped is not value:
                    originals[id(swapped)] = value
                return swapped
            if isinstance(value, (list, tuple)):
                return type(value)(swap(item) for item in value)
            return value

        result = func(*swap(tuple(args)), **{key: swap(item) for key, item in kwargs.items()})
        if not writes or not originals:
            return result
        # An in-place or out= op returns the tensor it wrote: hand back the caller's object.
        if isinstance(result, torch.Tensor):
            return originals.get(id(result), result)
        if isinstance(result, (list, tuple)):
            return type(result)(originals.get(id(item), item) for item in result)
        return result
