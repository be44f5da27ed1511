"""allow_mutation_on_saved_tensors: change tensors saved for backward in place, safely.

See NOTE [Clone before write].
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import Any, NamedTuple, NoReturn

import torch

from tensorhooks._core.compile import not_traced, warn_compile_skipped
from tensorhooks._core.errors import (
    MutationContextExitedError,
    SavedTensorModifiedError,
    UnguardedHooksError,
)
from tensorhooks._core.guards import (
    PackHook,
    SavedCopy,
    UnpackHook,
    current_save_guard,
    is_output_of_saving_node,
    is_protected_pack_hook,
    may_share_storage,
    modified_message,
    register_protected_pack_hook,
    use_save_guard,
)
from tensorhooks._core.torch_compat import (
    PYTHON_DISPATCH_KEY,
    OpOverload,
    UnwrappedDispatchMode,
    current_dispatch_mode,
    current_graph_task_id,
    get_disabled_hooks_message,
    is_alias_of,
    is_dispatch_key_excluded,
    is_newest_node,
    next_sequence_nr,
    op_call,
    op_schema,
    pop_saved_tensors_hooks,
    push_saved_tensors_hooks,
    set_dispatch_key_excluded,
    skip_code_in_dynamo,
    storage_key,
    top_saved_tensors_hooks,
    warn_once,
)

__all__ = ["MutationContext", "allow_mutation_on_saved_tensors"]

# NOTE [Clone before write]
#
# Inside the context every tensor autograd saves goes through our pack hook, which returns a
# small handle (``_SavedTensor``) holding the tensor; the unpack hook hands back whatever the
# handle holds. A
# TorchDispatchMode sees every operator; just before an operator writes to a tensor it finds the
# saved tensors that share the written tensor's storage and whose byte span overlaps the span the
# write can reach, clones each of them and puts the clone in its handle. Backward therefore sees
# the saved values whatever alias the write went through: the tensor itself, a view, its base, a
# transposed or strided view, an overlapping slice, an ``out=`` argument, a foreach list.
#
# Aliasing is decided by storage identity (the StorageImpl address) and byte spans (storage
# offset, sizes, strides and element size give the lowest and highest byte an access can reach).
# Spans are conservative: two strided views that interleave without sharing an element still
# "overlap" and the saved one is cloned. An ``out=`` argument, or the tensor given to a resizing
# op (``resize_``, ``set_``), may be resized by the op, so its span runs from its storage offset
# to the end of the storage. torch 2.13 keys on ``(data_ptr(), _version)`` instead, and misses a
# write through any alias whose first element is elsewhere, or made after an unrelated write
# bumped the shared version counter.
#
# Costs, in the order they are paid:
#   every operator: one dict lookup keyed by the OpOverload's id. What an op writes is read from
#       its schema (``alias_info.is_write``) the first time it is seen; ops that write nothing
#       are then called straight through the C++ operator (``op_call`` of `_core.torch_compat`),
#       skipping ``OpOverload.__call__``.
#   every saved tensor: one handle and one weak reference, added to the context's pending set
#       (whose discard is the reference's callback). Nothing is keyed by storage yet: most saved
#       tensors are never written.
#   every write: handles saved since the last write are indexed by storage (each handle at most
#       once: its weak reference moves into a per-storage list, dead ones pruned in amortised
#       sweeps), then one dict lookup keyed by the written storage. Only when saved tensors live
#       on that storage are spans computed and clones made.
#
# Memory: the handle is the only strong owner of what it holds, and autograd is the only owner of
# the handle, so both die with the graph, after backward or when the graph is dropped. A tensor
# that is an output of the very node saving it (``exp``, ``relu``, a custom Function saving its
# result) references that node through ``grad_fn``; holding it would close a cycle through the
# node's C++ saved variable that Python's collector cannot see (torch's context has this cycle
# and keeps such graphs until it exits). Such tensors are recognised by their ``grad_fn``'s
# sequence number (the node created last on this thread) and held through a detached alias,
# made with the Python dispatch key excluded so that it does not re-enter the mode. Other
# tensors are held as they are, as plain autograd does. If a node was created between the saving
# node and the save (a custom Function applied inside another's forward), an output is held as it
# is and its graph, if dropped without backward, lives until the context exits, as with torch.
#
# TorchDispatchMode wraps every subclass's ``__torch_dispatch__`` in ``torch._disable_dynamo``, a
# Python-level wrapper that costs about as much per operator as the whole handler. We instead
# tell Dynamo's frame evaluator to skip the handler's code object and everything it calls
# (``set_code_exec_strategy``, what ``torch._dynamo.disable(recursive=True)`` amounts to, at no
# per-call cost) and opt out of the wrapper (`UnwrappedDispatchMode` of `_core.torch_compat`); torch
# versions without that hook keep the wrapper.
#
# Threads and nesting: each context has its own state; open contexts are listed in a module-level
# tuple, and a write made under any context's mode, on any thread, protects the tensors saved by
# every open context. Nesting is allowed (unlike torch): the inner context tracks what is saved
# inside it and must also see its backward. A context whose thread's innermost dispatch mode is
# already ours pushes no second one (it would only run every operator through the handler twice).
#
# Hooks pushed inside: pairs pushed with tensorhooks' ``saved_tensors_hooks`` (and its
# subclasses, ``save_on_cpu``) are wrapped by the context's save guard and keep the protection.
# torch's own ``saved_tensors_hooks`` are taken over when first seen innermost; see NOTE
# [Saved-tensor hooks the context did not install].

# Tensor types whose detach never needs Python dispatch (no __torch_dispatch__ of their own).
_PLAIN_TENSOR_TYPES = frozenset(
    t for t in (torch.Tensor, torch.nn.Parameter, getattr(torch.nn, "Buffer", None)) if t
)
# Ops whose schema marks a write that changes no value: ``record_stream`` only tells the caching
# allocator which stream uses the memory (save_on_cpu calls it on every tensor it copies back).
_VALUE_PRESERVING_OPS = frozenset({"aten::record_stream"})
# Ops that may resize the tensor they write (besides every ``out=`` argument).
_RESIZING_OPS = frozenset(
    {"aten::resize_", "aten::resize_as_", "aten::resize_as_sparse_", "aten::set_"}
)
# Values a pack hook may return next to tensors without hiding a reference to the saved tensor.
_IMMUTABLE_TYPES = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)

_EXITED_MESSAGE = (
    # torch's own sentence first, as torch writes it (no space in "contextin", on 2.11 to 2.15),
    # for code that matches it
    "Trying to backward outside of the 'allow_mutation_on_saved_tensors' contextin which the "
    "graph was originally recorded. "
    "allow_mutation_on_saved_tensors: backward needed a tensor saved inside the context, but the "
    "context has exited (or was cleared) since the forward pass recorded the graph, so in-place "
    "changes made after that were not tracked. Run backward inside the same "
    "`with tensorhooks.allow_mutation_on_saved_tensors():` block as the forward pass."
)


class _SavedTensor:
    """What autograd stores for a tensor saved in the context: an alias of it, or its clone.

    ``tensor`` is emptied when the context closes; reading it then raises.
    """

    __slots__ = ("__weakref__", "slack", "tensor", "version")

    tensor: torch.Tensor
    # The versions ``tensor`` may be at with no write the context did not see: from ``version``
    # to ``version + slack``. See NOTE [Detecting writes the context did not see].
    version: int
    slack: int

    def __getattr__(self, name: str) -> NoReturn:
        # Only reached when a slot is empty, i.e. after the context closed.
        if name == "tensor":
            raise MutationContextExitedError(_EXITED_MESSAGE)
        raise AttributeError(name)


# NOTE [Detecting writes the context did not see]
#
# Cloning before a write protects saved tensors from the writes the dispatch mode sees. Some it
# cannot see: a write on a thread with no open context, a write to a sparse tensor's values or
# indices (another storage, the same version counter), a write under saved-tensor hooks that
# tensorhooks did not install. Each handle therefore records its tensor's version counter at
# save, and unpacking compares: a mismatch means a write changed the tensor with no clone taken,
# and backward raises autograd's own in-place error instead of reading changed data. A write the
# mode did see and that left a saved tensor unchanged (a non-overlapping slice of its storage)
# still moves the shared counter. The mode runs below autograd, which bumps the counter after the
# op returns, so after such a write each handle on that storage accepts its current version up
# to one more per tensor written there (``slack``). Costs: two ints per save, one comparison per
# unpack, and, after a write that reaches a storage holding saved tensors, one pass over that
# storage's handles.


def _unseen_write_error(tensor: torch.Tensor, saved_version: int) -> SavedTensorModifiedError:
    try:
        type_name = tensor.type()
    except RuntimeError:  # layouts without a legacy type name (sparse CSR)
        type_name = f"{tensor.layout} {tensor.dtype}"
    return SavedTensorModifiedError(
        modified_message(type_name, list(tensor.shape), tensor._version, saved_version)
        + " Hint: the tensor was saved inside allow_mutation_on_saved_tensors() and then changed "
        "in place by a write the context did not see, so it could not keep the save-time value: "
        "a write made on a thread with no open context, through a sparse tensor's components, or "
        "under saved-tensor hooks that tensorhooks did not install. Make the write inside the "
        "context on the thread that runs the forward pass, or write to a copy."
    )


def _check_version(saved: _SavedTensor, tensor: torch.Tensor) -> None:
    """Raise if a write the context did not see changed ``tensor`` (a mismatch, the slow path)."""
    if not saved.version <= tensor._version <= saved.version + saved.slack:
        raise _unseen_write_error(tensor, saved.version)


def _unpack(saved: _SavedTensor) -> torch.Tensor:
    """Hand back what ``saved`` holds, unless a write the context did not see changed it."""
    tensor = saved.tensor
    if tensor._version != saved.version:
        _check_version(saved, tensor)
    return tensor


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.detach()``, made without entering this context's dispatch mode where possible."""
    if type(tensor) not in _PLAIN_TENSOR_TYPES:
        return tensor.detach()
    # detach() would otherwise go through the dispatch mode (microseconds).
    was_excluded = is_dispatch_key_excluded(PYTHON_DISPATCH_KEY)
    set_dispatch_key_excluded(PYTHON_DISPATCH_KEY, True)
    try:
        return tensor.detach()
    finally:
        set_dispatch_key_excluded(PYTHON_DISPATCH_KEY, was_excluded)


_Pack = Callable[[torch.Tensor], _SavedTensor]
_Track = Callable[[torch.Tensor, bool], _SavedTensor]


def _make_pack(pending: set[weakref.ref[_SavedTensor]]) -> tuple[_Pack, _Track]:
    """Return the context's pack hook and its tracker; handles go into ``pending``.

    ``track(tensor, is_output)`` makes the handle of a tensor whose ``is_output`` test was made
    earlier (guarded user pairs, see `_GuardedPair.pack`); ``pack`` tests now. See NOTE [Clone
    before write] for why saved outputs are held through a detached alias. Handles stay in
    ``pending`` until a write indexes them.
    """
    add = pending.add
    discard = pending.discard
    newest = is_newest_node

    def pack(tensor: torch.Tensor) -> _SavedTensor:
        # The hot path: is_output_of_saving_node and track inlined.
        saved = _SavedTensor()
        grad_fn = tensor.grad_fn
        if grad_fn is None or not newest(grad_fn):
            saved.tensor = tensor
        else:
            saved.tensor = _detached(tensor)
        saved.version = tensor._version
        saved.slack = 0
        add(weakref.ref(saved, discard))
        return saved

    def track(tensor: torch.Tensor, is_output: bool) -> _SavedTensor:
        saved = _SavedTensor()
        saved.tensor = _detached(tensor) if is_output else tensor
        saved.version = tensor._version
        saved.slack = 0
        add(weakref.ref(saved, discard))
        return saved

    register_protected_pack_hook(pack)
    return pack, track


_EVERYTHING = (0, float("inf"))


def _byte_span(tensor: torch.Tensor, resizes: bool) -> tuple[float, float] | None:
    """Bytes ``[lo, hi)`` of its storage that ``tensor`` can reach; None if it reaches none.

    ``resizes``: the op may resize ``tensor`` first, so anything past its storage offset counts.
    Symbolic or unavailable geometry gives the whole storage.
    """
    try:
        offset = tensor.storage_offset()
        sizes = tensor.size()
        strides = tensor.stride()
        itemsize = tensor.element_size()
    except (RuntimeError, NotImplementedError):
        return _EVERYTHING
    if type(offset) is not int:
        return _EVERYTHING
    lo = hi = offset
    for size, stride in zip(sizes, strides, strict=True):
        if type(size) is not int or type(stride) is not int:
            return _EVERYTHING
        if size == 0:
            return (offset * itemsize, float("inf")) if resizes else None
        if stride >= 0:
            hi += (size - 1) * stride
        else:
            lo += (size - 1) * stride
    if resizes:
        return (min(lo, offset) * itemsize, float("inf"))
    return (lo * itemsize, (hi + 1) * itemsize)


def _reaches(span: tuple[float, float], saved: torch.Tensor) -> bool:
    """Whether a write reaching bytes ``span`` of the storage overlaps what ``saved`` reads."""
    saved_span = _byte_span(saved, False)
    return saved_span is not None and saved_span[0] < span[1] and span[0] < saved_span[1]


def _clone_key(tensor: torch.Tensor) -> object:
    """A key equal for two aliases whose clones are interchangeable.

    They must read the same elements (storage offset, sizes, strides) as the same values: same
    dtype, same conjugate and negative bits (a clone resolves them, so ``b`` and ``b.conj()``
    need two clones) and the same tensor type. Falls back to the tensor's identity (no sharing)
    without concrete integer geometry: symbolic sizes of fake tensors are unhashable.
    """
    try:
        geometry = (tensor.storage_offset(), *tensor.size(), *tensor.stride())
    except (RuntimeError, NotImplementedError):
        return id(tensor)
    if all(type(value) is int for value in geometry):
        return (
            type(tensor),
            tensor.dtype,
            tensor.is_conj(),
            tensor.is_neg(),
            tensor.dim(),
            geometry,
        )
    return id(tensor)


class MutationContext:
    """The state of one ``allow_mutation_on_saved_tensors`` context, yielded by it.

    Useful for inspection and tests: `num_saved` and `num_cloned` count the live
    saved tensors this context tracks and how many of them hold a clone. The state is cleared
    when the context exits; a graph recorded inside it can no longer be backpropagated then.
    """

    def __init__(self) -> None:
        self._pending: set[weakref.ref[_SavedTensor]] = set()
        self._by_storage: dict[int | None, list[weakref.ref[_SavedTensor]]] = {}
        self._cloned: set[weakref.ref[_SavedTensor]] = set()
        # Reentrant: a clone made while protecting may itself reach a write (through another
        # mode on the stack) that protects this context again.
        self._lock = threading.RLock()
        self._indexed = 0
        self._prune_at = 256
        self._pack, self._track = _make_pack(self._pending)
        self._guard = _MutationGuard(self)

    def num_saved(self) -> int:
        """Return how many tensors saved in this context are still held for backward."""
        with self._lock:
            refs = self._refs()
        return sum(1 for ref in refs if ref() is not None)

    def num_cloned(self) -> int:
        """Return how many of them were cloned because they were about to be written."""
        return sum(1 for ref in list(self._cloned) if ref() is not None)

    def clear(self) -> None:
        """Release every saved tensor and clone; backward through them raises afterwards.

        Called when the context exits. Tensors saved after a manual call are tracked afresh.
        """
        with self._lock:
            refs = self._refs()
            self._pending.clear()
            self._cloned.clear()
            self._by_storage.clear()
        for ref in refs:
            saved = ref()
            if saved is not None:
                with contextlib.suppress(AttributeError):
                    del saved.tensor

    def _refs(self) -> list[weakref.ref[_SavedTensor]]:
        """Every weak reference to a handle this context holds. Caller holds the lock."""
        refs = [*self._pending, *self._cloned]
        for bucket in self._by_storage.values():
            refs.extend(bucket)
        return refs

    def _index_pending(self) -> None:
        """Key every handle saved since the last write by its storage. Caller holds the lock.

        Buckets are lists of the pending set's own weak references: no new object per handle.
        References that died stay until the next prune, which runs once the number of
        references indexed since the last one exceeds twice the number then alive.
        """
        pending = self._pending
        batch = list(pending)
        pending.difference_update(batch)
        by_storage = self._by_storage
        for ref in batch:
            saved = ref()
            if saved is None:
                continue
            key = storage_key(saved.tensor)
            bucket = by_storage.get(key)
            if bucket is None:
                by_storage[key] = [ref]
            else:
                bucket.append(ref)
        self._indexed += len(batch)
        if self._indexed > self._prune_at:
            alive = 0
            for key, bucket in list(by_storage.items()):
                live = [ref for ref in bucket if ref() is not None]
                if live:
                    by_storage[key] = live
                    alive += len(live)
                else:
                    del by_storage[key]
            self._indexed = alive
            self._prune_at = 2 * alive + 256

    def _protect(self, written: Sequence[torch.Tensor], resizes: bool) -> list[int | None]:
        """Clone every tracked saved tensor that a write to ``written`` could change.

        Returns, once per written tensor, the storage it writes when that storage still holds
        tracked saved tensors after the clones: the write leaves their values alone but may bump
        their version counter (see `_seen_write`).
        """
        if self._pending:
            with self._lock:
                self._index_pending()
        by_storage = self._by_storage
        if not by_storage:
            return []
        touched = []
        for tensor in written:
            key = storage_key(tensor)
            if key in by_storage:
                with self._lock:
                    self._clone_overlapping(key, tensor, resizes)
                if key in by_storage:
                    touched.append(key)
        return touched

    def _seen_write(self, keys: list[int | None]) -> None:
        """After a write this context saw: the uncloned saved tensors on ``keys`` are unchanged.

        The op has run below autograd; autograd bumps the version counter of each tensor it
        wrote once the op returns, so a saved tensor sharing a counter with written tensors will
        be up to one step ahead per written tensor on its storage. Accept that range, so that
        only writes the context did not see make unpacking raise.
        """
        bumps: dict[int | None, int] = {}
        for key in keys:
            bumps[key] = bumps.get(key, 0) + 1
        with self._lock:
            for key, count in bumps.items():
                for ref in self._by_storage.get(key, ()):
                    saved = ref()
                    if saved is not None:
                        saved.version = saved.tensor._version
                        saved.slack = count

    def _clone_overlapping(self, key: int | None, written: torch.Tensor, resizes: bool) -> None:
        bucket = self._by_storage.get(key)
        if not bucket:
            return
        # Without a storage nothing can be compared: every storage-less saved tensor is cloned.
        span = None if key is None else _byte_span(written, resizes)
        if key is not None and span is None:
            return
        clones: dict[object, torch.Tensor] = {}
        kept: list[weakref.ref[_SavedTensor]] = []
        for ref in bucket:
            saved = ref()
            if saved is None:
                continue
            original = saved.tensor
            if span is not None and not _reaches(span, original):
                kept.append(ref)
                continue
            # A tensor saved several times (same alias, same version) shares one clone.
            shared = _clone_key(original)
            clone = clones.get(shared)
            if clone is None:
                clone = clones[shared] = original.clone()
            saved.tensor = clone
            saved.version = clone._version
            saved.slack = 0
            self._cloned.add(weakref.ref(saved, self._cloned.discard))
        if kept:
            self._by_storage[key] = kept
        else:
            del self._by_storage[key]


class _GuardedSave:
    """What a guarded user pair stores when its packed value may share the saved storage."""

    __slots__ = ("original_id", "packed", "saved")

    def __init__(self, saved: _SavedTensor, packed: object) -> None:
        self.saved = saved
        self.original_id = id(saved.tensor)
        self.packed = packed


def _is_copy(packed: object, tensor: torch.Tensor) -> bool:
    """Whether ``packed`` provably holds nothing that shares ``tensor``'s storage.

    Containers and objects are walked as the version guard walks them (`may_share_storage`):
    a record or dict holding a copy is a copy; one past the walk's budget is not.
    """
    # save_on_cpu's host copies (fenced at once under this guard), or a key or a path: the data
    # went elsewhere (to disk, say) and there is nothing to hold.
    if isinstance(packed, (SavedCopy, *_IMMUTABLE_TYPES)):
        return True
    if isinstance(packed, torch.Tensor):
        if packed is tensor or type(packed) not in _PLAIN_TENSOR_TYPES:
            return False  # a tensor subclass may wrap the saved tensor without sharing storage
        try:
            return not is_alias_of(packed, tensor)
        except (RuntimeError, NotImplementedError):
            return False
    if isinstance(packed, (tuple, list)):
        return all(_is_copy(item, tensor) for item in packed)
    return _walk_finds_no_alias(packed, tensor)


def _walk_finds_no_alias(packed: object, tensor: torch.Tensor) -> bool:
    try:
        return not may_share_storage(packed, tensor)
    except (RuntimeError, NotImplementedError):
        return False


class _GuardedPair:
    """A user's pack/unpack pair pushed inside the context, with the context's protection."""

    __slots__ = ("_context", "_pack_hook", "_unpack_hook")

    def __init__(self, context: MutationContext, pack_hook: PackHook, unpack_hook: UnpackHook):
        self._context = context
        self._pack_hook = pack_hook
        self._unpack_hook = unpack_hook

    def pack(self, tensor: torch.Tensor) -> object:
        """Call the user's pack; track the tensor unless what pack returned is a real copy."""
        # Tested first: the user's pack may create autograd nodes, which would hide that
        # ``tensor`` is an output of the node saving it.
        is_output = is_output_of_saving_node(tensor)
        packed = self._pack_hook(tensor)
        if _is_copy(packed, tensor):
            return packed
        return _GuardedSave(self._context._track(tensor, is_output), packed)

    def unpack(self, stored: object) -> torch.Tensor:
        """Hand back the save-time clone if the tensor was written; else call the user's unpack."""
        if type(stored) is not _GuardedSave:
            return self._unpack_hook(stored)
        saved = stored.saved
        current = saved.tensor  # raises once the context has exited
        if id(current) != stored.original_id:
            return current
        if current._version != saved.version:
            _check_version(saved, current)
        return self._unpack_hook(stored.packed)


class _MutationGuard:
    """The save guard a context installs: user pairs pushed inside keep its protection."""

    __slots__ = ("_context",)

    lets_saved_tensors_change = True
    version_check_may_be_inlined = False

    def __init__(self, context: MutationContext) -> None:
        self._context = context

    def wrap(self, pack_hook: PackHook, unpack_hook: UnpackHook) -> tuple[PackHook, UnpackHook]:
        """Return ``(pack_hook, unpack_hook)`` wrapped so that writes clone what they save."""
        pair = _GuardedPair(self._context, pack_hook, unpack_hook)
        pack = pair.pack  # the bound method pushed, kept in the registry while it is alive
        register_protected_pack_hook(pack)
        return pack, pair.unpack


# NOTE [Saved-tensor hooks the context did not install]
#
# torch's own ``saved_tensors_hooks`` (and its subclasses: torch's ``save_on_cpu``, the hooks of
# ``torch.utils.checkpoint``) cannot be intercepted when they are pushed. The context takes such a
# pair over the first time it sees it innermost: it pops it and pushes the pair wrapped by the
# save guard in force (``guard.wrap(pack, unpack)``), so what it saves from then on is tracked and
# cloned before a write, as for pairs pushed with tensorhooks. ``saved_tensors_hooks.__exit__``
# only pops, so the swap is invisible to the code that pushed the pair.
#
# When to look: tensors are saved when autograd creates a node, and every node takes the next
# number of the thread's sequence counter. The mode reads that counter on every operator (a few
# tens of nanoseconds) and reads the innermost pair (a few hundred) only when it moved since the
# last look. Autograd saves a node's inputs before the operator reaches the mode, so the inputs
# of the operator at which a pair is taken over may already sit in what the foreign pack kept:
# they are recorded (weakly, by storage) as *foreign saves*, and a later write that reaches one
# of them raises ``UnguardedHooksError`` instead of changing what backward may read. Outputs are
# saved after the operator returns, through the wrapped pair.
#
# Exceptions:
# - ``torch.utils.checkpoint``'s forward pair stores no tensor data (a holder per save); it is
#   left as it is (wrapping it would keep every tensor alive that it means to free).
# - its recomputation pair (pushed in backward around the recomputed forward) hands what it saves
#   to the checkpoint frame directly, past any unpack: wrapping cannot protect it. Everything it
#   saves is recorded as a foreign save for the graph task running the recomputation, so a
#   write during recomputation that reaches a tensor recomputed for backward raises.
# - tensors saved under a foreign pair before any operator reached the mode (a custom Function
#   whose forward runs no operator, ``checkpoint``'s own inputs saved as the first thing) are
#   not seen. See the Limits section of docs/allow_mutation_on_saved_tensors.md.
# The innermost pair can only be read on torch 2.8 and newer; before that all of this is off, and
# entering the context warns once.

_CHECKPOINT_MODULE = "torch.utils.checkpoint"
_CHECKPOINT_FORWARD_PACK = "_checkpoint_hook."
_CHECKPOINT_RECOMPUTATION_PACK = "_recomputation_hook."

_NO_INNERMOST_HOOKS_READER = (
    "allow_mutation_on_saved_tensors: this torch ({version}) cannot read the innermost "
    "saved-tensor hooks, so UnguardedHooksError protection is off: an in-place write made while "
    "torch's own torch.autograd.graph.saved_tensors_hooks (or torch's save_on_cpu) is the "
    "innermost pair inside the context is not caught. Upgrade to torch 2.8 or newer to turn it "
    "on, or push hooks with tensorhooks.saved_tensors_hooks, which keep the protection."
)


def _warn_if_unguarded() -> None:
    """Warn once per process when this torch cannot check the innermost hooks on writes."""
    if top_saved_tensors_hooks is None:
        warn_once(
            "allow_mutation_on_saved_tensors:top_saved_tensors_hooks",
            _NO_INNERMOST_HOOKS_READER.format(version=torch.__version__),
        )


class _ForeignSave:
    """A tensor that hooks the context did not install may hold: writes reaching it raise."""

    __slots__ = ("hook_name", "ref", "slack", "task", "version")

    def __init__(self, tensor: torch.Tensor, hook_name: str, task: int | None) -> None:
        self.ref = weakref.ref(tensor)
        self.hook_name = hook_name
        # The graph task whose recomputation saved it; None: until the tensor dies.
        self.task = task
        # Versions it may be at with no write the mode did not see (a seen write to another
        # part of its storage moves the shared counter). See NOTE [Detecting writes the context
        # did not see].
        self.version = tensor._version
        self.slack = 0

    def check_version(self) -> None:
        """Raise autograd's in-place error if a write the mode did not see changed the tensor."""
        tensor = self.ref()
        if tensor is not None and not self.version <= tensor._version <= self.version + self.slack:
            raise _unseen_write_error(tensor, self.version)


# Storage key -> foreign saves on that storage, on every thread; guarded by the lock.
_foreign_saves: dict[int | None, list[_ForeignSave]] = {}
_foreign_saves_lock = threading.Lock()


def _record_foreign_saves(
    tensors: Sequence[torch.Tensor], hook_name: str, task: int | None
) -> list[_ForeignSave]:
    made = []
    with _foreign_saves_lock:
        for tensor in tensors:
            key = storage_key(tensor)
            records = [
                record
                for record in _foreign_saves.get(key, ())
                if record.ref() is not None and (record.task is None or record.task == task)
            ]
            made.append(_ForeignSave(tensor, hook_name, task))
            records.append(made[-1])
            _foreign_saves[key] = records
    return made


def _check_foreign_saves(func: OpOverload, written: Sequence[torch.Tensor], resizes: bool) -> None:
    """Raise if ``written`` can reach a tensor that hooks the context did not install kept."""
    task = current_graph_task_id()
    for tensor in written:
        key = storage_key(tensor)
        records = _foreign_saves.get(key)
        if not records:
            continue
        span = None if key is None else _byte_span(tensor, resizes)
        live = []
        for record in records:
            saved = record.ref()
            if saved is None or (record.task is not None and record.task != task):
                continue
            live.append(record)
            if span is not None:
                if not _reaches(span, saved):
                    record.slack += 1  # the write moves the shared version counter
                    continue
            elif key is not None:
                continue
            raise _foreign_write_error(func, record.hook_name)
        with _foreign_saves_lock:
            if live:
                _foreign_saves[key] = live
            else:
                _foreign_saves.pop(key, None)


def _foreign_write_error(func: OpOverload, name: str) -> UnguardedHooksError:
    return UnguardedHooksError(
        f"allow_mutation_on_saved_tensors: in-place operator {func} writes a tensor that "
        f"saved-tensor hooks not pushed by tensorhooks (pack hook {name!r}) may hold for "
        "backward: it was saved before the context could take those hooks over (or by "
        "torch.utils.checkpoint's recomputation), so the write could silently change what "
        "backward reads. Push the hooks with tensorhooks.saved_tensors_hooks (or use "
        "tensorhooks.save_on_cpu), which keep the protection, write to a copy, or, inside a "
        "checkpointed function, use an out-of-place operator (h = h + f(h))."
    )


def _tensors_in(values: Iterable[Any]) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, (list, tuple)):
            tensors.extend(item for item in value if isinstance(item, torch.Tensor))
    return tensors


def _recording_pack(pack: PackHook, hook_name: str, task: int) -> PackHook:
    """``pack``, recording what it returns as foreign saves of graph task ``task``."""

    def recording_pack(tensor: torch.Tensor) -> object:
        packed = pack(tensor)
        _record_foreign_saves(_tensors_in((packed,)), hook_name, task)
        return packed

    register_protected_pack_hook(recording_pack)
    return recording_pack


def _take_over_innermost_hooks(
    mode: _CloneBeforeWriteMode, func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[_ForeignSave]:
    """Swap a foreign innermost pair for its guarded version.

    Returns the foreign saves recorded for this operator's inputs that the saving node must
    check (see `_call_and_tie`). See NOTE [Saved-tensor hooks the context did not install].
    """
    if top_saved_tensors_hooks is None:
        return []  # see _warn_if_unguarded
    top = top_saved_tensors_hooks()
    if top is None or top[0] is mode.known_pack:
        return []
    pack, unpack = top
    if is_protected_pack_hook(pack) or get_disabled_hooks_message() is not None:
        mode.known_pack = pack
        return []
    name = getattr(pack, "__qualname__", None) or type(pack).__name__
    checkpoint = getattr(pack, "__module__", None) == _CHECKPOINT_MODULE
    if checkpoint and name.startswith(_CHECKPOINT_FORWARD_PACK):
        mode.known_pack = pack  # stores no tensor data
        return []
    # This operator's inputs may already be in what ``pack`` kept; what it writes was not
    # (autograd saves a copy of an input an in-place formula needs).
    written = {id(value) for value in _written_values(func, args, kwargs)}
    inputs = [t for t in _tensors_in((*args, *kwargs.values())) if id(t) not in written]
    records: list[_ForeignSave] = []
    if checkpoint and name.startswith(_CHECKPOINT_RECOMPUTATION_PACK):
        task = current_graph_task_id()
        _record_foreign_saves(inputs, name, task)
        new_pack, new_unpack = _recording_pack(pack, name, task), unpack
    else:
        records = _record_foreign_saves(inputs, name, None)
        new_pack, new_unpack = current_save_guard().wrap(pack, unpack)
    pop_saved_tensors_hooks()
    push_saved_tensors_hooks(new_pack, new_unpack)
    mode.known_pack = new_pack
    return records


# NOTE [Checking foreign saves in backward]
#
# A write made where the mode cannot see it (on a thread with no open context) can change a
# foreign save with no error at the write; what torch's pack kept has no version check of its
# own (autograd skips its check once hooks are installed). The operator at which the pair is
# taken over is therefore run by the handler itself, which keeps weak references to its outputs
# and looks at them on the thread's next operator (it forces one more pass through the slow
# branch): by then autograd has set their ``grad_fn``, the node that saved the inputs. A
# pre-hook on that node compares each foreign save's version before the node unpacks them and
# raises autograd's in-place error on a change. If that next operator already runs in backward
# (the output was backwarded at once), the versions are compared there, before the node's
# formula has read anything. Cost: one operator per take-over, nothing per operator otherwise.


def _call_and_tie(
    mode: _CloneBeforeWriteMode,
    records: list[_ForeignSave],
    func: OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Run ``func``; tie ``records`` to the node that saved them.

    See NOTE [Checking foreign saves in backward].
    """
    call = _READ_ONLY_OPS.get(id(func))
    result = _dispatch_write(func, args, kwargs) if call is None else call(*args, **kwargs)
    outputs = _tensors_in((result,))
    mode.untied = (records, [weakref.ref(output) for output in outputs])
    mode.sequence_nr = -1  # look again on the next operator, once autograd set grad_fn
    return result


def _tie_foreign_saves(
    mode: _CloneBeforeWriteMode,
    untied: tuple[list[_ForeignSave], list[weakref.ref[torch.Tensor]]],
) -> None:
    """Hook the node that saved ``untied``'s records, or check them now."""
    records, outputs = untied
    mode.untied = None
    nodes = {}
    for ref in outputs:
        output = ref()
        node = None if output is None else output.grad_fn
        if node is not None:
            nodes[id(node)] = node
    if not nodes or current_graph_task_id() != -1:  # no node to hook, or already in backward
        for record in records:
            record.check_version()
        if not nodes:
            return

    def check(*_: object) -> None:
        for record in records:
            record.check_version()

    for node in nodes.values():
        node.register_prehook(check)


def _written_values(
    func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[torch.Tensor]:
    op = _WRITING_OPS.get(id(func))
    written = op.written if op is not None else _written_arguments(func)
    values = []
    for argument in written:
        position = argument.position
        values.append(args[position] if 0 <= position < len(args) else kwargs.get(argument.name))
    return _tensors_in(values)


class _WrittenArgument(NamedTuple):
    position: int  # index into args, or -1 for keyword-only arguments
    name: str
    resizes: bool


class _WritingOp(NamedTuple):
    call: Callable[..., Any]
    written: tuple[_WrittenArgument, ...]


# Both keyed by id(OpOverload): OpOverload.__hash__ is Python code. Every op seen is kept alive in
# _SEEN_OPS, so an id can never be reused by another op.
# Ops that write nothing -> what to call: the per-operator fast path.
_READ_ONLY_OPS: dict[int, Callable[..., Any]] = {}
# Ops that write -> what to call and which arguments they write.
_WRITING_OPS: dict[int, _WritingOp] = {}
_SEEN_OPS: list[OpOverload] = []


def _written_arguments(func: OpOverload) -> tuple[_WrittenArgument, ...]:
    """The arguments ``func`` writes, read once from its schema."""
    schema = op_schema(func)
    if schema.name in _VALUE_PRESERVING_OPS:
        return ()
    resizing_op = schema.name in _RESIZING_OPS
    written = []
    for position, argument in enumerate(schema.arguments):
        info = argument.alias_info
        if info is None or not info.is_write:
            continue
        written.append(
            _WrittenArgument(
                -1 if argument.kwarg_only else position,
                argument.name,
                argument.is_out or resizing_op,
            )
        )
    return tuple(written)


# Open contexts, on every thread; replaced (never mutated) under the lock so readers need none.
_open_contexts: tuple[MutationContext, ...] = ()
_open_contexts_lock = threading.Lock()


def _first_call(func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Read which arguments ``func`` writes, cache it, then run it as later calls will."""
    written = _written_arguments(func)
    call = op_call(func)
    _SEEN_OPS.append(func)
    if not written:
        _READ_ONLY_OPS[id(func)] = call
        return call(*args, **kwargs)
    _WRITING_OPS[id(func)] = _WritingOp(call, written)
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
        elif isinstance(value, (list, tuple)):
            tensors = [item for item in value if isinstance(item, torch.Tensor)]
        else:
            continue
        if _foreign_saves:
            _check_foreign_saves(func, tensors, argument.resizes)
        for context in contexts:
            keys = context._protect(tensors, argument.resizes)
            if keys:
                touched.append((context, keys))
    result = op.call(*args, **kwargs)
    for context, keys in touched:
        context._seen_write(keys)
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
            _tie_foreign_saves(self, untied)
        records = _take_over_innermost_hooks(self, func, args, kwargs or {})
        if records:
            return _call_and_tie(self, records, func, args, kwargs or {})
    call = _READ_ONLY_OPS.get(id(func))
    if call is None:
        return _dispatch_write(func, args, kwargs or {})
    if kwargs:
        return call(*args, **kwargs)
    return call(*args)


_HANDLER_SKIPPED_BY_DYNAMO = skip_code_in_dynamo(_torch_dispatch.__code__)


class _CloneBeforeWriteMode(UnwrappedDispatchMode):
    """Clones saved tensors that an operator is about to write. See NOTE [Clone before write]."""

    # The thread's node counter when last looked at, and the innermost pack hook known to be
    # safe then. See NOTE [Saved-tensor hooks the context did not install].
    sequence_nr = -1
    known_pack: object = None
    # Foreign saves and weak references to the outputs of the operator that saved them, until
    # the next operator ties them to its node. See NOTE [Checking foreign saves in backward].
    untied: tuple[list[_ForeignSave], list[weakref.ref[torch.Tensor]]] | None = None

    # torch's torch._disable_dynamo wrapper only when Dynamo could not be told to skip the
    # handler directly.
    handler_skipped_by_dynamo = _HANDLER_SKIPPED_BY_DYNAMO
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

        See NOTE [Contexts under torch.compile].
        """
        if getattr(self, "_active", False):
            warn_compile_skipped("allow_mutation_on_saved_tensors")
        return False


def _mode_for_this_thread() -> contextlib.AbstractContextManager[object]:
    """A new clone-before-write mode, or nothing if this thread's innermost mode is one already.

    One mode protects every open context, so a nested context adds none: each operator goes
    through one handler and each write protects each context once. A context entered under
    another mode pushes its own, which sees the operators that mode does not forward.
    """
    if isinstance(current_dispatch_mode(), _CloneBeforeWriteMode):
        return contextlib.nullcontext()
    return _CloneBeforeWriteMode()  # type: ignore[no-untyped-call]  # torch's __init__ is untyped


@not_traced("allow_mutation_on_saved_tensors")  # See NOTE [Contexts under torch.compile]
@contextlib.contextmanager
def allow_mutation_on_saved_tensors() -> Generator[MutationContext, None, None]:
    """Context manager under which tensors saved for backward may be changed in place.

    Normally, changing a tensor in place after autograd saved it makes backward raise. Inside
    this context a saved tensor is cloned just before an operation writes to it, and backward
    uses the clone, so gradients are those of the values at the time they were saved. Only
    tensors that are both saved and written are cloned; a clone lives as long as the part of
    the graph that needs it.

    Same semantics as `torch.autograd.graph.allow_mutation_on_saved_tensors`, plus: a
    write through any alias of a saved tensor (a view, its base, an overlapping slice, an
    ``out=`` argument, a foreach list) is caught, hooks pushed inside with tensorhooks'
    `saved_tensors_hooks` keep the protection, contexts nest, and contexts on different
    threads are independent. It also costs far less per operation.

    Example:
        >>> import torch, tensorhooks
        >>> a = torch.ones(2, 3, requires_grad=True)
        >>> with tensorhooks.allow_mutation_on_saved_tensors():
        ...     b = a.clone()
        ...     out = (b**2).sum()
        ...     _ = b[:, 1:].sin_()  # a view of the saved tensor, changed in place
        ...     out.backward()
        >>> a.grad
        tensor([[2., 2., 2.],
                [2., 2., 2.]])

    Returns:
        A context manager that yields a `MutationContext`, whose state (saved tensors
        and clones) is cleared when the context exits.

    Raises:
        RuntimeError: on entry, if saved-tensor hooks are disabled by
            ``disable_saved_tensors_hooks`` (raised by torch, with the message given there).
        MutationContextExitedError: during backward, if the graph was recorded inside a context
            that has exited since (a ``RuntimeError``, and an ``AssertionError`` as torch's).
        UnguardedHooksError: on an in-place write into a tensor that torch's own
            ``torch.autograd.graph.saved_tensors_hooks`` (or torch's ``save_on_cpu``), pushed
            inside the context, may have saved before the context took them over, or into a
            tensor saved by ``torch.utils.checkpoint``'s recomputation (a ``RuntimeError``).

    Nesting and threads: contexts nest (torch raises); the inner one tracks what is saved inside
    it, so backward of a graph recorded there must run before it exits. Each thread has its own
    dispatch mode and hook stack, so a context covers the forward passes and writes of the
    thread that entered it; a write made under any open context, on any thread, protects the
    tensors saved by all of them. Writes made on a thread with no open context are not seen.
    Pairs pushed inside by tensorhooks (``saved_tensors_hooks``, ``save_on_cpu``) apply to what
    is saved while they are innermost, as usual; if their pack returns the tensor itself or a
    view of it, unpack returns the save-time clone after a write.
    """
    global _open_contexts  # noqa: PLW0603 (replaced as a whole so readers need no lock)
    _warn_if_unguarded()
    context = MutationContext()
    push_saved_tensors_hooks(context._pack, _unpack)
    try:
        with use_save_guard(context._guard), _mode_for_this_thread():
            with _open_contexts_lock:
                _open_contexts = (*_open_contexts, context)
            try:
                yield context
            finally:
                with _open_contexts_lock:
                    _open_contexts = tuple(c for c in _open_contexts if c is not context)
    finally:
        pop_saved_tensors_hooks()
        context.clear()
