"""The streamer of `offload_parameters`: block hooks that move parameters and land gradients.

See NOTE [Streaming parameters with hooks] below, and in `slots`:
NOTE [The value of a slot, and changes made under it].
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import Node
from torch.utils.hooks import RemovableHandle

from tensorhooks._core.compile import not_traced, runs_eagerly
from tensorhooks._core.errors import ParameterOffloadStateError
from tensorhooks._core.guards import SavedCopy, is_output_of_saving_node, modified_error
from tensorhooks._core.late_grads import LANDING_ORDER
from tensorhooks._core.store import graph_task_store
from tensorhooks._core.torch_compat import (
    current_graph_task_id,
    is_captured_accumulator,
    post_accumulate_grad_hooks,
    top_saved_tensors_hooks,
    will_engine_execute_node,
)
from tensorhooks._hooks import saved_tensors_hooks

from .slots import Block, Slot, accumulate
from .transfers import ParameterTransfer

__all__ = ["Streamer"]

# NOTE [Streaming parameters with hooks]
#
# Every parameter and buffer of a block is one *slot* (`slots.Slot`): the tensor object the model
# holds (the same ``nn.Parameter`` from start to end), a host tensor that is its value while no
# block holds it, and a count of the blocks holding it on the device. *Holding* a block installs
# device copies (``tensor.data = copy``); when no block holds a slot any more, its value goes back
# to the host tensor (copied back where it was written on the device, and always for buffers) and
# ``tensor.data = host`` again. Holders are owners: the block's running forward, or a backward
# call (graph task). Before a slot no block holds is used, what the user changed since is taken in
# (`Streamer.sync`): new data (see NOTE [The value of a slot, and changes made under it]), a new
# buffer object in the module (followed), a new parameter object (refused: the hooks are on the
# old one), ``requires_grad`` turned on or off (hooks added or removed).
#
# Forward. A block's pre-forward hook holds it and *stages* the next ``prefetch`` blocks (starts
# their copies; staged copies are not installed, so a parameter changed on the host before its
# block runs is copied again: the stage remembers the parameter's version). Installing a
# parameter in a forward records its gradient accumulator, the node this forward's graph uses.
# The post-forward hook (always called, also when forward or the pre-forward hook raises) drops
# the hold; when forward raised, the blocks it staged will not run next, so their staged copies
# are dropped too. So is every staged copy when the model's forward ends, returning or raising
# (backward stages its own). While a block runs, a pair of saved-tensor hooks is pushed: a tensor
# saved for backward that is a slot, a view of one, or a dtype cast of a parameter (autocast) is
# replaced by a placeholder holding no device memory; every other tensor goes to the pair that was
# innermost before (``save_on_cpu``), so activations can be offloaded too. Without the placeholder
# the graph would keep the parameter *object*, whose ``.data`` is the host tensor by the time
# backward runs. A placeholder unpacked after the parameter was written in place raises autograd's
# error; after its data was replaced, `ParameterOffloadStateError`.
#
# Backward. The first unpack in a graph task of anything saved while a block ran (a placeholder, an
# activation, the inputs of a `checkpoint` region, which its recomputation unpacks before it reads
# the weights from the module), or the first gradient reaching one of its parameters, makes the task
# hold the block (and stage the blocks before it); an activation unpacked after all of the block's
# gradients arrived does not bring it back. A tensor hook on each parameter, which runs before
# autograd accumulates, sets aside a host ``.grad`` left by an earlier backward (accumulation must
# not mix devices). A post-accumulate hook, kept first among the parameter's post-accumulate hooks,
# starts copying the new gradient to the host and clears the device one. When the parameter has
# other post-accumulate hooks (an optimizer step in backward), it copies at once instead, adds what
# was set aside, writes ``.grad`` and *parks* the slot (``tensor.data = host``, the device copy kept
# for saved weights), so that those hooks see the host value with its gradient and what they write
# is the value. The first time a task touches a block it asks the engine which of the block's
# recorded accumulators run; once each of those ran (or, for a gradient ``autograd.grad``
# captures, its tensor hook fired) the task drops the block. At the successful end of the task the
# host gradients land in ``.grad`` (added to what was set aside), in an end callback of order
# `LANDING_ORDER` of `_core.late_grads`: the parameters are registered there, so that what reads
# ``.grad`` during backward (`sync_gradients`) reads it after that instead. When backward fails,
# the task's holds are dropped and the set-aside gradients restored, so a failed backward changes
# nothing. All of it lives in the graph-task store.
#
# Accumulators. Autograd checks a gradient against what the parameter's accumulator recorded when
# it was created (device, dtype, shape), and forgets the accumulator when ``.data`` changes device
# or dtype. So the accumulator is recorded while the parameter is installed in forward (autograd
# makes it then, for the device copy), and forgotten when the user replaces the data, so that a
# new one matching it is made. A parameter installed twice in one forward (a weight tied between
# blocks, released between them) may so have two accumulators in one graph: its gradients are
# summed per parameter when they land.
#
# After ``remove()`` a graph built under the handle cannot be used: its gradients would reach
# accumulators expecting the streaming device and no hook would move them to where the parameters
# were put back, and holding a block would install copies over the restored data. The first unpack
# of anything saved inside a block of such a graph raises instead, before anything changes.

_FORWARD = "forward"  # owner of the hold a block's running forward takes


class _Placeholder(SavedCopy):
    """What the graph keeps for a saved slot, a view of one, or a cast of a parameter.

    A `SavedCopy` for the save guards: it holds no device tensor, refetches the block's
    parameters at unpack and checks their version (and that their data was not replaced) itself.
    """

    __slots__ = ("block", "dtype", "generation", "offset", "size", "slot", "stride", "version")

    def __init__(self, slot: Slot, block: Block, view: torch.Tensor, dtype: Any) -> None:
        self.slot = slot
        self.block = block
        self.dtype = dtype
        self.size = view.shape
        self.stride = view.stride()
        self.offset = view.storage_offset()
        self.version = slot.tensor._version
        self.generation = slot.generation


class _Outer:
    """A tensor packed by the pair that was innermost when the block's pair was pushed."""

    __slots__ = ("packed", "unpack")

    def __init__(self, packed: Any, unpack: Callable[[Any], torch.Tensor]) -> None:
        self.packed = packed
        self.unpack = unpack


class _Frame:
    """One running block forward: whether its hold was taken, and the pair it pushed."""

    __slots__ = ("context", "held")

    def __init__(self) -> None:
        self.held = False
        self.context: saved_tensors_hooks | None = None


class _Progress:
    """Which gradients of one block one graph task still waits for.

    ``waiting`` maps a slot (by id) to True while its accumulator is still to run, to False while
    its tensor hook is still to fire (a gradient ``autograd.grad`` captures).
    """

    __slots__ = ("expected", "waiting")

    def __init__(self, waiting: dict[int, bool]) -> None:
        self.expected = bool(waiting)
        self.waiting = waiting


class _TaskData:
    """What one graph task keeps: its holds, set-aside grads, grads on their way to the host."""

    __slots__ = ("finished", "held", "pending", "progress", "stash")

    def __init__(self) -> None:
        self.finished = False
        self.held: dict[int, None] = {}
        self.stash: dict[int, tuple[Slot, torch.Tensor]] = {}
        self.pending: list[tuple[Slot, torch.Tensor, object]] = []
        self.progress: dict[int, _Progress] = {}


class _TaskShell:
    """The store's entry: its death (success or failure) releases what `_TaskData` holds."""

    __slots__ = ("__weakref__", "data")

    def __init__(self, data: _TaskData) -> None:
        self.data = data


class Streamer:
    """Moves the slots of blocks between host and device. See NOTE [Streaming parameters...]."""

    def __init__(self, blocks: list[Block], transfer: ParameterTransfer, prefetch: int) -> None:
        self.blocks = blocks
        self.transfer = transfer
        self.prefetch = prefetch
        self.lock = threading.RLock()
        self.key = object()
        self.slots: dict[int, Slot] = {id(s.tensor): s for b in blocks for s in b.slots}
        self.unrestored: list[Slot] = []  # offloaded, not put back yet
        self.removed = False  # set by the handle's remove(): see NOTE [Streaming parameters ...]
        self._pushed = threading.local()

    # --- what the user changed ----------------------------------------------------------------

    def sync(self, slot: Slot) -> None:
        """Take in what the user changed since the slot was last used; no block holds it."""
        self._check_locations(slot)
        slot.follow(self.transfer)
        if slot.is_param and slot.tensor.requires_grad != slot.requires_grad:
            slot.requires_grad = slot.tensor.requires_grad
            self._unhook(slot)
            if slot.requires_grad:
                self._hook(slot)

    def _check_locations(self, slot: Slot) -> None:
        tensor = slot.tensor
        for module, name in slot.locations:
            if getattr(module, name, None) is not tensor:
                break
        else:
            return
        held = [getattr(module, name, None) for module, name in slot.locations]
        new = held[0]
        if slot.is_param or not isinstance(new, torch.Tensor) or any(t is not new for t in held):
            kind = "parameter" if slot.is_param else "buffer"
            raise ParameterOffloadStateError(
                f"offload_parameters: {slot.name} is no longer the {kind} offload_parameters "
                f"streams: the module now holds {_describe(new)} (load_state_dict(assign=True), "
                "an assignment, or model.to() with overwrite_module_params_on_conversion); call "
                "handle.remove() before replacing parameters and offload_parameters again "
                "after, or change the values instead (in place, or param.data = ...)"
            )
        del self.slots[id(slot.tensor)]
        slot.tensor = new  # a buffer the module replaced (model.double(), self.buf = ...)
        self.slots[id(new)] = slot
        slot.signature = ()  # so that `Slot.follow` takes its data as the value

    def _hook(self, slot: Slot) -> None:
        """The parameter's tensor hook and post-accumulate hook, the latter first of its kind."""
        param = slot.tensor
        slot.hooks.append(param.register_hook(self._grad_arriving(slot)))  # type: ignore[no-untyped-call]  # untyped in torch's stubs
        accumulated = param.register_post_accumulate_grad_hook
        handle = accumulated(functools.partial(self._grad_accumulated, slot))  # type: ignore[no-untyped-call]  # untyped in torch's stubs
        slot.hooks.append(handle)
        hooks = post_accumulate_grad_hooks(param)
        assert hooks is not None  # just registered one
        hooks.move_to_end(handle.id, last=False)  # See NOTE [Streaming parameters with hooks]

    @staticmethod
    def _unhook(slot: Slot) -> None:
        for handle in slot.hooks:
            handle.remove()
        slot.hooks.clear()

    # --- residency ----------------------------------------------------------------------------

    def stage(self, block: Block) -> None:
        """Start copying the block's slots that are neither installed nor staged up to date.

        A copy staged ahead of a change the user makes before the block starts is dropped when
        `hold` takes the change in (`Slot.follow`), and made again.
        """
        for slot in block.slots:
            if slot.holders == 0 and slot.staged_version != slot.tensor._version:
                slot.staged, slot.staged_token = self.transfer.to_device(slot.host)
                slot.staged_version = slot.tensor._version

    def hold(self, block: Block, owner: object) -> None:
        """Add ``owner`` to the block's holders, installing its device copies on the first."""
        with self.lock:
            first = not block.owners
            if first:
                for slot in block.slots:
                    if slot.holders == 0:
                        self.sync(slot)  # raises before anything is held: a refused change
                self.stage(block)
            block.owners[owner] = block.owners.get(owner, 0) + 1
            if not first:
                return
            record = owner is _FORWARD and current_graph_task_id() == -1
            for slot in block.slots:
                if slot.holders == 0:
                    self._install(slot, record)
                slot.holders += 1

    def _install(self, slot: Slot, record: bool) -> None:
        copy, token = slot.staged, slot.staged_token
        assert copy is not None  # `hold` staged it
        slot.unstage()
        self.transfer.wait(copy, token)
        slot.install(copy)
        if record and slot.requires_grad:
            slot.accumulator = _accumulator(slot.tensor)  # See NOTE [Streaming parameters ...]

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
                    slot.evict(self.transfer)

    def unstage(self, indexes: range) -> None:
        """Drop the staged copies of the blocks at ``indexes`` (those past the end are skipped)."""
        with self.lock:
            for block in self.blocks[indexes.start : indexes.stop]:
                for slot in block.slots:
                    slot.unstage()

    def discard_staged(self, keep: range) -> None:
        """Drop staged copies of blocks outside ``keep`` (indexes), unless a kept block has them."""
        kept = {id(s) for i in keep if 0 <= i < len(self.blocks) for s in self.blocks[i].slots}
        for block in self.blocks:
            for slot in block.slots:
                if slot.staged is not None and id(slot) not in kept:
                    slot.unstage()

    def device_data(self, block: Block, slot: Slot) -> torch.Tensor:
        """The slot's device copy, held for the running backward (or a transient copy outside)."""
        if current_graph_task_id() == -1:
            with self.lock:
                if slot.device is not None:
                    return slot.device
                copy, token = self.transfer.to_device(slot.host)
            self.transfer.wait(copy, token)
            return copy
        self.backward_hold(block)
        assert slot.device is not None  # the task holds it
        return slot.device

    def offload(self) -> None:
        """Move every slot into host memory (the parameters' ``.grad`` too)."""
        for slot in self.slots.values():
            slot.offload(self.transfer)
            self.unrestored.append(slot)

    def restore(self) -> list[tuple[Slot, BaseException]]:
        """Put back every slot not put back yet; return those that failed, with their error."""
        failures: list[tuple[Slot, BaseException]] = []
        with self.lock:
            self.discard_staged(range(0))
            for slot in self.unrestored:
                self._unhook(slot)
                try:
                    slot.restore(self.transfer)
                except Exception as error:  # the others are put back first; see remove()
                    failures.append((slot, error))
            self.unrestored = [slot for slot, _ in failures]
        return failures

    # --- forward ------------------------------------------------------------------------------

    @not_traced("offload_parameters")  # See NOTE [Contexts under torch.compile]
    def pre_forward(self, block: Block) -> None:
        """Hold the block, stage the next ones, push the saved-tensor pair while it runs."""
        frame = _Frame()
        self._pushed.__dict__.setdefault("stack", []).append(frame)
        window = range(block.index, block.index + self.prefetch + 1)
        with self.lock:
            self.discard_staged(window)
            self.hold(block, _FORWARD)
            frame.held = True
            for index in window[1:]:
                if index < len(self.blocks):
                    self.stage(self.blocks[index])
        if torch.is_grad_enabled():
            frame.context = self._saved_pair(block)
            frame.context.__enter__()

    @not_traced("offload_parameters")
    def post_forward(self, block: Block, output: Any) -> None:
        """Pop the pair, drop the block's forward hold, drop autocast's casts of its weights."""
        frame: _Frame = self._pushed.stack.pop()
        if frame.context is not None:
            frame.context.__exit__(None, None, None)
        if frame.held:
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
        outer = top_saved_tensors_hooks()
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
        if slot is None or slot.tensor is not base:
            grad_fn = base.grad_fn
            if grad_fn is None or type(grad_fn).__name__ != "ToCopyBackward0":
                return None
            source = getattr(grad_fn.next_functions[0][0], "variable", None)
            slot = self.slots.get(id(source))
            if slot is None or slot.tensor is not source or base.device != source.device:
                return None
            if base.shape != source.shape or base.stride() != source.stride():
                return None
            dtype = base.dtype
        else:
            dtype = None
        with self.lock:
            slot.follow(self.transfer)  # data replaced inside the forward: it is what is saved
        return slot, dtype

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
        progress = self._progress(data, block)
        if not progress.expected or progress.waiting:
            self.backward_hold(block)

    def _unpack_placeholder(self, packed: _Placeholder) -> torch.Tensor:
        slot = packed.slot
        if slot.tensor._version != packed.version:
            raise modified_error(slot.tensor, packed.version)
        if slot.generation != packed.generation or slot.replaced():
            raise ParameterOffloadStateError(
                f"offload_parameters: backward needs {slot.name} as it was in forward, but its "
                "data was replaced since (param.data = ..., vector_to_parameters, model.to(), "
                "model.double()); run backward before changing the model, or run the forward "
                "again after the change"
            )
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
                if not self._progress(data, self.blocks[index]).waiting:
                    self._release(data, index)
            self.discard_staged(range(block.index - self.prefetch, block.index + 1))
            self.hold(block, data)
            data.held[block.index] = None
            for index in range(block.index - 1, block.index - self.prefetch - 1, -1):
                if index >= 0:
                    self.stage(self.blocks[index])

    def _progress(self, data: _TaskData, block: Block) -> _Progress:
        """What the task waits for of the block, asked of the engine the first time."""
        progress = data.progress.get(block.index)
        if progress is None:
            waiting: dict[int, bool] = {}
            for slot in block.slots:
                node = slot.accumulator
                if not slot.requires_grad or node is None:
                    continue
                if is_captured_accumulator(node):
                    waiting[id(slot)] = False
                elif will_engine_execute_node(node):
                    waiting[id(slot)] = True
            progress = data.progress[block.index] = _Progress(waiting)
        return progress

    def _release(self, data: _TaskData, index: int) -> None:
        with self.lock:
            if data.held.pop(index, False) is None:
                self.drop(self.blocks[index], data)

    def _done(self, data: _TaskData, slot: Slot, accumulated: bool) -> None:
        """The slot's gradient arrived (``accumulated``, or captured): release finished blocks."""
        for block in slot.blocks:
            progress = self._progress(data, block)
            if progress.waiting.get(id(slot)) is accumulated:
                del progress.waiting[id(slot)]
                if not progress.waiting:
                    self._release(data, block.index)

    def _grad_arriving(self, slot: Slot) -> Callable[[torch.Tensor], None]:
        """Tensor hook: hold a block of the slot; set its host ``.grad`` aside."""
        param = slot.tensor

        @runs_eagerly  # See NOTE [Contexts under torch.compile]
        def hook(grad: torch.Tensor) -> None:
            data = self.task()
            if not any(b.index in data.held for b in slot.blocks):
                self.backward_hold(slot.blocks[0])
            node = slot.accumulator
            if node is not None and is_captured_accumulator(node):
                self._done(data, slot, accumulated=False)
            elif param.grad is not None:
                data.stash[id(slot)] = (slot, param.grad)
                param.grad = None

        return hook

    @runs_eagerly  # See NOTE [Contexts under torch.compile]
    def _grad_accumulated(self, slot: Slot, param: torch.Tensor) -> None:
        """Post-accumulate hook: send the gradient to the host, mark it done for its blocks."""
        data = self.task()
        grad = param.grad
        if grad is not None:
            param.grad = None
            hooks = post_accumulate_grad_hooks(param)
            if hooks is not None and len(hooks) > 1:
                self._park(data, slot, grad)
            else:
                host, token = self.transfer.to_host(grad)
                data.pending.append((slot, host, token))
        self._done(data, slot, accumulated=True)

    def _park(self, data: _TaskData, slot: Slot, grad: torch.Tensor) -> None:
        """Land the gradient now and make the host value the data, for the hooks that follow."""
        host, token = self.transfer.to_host(grad)
        self.transfer.synchronize(token)
        for entry in [entry for entry in data.pending if entry[0] is slot]:
            data.pending.remove(entry)  # an earlier accumulator of the same parameter
            self.transfer.synchronize(entry[2])
            host = accumulate(entry[1], host)
        stashed = data.stash.pop(id(slot), None)
        if stashed is not None:
            host = accumulate(stashed[1], host)
        with self.lock:
            slot.park(self.transfer)
        _land(slot, host)

    @runs_eagerly  # See NOTE [Contexts under torch.compile]
    def _finish(self, data: _TaskData) -> None:
        """Successful end of the task: release everything, land the gradients in ``.grad``."""
        with self.lock:
            for index in list(data.held):
                self._release(data, index)
            self.discard_staged(range(0))
        landed: dict[int, tuple[Slot, torch.Tensor]] = {}
        for slot, host, token in data.pending:
            self.transfer.synchronize(token)
            earlier = landed.get(id(slot))
            landed[id(slot)] = (slot, host if earlier is None else accumulate(earlier[1], host))
        data.pending.clear()
        for key, (slot, grad) in landed.items():
            stashed = data.stash.pop(key, None)
            _land(slot, grad if stashed is None else accumulate(stashed[1], grad))
        self._restore_stash(data)
        data.finished = True

    @runs_eagerly  # See NOTE [Contexts under torch.compile]
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
        for slot, grad in data.stash.values():
            slot.tensor.grad = grad
        data.stash.clear()

    # --- setup --------------------------------------------------------------------------------

    def register(self, model: nn.Module) -> list[RemovableHandle]:
        """Register the module hooks and the parameters' gradient hooks; return the handles."""
        handles: list[RemovableHandle] = []
        try:
            hook = model.register_forward_hook
            handles.append(hook(lambda *_: self.post_model_forward(), always_call=True))
            for block in self.blocks:
                handles += [
                    block.module.register_forward_pre_hook(
                        lambda _m, _a, b=block: self.pre_forward(b)
                    ),
                    block.module.register_forward_hook(
                        lambda _m, _a, o, b=block: self.post_forward(b, o), always_call=True
                    ),
                ]
            for slot in self.slots.values():
                if slot.requires_grad:
                    self._hook(slot)
        except BaseException:
            for handle in handles:
                handle.remove()
            for slot in self.slots.values():
                self._unhook(slot)
            raise
        return handles


_REMOVED_MESSAGE = (
    "offload_parameters: backward (or grad_fn._saved_*) needs a tensor saved inside a streamed "
    "block, but this graph was built while the parameters were offloaded, and handle.remove() "
    "was called since; run backward before remove(), or drop this graph and run the forward "
    "again after remove() (plain autograd then)"
)


def _accumulator(param: torch.Tensor) -> Node:
    """The parameter's gradient accumulator (created now if no graph holds one)."""
    with torch.enable_grad():
        node: Node = param.view_as(param).grad_fn.next_functions[0][0]  # type: ignore[union-attr, assignment]  # a leaf requiring grad has one
    return node


def _land(slot: Slot, grad: torch.Tensor) -> None:
    """Write a landed gradient into ``.grad`` (on the parameter's device, if it is not there)."""
    param = slot.tensor
    param.grad = grad if param.device == grad.device else grad.to(param.device)


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"another {type(value).__name__} object"
    return repr(value)
