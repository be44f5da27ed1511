"""save_on_cpu: tensors saved for backward wait in host memory until backward needs them.

# NOTE [Offloading saved tensors without races]
#
# torch's ``save_on_cpu`` copies every saved tensor to the host on the compute stream, once per
# op that saves it (parameters included), and copies it back on the compute stream when an op's
# backward unpacks it. Stream order makes that safe and slow. Here, with ``pin_memory=True`` on a
# device with streams, copies run on one side stream per device and overlap with compute; four
# rules keep them correct:
#
# 1. Source before copy. The side stream waits for the compute stream before each device-to-host
#    copy, so the copy reads the finished value.
# 2. No write or reuse before the copy is done. The record keeps a detached alias of the source
#    (so the device memory cannot be freed and handed to another tensor) until it is *fenced*:
#    the stream that produced the tensor waits on the copy's event, after which any later write
#    to the tensor, and any reuse of its memory by the caching allocator, is ordered after the
#    copy. A session fences its oldest copy once more than ``max_in_flight`` are pending, and
#    fences everything when the context exits. A write made *before* the fence may have landed
#    before the copy read the memory; the fence sees it as a changed version counter and marks
#    the record, whose unpack then raises autograd's in-place error: never a silently wrong
#    gradient. Fencing by count (never by polling events) keeps that outcome independent of
#    timing: the same program raises or not on every run.
# 3. Prefetch into memory the side stream owns. In backward the unpack of saved tensor number
#    ``i`` (in save order, per thread and device) copies back tensors ``i-1 ... i-prefetch`` on the
#    side stream, allocated while the side stream is current. The consumer waits on the copy's
#    event and calls ``record_stream`` on the tensor, so the allocator hands its memory to the
#    side stream again only after the consumer's kernels are done. Prefetched tensors that
#    backward never asks for (``autograd.grad`` stopping early, a failed backward) are dropped
#    with the graph task's state; their memory returns to the side stream's pool, where the next
#    use is ordered after the pending copy. The prefetch state lives in the graph-task store.
#    Prefetch stops at the first record of another forward pass (``_Timeline.forward_of``), so
#    the backward of one micro-batch does not fetch the tensors of the one saved before it.
# 4. Host buffers are reused only by the stream that used them. Pinned buffers come from a pool
#    per device, keyed by byte size. A buffer returns to the pool when its record dies and is
#    reused by the next device-to-host copy on the same side stream, which stream order puts
#    after any copy still reading it.
#
# A tensor saved by several ops (``x`` feeding the q, k and v projections) is copied once: the
# thread's timeline maps ``id(tensor)`` to the record, and an entry counts only while a weak
# reference to the tensor still returns that very tensor, its version counter is unchanged and
# the record is alive. Keying by storage address is not enough because the caching allocator
# hands a freed address to the next tensor.
#
# What is not copied (CPU tensors, parameters and views of them, tensors under the size
# threshold) is returned by pack as-is (a detached alias when it is an output of the node saving
# it: see `is_output_of_saving_node`), so the save guard of ``saved_tensors_hooks`` checks its
# version at unpack: changing it in place before backward raises autograd's error (torch's
# ``save_on_cpu`` silently uses the changed value for CPU tensors). Under a guard that lets saved
# tensors change (``allow_mutation_on_saved_tensors``), that guard handles what is not copied,
# and every copy is fenced as soon as it is issued, so a change right after the save is ordered
# after the copy and backward sees the save-time value.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from ._errors import InvalidHookArgumentError, InvalidOffloadOptionError, SavedTensorModifiedError
from ._saved import (
    _ALIASED,
    SavedCopy,
    VersionGuard,
    _peek_sequence_nr,
    _pop_hooks,
    _push_hooks,
    current_save_guard,
    is_output_of_saving_node,
    modified_error,
    modified_message,
    saved_tensors_hooks,
)
from ._store import graph_task_store

__all__ = ["save_on_cpu"]

_current_graph_task_id: Callable[[], int] = torch._C._current_graph_task_id
_Parameter = torch.nn.Parameter
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)

# Below this many bytes a copy saves little memory and costs more in launch and bookkeeping
# than it moves.
_DEFAULT_MIN_OFFLOAD_BYTES = 1 << 20


def _kept(tensor: torch.Tensor) -> torch.Tensor:
    """What pack returns for a tensor it does not copy: the tensor, or a detached alias of it.

    The alias is for a tensor saved by the node that produced it (see
    `is_output_of_saving_node`): holding the tensor itself would keep a graph dropped without
    backward alive forever.
    """
    return tensor.detach() if is_output_of_saving_node(tensor) else tensor


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    step = 1
    for n in reversed(size):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _copy_strides(tensor: torch.Tensor) -> tuple[int, ...]:
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


class _HostPool:
    """Host buffers (1-D ``uint8``) reused across steps, keyed by their exact byte size.

    A record's buffer comes back through `release` when the record dies, possibly on
    another thread or inside garbage collection, so releasing only appends to a deque; the next
    `acquire` files the returned buffers under the lock. The pool never holds more bytes
    (in use plus free) than the most it ever had in use at once: when a size has no free buffer
    it evicts free buffers of other sizes first, so shapes that change from step to step do not
    pile up pinned memory.
    """

    def __init__(self, allocate: Callable[[int], torch.Tensor]) -> None:
        self._allocate = allocate
        self._free: dict[int, list[torch.Tensor]] = {}
        self._returned: collections.deque[torch.Tensor] = collections.deque()
        self._lock = threading.Lock()
        self.in_use = 0
        self.free_bytes = 0
        self.peak = 0
        self.allocations = 0
        """How many buffers were allocated rather than reused (for tests and benchmarks)."""

    def acquire(self, nbytes: int) -> torch.Tensor:
        """Return a buffer of exactly ``nbytes`` bytes, reused when one is free."""
        with self._lock:
            self._file_returned()
            bucket = self._free.get(nbytes)
            if bucket:
                buffer = bucket.pop()
                self.free_bytes -= nbytes
            else:
                self._evict_for(nbytes)
                buffer = self._allocate(nbytes)
                self.allocations += 1
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)
            return buffer

    def release(self, buffer: torch.Tensor) -> None:
        """Give ``buffer`` back; safe from any thread and from ``__del__``."""
        self._returned.append(buffer)

    def stats(self) -> dict[str, int]:
        """Return ``in_use``, ``free_bytes``, ``peak`` and ``allocations`` (bytes and counts)."""
        with self._lock:
            self._file_returned()
            return {
                "in_use": self.in_use,
                "free_bytes": self.free_bytes,
                "peak": self.peak,
                "allocations": self.allocations,
            }

    def _file_returned(self) -> None:
        while self._returned:
            buffer = self._returned.popleft()
            nbytes = buffer.numel()
            self.in_use -= nbytes
            self._free.setdefault(nbytes, []).append(buffer)
            self.free_bytes += nbytes

    def _evict_for(self, nbytes: int) -> None:
        for size in list(self._free):
            bucket = self._free[size]
            while bucket and self.in_use + self.free_bytes + nbytes > self.peak:
                bucket.pop()
                self.free_bytes -= size
            if not bucket:
                del self._free[size]
            if self.in_use + self.free_bytes + nbytes <= self.peak:
                return


class _CopyEngine(Protocol):
    """Moves saved tensors between one device and host memory (a real side stream, or a play)."""

    device: torch.device
    pool: _HostPool
    bytes_to_host: int
    bytes_to_device: int

    def current_stream(self) -> Any:
        """The stream the calling thread runs its ops on, for this device."""
        ...

    def to_host(self, source: torch.Tensor, host: torch.Tensor, producer: Any, tag: int) -> Any:
        """Copy ``source`` into ``host`` after ``producer``'s queued work; return the event."""
        ...

    def to_device(
        self,
        host: torch.Tensor,
        size: tuple[int, ...],
        stride: tuple[int, ...],
        dtype: torch.dtype,
        tag: int,
    ) -> tuple[torch.Tensor, Any]:
        """Copy ``host`` into new device memory; return it and the copy's event."""
        ...

    def wait(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait for ``event`` (the host does not block)."""
        ...

    def hand_over(self, tensor: torch.Tensor, stream: Any, event: Any) -> None:
        """Let ``stream`` use ``tensor``, which the side stream is filling."""
        ...


class _StreamEngine:
    """Copies between one accelerator device and pinned host memory on a side stream.

    ``module`` is the device's torch module (``torch.cuda``, ``torch.xpu``, ...), which offers
    ``Stream``, ``current_stream`` and ``stream``. One engine per device is shared by every
    context and thread, so all copies of a device are ordered on one stream (see NOTE
    [Offloading saved tensors without races], rule 4).
    """

    def __init__(self, device: torch.device, module: Any) -> None:
        self.device = device
        self.module = module
        self.stream = module.Stream(device=device)
        self.pool = _HostPool(self._allocate_host)
        self.bytes_to_host = 0
        self.bytes_to_device = 0

    @staticmethod
    def _allocate_host(nbytes: int) -> torch.Tensor:
        # An explicit device: torch.set_default_device("cuda") must not move host buffers.
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)

    def current_stream(self) -> Any:
        """The stream the calling thread runs its ops on, for this device."""
        return self.module.current_stream(self.device)

    def to_host(self, source: torch.Tensor, host: torch.Tensor, producer: Any, tag: int) -> Any:
        """Copy ``source`` into ``host`` after ``producer``'s queued work; return the event."""
        del tag  # only the simulation logs it
        self.stream.wait_stream(producer)
        with self.module.stream(self.stream):
            host.copy_(source, non_blocking=True)
            event = self.stream.record_event()
        self.bytes_to_host += host.nbytes
        return event

    def to_device(
        self,
        host: torch.Tensor,
        size: tuple[int, ...],
        stride: tuple[int, ...],
        dtype: torch.dtype,
        tag: int,
    ) -> tuple[torch.Tensor, Any]:
        """Copy ``host`` into new memory of the side stream; return it and the copy's event."""
        del tag
        with self.module.stream(self.stream):
            out = torch.empty_strided(size, stride, dtype=dtype, device=self.device)
            out.copy_(host, non_blocking=True)
            event = self.stream.record_event()
        self.bytes_to_device += host.nbytes
        return out, event

    @staticmethod
    def wait(stream: Any, event: Any) -> None:
        """Make ``stream`` wait for ``event`` (the host does not block)."""
        stream.wait_event(event)

    @staticmethod
    def hand_over(tensor: torch.Tensor, stream: Any, event: Any) -> None:
        """Let ``stream`` use ``tensor``, which the side stream is filling."""
        stream.wait_event(event)
        tensor.record_stream(stream)


_engines: dict[torch.device, _StreamEngine | None] = {}
_engines_lock = threading.Lock()


def _stream_engine(device: torch.device) -> _StreamEngine | None:
    """The side-stream engine of ``device``, or None when its backend has no usable streams."""
    try:
        return _engines[device]
    except KeyError:
        pass
    with _engines_lock:
        if device not in _engines:
            module = getattr(torch, device.type, None)
            usable = (
                module is not None
                and all(hasattr(module, name) for name in ("Stream", "current_stream", "stream"))
                and bool(module.is_available())
            )
            _engines[device] = _StreamEngine(device, module) if usable else None
        return _engines[device]


class _Timeline:
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
        self.records: weakref.WeakValueDictionary[int, _Offloaded] = weakref.WeakValueDictionary()
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
        node = _peek_sequence_nr() - 1  # the saving node (see is_output_of_saving_node)
        if entry != self.entry:
            self.entry = entry
            latest = self.records.get(self.next_seq - 1)
            if latest is None or not _computed_from(tensor.grad_fn, self.node):
                self.forward += 1
        self.node = node
        return self.forward

    def find(self, tensor: torch.Tensor) -> _Offloaded | _HostCopy | None:
        """The live record of an earlier save of ``tensor`` at its current version, if any."""
        entry = self.saved.get(id(tensor))
        if entry is None:
            return None
        tensor_ref, version, record_ref = entry
        if tensor_ref() is not tensor or tensor._version != version:
            return None
        record: _Offloaded | _HostCopy | None = record_ref()
        if type(record) is _Offloaded:
            record.uses += 1  # how many unpacks backward will make of a prefetched copy
        return record

    def remember(self, tensor: torch.Tensor, record: _Offloaded | _HostCopy) -> None:
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
        number = current._sequence_nr()
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


class _HostCopy(SavedCopy):
    """A saved tensor copied to host memory on the current stream, the way torch does it."""

    __slots__ = ("__weakref__", "device", "host", "non_blocking")

    def __init__(self, device: torch.device, host: torch.Tensor, non_blocking: bool) -> None:
        self.device = device
        self.host = host
        self.non_blocking = non_blocking

    def restore(self) -> torch.Tensor:
        """A new tensor on the original device with the saved value."""
        return self.host.to(self.device, non_blocking=self.non_blocking, copy=True)


class _Prefetch:
    """What one graph task has copied back ahead of use, for one timeline.

    ``ready`` maps a sequence number to ``[device tensor, event, unpacks left]``; ``done`` holds
    the numbers whose every unpack happened, so they are not fetched again.
    """

    __slots__ = ("done", "lock", "ready")

    def __init__(self) -> None:
        self.ready: dict[int, list[Any]] = {}
        self.done: set[int] = set()
        self.lock = threading.Lock()


class _Offloaded(SavedCopy):
    """A saved tensor copied to a pooled host buffer on a side stream."""

    __slots__ = (
        "__weakref__",
        "buffer",
        "device",
        "dtype",
        "engine",
        "event",
        "forward",
        "host",
        "prefetch",
        "raced",
        "seq",
        "session",
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
        engine: _CopyEngine,
        timeline: _Timeline,
        session: _Session,
    ) -> None:
        self.forward = timeline.forward_of(tensor, session.entry)
        size = tuple(tensor.shape)
        stride = _copy_strides(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        self.engine = engine
        self.buffer = engine.pool.acquire(nbytes)
        self.host = self.buffer.view(tensor.dtype).as_strided(size, stride)
        self.device = tensor.device
        self.dtype = tensor.dtype
        self.size = size
        self.stride = stride
        self.uses = 1
        self.prefetch = session.prefetch
        self.seq = timeline.next_seq
        timeline.next_seq += 1
        self.timeline = timeline
        self.session: _Session | None = session
        self.raced: tuple[str, list[int], int] | None = None
        self.version = tensor._version
        # Detached: the alias shares storage and version counter without holding the graph.
        self.source: torch.Tensor | None = tensor.detach()
        self.stream = engine.current_stream()
        self.event = engine.to_host(self.source, self.host, self.stream, self.seq)

    def __del__(self) -> None:
        buffer = getattr(self, "buffer", None)
        if buffer is not None:
            self.engine.pool.release(buffer)

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
        self.session = None

    def _fetch(self) -> tuple[torch.Tensor, Any]:
        return self.engine.to_device(self.host, self.size, self.stride, self.dtype, self.seq)

    def restore(self) -> torch.Tensor:
        """A device tensor with the saved value, fetched ahead of use when possible."""
        session = self.session
        if session is not None:
            session.fence_through(self)
        if self.raced is not None:
            raise _raced_error(*self.raced, self.version)
        engine = self.engine
        consumer = engine.current_stream()
        if _current_graph_task_id() == -1:
            # Unpacked outside backward (``grad_fn._saved_self``): nothing to prefetch for.
            tensor, event = self._fetch()
        else:
            state = graph_task_store.current().get(self.timeline, _Prefetch)
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
        return tensor

    def _fetch_ahead(self, state: _Prefetch) -> None:
        records = self.timeline.records
        for seq in range(self.seq - 1, max(self.seq - 1 - self.prefetch, -1), -1):
            if seq in state.ready or seq in state.done:
                continue
            record = records.get(seq)
            if record is None or record.engine is not self.engine:
                continue
            if record.forward != self.forward:
                break  # saved by another forward pass: not this graph task's, most likely
            session = record.session
            if session is not None:
                session.fence_through(record)
            if record.raced is None:
                state.ready[seq] = [*record._fetch(), record.uses]


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


_entry_numbers = itertools.count()


class _Session:
    """One entry into a ``save_on_cpu`` context: its options and its copies still in flight."""

    def __init__(self, owner: save_on_cpu, simulation: _Simulation | None) -> None:
        self.pin_memory = owner.pin_memory
        self.device_type = owner.device_type
        self.min_offload_bytes = owner.min_offload_bytes
        self.offload_parameters = owner.offload_parameters
        self.prefetch = owner.prefetch
        self.max_in_flight = owner.max_in_flight
        self.simulation = simulation
        self.timelines = _thread_timelines if simulation is None else simulation.timelines
        self.pending: collections.deque[_Offloaded] = collections.deque()
        self.lock = threading.Lock()
        self.entry = next(_entry_numbers)

    def pack(self, tensor: torch.Tensor) -> _Offloaded | _HostCopy | torch.Tensor:
        """Copy ``tensor`` (a record), or return it (or a detached alias) when it stays."""
        if tensor.is_cpu and self.simulation is None:
            return _kept(tensor)
        if not self.offload_parameters and (
            isinstance(tensor, _Parameter) or isinstance(tensor._base, _Parameter)
        ):
            return _kept(tensor)
        dense = type(tensor) in _PLAIN_TYPES and tensor.layout == torch.strided
        dense = dense and not tensor.is_nested and not tensor.is_quantized
        if dense and tensor.numel() * tensor.element_size() < self.min_offload_bytes:
            return _kept(tensor)
        device = tensor.device
        timeline = self._timeline(device)
        record = timeline.find(tensor)
        if record is not None:
            return record
        engine = self._engine(device) if dense else None
        if engine is None:
            record = self._copy(tensor, device, dense)
        else:
            record = _Offloaded(tensor, engine, timeline, self)
            timeline.records[record.seq] = record
            with self.lock:
                self.pending.append(record)
                while len(self.pending) > self.max_in_flight:
                    self.pending.popleft().fence()
        timeline.remember(tensor, record)
        return record

    def _timeline(self, device: torch.device) -> _Timeline:
        by_device: dict[torch.device, _Timeline] | None = getattr(self.timelines, "by_device", None)
        if by_device is None:
            by_device = self.timelines.by_device = {}
        timeline = by_device.get(device)
        if timeline is None:
            timeline = by_device[device] = _Timeline()
        return timeline

    def _engine(self, device: torch.device) -> _CopyEngine | None:
        if not self.pin_memory:
            return None
        if self.simulation is not None:
            return self.simulation.engine
        if device.type != self.device_type:
            return None
        return _stream_engine(device)

    def _copy(self, tensor: torch.Tensor, device: torch.device, dense: bool) -> _HostCopy:
        source = tensor.detach()
        if self.pin_memory and dense and self.simulation is None:
            module = getattr(torch, self.device_type, torch.cuda)
            if module.is_available():
                host = torch.empty_strided(
                    tuple(source.shape),
                    _copy_strides(source),
                    dtype=source.dtype,
                    device="cpu",
                    pin_memory=True,
                )
                host.copy_(source, non_blocking=True)
                return _HostCopy(device, host, non_blocking=True)
        return _HostCopy(device, source.to("cpu", copy=True), non_blocking=self.pin_memory)

    def fence_through(self, record: _Offloaded) -> None:
        """Fence the pending copies up to and including ``record``'s (they are in save order)."""
        with self.lock:
            while record.source is not None and self.pending:
                self.pending.popleft().fence()

    def close(self) -> None:
        """Fence every pending copy: after the context, writes and reuse are ordered after them."""
        with self.lock:
            while self.pending:
                self.pending.popleft().fence()


def _unpack(packed: _Offloaded | _HostCopy | torch.Tensor) -> torch.Tensor:
    if isinstance(packed, torch.Tensor):
        return packed  # pack kept the tensor (or an alias): the save guard checked its version
    return packed.restore()


def _guarded_pair(
    session: _Session,
) -> tuple[Callable[[torch.Tensor], object], Callable[[Any], torch.Tensor]]:
    """``VersionGuard().wrap(session.pack, _unpack)`` with the guard's work done inline.

    Same behaviour as the wrapped pair (the tests run both); one Python call fewer per pack and
    per unpack keeps the CPU path near the cost of identity hooks (see docs/performance.md).
    """
    slow = session.pack
    peek = _peek_sequence_nr

    def pack(tensor: torch.Tensor) -> object:
        if tensor.is_cpu:
            # `_kept`, inlined.
            grad_fn = tensor.grad_fn
            if grad_fn is not None and grad_fn._sequence_nr() == peek() - 1:
                tensor = tensor.detach()
            return (_ALIASED, tensor, tensor, tensor._version)
        return pack_any(tensor)

    def pack_any(tensor: torch.Tensor) -> object:
        packed = slow(tensor)
        if isinstance(packed, torch.Tensor):
            return (_ALIASED, packed, packed, packed._version)
        return packed

    def unpack(
        stored: tuple[object, torch.Tensor, torch.Tensor, int] | _Offloaded | _HostCopy,
    ) -> torch.Tensor:
        if type(stored) is tuple:
            # The version guard's record (see _saved.VersionGuard): pack kept the tensor itself.
            _, _, source, version = stored
            if source._version != version:
                raise modified_error(source, version)
            return source
        return stored.restore()  # type: ignore[union-attr]  # not a guard record: an offload record

    return (pack if session.simulation is None else pack_any), unpack


_thread_timelines = threading.local()


class save_on_cpu(saved_tensors_hooks):
    """Context manager under which tensors saved for backward wait in host memory.

    Tensors that ops save for backward inside the context are copied to host memory and copied
    back to their device (same dtype, layout, shape and, when dense, strides) when backward needs
    them, so that device memory holds fewer activations between forward and backward. Same
    positional signature, defaults and semantics as
    `torch.autograd.graph.save_on_cpu`, plus:

    - with ``pin_memory=True`` on a device with streams (CUDA, XPU, ...), copies run on a side
      stream and overlap compute; backward copies the next saved tensors back ahead of use
      (``prefetch``); pinned host buffers are reused across steps;
    - a tensor saved by several ops is copied once;
    - CPU tensors, parameters (and views of them) and tensors smaller than
      ``min_offload_bytes`` stay where they are, at no more cost than identity hooks; changing
      one of them in place before backward raises autograd's in-place error, as plain autograd
      does (torch's ``save_on_cpu`` silently uses the changed CPU tensor).

    Example:
        >>> import torch, tensorhooks
        >>> w = torch.nn.Parameter(torch.ones(4, 4))
        >>> x = torch.ones(2, 4)
        >>> with tensorhooks.save_on_cpu(pin_memory=torch.cuda.is_available()):
        ...     loss = (x @ w).relu().sum()    # on a GPU, the relu output waits on the host
        >>> loss.backward()
        >>> w.grad
        tensor([[2., 2., 2., 2.],
                [2., 2., 2., 2.],
                [2., 2., 2., 2.],
                [2., 2., 2., 2.]])

    Args:
        pin_memory: copy into pinned host memory, asynchronously (on a side stream when the
            device has streams); otherwise copy synchronously into pageable memory, as torch does.
        device_type: the device type whose tensors get the side-stream path, and whose backend
            decides whether memory can be pinned (torch's meaning). Tensors on other devices are
            copied the way torch's ``save_on_cpu`` copies them.
        min_offload_bytes: dense tensors smaller than this many bytes stay on their device
            (default 1 MiB). Tensors of other layouts (sparse, nested) are always copied.
        offload_parameters: also copy ``nn.Parameter`` tensors and views of them (default: they
            stay, since the module keeps them alive anyway). Buffers registered on a module are
            plain tensors that cannot be told apart from activations: the size threshold is what
            keeps small ones in place.
        prefetch: how many saved tensors backward copies back ahead of the one it is unpacking.
        max_in_flight: how many device-to-host copies a context lets run before the compute
            stream waits for the oldest one. Each in-flight copy keeps its device memory.

    Raises:
        TypeError: (``InvalidHookArgumentError``) if an argument has the wrong type.
        ValueError: (``InvalidOffloadOptionError``) if a number is negative.
        RuntimeError: on entry, if hooks are disabled by ``disable_saved_tensors_hooks``.
        SavedTensorModifiedError: in backward, if a tensor that was not copied was changed in
            place after it was saved, or a tensor was changed in place while its asynchronous
            copy was still in flight (a ``RuntimeError``).

    Nesting and threads: the innermost saved-tensor hooks apply, as in torch. The context is per
    thread and the same instance may be entered on several threads at once, or nested; each
    entry fences its own copies when it exits. Backward may run on any thread. Saved tensors are
    numbered per thread and device in save order, and prefetching follows that order backwards,
    across consecutive contexts (one per layer works) and within one backward call.
    """

    def __init__(
        self,
        pin_memory: bool = False,
        device_type: str = "cuda",
        *,
        min_offload_bytes: int = _DEFAULT_MIN_OFFLOAD_BYTES,
        offload_parameters: bool = False,
        prefetch: int = 2,
        max_in_flight: int = 4,
    ) -> None:
        for name, value, kind in (
            ("device_type", device_type, str),
            ("offload_parameters", offload_parameters, bool),
        ):
            if not isinstance(value, kind):
                raise InvalidHookArgumentError(
                    f"save_on_cpu: {name} must be a {kind.__name__}, got {value!r} of type "
                    f"{type(value).__name__}"
                )
        for name, number in (
            ("min_offload_bytes", min_offload_bytes),
            ("prefetch", prefetch),
            ("max_in_flight", max_in_flight),
        ):
            if not isinstance(number, int) or isinstance(number, bool):
                raise InvalidHookArgumentError(
                    f"save_on_cpu: {name} must be an int, got {number!r} of type "
                    f"{type(number).__name__}"
                )
            if number < 0:
                raise InvalidOffloadOptionError(
                    f"save_on_cpu: {name} must be >= 0, got {number}; pass 0 to "
                    + {
                        "min_offload_bytes": "copy tensors of every size",
                        "prefetch": "fetch each tensor only when backward unpacks it",
                        "max_in_flight": "order every copy before the ops that follow it",
                    }[name]
                )
        self.pin_memory = bool(pin_memory)  # torch takes any truthy value
        self.device_type = device_type
        self.min_offload_bytes = min_offload_bytes
        self.offload_parameters = offload_parameters
        self.prefetch = prefetch
        self.max_in_flight = max_in_flight
        self._entries = threading.local()
        super().__init__(self._pack, _unpack)

    def _session(self) -> _Session:
        return _Session(self, _simulation)

    def _pack(self, tensor: torch.Tensor) -> object:
        """Pack outside any entry (a direct call of ``pack_hook``): fence the copy at once."""
        stack: list[_Session] | None = getattr(self._entries, "stack", None)
        if stack:
            return stack[-1].pack(tensor)
        session = self._session()
        packed = session.pack(tensor)
        session.close()
        return packed

    def __enter__(self) -> None:
        session = self._session()
        guard = current_save_guard()
        if type(guard) is VersionGuard:
            pack, unpack = _guarded_pair(session)
        else:
            if not isinstance(guard, VersionGuard):
                # A guard that lets saved tensors change (allow_mutation_on_saved_tensors):
                # changes are expected, so each copy is ordered before the ops that follow it.
                session.max_in_flight = 0
            pack, unpack = guard.wrap(session.pack, _unpack)
        _push_hooks(pack, unpack)
        stack: list[_Session] | None = getattr(self._entries, "stack", None)
        if stack is None:
            stack = self._entries.stack = []
        stack.append(session)

    def __exit__(self, *args: object) -> None:
        _pop_hooks()
        self._entries.stack.pop().close()


# --- Testing: CPU tensors played as device tensors --------------------------------------------


class _SimStream:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class _SimEvent:
    __slots__ = ("done", "tag")

    def __init__(self, tag: int) -> None:
        self.tag = tag
        self.done = False


class _SimulatedEngine:
    """Plays a device with a side stream, using CPU tensors, for tests on machines without one.

    Copies are queued and run as late as a real side stream may run them: when some stream
    waits on their event (or at `synchronize`). So a write that the fencing rules fail to
    order after a copy changes the copied value, and a source released before its copy ran is
    reported as a use after free (``AssertionError``) instead of reading recycled memory.
    ``log`` lists ``(operation, sequence number)`` pairs: ``to_host``, ``to_device``, ``wait``
    (a stream waits on a copy) and ``hand_over`` (backward receives a fetched tensor).
    """

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.stream = _SimStream("side")
        self.compute = _SimStream("compute")
        self.pool = _HostPool(self._allocate_host)
        self.log: list[tuple[str, int]] = []
        self.sources: list[weakref.ref[torch.Tensor]] = []
        self.bytes_to_host = 0
        self.bytes_to_device = 0
        self._queue: collections.deque[tuple[_SimEvent, Callable[[], None]]] = collections.deque()
        self._lock = threading.RLock()

    @staticmethod
    def _allocate_host(nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu")

    def current_stream(self) -> _SimStream:
        """The one compute stream."""
        return self.compute

    def _enqueue(self, tag: int, work: Callable[[], None]) -> _SimEvent:
        event = _SimEvent(tag)
        with self._lock:
            self._queue.append((event, work))
        return event

    def to_host(
        self, source: torch.Tensor, host: torch.Tensor, producer: _SimStream, tag: int
    ) -> _SimEvent:
        """Queue the copy of ``source`` into ``host``; it runs when something waits on it."""
        del producer
        source_ref = weakref.ref(source)
        self.sources.append(source_ref)
        self.log.append(("to_host", tag))
        self.bytes_to_host += host.nbytes

        def copy() -> None:
            alive = source_ref()
            if alive is None:
                raise AssertionError(
                    f"save_on_cpu released the source of copy {tag} before the copy ran"
                )
            host.copy_(alive)

        return self._enqueue(tag, copy)

    def to_device(
        self,
        host: torch.Tensor,
        size: tuple[int, ...],
        stride: tuple[int, ...],
        dtype: torch.dtype,
        tag: int,
    ) -> tuple[torch.Tensor, _SimEvent]:
        """Queue a copy of ``host`` into a new tensor; return the tensor and the event."""
        out = torch.empty_strided(size, stride, dtype=dtype, device="cpu")
        self.log.append(("to_device", tag))
        self.bytes_to_device += host.nbytes

        def copy() -> None:
            out.copy_(host)

        return out, self._enqueue(tag, copy)

    def wait(self, stream: _SimStream, event: _SimEvent) -> None:
        """Run every queued copy up to ``event``: the stream's later work comes after them."""
        del stream
        self.log.append(("wait", event.tag))
        self._run_through(event)

    def hand_over(self, tensor: torch.Tensor, stream: _SimStream, event: _SimEvent) -> None:
        """Like `wait`, logged as the hand-over of a fetched tensor."""
        del tensor, stream
        self.log.append(("hand_over", event.tag))
        self._run_through(event)

    def synchronize(self) -> None:
        """Run every queued copy."""
        with self._lock:
            while self._queue:
                event, work = self._queue.popleft()
                work()
                event.done = True

    def _run_through(self, event: _SimEvent) -> None:
        with self._lock:
            while not event.done and self._queue:
                queued, work = self._queue.popleft()
                work()
                queued.done = True

    def live_sources(self) -> int:
        """How many sources of device-to-host copies are still referenced."""
        return sum(ref() is not None for ref in self.sources)


class _Simulation:
    def __init__(self) -> None:
        self.engine = _SimulatedEngine()
        self.timelines = threading.local()


_simulation: _Simulation | None = None


@contextlib.contextmanager
def _offload_cpu_tensors_for_testing() -> Iterator[_SimulatedEngine]:
    """For tests only: contexts entered inside treat CPU tensors as device tensors.

    With ``pin_memory=True`` they go through a `_SimulatedEngine` (yielded, with its log
    and pool); with ``pin_memory=False`` they take the synchronous copy path. Not thread-local:
    every thread's contexts entered meanwhile are affected.
    """
    global _simulation  # noqa: PLW0603  # a process-wide switch is what tests need
    previous = _simulation
    _simulation = _Simulation()
    try:
        yield _simulation.engine
    finally:
        _simulation = previous
