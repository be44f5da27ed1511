"""Stand-in and tracked devices for offload_parameters' tests, with a log of the device copies.

`HostCloneTransfer` implements `tensorhooks.ParameterTransfer` without a device: every copy to
the "device" is a fresh CPU clone. `TrackingCudaTransfer` is the real `tensorhooks.CudaTransfer`
(side streams, events, pinned memory) with the same log, for the CUDA variants of the tests. Both
let a test watch, with weak references to the copies' storages (alive while any tensor, view or
saved tensor uses them), which host tensors have device copies alive at any moment, and in which
order copies were made. Host tensors are named by their ``data_ptr()``, which is what
``param.data_ptr()`` says while the parameter is offloaded.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from tensorhooks import CudaTransfer


class DeviceCopyLog:
    """The log both transfers keep: every copy to the device, and which are still alive."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loads: list[int] = []
        """``data_ptr()`` of the host tensor of every copy to the device, in order."""
        self.to_host_copies = 0
        self.on_event: Callable[[], None] | None = None
        """Called after every copy and wait: a test's probe of what is alive at that moment."""
        self._copies: list[tuple[int, weakref.ref[torch.UntypedStorage]]] = []

    def is_device_copy(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (or what it views) is a live device copy, not a host tensor."""
        storage = tensor.untyped_storage()
        return any(
            (copy := ref()) is not None
            and copy.device == storage.device
            and copy.data_ptr() == storage.data_ptr()
            for _, ref in self._copies
        )

    def alive(self) -> set[int]:
        """``data_ptr()`` of every host tensor that has a device copy alive now."""
        self._copies = [(key, ref) for key, ref in self._copies if ref() is not None]
        return {key for key, _ in self._copies}

    def settle(self) -> None:
        """Wait for the copies queued on the device (nothing to wait for on the host)."""

    def _track(self, host: torch.Tensor, copy: torch.Tensor) -> None:
        self.loads.append(host.data_ptr())
        self._copies.append((host.data_ptr(), weakref.ref(copy.untyped_storage())))
        self._probe()

    def _probe(self) -> None:
        if self.on_event is not None:
            self.on_event()


class HostCloneTransfer(DeviceCopyLog):
    """Copies are clones on the CPU; every copy to the "device" is logged and weakly tracked."""

    def __init__(self) -> None:
        super().__init__()
        self.device = torch.device("cpu")

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().clone()

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, object]:
        copy = host.clone()
        self._track(host, copy)
        return copy, None

    def wait(self, tensor: torch.Tensor, token: object) -> None:
        self._probe()

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        self.to_host_copies += 1
        self._probe()
        return tensor.detach().clone(), None

    def synchronize(self, token: object) -> None:
        pass


class TrackingCudaTransfer(DeviceCopyLog, CudaTransfer):
    """`tensorhooks.CudaTransfer` unchanged, with every copy to the device logged and tracked.

    Liveness is the host's view (a weak reference to the copy's storage): a dropped copy whose
    memory the caching allocator still keeps for a stream (``record_stream``) counts as gone.
    """

    def __init__(self, device: torch.device | None = None, *, pin_memory: bool = True) -> None:
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(device, pin_memory=pin_memory)

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, object]:
        copy, token = super().to_device(host)
        self._track(host, copy)
        return copy, token

    def wait(self, tensor: torch.Tensor, token: object) -> None:
        super().wait(tensor, token)
        self._probe()

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        result = super().to_host(tensor)
        self.to_host_copies += 1
        self._probe()
        return result

    def settle(self) -> None:
        """Block until every stream of the device is idle (copies both ways included)."""
        torch.cuda.synchronize(self.device)


TrackingTransfer = HostCloneTransfer | TrackingCudaTransfer
"""What `tests.test_params` offloads with: the host stand-in, or CUDA when a device is present."""
