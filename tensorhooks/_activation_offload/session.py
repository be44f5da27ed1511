"""One entry into a save_on_cpu context: its options, what pack does, its copies in flight."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import sys
import threading
import warnings

import torch

from tensorhooks._core.errors import (
    HookArgumentTypeError,
    OffloadArgumentValueError,
    OffloadCaptureError,
)
from tensorhooks._core.guards import SaveGuard, is_output_of_saving_node

from .copy_engines import CopyEngine, CopyEngineProvider
from .pinned_pool import pool_of
from .records import HostCopy, Offloaded, Timeline, copy_strides

__all__ = ["NothingPinnedWarning", "OffloadOptions", "Session", "kept", "thread_timeline"]

_Parameter = torch.nn.Parameter
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)

# What a negative option is told to pass instead.
_ZERO_MEANS = {
    "min_offload_bytes": "copy tensors of every size",
    "prefetch": "fetch each tensor only when backward unpacks it",
    "max_in_flight": "order every copy before the ops that follow it",
}


@dataclasses.dataclass(frozen=True, slots=True)
class OffloadOptions:
    """The options of one ``save_on_cpu`` instance, validated (see `validated`)."""

    pin_memory: bool
    device_type: str
    min_offload_bytes: int
    offload_parameters: bool
    prefetch: int
    max_in_flight: int

    @classmethod
    def validated(
        cls,
        pin_memory: object,
        device_type: str,
        *,
        min_offload_bytes: int,
        offload_parameters: bool,
        prefetch: int,
        max_in_flight: int,
    ) -> OffloadOptions:
        """Check the arguments of ``save_on_cpu`` (callers may pass any type) and build the record.

        Arguments checked before are not checked again (see `_VALIDATED`).

        Raises:
            HookArgumentTypeError: if an argument has the wrong type (a ``TypeError``).
            OffloadArgumentValueError: if a number is negative or ``device_type`` is not a device
                type (a ``ValueError``).
        """
        arguments = (
            pin_memory,
            device_type,
            min_offload_bytes,
            offload_parameters,
            prefetch,
            max_in_flight,
        )
        key = (*arguments, *map(type, arguments))
        try:
            known = _VALIDATED.get(key)
        except TypeError:  # an unhashable argument: checked every time
            known, remember = None, False
        else:
            remember = type(pin_memory) is bool and len(_VALIDATED) < _VALIDATED_MAX
        options = known or cls._checked(
            pin_memory,
            device_type,
            min_offload_bytes=min_offload_bytes,
            offload_parameters=offload_parameters,
            prefetch=prefetch,
            max_in_flight=max_in_flight,
        )
        if remember and known is None:
            _VALIDATED[key] = options
        if options.pin_memory and not _nothing_pinned_said:
            _say_nothing_pinned(options.device_type)
        return options

    @classmethod
    def _checked(
        cls,
        pin_memory: object,
        device_type: str,
        *,
        min_offload_bytes: int,
        offload_parameters: bool,
        prefetch: int,
        max_in_flight: int,
    ) -> OffloadOptions:
        for name, value, kind in (
            ("device_type", device_type, str),
            ("offload_parameters", offload_parameters, bool),
        ):
            if not isinstance(value, kind):
                raise HookArgumentTypeError(
                    f"save_on_cpu: {name} must be a {kind.__name__}, got {value!r} of type "
                    f"{type(value).__name__}"
                )
        for name, number in (
            ("min_offload_bytes", min_offload_bytes),
            ("prefetch", prefetch),
            ("max_in_flight", max_in_flight),
        ):
            if not isinstance(number, int) or isinstance(number, bool):
                raise HookArgumentTypeError(
                    f"save_on_cpu: {name} must be an int, got {number!r} of type "
                    f"{type(number).__name__}"
                )
            if number < 0:
                raise OffloadArgumentValueError(
                    f"save_on_cpu: {name} must be >= 0, got {number}; pass 0 to {_ZERO_MEANS[name]}"
                )
        _check_pin_memory_and_device_type(pin_memory, device_type)
        return cls(
            pin_memory=bool(pin_memory),  # torch takes any truthy value
            device_type=device_type,
            min_offload_bytes=min_offload_bytes,
            offload_parameters=offload_parameters,
            prefetch=prefetch,
            max_in_flight=max_in_flight,
        )


# Options already built, by their arguments and the arguments' types (True and 1 are equal keys
# otherwise, and only one is a valid size). A program makes its contexts with a few sets of
# arguments, once per step or once per layer; checking them again (torch.device parses the
# device type) cost more than the rest of entering the context. Only a bool ``pin_memory`` is
# remembered (torch takes any truthy object there), and at most `_VALIDATED_MAX` sets.
_VALIDATED: dict[tuple[object, ...], OffloadOptions] = {}
_VALIDATED_MAX = 64


class NothingPinnedWarning(UserWarning):
    """``save_on_cpu(pin_memory=True)`` where the device type is not available: nothing pinned."""


_nothing_pinned_said = False
"""Whether this process was told that ``pin_memory=True`` pins nothing here (it is, once)."""


_OWN_CODE = ("tensorhooks._activation_offload.", "tensorhooks._core.compile")


def _say_nothing_pinned(device_type: str) -> None:
    """Warn, once per process, when ``pin_memory=True`` meets no available ``device_type``.

    Torch is silent there; the copies are then plain synchronous host copies.
    """
    global _nothing_pinned_said  # noqa: PLW0603  # once per process, as torch's warn-once
    module = getattr(torch, device_type, None)
    is_available = getattr(module, "is_available", None)
    if is_available is not None and is_available():
        return
    # tensorhooks' own contexts (checkpoint's offload policies, the planner) ask for pinning
    # wherever it exists; only a user's call is told. The caller: the first frame outside
    # save_on_cpu's own code (this wing, and the entry that keeps Dynamo out).
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith(_OWN_CODE):
        frame, level = frame.f_back, level + 1
    if frame.f_globals.get("__name__", "").startswith("tensorhooks."):
        return
    _nothing_pinned_said = True
    warnings.warn(
        f"save_on_cpu(pin_memory=True): no {device_type} device is available here, so nothing "
        "will be pinned: saved tensors are copied to (or stay in) ordinary host memory, "
        f"synchronously. Pass pin_memory=torch.{device_type}.is_available() to ask for this "
        "without the warning (said once per process)",
        NothingPinnedWarning,
        stacklevel=level,
    )


def _check_pin_memory_and_device_type(pin_memory: object, device_type: str) -> None:
    """Refuse what torch's ``save_on_cpu`` takes by mistake (see docs/differences.md)."""
    # A str is truthy, so torch pins for pin_memory="false".
    if isinstance(pin_memory, str):
        raise HookArgumentTypeError(
            f"save_on_cpu: pin_memory must be a bool, got {pin_memory!r} of type str; pass "
            "True or False"
        )
    try:
        device = torch.device(device_type)
    except RuntimeError as error:  # torch silently falls back to torch.cuda here
        raise OffloadArgumentValueError(
            f"save_on_cpu: device_type {device_type!r} is not a device type: {error}. Pass "
            "the type of the device your tensors are on, such as 'cuda' or 'xpu'"
        ) from None
    if device.type != device_type:  # "cuda:0"
        raise OffloadArgumentValueError(
            f"save_on_cpu: device_type must be a device type without an index, got "
            f"{device_type!r}; pass {device.type!r}"
        )


def _capture_error(tensor: torch.Tensor) -> OffloadCaptureError:
    return OffloadCaptureError(
        f"save_on_cpu cannot offload a {tensor.type()} of shape {list(tensor.shape)} while the "
        f"stream of {tensor.device} is being captured into a graph: replays would rewrite host "
        "buffers that later saves reuse. Run the captured region outside save_on_cpu (its saved "
        "tensors then stay on the device)."
    )


def kept(tensor: torch.Tensor) -> torch.Tensor:
    """What pack returns for a tensor it does not copy: the tensor, or a detached alias of it.

    The alias is for a tensor saved by the node that produced it (see
    `is_output_of_saving_node`): holding the tensor itself would keep a graph dropped without
    backward alive forever.
    """
    return tensor.detach() if is_output_of_saving_node(tensor) else tensor


class _Timelines(threading.local):
    def __init__(self) -> None:
        self.by_device: dict[torch.device, Timeline] = {}


_timelines = _Timelines()


def thread_timeline(device: torch.device) -> Timeline:
    """The calling thread's timeline of ``device``, made on first use."""
    by_device = _timelines.by_device
    timeline = by_device.get(device)
    if timeline is None:
        timeline = by_device[device] = Timeline()
    return timeline


_entry_numbers = itertools.count()


class Session:
    """One entry into a ``save_on_cpu`` context: its options and its copies still in flight.

    ``max_in_flight`` is the options' unless ``guard`` lets saved tensors change
    (``allow_mutation_on_saved_tensors``): changes are then expected, so each copy is ordered
    before the ops that follow it (0).
    """

    __slots__ = ("cpu_is_device", "entry", "lock", "options", "pending", "provider")

    def __init__(
        self, options: OffloadOptions, guard: SaveGuard, provider: CopyEngineProvider
    ) -> None:
        if guard.lets_saved_tensors_change:
            options = dataclasses.replace(options, max_in_flight=0)
        self.options = options
        self.provider = provider
        self.cpu_is_device = provider.treats_cpu_as_device
        self.pending: collections.deque[Offloaded] = collections.deque()
        self.lock = threading.Lock()
        self.entry = next(_entry_numbers)

    @property
    def prefetch(self) -> int:
        """How many saved tensors backward copies back ahead of the one it unpacks."""
        return self.options.prefetch

    def pack(self, tensor: torch.Tensor) -> Offloaded | HostCopy | torch.Tensor:
        """Copy ``tensor`` (a record), or return it (or a detached alias) when it stays."""
        options = self.options
        if tensor.is_cpu and not self.cpu_is_device:
            return kept(tensor)
        if not options.offload_parameters and (
            isinstance(tensor, _Parameter) or isinstance(tensor._base, _Parameter)
        ):
            return kept(tensor)
        dense = type(tensor) in _PLAIN_TYPES and tensor.layout == torch.strided
        dense = dense and not tensor.is_nested and not tensor.is_quantized
        if dense and tensor.numel() * tensor.element_size() < options.min_offload_bytes:
            return kept(tensor)
        device = tensor.device
        timeline = thread_timeline(device)
        record = timeline.find(tensor)
        if record is not None:
            return record
        engine = self._engine(device) if dense else None
        if engine is None:
            record = self._copy(tensor, device, dense)
        else:
            if engine.capturing():
                raise _capture_error(tensor)
            record = Offloaded(tensor, engine, pool_of(engine), timeline, self)
            timeline.records[record.seq] = record
            with self.lock:
                self.pending.append(record)
                while len(self.pending) > options.max_in_flight:
                    self.pending.popleft().fence()
        timeline.remember(tensor, record)
        return record

    def _engine(self, device: torch.device) -> CopyEngine | None:
        if not self.options.pin_memory:
            return None
        if device.type != self.options.device_type and not self.cpu_is_device:
            return None
        return self.provider.engine_for(device)

    def _copy(self, tensor: torch.Tensor, device: torch.device, dense: bool) -> HostCopy:
        source = tensor.detach()
        pin_memory = self.options.pin_memory
        if pin_memory and dense:
            module = getattr(torch, self.options.device_type, torch.cuda)
            if module.is_available():
                host = torch.empty_strided(
                    tuple(source.shape),
                    copy_strides(source),
                    dtype=source.dtype,
                    device="cpu",
                    pin_memory=True,
                )
                host.copy_(source, non_blocking=True)
                return HostCopy(device, host, non_blocking=True)
        return HostCopy(device, source.to("cpu", copy=True), non_blocking=pin_memory)

    def fence_through(self, record: Offloaded) -> None:
        """Fence the pending copies up to and including ``record``'s (they are in save order)."""
        with self.lock:
            while record.source is not None and self.pending:
                self.pending.popleft().fence()

    def close(self) -> None:
        """Fence every pending copy: after the context, writes and reuse are ordered after them."""
        if not self.pending:  # only pack, on this entry's thread, adds: nothing can come now
            return
        with self.lock:
            while self.pending:
                self.pending.popleft().fence()
