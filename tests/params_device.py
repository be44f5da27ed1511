"""A stand-in device for offload_parameters' tests: "device copies" are separate host clones.

`HostCloneTransfer` implements `tensorhooks.ParameterTransfer` without a device: every copy to
the "device" is a fresh CPU clone, so a test can watch, with weak references to the clones'
storages (alive while any tensor, view or saved tensor uses them), which host tensors have copies
alive at any moment, and in which order copies were made. Host tensors are named by
their ``data_ptr()``, which is what ``param.data_ptr()`` says while the parameter is offloaded.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch


class HostCloneTransfer:
    """Copies are clones on the CPU; every copy to the "device" is logged and weakly tracked."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.loads: list[int] = []
        """``data_ptr()`` of the host tensor of every copy to the "device", in order."""
        self.to_host_copies = 0
        self.on_event: Callable[[], None] | None = None
        """Called after every copy and wait: a test's probe of what is alive at that moment."""
        self._copies: list[tuple[int, weakref.ref[torch.UntypedStorage]]] = []

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().clone()

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, object]:
        copy = host.clone()
        self.loads.append(host.data_ptr())
        self._copies.append((host.data_ptr(), weakref.ref(copy.untyped_storage())))
        self._probe()
        return copy, None

    def wait(self, tensor: torch.Tensor, token: object) -> None:
        self._probe()

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        self.to_host_copies += 1
        self._probe()
        return tensor.detach().clone(), None

    def synchronize(self, token: object) -> None:
        pass

    def is_device_copy(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (or what it views) is a live "device" copy, not a host tensor."""
        storage = tensor.untyped_storage()
        return any(
            (copy := ref()) is not None and copy.data_ptr() == storage.data_ptr()
            for _, ref in self._copies
        )

    def alive(self) -> set[int]:
        """``data_ptr()`` of every host tensor that has a "device" copy alive now."""
        self._copies = [(key, ref) for key, ref in self._copies if ref() is not None]
        return {key for key, _ in self._copies}

    def _probe(self) -> None:
        if self.on_event is not None:
            self.on_event()
