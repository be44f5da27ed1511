"""Save guards: what keeps a saved tensor that pack did not copy from reaching backward changed.

Every pair of hooks tensorhooks pushes is wrapped by the save guard in force on the thread: the
`VersionGuard` by default (raise autograd's in-place error), the guard of
``allow_mutation_on_saved_tensors`` inside that context (hand back the save-time value). See
NOTE [Guarding saved tensors that pack returned as-is].
"""

from __future__ import annotations

import collections
import contextlib
import threading
import types
import weakref
from collections.abc import Callable, Generator
from typing import Any, Protocol

import torch

from .errors import SavedTensorModifiedError
from .torch_compat import is_alias_of, is_newest_node, storage_key

__all__ = [
    "PackHook",
    "SaveGuard",
    "SavedCopy",
    "UnpackHook",
    "VersionGuard",
    "current_save_guard",
    "is_output_of_saving_node",
    "is_protected_pack_hook",
    "may_share_storage",
    "modified_error",
    "modified_message",
    "register_protected_pack_hook",
    "use_save_guard",
]

# NOTE [Guarding saved tensors that pack returned as-is]
#
# Plain autograd remembers the version counter of every tensor it saves and raises at backward
# if the tensor was changed in place since ("one of the variables needed for gradient computation
# has been modified by an inplace operation"). Once a pack hook is installed autograd stores the
# hook's return value instead and skips that check, trusting the hook to have made a copy. A pack
# hook that returns the tensor itself (``lambda t: t``), a ``detach()`` of it, a view of it, or
# anything else sharing its storage breaks that trust: an in-place change before backward flows
# silently into the gradient.
#
# Every pair of hooks pushed by tensorhooks is therefore wrapped by a *save guard*. The default
# guard looks at what pack returned (a tensor, or a tuple/list of them): if it shares storage
# with the saved tensor (``is_alias_of``), the guard records the saved tensor's version
# and re-checks it before calling unpack, raising autograd's own error on a mismatch. When pack
# made a real copy nothing is recorded and unpack is called directly. Guards are per thread and
# replaceable: ``allow_mutation_on_saved_tensors`` installs one that clones before writes instead
# of raising, so hooks pushed inside it keep its protection.
#
# The version guard's record is a plain tuple ``(_ALIASED, packed, source, version)``, the
# cheapest thing to build per save. ``save_on_cpu`` builds and checks the same record inline on
# its CPU path (one Python call fewer per save); a change to the record changes both places.

PackHook = Callable[[torch.Tensor], Any]
UnpackHook = Callable[[Any], torch.Tensor]


def is_output_of_saving_node(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``, given to a pack hook, is an output of the node that is saving it.

    Holding such a tensor (``exp``, ``relu``, ``sigmoid``, a custom Function saving its result)
    in what pack returns closes a reference cycle through the node's C++ saved variable that
    Python's collector cannot see: a graph dropped without backward is never freed. Hold a
    ``detach()`` of it instead (same storage and version counter, no ``grad_fn``).

    Each node takes the next number of a per-thread counter when it is created, and autograd
    creates a node before saving anything for it, so the saving node is the newest one: its
    number is the counter minus one, and the nodes that produced its inputs are older. Call it
    first thing in a pack hook, before anything that could create a node. A node created between
    the saving node and the save (a custom Function applied inside another's forward) makes it
    answer False: the tensor is then held as it is, as before.
    """
    grad_fn = tensor.grad_fn
    return grad_fn is not None and is_newest_node(grad_fn)


class SavedCopy:
    """Base of packed records that hold a copy of the saved data, never an alias of its storage.

    Save guards need not protect a tensor whose pack returned one of these: changing the tensor
    in place cannot reach the copy. A record that copies asynchronously must have finished
    reading the tensor when pack returns under any guard other than `VersionGuard` (such guards
    let saved tensors change).
    """

    __slots__ = ()


class SaveGuard(Protocol):
    """Turns a user's pack/unpack pair into the pair that is actually pushed to autograd.

    A guard decides what happens when a tensor whose packed form still shares its storage is
    changed in place before backward: raise (`VersionGuard`) or hand back the save-time
    value (the guard of ``allow_mutation_on_saved_tensors``).
    """

    @property
    def lets_saved_tensors_change(self) -> bool:
        """Whether a saved tensor may change in place after pack, its save-time value kept.

        False: a change makes unpack raise autograd's in-place error (`VersionGuard`'s contract,
        which a pair may also implement inline). True: the guard hands back the save-time value,
        so anything that reads the tensor asynchronously must have finished reading it when
        pack returns.
        """
        ...

    @property
    def version_check_may_be_inlined(self) -> bool:
        """Whether a pair may do this guard's work itself instead of calling `wrap`.

        True only for a guard whose ``wrap`` is exactly `VersionGuard`'s check; ``save_on_cpu``
        then builds and checks the version record inline (one Python call fewer per save).
        """
        ...

    def wrap(self, pack_hook: PackHook, unpack_hook: UnpackHook) -> tuple[PackHook, UnpackHook]:
        """Return the pack/unpack pair to push in place of ``(pack_hook, unpack_hook)``."""
        ...


def may_share_storage(packed: object, tensor: torch.Tensor) -> bool:
    """Whether ``packed`` may share ``tensor``'s storage.

    False only when every object reachable from ``packed`` was looked at and none shares it. See
    NOTE [Aliases inside what pack returned]. The flat cases (a tensor, a tuple or list of
    tensors and scalars) take no detour.
    """
    if isinstance(packed, torch.Tensor):
        return is_alias_of(packed, tensor)
    if type(packed) is tuple or type(packed) is list:
        for item in packed:
            if isinstance(item, torch.Tensor):
                if item is tensor or is_alias_of(item, tensor):
                    return True
            elif not isinstance(item, _ATOMS):
                return _aliases_inside(packed, tensor)
        return False
    if isinstance(packed, (_ATOMS, SavedCopy)):
        return False
    return _aliases_inside(packed, tensor)


# NOTE [Aliases inside what pack returned]
#
# A pack hook may return the saved tensor, or a view of it, anywhere inside what it returns: a
# dict, nested tuples and lists, an object's attributes (``__dict__`` or ``__slots__``), a NumPy
# array from ``tensor.numpy()`` (whose ``base`` chain ends at a tensor sharing the storage). The
# guard looks through all of them, with a budget of `_MAX_VISITS` objects and each container
# visited once, so a large or cyclic structure costs a bounded walk. It also looks into a
# ``collections.deque``, a function's closure cells and defaults (``lambda: t``), the namespace of
# a class made by the user (``type("Box", (), {"t": t})``, or an instance of it), a bound
# method's ``__self__``, a ``memoryview``'s exporter (``memoryview(t.numpy())``) and an untyped
# or typed storage (``t.untyped_storage()``, compared by StorageImpl). Past the budget it answers
# "may alias": the version guard then keeps its version record (a change raises) and the guard
# of allow_mutation_on_saved_tensors tracks the tensor, rather than silently trusting what was
# not looked at. Records that subclass `SavedCopy` hold copies by contract and are not walked.
# What the walk cannot see (a reference kept in a global, a C object's internals, a generator's
# frame) is listed in the Limits section of docs/saved_tensors_hooks.md.

_ATOMS = (int, float, complex, bool, str, bytes, type(None), torch.device, torch.dtype)
_MAX_VISITS = 256


def _children(obj: object) -> list[object]:
    """What ``obj`` holds that could hold a tensor: items, values, attributes, an array's base."""
    if isinstance(obj, (tuple, list, set, frozenset, collections.deque)):
        return list(obj)
    if isinstance(obj, dict):
        return [*obj.keys(), *obj.values()]
    if isinstance(obj, memoryview):
        return [obj.obj]
    children: list[object] = []
    if isinstance(obj, types.FunctionType):
        cells = obj.__closure__ or ()
        children.extend(cell.cell_contents for cell in cells if _cell_is_set(cell))
        children.extend(obj.__defaults__ or ())
        children.extend((obj.__kwdefaults__ or {}).values())
    elif isinstance(obj, types.MethodType):
        children.append(obj.__self__)
    if hasattr(obj, "__array_interface__"):  # a NumPy array (or alike): its memory's owner
        children.append(getattr(obj, "base", None))
    attributes = getattr(obj, "__dict__", None)
    if isinstance(attributes, dict):
        children.extend(attributes.values())
    children.extend(_class_values(obj if isinstance(obj, type) else type(obj)))
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        names = (slots,) if isinstance(slots, str) else slots
        children.extend(getattr(obj, name, None) for name in names)
    return children


def _class_values(cls: type) -> list[object]:
    """The data a user-made class holds in its own namespace: a pack may hide a tensor there.

    ``type("Box", (), {"t": t})`` (or an instance of it) keeps ``t`` on the class. Functions,
    descriptors and the namespace's own entries are not data; classes of the standard library
    and of torch hold no saved tensor and are not looked into.
    """
    if cls.__module__ in _UNWALKED_MODULES or cls.__module__.startswith("torch."):
        return []
    return [
        value
        for name, value in vars(cls).items()
        if not (name.startswith("__") and name.endswith("__")) and not isinstance(value, _NOT_DATA)
    ]


_UNWALKED_MODULES = frozenset({"builtins", "collections", "torch", "types"})
_NOT_DATA = (types.FunctionType, staticmethod, classmethod, property, types.MemberDescriptorType)


def _cell_is_set(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (read to learn whether the cell is empty)
    except ValueError:
        return False
    return True


def _aliases_inside(packed: object, tensor: torch.Tensor) -> bool:
    """Whether anything reachable from ``packed`` may share ``tensor``'s storage.

    True past the budget: what was not looked at may hold an alias.
    """
    seen: set[int] = set()
    pending = [packed]
    while pending:
        if len(seen) >= _MAX_VISITS:
            return True
        obj = pending.pop()
        if isinstance(obj, torch.Tensor):
            if obj is tensor or is_alias_of(obj, tensor):
                return True
            continue
        if isinstance(obj, (_ATOMS, SavedCopy)) or id(obj) in seen:
            continue
        if isinstance(obj, (torch.UntypedStorage, torch.TypedStorage)):
            if _storage_key_of(obj) == storage_key(tensor):
                return True
            continue
        seen.add(id(obj))
        pending.extend(_children(obj))
    return False


def _storage_key_of(storage: torch.UntypedStorage | torch.TypedStorage) -> int:
    """The address of ``storage``'s StorageImpl, as `storage_key` gives it for a tensor."""
    if isinstance(storage, torch.TypedStorage):
        storage = storage._untyped_storage
    key: int = storage._cdata
    return key


def modified_message(type_name: str, shape: list[int], version: int, saved_version: int) -> str:
    """The first sentence of autograd's in-place error, to which callers add their hint."""
    return (
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: [{type_name} {shape}] is at version {version}; expected version "
        f"{saved_version} instead."
    )


def modified_error(tensor: torch.Tensor, saved_version: int) -> SavedTensorModifiedError:
    """Build autograd's in-place error for ``tensor``, saved at ``saved_version``."""
    return SavedTensorModifiedError(
        modified_message(tensor.type(), list(tensor.shape), tensor._version, saved_version)
        + " Hint: the pack hook returned a tensor that shares storage with the saved tensor, so "
        "backward would have read the changed values. Return a copy from pack_hook (e.g. "
        "tensor.clone()), avoid changing the tensor in place before backward, or run the forward "
        "pass under tensorhooks.allow_mutation_on_saved_tensors()."
    )


# Pack hooks under which an in-place write cannot silently reach backward: those built by a save
# guard of tensorhooks, and hooks that keep no tensor data. allow_mutation_on_saved_tensors asks
# this registry about the innermost pair before a write. Weak, so a registered hook that is
# popped and dropped leaves nothing behind.
_protected_pack_hooks: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()


def register_protected_pack_hook(pack_hook: Callable[..., Any]) -> None:
    """Declare that writes made while ``pack_hook`` is the innermost pack hook are safe.

    For a pack hook built by a save guard, or one that keeps no tensor data (it recomputes in
    backward). Call it before pushing the hook.
    """
    _protected_pack_hooks.add(pack_hook)


def is_protected_pack_hook(pack_hook: Callable[..., Any]) -> bool:
    """Whether ``pack_hook`` was declared with `register_protected_pack_hook`."""
    try:
        return pack_hook in _protected_pack_hooks
    except TypeError:  # an object that takes no weak reference was never registered
        return False


# What the version guard stores when pack returned something sharing the saved storage:
# ``(_ALIASED, packed, source, version)``. A plain tuple is the cheapest record to build; no user
# object can start with this private marker.
_ALIASED = object()


class VersionGuard:
    """The default guard: raise autograd's in-place error instead of unpacking changed data.

    See NOTE [Guarding saved tensors that pack returned as-is].
    """

    lets_saved_tensors_change = False
    version_check_may_be_inlined = True

    def wrap(self, pack_hook: PackHook, unpack_hook: UnpackHook) -> tuple[PackHook, UnpackHook]:
        """Return ``(pack_hook, unpack_hook)`` with the version check around them."""

        def pack(tensor: torch.Tensor) -> object:
            packed = pack_hook(tensor)
            if packed is tensor:
                return (_ALIASED, packed, packed, tensor._version)
            if may_share_storage(packed, tensor):
                # Read the version through a tensor that shares the version counter. Holding
                # ``tensor`` itself would add a reference cycle when it is the output of the very
                # node that saves it; a detached alias holds no graph.
                return (_ALIASED, packed, tensor.detach(), tensor._version)
            return packed

        register_protected_pack_hook(pack)

        def unpack(stored: Any) -> torch.Tensor:
            if type(stored) is tuple and len(stored) == 4 and stored[0] is _ALIASED:
                _, packed, source, version = stored
                if source._version != version:
                    raise modified_error(source, version)
                return unpack_hook(packed)
            return unpack_hook(stored)

        return pack, unpack


class _GuardState(threading.local):
    def __init__(self) -> None:
        self.guard: SaveGuard = _VERSION_GUARD


_VERSION_GUARD = VersionGuard()
_guard_state = _GuardState()


def current_save_guard() -> SaveGuard:
    """Return the save guard in force on this thread."""
    return _guard_state.guard


@contextlib.contextmanager
def use_save_guard(guard: SaveGuard) -> Generator[None, None, None]:
    """Make ``guard`` wrap every pair of hooks pushed by tensorhooks on this thread, then restore.

    Pairs pushed before entering keep the guard they were pushed with.
    """
    previous = _guard_state.guard
    _guard_state.guard = guard
    try:
        yield
    finally:
        _guard_state.guard = previous
