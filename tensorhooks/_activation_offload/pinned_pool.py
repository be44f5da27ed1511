"""Pooled host buffers of a copy engine, and the bytes save_on_cpu moved through them.

Host buffers are reused only by copies issued through the engine that used them: see NOTE
[Offloading saved tensors without races] in `context.py`, rule 4.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import weakref
from collections.abc import Callable

import torch

from .copy_engines import CopyEngine

__all__ = ["HostPool", "OffloadStats", "pool_of"]


@dataclasses.dataclass(frozen=True, slots=True)
class OffloadStats:
    """What ``save_on_cpu``'s side-stream path has done on one device, since the process began.

    Returned by `save_on_cpu.stats`. Counts cover the asynchronous path (``pin_memory=True`` on
    a device with streams); synchronous copies are not counted.

    Attributes:
        bytes_to_host: bytes copied from the device to host memory.
        bytes_to_device: bytes copied back to the device (prefetched or not).
        host_bytes_in_use: bytes of host buffers held by saved tensors now.
        host_bytes_free: bytes of host buffers in the pool, ready for reuse.
        host_bytes_peak: the most bytes of host buffers in use at once.
        host_allocations: how many host buffers were allocated rather than reused.
    """

    bytes_to_host: int
    bytes_to_device: int
    host_bytes_in_use: int
    host_bytes_free: int
    host_bytes_peak: int
    host_allocations: int


class HostPool:
    """Host buffers (1-D ``uint8``) reused across steps, keyed by their exact byte size.

    A record's buffer comes back through `release` when the record dies, possibly on another
    thread or inside garbage collection, so releasing only appends to a deque; the next
    `acquire` files the returned buffers under the lock. The pool never holds more bytes (in use
    plus free) than the most it ever had in use at once: when a size has no free buffer it
    evicts free buffers of other sizes first, so shapes that change from step to step do not
    pile up pinned memory.
    """

    def __init__(self, allocate: Callable[[int], torch.Tensor]) -> None:
        self._allocate = allocate
        self._free: dict[int, list[torch.Tensor]] = {}
        self._returned: collections.deque[torch.Tensor] = collections.deque()
        self.lock = threading.Lock()
        self.in_use = 0
        self.free_bytes = 0
        self.peak = 0
        self.allocations = 0
        self.bytes_to_host = 0
        self.bytes_to_device = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        """Return a buffer of exactly ``nbytes`` bytes, reused when one is free."""
        with self.lock:
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
            self.bytes_to_host += nbytes
            return buffer

    def release(self, buffer: torch.Tensor) -> None:
        """Give ``buffer`` back; safe from any thread and from ``__del__``."""
        self._returned.append(buffer)

    def count_to_device(self, nbytes: int) -> None:
        """Count a copy of ``nbytes`` bytes from a buffer of this pool back to the device."""
        with self.lock:
            self.bytes_to_device += nbytes

    def stats(self) -> OffloadStats:
        """The pool's counts, returned buffers filed first."""
        with self.lock:
            self._file_returned()
            return OffloadStats(
                bytes_to_host=self.bytes_to_host,
                bytes_to_device=self.bytes_to_device,
                host_bytes_in_use=self.in_use,
                host_bytes_free=self.free_bytes,
                host_bytes_peak=self.peak,
                host_allocations=self.allocations,
            )

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


# One pool per engine, for as long as the engine lives: every copy of an engine is ordered on
# its one side stream, which is what makes reusing its buffers safe.
_pools: weakref.WeakKeyDictionary[CopyEngine, HostPool] = weakref.WeakKeyDictionary()
_pools_lock = threading.Lock()


def pool_of(engine: CopyEngine) -> HostPool:
    """The host-buffer pool (and byte counts) of ``engine``, made on first use."""
    pool = _pools.get(engine)
    if pool is None:
        with _pools_lock:
            pool = _pools.get(engine)
            if pool is None:
                pool = _pools[engine] = HostPool(engine.allocate_host)
    return pool
