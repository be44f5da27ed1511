"""Pack/unpack hooks for tensors saved for backward, and the switch that disables them.

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
# with the saved tensor (``torch._C._is_alias_of``), the guard records the saved tensor's version
# and re-checks it before calling unpack, raising autograd's own error on a mismatch. When pack
# made a real copy nothing is recorded and unpack is called directly. Guards are per thread and
# replaceable: ``allow_mutation_on_saved_tensors`` installs one that clones before writes instead
# of raising, so hooks pushed inside it keep its protection.
#
# The version guard's record is a plain tuple ``(_ALIASED, packed, source, version)``, the
# cheapest thing to build per save. ``save_on_cpu`` builds and checks the same record inline on
# its CPU path (one Python call fewer per save); a change to the record changes both places.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Generator
from typing import Any, Protocol

import torch

from ._errors import InvalidHookArgumentError, SavedTensorModifiedError

__all__ = [
    "PackHook",
    "SaveGuard",
    "SavedCopy",
    "UnpackHook",
    "VersionGuard",
    "current_save_guard",
    "disable_saved_tensors_hooks",
    "saved_tensors_hooks",
    "use_save_guard",
]

PackHook = Callable[[torch.Tensor], Any]
UnpackHook = Callable[[Any], torch.Tensor]

# Not in torch's stubs; True when two tensors share a storage.
_is_alias_of: Callable[[torch.Tensor, torch.Tensor], bool] = torch._C._is_alias_of  # type: ignore[attr-defined]
_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_pop_hooks = torch._C._autograd._pop_saved_tensors_default_hooks
# The sequence number the next autograd node created on this thread will get.
_peek_sequence_nr: Callable[[], int] = torch._C._autograd._get_sequence_nr


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
    return grad_fn is not None and grad_fn._sequence_nr() == _peek_sequence_nr() - 1


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

    def wrap(self, pack_hook: PackHook, unpack_hook: UnpackHook) -> tuple[PackHook, UnpackHook]:
        """Return the pack/unpack pair to push in place of ``(pack_hook, unpack_hook)``."""
        ...


def _aliases(packed: object, tensor: torch.Tensor) -> bool:
    """Whether ``packed`` (a tensor, or a tuple/list of them) shares ``tensor``'s storage."""
    if isinstance(packed, torch.Tensor):
        return _is_alias_of(packed, tensor)
    if isinstance(packed, (tuple, list)):
        return any(
            isinstance(item, torch.Tensor) and (item is tensor or _is_alias_of(item, tensor))
            for item in packed
        )
    return False


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


# What the version guard stores when pack returned something sharing the saved storage:
# ``(_ALIASED, packed, source, version)``. A plain tuple is the cheapest record to build; no user
# object can start with this private marker.
_ALIASED = object()


class VersionGuard:
    """The default guard: raise autograd's in-place error instead of unpacking changed data.

    See NOTE [Guarding saved tensors that pack returned as-is].
    """

    def wrap(self, pack_hook: PackHook, unpack_hook: UnpackHook) -> tuple[PackHook, UnpackHook]:
        """Return ``(pack_hook, unpack_hook)`` with the version check around them."""

        def pack(tensor: torch.Tensor) -> object:
            packed = pack_hook(tensor)
            if packed is tensor:
                return (_ALIASED, packed, packed, tensor._version)
            if _aliases(packed, tensor):
                # Read the version through a tensor that shares the version counter. Holding
                # ``tensor`` itself would add a reference cycle when it is the output of the very
                # node that saves it; a detached alias holds no graph.
                return (_ALIASED, packed, tensor.detach(), tensor._version)
            return packed

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


class saved_tensors_hooks:
    """Context manager that sets a pair of pack/unpack hooks for tensors saved for backward.

    Inside the context, ``pack_hook`` is called every time an operation saves a tensor for
    backward (built-in ops and custom Functions' ``save_for_backward`` alike), and autograd
    stores what it returns. When backward needs the tensor, ``unpack_hook`` gets that object back
    and must return a tensor with the same content as the one given to ``pack_hook``.

    Same semantics as `torch.autograd.graph.saved_tensors_hooks`, plus one safety net: if
    ``pack_hook`` returns the tensor it was given, or anything sharing its storage, and that
    tensor is then changed in place before backward, unpacking raises autograd's own in-place
    error instead of handing back the changed data.

    Example:
        >>> import torch, tensorhooks
        >>> a = torch.ones(3, requires_grad=True)
        >>> with tensorhooks.saved_tensors_hooks(lambda t: t.to(torch.bfloat16),
        ...                                      lambda t: t.to(torch.float32)):
        ...     y = (a * a).sum()
        >>> y.backward()
        >>> a.grad
        tensor([2., 2., 2.])

    Args:
        pack_hook: ``pack_hook(tensor) -> Any``, called when a tensor is saved.
        unpack_hook: ``unpack_hook(packed) -> Tensor``, called when backward needs it.

    Raises:
        RuntimeError: on entry, if hooks are disabled by ``disable_saved_tensors_hooks`` (the
            message is the one given there).
        SavedTensorModifiedError: during backward, if a tensor that pack returned as-is was
            changed in place after it was saved (a ``RuntimeError``).

    Nesting and threads: only the innermost pair is applied, as in torch. The hooks in force are
    per thread; a context entered on one thread does not affect forward passes on another. The
    hooks stored with a saved tensor are called by backward on whatever thread runs it. The same
    instance may be entered several times, nested or from several threads.
    """

    def __init__(self, pack_hook: PackHook, unpack_hook: UnpackHook) -> None:
        for name, value in (("pack_hook", pack_hook), ("unpack_hook", unpack_hook)):
            if callable(value):
                continue
            raise InvalidHookArgumentError(
                f"saved_tensors_hooks: {name} must be callable, got {value!r} of type "
                f"{type(value).__name__}; pass a function such as `lambda t: t.clone()`"
            )
        self.pack_hook = pack_hook
        self.unpack_hook = unpack_hook

    def __enter__(self) -> None:
        pack, unpack = _guard_state.guard.wrap(self.pack_hook, self.unpack_hook)
        _push_hooks(pack, unpack)

    def __exit__(self, *args: object) -> None:
        _pop_hooks()


@contextlib.contextmanager
def disable_saved_tensors_hooks(error_message: str) -> Generator[None, None, None]:
    """Context manager that disables saved-tensor hooks, for features that cannot take them.

    While it is active, entering any saved-tensor hooks context (tensorhooks' or torch's)
    raises ``RuntimeError(error_message)``. On exit, by any path, the previous state is restored,
    including the message of an enclosing ``disable_saved_tensors_hooks``.

    Example:
        >>> import tensorhooks
        >>> with tensorhooks.disable_saved_tensors_hooks("no hooks in this region"):
        ...     with tensorhooks.saved_tensors_hooks(lambda t: t, lambda t: t):
        ...         pass
        Traceback (most recent call last):
        ...
        RuntimeError: no hooks in this region

    Args:
        error_message: the message of the ``RuntimeError`` raised when hooks are used while
            disabled.

    Raises:
        TypeError: if ``error_message`` is not a string.
        RuntimeError: ``error_message``, on entry, if saved-tensor hooks are in force.

    Nesting and threads: nests; the innermost message applies and the outer one is back after
    the inner context exits. The disabled state is per thread, as in torch. Entering it while
    saved-tensor hooks are in force raises ``RuntimeError(error_message)`` at once (torch's
    semantics), and leaves the previous state in place.
    """
    if not isinstance(error_message, str):
        raise InvalidHookArgumentError(
            f"disable_saved_tensors_hooks: error_message must be a str, got {error_message!r} "
            f"of type {type(error_message).__name__}"
        )
    previous = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message()
    try:
        # Inside the try: when hooks are already in force, torch records the message and then
        # raises it, and the state must still be restored.
        torch._C._autograd._saved_tensors_hooks_disable(error_message)
        yield
    finally:
        if previous is None:
            torch._C._autograd._saved_tensors_hooks_enable()
        else:
            torch._C._autograd._saved_tensors_hooks_disable(previous)
