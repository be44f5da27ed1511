"""The state of one allow_mutation_on_saved_tensors context: what it saved, indexed by storage.

`MutationContext` keeps the handles its pack hook makes (`saved_tensor`), clones those that a
write can reach (`aliasing`) just before the write, and records how far a write that reached
none of them moved their version counter (see NOTE [Detecting writes the context did not see]
in `saved_tensor.py`).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Sequence

import torch

from tensorhooks._core.torch_compat import storage_key

from .aliasing import byte_span, clone_key, reaches
from .guarded_pairs import MutationGuard
from .saved_tensor import (
    PENDING,
    SavedTensor,
    holds_weight,
    make_pack,
    settle_to_original,
    shares_version_counter,
)

__all__ = ["MutationContext"]


class MutationContext:
    """The state of one ``allow_mutation_on_saved_tensors`` context, yielded by it.

    Useful for inspection and tests: `num_saved` and `num_cloned` count the live
    saved tensors this context tracks and how many of them hold a clone. The state is cleared
    when the context exits; a graph recorded inside it can no longer be backpropagated then.
    """

    def __init__(self) -> None:
        self._pending: set[weakref.ref[SavedTensor]] = set()
        self._by_storage: dict[int | None, list[weakref.ref[SavedTensor]]] = {}
        self._cloned: set[weakref.ref[SavedTensor]] = set()
        # Reentrant: a clone made while protecting may itself reach a write (through another
        # mode on the stack) that protects this context again.
        self._lock = threading.RLock()
        self._indexed = 0
        self._prune_at = 256
        self._pack, self._track = make_pack(self._pending)
        self._guard = MutationGuard(self._track)

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
                for name in ("tensor", "original"):
                    with contextlib.suppress(AttributeError):
                        delattr(saved, name)

    def _refs(self) -> list[weakref.ref[SavedTensor]]:
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

    def _protect(
        self, written: Sequence[torch.Tensor], resizes: bool, counted_later: bool
    ) -> list[int | None]:
        """Clone every tracked saved tensor that a write to ``written`` could change.

        ``counted_later``: the version counters of the written tensor will tell, after the write,
        whether autograd counts it (see NOTE [Writes autograd does not count] in
        `saved_tensor.py`); the clone is then used only if it does.

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
                    self._clone_overlapping(key, tensor, resizes, counted_later)
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
                    if saved is not None and saved.version != PENDING:
                        saved.version = saved.tensor._version
                        saved.slack = count

    def _clone_overlapping(
        self, key: int | None, written: torch.Tensor, resizes: bool, counted_later: bool
    ) -> None:
        bucket = self._by_storage.get(key)
        if not bucket:
            return
        # Without a storage nothing can be compared: every storage-less saved tensor is cloned.
        span = None if key is None else byte_span(written, resizes)
        if key is not None and span is None:
            return
        clones: dict[object, torch.Tensor] = {}
        kept: list[weakref.ref[SavedTensor]] = []
        for ref in bucket:
            saved = ref()
            if saved is None:
                continue
            # A handle still deciding about an earlier write decides now, before this one.
            if saved.version == PENDING and not settle_to_original(saved):
                continue  # the earlier write counted: its clone is final, off this storage
            original = saved.tensor
            if span is not None and not reaches(span, original):
                kept.append(ref)
                continue
            # A tensor saved several times (same alias, same version) shares one clone.
            shared = clone_key(original)
            clone = clones.get(shared)
            if clone is None:
                clone = clones[shared] = original.clone()
            saved.tensor = clone
            saved.slack = 0
            if (
                counted_later
                and holds_weight(saved, original)
                and shares_version_counter(original, written)
            ):
                # See NOTE [Writes autograd does not count] in `saved_tensor.py`. Kept on this
                # storage: a later write must find it.
                saved.original = original
                saved.original_version = original._version
                saved.version = PENDING
                kept.append(ref)
            else:
                saved.version = clone._version
            self._cloned.add(weakref.ref(saved, self._cloned.discard))
        if kept:
            self._by_storage[key] = kept
        else:
            del self._by_storage[key]
