"""The profiled step itself: the recorder, its dispatch mode, and the timed runs.

See NOTE [Profiling a step with every block recomputed] below.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tensorhooks._core.errors import PlanStateError
from tensorhooks._core.guards import is_output_of_saving_node
from tensorhooks._core.torch_compat import (
    OpOverload,
    TorchDispatchMode,
    current_autograd_node,
    current_graph_task_id,
    next_sequence_nr,
    op_schema,
    sequence_nr,
    storage_key,
)
from tensorhooks._hooks import saved_tensors_hooks

from .accounting import HeldBytes, Hold, holding_hooks, module_keys, storage_bytes
from .apply import FULL, KEEP, SAVE, Action, Application, OpKey, Watcher, tensors_in

__all__ = [
    "AGREED",
    "BEFORE",
    "BETWEEN",
    "Recorder",
    "StepClock",
    "Timings",
    "device_of",
    "grads_kept",
    "instrumented",
    "measured_bandwidth",
    "measured_peak",
    "median",
    "timed",
]

# NOTE [Profiling a step with every block recomputed]
#
# The profiled step runs with every block checkpointed (nothing cached), so profiling needs no
# more memory than full checkpointing: a model that only fits checkpointed can be planned. A
# dispatch mode times every op (the clock on a CPU, CUDA events on a GPU) and notes the storage
# of each fresh output (one that is not an input's storage) with the op that made it. What a
# kept block would save is what its recomputation keeps: a pair of hooks inside the
# recomputation sees each of those tensors (`Watcher.kept`), and the op that made its storage
# is the op whose output a policy could cache instead. What the blocks save in the forward pass
# is their region inputs; what the rest of the model saves is seen by a pair around the step.
#
# Ops are named by (operator, how many times it ran before in the block's function), the key
# the plan's policies use, so the numbering skips what checkpoint itself runs around the
# function. A storage is named by the op that made it (the count of ops so far), since the
# allocator reuses addresses. A storage saved by two parts of the step (a block and another, or
# the model outside the blocks) is held for the whole step by the cost model.
#
# Then the step is timed, interleaved over rounds: with every block recomputed (the anchor of
# every predicted step time, and each block's recomputation time), with a selective policy that
# caches nothing (what a policy's dispatch modes cost per op), and, unless asked not to, with no
# plan (what checkpointing costs a block beyond its recomputation).
#
# Every run of the step is paid for, so none is spent twice: the watched warm-up step also warms
# up the op times, the op times are read from the one instrumented run (each op under its own
# timer), the peak with every block recomputed is the instrumented run's own count of held bytes
# (its hooks hold what `measured_peak` holds), the run that measures the unplanned peak warms up
# the unplanned variant, and the rounds stop after two once every variant's two times agree within
# `AGREED` (the medians of more rounds would not move). Noise the rounds leave is smoothed across
# the blocks: blocks that run the same ops on the same shapes (a stack's layers) get the medians
# of their times, so they tie exactly and the solver's ties are broken by bytes, then block order.

BEFORE = -1  # the model's forward before the first block: held for the whole step
BETWEEN = -2  # outside the blocks, between the first and the last: held for the whole step
AGREED = 0.02  # the relative spread of a variant's times under which more rounds are not run


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
        # (storage name, storage bytes, tensor bytes) of each fresh output
        self.outputs: list[tuple[int, int, int]] = []


class _Saved:
    """A storage saved for backward somewhere in the step: its size and who saved it."""

    __slots__ = ("nbytes", "parts")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.parts: set[int] = set()


class Recorder(Watcher):
    """Everything the profiled step shows, gathered from the application and the mode."""

    wants_saves = True

    def __init__(self, count: int, clock: StepClock, held: HeldBytes) -> None:
        self.count = count
        self.clock = clock
        self.held = held
        self.block: int | None = None  # running its forward or recomputation
        self.in_function = False
        self.recomputing = False
        self.started = [False] * count
        self.ranges: list[tuple[int, int]] = [(0, 0)] * count
        self.ops: list[list[_Op]] = [[] for _ in range(count)]
        self.calls: list[dict[OpOverload, int]] = [{} for _ in range(count)]
        self.recomputed: list[dict[OpOverload, int]] = [{} for _ in range(count)]
        # The names of the storages each op made again in a recomputation, by op key.
        self.remade: list[dict[tuple[OpOverload, int], list[int]]] = [{} for _ in range(count)]
        self.kept_by: list[set[int]] = [set() for _ in range(count)]
        self.inputs_of: list[set[int]] = [set() for _ in range(count)]
        self.names: dict[int, int] = {}  # storage key -> name of the storage made there last
        self.serial = 0
        self.saved: dict[int, _Saved] = {}
        self.tensor_bytes: dict[int, int] = {}  # storage name -> bytes of the tensor saved
        self.mutated: set[int] = set()  # storages an in-place op may have written
        self.marks: list[tuple[int, bool, Any, Any]] = []  # (part, backward, start, end)
        self.forward_seconds: list[float] = []  # per block, then the part after the blocks
        self.backward_seconds: list[float] = []

    def resolve(self) -> None:
        """After the step (and a device sync): op times, and each part's forward and backward."""
        clock = self.clock
        for ops in self.ops:
            for record in ops:
                record.seconds = clock.seconds(record.start, record.end)
        self.forward_seconds = [0.0] * (self.count + 1)
        self.backward_seconds = [0.0] * (self.count + 1)
        for part, backward, start, end in self.marks:
            if 0 <= part <= self.count:
                sums = self.backward_seconds if backward else self.forward_seconds
                sums[part] += clock.seconds(start, end)
        self.marks = []

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
                    self.saved.setdefault(forward, saved).parts |= saved.parts

    # --- the application's side ---------------------------------------------------------

    @contextlib.contextmanager
    def forward(self, index: int) -> Iterator[None]:
        if self.started[index]:
            raise PlanStateError(
                f"profile_step: block {index} ran twice in one step; the planner plans one "
                "call of each block per step (run one micro-batch per step when profiling, or "
                "pass blocks=[...] that run once)"
            )
        self.started[index] = True
        start = next_sequence_nr()
        self.block = index
        try:
            yield
        finally:
            self.block = None
            self.ranges[index] = (start, next_sequence_nr())

    @contextlib.contextmanager
    def function(self, index: int) -> Iterator[None]:
        self.in_function = True
        try:
            yield
        finally:
            self.in_function = False

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

    # --- the mode's side ----------------------------------------------------------------

    def part(self) -> int:
        """The part of the step running forward now: a block, or before, between or after."""
        if self.block is not None:
            return self.block
        if not any(self.started):
            return BEFORE
        return self.count if all(self.started) else BETWEEN

    def part_of_node(self) -> int:
        """The part of the step whose forward made the node that backward is running."""
        node = current_autograd_node()
        if node is None:
            return BETWEEN
        number = sequence_nr(node)
        for index, (start, end) in enumerate(self.ranges):
            if start <= number < end:
                return index
        if self.ranges and number >= self.ranges[-1][1]:
            return self.count
        return BEFORE

    def op(
        self, func: OpOverload, args: Any, kwargs: Any, out: Any, *, start: Any, end: Any
    ) -> None:
        inputs = {storage_key(t) for t in tensors_in((args, kwargs), [])}
        fresh = [t for t in tensors_in(out, []) if storage_key(t) not in inputs]
        writes = op_schema(func).is_mutable
        alias = func.is_view or not fresh or writes
        if writes and not self.recomputing and current_graph_task_id() == -1:
            # A cached output that the forward pass then changes in place would be handed to
            # the recomputation changed (checkpoint raises): what an in-place op may write is
            # never cached. Every tensor argument counts, the written one among them.
            self.mutated.update(self.names[key] for key in inputs if key in self.names)
        if self.recomputing and self.block is not None:
            calls = self.recomputed[self.block]
            call = calls.get(func, 0)
            calls[func] = call + 1
            self.remade[self.block][func, call] = self._name_outputs(fresh)
            return
        if current_graph_task_id() != -1:
            self.marks.append((self.part_of_node(), True, start, end))
            self._name_outputs(fresh)
            return
        part = self.part()
        self.marks.append((part, False, start, end))
        if part < 0 or part >= self.count or not self.in_function:
            self._name_outputs(fresh)
            return
        calls = self.calls[part]
        call = calls.get(func, 0)
        calls[func] = call + 1
        record = _Op(func, call, start, end)
        record.alias = alias
        record.flops = _flops(func, args, kwargs, out)
        names = self._name_outputs(fresh)
        record.outputs = [
            (name, storage_bytes(t), t.numel() * t.element_size())
            for name, t in zip(names, fresh, strict=True)
        ]
        self.ops[part].append(record)

    def _name_outputs(self, fresh: list[torch.Tensor]) -> list[int]:
        names = []
        for tensor in fresh:
            key = storage_key(tensor)
            self.serial += 1
            if key is not None:
                self.names[key] = self.serial
            names.append(self.serial)
        return names

    def _name(self, tensor: torch.Tensor) -> int:
        key = storage_key(tensor)
        if key is None:
            return 0
        return self.names.get(key, -key)  # made before the step: named by its address

    # --- saves outside the recomputations -------------------------------------------------

    def _saved_by(self, part: int, tensor: torch.Tensor) -> bool:
        """Note that ``part`` saves ``tensor``; False for the model's parameters and buffers."""
        key = storage_key(tensor)
        if key is None or key in self.held.excluded:
            return False
        saved = self.saved.setdefault(self._name(tensor), _Saved(storage_bytes(tensor)))
        saved.parts.add(part)
        return True

    def pack(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Hold | None]:
        """The pair around the step: a forward save outside recomputations."""
        kept = tensor.detach() if is_output_of_saving_node(tensor) else tensor
        hold = self.held.hold(tensor)
        if current_graph_task_id() == -1:
            part = self.part()
            if self._saved_by(part, tensor) and 0 <= part < self.count:
                name = self._name(tensor)
                self.inputs_of[part].add(name)
                size = tensor.numel() * tensor.element_size()
                self.tensor_bytes[name] = max(size, self.tensor_bytes.get(name, 0))
        return kept, hold


def _flops(func: OpOverload, args: Any, kwargs: Any, out: Any) -> int:
    # Imported here: only profiling needs it, and `import tensorhooks` stays lighter without.
    from torch.utils.flop_counter import flop_registry  # noqa: PLC0415

    formula = flop_registry.get(func.overloadpacket)
    if formula is None:
        return 0
    try:
        return int(formula(*args, **kwargs, out_val=out))
    except Exception:  # a formula that does not fit this overload: no count
        return 0


class _ProfileMode(TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped base
    """Times every op and hands it to the recorder."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's __init__ is untyped
        self.recorder = recorder

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = {} if kwargs is None else kwargs
        clock = self.recorder.clock
        start = clock.mark()
        out = func(*args, **kwargs)
        end = clock.mark()
        self.recorder.op(func, args, kwargs, out, start=start, end=end)
        return out


class _Timer(Watcher):
    """Wall time of each block's recomputation, per step."""

    def __init__(self, count: int, clock: StepClock) -> None:
        self.clock = clock
        self.marks: list[tuple[int, Any, Any]] = []
        self.count = count

    @contextlib.contextmanager
    def recompute(self, index: int) -> Iterator[None]:
        start = self.clock.mark()
        try:
            yield
        finally:
            self.marks.append((index, start, self.clock.mark()))

    def per_block(self) -> list[float]:
        seconds = [0.0] * self.count
        for index, start, end in self.marks:
            seconds[index] += self.clock.seconds(start, end)
        self.marks = []
        return seconds


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


def instrumented(
    model: nn.Module, blocks: list[nn.Module], step: Callable[[], object], clock: StepClock
) -> Recorder:
    """Run ``step`` once, every block recomputed, under the recorder and its dispatch mode."""
    held = HeldBytes(module_keys(model))
    recorder = Recorder(len(blocks), clock, held)
    application = Application(blocks, [FULL] * len(blocks), held=held, watcher=recorder)
    application.install()
    try:
        with _ProfileMode(recorder), saved_tensors_hooks(recorder.pack, _unpack_first):
            step()
    finally:
        application.remove()
    clock.sync()
    recorder.resolve()
    missing = [index for index, started in enumerate(recorder.started) if not started]
    if missing:
        raise PlanStateError(
            f"profile_step: blocks {missing} did not run in the step; pass blocks=[...] with "
            "the modules the step's forward calls"
        )
    return recorder


@dataclass
class Timings:
    checkpointed: list[float]
    policy: list[float]
    unplanned: list[float]
    cached: list[float]
    recompute: list[list[float]]  # per round, per block
    checkpointed_peak: int
    unplanned_peak: int | None


def measured_peak(
    model: nn.Module, blocks: list[nn.Module], actions: list[Action], step: Callable[[], object]
) -> int:
    held = HeldBytes(module_keys(model))
    application = Application(blocks, actions, held=held)
    application.install()
    try:
        with holding_hooks(held):
            step()
    finally:
        application.remove()
    return held.peak[0]


def timed(
    model: nn.Module,
    blocks: list[nn.Module],
    step: Callable[[], object],
    clock: StepClock,
    *,
    rounds: int,
    unplanned: bool,
    candidates: list[list[OpKey]],
    checkpointed_peak: int,
) -> Timings:
    """Time the step interleaved: every block recomputed, a policy caching nothing, no plan.

    With ``unplanned``, also a policy that saves every candidate op (it holds about what no
    plan holds): what caching an op costs, beyond the time its recomputation takes. At most
    ``rounds`` rounds, two when every variant's two times agree within `AGREED`; no warm-up
    round (the steps run before warmed them up). ``checkpointed_peak`` is the peak with every
    block recomputed, as the instrumented run measured it.
    """
    count = len(blocks)
    timer = _Timer(count, clock)
    variants: dict[str, Application | None] = {
        "checkpointed": Application(blocks, [FULL] * count, watcher=timer),
        "policy": Application(blocks, [Action(checkpoint=True, selective=True)] * count),
    }
    if unplanned:
        variants["unplanned"] = None
        every = [
            Action(checkpoint=True, cached=dict.fromkeys(keys, SAVE), selective=True)
            for keys in candidates
        ]
        variants["cached"] = Application(blocks, every)
    unplanned_peak = measured_peak(model, blocks, [KEEP] * count, step) if unplanned else None
    samples: dict[str, list[float]] = {name: [] for name in variants}
    recompute: list[list[float]] = []
    names = list(variants)
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(_time_once(variants[name], step, clock))
            if name == "checkpointed":
                recompute.append(timer.per_block())
        if index == 1 and all(_agreed(times) for times in samples.values()):
            break
    return Timings(
        samples["checkpointed"],
        samples["policy"],
        samples.get("unplanned", []),
        samples.get("cached", []),
        recompute,
        checkpointed_peak,
        unplanned_peak,
    )


def _agreed(times: Sequence[float]) -> bool:
    """Whether ``times`` differ by at most `AGREED` of the least."""
    return max(times) - min(times) <= AGREED * min(times)


def _time_once(
    application: Application | None, step: Callable[[], object], clock: StepClock
) -> float:
    if application is not None:
        application.install()
    try:
        return clock.time(step)
    finally:
        if application is not None:
            application.remove()


def median(values: Sequence[float]) -> float:
    """The median of ``values``, 0 for none."""
    return float(statistics.median(values)) if values else 0.0
