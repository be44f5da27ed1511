"""checkpoint: activation checkpointing on saved-tensor hooks, with its state in the store.

See NOTE [Checkpointing on saved-tensor hooks] below.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, overload

import torch
from torch.utils import checkpoint as torch_checkpoint
from torch.utils.checkpoint import CheckpointError

from tensorhooks._core.errors import CheckpointArgumentValueError, SavedTensorModifiedError
from tensorhooks._core.guards import (
    SavedCopy,
    current_save_guard,
    modified_error,
    modified_message,
    register_protected_pack_hook,
)
from tensorhooks._core.store import graph_task_store
from tensorhooks._core.torch_compat import (
    PYTHON_DISPATCH_KEY,
    current_graph_task_id,
    is_dispatch_key_excluded,
    make_saved_tensor,
    pop_saved_tensors_hooks,
    push_saved_tensors_hooks,
    set_dispatch_key_excluded,
    top_saved_tensors_hooks,
    torch_checkpoint_debug_override,
    torch_checkpoint_debug_tools,
    torch_checkpoint_early_stop_override,
)

from .policies import SelectiveForward, adopt_contexts

__all__ = ["checkpoint", "is_recomputing", "noop_context_fn"]

# NOTE [Checkpointing on saved-tensor hooks]
#
# Inside a region the pack hook keeps no tensor: it returns a `_Holder` (the region's frame and
# the save's position). The region's tensor inputs are saved the way a node saves them, through
# whatever hooks are in force outside the region (``save_on_cpu`` offloads them, an enclosing
# checkpoint holds them, user hooks see them). The first unpack of a holder in a graph task runs
# the function again under a recomputation hook that keeps each saved tensor by position, and
# stops (``_StopRecomputation``) once the last position is reached (early stop). What was
# recomputed lives in the graph-task store under the frame, so it is released when the task ends
# whether backward succeeded, raised part-way or stopped early, and a second backward over a
# retained graph (a new task) recomputes again. Each position is handed out once per task.
#
# Inputs. Every tensor argument is an input of the region, however it is passed: positional,
# keyword, or inside a list, tuple (named or not) or dict argument (`_Arguments` takes them out
# and rebuilds those containers around the saved tensors in recomputation; a container with no
# tensor in it is passed as itself). Keeping a keyword or nested tensor by reference instead
# would let a write to it, inside the region or before backward, reach recomputation unseen:
# a silently wrong gradient. Tensors inside other objects are tensors from elsewhere (below).
#
# Recomputation replays what the forward pass ran under: the CPU and device RNG states, the
# autocast state of the CPU and of the inputs' device, the default device, and the second
# context of ``context_fn``. It then checks (``determinism_check="default"``) that as many
# tensors were saved as in the forward pass, with the same shape, dtype and device.
#
# In-place writes. The forward pass notes whether the function changes a tensor input in place;
# recomputation then runs on clones of the inputs, so a second recomputation starts from the
# same values. A recomputed tensor that the function changes in place after saving it (a write
# inside the region) would reach backward changed: after each recomputation the kept tensors'
# versions are compared with their versions when kept, and on a difference the recomputation
# runs once more keeping clones (and keeps clones from then on). So backward always reads the
# save-time value, where plain autograd would raise its in-place error and torch's checkpoint
# silently uses the changed value.
#
# A cycle. An input that the forward pass changes in place gets a ``grad_fn`` inside the region,
# whose nodes hold the holders, which hold the frame. Were the frame to hold the input still,
# that cycle would run through autograd's C++ nodes, where the garbage collector cannot follow
# it, and the graph would leak. Saved with no hooks in force, such an input can only raise
# autograd's in-place error at unpack, so the frame keeps that error (with a detached alias for
# its message) instead of the input.
#
# Tensors from elsewhere. A tensor that the function reaches other ways (a closure, a module
# attribute) is read again by recomputation. The saved tensors still alive when the forward
# pass ends are those (and the inputs, which their saved form checks); the frame keeps a weak
# reference to each and its version then. One whose version moved before a recomputation was
# changed in place in between; if recomputation saves that very tensor again, it read the
# changed value, and the unpack of that position raises autograd's in-place error, as plain
# autograd's unpack would (torch's checkpoint silently uses the changed value). Writes made by
# the region itself, in the forward pass or a recomputation, count as the region's: a function
# that writes the same values into a buffer on every run is not flagged.
#
# Both pairs are wrapped by the save guard of the thread that pushes them, like every pair of the
# toolkit, and registered as protected: the region's pack keeps no tensor data, and the
# recomputation's does the version check above itself.

_R = TypeVar("_R")

_REENTRANT_REFUSED = (
    "tensorhooks.checkpoint: use_reentrant=True is not supported. This checkpoint is built on "
    "saved-tensor hooks (torch's use_reentrant=False semantics): backward recomputes the region "
    "inside the outer backward call instead of running a nested one, so it works with "
    "torch.autograd.grad(), backward(inputs=...), keyword arguments, nesting and every "
    "tensorhooks context. Pass use_reentrant=False (or leave it out), or call "
    "torch.utils.checkpoint.checkpoint(..., use_reentrant=True) for the reentrant variant."
)


def noop_context_fn() -> tuple[contextlib.AbstractContextManager[None], ...]:
    """The default ``context_fn``: no context around the forward pass or the recomputation."""
    return contextlib.nullcontext(), contextlib.nullcontext()


def _metadata(tensor: torch.Tensor) -> tuple[torch.Size, torch.dtype, torch.device]:
    return tensor.shape, tensor.dtype, tensor.device


def _no_metadata(tensor: torch.Tensor) -> None:
    return None


_DETERMINISM_CHECKS: dict[str, Callable[[torch.Tensor], Any]] = {
    "default": _metadata,
    "none": _no_metadata,
}


class _StopRecomputation(Exception):  # noqa: N818 (a signal, not an error)
    """Raised by the recomputation hook once every needed tensor is kept (early stop)."""


class _Recomputing(threading.local):
    def __init__(self) -> None:
        self.depth = 0


_recomputing = _Recomputing()


def is_recomputing() -> bool:
    """Whether this thread is running a checkpointed function again, in backward.

    Forward hooks of modules run again during recomputation; hooks that register something
    (tensor hooks on parameters, multi-grad hooks) check this to register once per forward.

    Example:
        >>> import torch, tensorhooks
        >>> seen = []
        >>> def block(x):
        ...     seen.append(tensorhooks.is_recomputing())
        ...     return x.sin()
        >>> x = torch.ones(2, requires_grad=True)
        >>> tensorhooks.checkpoint(block, x).sum().backward()
        >>> seen
        [False, True]

    Returns:
        True inside a recomputation on this thread.
    """
    return _recomputing.depth > 0


class _Holder(SavedCopy):
    """What the region's pack hook returns: its frame and the position of the save."""

    __slots__ = ("__weakref__", "frame", "index")

    def __init__(self, frame: _Frame, index: int) -> None:
        self.frame = frame
        self.index = index


class _Outside:
    """A tensor the forward pass saved that outlived it (a closure's, a module's), by position.

    See NOTE [Checkpointing on saved-tensor hooks], "Tensors from elsewhere".
    """

    __slots__ = ("ref", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.ref = weakref.ref(tensor)
        self.version = tensor._version  # as the region's runs left it


class _Recomputation:
    """One graph task's recomputation of one region: the tensors kept, by position."""

    __slots__ = ("count", "done", "ignore_mismatch", "kept", "lock", "moved", "stale", "tensors")

    def __init__(self) -> None:
        self.tensors: dict[int, torch.Tensor] = {}
        # Positions of tensors from elsewhere changed since the forward pass: (now, expected).
        self.moved: dict[int, tuple[int, int]] = {}
        self.stale: dict[int, tuple[int, int]] = {}  # those of them recomputation read again
        self.kept: list[tuple[torch.Tensor, int]] = []
        self.count = 0
        self.done = False
        self.ignore_mismatch = False
        self.lock = threading.RLock()

    def reset(self) -> None:
        self.tensors.clear()
        self.stale.clear()
        self.kept.clear()
        self.count = 0
        self.ignore_mismatch = False

    def changed_in_place(self) -> bool:
        return any(tensor._version != version for tensor, version in self.kept)


def _requiring_grad(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.requires_grad else tensor.detach().requires_grad_()


class _Slot:
    """Where a tensor argument was: its index among the region's input tensors."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _Container:
    """A list, tuple or dict argument holding tensors, with a `_Slot` in place of each."""

    __slots__ = ("items", "keys", "kind")

    def __init__(self, kind: type, items: list[Any], keys: list[Any] | None) -> None:
        self.kind = kind
        self.items = items
        self.keys = keys

    def build(self, tensors: list[torch.Tensor]) -> Any:
        values = [_put_tensors(item, tensors) for item in self.items]
        if self.keys is not None:
            return dict(zip(self.keys, values, strict=True))
        if self.kind is list:
            return values
        if self.kind is tuple:
            return tuple(values)
        return self.kind(*values)  # a named tuple


def _is_container(value: object) -> bool:
    kind = type(value)
    return kind in (list, tuple, dict) or (
        isinstance(value, tuple) and hasattr(kind, "_fields") and hasattr(kind, "_make")
    )


def _take_tensors(value: Any, tensors: list[torch.Tensor], seen: dict[int, int]) -> Any:
    """``value`` with its tensors (also in lists, tuples, dicts) moved to ``tensors``, once each."""
    if isinstance(value, torch.Tensor):
        index = seen.get(id(value))
        if index is None:
            index = seen[id(value)] = len(tensors)
            tensors.append(value)
        return _Slot(index)
    if not _is_container(value):
        return value
    keys = list(value) if type(value) is dict else None
    originals = list(value) if keys is None else list(value.values())
    items = [_take_tensors(item, tensors, seen) for item in originals]
    if all(item is original for item, original in zip(items, originals, strict=True)):
        return value  # no tensor inside: passed as itself
    return _Container(type(value), items, keys)


def _put_tensors(template: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(template, _Slot):
        return tensors[template.index]
    if isinstance(template, _Container):
        return template.build(tensors)
    return template


class _Arguments:
    """A call's arguments with the tensors taken out.

    See NOTE [Checkpointing on saved-tensor hooks], "Inputs".
    """

    __slots__ = ("args", "kwargs")

    def __init__(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], tensors: list[torch.Tensor]
    ) -> None:
        seen: dict[int, int] = {}
        self.args = _take_tensors(args, tensors, seen)
        self.kwargs = _take_tensors(kwargs, tensors, seen)

    def rebuild(self, tensors: list[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments again, with ``tensors`` in the places the inputs were."""
        return _put_tensors(self.args, tensors), _put_tensors(self.kwargs, tensors)


def _save_inputs(tensors: list[torch.Tensor]) -> Callable[[], list[torch.Tensor]]:
    """Save ``tensors`` through the hooks in force; return a function that unpacks them."""
    if make_saved_tensor is not None:
        saved = [make_saved_tensor(tensor, is_output=False) for tensor in tensors]
        return lambda: [item.unpack() for item in saved]
    # Releases before 2.12: do what a node's SavedVariable does, by hand.
    top = top_saved_tensors_hooks() if top_saved_tensors_hooks is not None else None
    if top is not None:
        pack, unpack = top
        packed = [(pack(tensor), tensor.requires_grad) for tensor in tensors]
        # Hooks may hand back a detached tensor; a SavedVariable restores requires_grad, so the
        # recomputed ops save what the forward's saved.
        return lambda: [
            _requiring_grad(unpack(item)) if requires_grad else unpack(item)
            for item, requires_grad in packed
        ]
    versions = [tensor._version for tensor in tensors]

    def unpack_checked() -> list[torch.Tensor]:
        for tensor, version in zip(tensors, versions, strict=True):
            if tensor._version != version:
                raise modified_error(tensor, version)
        return list(tensors)

    return unpack_checked


class _RegionState:
    """The RNG, autocast and default-device state a region's forward pass ran under."""

    __slots__ = ("autocast", "cpu_rng", "default_device", "device_rng", "device_type")

    def __init__(self, tensors: list[torch.Tensor], preserve_rng_state: bool) -> None:
        devices = {t.device for t in tensors if t.device.type not in ("cpu", "meta")}
        self.device_type = next(iter(devices)).type if devices else None
        for device in devices:
            if device.type == "cuda":
                self.device_type = "cuda"
        self.cpu_rng = torch.get_rng_state() if preserve_rng_state else None
        self.device_rng: list[tuple[torch.device, torch.Tensor]] = []
        if preserve_rng_state and self.device_type is not None:
            module = getattr(torch, self.device_type)
            for device in sorted(devices, key=str):
                if device.type == self.device_type:
                    with module.device(device):
                        self.device_rng.append((device, module.get_rng_state()))
        types = ["cpu"] if self.device_type is None else ["cpu", self.device_type]
        self.autocast = [(kind, _autocast_state(kind)) for kind in types]
        self.default_device = torch.get_default_device()

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the body under the recorded state; restore the present one after."""
        with contextlib.ExitStack() as stack:
            if self.cpu_rng is not None:
                stack.enter_context(self._rng())
            for kind, state in self.autocast:
                if _autocast_state(kind) != state:
                    enabled, dtype, cache = state
                    stack.enter_context(
                        torch.autocast(kind, dtype=dtype, enabled=enabled, cache_enabled=cache)
                    )
            if torch.get_default_device() != self.default_device:
                stack.enter_context(self.default_device)
            yield

    @contextlib.contextmanager
    def _rng(self) -> Iterator[None]:
        assert self.cpu_rng is not None
        module = None if self.device_type is None else getattr(torch, self.device_type)
        cpu_now = torch.get_rng_state()
        devices_now = []
        if module is not None:
            for device, state in self.device_rng:
                with module.device(device):
                    devices_now.append((device, module.get_rng_state()))
                    module.set_rng_state(state)
        torch.set_rng_state(self.cpu_rng)
        try:
            yield
        finally:
            torch.set_rng_state(cpu_now)
            if module is not None:
                for device, state in devices_now:
                    with module.device(device):
                        module.set_rng_state(state)


def _autocast_state(kind: str) -> tuple[bool, torch.dtype, bool]:
    return (
        torch.is_autocast_enabled(kind),
        torch.get_autocast_dtype(kind),
        torch.is_autocast_cache_enabled(),
    )


def _device_initialized(device_type: str | None) -> bool:
    if device_type is None:
        return False
    is_initialized = getattr(getattr(torch, device_type, None), "is_initialized", None)
    return bool(is_initialized()) if callable(is_initialized) else False


class _Frame:
    """One call of `checkpoint`: how to run the region again, and what its forward saved."""

    __slots__ = (
        "__weakref__",
        "arguments",
        "clone_inputs",
        "clone_saves",
        "early_stop",
        "error_cb",
        "forward_completed",
        "holders",
        "inputs",
        "metadata",
        "metadata_fn",
        "outside",
        "recompute_context",
        "region",
        "run",
        "saved",
    )

    def __init__(
        self,
        run: Callable[..., Any],
        region: _RegionState,
        *,
        recompute_context: Any,
        early_stop: bool,
        metadata_fn: Callable[[torch.Tensor], Any],
        error_cb: Callable[[Exception], Any] | None,
    ) -> None:
        self.run = run
        self.region = region
        self.recompute_context = recompute_context
        self.early_stop = early_stop
        self.metadata_fn = metadata_fn
        self.error_cb = error_cb
        self.holders: list[weakref.ref[_Holder]] = []
        self.metadata: list[Any] = []
        self.saved: list[weakref.ref[torch.Tensor]] = []  # during the forward pass only
        self.outside: dict[int, _Outside] = {}
        self.inputs: Callable[[], list[torch.Tensor]] = list
        self.arguments = _Arguments((), {}, [])
        self.forward_completed = False
        self.clone_inputs = False
        self.clone_saves = False

    def pack(self, tensor: torch.Tensor) -> _Holder:
        """The region's pack hook: keep nothing but the position (and the metadata to check)."""
        holder = _Holder(self, len(self.holders))
        self.holders.append(weakref.ref(holder))
        self.metadata.append(self.metadata_fn(tensor))
        self.saved.append(weakref.ref(tensor))
        return holder

    def seal(self) -> None:
        """At the end of the forward pass: note the saved tensors that outlive it."""
        self.forward_completed = True
        for index, ref in enumerate(self.saved):
            tensor = ref()
            if tensor is not None:
                self.outside[index] = _Outside(tensor)
        self.saved = []

    def recompute(self, state: _Recomputation) -> None:
        """Run the region again, keeping its saved tensors in ``state``; check them."""
        starts = self._outside_versions()
        state.moved = {
            index: (now, self.outside[index].version)
            for index, now in starts.items()
            if now != self.outside[index].version
        }
        self._run_again(state)
        if state.changed_in_place():
            # See NOTE [Checkpointing on saved-tensor hooks], "In-place writes".
            self.clone_saves = True
            state.reset()
            self._run_again(state)
        state.kept.clear()
        self._advance_outside(starts)
        self._check(state)

    def _outside_versions(self) -> dict[int, int]:
        versions = {}
        for index, outside in self.outside.items():
            tensor = outside.ref()
            if tensor is not None:
                versions[index] = tensor._version
        return versions

    def _advance_outside(self, starts: dict[int, int]) -> None:
        """Count the recomputation's own writes to tensors from elsewhere as the region's."""
        for index, start in starts.items():
            outside = self.outside[index]
            tensor = outside.ref()
            if tensor is not None:
                outside.version += tensor._version - start

    def _run_again(self, state: _Recomputation) -> None:
        tensors = self.inputs()
        if self.clone_inputs:
            # Non-leaf clones (the function writes to them), connected to nothing that matters.
            with torch.enable_grad():
                tensors = [t.detach().requires_grad_(t.requires_grad).clone() for t in tensors]
        args, kwargs = self.arguments.rebuild(tensors)
        pack, unpack = current_save_guard().wrap(
            functools.partial(_keep_recomputed, self, state), _identity
        )
        register_protected_pack_hook(pack)
        push_saved_tensors_hooks(pack, unpack)
        _recomputing.depth += 1
        try:
            with torch.enable_grad(), self.region.replay(), self.recompute_context:
                self.run(*args, **kwargs)
        except _StopRecomputation:
            pass
        finally:
            _recomputing.depth -= 1
            pop_saved_tensors_hooks()

    def _check(self, state: _Recomputation) -> None:
        if state.ignore_mismatch:
            return
        if state.count != len(self.holders):
            raise CheckpointError(
                "tensorhooks.checkpoint: a different number of tensors was saved during the "
                f"forward pass ({len(self.holders)}) and during recomputation ({state.count}). "
                "The checkpointed function must run the same ops both times: look for "
                "branches on global state or on values that differ between the two runs, or "
                'pass determinism_check="none" if the difference is harmless.'
            )
        metadata_fn = self.metadata_fn
        differ = [
            f"tensor at position {index}: saved {self.metadata[index]}, recomputed {now}"
            for index, tensor in state.tensors.items()
            if (now := metadata_fn(tensor)) != self.metadata[index]
        ]
        if differ:
            raise CheckpointError(
                "tensorhooks.checkpoint: recomputed tensors differ from those saved in the "
                "forward pass (shape, dtype, device):\n"
                + "\n".join(differ)
                + '\nReplay the same state (autocast, dtypes) or pass determinism_check="none".'
            )


def _identity(value: Any) -> Any:
    return value


def _keep_recomputed(frame: _Frame, state: _Recomputation, tensor: torch.Tensor) -> torch.Tensor:
    """The recomputation's pack hook: keep the tensor saved at this position for backward."""
    index = state.count
    state.count = index + 1
    total = len(frame.holders)
    if index >= total:
        if not frame.forward_completed:  # backward inside the region's own forward pass
            state.ignore_mismatch = True
            return tensor
        raise CheckpointError(
            "tensorhooks.checkpoint: more tensors were saved during recomputation than during "
            f"the forward pass ({total}). The checkpointed function must run the same ops both "
            "times."
        )
    kept = tensor.detach() if tensor.requires_grad else tensor
    if frame.clone_saves:
        kept = _clone_below_modes(kept)
    if frame.holders[index]() is not None:  # else its node was already released
        state.tensors[index] = kept
        moved = state.moved.get(index)
        if moved is not None and frame.outside[index].ref() is tensor:
            state.stale[index] = moved  # See NOTE [Checkpointing...], "Tensors from elsewhere"
        state.kept.append((kept, kept._version))
    if frame.early_stop and index + 1 == total:
        raise _StopRecomputation
    return kept


def _clone_below_modes(tensor: torch.Tensor) -> torch.Tensor:
    """A clone that dispatch modes (a selective context, the user's) do not see.

    The forward pass made no such clone, so a mode counting ops must not count it.
    """
    was_excluded = is_dispatch_key_excluded(PYTHON_DISPATCH_KEY)
    set_dispatch_key_excluded(PYTHON_DISPATCH_KEY, True)
    try:
        return tensor.clone()
    finally:
        set_dispatch_key_excluded(PYTHON_DISPATCH_KEY, was_excluded)


def _unpack(holder: _Holder) -> torch.Tensor:
    """The region's unpack hook: recompute once per graph task, hand out each tensor once."""
    frame = holder.frame
    try:
        return _unpack_from(frame, holder.index)
    except CheckpointError as error:
        if frame.error_cb is not None:
            frame.error_cb(error)
        raise


def _unpack_from(frame: _Frame, index: int) -> torch.Tensor:
    if current_graph_task_id() == -1:
        # Outside backward (``grad_fn._saved_self``): a recomputation of its own, kept nowhere.
        state = _Recomputation()
        frame.recompute(state)
    else:
        task = graph_task_store.current()
        state = task.peek(frame)
        if state is None:
            state = task.claim(frame, _Recomputation())
        if not state.done:
            with state.lock:
                if not state.done:
                    frame.recompute(state)
                    state.done = True
    tensor = state.tensors.pop(index, None)
    if tensor is None:
        raise CheckpointError(
            "tensorhooks.checkpoint: a saved tensor of a checkpointed region was unpacked twice "
            "in one backward call. If a custom Function reads ctx.saved_tensors in backward, "
            "read it once and keep the result."
        )
    stale = state.stale.get(index)
    if stale is not None:
        raise _changed_outside_error(tensor, *stale)
    return tensor


def _raise_changed_input(tensor: torch.Tensor, version: int) -> Callable[[], list[torch.Tensor]]:
    """What unpacking the inputs would do, holding no ``grad_fn``: raise the in-place error."""
    alias = tensor.detach()

    def inputs() -> list[torch.Tensor]:
        raise SavedTensorModifiedError(
            modified_message(alias.type(), list(alias.shape), alias._version, version)
            + " Hint: the checkpointed function changed this argument in place, and "
            "recomputation needs its value from the call. Clone it before the call, or run "
            "under tensorhooks.allow_mutation_on_saved_tensors() to keep that value."
        )

    return inputs


def _changed_outside_error(
    tensor: torch.Tensor, version: int, expected: int
) -> SavedTensorModifiedError:
    return SavedTensorModifiedError(
        modified_message(tensor.type(), list(tensor.shape), version, expected)
        + " Hint: the checkpointed function reads this tensor from outside its arguments (a "
        "closure, a module attribute), and it was changed in place between the forward pass "
        "and backward, so recomputation would use the changed value. Pass it to checkpoint as "
        "an argument (then allow_mutation_on_saved_tensors() keeps its saved value), or change "
        "it after backward."
    )


@overload
def checkpoint(
    function: None = None,
    *,
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    context_fn: Callable[[], tuple[Any, ...]] = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
) -> Callable[[Callable[..., _R]], Callable[..., _R]]: ...


@overload
def checkpoint(
    function: Callable[..., _R],
    *args: Any,
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    context_fn: Callable[[], tuple[Any, ...]] = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    **kwargs: Any,
) -> _R: ...


def checkpoint(
    function: Callable[..., Any] | None = None,
    *args: Any,
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    context_fn: Callable[[], tuple[Any, ...]] = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    **kwargs: Any,
) -> Any:
    """Run ``function(*args, **kwargs)`` without keeping its activations; recompute them later.

    A drop-in for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: the tensors
    the function saves for backward are not kept; the first backward call that needs one runs
    the function again (same RNG, autocast and default device) and stops as soon as every needed
    tensor is back. Works with ``torch.autograd.grad``, ``backward(inputs=...)``,
    ``retain_graph=True``, double backward, nesting, keyword and non-tensor arguments, and every
    tensorhooks context; state lives in the graph-task store, so nothing outlives a backward
    call, successful or not. With ``function=None`` it returns a decorator.

    Example:
        >>> import torch, tensorhooks
        >>> w = torch.ones(3, 3, requires_grad=True)
        >>> x = torch.ones(2, 3, requires_grad=True)
        >>> y = tensorhooks.checkpoint(lambda a: (a @ w).sin(), x)
        >>> (gx,) = torch.autograd.grad(y.sum(), [x])
        >>> gx.shape
        torch.Size([2, 3])
        >>> @tensorhooks.checkpoint(early_stop=False)
        ... def block(a, *, scale=1.0):
        ...     return (a * scale).exp()
        >>> block(x, scale=2.0).sum().backward()

    Args:
        function: what to run; ``None`` to get a decorator taking the same options.
        *args: its positional arguments. Tensors among them, also inside list, tuple and dict
            arguments, are saved as a node saves its inputs.
        use_reentrant: ``None`` or ``False``; ``True`` is refused (see Raises).
        preserve_rng_state: replay the CPU and device RNG state in recomputation.
        context_fn: returns ``(forward_context, recompute_context)``, e.g.
            `create_selective_checkpoint_contexts` (tensorhooks' or torch's).
        determinism_check: ``"default"`` (compare shape, dtype and device) or ``"none"``.
        debug: on a `CheckpointError`, add torch's trace of the ops of both runs.
        early_stop: stop recomputing once every saved tensor is back (torch's
            ``set_checkpoint_early_stop`` overrides it).
        **kwargs: keyword arguments of ``function``; tensors among them are saved as in
            ``args``.

    Returns:
        What ``function`` returns (or the decorator, with ``function=None``).

    Raises:
        CheckpointArgumentValueError: if ``use_reentrant=True``, ``determinism_check`` is not a
            known value, or ``debug=True`` comes with a ``context_fn`` (a ``ValueError``).
        CheckpointError: in backward, if recomputation saved a different number of tensors or
            tensors of another shape, dtype or device (a ``RuntimeError``).
        RuntimeError: in backward, autograd's in-place error if a tensor argument was changed
            in place, inside the function or after the call (outside
            ``allow_mutation_on_saved_tensors``).
        SavedTensorModifiedError: in backward, if a tensor the function reads from elsewhere (a
            closure, a module attribute) and saved was changed in place before recomputation
            read it again (a ``RuntimeError`` with autograd's message).

    Nesting and threads: regions nest (the innermost manages its tensors, its inputs are saved
    by the enclosing one). Backward calls may run on several threads at once over the same or
    different graphs; each graph task recomputes on its own.
    """
    if use_reentrant:
        raise CheckpointArgumentValueError(_REENTRANT_REFUSED)
    if function is None:
        if args:
            raise CheckpointArgumentValueError(
                "tensorhooks.checkpoint: positional arguments were given without a function; "
                "pass the function first, or use @checkpoint(...) as a decorator"
            )
        options = {
            "preserve_rng_state": preserve_rng_state,
            "context_fn": context_fn,
            "determinism_check": determinism_check,
            "debug": debug,
            "early_stop": early_stop,
        }

        def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(fn)
            def checkpointed(*a: Any, **k: Any) -> Any:
                return _checkpoint_with(fn, a, k, options)

            return checkpointed

        return decorate
    return _checkpoint_with(
        function,
        args,
        kwargs,
        {
            "preserve_rng_state": preserve_rng_state,
            "context_fn": context_fn,
            "determinism_check": determinism_check,
            "debug": debug,
            "early_stop": early_stop,
        },
    )


# NOTE [Checkpointing under torch.compile]
#
# Traced by Dynamo, this checkpoint would break the graph around its hooks and RNG reads and have
# the region's frame compiled: the forward pass would then save AOTAutograd's tensors while the
# recomputation in backward runs the region eagerly and saves others, and early stop hides the
# mismatch (a wrong gradient, nothing raised). torch's non-reentrant checkpoint is traced as one
# higher-order op instead, and AOTAutograd recomputes inside the compiled graph. So while Dynamo
# traces, the call goes to torch's checkpoint with the same options; a tensorhooks selective
# context becomes torch's with the same policy (torch's enum, so its offload policies too).
# Eager calls, and compiled functions called inside a checkpoint, are unaffected.


def _torch_checkpoint(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: dict[str, Any],
) -> Any:
    """Run torch's non-reentrant checkpoint with ``options`` (see the NOTE above)."""
    context_fn: Callable[[], tuple[Any, ...]] = options["context_fn"]
    # Dynamo takes a context_fn only as a plain or partial function; the default goes unsaid.
    contexts = (
        {}
        if context_fn is noop_context_fn
        else {"context_fn": functools.partial(_torch_contexts, context_fn)}
    )
    return torch_checkpoint.checkpoint(
        function,
        *args,
        use_reentrant=False,
        preserve_rng_state=options["preserve_rng_state"],
        determinism_check=options["determinism_check"],
        debug=options["debug"],
        early_stop=options["early_stop"],
        **contexts,
        **kwargs,
    )


def _torch_contexts(context_fn: Callable[[], tuple[Any, ...]]) -> tuple[Any, ...]:
    """``context_fn()``, with a tensorhooks selective context made torch's (same policy)."""
    forward, recompute = context_fn()
    if isinstance(forward, SelectiveForward):
        plan = forward.plan
        make = torch_checkpoint.create_selective_checkpoint_contexts
        contexts: tuple[Any, ...] = make(  # type: ignore[no-untyped-call]  # untyped in torch
            plan.policy_fn, plan.allow_cache_entry_mutation
        )
        return contexts
    return forward, recompute


def _checkpoint_with(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: dict[str, Any],
) -> Any:
    if torch.compiler.is_compiling():  # See NOTE [Checkpointing under torch.compile]
        return _torch_checkpoint(function, args, kwargs, options)
    preserve_rng_state: bool = options["preserve_rng_state"]
    context_fn: Callable[[], tuple[Any, ...]] = options["context_fn"]
    determinism_check: str = options["determinism_check"]
    debug: bool = options["debug"]
    early_stop: bool = options["early_stop"]
    metadata_fn = _DETERMINISM_CHECKS.get(determinism_check)
    if metadata_fn is None:
        raise CheckpointArgumentValueError(
            f"tensorhooks.checkpoint: determinism_check must be one of "
            f"{sorted(_DETERMINISM_CHECKS)}, got {determinism_check!r}"
        )
    debug_override = torch_checkpoint_debug_override()
    error_cb = None
    if debug if debug_override is None else debug_override:
        if context_fn is not noop_context_fn:
            raise CheckpointArgumentValueError(
                "tensorhooks.checkpoint: debug=True records the ops through its own "
                "context_fn and cannot be combined with another one; drop one of them"
            )
        tools = torch_checkpoint_debug_tools()
        if tools is not None:
            context_fn, error_cb = tools
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    return _run_region(
        function,
        args,
        kwargs,
        preserve_rng_state=preserve_rng_state,
        context_fn=context_fn,
        metadata_fn=metadata_fn,
        early_stop=early_stop,
        error_cb=error_cb,
    )


def _run_region(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    preserve_rng_state: bool,
    context_fn: Callable[[], tuple[Any, ...]],
    metadata_fn: Callable[[torch.Tensor], Any],
    early_stop: bool,
    error_cb: Callable[[Exception], Any] | None,
) -> Any:
    forward_context, recompute_context = adopt_contexts(*context_fn())
    tensors: list[torch.Tensor] = []
    arguments = _Arguments(args, kwargs, tensors)
    region = _RegionState(tensors, preserve_rng_state)
    had_device = _device_initialized(region.device_type)
    override = torch_checkpoint_early_stop_override()
    frame = _Frame(
        function,
        region,
        recompute_context=recompute_context,
        early_stop=early_stop if override is None else override,
        metadata_fn=metadata_fn,
        error_cb=error_cb,
    )
    # The arguments keep what is not a tensor; tensors come back through the saved form.
    unhooked = top_saved_tensors_hooks is not None and top_saved_tensors_hooks() is None
    frame.inputs = _save_inputs(tensors)
    frame.arguments = arguments
    versions = [tensor._version for tensor in tensors]
    offload = (
        forward_context.offload_context()
        if isinstance(forward_context, SelectiveForward)
        else contextlib.nullcontext()
    )
    pack, unpack = current_save_guard().wrap(frame.pack, _unpack)
    register_protected_pack_hook(pack)
    with offload:
        push_saved_tensors_hooks(pack, unpack)
        try:
            with forward_context:
                output = function(*args, **kwargs)
        finally:
            pop_saved_tensors_hooks()
    frame.seal()
    changed = [
        (tensor, version)
        for tensor, version in zip(tensors, versions, strict=True)
        if tensor._version != version
    ]
    frame.clone_inputs = bool(changed)
    if changed and unhooked:  # See NOTE [Checkpointing on saved-tensor hooks], "A cycle"
        frame.inputs = _raise_changed_input(*changed[0])
    if preserve_rng_state and not had_device and _device_initialized(region.device_type):
        raise RuntimeError(
            "tensorhooks.checkpoint: the device was initialised inside the checkpointed "
            "function, so its RNG state could not be recorded before it ran; initialise the "
            "device before the call, or pass preserve_rng_state=False"
        )
    return output
