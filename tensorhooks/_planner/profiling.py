"""Profiling one step: per op what it saves and what it costs, per block what it holds.

The step itself is run by `recording`, see
NOTE [Profiling a step with every block recomputed] there; this module turns what it saw into a
`StepProfile`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tensorhooks._core.errors import PlanArgumentTypeError, PlanArgumentValueError
from tensorhooks._core.torch_compat import OpOverload

from .apply import FULL, Application
from .blocks import repeated_stacks, resolve_blocks
from .checks import StepWatch, check_model_state, untouched
from .ranks import agreed, together
from .recording import (
    BEFORE,
    BETWEEN,
    Recorder,
    StepClock,
    Timings,
    device_of,
    instrumented,
    measured_bandwidth,
    median,
    timed,
)

__all__ = [
    "BlockProfile",
    "InputProfile",
    "OpProfile",
    "StepProfile",
    "candidates",
    "check_step",
    "profile_step",
]


@dataclass(frozen=True)
class OpProfile:
    """One op of a block's forward, as profiled.

    Attributes:
        op: the operator.
        call: how many times ``op`` ran before in the block's forward (with ``op``, the key a
            plan's policy knows it by).
        seconds: the op's own time in the forward pass.
        flops: its floating-point operations, where torch has a formula (matmuls, attention,
            convolutions), else 0.
        saved_bytes: bytes of its outputs that the block saves for backward when kept.
        other_bytes: bytes of its outputs that nothing saves for backward.
        smallest_output: bytes of its smallest output tensor (tiny tensors are never offloaded).
        recomputed: whether a recomputation of the block runs it (the ops after the last save
            never run again).
        cacheable: whether a policy may keep its output: a real op (not a view, not writing into
            an input) whose outputs no other part of the step saves and no in-place op changes.
    """

    op: OpOverload
    call: int
    seconds: float
    flops: int
    saved_bytes: int
    other_bytes: int
    smallest_output: int
    recomputed: bool
    cacheable: bool


@dataclass(frozen=True)
class InputProfile:
    """One input a checkpoint of a block keeps.

    Attributes:
        nbytes: bytes of its storage.
        tensor_bytes: bytes of the tensor itself (what offloading it copies, and what the
            tiny-tensor rule looks at).
        saved: whether the block's own ops save it too when the block is kept.
    """

    nbytes: int
    tensor_bytes: int
    saved: bool


@dataclass(frozen=True)
class BlockProfile:
    """One block, as profiled.

    Attributes:
        name: the block's qualified name in the model.
        ops: the ops of its forward, in order.
        inputs: the inputs a checkpoint of it keeps.
        input_bytes: bytes of its inputs that a checkpoint of it keeps (not the model's
            parameters or buffers, nor tensors that other parts of the step save too).
        saved_bytes: bytes its forward saves for backward when it is kept.
        saved_and_input_bytes: bytes of those two sets together (the input is often saved).
        forward_seconds: op time of its forward pass.
        backward_seconds: op time of its backward pass, recomputation left out.
        recompute_seconds: wall time of its recomputation (median over the timed rounds).
        forward_ops: ops its forward runs (each pays a selective policy's dispatch).
        recompute_ops: ops its recomputation runs.
    """

    name: str
    ops: tuple[OpProfile, ...]
    inputs: tuple[InputProfile, ...]
    input_bytes: int
    saved_bytes: int
    saved_and_input_bytes: int
    forward_seconds: float
    backward_seconds: float
    recompute_seconds: float
    forward_ops: int
    recompute_ops: int


@dataclass(frozen=True)
class StepProfile:
    """What one profiled step says about a model's blocks: the inputs of the cost model.

    Made by `profile_step`; every figure can be replaced (``dataclasses.replace``) to plan for
    another machine, such as ``bandwidth`` of a GPU's host link on a CPU-only one.

    Attributes:
        blocks: one `BlockProfile` per block, in forward order.
        device: the device the step ran on (``"cpu"``, ``"cuda:0"``).
        fixed_bytes: bytes saved for backward that the plan does not change and that are held
            the whole step: saved outside the blocks before the last one ends (embeddings), or
            saved by more than one part of the step.
        after_bytes: bytes saved after the last block (final norm, head, loss), released
            before the blocks' backward starts.
        after_forward_seconds: op time of the forward after the last block.
        after_backward_seconds: op time of the backward of that part.
        checkpointed_step_seconds: the step with every block recomputed (median): predicted
            step times are this, plus or minus what each block's choice changes.
        unplanned_step_seconds: the step with no plan (median), or None if it was not timed.
        checkpoint_overhead_seconds: what checkpointing a block costs beyond its recomputation
            (hooks, RNG state), per block; 0 when the unplanned step was not timed.
        policy_op_seconds: what a selective policy costs per op it sees, forward and
            recomputation.
        cached_op_seconds: what a policy costs per op whose output it caches (the entry in
            the forward pass, handing it back in recomputation), beyond that op's own time
            saved; 0 when the unplanned step was not timed (caching every op is timed with it).
        bandwidth: host↔device bytes per second of pinned copies (the slower direction),
            measured on CUDA; None on a CPU, where there is no link.
        checkpointed_peak_bytes: the measured peak of the profiled step (every block
            recomputed), device bytes held for backward.
        unplanned_peak_bytes: the measured peak with no plan, or None if not run.
    """

    blocks: tuple[BlockProfile, ...]
    device: str
    fixed_bytes: int
    after_bytes: int
    after_forward_seconds: float
    after_backward_seconds: float
    checkpointed_step_seconds: float
    unplanned_step_seconds: float | None
    checkpoint_overhead_seconds: float
    policy_op_seconds: float
    cached_op_seconds: float
    bandwidth: float | None
    checkpointed_peak_bytes: int
    unplanned_peak_bytes: int | None

    def __post_init__(self) -> None:
        """Check the figures a caller may have replaced (``dataclasses.replace``)."""
        if self.bandwidth is not None and (
            isinstance(self.bandwidth, bool)
            or not isinstance(self.bandwidth, (int, float))
            or not self.bandwidth > 0
        ):
            raise PlanArgumentValueError(
                f"StepProfile: bandwidth must be a positive number of bytes per second, or None "
                f"for no host link, got {self.bandwidth!r}"
            )
        for name in _SECONDS_AND_BYTES:
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, (int, float)) and math.isfinite(value) and value >= 0
            ):
                raise PlanArgumentValueError(
                    f"StepProfile: {name} must be a finite number >= 0, got {value!r}"
                )


_SECONDS_AND_BYTES = (
    "fixed_bytes",
    "after_bytes",
    "after_forward_seconds",
    "after_backward_seconds",
    "checkpointed_step_seconds",
    "unplanned_step_seconds",
    "checkpoint_overhead_seconds",
    "policy_op_seconds",
    "cached_op_seconds",
    "checkpointed_peak_bytes",
    "unplanned_peak_bytes",
)


def _block_profile(
    recorder: Recorder, index: int, name: str, shared: set[int], recompute_seconds: float
) -> BlockProfile:
    saved = recorder.saved
    kept = {item for item in recorder.kept_by[index] if item not in shared}
    inputs = {item for item in recorder.inputs_of[index] if item not in shared}
    recomputed = recorder.recomputed[index]
    ops = []
    for record in recorder.ops[index]:
        in_block, unsaved = [], []
        elsewhere = any(item in recorder.mutated for item, _, _ in record.outputs)
        for item, nbytes, _ in record.outputs:
            if item in kept:
                in_block.append(nbytes)
            elif item in saved:
                elsewhere = True  # saved by another part too (shared), or only by another
            else:
                unsaved.append(nbytes)
        again = record.call < recomputed.get(record.op, 0)
        ops.append(
            OpProfile(
                op=record.op,
                call=record.call,
                seconds=record.seconds,
                flops=record.flops,
                saved_bytes=sum(in_block),
                other_bytes=sum(unsaved),
                smallest_output=min((size for _, _, size in record.outputs), default=0),
                recomputed=again,
                cacheable=again and not record.alias and not elsewhere and bool(record.outputs),
            )
        )
    return BlockProfile(
        name=name,
        ops=tuple(ops),
        inputs=tuple(
            InputProfile(saved[item].nbytes, recorder.tensor_bytes[item], item in kept)
            for item in sorted(inputs)
        ),
        input_bytes=sum(saved[item].nbytes for item in inputs),
        saved_bytes=sum(saved[item].nbytes for item in kept),
        saved_and_input_bytes=sum(saved[item].nbytes for item in kept | inputs),
        forward_seconds=recorder.forward_seconds[index],
        backward_seconds=recorder.backward_seconds[index],
        recompute_seconds=recompute_seconds,
        forward_ops=len(recorder.ops[index]),
        recompute_ops=sum(recomputed.values()),
    )


def _shared(recorder: Recorder) -> set[int]:
    """Storages held the whole step: saved outside the blocks before the last, or twice."""
    return {
        item
        for item, record in recorder.saved.items()
        if len(record.parts) > 1 or record.parts & {BEFORE, BETWEEN}
    }


def _blocks(recorder: Recorder, names: list[str]) -> tuple[BlockProfile, ...]:
    """The blocks as the instrumented step saw them (recomputation not timed yet)."""
    recorder.merge_remade()
    shared = _shared(recorder)
    return tuple(
        _block_profile(recorder, index, name, shared, 0.0) for index, name in enumerate(names)
    )


def candidates(blocks: Sequence[BlockProfile]) -> list[list[tuple[OpOverload, int]]]:
    """Each block's ops a plan may cache: cacheable, and taking time to recompute."""
    return [
        [(op.op, op.call) for op in block.ops if op.cacheable and op.seconds > 0]
        for block in blocks
    ]


def _alike_smoothed(blocks: tuple[BlockProfile, ...]) -> tuple[BlockProfile, ...]:
    """``blocks``, each block's times the medians over the blocks alike to it.

    Blocks are alike when they run the same ops, with the same FLOPs and output bytes, in the
    same order (a stack's layers on the same shapes): what tells their times apart is noise, and
    a plan that flipped on it would not be stable. Bytes are left as they were.
    """
    alike: dict[tuple[object, ...], list[int]] = {}
    for index, block in enumerate(blocks):
        shape = tuple(
            (op.op, op.call, op.flops, op.saved_bytes, op.other_bytes, op.recomputed)
            for op in block.ops
        )
        alike.setdefault((shape, block.recompute_ops), []).append(index)
    smoothed = list(blocks)
    for members in alike.values():
        if len(members) < 2:
            continue
        group = [blocks[index] for index in members]
        ops = tuple(
            dataclasses.replace(op, seconds=median([block.ops[at].seconds for block in group]))
            for at, op in enumerate(group[0].ops)
        )
        forward = median([block.forward_seconds for block in group])
        backward = median([block.backward_seconds for block in group])
        recompute = median([block.recompute_seconds for block in group])
        for index in members:
            smoothed[index] = dataclasses.replace(
                blocks[index],
                ops=tuple(
                    dataclasses.replace(mine, seconds=theirs.seconds)
                    for mine, theirs in zip(blocks[index].ops, ops, strict=True)
                ),
                forward_seconds=forward,
                backward_seconds=backward,
                recompute_seconds=recompute,
            )
    return tuple(smoothed)


def _summary(
    blocks: tuple[BlockProfile, ...],
    recorder: Recorder,
    timings: Timings,
    bandwidth: float | None,
    device: torch.device,
) -> StepProfile:
    count = len(blocks)
    shared = _shared(recorder)
    after = {item for item, record in recorder.saved.items() if record.parts == {count}}
    recompute = [median([row[index] for row in timings.recompute]) for index in range(count)]
    blocks = _alike_smoothed(
        tuple(
            dataclasses.replace(block, recompute_seconds=seconds)
            for block, seconds in zip(blocks, recompute, strict=True)
        )
    )
    checkpointed = median(timings.checkpointed)
    unplanned = median(timings.unplanned) if timings.unplanned else None
    overhead = 0.0
    if unplanned is not None:
        overhead = max(0.0, (checkpointed - unplanned - sum(recompute)) / count)
    ops = sum(block.forward_ops + block.recompute_ops for block in blocks)
    policy = [
        (with_policy - without) / max(ops, 1)
        for with_policy, without in zip(timings.policy, timings.checkpointed, strict=True)
    ]
    cached = candidates(blocks)
    count_cached = sum(len(keys) for keys in cached)
    recompute_cached = sum(
        op.seconds for block in blocks for op in block.ops if op.cacheable and op.seconds > 0
    )
    per_cached = [
        (with_cache - without + recompute_cached) / max(count_cached, 1)
        for with_cache, without in zip(timings.cached, timings.policy, strict=False)
    ]
    return StepProfile(
        blocks=blocks,
        device=str(device),
        fixed_bytes=sum(recorder.saved[item].nbytes for item in shared),
        after_bytes=sum(recorder.saved[item].nbytes for item in after),
        after_forward_seconds=recorder.forward_seconds[count],
        after_backward_seconds=recorder.backward_seconds[count],
        checkpointed_step_seconds=checkpointed,
        unplanned_step_seconds=unplanned,
        checkpoint_overhead_seconds=overhead,
        policy_op_seconds=max(0.0, median(policy)),
        cached_op_seconds=max(0.0, median(per_cached)),
        bandwidth=bandwidth,
        checkpointed_peak_bytes=timings.checkpointed_peak,
        unplanned_peak_bytes=timings.unplanned_peak,
    )


def check_step(step: object, caller: str) -> Callable[[], object]:
    """``step``, checked to be callable.

    Raises:
        PlanArgumentTypeError: if it is not.
    """
    if not callable(step):
        raise PlanArgumentTypeError(
            f"{caller}: step must be a function that runs one forward and backward, got "
            f"{step!r} of type {type(step).__name__}"
        )
    return step


def _in_run_order(
    model: nn.Module,
    named: list[tuple[str, nn.Module]],
    step: Callable[[], object],
    *,
    default: bool,
) -> list[tuple[str, nn.Module]]:
    """``named`` in the order the step runs them, from one warm-up step (every block recomputed).

    The cost model takes the blocks in forward order (backward runs them last to first). Of the
    default blocks, a whole stack the step never runs is left out (a decoder in an encoder-only
    step); blocks passed by the caller that do not run are refused by the profiled step.
    """
    modules = [module for _, module in named]
    watch = StepWatch(modules, "profile_step")
    application = Application(modules, [FULL] * len(modules), caller="profile_step")
    application.install()
    try:
        watch.run(step)  # also warms up the op times
    finally:
        application.remove()
    ran = [named[index] for index in watch.run_order()]
    ran_ids = {id(module) for _, module in ran}
    if default and ran:
        idle = [stack for stack in repeated_stacks(model) if not ran_ids & set(map(id, stack))]
        left_out = {id(member) for stack in idle for member in stack}
        named = [pair for pair in named if id(pair[1]) not in left_out]
    return ran + [pair for pair in named if id(pair[1]) not in ran_ids]


def profile_step(
    model: nn.Module,
    step: Callable[[], object],
    *,
    blocks: Sequence[nn.Module] | None = None,
    rounds: int = 3,
    unplanned: bool = True,
    device: torch.device | str | None = None,
) -> StepProfile:
    """Profile one training step of ``model``: what each op of each block saves and costs.

    After one watched warm-up step, the step runs once with every block checkpointed under a
    dispatch mode that times each op (the clock on a CPU, CUDA events on a GPU) and counts its
    FLOPs, with saved-tensor hooks that see what each block's recomputation keeps for backward;
    then it is timed over up to ``rounds`` interleaved rounds with every block recomputed, with
    a policy that caches nothing (what a policy's dispatch costs), and with no plan (unless
    ``unplanned=False``): ``4 * rounds + 3`` runs of the step at most, 11 when the first two
    rounds agree. Blocks that run the same ops on the same shapes get the medians of their
    times, so that noise does not tell them apart. On
    CUDA the pinned host↔device bandwidth is measured once per process. `plan_activations`
    takes the result, so several budgets can be planned from one profile. Under FSDP2
    (``fully_shard``) every rank of the model's mesh must call it: the ranks agree on one
    profile, each figure its worst case over them, so they all plan alike (see
    docs/planner.md, "Under FSDP2").

    Example:
        >>> import torch, tensorhooks
        >>> layer = lambda: torch.nn.Sequential(
        ...     torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
        >>> model = torch.nn.Sequential(*(layer() for _ in range(3)))
        >>> x = torch.randn(8, 16)
        >>> profile = tensorhooks.profile_step(model, lambda: model(x).sum().backward())
        >>> [block.name for block in profile.blocks]
        ['0', '1', '2']
        >>> profile.blocks[1].saved_bytes   # its input (8 x 16 floats) and two 8 x 64 tensors
        4608

    Args:
        model: the model the step trains.
        step: runs one forward and backward the way training does (no optimizer step: it is
            called several times), with the same shapes. The parameters' ``.grad``, the
            model's buffers (BatchNorm's running statistics) and the RNG states are put back as
            they were after the profiled steps.
        blocks: the modules to plan, each run once per step; default: the layers of every
            stack of repeated layers (``model.model.layers`` of a Hugging Face model, both
            stacks of T5), less a stack the step does not run. The profile lists them in the
            order the step runs them.
        rounds: at most this many timed rounds of each variant; two when every variant's two
            times agree within 2%.
        unplanned: also time (and measure) the step with no plan; pass False when it does not
            fit in memory, and the cost of checkpointing a block beyond its recomputation is
            then taken as 0.
        device: the device the step computes on; default: CUDA if a parameter or buffer is
            there, else the CPU.

    Returns:
        The `StepProfile`.

    Raises:
        PlanArgumentTypeError: if ``model`` is not an ``nn.Module``, a block is not one, or
            ``step`` is not callable (a ``TypeError``).
        PlanArgumentValueError: if ``rounds`` is not a positive int, or the blocks are not
            distinct submodules of the model (a ``ValueError``).
        PlanStateError: if a block runs twice in the step or not at all, the step runs no
            backward, records a graph in backward (``create_graph=True``, which the cost model
            cannot price), or changes a parameter in place, or the model's own gradient
            checkpointing is on (Hugging Face's ``gradient_checkpointing_enable()``) (a
            ``RuntimeError``).
    """
    with together(model, "profile_step"):  # no collective runs here
        named = resolve_blocks(model, blocks, "profile_step")
        check_step(step, "profile_step")
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise PlanArgumentValueError(
                f"profile_step: rounds must be an int >= 1, got {rounds!r}"
            )
        check_model_state(model, "profile_step")
        where = device_of(model, device)
        clock = StepClock(where)
    with together(model, "profile_step"), untouched(model, "profile_step"):
        named = _in_run_order(model, named, step, default=blocks is None)
        modules = [module for _, module in named]
        recorder = instrumented(model, modules, step, clock)
        profiled = _blocks(recorder, [name for name, _ in named])
        timings = timed(
            model,
            modules,
            step,
            clock,
            rounds=rounds,
            unplanned=unplanned,
            candidates=candidates(profiled),
            checkpointed_peak=recorder.held.peak[0],
        )
        bandwidth = measured_bandwidth(where) if where.type == "cuda" else None
        summary = _summary(profiled, recorder, timings, bandwidth, where)
    return agreed(summary, model)
