"""The state a region's forward pass ran under (RNG, autocast, default device), replayed."""

from __future__ import annotations

import contextlib

import torch

from tensorhooks._core.torch_compat import default_device_in_force

__all__ = ["RegionState", "device_initialized"]


class RegionState:
    """The RNG, autocast and default-device state a region's forward pass ran under.

    Read once per region call and replayed around each recomputation: a context manager of its
    own (entered once per recomputation, so no generator or exit stack per call).
    """

    __slots__ = (
        "autocast",
        "cpu_rng",
        "default_device",
        "device_rng",
        "device_type",
    )

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
        types = ("cpu",) if self.device_type is None else ("cpu", self.device_type)
        self.autocast = [(kind, _autocast_state(kind)) for kind in types]
        self.default_device = default_device_in_force()

    def replay(self) -> _Replaying:
        """The context that runs its body under the recorded state, and restores the present."""
        return _Replaying(self)

    def _set_device_rng(self) -> list[tuple[torch.device, torch.Tensor]]:
        if not self.device_rng or self.device_type is None:
            return []
        module = getattr(torch, self.device_type)
        now = []
        for device, state in self.device_rng:
            with module.device(device):
                now.append((device, module.get_rng_state()))
                module.set_rng_state(state)
        return now

    def _restore_device_rng(self, states: list[tuple[torch.device, torch.Tensor]]) -> None:
        if not states or self.device_type is None:
            return
        module = getattr(torch, self.device_type)
        for device, state in states:
            with module.device(device):
                module.set_rng_state(state)


class _Replaying:
    """One recomputation's replay of a `RegionState` (its own: recomputations may run at once)."""

    __slots__ = ("_cpu_now", "_devices_now", "_stack", "_state")

    def __init__(self, state: RegionState) -> None:
        self._state = state
        self._cpu_now: torch.Tensor | None = None
        self._devices_now: list[tuple[torch.device, torch.Tensor]] = []
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> None:
        state = self._state
        if state.cpu_rng is not None:
            self._cpu_now = torch.get_rng_state()
            torch.set_rng_state(state.cpu_rng)
            self._devices_now = state._set_device_rng()
        stack: contextlib.ExitStack | None = None
        for kind, recorded in state.autocast:
            if _autocast_state(kind) != recorded:
                stack = stack or contextlib.ExitStack()
                enabled, dtype, cache = recorded
                stack.enter_context(
                    torch.autocast(kind, dtype=dtype, enabled=enabled, cache_enabled=cache)
                )
        if default_device_in_force() != state.default_device:
            stack = stack or contextlib.ExitStack()
            stack.enter_context(state.default_device or torch.device("cpu"))
        self._stack = stack

    def __exit__(self, *exc: object) -> None:
        try:
            if self._stack is not None:
                self._stack.close()
        finally:
            if self._cpu_now is not None:
                torch.set_rng_state(self._cpu_now)
                self._state._restore_device_rng(self._devices_now)


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
