"""The recorded step: the recorder, its dispatch mode, and the one run of the step.

See NOTE [Recording one step] below.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import gc
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from tensorhooks._core.errors import PlanStateError
from tensorhooks._core.guards import is_output_of_saving_node, register_protected_pack_hook
from tensorhooks._core.torch_compat import (
    OpOverload,
    UnwrappedDispatchMode,
    below_python_modes,
    current_autograd_node,
    current_graph_task_id,
    next_sequence_nr,
    op_schema,
    pop_saved_tensors_hooks,
    push_saved_tensors_hooks,
    sequence_nr,
    storage_key,
)

from .accounting import HeldBytes, Hold, delegating_hooks, module_keys, storage_bytes
from .apply import FULL, KEEP, Application, Watcher, tensors_in
from .checks import StepWatch
from .shapes import Exps, SizeTracker

__all__ = [
    "BEFORE",
    "Recorder",
    "StepClock",
    "device_of",
    "gap",
    "gap_after",
    "grads_kept",
    "measured_bandwidth",
    "median",
    "record",
]

# NOTE [Recording one step]
#
# Profiling runs the step once. By default the blocks run as they are (no plan): what a kept
# block saves is what its forward saves, seen by a pair of saved-tensor hooks around the step,
# and what a checkpoint of it would keep are the tensors it is called with (a checkpoint saves
# every tensor argument). With ``unplanned=False`` (a model that only fits checkpointed) every
# block is checkpointed instead, so the step needs no more memory than full checkpointing: what
# a kept block would save is then what its recomputation keeps, seen by a pair pushed inside
# it, and named after the forward outputs it is made again from.
#
# A dispatch mode sees every op: in the forward pass it times each op (the clock on a CPU, CUDA
# events on a GPU), counts its FLOPs, names the storage of each fresh output (one that is not an
# input's storage) after the op that made it (the allocator reuses addresses), and follows how
# each dimension grows with the step's input sizes (`SizeTracker`, see NOTE [Sizes that vary
# between steps] in `shapes`); in backward it only times ops, by the part of the step whose node
# runs. Ops are named by (operator, how many times it ran before in the block's function), the
# key a plan's policies use.
#
# A storage saved by several parts of the step is held from the first save to the backward of
# the first part that saved it: the profile counts it there (see `profiling`). Parts are the
# blocks, the model before the first block (`BEFORE`), and the gap after each block (`gap`):
# what the model runs between a block and the next, or after the last one.
#
# The same step is watched (`StepWatch`): the blocks' run order, a backward that records a graph,
# a block that writes its input, a cache a recomputation would write again. Its time is the
# recorder's as well: the recorder measures its own overhead per part (the mode's bookkeeping,
# the hooks), so that the step's and each block's own times can be told from the recorded ones.

BEFORE = -1  # the model's forward before the first block: held for the whole step
_GAP = -3  # gap(i) = _GAP - i


def gap(block: int) -> int:
    """The part of the step after block ``block`` (by listed index) and before the next."""
    return _GAP - block


def gap_after(part: int) -> int | None:
    """The block a gap part follows, or None if ``part`` is not a gap."""
    return _GAP - part if part <= _GAP else None


class StepClock:
    """The clock ops and steps are timed by: ``perf_counter`` on a CPU, CUDA events on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # untyped
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return float(end - start)
        return float(start.elapsed_time(end)) / 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, step: Callable[[], object]) -> float:
        """Seconds one call of ``step`` takes, with the cycle collector off (as the harness times).

        A collection triggered by the profiler's own garbage would otherwise land in a timed step.
        """
        collecting = gc.isenabled()
        gc.disable()
        try:
            self.sync()
            start = self.mark()
            step()
            end = self.mark()
            self.sync()
        finally:
            if collecting:
                gc.enable()
        return self.seconds(start, end)


class _Op:
    """One op of a block's function, while the step runs."""

    __slots__ = ("alias", "call", "end", "flops", "op", "outputs", "seconds", "start")

    def __init__(self, op: OpOverload, call: int, start: Any, end: Any) -> None:
        self.op = op
        self.call = call
        self.start = start
        self.end = end
        self.seconds = 0.0
        self.flops = 0
        self.alias = False
        # (storage name, storage bytes, tensor bytes, growth of its elements) per fresh output
        self.outputs: list[tuple[int, int, int, Exps]] = []


class _Saved:
    """A storage saved for backward somewhere in the step: its size, growth and savers."""

    __slots__ = ("exps", "nbytes", "parts")

    def __init__(self, nbytes: int, exps: Exps) -> None:
        self.nbytes = nbytes
        self.exps = exps
        self.parts: set[int] = set()


class Recorder(Watcher):
    """Everything the recorded step shows, gathered from the application, the mode and hooks.

    Blocks are indexed as listed; `order` says in which order they ran.
    """

    wants_saves = True

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        clock: StepClock,
        held: HeldBytes,
        *,
        keep: bool,
        watch: StepWatch,
    ) -> None:
        count = len(blocks)
        self.blocks = list(blocks)
        self.count = count
        self.clock = clock
        self.held = held
        self.keep = keep
        self.watch = watch
        self.sizes = SizeTracker(held.base)
        self.block: int | None = None  # running its forward or recomputation
        self.in_function = False
        self.recomputing = False
        self.order: list[int] = []  # blocks as their forward started
        self.last_done: int | None = None
        self.ranges: list[tuple[int, int]] = [(0, 0)] * count
        self.ops: list[list[_Op]] = [[] for _ in range(count)]
        self.calls: list[dict[OpOverload, int]] = [{} for _ in range(count)]
        # Per block, how many times each op ran again in its recomputation (recorded checkpointed).
        self.recomputed: list[dict[OpOverload, int]] = [{} for _ in range(count)]
        # Per block, its ops up to its last save (recorded kept): a recomputation stops there.
        self.saves_through = [0] * count
        # The names of the storages each op made again in a recomputation, by op key.
        self.remade: list[dict[tuple[OpOverload, int], list[int]]] = [{} for _ in range(count)]
        self.kept_by: list[set[int]] = [set() for _ in range(count)]
        self.inputs_of: list[set[int]] = [set() for _ in range(count)]
        self.names: dict[int, int] = {}  # storage key -> name of the storage made there last
        self.exps: dict[int, Exps] = {}  # storage name -> growth of its elements
        self.serial = 0
        self.saved: dict[int, _Saved] = {}
        self.tensor_bytes: dict[int, int] = {}  # storage name -> bytes of the tensor saved
        self.mutated: set[int] = set()  # storages an in-place op may have written
        self.marks: list[tuple[int, bool, Any, Any]] = []  # (part, backward, start, end)
        self.spans: list[list[tuple[Any, Any]]] = [[] for _ in range(count)]
        self.overhead: dict[int, float] = {}  # per part: the recorder's own seconds
        self.overhead_total = 0.0
        self._block_keys: dict[int, frozenset[int]] = {}
        # Backward ops are timed where they can hide copies (a GPU's link) or recompute blocks.
        self.times_backward = clock.cuda or not keep
        self.starts: list[int] = []  # sorted range starts, for `part_of_node`
        self._by_start: dict[int, int] = {}
        self.forward_seconds: list[float] = []  # per block, then the part after the blocks
        self.backward_seconds: list[float] = []
        self.function_seconds: list[float] = []
        self.step_seconds = 0.0
        self.op_count = 0  # ops the mode saw

    # --- after the step -------------------------------------------------------------------

    def resolve(self) -> None:
        """After the step (and a device sync): op times, and each part's forward and backward."""
        clock = self.clock
        for ops in self.ops:
            for record in ops:
                record.seconds = clock.seconds(record.start, record.end)
        self.forward_seconds = [0.0] * (self.count + 1)
        self.backward_seconds = [0.0] * (self.count + 1)
        for part, backward, start, end in self.marks:
            index = self._summed(part)
            if index is not None:
                sums = self.backward_seconds if backward else self.forward_seconds
                sums[index] += clock.seconds(start, end)
        self.marks = []
        self.function_seconds = [
            sum(clock.seconds(start, end) for start, end in spans) for spans in self.spans
        ]
        if not self.times_backward:  # a backward takes about twice its forward's op time
            self.backward_seconds = [2 * seconds for seconds in self.forward_seconds]

    def _summed(self, part: int) -> int | None:
        """Where a part's op times add up: its block, or `count` for after the last block."""
        if 0 <= part < self.count:
            return part
        if part == self.count or (self.order and gap_after(part) == self.order[-1]):
            return self.count
        return None

    def merge_remade(self) -> None:
        """Name what recomputations kept after the forward outputs they are made again from.

        A recomputation makes new storages; what a kept block would hold are the forward pass's
        (the same op's same output), which other parts of the step may save too (the next
        block's input, when the block ends with an op that saves its output).
        """
        for index, remade in enumerate(self.remade):
            again: dict[int, int] = {}
            for record in self.ops[index]:
                for position, name in enumerate(remade.get((record.op, record.call), [])):
                    if position < len(record.outputs):
                        again[name] = record.outputs[position][0]
            self.kept_by[index] = {again.get(name, name) for name in self.kept_by[index]}
            for name, forward in again.items():
                saved = self.saved.pop(name, None)
                if saved is not None:
                    merged = self.saved.setdefault(forward, saved)
                    merged.parts |= saved.parts
                    merged.exps = self.exps.get(forward, merged.exps)

    # --- the application's side -----------------------------------------------------------

    @contextlib.contextmanager
    def forward(self, index: int) -> Iterator[None]:
        if index in self.order:
            raise PlanStateError(
                f"profile_step: block {index} ran twice in one step; the planner plans one "
                "call of each block per step (run one micro-batch per step when profiling, or "
                "pass blocks=[...] that run once)"
            )
        self.order.append(index)
        start = next_sequence_nr()
        self.block = index
        keys = self._block_keys.get(index)
        if keys is None:
            keys = self._block_keys[index] = self.held.base | frozenset(
                module_keys(self.blocks[index])
            )
        self.held.excluded = keys
        try:
            yield
        finally:
            self.block = None
            self.last_done = index
            self.ranges[index] = (start, next_sequence_nr())

    def called(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.sizes.started:  # the step calls the blocks, not the model
            self.sizes.start(args, kwargs, "block")
        if self.keep:  # what a checkpoint of it would keep: every tensor argument
            for tensor in tensors_in((args, kwargs), []):
                if self._saved_by(index, tensor):
                    name = self._name(tensor)
                    self.inputs_of[index].add(name)
                    self._note_tensor_bytes(name, tensor)

    @contextlib.contextmanager
    def function(self, index: int) -> Iterator[None]:
        self.in_function = True
        start = self.clock.mark()
        try:
            if self.keep:  # the block's saves, also under hooks the step pushes inside
                with delegating_hooks(self._block_save):
                    yield
            else:
                yield
        finally:
            self.spans[index].append((start, self.clock.mark()))
            self.in_function = False

    def _block_save(self, tensor: torch.Tensor) -> Hold | None:
        """A save of the running block's forward (recorded kept): what keeping it holds."""
        began = time.perf_counter()
        part = self.block
        hold = None
        if part is not None and current_graph_task_id() == -1:
            self.saves_through[part] = len(self.ops[part])
            if self._saved_by(part, tensor):
                self.kept_by[part].add(self._name(tensor))
            hold = self.held.hold(tensor)
        self.charge(time.perf_counter() - began)
        return hold

    @contextlib.contextmanager
    def recompute(self, index: int) -> Iterator[None]:
        self.block, self.recomputing = index, True
        self.recomputed[index] = {}
        self.remade[index] = {}
        try:
            yield
        finally:
            self.block, self.recomputing = None, False

    def kept(self, index: int, tensor: torch.Tensor) -> None:
        if self._saved_by(index, tensor):
            self.kept_by[index].add(self._name(tensor))

    def runs_again(self, index: int, position: int) -> bool:
        """Whether block ``index``'s recomputation runs its op at ``position``.

        A recomputation stops at the last save (``early_stop``): recorded checkpointed it is
        seen; recorded kept, the ops up to the last save run again (an op's inputs are saved
        before it runs, its outputs after).
        """
        if self.keep:
            return position < self.saves_through[index]
        record = self.ops[index][position]
        return record.call < self.recomputed[index].get(record.op, 0)

    # --- the mode's side ------------------------------------------------------------------

    def part(self) -> int:
        """The part of the step running forward now: a block, before, or a gap after one."""
        if self.block is not None:
            return self.block
        if self.last_done is None:
            return BEFORE
        return gap(self.last_done)

    def part_of_node(self) -> int:
        """The part of the step whose forward made the node that backward is running."""
        node = current_autograd_node()
        if node is None or not self.order:
            return BEFORE
        if len(self.starts) != len(self.order):
            self.starts = sorted(self.ranges[index][0] for index in self.order)
            self._by_start = {self.ranges[index][0]: index for index in self.order}
        number = sequence_nr(node)
        at = bisect.bisect_right(self.starts, number) - 1
        if at < 0:
            return BEFORE
        index = self._by_start[self.starts[at]]
        return index if number < self.ranges[index][1] else gap(index)

    def op(
        self, func: OpOverload, args: Any, kwargs: Any, out: Any, *, start: Any, end: Any
    ) -> None:
        inputs = tensors_in((args, kwargs), [])
        input_keys = {storage_key(t) for t in inputs}
        fresh = [t for t in tensors_in(out, []) if storage_key(t) not in input_keys]
        if self.recomputing:
            self._recomputed(func, fresh)
            return
        writes = op_schema(func).is_mutable
        if writes:
            # A cached output that the forward pass then changes in place would be handed to
            # the recomputation changed (checkpoint raises): what an in-place op may write is
            # never cached. Every tensor argument counts, the written one among them.
            self.mutated.update(self.names[key] for key in input_keys if key in self.names)
            self.watch.note_write(func, args, kwargs)
        outputs = tensors_in(out, [])
        grown = self.sizes.op(func, inputs, outputs) if outputs else []
        growth = {id(t): exps for t, exps in zip(outputs, grown, strict=True)}
        part = self.part()
        self.marks.append((part, False, start, end))
        names = self._name_outputs(fresh, [growth[id(t)] for t in fresh])
        if part < 0 or not self.in_function:
            return
        calls = self.calls[part]
        call = calls.get(func, 0)
        calls[func] = call + 1
        record = _Op(func, call, start, end)
        record.alias = func.is_view or not fresh or writes
        record.flops = _flops(func, args, kwargs, out)
        record.outputs = [
            (name, storage_bytes(t), t.numel() * t.element_size(), growth[id(t)])
            for name, t in zip(names, fresh, strict=True)
        ]
        self.ops[part].append(record)

    def _recomputed(self, func: OpOverload, fresh: list[torch.Tensor]) -> None:
        if self.block is None:
            return
        calls = self.recomputed[self.block]
        call = calls.get(func, 0)
        calls[func] = call + 1
        self.remade[self.block][func, call] = self._name_outputs(fresh, [()] * len(fresh))

    def backward_op(self, start: Any, end: Any) -> None:
        self.watch.note_backward()
        if self.times_backward:
            self.marks.append((self.part_of_node(), True, start, end))

    def _name_outputs(self, fresh: list[torch.Tensor], growth: list[Exps]) -> list[int]:
        names = []
        for tensor, exps in zip(fresh, growth, strict=True):
            key = storage_key(tensor)
            self.serial += 1
            if key is not None:
                self.names[key] = self.serial
            if exps:
                self.exps[self.serial] = exps
            names.append(self.serial)
        return names

    def _name(self, tensor: torch.Tensor) -> int:
        key = storage_key(tensor)
        if key is None:
            return 0
        return self.names.get(key, -key)  # made before the step: named by its address

    # --- saves ------------------------------------------------------------------------------

    def _saved_by(self, part: int, tensor: torch.Tensor) -> bool:
        """Note that ``part`` saves ``tensor``; False for the model's parameters and buffers."""
        key = storage_key(tensor)
        if key is None or key in self.held.excluded:
            return False
        name = self._name(tensor)
        saved = self.saved.get(name)
        if saved is None:
            exps = self.exps.get(name) or self.sizes.numel(tensor)
            saved = self.saved[name] = _Saved(storage_bytes(tensor), exps)
        saved.parts.add(part)
        return True

    def _note_tensor_bytes(self, name: int, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        self.tensor_bytes[name] = max(size, self.tensor_bytes.get(name, 0))

    def pack(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Hold | None]:
        """The pair around the step: a forward save outside recomputations."""
        began = time.perf_counter()
        with below_python_modes():  # the recorder's own detach is no op of the step
            kept = tensor.detach() if is_output_of_saving_node(tensor) else tensor
        hold = self.held.hold(tensor)
        if current_graph_task_id() != -1:
            if not self.recomputing:
                self.watch.note_save_in_backward()
        else:
            part = self.part()
            if self.keep and part >= 0 and self.in_function:
                pass  # noted by `_block_save`, which the block's saves go through
            elif self._saved_by(part, tensor) and part >= 0:  # a checkpoint's input
                name = self._name(tensor)
                self.inputs_of[part].add(name)
                self._note_tensor_bytes(name, tensor)
        self.charge(time.perf_counter() - began)
        return kept, hold

    def charge(self, seconds: float) -> None:
        """The recorder's own ``seconds``, charged to the part running now."""
        part = self.block if self.block is not None else BEFORE
        self.overhead[part] = self.overhead.get(part, 0.0) + seconds
        self.overhead_total += seconds


def _flops(func: OpOverload, args: Any, kwargs: Any, out: Any) -> int:
    formula = _flop_registry().get(func.overloadpacket)
    if formula is None:
        return 0
    key = (func, *(_shape_or_value(value) for value in (*args, *kwargs.values())))
    try:
        known = _FLOPS.get(key)
    except TypeError:  # an argument that cannot be a key: count it every time
        known, key = None, ()
    if known is not None:
        return known
    try:
        count = int(formula(*args, **kwargs, out_val=out))
    except Exception:  # a formula that does not fit this overload: no count
        count = 0
    if key:
        _FLOPS[key] = count
    return count


_FLOPS: dict[tuple[Any, ...], int] = {}
"""FLOPs by operator and argument shapes: a stack's layers run the same ops on the same shapes."""


def _shape_or_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if isinstance(value, (list, tuple)):
        return tuple(_shape_or_value(item) for item in value)
    return value


@functools.cache
def _flop_registry() -> dict[Any, Any]:
    # Imported here: only profiling needs it, and `import tensorhooks` stays lighter without.
    from torch.utils.flop_counter import flop_registry  # noqa: PLC0415

    return dict(flop_registry)


class _RecordingMode(UnwrappedDispatchMode):
    """Times every op and hands it to the recorder, charging the recorder its own time."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's __init__ is untyped
        self.recorder = recorder
        self.mark = recorder.clock.mark

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        began = time.perf_counter()
        kwargs = {} if kwargs is None else kwargs
        start = self.mark()
        called = time.perf_counter()
        out = func(*args, **kwargs)
        returned = time.perf_counter()
        end = self.mark()
        recorder = self.recorder
        recorder.op_count += 1
        if current_graph_task_id() != -1 and not recorder.recomputing:
            recorder.backward_op(start, end)
        else:
            recorder.op(func, args, kwargs, out, start=start, end=end)
        recorder.charge(time.perf_counter() - began - (returned - called))
        return out


def device_of(model: nn.Module, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.device.type == "cuda":
            return tensor.device
    return torch.device("cpu")


@functools.cache
def measured_bandwidth(device: torch.device) -> float:
    """Bytes per second of pinned host↔device copies on ``device`` (the slower direction).

    Measured once per process and device: 64 MiB each way, the best of five, CUDA events.
    """
    size = 64 << 20
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(size, dtype=torch.uint8, device=device)
    best = []
    for source, destination in ((host, target), (target, host)):
        times = []
        for _ in range(6):
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            destination.copy_(source, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(float(start.elapsed_time(end)) / 1e3)
        best.append(min(times[1:]))
    return size / max(best)


@contextlib.contextmanager
def grads_kept(model: nn.Module) -> Iterator[None]:
    """Give every parameter of ``model`` its ``.grad`` back after the steps run inside."""
    before = [(parameter, parameter.grad) for parameter in model.parameters()]
    try:
        yield
    finally:
        for parameter, grad in before:
            parameter.grad = grad


def _unpack_first(packed: tuple[torch.Tensor, Hold | None]) -> torch.Tensor:
    return packed[0]


@contextlib.contextmanager
def _recording_hooks(recorder: Recorder) -> Iterator[None]:
    """The recorder's pair around the step, pushed as it is.

    Not through `saved_tensors_hooks`: its save guard's own ops (a detach per save) would be
    recorded as the step's. The recorded step's gradients are thrown away (`untouched`), so the
    guard has nothing to protect there.
    """
    register_protected_pack_hook(recorder.pack)
    push_saved_tensors_hooks(recorder.pack, _unpack_first)
    try:
        yield
    finally:
        pop_saved_tensors_hooks()


def _root_hook(recorder: Recorder, model: nn.Module) -> Callable[..., None]:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if recorder.sizes.started or current_graph_task_id() != -1:
            return
        # FSDP2 made its unsharded parameters in its own pre-hook (which ran first): they are
        # parameters, never activations.
        recorder.held.base = recorder.held.excluded = frozenset(module_keys(model))
        recorder.sizes.excluded = set(recorder.held.base)
        recorder.sizes.start(args, kwargs, "model")

    return hook


def record(
    model: nn.Module,
    blocks: list[nn.Module],
    step: Callable[[], object],
    clock: StepClock,
    *,
    keep: bool,
    caller: str = "profile_step",
) -> Recorder:
    """Run ``step`` once under the recorder (see NOTE [Recording one step]).

    Args:
        model: the model.
        blocks: its blocks, as listed.
        step: the step.
        clock: what times the ops.
        keep: run the blocks as they are; else every block checkpointed.
        caller: the function named in errors.

    Returns:
        The `Recorder`, resolved: blocks that did not run are not in its ``order``.

    Raises:
        PlanStateError: if the watch refuses the step (see `StepWatch`), or a block ran twice.
    """
    held = HeldBytes(module_keys(model))
    watch = StepWatch(blocks, caller)
    recorder = Recorder(blocks, clock, held, keep=keep, watch=watch)
    actions = [KEEP if keep else FULL] * len(blocks)
    application = Application(blocks, actions, held=None if keep else held, watcher=recorder)
    handle = model.register_forward_pre_hook(_root_hook(recorder, model), with_kwargs=True)
    application.install()
    collecting = gc.isenabled()
    gc.disable()  # a collection of the recorder's own garbage would land in the recorded step
    began = clock.mark()
    try:
        with (
            watch.watching(),
            _RecordingMode(recorder),
            _recording_hooks(recorder),
        ):
            step()
    except Exception as error:
        watch.failed(error)
        raise
    finally:
        ended = clock.mark()
        if collecting:
            gc.enable()
        application.remove()
        handle.remove()
    watch.check()
    clock.sync()
    recorder.step_seconds = clock.seconds(began, ended)
    recorder.resolve()
    if not keep:
        recorder.merge_remade()
    return recorder


def median(values: Sequence[float]) -> float:
    """The median of ``values``, 0 for none."""
    return float(statistics.median(values)) if values else 0.0
