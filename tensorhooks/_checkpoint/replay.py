"""The state a region's forward pass ran under (RNG, autocast, default device), replayed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["RegionState", "device_initialized"]


class RegionState:
    """The RNG, autocast and default-device state a region's forward pass ran under."""

    __slots__ = ("autocast", "cpu_rng", "default_device", "device_rng", "device_type")

    def __init__(self, tensors: list[torch.Tensor], preserve_rng_state: bool) -> None:
        devices = {t.device for t in tensors if t.device.type not in ("cpu", "meta")}
        self.device_type = next(iter(devices)).type if devices else None
        for device in devices:
            if device.type == "cuda":
                self.device_type = "cuda"
        self.cpu_rng = torch.get_rng_state() if preserve_rng_state else None
        self.device_rng: list[tuple[torch.device, torch.Tensor]] = []
        if preserve_rng_state and self.device_type is not None:
            module = getattr(torch, self.device_type)
            for device in sorted(devices, key=str):
                if device.type == self.device_type:
                    with module.device(device):
                        self.device_rng.append((device, module.get_rng_state()))
        types = ["cpu"] if self.device_type is None else ["cpu", self.device_type]
        self.autocast = [(kind, _autocast_state(kind)) for kind in types]
        self.default_device = torch.get_default_device()

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the body under the recorded state; restore the present one after."""
        with contextlib.ExitStack() as stack:
            if self.cpu_rng is not None:
                stack.enter_context(self._rng())
            for kind, state in self.autocast:
                if _autocast_state(kind) != state:
                    enabled, dtype, cache = state
                    stack.enter_context(
                        torch.autocast(kind, dtype=dtype, enabled=enabled, cache_enabled=cache)
                    )
            if torch.get_default_device() != self.default_device:
                stack.enter_context(self.default_device)
            yield

    @contextlib.contextmanager
    def _rng(self) -> Iterator[None]:
        assert self.cpu_rng is not None
        module = None if self.device_type is None else getattr(torch, self.device_type)
        cpu_now = torch.get_rng_state()
        devices_now = []
        if module is not None:
            for device, state in self.device_rng:
                with module.device(device):
                    devices_now.append((device, module.get_rng_state()))
                    module.set_rng_state(state)
        torch.set_rng_state(self.cpu_rng)
        try:
            yield
        finally:
            torch.set_rng_state(cpu_now)
            if module is not None:
                for device, state in devices_now:
                    with module.device(device):
                        module.set_rng_state(state)


def _autocast_state(kind: str) -> tuple[bool, torch.dtype, bool]:
    return (
        torch.is_autocast_enabled(kind),
        torch.get_autocast_dtype(kind),
        torch.is_autocast_cache_enabled(),
    )


def device_initialized(device_type: str | None) -> bool:
    if device_type is None:
        return False
    is_initialized = getattr(getattr(torch, device_type, None), "is_initialized", None)
    return bool(is_initialized()) if callable(is_initialized) else False
