"""Profiling one step: per op what it saves and what it costs, per block what it holds.

The step is run once by `recording` (see NOTE [Recording one step] there), and `summary`
turns what it saw into a `StepProfile` (see NOTE [Who holds a storage saved by several parts]).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from tensorhooks._core.errors import PlanArgumentTypeError, PlanArgumentValueError, PlanStateError

from .blocks import repeated_stacks, resolve_blocks
from .calibration import overheads
from .checks import check_model_state, untouched
from .profiles import BlockProfile, InputProfile, OpProfile, StepProfile
from .ranks import agreed, together
from .recording import Recorder, StepClock, device_of, measured_bandwidth, median, record
from .summary import candidates, summary

__all__ = [
    "BlockProfile",
    "InputProfile",
    "OpProfile",
    "StepProfile",
    "candidates",
    "check_step",
    "profile_step",
]


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


def _ran(
    model: nn.Module, named: list[tuple[str, nn.Module]], recorder: Recorder, *, default: bool
) -> None:
    """Check every block ran; of the default blocks, a whole stack that did not is left out.

    Raises:
        PlanStateError: if a block the caller passed did not run.
    """
    ran = set(recorder.order)
    idle: set[int] = set()
    if default and ran:
        ids = {id(module): index for index, (_, module) in enumerate(named)}
        for stack in repeated_stacks(model):
            members = [ids[id(member)] for member in stack if id(member) in ids]
            if not ran & set(members):
                idle.update(members)
    missing = [index for index in range(len(named)) if index not in ran and index not in idle]
    if missing:
        raise PlanStateError(
            f"profile_step: blocks {missing} did not run in the step; pass blocks=[...] with "
            "the modules the step's forward calls"
        )


def _medians(recorders: list[Recorder]) -> Recorder:
    """The first recorder, with each op's and block's times the medians over all of them."""
    first = recorders[0]
    if len(recorders) == 1:
        return first
    for index, ops in enumerate(first.ops):
        for at, op in enumerate(ops):
            op.seconds = median([r.ops[index][at].seconds for r in recorders])
    for name in ("forward_seconds", "backward_seconds", "function_seconds"):
        values = [getattr(r, name) for r in recorders]
        setattr(first, name, [median(column) for column in zip(*values, strict=True)])
    first.step_seconds = median([r.step_seconds for r in recorders])
    first.overhead_total = median([r.overhead_total for r in recorders])
    return first


def profile_step(
    model: nn.Module,
    step: Callable[[], object],
    *,
    blocks: Sequence[nn.Module] | None = None,
    rounds: int = 1,
    unplanned: bool = True,
    device: torch.device | str | None = None,
) -> StepProfile:
    """Profile one training step of ``model``: what each op of each block saves and costs.

    The step runs once (``rounds`` times if asked), watched and recorded: a dispatch mode times
    each op (the clock on a CPU, CUDA events on a GPU), counts its FLOPs and follows how each
    tensor's dimensions grow with the sizes of the step's inputs; saved-tensor hooks see what
    each block saves. The blocks run as they are (no plan), or, with ``unplanned=False``, every
    one checkpointed, so the step needs no more memory than full checkpointing. What
    checkpointing and a selective policy cost beyond the ops they run is measured once per
    process on a tiny stack, not on the step; on CUDA so is the pinned host↔device bandwidth.
    Blocks that run the same ops on the same shapes get the medians of their times, so that
    noise does not tell them apart. `plan_activations` takes the result, so several budgets can
    be planned from one profile. Under FSDP2
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
        rounds: recorded runs of the step; the op times are their medians.
        unplanned: record the step with the blocks as they are (its peak is then measured as
            ``unplanned_peak_bytes``); pass False when it does not fit in memory, and every
            block is checkpointed while it is recorded.
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
            cannot price), or changes a parameter in place, a block writes its input in place
            or is handed a cache it writes (a Hugging Face layer in eval mode), or the model's
            own gradient checkpointing is on (Hugging Face's ``gradient_checkpointing_enable()``)
            (a ``RuntimeError``).
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
        costs = overheads(where)
    with together(model, "profile_step"), untouched(model, "profile_step"):
        modules = [module for _, module in named]
        recorders = []
        for _ in range(rounds):
            recorders.append(record(model, modules, step, clock, keep=unplanned))
            _ran(model, named, recorders[-1], default=blocks is None)
            model.zero_grad(set_to_none=True)
        bandwidth = measured_bandwidth(where) if where.type == "cuda" else None
        profile = summary(
            _medians(recorders),
            [name for name, _ in named],
            overheads=costs,
            bandwidth=bandwidth,
            device=where,
        )
    return agreed(profile, model)
