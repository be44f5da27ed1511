"""A simulated device with a side stream, played by CPU tensors, for tests of copy engines.

`simulated_device` installs a `SimulatedDevice` as the copy-engine provider: contexts entered
meanwhile (on every thread) treat CPU tensors as tensors of a device with streams and copy them
through one `SimulatedEngine`. The engine runs each copy as late as a real side stream may run
it, so code that forgets to order work after a copy reads or writes the wrong values here too.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator

import torch

from tensorhooks._activation_offload.copy_engines import use_copy_engine_provider


class SimStream:
    """A stream of the simulated device: only a name."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class SimEvent:
    """The event of one queued copy, done once the copy ran."""

    __slots__ = ("done", "tag")

    def __init__(self, tag: int) -> None:
        self.tag = tag
        self.done = False


class SimulatedEngine:
    """A `CopyEngine` (tensorhooks._activation_offload.copy_engines) over CPU tensors, lazily.

    Copies are queued and run when some stream waits on their event, the latest a real side
    stream may run them. So a write that the caller fails to order after a copy changes the
    copied value, and a source released before its copy ran is reported as a use after free
    (``AssertionError``) instead of reading recycled memory.

    ``log`` lists ``(operation, tag)`` pairs: ``to_host``, ``to_device``, ``wait`` (a stream
    waits on a copy) and ``hand_over`` (a consumer receives a copied-back tensor). Tags number
    the device-to-host copies in issue order from 0; a copy back from a host buffer carries the
    tag of the copy that filled it. ``host_buffers`` lists the buffers `allocate_host` made.

    Copies move bytes as a DMA does: a source with the conjugate or negative bit set lands as
    its raw data, bits ignored. ``capture`` plays a stream being captured into a graph;
    ``out_of_memory_after = n`` lets ``n`` more copies back to the device through, then makes
    the next one raise ``torch.OutOfMemoryError`` (once), as an allocation on a full device does.
    """

    def __init__(self) -> None:
        self.stream = SimStream("side")
        self.compute = SimStream("compute")
        self.log: list[tuple[str, int]] = []
        self.sources: list[weakref.ref[torch.Tensor]] = []
        self.host_buffers: list[torch.Tensor] = []
        self._tags = itertools.count()
        self._host_tags: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self._queue: collections.deque[tuple[SimEvent, Callable[[], None]]] = collections.deque()
        self._lock = threading.RLock()
        self.capture = False
        self.out_of_memory_after: int | None = None

    def capturing(self) -> bool:
        """Whether the compute stream plays one being captured (``capture``)."""
        return self.capture

    def current_stream(self) -> SimStream:
        """The one compute stream."""
        return self.compute

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        """A pageable host buffer (pinning needs a real device)."""
        buffer = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
        self.host_buffers.append(buffer)
        return buffer

    def to_host(self, source: torch.Tensor, host: torch.Tensor, producer: SimStream) -> SimEvent:
        """Queue the copy of ``source`` into ``host``; it runs when something waits on it."""
        del producer
        with self._lock:
            tag = next(self._tags)
            self._host_tags[id(host)] = (weakref.ref(host), tag)
        source_ref = weakref.ref(source)
        self.sources.append(source_ref)
        self.log.append(("to_host", tag))

        def copy() -> None:
            alive = source_ref()
            if alive is None:
                raise AssertionError(f"the source of copy {tag} was released before the copy ran")
            raw = alive.conj() if alive.is_conj() else alive  # what a DMA reads: the bytes
            host.copy_(torch._neg_view(raw) if raw.is_neg() else raw)

        return self._enqueue(tag, copy)

    def to_device(
        self, host: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[torch.Tensor, SimEvent]:
        """Queue a copy of ``host`` into a new tensor; return the tensor and the event."""
        tag = self._tag_of(host)
        if self.out_of_memory_after is not None:
            if self.out_of_memory_after <= 0:
                self.out_of_memory_after = None
                raise torch.OutOfMemoryError(f"simulated: no device memory for copy {tag}")
            self.out_of_memory_after -= 1
        out = torch.empty_strided(size, stride, dtype=dtype, device="cpu")
        self.log.append(("to_device", tag))

        def copy() -> None:
            out.copy_(host)

        return out, self._enqueue(tag, copy)

    def wait(self, stream: SimStream, event: SimEvent) -> None:
        """Run every queued copy up to ``event``: the stream's later work comes after them."""
        del stream
        self.log.append(("wait", event.tag))
        self._run_through(event)

    def hand_over(self, tensor: torch.Tensor, stream: SimStream, event: SimEvent) -> None:
        """Like `wait`, logged as the hand-over of a copied-back tensor."""
        del tensor, stream
        self.log.append(("hand_over", event.tag))
        self._run_through(event)

    def live_sources(self) -> int:
        """How many sources of device-to-host copies are still referenced."""
        return sum(ref() is not None for ref in self.sources)

    def _tag_of(self, host: torch.Tensor) -> int:
        with self._lock:
            entry = self._host_tags.get(id(host))
        if entry is None or entry[0]() is not host:
            raise AssertionError("copy back from a host tensor that no copy to the host filled")
        return entry[1]

    def _enqueue(self, tag: int, work: Callable[[], None]) -> SimEvent:
        event = SimEvent(tag)
        with self._lock:
            self._queue.append((event, work))
        return event

    def _run_through(self, event: SimEvent) -> None:
        with self._lock:
            while not event.done and self._queue:
                queued, work = self._queue.popleft()
                work()
                queued.done = True


class SimulatedDevice:
    """A copy-engine provider under which CPU tensors play device tensors, all on one engine."""

    treats_cpu_as_device = True

    def __init__(self, engine: SimulatedEngine | None = None) -> None:
        self.engine = engine if engine is not None else SimulatedEngine()

    def engine_for(self, device: torch.device) -> SimulatedEngine:
        """The one simulated engine, whatever the device."""
        del device
        return self.engine


@contextlib.contextmanager
def simulated_device() -> Iterator[SimulatedEngine]:
    """Offload CPU tensors through a new `SimulatedEngine` (yielded) until exit, on every thread.

    With ``pin_memory=True`` save_on_cpu's copies go through the engine; with
    ``pin_memory=False`` they take the synchronous path.
    """
    device = SimulatedDevice()
    with use_copy_engine_provider(device):
        yield device.engine
