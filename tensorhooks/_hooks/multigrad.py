"""Hooks that fire once per backward for a group of tensors: when all, or any, got a gradient.

See NOTE [Counting the gradients an "all" hook waits for].
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Literal, cast

import torch
from torch.utils.hooks import RemovableHandle

from tensorhooks._core.compile import runs_eagerly
from tensorhooks._core.errors import HookArgumentTypeError, HookArgumentValueError
from tensorhooks._core.graph import grad_node
from tensorhooks._core.store import GraphTaskState, graph_task_store
from tensorhooks._core.torch_compat import fsdp2_sharded_parameters, will_engine_execute_nodes

__all__ = ["MultiGradHandle", "register_multi_grad_hook"]

# NOTE [Counting the gradients an "all" hook waits for]
#
# A multi-grad hook in mode "all" registers one tensor hook per distinct tensor and must call
# ``fn`` exactly once per backward, after the last of those hooks that will fire in that
# backward. When the first of its hooks fires in a graph task, the hook asks the engine, for each
# tensor's node (``grad_fn``, or the gradient accumulator of a leaf), whether that node runs in
# this task (``will_engine_execute_node`` of `_core.torch_compat`), and counts the hooks to wait
# for.
# All of it (the expected count, the calls seen so far, the buffered grads) lives in the
# graph-task store under a key private to the hook, so concurrent backward calls never share a
# counter and nothing survives the task, whether backward succeeded or raised.
#
# One place where the engine cannot answer: ``autograd.grad(..., inputs=leaf)`` makes it raise for
# a captured leaf's accumulator (pytorch issue 131753). A captured leaf's tensor hook does fire,
# so that counts as "runs". Should the count ever be too high for another reason (a hook the
# engine says will run but that does not), the hook still must not be lost: the first "all" hook
# of a task registers one end-of-task callback that fires every ``fn`` whose count was never
# reached, with the grads seen so far. ``fn`` runs exactly once per backward either way, with
# exactly the grads whose hooks fired; the property tests compare that set with plain tensor
# hooks on random programs.


AllHook = Callable[[Sequence[torch.Tensor | None]], None]
AnyHook = Callable[[torch.Tensor], None]
_MODES = ("all", "any")


class _Registration:
    """Whether a multi-grad hook was removed; its end-of-task flush asks before calling ``fn``."""

    __slots__ = ("removed",)

    def __init__(self) -> None:
        self.removed = False


class MultiGradHandle(RemovableHandle):
    """Removes every tensor hook of one multi-grad hook; picklable like torch's handle."""

    handles: tuple[RemovableHandle, ...]

    def __init__(
        self, handles: tuple[RemovableHandle, ...], registration: _Registration | None = None
    ) -> None:
        self.handles = handles
        self.registration = registration or _Registration()

    def remove(self) -> None:
        """Remove the hook from every tensor. Calling it again does nothing."""
        self.registration.removed = True
        for handle in self.handles:
            handle.remove()

    def __getstate__(self) -> tuple[int, ...]:
        # The hooks themselves are closures over autograd nodes and cannot be pickled (torch's
        # handle fails here). As with a RemovableHandle whose dict is gone, the unpickled copy
        # is inert: its remove() does nothing, and the original keeps working.
        return tuple(handle.id for handle in self.handles)

    def __setstate__(self, state: tuple[int, ...]) -> None:
        handles = []
        for hook_id in state:
            handle = RemovableHandle.__new__(RemovableHandle)
            handle.__setstate__((None, hook_id))
            handles.append(handle)
        self.handles = tuple(handles)
        self.registration = _Registration()


class _AllState:
    """What one "all" hook keeps in one graph task."""

    __slots__ = ("calls", "fired", "fn", "grads", "last", "registration")

    def __init__(self, expected: int, size: int, fn: AllHook, registration: _Registration) -> None:
        # ``next(calls)`` is atomic under the GIL: exactly one hook call draws ``last``.
        self.calls = itertools.count()
        self.last = expected - 1
        self.fired = False
        self.fn = fn
        self.registration = registration
        self.grads: list[torch.Tensor | None] = [None] * size


_PENDING = object()  # store key: the "all" states of a task, flushed at its end


def _flush_pending(pending: list[_AllState]) -> None:
    """End of a graph task: fire the hooks whose expected count was never reached.

    A state exists only once one of its hooks was called, so each one left unfired here owes
    exactly one call, unless its handle was removed meanwhile (torch then never calls it). End
    callbacks run after every node of the task, so no hook races this.
    """
    for state in pending:
        if not state.fired and not state.registration.removed:
            state.fired = True
            state.fn(state.grads)


def _pending_states(task: GraphTaskState) -> list[_AllState]:
    """The task's list of "all" states, created with its end-of-task flush on first use."""
    pending: list[_AllState] | None = task.peek(_PENDING)
    if pending is None:
        candidate: list[_AllState] = []
        # If hooks on two device threads race, one list wins and only the winner registers the
        # flush.
        pending = task.claim(_PENDING, candidate)
        if pending is candidate:
            task.on_end(functools.partial(_flush_pending, pending))
    return pending


def _register_all(
    tensors: Sequence[torch.Tensor], fn: AllHook, registration: _Registration
) -> tuple[RemovableHandle, ...]:
    key = object()
    size = len(tensors)
    groups = _positions(tensors)
    # Every node before any hook: a backward on another thread may fire one at once.
    nodes = [grad_node(tensors[positions[0]]) for positions in groups.values()]
    current = graph_task_store.current

    def new_state(task: GraphTaskState) -> _AllState:
        # See NOTE [Counting the gradients an "all" hook waits for].
        expected = will_engine_execute_nodes(nodes)
        candidate = _AllState(expected, size, fn, registration)
        state: _AllState = task.claim(key, candidate)
        if state is candidate:
            _pending_states(task).append(state)
        return state

    def make_hook(positions: tuple[int, ...]) -> Callable[[torch.Tensor], None]:
        @runs_eagerly  # See NOTE [Contexts under torch.compile]
        def hook(grad: torch.Tensor) -> None:
            task = current()
            state: _AllState = task.peek(key) or new_state(task)
            grads = state.grads
            for position in positions:
                grads[position] = grad
            if next(state.calls) == state.last:
                state.fired = True
                fn(grads)

        return hook

    return tuple(
        [
            tensors[positions[0]].register_hook(make_hook(positions))  # type: ignore[no-untyped-call]  # untyped in torch's stubs
            for positions in groups.values()
        ]
    )


def _register_any(tensors: Sequence[torch.Tensor], fn: AnyHook) -> tuple[RemovableHandle, ...]:
    key = object()

    @functools.wraps(fn)
    @runs_eagerly  # See NOTE [Contexts under torch.compile]
    def hook(grad: torch.Tensor) -> None:
        task = graph_task_store.current()
        claim = object()
        # Exactly one hook call per graph task wins the claim.
        if task.claim(key, claim) is claim:
            fn(grad)

    # As torch's: a tensor listed twice gets the hook twice, and the claim lets one call through.
    return tuple(
        [
            tensor.register_hook(hook)  # type: ignore[no-untyped-call]  # untyped in torch's stubs
            for tensor in tensors
            if tensor.requires_grad
        ]
    )


def register_multi_grad_hook(
    tensors: Sequence[torch.Tensor],
    fn: AllHook | AnyHook,
    *,
    mode: Literal["all", "any"] = "all",
) -> RemovableHandle:
    """Register a hook that fires once per backward for a group of tensors.

    In mode ``"all"``, ``fn(grads)`` is called once per backward call in which any of
    ``tensors`` receives a gradient, after every tensor whose gradient is computed in that call
    has it. ``grads[i]`` is the gradient of ``tensors[i]``, or ``None`` when it was not computed
    (not part of the graph, not needed for the ``inputs`` of the call, or not requiring grad).
    In mode ``"any"``, ``fn(grad)`` is called once per backward call, with the first gradient
    computed for any of ``tensors``.

    Same semantics as `torch.autograd.graph.register_multi_grad_hook`, and also: no state
    is kept after any backward call, successful or not; the counting is exact when many threads
    run backward at once; ``torch.autograd.grad`` with leaf ``inputs`` works; a tensor listed
    twice gets its gradient in both positions; tensors that do not require grad are accepted in
    mode ``"all"`` and always get ``None`` (torch raises).

    Example:
        >>> import torch, tensorhooks
        >>> a = torch.rand(2, 3, requires_grad=True)
        >>> b = torch.rand(2, 3, requires_grad=True)
        >>> c = a * b
        >>> handle = tensorhooks.register_multi_grad_hook(
        ...     (a, b, c), lambda grads: print([g is not None for g in grads]))
        >>> c.sum().backward(retain_graph=True)
        [True, True, True]
        >>> c.sum().backward(inputs=(a,))
        [True, False, True]
        >>> handle.remove()

    Args:
        tensors: the tensors to watch.
        fn: ``fn(grads: Sequence[Tensor | None])`` in mode ``"all"``, ``fn(grad: Tensor)`` in
            mode ``"any"``. It must not modify its arguments.
        mode: ``"all"`` (default) or ``"any"``.

    Returns:
        A handle whose ``remove()`` unregisters the hook; it pickles like torch's.

    Raises:
        HookArgumentValueError: if ``mode`` is not ``"all"`` or ``"any"``, ``tensors`` is empty,
            so that ``fn`` would never be called, or a tensor is a parameter sharded by FSDP2
            (``fully_shard``), which autograd never gives a gradient: use its
            ``register_post_accumulate_grad_hook`` (a ``ValueError``).
        HookArgumentTypeError: if ``tensors`` is a single tensor or holds something that is not
            a tensor, or ``fn`` is not callable (a ``TypeError``).

    Threads: the hook may be registered on one thread and fire on any; concurrent backward
    calls each get their own count, and ``fn`` may run concurrently for different calls.

    Lifetime: as in torch, the hook holds the gradient accumulators of leaf tensors, which keeps
    those leaves alive until ``handle.remove()``; non-leaf tensors are not kept alive.
    """
    if mode not in _MODES:
        # torch's own text first, so that code matching torch's message keeps working.
        raise HookArgumentValueError(
            f"register_multi_grad_hook: Expects mode to be one of {_MODES} but got {mode}. The "
            "mode must be one of 'all' (fn gets every gradient of the call) or 'any' (fn gets "
            "the first one)"
        )
    if isinstance(tensors, torch.Tensor):  # type: ignore[unreachable]  # a common mistake, checked at runtime
        raise HookArgumentTypeError(
            "register_multi_grad_hook: tensors must be a sequence of tensors, got a single "
            "Tensor; wrap it in a list: register_multi_grad_hook([tensor], fn)"
        )
    given = tensors
    try:
        tensors = tuple(tensors)
    except TypeError as error:  # torch fails later, with this text, on len() or iteration
        raise HookArgumentTypeError(
            f"register_multi_grad_hook: tensors must be a sequence of tensors, got {tensors!r} "
            f"of type {type(tensors).__name__} ({error}); pass a list such as [a, b]"
        ) from None
    if not tensors:  # torch registers nothing and never calls fn, without a word
        raise HookArgumentValueError(
            f"register_multi_grad_hook: tensors is empty (got {given!r}), so fn would never be "
            "called; pass the tensors whose gradients fn waits for, such as "
            "list(model.parameters()), or do not register a hook for an empty group"
        )
    # One look at the types on the common path: Tensors and Parameters need no further check.
    subclassed = not _PLAIN_TYPES.issuperset(map(type, tensors))
    if subclassed:
        _check_tensors(tensors)
    if not callable(fn):
        raise HookArgumentTypeError(
            f"register_multi_grad_hook: fn must be callable, got {fn!r} of type {type(fn).__name__}"
        )
    if subclassed:  # sharded parameters are DTensors: plain tensors need no look-up
        _refuse_fsdp2_sharded(tensors)
    registration = _Registration()
    if mode == "all":
        handles = _register_all(tensors, cast(AllHook, fn), registration)
    else:
        handles = _register_any(tensors, cast(AnyHook, fn))
    return MultiGradHandle(handles, registration)


# The types of tensors that cannot be FSDP2-sharded parameters: ``nn.Parameter(dtensor)`` is a
# DTensor, not a Parameter (``Parameter.__new__`` keeps the type of a subclass).
_PLAIN_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})


def _check_tensors(tensors: Sequence[object]) -> None:
    """Raise for an item of ``tensors`` that is not a tensor.

    Raises:
        HookArgumentTypeError: naming the first such item.
    """
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise HookArgumentTypeError(
                f"register_multi_grad_hook: tensors[{index}] is {tensor!r} of type "
                f"{type(tensor).__name__}, not a torch.Tensor; pass only tensors"
            )


def _positions(tensors: Sequence[torch.Tensor]) -> dict[int, tuple[int, ...]]:
    """The positions of each distinct tensor that can get a gradient, by the tensor's id.

    An "all" hook registers one tensor hook per distinct tensor; a tensor listed twice fills
    every position it appears at.
    """
    groups: dict[int, tuple[int, ...]] = {}
    for index, tensor in enumerate(tensors):
        if tensor.requires_grad:
            key = id(tensor)
            groups[key] = (*groups[key], index) if key in groups else (index,)
    return groups


def _refuse_fsdp2_sharded(tensors: Sequence[torch.Tensor]) -> None:
    """Raise for a parameter sharded by FSDP2: autograd never gives it a gradient to hook."""
    sharded = fsdp2_sharded_parameters()
    for index, tensor in enumerate(tensors):
        if id(tensor) in sharded:
            raise HookArgumentValueError(
                f"register_multi_grad_hook: tensors[{index}] is a parameter sharded by FSDP2 "
                "(fully_shard), which autograd never gives a gradient: FSDP2 sets its .grad "
                "after the reduce-scatter, so the hook would never fire. Use "
                "param.register_post_accumulate_grad_hook(hook) on each sharded parameter "
                "(FSDP2 runs those once the sharded gradient is set) and count the calls"
            )
