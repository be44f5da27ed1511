"""How `offload_parameters` moves tensors between host and device: a protocol, and CUDA's answer.

`ParameterTransfer` is the one seam between the streaming logic of `streaming` and a device: the
logic never touches streams or events itself, so tests drive it with a stand-in device (see
``tests/params_device.py``) and another accelerator can plug in its own transfer.

See NOTE [Copies on a side stream without races].
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["CudaTransfer", "ParameterTransfer"]

# NOTE [Copies on a side stream without races]
#
# ``to_device`` allocates the device copy while a side stream is current and copies into it there,
# recording an event; the host tensor is pinned, so the copy is asynchronous. Before any kernel
# reads the copy, ``wait`` makes the stream current at that moment wait for the event and calls
# ``record_stream`` on the copy, so that when the copy is dropped the caching allocator hands its
# memory out again only after that stream's kernels that were queued before the drop are done.
# ``to_host`` (gradients) first makes a second side stream wait for the current stream, which
# produced the gradient, copies into fresh pinned memory there and records the gradient on that
# stream, so dropping the device gradient right after is safe; ``synchronize`` blocks the host
# until the copy landed, before anyone reads it. Host-to-device and device-to-host copies run on
# separate streams so a gradient copy never queues behind a prefetch, nor the reverse.


class ParameterTransfer(Protocol):
    """Copies between host memory and one device, for `tensorhooks.offload_parameters`.

    ``token`` values are opaque to the caller: whatever the transfer needs to finish a copy it
    started (an event, or None when copies are synchronous).
    """

    @property
    def device(self) -> torch.device:
        """The device parameters are copied to."""
        ...

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """Return a host tensor (pinned where that makes copies asynchronous) equal to ``tensor``.

        Synchronous: the result holds the value when this returns. Strides are kept.
        """
        ...

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Start copying ``host`` to the device; return the device tensor and a token.

        Nothing may read the device tensor before ``wait(tensor, token)``. Strides are kept.
        """
        ...

    def wait(self, tensor: torch.Tensor, token: object) -> None:
        """Order everything queued after this call on the current stream after the copy."""
        ...

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Start copying device ``tensor`` (ready on the current stream) to a new host tensor.

        ``tensor`` may be dropped at once; the host tensor may be read after ``synchronize``.
        """
        ...

    def synchronize(self, token: object) -> None:
        """Block the host until the copy that returned ``token`` from `to_host` has landed."""
        ...


class _Copy:
    """A copy in flight on a side stream: its event, recorded after the copy was queued."""

    __slots__ = ("event",)

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event


class CudaTransfer:
    """`ParameterTransfer` for a CUDA device: side streams, events, pinned host memory.

    See NOTE [Copies on a side stream without races].

    Args:
        device: a CUDA device.
        pin_memory: keep host tensors in page-locked memory, which makes copies asynchronous
            (False saves page-locked memory and makes every copy synchronous).
    """

    def __init__(self, device: torch.device, *, pin_memory: bool = True) -> None:
        self._device = device
        self._pin_memory = pin_memory
        self._to_device_stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # untyped in torch's stubs
        self._to_host_stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # untyped in torch's stubs

    @property
    def device(self) -> torch.device:
        """The CUDA device parameters are copied to."""
        return self._device

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """Return a (pinned) host tensor with ``tensor``'s value, strides kept."""
        host = torch.empty_strided(
            tensor.shape,
            tensor.stride(),
            dtype=tensor.dtype,
            device="cpu",
            pin_memory=self._pin_memory,
        )
        host.copy_(tensor)
        return host

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Queue the copy of ``host`` on the host-to-device stream."""
        stream = self._to_device_stream
        with torch.cuda.stream(stream):
            copy = torch.empty_strided(
                host.shape, host.stride(), dtype=host.dtype, device=self._device
            )
            copy.copy_(host, non_blocking=self._pin_memory)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
            event.record(stream)
        return copy, _Copy(event)

    def wait(self, tensor: torch.Tensor, token: object) -> None:
        """Make the current stream wait for the copy, and record ``tensor`` on it."""
        assert isinstance(token, _Copy)
        current = torch.cuda.current_stream(self._device)
        current.wait_event(token.event)
        tensor.record_stream(current)

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Queue the copy of ``tensor`` to new (pinned) host memory on the device-to-host stream.

        A sparse gradient (``nn.Embedding(sparse=True)``) has no strided buffer to pin: it is
        copied at once, on the current stream.
        """
        if tensor.layout != torch.strided:
            return tensor.to("cpu"), None
        stream = self._to_host_stream
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            host = torch.empty_strided(
                tensor.shape,
                tensor.stride(),
                dtype=tensor.dtype,
                device="cpu",
                pin_memory=self._pin_memory,
            )
            host.copy_(tensor, non_blocking=self._pin_memory)
            tensor.record_stream(stream)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
            event.record(stream)
        return host, _Copy(event)

    def synchronize(self, token: object) -> None:
        """Block until the device-to-host copy of ``token`` is done (None: it was at once)."""
        if token is None:
            return
        assert isinstance(token, _Copy)
        token.event.synchronize()
