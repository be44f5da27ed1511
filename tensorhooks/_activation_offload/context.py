"""save_on_cpu: tensors saved for backward wait in host memory until backward needs them.

The public context and its pack/unpack pair. A context entry is a `Session`
(`session`); the records pack returns are in `records`, the pinned host-buffer pool in
`pinned_pool`, and the copy engines, with the provider tests replace, in `copy_engines`.
See NOTE [Offloading saved tensors without races] below.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import graph as torch_graph

from tensorhooks._core.compile import not_traced
from tensorhooks._core.guards import _ALIASED, current_save_guard, modified_error
from tensorhooks._core.torch_compat import (
    is_newest_node,
    pop_saved_tensors_hooks,
    push_saved_tensors_hooks,
)
from tensorhooks._hooks import saved_tensors_hooks

from .copy_engines import copy_engine_provider
from .pinned_pool import OffloadStats, pool_of
from .records import HostCopy, Offloaded
from .session import OffloadOptions, Session

__all__ = ["OffloadStats", "save_on_cpu"]

# NOTE [Offloading saved tensors without races]
#
# torch's ``save_on_cpu`` copies every saved tensor to the host on the compute stream, once per
# op that saves it (parameters included), and copies it back on the compute stream when an op's
# backward unpacks it. Stream order makes that safe and slow. Here, with ``pin_memory=True`` on a
# device with streams, copies run on one side stream per device and overlap with compute; six
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
#    Prefetch stops at the first record of another forward pass (``Timeline.forward_of``), so
#    the backward of one micro-batch does not fetch the tensors of the one saved before it.
# 4. Host buffers are reused only by the stream that used them. Pinned buffers come from a pool
#    per copy engine (one engine per device), keyed by byte size. A buffer returns to the pool
#    when its record dies and is reused by the next device-to-host copy on the same side
#    stream, which stream order puts after any copy still reading it.
# 5. Nothing captured. Under CUDA graph capture a replay would rewrite pooled host buffers that
#    later saves own: an offload while the current stream is capturing raises
#    `OffloadCaptureError` (the engine's ``capturing()``).
# 6. Prefetch is speculative. Running out of device memory while fetching a tensor ahead of use
#    stops that round of prefetching; the tensor's own unpack fetches it when backward needs it
#    (and raises there if memory is still short), so prefetch never fails a backward by itself.
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

# Below this many bytes a copy saves little memory and costs more in launch and bookkeeping
# than it moves.
_DEFAULT_MIN_OFFLOAD_BYTES = 1 << 20


def _unpack(packed: Offloaded | HostCopy | torch.Tensor) -> torch.Tensor:
    if isinstance(packed, torch.Tensor):
        return packed  # pack kept the tensor (or an alias): the save guard checked its version
    return packed.restore()


def _guarded_pair(
    session: Session,
) -> tuple[Callable[[torch.Tensor], object], Callable[[Any], torch.Tensor]]:
    """``VersionGuard().wrap(session.pack, _unpack)`` with the guard's work done inline.

    Same behaviour as the wrapped pair (the tests run both); one Python call fewer per pack and
    per unpack keeps the CPU path near the cost of identity hooks (see docs/performance.md).
    """
    slow = session.pack
    newest = is_newest_node

    def pack(tensor: torch.Tensor) -> object:
        if tensor.is_cpu:
            # `kept` of session.py, inlined.
            grad_fn = tensor.grad_fn
            if grad_fn is not None and newest(grad_fn):
                tensor = tensor.detach()
            return (_ALIASED, tensor, tensor, tensor._version)
        return pack_any(tensor)

    def pack_any(tensor: torch.Tensor) -> object:
        packed = slow(tensor)
        if isinstance(packed, torch.Tensor):
            return (_ALIASED, packed, packed, packed._version)
        return packed

    def unpack(
        stored: tuple[object, torch.Tensor, torch.Tensor, int] | Offloaded | HostCopy,
    ) -> torch.Tensor:
        if type(stored) is tuple:
            # The version guard's record (`_core.guards.VersionGuard`): pack kept the tensor.
            _, _, source, version = stored
            if source._version != version:
                raise modified_error(source, version)
            return source
        return stored.restore()  # type: ignore[union-attr]  # not a guard record: an offload record

    return (pack_any if session.cpu_is_device else pack), unpack


class _OpenEntries(threading.local):
    """The save_on_cpu entries open on this thread, innermost last: (its `_PackByHand`, session)."""

    def __init__(self) -> None:
        self.entries: list[tuple[_PackByHand, Session]] = []


_open = _OpenEntries()


class _PackByHand:
    """The ``pack_hook`` attribute of a save_on_cpu instance, which its own entries do not push.

    Called by hand, or through another context: inside an entry of its instance on this thread it
    packs as that entry does; outside, it packs alone and fences the copy at once. It also marks
    the instance's entries on the thread's list. It holds the options, not the instance: an
    instance holding a bound method of itself is a reference cycle, which only the cyclic garbage
    collector frees, at a cost paid at every ``with save_on_cpu():``.
    """

    __slots__ = ("options",)

    def __init__(self, options: OffloadOptions) -> None:
        self.options = options

    def __call__(self, tensor: torch.Tensor) -> object:
        for owner, session in reversed(_open.entries):
            if owner is self:
                return session.pack(tensor)
        session = Session(self.options, current_save_guard(), copy_engine_provider())
        packed = session.pack(tensor)
        session.close()
        return packed


class save_on_cpu(saved_tensors_hooks, torch_graph.save_on_cpu):
    """Context manager under which tensors saved for backward wait in host memory.

    Tensors that ops save for backward inside the context are copied to host memory and copied
    back to their device (same dtype, layout, shape and, when dense, strides) when backward needs
    them, so that device memory holds fewer activations between forward and backward. Same
    positional signature, defaults and semantics as `torch.autograd.graph.save_on_cpu` (of which
    it is a subclass, as of torch's ``saved_tensors_hooks``), plus:

    - with ``pin_memory=True`` on a device with streams (CUDA, XPU, ...), copies run on a side
      stream and overlap compute; backward copies the next saved tensors back ahead of use
      (``prefetch``); pinned host buffers are reused across steps (`save_on_cpu.stats` counts
      the bytes moved and the host memory held);
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
        HookArgumentTypeError: if an argument has the wrong type, such as a string
            ``pin_memory`` (a ``TypeError``).
        OffloadArgumentValueError: if a number is negative, or ``device_type`` is not a device
            type torch knows (torch falls back to CUDA's backend then; a ``ValueError``).
        RuntimeError: on entry, if hooks are disabled by ``disable_saved_tensors_hooks``.
        OffloadCaptureError: in the forward pass, if a tensor would be offloaded while its
            device's stream is being captured into a CUDA graph (a ``RuntimeError``).
        SavedTensorModifiedError: in backward, if a tensor that was not copied was changed in
            place after it was saved, or a tensor was changed in place while its asynchronous
            copy was still in flight (a ``RuntimeError``).

    Nesting and threads: the innermost saved-tensor hooks apply, as in torch. The context is per
    thread and the same instance may be entered on several threads at once, or nested; each
    entry fences its own copies when it exits. Backward may run on any thread. Saved tensors are
    numbered per thread and device in save order, and prefetching follows that order backwards,
    across consecutive contexts (one per layer works) and within one backward call.
    """

    @not_traced("save_on_cpu")  # See NOTE [Contexts under torch.compile]
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
        self._options = OffloadOptions.validated(
            pin_memory,
            device_type,
            min_offload_bytes=min_offload_bytes,
            offload_parameters=offload_parameters,
            prefetch=prefetch,
            max_in_flight=max_in_flight,
        )
        self._by_hand = _PackByHand(self._options)
        super().__init__(self._by_hand, _unpack)

    @property
    def pin_memory(self) -> bool:
        """Whether copies go to pinned host memory, asynchronously."""
        return self._options.pin_memory

    @property
    def device_type(self) -> str:
        """The device type whose tensors get the side-stream path."""
        return self._options.device_type

    @property
    def min_offload_bytes(self) -> int:
        """Dense tensors smaller than this many bytes stay on their device."""
        return self._options.min_offload_bytes

    @property
    def offload_parameters(self) -> bool:
        """Whether parameters and views of them are copied too."""
        return self._options.offload_parameters

    @property
    def prefetch(self) -> int:
        """How many saved tensors backward copies back ahead of the one it unpacks."""
        return self._options.prefetch

    @property
    def max_in_flight(self) -> int:
        """How many device-to-host copies an entry lets run before the oldest is waited for."""
        return self._options.max_in_flight

    @staticmethod
    def stats(device: torch.device | str) -> OffloadStats:
        """What the side-stream path has copied for ``device``, and the host memory it holds.

        Counts since the process started, over every ``save_on_cpu`` context; copies made
        synchronously (``pin_memory=False``, devices without streams) are not counted.

        Example:
            >>> import torch, tensorhooks
            >>> stats = tensorhooks.save_on_cpu.stats("cpu")  # the CPU has no side stream
            >>> stats.bytes_to_host, stats.host_bytes_in_use
            (0, 0)

        Args:
            device: the device, with its index (``"cuda:0"``); ``"cuda"`` means the current
                CUDA device.

        Returns:
            A frozen `OffloadStats`; all zeros for a device without a side-stream engine.
        """
        device = torch.device(device)
        index: int | None = device.index  # None for "cuda" (torch's stubs say int)
        if index is None and device.type != "cpu":
            module: Any = getattr(torch, device.type, None)
            if hasattr(module, "current_device") and module.is_available():
                device = torch.device(device.type, module.current_device())
        engine = copy_engine_provider().engine_for(device)
        if engine is None:
            return OffloadStats(0, 0, 0, 0, 0, 0)
        return pool_of(engine).stats()

    @not_traced("save_on_cpu")
    def __enter__(self) -> None:
        guard = current_save_guard()
        session = Session(self._options, guard, copy_engine_provider())
        if guard.version_check_may_be_inlined:
            pack, unpack = _guarded_pair(session)
        else:
            pack, unpack = guard.wrap(session.pack, _unpack)
        push_saved_tensors_hooks(pack, unpack)
        _open.entries.append((self._by_hand, session))

    @not_traced("save_on_cpu")
    def __exit__(self, *args: object) -> None:
        pop_saved_tensors_hooks()
        entries = _open.entries
        for index in range(len(entries) - 1, -1, -1):  # the last one, when exits are nested
            if entries[index][0] is self._by_hand:
                entries.pop(index)[1].close()
                return
