"""What save_on_cpu's pack returns for a copied tensor, and the per-thread timelines behind them.

The rules these records follow are NOTE [Offloading saved tensors without races] in `context.py`.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Protocol

import torch

from tensorhooks._core.errors import SavedTensorModifiedError
from tensorhooks._core.guards import SavedCopy, modified_message
from tensorhooks._core.store import graph_task_store
from tensorhooks._core.torch_compat import (
    current_graph_task_id,
    neg_view,
    next_sequence_nr,
    sequence_nr,
)

from .copy_engines import CopyEngine
from .pinned_pool import HostPool

__all__ = ["HostCopy", "Issuer", "Offloaded", "Prefetch", "Timeline", "copy_strides"]


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    step = 1
    for n in reversed(size):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def copy_strides(tensor: torch.Tensor) -> tuple[int, ...]:
    """Strides for a copy of ``tensor``: its own when they cover its elements densely.

    Keeping a dense layout (transposed, channels-last) makes the copy a plain memcpy and gives
    backward the layout it saw in forward; anything else (a strided slice, an expanded tensor) is
    copied contiguously, as torch's pinned path does.
    """
    if tensor.is_contiguous():
        return tuple(tensor.stride())
    size, stride = tuple(tensor.shape), tuple(tensor.stride())
    if 0 in size:
        return _contiguous_strides(size)
    expected = 1
    for step, n in sorted((s, n) for s, n in zip(stride, size, strict=True) if n != 1):
        if step != expected:
            return _contiguous_strides(size)
        expected *= n
    return stride


class Timeline:
    """The offloaded saves of one thread on one device: save order (for prefetch) and dedupe.

    ``records`` maps a sequence number to a live record; ``saved`` maps ``id(tensor)`` to
    ``(weak tensor, version at save, weak record)`` (see NOTE [Offloading saved tensors without
    races] for why each part is needed). ``forward`` numbers the forward passes (see
    `forward_of`); ``entry`` is the context entry that made the latest record and ``node`` the
    autograd sequence number of the node that saved it.
    """

    __slots__ = ("__weakref__", "entry", "forward", "next_seq", "node", "records", "saved")

    def __init__(self) -> None:
        self.next_seq = 0
        self.records: weakref.WeakValueDictionary[int, Offloaded] = weakref.WeakValueDictionary()
        self.saved: dict[int, tuple[weakref.ref[torch.Tensor], int, weakref.ref[Any]]] = {}
        self.forward = 0
        self.entry = -1
        self.node = -1

    def forward_of(self, tensor: torch.Tensor, entry: int) -> int:
        """The number of the forward pass that a new offloaded save of ``tensor`` belongs to.

        Called as pack starts. Records of one context entry share a forward. The first record of
        another entry continues the forward of the latest record when ``tensor`` was computed
        from what that record's node computed (one context per layer); otherwise (the next
        micro-batch, another model) a new forward begins, and prefetch stops at its start.
        """
        node = next_sequence_nr() - 1  # the saving node (see is_output_of_saving_node)
        if entry != self.entry:
            self.entry = entry
            latest = self.records.get(self.next_seq - 1)
            if latest is None or not _computed_from(tensor.grad_fn, self.node):
                self.forward += 1
        self.node = node
        return self.forward

    def find(self, tensor: torch.Tensor) -> Offloaded | HostCopy | None:
        """The live record of an earlier save of ``tensor`` at its current version, if any."""
        entry = self.saved.get(id(tensor))
        if entry is None:
            return None
        tensor_ref, version, record_ref = entry
        if tensor_ref() is not tensor or tensor._version != version:
            return None
        record: Offloaded | HostCopy | None = record_ref()
        if type(record) is Offloaded:
            record.uses += 1  # how many unpacks backward will make of a prefetched copy
        return record

    def remember(self, tensor: torch.Tensor, record: Offloaded | HostCopy) -> None:
        """Map ``tensor`` to ``record`` until the tensor dies."""
        key = id(tensor)
        saved = self.saved

        def forget(dead: weakref.ref[torch.Tensor]) -> None:
            entry = saved.get(key)
            if entry is not None and entry[0] is dead:
                del saved[key]

        saved[key] = (weakref.ref(tensor, forget), tensor._version, weakref.ref(record))


# How many autograd nodes `_computed_from` looks at before giving up (and answering True).
_HISTORY_WALK_LIMIT = 64


def _computed_from(grad_fn: Any, node: int) -> bool:
    """Whether the node numbered ``node`` is ``grad_fn`` or in its history, on this thread.

    A node's history is older than the node (smaller numbers; ``AccumulateGrad`` has the
    largest number and no history), so the walk skips what is older than ``node``. Nodes of
    other threads do not follow that order: after `_HISTORY_WALK_LIMIT` nodes the answer is
    True, which only keeps prefetching as it was.
    """
    if grad_fn is None:
        return False
    stack = [grad_fn]
    seen = {grad_fn}
    while stack:
        current = stack.pop()
        number = sequence_nr(current)
        if number == node:
            return True
        if number < node:
            continue
        if len(seen) > _HISTORY_WALK_LIMIT:
            return True
        for parent, _ in current.next_functions:
            if parent is not None and parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return False


# NOTE [Conjugate and negative bits of offloaded tensors]
# A saved tensor may be a lazy view with the conjugate or negative bit set (``a @ b.mH`` saves a
# conjugate view, ``z.conj().imag`` a negative one). Copying such a view into a host buffer with
# ``copy_(non_blocking=True)`` queues the DMA of the raw bytes and then resolves the bit on the host
# buffer right away, before the DMA has landed: the buffer ends up with the raw values. So the copy
# moves the raw data (the view with its bits cleared), and the record carries the bits, which the
# copy brought back to the device gets again: the same lazy view backward saw saved.


def strip_view_bits(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[bool, bool]]:
    """``tensor`` with its conjugate and negative bits cleared (a view), and the bits."""
    conj, neg = tensor.is_conj(), tensor.is_neg()
    if conj:
        tensor = tensor.conj()  # of a conjugate view: the raw data, a view without the bit
    if neg:
        tensor = neg_view(tensor)
    return tensor, (conj, neg)


def apply_view_bits(tensor: torch.Tensor, bits: tuple[bool, bool]) -> torch.Tensor:
    """``tensor`` viewed with the conjugate and negative bits ``strip_view_bits`` returned."""
    conj, neg = bits
    if neg:
        tensor = neg_view(tensor)
    if conj:
        tensor = tensor.conj()
    return tensor


class HostCopy(SavedCopy):
    """A saved tensor copied to host memory on the current stream, the way torch does it."""

    __slots__ = ("__weakref__", "device", "host", "non_blocking")

    def __init__(self, device: torch.device, host: torch.Tensor, non_blocking: bool) -> None:
        self.device = device
        self.host = host
        self.non_blocking = non_blocking

    def restore(self) -> torch.Tensor:
        """A new tensor on the original device with the saved value."""
        return self.host.to(self.device, non_blocking=self.non_blocking, copy=True)


class Prefetch:
    """What one graph task has copied back ahead of use, for one timeline.

    ``ready`` maps a sequence number to ``[device tensor, event, unpacks left]``; ``done`` holds
    the numbers whose every unpack happened, so they are not fetched again.
    """

    __slots__ = ("done", "lock", "ready")

    def __init__(self) -> None:
        self.ready: dict[int, list[Any]] = {}
        self.done: set[int] = set()
        self.lock = threading.Lock()


class Issuer(Protocol):
    """The context entry that issued a copy; it fences its copies in save order."""

    @property
    def entry(self) -> int:
        """The entry's number (see `Timeline.forward_of`)."""
        ...

    @property
    def prefetch(self) -> int:
        """How many saved tensors backward copies back ahead of the one it unpacks."""
        ...

    def fence_through(self, record: Offloaded) -> None:
        """Fence the entry's pending copies up to and including ``record``'s."""
        ...


class Offloaded(SavedCopy):
    """A saved tensor copied to a pooled host buffer on a side stream."""

    __slots__ = (
        "__weakref__",
        "bits",
        "buffer",
        "device",
        "dtype",
        "engine",
        "event",
        "forward",
        "host",
        "issuer",
        "pool",
        "prefetch",
        "raced",
        "seq",
        "size",
        "source",
        "stream",
        "stride",
        "timeline",
        "uses",
        "version",
    )

    def __init__(
        self,
        tensor: torch.Tensor,
        engine: CopyEngine,
        pool: HostPool,
        timeline: Timeline,
        issuer: Issuer,
    ) -> None:
        self.forward = timeline.forward_of(tensor, issuer.entry)
        size = tuple(tensor.shape)
        stride = copy_strides(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        self.engine = engine
        self.pool = pool
        self.buffer = pool.acquire(nbytes)
        self.host = self.buffer.view(tensor.dtype).as_strided(size, stride)
        self.device = tensor.device
        self.dtype = tensor.dtype
        self.size = size
        self.stride = stride
        self.uses = 1
        self.prefetch = issuer.prefetch
        self.seq = timeline.next_seq
        timeline.next_seq += 1
        self.timeline = timeline
        self.issuer: Issuer | None = issuer
        self.raced: tuple[str, list[int], int] | None = None
        self.version = tensor._version
        # Detached: the alias shares storage and version counter without holding the graph.
        # See NOTE [Conjugate and negative bits of offloaded tensors] for the bits.
        source, self.bits = strip_view_bits(tensor.detach())
        self.source: torch.Tensor | None = source
        self.stream = engine.current_stream()
        self.event = engine.to_host(self.source, self.host, self.stream)

    def __del__(self) -> None:
        buffer = getattr(self, "buffer", None)
        if buffer is not None:
            self.pool.release(buffer)

    def fence(self) -> None:
        """Order later work of the producing stream after the copy; detect earlier writes."""
        source = self.source
        if source is None:
            return
        self.engine.wait(self.stream, self.event)
        if source._version != self.version:
            self.raced = (source.type(), list(source.shape), source._version)
        self.source = None
        self.stream = None
        self.issuer = None

    def _fetch(self) -> tuple[torch.Tensor, Any]:
        self.pool.count_to_device(self.buffer.numel())
        return self.engine.to_device(self.host, self.size, self.stride, self.dtype)

    def restore(self) -> torch.Tensor:
        """A device tensor with the saved value, fetched ahead of use when possible."""
        issuer = self.issuer
        if issuer is not None:
            issuer.fence_through(self)
        if self.raced is not None:
            raise _raced_error(*self.raced, self.version)
        engine = self.engine
        consumer = engine.current_stream()
        if current_graph_task_id() == -1:
            # Unpacked outside backward (``grad_fn._saved_self``): nothing to prefetch for.
            tensor, event = self._fetch()
        else:
            state = graph_task_store.current().get(self.timeline, Prefetch)
            with state.lock:
                slot = state.ready.get(self.seq)
                if slot is None:
                    slot = [*self._fetch(), self.uses]
                    state.ready[self.seq] = slot
                tensor, event = slot[0], slot[1]
                slot[2] -= 1
                if slot[2] <= 0:
                    del state.ready[self.seq]
                    state.done.add(self.seq)
                self._fetch_ahead(state)
        engine.hand_over(tensor, consumer, event)
        return apply_view_bits(tensor, self.bits)

    def _fetch_ahead(self, state: Prefetch) -> None:
        records = self.timeline.records
        for seq in range(self.seq - 1, max(self.seq - 1 - self.prefetch, -1), -1):
            if seq in state.ready or seq in state.done:
                continue
            record = records.get(seq)
            if record is None or record.engine is not self.engine:
                continue
            if record.forward != self.forward:
                break  # saved by another forward pass: not this graph task's, most likely
            issuer = record.issuer
            if issuer is not None:
                issuer.fence_through(record)
            if record.raced is not None:
                continue
            try:
                state.ready[seq] = [*record._fetch(), record.uses]
            except torch.OutOfMemoryError:
                # Speculative: the tensor is not needed yet, and its own unpack fetches it (or
                # raises) later. See NOTE [Offloading saved tensors without races], rule 6.
                return


def _raced_error(
    type_name: str, shape: list[int], version: int, saved_version: int
) -> SavedTensorModifiedError:
    return SavedTensorModifiedError(
        modified_message(type_name, shape, version, saved_version)
        + " Hint: save_on_cpu was still copying this tensor to host "
        "memory on a side stream when it was changed in place, so the copy may hold the changed "
        "values. Change it only after the save_on_cpu context exits, change a clone instead, or "
        "pass max_in_flight=0 so that each copy is ordered before the ops that follow it."
    )
