"""A region's frame: what its forward pass saved, and its recomputation in backward.

See NOTE [Checkpointing on saved-tensor hooks].
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointError

from tensorhooks._core.errors import SavedTensorModifiedError
from tensorhooks._core.guards import (
    PackHook,
    SavedCopy,
    UnpackHook,
    current_save_guard,
    modified_message,
    register_protected_pack_hook,
)
from tensorhooks._core.store import graph_task_store
from tensorhooks._core.torch_compat import (
    below_python_modes,
    current_graph_task_id,
    next_sequence_nr,
    pop_saved_tensors_hooks,
    push_saved_tensors_hooks,
    storage_key,
)

from .arguments import Arguments
from .bindings import Rebinding, code_of
from .reads import GraphReads, RecomputedReads, describe, tensors_in, unpacked
from .replay import RegionState
from .state import CallWatch, ReachedState
from .substitution import Substitution

__all__ = ["DETERMINISM_CHECKS", "Frame", "is_recomputing", "raise_changed_input", "unpack_holder"]

# NOTE [Checkpointing on saved-tensor hooks]
#
# Inside a region the pack hook keeps no tensor: it returns a `_Holder` (the region's frame and
# the save's position). The region's tensor inputs are saved the way a node saves them, through
# whatever hooks are in force outside the region (``save_on_cpu`` offloads them, an enclosing
# checkpoint holds them, user hooks see them). The first unpack of a holder in a graph task runs
# the function again under a recomputation hook that keeps each saved tensor by position, and
# stops (``_StopRecomputation``) once the last position is reached (early stop). What was
# recomputed lives in the graph-task store under a key the frame holds (never the frame itself),
# so it is released when the task ends whether backward succeeded, raised part-way or stopped
# early, and a second backward over a retained graph (a new task) recomputes again. Each position
# is handed out once per task. Keyed by the frame, the store would keep every region's frame, and
# with it its inputs and the outputs its policy saved, until the end of backward; keyed so, a
# region's frame dies when its last node has run, as torch's does, and a region holds no more
# than torch's checkpoint while the regions before it recompute.
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
# runs once more keeping clones of the positions that changed (and keeps clones of those from
# then on; the others are kept as they are). The positions are remembered by the function's code
# (or its module's class), so the next call of the same block clones them on its first run. So
# backward always reads the save-time value, where plain autograd would raise its in-place error
# and torch's checkpoint silently uses the changed value.
#
# A cycle. An input that the forward pass changes in place gets a ``grad_fn`` inside the region,
# whose nodes hold the holders, which hold the frame. Were the frame to hold the input still,
# that cycle would run through autograd's C++ nodes, where the garbage collector cannot follow
# it, and the graph would leak. Saved with no hooks in force, such an input can only raise
# autograd's in-place error at unpack, so the frame keeps that error (with a detached alias for
# its message) instead of the input.
#
# Tensors from elsewhere. A tensor that the function reaches other ways (a module's parameters
# and buffers, a closure's tensors, the base of a view it saved) is read again by recomputation,
# which must read what the forward pass read: see NOTE [What a region read] in reads.py and
# NOTE [State a region reaches] in state.py.
#
# Both pairs are wrapped by the save guard of the thread that pushes them, like every pair of the
# toolkit, and registered as protected: the region's pack keeps no tensor data, and the
# recomputation's does the version check above itself.


def _metadata(tensor: torch.Tensor) -> tuple[torch.Size, torch.dtype, torch.device]:
    return tensor.shape, tensor.dtype, tensor.device


def _no_metadata(tensor: torch.Tensor) -> None:
    return None


DETERMINISM_CHECKS: dict[str, Callable[[torch.Tensor], Any]] = {
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
        >>> tensorhooks.checkpoint(block, x, use_reentrant=False).sum().backward()
        >>> seen
        [False, True]

    Returns:
        True inside a recomputation on this thread.
    """
    return _recomputing.depth > 0


class _Holder(SavedCopy):
    """What the region's pack hook returns: its frame and the position of the save."""

    __slots__ = ("__weakref__", "frame", "index")

    def __init__(self, frame: Frame, index: int) -> None:
        self.frame = frame
        self.index = index


class _Recomputation:
    """One graph task's recomputation of one region: the tensors kept, by position."""

    __slots__ = (
        "count",
        "done",
        "ignore_mismatch",
        "kept",
        "lock",
        "reads",
        "substitution",
        "tensors",
    )

    def __init__(self) -> None:
        self.tensors: dict[int, torch.Tensor] = {}
        self.kept: list[tuple[int, torch.Tensor, int]] = []  # position, tensor, its version
        # What recomputation reads instead of tensors from elsewhere (see substitution.py).
        self.substitution: Substitution | None = None
        self.reads: RecomputedReads | None = None  # checked against the forward pass's (reads.py)
        self.count = 0
        self.done = False
        self.ignore_mismatch = False
        self.lock = threading.RLock()

    def reset(self) -> None:
        self.tensors.clear()
        self.kept.clear()
        self.count = 0
        self.ignore_mismatch = False

    def changed_in_place(self) -> set[int]:
        """The positions whose kept tensor recomputation changed in place after keeping it."""
        return {index for index, tensor, version in self.kept if tensor._version != version}


_NO_ARGUMENTS = Arguments((), {}, [])

# The positions each checkpointed code (a function's code object, a module's class) changes in
# place after saving, learned by recomputation: the next call's first recomputation clones them
# at once instead of running twice. Bounded by the program's code.
_WRITTEN_AFTER_SAVE: dict[object, frozenset[int]] = {}


class Frame:
    """One call of `checkpoint`: how to run the region again, and what its forward saved."""

    __slots__ = (
        "__weakref__",
        "arguments",
        "clone_inputs",
        "clone_saves",
        "code",
        "early_stop",
        "error_cb",
        "forward_completed",
        "graph",
        "holders",
        "inputs",
        "key",
        "metadata",
        "metadata_fn",
        "pair",
        "reached",
        "recompute_context",
        "region",
        "run",
        "saved",
        "start",
        "watch",
    )

    def __init__(
        self,
        run: Callable[..., Any],
        region: RegionState,
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
        # During the forward pass only: each saved tensor, weakly, and its version when saved.
        self.saved: list[tuple[weakref.ref[torch.Tensor], int]] = []
        # What the forward pass read from outside its arguments (reads.py, state.py): watched
        # while it runs, recorded when it ends.
        self.watch: CallWatch | None = None
        self.graph: GraphReads | None = None
        self.reached: ReachedState | None = None
        self.pair: tuple[PackHook, UnpackHook] | None = None  # allow_mutation's, inside it
        self.start = 0  # the calling thread's node counter when the forward pass started
        self.inputs: Callable[[], list[torch.Tensor]] = list
        self.arguments = _NO_ARGUMENTS  # the region's, set before its forward pass runs
        self.forward_completed = False
        self.clone_inputs = False
        # Positions whose recomputed tensor the function changes in place after saving it: kept
        # as clones (NOTE [Checkpointing on saved-tensor hooks], "In-place writes"), starting
        # from what earlier calls of the same code learned.
        self.code = code_of(run)
        self.clone_saves: frozenset[int] = _WRITTEN_AFTER_SAVE.get(self.code, frozenset())
        # What the graph-task store files this frame's recomputation under: not the frame, which
        # the store would keep alive (see NOTE [Checkpointing on saved-tensor hooks]).
        self.key = object()

    def pack(self, tensor: torch.Tensor) -> _Holder:
        """The region's pack hook: keep nothing but the position (and the metadata to check)."""
        holder = _Holder(self, len(self.holders))
        self.holders.append(weakref.ref(holder))
        self.metadata.append(self.metadata_fn(tensor))
        # The base of a view (``weight.t()`` dies with the forward pass; ``weight`` does not).
        base = tensor._base
        self.saved.append((weakref.ref(tensor if base is None else base), tensor._version))
        return holder

    def begin(
        self,
        function: Callable[..., Any],
        tensors: list[torch.Tensor],
        pair: tuple[PackHook, UnpackHook] | None,
    ) -> None:
        """The forward pass starts: watch what it reaches (NOTE [State a region reaches])."""
        self.pair = pair
        self.graph = GraphReads(tensors)
        self.watch = CallWatch(function, self.code, pair)
        self.start = next_sequence_nr()

    def seal(self, output: object, tensors: list[torch.Tensor]) -> None:
        """At the end of the forward pass: record what it read (NOTE [What a region read])."""
        self.forward_completed = True
        graph = self.graph
        assert graph is not None
        assert self.watch is not None
        if not self.holders:  # nothing saved: never recomputed, nothing to hold it to
            self.watch.learn()
            self.watch = self.graph = None
            return
        outputs = tensors_in(output)
        graph.walk(outputs, self.start, next_sequence_nr())
        if self.watch.leaf_storages:
            graph.swapped_by_the_region(self.watch.leaf_storages)
        saved = [(index, ref, version) for index, (ref, version) in enumerate(self.saved)]
        self.saved = []
        # The leaves the region read (read only if needed): its graph's, and those a branch
        # its outputs do not depend on saved (batch norm's weight there).
        leaves = itertools.chain(
            (leaf.tensor for leaf in graph.leaves.values()),
            (base for _, ref, _ in saved if (base := ref()) is not None and base.is_leaf),
        )
        self.reached = self.watch.seal(functools.partial(_storages, tensors), leaves)
        self.watch = None
        returned = {id(tensor) for tensor in outputs}
        for index, ref, version in saved:
            base = ref()
            if base is not None:
                graph.note_saved(index, base, version, returned)
        graph.watch(self.pair)

    def recompute(self, state: _Recomputation) -> None:
        """Run the region again, keeping its saved tensors in ``state``; check them."""
        inputs = unpacked(self.inputs())  # an argument changed in place raises here, first
        reached, graph = self.reached, self.graph
        values, verify = ([], []) if reached is None else reached.values()
        if graph is not None:
            namer, found = (
                (describe, _nowhere) if reached is None else (reached.name_of, reached.found)
            )
            # One stand-in per storage: the value at the call (state.py) over the one after it.
            substituted = {storage_key(tensor) for tensor, _ in values}
            values.extend(
                item
                for item in graph.values(self.pair, namer, found)
                if storage_key(item[0]) not in substituted
            )
            graph.check_saved({storage_key(tensor) for tensor, _ in values}, namer)
        rebindings = [] if self.reached is None else self.reached.rebindings()
        self._run_again(state, inputs, rebindings, values, verify)
        changed = state.changed_in_place()
        if changed:
            # See NOTE [Checkpointing on saved-tensor hooks], "In-place writes".
            self.clone_saves |= changed
            _WRITTEN_AFTER_SAVE[self.code] = self.clone_saves
            state.reset()
            self._run_again(state, unpacked(self.inputs()), rebindings, values, verify)
        state.kept.clear()
        self._verify(state.substitution, verify)
        state.substitution = None
        if self.graph is not None:
            self.graph.recomputed()
        self._check(state)

    def _verify(self, substitution: Substitution | None, written: list[torch.Tensor]) -> None:
        """State written with no copy of its value before: recomputation must give it again."""
        for tensor in written:
            assert substitution is not None
            assert self.reached is not None
            if not substitution.reproduced(tensor):
                raise self.reached.not_reproduced(tensor)

    def _run_again(
        self,
        state: _Recomputation,
        inputs: list[torch.Tensor],
        rebindings: list[Rebinding],
        values: list[tuple[torch.Tensor, torch.Tensor]],
        verify: list[torch.Tensor],
    ) -> None:
        # Stand-ins of its own for each run: a run writes them (an EMA's update), and a second
        # run (a saved value written after its save) must read the state as at the call again.
        state.substitution = Substitution(values, verify) if values else None
        tensors, windows = self.arguments.as_called(inputs, writable=self.clone_inputs)
        args, kwargs = self.arguments.rebuild(tensors)
        pack, unpack = current_save_guard().wrap(
            functools.partial(_keep_recomputed, self, state), _identity
        )
        register_protected_pack_hook(pack)
        push_saved_tensors_hooks(pack, unpack)
        substitute = (
            contextlib.nullcontext() if state.substitution is None else state.substitution.mode()
        )
        guard = contextlib.nullcontext() if windows is None else windows.mode()
        state.reads = None if self.graph is None else RecomputedReads(self.graph, tensors)
        for rebinding in rebindings:
            rebinding.apply()
        _recomputing.depth += 1
        try:
            with (
                torch.enable_grad(),
                self.region.replay(),
                guard,
                substitute,
                self.recompute_context,
            ):
                self.run(*args, **kwargs)
        except _StopRecomputation:
            pass
        finally:
            _recomputing.depth -= 1
            pop_saved_tensors_hooks()
            for rebinding in reversed(rebindings):
                rebinding.undo()
            if state.substitution is not None:
                state.substitution.restore_versions()
        if state.reads is not None:
            reads, state.reads = state.reads, None
            reads.check()  # See NOTE [What a region read] in reads.py

    def _check(self, state: _Recomputation) -> None:
        if state.ignore_mismatch:
            return
        if state.count != len(self.holders):
            raise CheckpointError(
                "tensorhooks.checkpoint: A different number of tensors was saved during the "
                f"forward pass ({len(self.holders)}) and during recomputation ({state.count}). "
                "The checkpointed function must run the same ops both times (non-determinism: "
                "look for branches on global state or on values that differ between the two "
                'runs), or pass determinism_check="none" if the difference is harmless.' + DEBUG_TIP
            )
        metadata_fn = self.metadata_fn
        differ = [
            f"tensor at position {index}: saved {self.metadata[index]}, recomputed {now}"
            for index, tensor in state.tensors.items()
            if (now := metadata_fn(tensor)) != self.metadata[index]
        ]
        if differ:
            raise CheckpointError(
                "tensorhooks.checkpoint: Recomputed values for the following tensors have "
                "different metadata than during the forward pass (recomputed tensors differ from "
                "those saved in shape, dtype or device):\n"
                + "\n".join(differ)
                + '\nReplay the same state (autocast, dtypes) or pass determinism_check="none".'
                + DEBUG_TIP
            )


# torch's tip, in its words (code written for torch, and its tests, look for them).
DEBUG_TIP = """
Tip: To see a more detailed error message, either pass `debug=True` to
`tensorhooks.checkpoint(...)` or wrap the code block with
`with torch.utils.checkpoint.set_checkpoint_debug_enabled(True):` to enable checkpoint-debug
mode globally. If this error occurs under torch.compile with automatic dynamic shapes, the
recomputation may have picked another compiled graph than the forward pass: use
torch._dynamo.mark_dynamic() to mark the varying dimensions as dynamic upfront."""


def _identity(value: Any) -> Any:
    return value


def _keep_recomputed(frame: Frame, state: _Recomputation, tensor: torch.Tensor) -> torch.Tensor:
    """The recomputation's pack hook: keep the tensor saved at this position for backward."""
    index = state.count
    state.count = index + 1
    total = len(frame.holders)
    if index >= total:
        if not frame.forward_completed:  # backward inside the region's own forward pass
            state.ignore_mismatch = True
            return tensor
        raise CheckpointError(
            "tensorhooks.checkpoint: trying to save more tensors during recomputation than "
            f"during the forward pass ({total}): more tensors were saved during recomputation. "
            "The checkpointed function must run the same ops both times (non-determinism)."
            + DEBUG_TIP
        )
    kept = tensor.detach() if tensor.requires_grad else tensor
    # A position whose holder died belongs to a node already released (a branch the region's
    # outputs do not depend on): neither what it read nor its value matters to the gradient.
    if frame.holders[index]() is not None:
        if state.reads is not None:
            state.reads.saved(index, tensor)
        if state.substitution is not None:
            kept = state.substitution.saved(kept)
        if index in frame.clone_saves:
            kept = _clone_below_modes(kept)
        state.tensors[index] = kept
        state.kept.append((index, kept, kept._version))
    if frame.early_stop and index + 1 == total:
        raise _StopRecomputation
    return kept


def _clone_below_modes(tensor: torch.Tensor) -> torch.Tensor:
    """A clone that dispatch modes (a selective context, the user's) do not see.

    The forward pass made no such clone, so a mode counting ops must not count it.
    """
    with below_python_modes():
        return tensor.clone()


def unpack_holder(holder: _Holder) -> torch.Tensor:
    """The region's unpack hook: recompute once per graph task, hand out each tensor once."""
    frame = holder.frame
    try:
        return _unpack_from(frame, holder.index)
    except CheckpointError as error:
        if frame.error_cb is not None:
            frame.error_cb(error)
        raise


def _unpack_from(frame: Frame, index: int) -> torch.Tensor:
    if current_graph_task_id() == -1:
        # Outside backward (``grad_fn._saved_self``): a recomputation of its own, kept nowhere.
        state = _Recomputation()
        frame.recompute(state)
    else:
        task = graph_task_store.current()
        state = task.peek(frame.key)
        if state is None:
            state = task.claim(frame.key, _Recomputation())
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
    return tensor


def raise_changed_input(tensor: torch.Tensor, version: int) -> Callable[[], list[torch.Tensor]]:
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


def _nowhere(tensor: torch.Tensor) -> None:
    return None


def _storages(inputs: list[torch.Tensor]) -> set[int | None]:
    """The storages of a region's inputs (read only where a written tensor needs it)."""
    return {storage_key(tensor) for tensor in inputs}
