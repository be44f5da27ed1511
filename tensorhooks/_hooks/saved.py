"""Pack/unpack hooks for tensors saved for backward, and the switch that disables them.

Both pairs pushed here are wrapped by the save guard in force (see `_core.guards`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator

from torch.autograd import graph as torch_graph
from torch.compiler import is_compiling

from tensorhooks._core.compile import not_traced
from tensorhooks._core.errors import HookArgumentTypeError
from tensorhooks._core.guards import PackHook, UnpackHook, current_save_guard
from tensorhooks._core.torch_compat import (
    disable_saved_tensors_hooks_with,
    enable_saved_tensors_hooks,
    get_disabled_hooks_message,
    pop_saved_tensors_hooks,
    push_saved_tensors_hooks,
)

__all__ = ["disable_saved_tensors_hooks", "saved_tensors_hooks"]


class saved_tensors_hooks(torch_graph.saved_tensors_hooks):
    """Context manager that sets a pair of pack/unpack hooks for tensors saved for backward.

    Inside the context, ``pack_hook`` is called every time an operation saves a tensor for
    backward (built-in ops and custom Functions' ``save_for_backward`` alike), and autograd
    stores what it returns. When backward needs the tensor, ``unpack_hook`` gets that object back
    and must return a tensor with the same content as the one given to ``pack_hook``.

    Same semantics as `torch.autograd.graph.saved_tensors_hooks`, plus one safety net: if
    ``pack_hook`` returns the tensor it was given, or anything sharing its storage, and that
    tensor is then changed in place before backward, unpacking raises autograd's own in-place
    error instead of handing back the changed data. A subclass of torch's class, so that code
    asking ``isinstance(ctx, torch.autograd.graph.saved_tensors_hooks)`` takes it as torch's.

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
        HookArgumentTypeError: if ``pack_hook`` or ``unpack_hook`` is not callable (a
            ``TypeError``).
        RuntimeError: on entry, if hooks are disabled by ``disable_saved_tensors_hooks`` (raised
            by torch, with the message given there).
        SavedTensorModifiedError: during backward, if a tensor that pack returned as-is was
            changed in place after it was saved (a ``RuntimeError``).

    Nesting and threads: only the innermost pair is applied, as in torch. The hooks in force are
    per thread; a context entered on one thread does not affect forward passes on another. The
    hooks stored with a saved tensor are called by backward on whatever thread runs it. The same
    instance may be entered several times, nested or from several threads.
    """

    @not_traced("saved_tensors_hooks")  # See NOTE [Contexts under torch.compile]
    def __init__(self, pack_hook: PackHook, unpack_hook: UnpackHook) -> None:
        for name, value in (("pack_hook", pack_hook), ("unpack_hook", unpack_hook)):
            if callable(value):
                continue
            raise HookArgumentTypeError(
                f"saved_tensors_hooks: {name} must be callable, got {value!r} of type "
                f"{type(value).__name__}; pass a function such as `lambda t: t.clone()`"
            )
        # What torch's __init__ does, without calling it: in save_on_cpu, which also derives from
        # torch's save_on_cpu, the next __init__ in line is that one, which takes other arguments.
        self.pack_hook = pack_hook
        self.unpack_hook = unpack_hook

    @not_traced("saved_tensors_hooks")
    def __enter__(self) -> None:
        pack, unpack = current_save_guard().wrap(self.pack_hook, self.unpack_hook)
        push_saved_tensors_hooks(pack, unpack)

    @not_traced("saved_tensors_hooks")
    def __exit__(self, *args: object) -> None:
        pop_saved_tensors_hooks()


def disable_saved_tensors_hooks(error_message: str) -> contextlib.AbstractContextManager[None]:
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
        HookArgumentTypeError: if ``error_message`` is not a string (a ``TypeError``).
        RuntimeError: on entry, if saved-tensor hooks are in force (raised by torch, with
            ``error_message``).

    Nesting and threads: nests; the innermost message applies and the outer one is back after
    the inner context exits. The disabled state is per thread, as in torch. Entering it while
    saved-tensor hooks are in force raises ``RuntimeError(error_message)`` at once (torch's
    semantics), and leaves the previous state in place.
    """
    if not isinstance(error_message, str):
        raise HookArgumentTypeError(
            f"disable_saved_tensors_hooks: error_message must be a str, got {error_message!r} "
            f"of type {type(error_message).__name__}"
        )
    if is_compiling():  # Dynamo traces torch's natively. See NOTE [Contexts under torch.compile]
        return torch_graph.disable_saved_tensors_hooks(error_message)
    return _disabled(error_message)


@contextlib.contextmanager
def _disabled(error_message: str) -> Generator[None, None, None]:
    previous = get_disabled_hooks_message()
    try:
        # Inside the try: when hooks are already in force, torch records the message and then
        # raises it, and the state must still be restored.
        disable_saved_tensors_hooks_with(error_message)
        yield
    finally:
        if previous is None:
            enable_saved_tensors_hooks()
        else:
            disable_saved_tensors_hooks_with(previous)
