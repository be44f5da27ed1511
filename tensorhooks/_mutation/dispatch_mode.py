"""The dispatch mode that clones saved tensors just before an operator writes them.

Every operator run inside a context goes through `_torch_dispatch`: an operator that writes
nothing is called straight through (`op_writes`); one that writes first has every open context
(`context_state`) clone what it can reach; a new autograd node is when hooks the context did not
install are looked for (`foreign_hooks`). See NOTE [Clone before write] in `context.py`.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from tensorhooks._core.compile import warn_compile_skipped
from tensorhooks._core.torch_compat import (
    OpOverload,
    UnwrappedDispatchMode,
    current_dispatch_mode,
    next_sequence_nr,
    op_call,
)

from .context_state import MutationContext
from .foreign_hooks import (
    ForeignSave,
    Untied,
    check_foreign_saves,
    foreign_saves,
    take_over_innermost_hooks,
    tie_foreign_saves,
)
from .op_writes import (
    READ_ONLY_OPS,
    SEEN_OPS,
    WRITING_OPS,
    WritingOp,
    tensors_in,
    written_arguments,
)

__all__ = ["add_open_context", "mode_for_this_thread", "remove_open_context"]

# The operator caches of `op_writes`, read on every operator, bound again by assignment: CPython
# compiles ``name.get(...)`` on a name that an import statement bound as an attribute load and a
# call (a bound method made per call) rather than as a method call.
_READ_ONLY_OPS = READ_ONLY_OPS
_WRITING_OPS = WRITING_OPS
_SEEN_OPS = SEEN_OPS

# Open contexts, on every thread; replaced (never mutated) under the lock so readers need none.
_open_contexts: tuple[MutationContext, ...] = ()
_open_contexts_lock = threading.Lock()


def add_open_context(context: MutationContext) -> None:
    """Have every write, on any thread, protect what ``context`` saves from now on."""
    global _open_contexts  # noqa: PLW0603 (replaced as a whole so readers need no lock)
    with _open_contexts_lock:
        _open_contexts = (*_open_contexts, context)


def remove_open_context(context: MutationContext) -> None:
    """Stop protecting what ``context`` saved: it is exiting."""
    global _open_contexts  # noqa: PLW0603 (replaced as a whole so readers need no lock)
    with _open_contexts_lock:
        _open_contexts = tuple(c for c in _open_contexts if c is not context)


def _first_call(func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Read which arguments ``func`` writes, cache it, then run it as later calls will."""
    written = written_arguments(func)
    call = op_call(func)
    _SEEN_OPS.append(func)
    if not written:
        _READ_ONLY_OPS[id(func)] = call
        return call(*args, **kwargs)
    _WRITING_OPS[id(func)] = WritingOp(call, written)
    return _dispatch_write(func, args, kwargs)


def _dispatch_write(func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Protect what ``func`` is about to write, then run it."""
    op = _WRITING_OPS.get(id(func))
    if op is None:
        return _first_call(func, args, kwargs)
    contexts = _open_contexts
    touched: list[tuple[MutationContext, list[int | None]]] = []
    for argument in op.written:
        position = argument.position
        value = args[position] if 0 <= position < len(args) else kwargs.get(argument.name)
        if isinstance(value, torch.Tensor):
            tensors: Sequence[torch.Tensor] = (value,)
            # Under a dispatch mode a list write leaves version counters alone: only a single
            # tensor's counter tells afterwards whether autograd counts the write.
            counted_later = True
        elif isinstance(value, (list, tuple)):
            tensors = [item for item in value if isinstance(item, torch.Tensor)]
            counted_later = False
        else:
            continue
        if foreign_saves:
            check_foreign_saves(func, tensors, argument.resizes)
        for context in contexts:
            keys = context._protect(tensors, argument.resizes, counted_later)
            if keys:
                touched.append((context, keys))
    result = op.call(*args, **kwargs)
    for context, keys in touched:
        context._seen_write(keys)
    return result


def _call_and_tie(
    mode: _CloneBeforeWriteMode,
    records: list[ForeignSave],
    func: OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Run ``func``; tie ``records`` to the node that saved them.

    See NOTE [Checking foreign saves in backward] in `foreign_hooks.py`.
    """
    call = _READ_ONLY_OPS.get(id(func))
    result = _dispatch_write(func, args, kwargs) if call is None else call(*args, **kwargs)
    outputs = tensors_in((result,))
    mode.untied = (records, [weakref.ref(output) for output in outputs])
    mode.sequence_nr = -1  # look again on the next operator, once autograd set grad_fn
    return result


def _torch_dispatch(
    self: _CloneBeforeWriteMode,
    func: OpOverload,
    types: Sequence[type],
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
) -> Any:
    sequence_nr = next_sequence_nr()
    if sequence_nr != self.sequence_nr:  # a node was created: it may have saved tensors
        self.sequence_nr = sequence_nr
        untied = self.untied
        if untied is not None:
            tie_foreign_saves(self, untied)
        records = take_over_innermost_hooks(self, func, args, kwargs or {})
        if records:
            return _call_and_tie(self, records, func, args, kwargs or {})
    call = _READ_ONLY_OPS.get(id(func))
    if call is None:
        return _dispatch_write(func, args, kwargs or {})
    if kwargs:
        return call(*args, **kwargs)
    return call(*args)


class _CloneBeforeWriteMode(UnwrappedDispatchMode):
    """Clones saved tensors that an operator is about to write.

    See NOTE [Clone before write] in `context.py`.
    """

    # The thread's node counter when last looked at, and the innermost pack hook known to be
    # safe then. See NOTE [Saved-tensor hooks the context did not install] in
    # `foreign_hooks.py`.
    sequence_nr = -1
    known_pack: object = None
    # Foreign saves and weak references to the outputs of the operator that saved them, until
    # the next operator ties them to its node. See NOTE [Checking foreign saves in backward] in
    # `foreign_hooks.py`.
    untied: Untied | None = None

    # Dynamo skips the handler's code (UnwrappedDispatchMode): no torch._disable_dynamo wrapper.
    __torch_dispatch__ = _torch_dispatch

    def __enter__(self) -> Any:
        entered = super().__enter__()  # type: ignore[no-untyped-call]  # untyped in torch
        self._active = True
        return entered

    def __exit__(self, *args: object) -> Any:
        self._active = False
        return super().__exit__(*args)  # type: ignore[no-untyped-call]  # untyped in torch

    def ignore_compile_internals(self) -> bool:  # type: ignore[override]  # asked of the instance
        """False, as for any mode; asked by Dynamo before it compiles a frame, so warn there.

        See NOTE [Contexts under torch.compile] in `_core/compile.py`.
        """
        if getattr(self, "_active", False):
            warn_compile_skipped("allow_mutation_on_saved_tensors")
        return False


def mode_for_this_thread() -> contextlib.AbstractContextManager[object]:
    """A new clone-before-write mode, or nothing if this thread's innermost mode is one already.

    One mode protects every open context, so a nested context adds none: each operator goes
    through one handler and each write protects each context once. A context entered under
    another mode pushes its own, which sees the operators that mode does not forward.
    """
    if isinstance(current_dispatch_mode(), _CloneBeforeWriteMode):
        return contextlib.nullcontext()
    return _CloneBeforeWriteMode()  # type: ignore[no-untyped-call]  # torch's __init__ is untyped
