"""offload_parameters: a model's parameters live in host memory and visit the device per block.

See NOTE [Streaming parameters with hooks] below.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import Node
from torch.utils.hooks import RemovableHandle

from tensorhooks._core.compile import not_traced
from tensorhooks._core.errors import ParameterOffloadStateError
from tensorhooks._core.guards import SavedCopy, is_output_of_saving_node, modified_error
from tensorhooks._core.late_grads import LANDING_ORDER, LateGrads
from tensorhooks._core.store import graph_task_store
from tensorhooks._core.torch_compat import (
    current_graph_task_id,
    is_captured_accumulator,
    top_saved_tensors_hooks,
    will_engine_execute_nodes,
)
from tensorhooks._hooks import register_multi_grad_hook, saved_tensors_hooks

from .blocks import Block, Slot, build_blocks, resolve_transfer
from .transfers import ParameterTransfer

__all__ = ["ParameterOffloadHandle", "offload_parameters"]

# NOTE [Streaming parameters with hooks]
#
# Every parameter and buffer of a block is one *slot*: the tensor object the model holds (the
# same ``nn.Parameter`` from start to end), a host tensor that is the one true value, and a
# count of the blocks holding it on the device. *Holding* a block installs device copies
# (``tensor.data = copy``); when no block holds a slot any more, ``tensor.data = host`` again.
# Device copies of parameters are only ever read, so releasing one needs no copy back; buffers
# (running statistics) are copied back. Holders are owners: the block's running
# forward, or a backward call (graph task).
#
# Forward. A block's pre-forward hook holds it and *stages* the next ``prefetch`` blocks (starts
# their copies; staged copies are not installed, so a parameter changed on the host before its
# block runs is copied again: the stage remembers the parameter's version). The post-forward hook
# (always called, also when forward raises) drops the hold; when forward raised, the blocks it
# staged will not run next, so their staged copies are dropped too. So is every staged copy when
# the model's forward ends, returning or raising (backward stages its own). While a block runs, a
# pair of saved-tensor hooks is pushed: a tensor saved for backward that is a slot, a view of one,
# or a dtype cast of a parameter (autocast) is replaced by a placeholder holding no device memory;
# every other tensor goes to the pair that was innermost before (``save_on_cpu``), so activations
# can be offloaded too. Without the placeholder the graph would keep the parameter *object*, whose
# ``.data`` is the host tensor by the time backward runs.
#
# Backward. The first unpack in a graph task of anything saved while a block ran (a placeholder, an
# activation, the inputs of a `checkpoint` region, which its recomputation unpacks before it reads
# the weights from the module), or the first gradient reaching one of its parameters, makes the task
# hold the block (and stage the blocks before it); an activation unpacked after all of the block's
# gradients arrived does not bring it back. A tensor hook on each parameter, which runs before
# autograd accumulates, sets aside a host ``.grad`` left by an earlier backward (accumulation must
# not mix devices); a post-accumulate hook starts copying the new gradient to the host and clears
# the device one. An ``"all"`` multi-grad hook on the block's parameters tells when every gradient
# of the block that this backward computes has arrived; once those are accumulated too, the task
# drops the block. At the successful end of the task the host gradients land in ``.grad`` (added to
# what was set aside), in an end callback of order `LANDING_ORDER` of `_core.late_grads`: the
# parameters are registered there, so that what reads ``.grad`` during backward (`sync_gradients`)
# reads it after that instead. When backward fails, the task's holds are dropped and the set-aside
# gradients restored, so a failed backward changes nothing. All of it lives in the graph-task store.
#
# Autograd checks a gradient's device against what its gradient accumulator recorded when it was
# created. The accumulators of the streamed parameters are therefore created once while the
# parameters are on the device, and kept alive (by the multi-grad hooks) until ``remove()``.
#
# After ``remove()`` a graph built under the handle cannot be used: its gradients would reach
# accumulators expecting the streaming device and no hook would move them to where the parameters
# were put back, and holding a block would install copies over the restored data. The first unpack
# of anything saved inside a block of such a graph raises instead, before anything changes.

_FORWARD = "forward"  # owner of the hold a block's running forward takes
_SETUP = "setup"  # owner of the hold taken while accumulators are created


class _Placeholder(SavedCopy):
    """What the graph keeps for a saved slot, a view of one, or a cast of a parameter.

    A `SavedCopy` for the save guards: it holds no device tensor, refetches the block's
    parameters at unpack and checks their version itself.
    """

    __slots__ = ("block", "dtype", "offset", "size", "slot", "stride", "version")

    def __init__(self, slot: Slot, block: Block, view: torch.Tensor, dtype: Any) -> None:
        self.slot = slot
        self.block = block
        self.dtype = dtype
        self.size = view.shape
        self.stride = view.stride()
        self.offset = view.storage_offset()
        self.version = slot.tensor._version


class _Outer:
    """A tensor packed by the pair that was innermost when the block's pair was pushed."""

    __slots__ = ("packed", "unpack")

    def __init__(self, packed: Any, unpack: Callable[[Any], torch.Tensor]) -> None:
        self.packed = packed
        self.unpack = unpack


class _Progress:
    """How far one block's gradients got in one graph task."""

    __slots__ = ("accumulated", "awaiting", "fired")

    def __init__(self) -> None:
        self.fired = False
        self.awaiting: set[int] = set()
        self.accumulated: set[int] = set()


class _TaskData:
    """What one graph task keeps: its holds, set-aside grads, grads on their way to the host."""

    __slots__ = ("finished", "held", "pending", "progress", "stash")

    def __init__(self) -> None:
        self.finished = False
        self.held: dict[int, None] = {}
        self.stash: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
        self.pending: list[tuple[nn.Parameter, torch.Tensor, object]] = []
        self.progress: dict[int, _Progress] = {}


class _TaskShell:
    """The store's entry: its death (success or failure) releases what `_TaskData` holds."""

    __slots__ = ("__weakref__", "data")

    def __init__(self, data: _TaskData) -> None:
        self.data = data


class _Streamer:
    """Moves the slots of blocks between host and device. See NOTE [Streaming parameters...]."""

    def __init__(self, blocks: list[Block], transfer: ParameterTransfer, prefetch: int) -> None:
        self.blocks = blocks
        self.transfer = transfer
        self.prefetch = prefetch
        self.lock = threading.RLock()
        self.key = object()
        self.slots: dict[int, Slot] = {id(s.tensor): s for b in blocks for s in b.slots}
        self.accumulators: dict[int, Node] = {}
        self.removed = False  # set by the handle's remove(): see NOTE [Streaming parameters ...]
        self._pushed = threading.local()

    # --- residency ----------------------------------------------------------------------------

    def stage(self, block: Block) -> None:
        """Start copying the block's slots that are neither installed nor staged up to date."""
        for slot in block.slots:
            if slot.holders == 0 and slot.staged_version != slot.tensor._version:
                slot.staged, slot.staged_token = self.transfer.to_device(slot.host)
                slot.staged_version = slot.tensor._version

    def hold(self, block: Block, owner: object) -> None:
        """Add ``owner`` to the block's holders, installing its device copies on the first."""
        with self.lock:
            first = not block.owners
            block.owners[owner] = block.owners.get(owner, 0) + 1
            if not first:
                return
            self.stage(block)
            for slot in block.slots:
                if slot.holders == 0:
                    self._install(slot)
                slot.holders += 1

    def _install(self, slot: Slot) -> None:
        copy, token = slot.staged, slot.staged_token
        assert copy is not None
        slot.staged = slot.staged_token = None
        slot.staged_version = -1
        self.transfer.wait(copy, token)
        slot.tensor.data = copy

    def drop(self, block: Block, owner: object) -> None:
        """Remove one hold of ``owner``; the last holder's drop returns the slots to the host."""
        with self.lock:
            count = block.owners[owner] - 1
            if count:
                block.owners[owner] = count
                return
            del block.owners[owner]
            if block.owners:
                return
            for slot in block.slots:
                slot.holders -= 1
                if slot.holders == 0:
                    self._evict(slot)

    def _evict(self, slot: Slot) -> None:
        tensor = slot.tensor
        if not slot.is_param:
            # Buffers may have changed (running statistics). Kernels such as batch_norm write
            # them without bumping their version counter, so they are always copied back.
            slot.host.copy_(tensor.data)
        tensor.data = slot.host

    def unstage(self, indexes: range) -> None:
        """Drop the staged copies of the blocks at ``indexes`` (those past the end are skipped)."""
        with self.lock:
            for block in self.blocks[indexes.start : indexes.stop]:
                for slot in block.slots:
                    slot.staged = slot.staged_token = None
                    slot.staged_version = -1

    def discard_staged(self, keep: range) -> None:
        """Drop staged copies of blocks outside ``keep`` (indexes), unless a kept block has them."""
        kept = {id(s) for i in keep if 0 <= i < len(self.blocks) for s in self.blocks[i].slots}
        for block in self.blocks:
            for slot in block.slots:
                if slot.staged is not None and id(slot) not in kept:
                    slot.staged = slot.staged_token = None
                    slot.staged_version = -1

    def device_data(self, block: Block, slot: Slot) -> torch.Tensor:
        """The slot's device copy, held for the running backward (or a transient copy outside)."""
        if current_graph_task_id() == -1:
            with self.lock:
                if slot.holders:
                    return slot.tensor.data
                copy, token = self.transfer.to_device(slot.host)
            self.transfer.wait(copy, token)
            return copy
        self.backward_hold(block)
        return slot.tensor.data

    # --- forward ------------------------------------------------------------------------------

    @not_traced("offload_parameters")  # See NOTE [Contexts under torch.compile]
    def pre_forward(self, block: Block) -> None:
        """Hold the block, stage the next ones, push the saved-tensor pair while it runs."""
        window = range(block.index, block.index + self.prefetch + 1)
        with self.lock:
            self.discard_staged(window)
            self.hold(block, _FORWARD)
            for index in window[1:]:
                if index < len(self.blocks):
                    self.stage(self.blocks[index])
        stack: list[saved_tensors_hooks | None] = self._pushed.__dict__.setdefault("stack", [])
        context = None
        if torch.is_grad_enabled():
            context = self._saved_pair(block)
            context.__enter__()
        stack.append(context)

    @not_traced("offload_parameters")
    def post_forward(self, block: Block, output: Any) -> None:
        """Pop the pair, drop the block's forward hold, drop autocast's casts of its weights."""
        context = self._pushed.stack.pop()
        if context is not None:
            context.__exit__(None, None, None)
        self.drop(block, _FORWARD)
        if output is None and sys.exc_info()[1] is not None and current_graph_task_id() == -1:
            # The forward raised (torch calls an always-called hook from its ``except`` block,
            # with no output): the blocks staged for what came next will not run now.
            self.unstage(range(block.index + 1, block.index + self.prefetch + 1))

    @not_traced("offload_parameters")
    def post_model_forward(self) -> None:
        """The model's forward returned or raised: no block runs before the next one starts."""
        if current_graph_task_id() == -1:  # not a checkpoint's recomputation in backward
            with self.lock:
                self.discard_staged(range(0))
        if torch.is_autocast_enabled(self.transfer.device.type):
            torch.clear_autocast_cache()  # its casts of the block's weights are device memory

    def _saved_pair(self, block: Block) -> saved_tensors_hooks:
        outer = top_saved_tensors_hooks() if top_saved_tensors_hooks is not None else None
        find = self._find
        unpack_saved = self._unpack

        def pack(tensor: torch.Tensor) -> Any:
            found = find(tensor)
            if found is not None:
                slot, dtype = found
                owner = block if id(slot) in block.slot_ids else slot.blocks[0]
                return _Placeholder(slot, owner, tensor, dtype)
            if outer is not None:
                return _Outer(outer[0](tensor), outer[1])
            return tensor.detach() if is_output_of_saving_node(tensor) else tensor

        def unpack(packed: Any) -> torch.Tensor:
            return unpack_saved(block, packed)

        return saved_tensors_hooks(pack, unpack)

    def _find(self, tensor: torch.Tensor) -> tuple[Slot, Any] | None:
        """The slot ``tensor`` is, views or (for a cast) was made from, and the cast's dtype."""
        base = tensor._base if tensor._base is not None else tensor
        slot = self.slots.get(id(base))
        if slot is not None and slot.tensor is base:
            return slot, None
        grad_fn = base.grad_fn
        if grad_fn is None or type(grad_fn).__name__ != "ToCopyBackward0":
            return None
        source = getattr(grad_fn.next_functions[0][0], "variable", None)
        slot = self.slots.get(id(source))
        if slot is None or slot.tensor is not source or base.device != source.device:
            return None
        if base.shape != source.shape or base.stride() != source.stride():
            return None
        return slot, base.dtype

    def _unpack(self, block: Block, packed: Any) -> torch.Tensor:
        """Unpack what the pair of ``block`` packed; see NOTE [Streaming parameters with hooks]."""
        if self.removed:
            raise ParameterOffloadStateError(_REMOVED_MESSAGE)
        if type(packed) is _Placeholder:
            return self._unpack_placeholder(packed)
        if current_graph_task_id() != -1:
            self._activation_unpacked(block)
        if type(packed) is _Outer:
            return packed.unpack(packed.packed)
        return packed  # type: ignore[no-any-return]  # a tensor pack kept as it was

    def _activation_unpacked(self, block: Block) -> None:
        """Hold ``block`` for the running task, unless it holds it or has all its gradients."""
        data = self.task()
        if block.index in data.held:
            return
        progress = data.progress.get(block.index)
        if progress is None or not progress.fired or progress.awaiting:
            self.backward_hold(block)

    def _unpack_placeholder(self, packed: _Placeholder) -> torch.Tensor:
        slot = packed.slot
        if slot.tensor._version != packed.version:
            raise modified_error(slot.tensor, packed.version)
        data = self.device_data(packed.block, slot)
        if packed.dtype is not None:
            data = data.to(packed.dtype)
        return data.as_strided(packed.size, packed.stride, packed.offset)

    # --- backward -----------------------------------------------------------------------------

    def task(self) -> _TaskData:
        """The running graph task's data, created (with its end and abandon paths) on first use."""
        state = graph_task_store.current()
        shell: _TaskShell | None = state.peek(self.key)
        if shell is not None:
            return shell.data
        candidate = _TaskShell(_TaskData())
        shell = state.claim(self.key, candidate)
        if shell is candidate:
            weakref.finalize(shell, self._abandon, shell.data).atexit = False
            # After the multi-grad hooks' own end-of-task flush (order 0); what reads the landed
            # .grad (sync_gradients) runs after it. See `_core.late_grads`.
            state.on_end(functools.partial(self._finish, shell.data), order=LANDING_ORDER)
        return shell.data

    def backward_hold(self, block: Block) -> None:
        """Make the running task hold ``block``; drop its finished blocks; stage the earlier."""
        data = self.task()
        if block.index in data.held:
            return
        with self.lock:
            if block.index in data.held:
                return
            for index in list(data.held):
                if not self._has_pending_grads(data, index):
                    self._release(data, index)
            self.discard_staged(range(block.index - self.prefetch, block.index + 1))
            self.hold(block, data)
            data.held[block.index] = None
            for index in range(block.index - 1, block.index - self.prefetch - 1, -1):
                if index >= 0:
                    self.stage(self.blocks[index])

    def _has_pending_grads(self, data: _TaskData, index: int) -> bool:
        block = self.blocks[index]
        accumulators = [self.accumulators[id(p)] for p in block.grad_params]
        if not accumulators or will_engine_execute_nodes(accumulators) == 0:
            return False
        progress = data.progress.get(index)
        return progress is None or not progress.fired or bool(progress.awaiting)

    def _release(self, data: _TaskData, index: int) -> None:
        with self.lock:
            if data.held.pop(index, False) is None:
                self.drop(self.blocks[index], data)

    def grad_arriving(self, param: nn.Parameter) -> Callable[[torch.Tensor], None]:
        """Tensor hook: hold a block of ``param``; set its host ``.grad`` aside."""
        slot = self.slots[id(param)]

        def hook(grad: torch.Tensor) -> None:
            data = self.task()
            if not any(b.index in data.held for b in slot.blocks):
                self.backward_hold(slot.blocks[0])
            if param.grad is not None and not is_captured_accumulator(self.accumulators[id(param)]):
                data.stash[id(param)] = (param, param.grad)
                param.grad = None

        return hook

    def grad_accumulated(self, param: torch.Tensor) -> None:
        """Post-accumulate hook: send the gradient to the host, mark it done for its blocks."""
        grad = param.grad
        assert grad is not None
        assert isinstance(param, nn.Parameter)
        param.grad = None
        data = self.task()
        host, token = self.transfer.to_host(grad)
        data.pending.append((param, host, token))
        for block in self.slots[id(param)].blocks:
            progress = data.progress.setdefault(block.index, _Progress())
            progress.accumulated.add(id(param))
            progress.awaiting.discard(id(param))
            self._maybe_done(data, block.index, progress)

    def grads_arrived(self, block: Block) -> Callable[[Sequence[torch.Tensor | None]], None]:
        """The block's "all" multi-grad hook: every gradient of this task reached its params."""

        def on_all(grads: Sequence[torch.Tensor | None]) -> None:
            data = self.task()
            progress = data.progress.setdefault(block.index, _Progress())
            progress.fired = True
            for param, grad in zip(block.grad_params, grads, strict=True):
                key = id(param)
                if grad is None or key in progress.accumulated:
                    continue
                if not is_captured_accumulator(self.accumulators[key]):
                    progress.awaiting.add(key)
            self._maybe_done(data, block.index, progress)

        return on_all

    def _maybe_done(self, data: _TaskData, index: int, progress: _Progress) -> None:
        if progress.fired and not progress.awaiting:
            self._release(data, index)

    def _finish(self, data: _TaskData) -> None:
        """Successful end of the task: release everything, land the gradients in ``.grad``."""
        with self.lock:
            for index in list(data.held):
                self._release(data, index)
            self.discard_staged(range(0))
        for param, host, token in data.pending:
            self.transfer.synchronize(token)
            stashed = data.stash.pop(id(param), None)
            grad = host if stashed is None else stashed[1].add_(host)
            param.grad = grad if param.device == grad.device else grad.to(param.device)
        data.pending.clear()
        self._restore_stash(data)
        data.finished = True

    def _abandon(self, data: _TaskData) -> None:
        """The task died without finishing (backward raised): undo everything it did."""
        if data.finished:
            return
        with self.lock:
            for index in list(data.held):
                self._release(data, index)
            self.discard_staged(range(0))
        data.pending.clear()
        self._restore_stash(data)

    @staticmethod
    def _restore_stash(data: _TaskData) -> None:
        for param, grad in data.stash.values():
            param.grad = grad
        data.stash.clear()

    # --- setup --------------------------------------------------------------------------------

    def register(self, model: nn.Module) -> list[RemovableHandle]:
        """Create the accumulators on the device and register every hook; return the handles."""
        handles: list[RemovableHandle] = []
        try:
            hook = model.register_forward_hook
            handles.append(hook(lambda *_: self.post_model_forward(), always_call=True))
            self._register(handles)
        except BaseException:
            for handle in handles:
                handle.remove()
            raise
        return handles

    def _register(self, handles: list[RemovableHandle]) -> None:
        seen: set[int] = set()
        for block in self.blocks:
            handles += [
                block.module.register_forward_pre_hook(lambda _m, _a, b=block: self.pre_forward(b)),
                block.module.register_forward_hook(
                    lambda _m, _a, o, b=block: self.post_forward(b, o), always_call=True
                ),
            ]
            if not block.grad_params:
                continue
            self.hold(block, _SETUP)
            try:
                for param in block.grad_params:
                    if id(param) in seen:
                        continue
                    seen.add(id(param))
                    self.accumulators[id(param)] = _accumulator(param)
                    handles.append(param.register_hook(self.grad_arriving(param)))  # type: ignore[no-untyped-call]  # untyped in torch's stubs
                    accumulated = param.register_post_accumulate_grad_hook
                    handles.append(accumulated(self.grad_accumulated))  # type: ignore[no-untyped-call]  # untyped in torch's stubs
                handles.append(
                    register_multi_grad_hook(block.grad_params, self.grads_arrived(block))
                )
            finally:
                self.drop(block, _SETUP)


_REMOVED_MESSAGE = (
    "offload_parameters: backward (or grad_fn._saved_*) needs a tensor saved inside a streamed "
    "block, but this graph was built while the parameters were offloaded, and handle.remove() "
    "was called since; run backward before remove(), or drop this graph and run the forward "
    "again after remove() (plain autograd then)"
)


def _accumulator(param: nn.Parameter) -> Node:
    """The parameter's gradient accumulator (created now if no graph holds one)."""
    with torch.enable_grad():
        node: Node = param.view_as(param).grad_fn.next_functions[0][0]  # type: ignore[union-attr, assignment]  # a leaf requiring grad has one
    return node


class ParameterOffloadHandle:
    """What `offload_parameters` returns: the blocks it streams, and ``remove()`` to stop.

    Attributes:
        blocks: the modules whose parameters move together, in the order they run.
        device: the device parameters are copied to while their block runs.
    """

    def __init__(self, streamer: _Streamer, handles: list[RemovableHandle]) -> None:
        self._streamer: _Streamer | None = streamer
        self._handles = handles
        self._late = LateGrads(p for b in streamer.blocks for p in b.grad_params)
        self.blocks: tuple[nn.Module, ...] = tuple(b.module for b in streamer.blocks)
        self.device: torch.device = streamer.transfer.device

    def remove(self) -> None:
        """Put every parameter and buffer back where it was, with its ``.grad``; unhook.

        Call it outside forward and backward. Calling it again does nothing. A graph built
        before cannot be used for backward any more (it raises `ParameterOffloadStateError`):
        run backward first, or drop the graph and run forward again.
        """
        streamer, self._streamer = self._streamer, None
        if streamer is None:
            return
        streamer.removed = True
        self._late.remove()
        for handle in self._handles:
            handle.remove()
        with streamer.lock:
            streamer.discard_staged(range(0))
            for slot in {id(s): s for b in streamer.blocks for s in b.slots}.values():
                slot.restore()


def offload_parameters(
    module: nn.Module,
    *,
    blocks: Sequence[nn.Module] | None = None,
    device: torch.device | str | int | None = None,
    prefetch: int = 1,
    pin_memory: bool = True,
    transfer: ParameterTransfer | None = None,
) -> ParameterOffloadHandle:
    """Keep ``module``'s parameters in host memory, copying each block's to the device as it runs.

    Between uses every parameter and buffer of the blocks lives in (pinned) host memory. When a
    block's forward starts its parameters are copied in (the next ``prefetch`` blocks' copies
    start meanwhile) and when it ends they leave again; backward brings each block back before
    its first node needs it, and as soon as all of the block's gradients are accumulated they go
    to the host ``.grad`` and the device copies are freed. So the device holds about
    ``1 + prefetch`` blocks' parameters at a time. The ``nn.Parameter`` objects stay the same, so
    an optimizer built on ``module.parameters()`` steps on the host tensors.
    ``torch.autograd.grad`` (which returns gradients on the device), ``backward(inputs=...)``,
    gradient accumulation, ``retain_graph``, weights tied between blocks, frozen parameters,
    autocast and ``save_on_cpu`` around the forward all work.

    Example:
        >>> import torch, tensorhooks
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        >>> handle = tensorhooks.offload_parameters(model, device="cuda")  # doctest: +SKIP
        >>> model(torch.ones(2, 4, device="cuda")).sum().backward()  # doctest: +SKIP
        >>> model[0].weight.device, model[0].weight.grad.device  # doctest: +SKIP
        (device(type='cpu'), device(type='cpu'))
        >>> handle.remove()  # doctest: +SKIP

    Args:
        module: the model. Its own parameters outside every block are left where they are.
        blocks: the submodules whose parameters move together, in the order they run forward
            (backward prefetches in reverse). Default: the children of ``module``, each item of
            an ``nn.ModuleList`` child (or of ``module`` itself) a block of its own. Blocks must
            not contain one another; a parameter in two blocks is a tied weight.
        device: where blocks run; default the current CUDA device.
        prefetch: how many blocks ahead to start copying (0: copy each block when it starts).
        pin_memory: keep host copies in page-locked memory, so copies run asynchronously.
        transfer: how to copy between host and device (`ParameterTransfer`); default CUDA
            side streams. ``device`` and ``pin_memory`` are then ignored.

    Returns:
        A `ParameterOffloadHandle`; its ``remove()`` puts everything back.

    Raises:
        ParameterOffloadValueError: for a block that is not a submodule of ``module``, a block
            listed twice or inside another, no blocks, or a negative ``prefetch`` (a
            ``ValueError``).
        ParameterOffloadDeviceError: when no CUDA device is available (a ``RuntimeError``).
        ParameterOffloadTypeError: when ``module`` or a block is not an ``nn.Module`` (a
            ``TypeError``).
        ParameterOffloadStateError: in backward, over a graph built before ``remove()`` (a
            ``RuntimeError``).

    Threads: one forward or backward of the model at a time. Parameters used outside the
    forward of a block that holds them are on the host then.
    """
    block_list = build_blocks(module, blocks, prefetch)
    streamer = _Streamer(block_list, resolve_transfer(device, pin_memory, transfer), prefetch)
    for slot in streamer.slots.values():
        slot.offload(streamer.transfer)
    try:
        handles = streamer.register(module)
    except BaseException:
        for slot in streamer.slots.values():
            slot.restore()
        raise
    return ParameterOffloadHandle(streamer, handles)
