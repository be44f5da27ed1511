"""Copy engines: what moves tensors between a device and host memory, and where to get them.

A `CopyEngine` copies asynchronously and orders work through streams and events; a
`CopyEngineProvider` says which engine serves a device. ``save_on_cpu`` asks the provider in
force (`copy_engine_provider`) when a context is entered. The default provider hands out one
`StreamEngine` per device whose torch backend has streams; tests install a provider that plays
a device with CPU tensors (`use_copy_engine_provider`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import torch

__all__ = [
    "CopyEngine",
    "CopyEngineProvider",
    "StreamEngine",
    "StreamEngines",
    "copy_engine_provider",
    "use_copy_engine_provider",
]


class CopyEngine(Protocol):
    """Moves tensors between one device and host memory without blocking the host.

    Streams and events are the engine's own objects (``torch.cuda.Stream`` and
    ``torch.cuda.Event`` for CUDA); callers only pass them back to it. Every copy of an engine
    runs on one side stream, in the order the copies were issued.
    """

    def current_stream(self) -> Any:
        """The stream the calling thread runs its ops on, for this engine's device."""
        ...

    def capturing(self) -> bool:
        """Whether the calling thread's stream is being captured into a graph (CUDA graphs)."""
        ...

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        """A new 1-D ``uint8`` host buffer of ``nbytes`` bytes that copies can use (pinned)."""
        ...

    def to_host(self, source: torch.Tensor, host: torch.Tensor, producer: Any) -> Any:
        """Copy ``source`` into ``host`` after ``producer``'s queued work; return the event."""
        ...

    def to_device(
        self, host: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[torch.Tensor, Any]:
        """Copy ``host`` into new device memory of that layout; return it and the copy's event."""
        ...

    def wait(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait for ``event`` (the host does not block)."""
        ...

    def hand_over(self, tensor: torch.Tensor, stream: Any, event: Any) -> None:
        """Let ``stream`` use ``tensor``, which the side stream is filling."""
        ...


class CopyEngineProvider(Protocol):
    """Says which `CopyEngine` serves a device."""

    @property
    def treats_cpu_as_device(self) -> bool:
        """Whether CPU tensors are offloaded as if they lived on a device (a simulated one).

        False for real providers: CPU tensors stay where they are.
        """
        ...

    def engine_for(self, device: torch.device) -> CopyEngine | None:
        """The engine of ``device``, or None when it has none (copies are then synchronous)."""
        ...


class StreamEngine:
    """Copies between one accelerator device and pinned host memory on a side stream.

    ``module`` is the device's torch module (``torch.cuda``, ``torch.xpu``, ...), which offers
    ``Stream``, ``current_stream`` and ``stream``. One engine per device is shared by every
    context and thread, so all copies of a device are ordered on one stream (see NOTE
    [Offloading saved tensors without races] in `context.py`, rule 4).
    """

    def __init__(self, device: torch.device, module: Any) -> None:
        self.device = device
        self.module = module
        self.stream = module.Stream(device=device)

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        """A pinned host buffer."""
        # An explicit device: torch.set_default_device("cuda") must not move host buffers.
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)

    def current_stream(self) -> Any:
        """The stream the calling thread runs its ops on, for this device."""
        return self.module.current_stream(self.device)

    def capturing(self) -> bool:
        """Whether the current stream is being captured (False where the backend cannot)."""
        is_capturing = getattr(self.module, "is_current_stream_capturing", None)
        return is_capturing is not None and bool(is_capturing())

    def to_host(self, source: torch.Tensor, host: torch.Tensor, producer: Any) -> Any:
        """Copy ``source`` into ``host`` after ``producer``'s queued work; return the event."""
        stream = self.stream
        stream.wait_stream(producer)
        with self.module.stream(stream):
            host.copy_(source, non_blocking=True)
            return stream.record_event()

    def to_device(
        self, host: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[torch.Tensor, Any]:
        """Copy ``host`` into memory allocated on the side stream; return it and the event."""
        stream = self.stream
        with self.module.stream(stream):
            out = torch.empty_strided(size, stride, dtype=dtype, device=self.device)
            out.copy_(host, non_blocking=True)
            return out, stream.record_event()

    def wait(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait for ``event`` (the host does not block)."""
        stream.wait_event(event)

    def hand_over(self, tensor: torch.Tensor, stream: Any, event: Any) -> None:
        """Order ``stream`` after the copy and keep the memory from the side stream until done."""
        stream.wait_event(event)
        tensor.record_stream(stream)


class StreamEngines:
    """The default provider: one `StreamEngine` per device whose backend has usable streams."""

    treats_cpu_as_device = False

    def __init__(self) -> None:
        self._engines: dict[torch.device, StreamEngine | None] = {}
        self._lock = threading.Lock()

    def engine_for(self, device: torch.device) -> StreamEngine | None:
        """The side-stream engine of ``device``, or None when its backend has no usable streams."""
        try:
            return self._engines[device]
        except KeyError:
            pass
        with self._lock:
            if device not in self._engines:
                module = getattr(torch, device.type, None)
                needed = ("Stream", "current_stream", "stream")
                usable = (
                    device.type != "cpu"  # torch.cpu has stream stand-ins; the host needs none
                    and module is not None
                    and all(hasattr(module, name) for name in needed)
                    and bool(module.is_available())
                )
                self._engines[device] = StreamEngine(device, module) if usable else None
            return self._engines[device]


_provider: CopyEngineProvider = StreamEngines()


def copy_engine_provider() -> CopyEngineProvider:
    """The provider in force (process-wide)."""
    return _provider


@contextlib.contextmanager
def use_copy_engine_provider(provider: CopyEngineProvider) -> Iterator[None]:
    """Make ``provider`` serve the contexts entered meanwhile, on every thread; then restore.

    Contexts entered before keep the engines they got.
    """
    global _provider  # noqa: PLW0603  # one provider per process: engines are per device
    previous = _provider
    _provider = provider
    try:
        yield
    finally:
        _provider = previous
