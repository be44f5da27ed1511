"""The cost model: what a block's choice holds on the device and host, and what it costs in time.

See NOTE [The cost model of a plan] below.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .apply import OpKey
from .profiles import BlockProfile, StepProfile

__all__ = [
    "NOISE",
    "OFFLOAD",
    "RECOMPUTE",
    "SAVE",
    "BlockCosts",
    "Choice",
    "CostTable",
    "OpCost",
    "Outcome",
    "choice_outcome",
    "cost_table",
    "exposed_seconds",
    "plan_peak",
    "plan_seconds",
]

# NOTE [The cost model of a plan]
#
# Bytes. A block's choice holds ``device`` bytes from its forward until its backward starts (what
# a kept block saves; under checkpoint, its inputs and the outputs its policy saves) and, during
# its own backward, ``backward`` bytes: a checkpointed block holds then what a kept one would
# (what its recomputation keeps until backward uses it) and its inputs. The outputs its policy
# saved are consumed by the recomputation (as torch's checkpoint consumes them), so those that
# no op of the block saves stop counting there. ``host`` bytes are offloaded.
# Saves outside the blocks are ``fixed`` (before the blocks, or shared: held the whole step) or
# ``after`` (the head and the loss: released before the blocks' backward). Backward runs the
# blocks last to first, so the peak is the larger of the end of the forward pass and the
# backward of each block j:
#
#     peak = max(fixed + sum(device) + after,  max_j fixed + sum(device[i] for i < j) + backward[j])
#
# What the model saves between a block and the next (``following``) is held from there until
# the block's own backward starts: it adds to the block's ``device`` bytes whatever it chooses,
# and not to its ``backward`` ones. A storage several parts save counts once, at the first (see
# NOTE [Who holds a storage saved by several parts] in `summary`).
#
# Time. Every predicted step is the profiled step with every block recomputed, plus each
# block's change: keeping a block saves its recomputation and checkpoint's own overhead; a policy
# costs its dispatch modes per op, and saves the time of each op it caches (a cached op does not
# run again; every other op up to the last save does) less what caching costs per op
# (``cached_op_seconds``: an op cheaper than that to recompute is not worth caching for time);
# an offload costs what the copies do not hide. A block's copies go out during the next block's
# forward and come back during the next block's backward (its prefetch), so each direction
# hides behind that block's op time (the head's, for the last block):
# ``max(0, bytes / bandwidth - window)`` per direction. The last block, whose windows are short,
# keeps its activations unless memory is scarcer than time.
#
# Noise. A profile's times are one recorded step's, so two profiles of the same step differ by
# noise, and a plan that followed every difference would change from profile to profile. Every
# time a choice saves is rounded down, and every time it costs rounded up, to a grain of `NOISE`
# of a block's share of the step: a choice whose gain is below the grain is not worth it (an op
# whose recomputation takes less is recomputed), and choices whose gains differ by less tie
# more often, where ties go to the plan that holds less, then to block order. So the simpler
# plan wins within the noise. The solver stays exact over the rounded times, so a larger budget
# still never predicts a slower step.
#
# Which ops of a block are candidates: real ops (not views, not writes into an input) that run
# again in a recomputation and whose outputs no other part of the step saves. Without a link
# (``bandwidth=None``, a CPU) nothing is offloaded; tensors below ``min_offload_bytes`` never
# are.

RECOMPUTE = 0
SAVE = 1
OFFLOAD = 2
NOISE = 0.05
"""The grain of a plan's times, as a fraction of a block's share of the step (see NOTE above)."""


@dataclass(frozen=True)
class OpCost:
    """A candidate op of a block: what caching its output holds, and the time it saves."""

    saved_bytes: int
    """Bytes of its outputs that the block saves anyway (held during the block's backward)."""
    other_bytes: int
    """Bytes of its outputs that nothing saves (held only if the policy keeps them)."""
    seconds: float
    """Time caching it saves: its recomputation, less what caching an op costs a policy."""
    offloadable: bool
    """Whether it may be offloaded (a link exists, and no output is tiny)."""


@dataclass(frozen=True)
class BlockCosts:
    """What each choice of one block costs is made from these."""

    ops: tuple[OpCost, ...]
    saved_bytes: int
    """Bytes the block saves when kept."""
    input_bytes: int
    """Bytes of the inputs a checkpoint of it keeps."""
    input_unsaved_bytes: int
    """Bytes of those inputs that the block's ops do not save too."""
    offloadable_input_bytes: int
    """Bytes of the inputs that offloading them moves (not tiny); 0 without a link."""
    offloadable_input_unsaved_bytes: int
    """The part of those that the block's ops do not save too."""
    keep_seconds: float
    """Time keeping the block changes (negative: its recomputation and overhead are saved)."""
    policy_seconds: float
    """Time a selective policy's dispatch costs the block (forward and recomputation)."""
    forward_window: float
    """Op time that hides the block's copies to the host (the next block's forward)."""
    backward_window: float
    """Op time that hides the copies back (the next block's backward)."""
    following_bytes: int = 0
    """Bytes saved after the block and before the next, held until its backward, any choice."""


@dataclass(frozen=True)
class CostTable:
    """Every block's costs, and what the rest of the step holds."""

    blocks: tuple[BlockCosts, ...]
    fixed_bytes: int
    after_bytes: int
    base_seconds: float
    """The step with every block recomputed."""
    bandwidth: float | None
    """Host↔device bytes per second; None: nothing can be offloaded."""


@dataclass(frozen=True)
class Choice:
    """One block's choice: kept, or checkpointed with a policy.

    ``ops`` has one entry per candidate op: `RECOMPUTE`, `SAVE` or `OFFLOAD`; ``offload_input``
    sends the block's inputs to host memory.
    """

    keep: bool
    ops: tuple[int, ...] = ()
    offload_input: bool = False


KEEP = Choice(keep=True)


@dataclass(frozen=True)
class Outcome:
    """What a block's choice holds and what it changes in time (see NOTE [The cost model])."""

    device: int
    backward: int
    host: int
    seconds: float


TICK = 2.0**-30
"""The grain of an outcome's seconds (about a nanosecond). On that grain a plan's seconds add
exactly in any order, so plans that differ only in which of some alike blocks they keep tie
exactly, and the solver's tie-break (least bytes, then block order) picks among them, rather
than the last bits of a float sum that the profile's noise moves."""


def ticked(seconds: float) -> float:
    """``seconds`` on the grain of `TICK`."""
    return round(seconds / TICK) * TICK


def _down(seconds: float, grain: float) -> float:
    """``seconds`` rounded down to the grain (see NOTE [The cost model of a plan], "Noise")."""
    return math.floor(seconds / grain) * grain if seconds > 0 else 0.0


def _up(seconds: float, grain: float) -> float:
    """``seconds`` rounded up to the grain."""
    return math.ceil(seconds / grain) * grain if seconds > 0 else 0.0


def exposed_seconds(block: BlockCosts, offloaded: int, bandwidth: float | None) -> float:
    """Copy time of ``offloaded`` bytes that the block's windows do not hide, both directions."""
    if offloaded == 0 or bandwidth is None:
        return 0.0
    copy = offloaded / bandwidth
    return max(0.0, copy - block.forward_window) + max(0.0, copy - block.backward_window)


def choice_outcome(block: BlockCosts, choice: Choice, bandwidth: float | None) -> Outcome:
    """What ``choice`` holds and costs for ``block``."""
    if choice.keep:
        return Outcome(
            block.saved_bytes + block.following_bytes,
            block.saved_bytes,
            0,
            ticked(block.keep_seconds),
        )
    device = block.input_bytes + block.following_bytes
    backward = block.saved_bytes + block.input_unsaved_bytes
    host = 0
    if choice.offload_input:
        device -= block.offloadable_input_bytes
        backward -= block.offloadable_input_unsaved_bytes
        host += block.offloadable_input_bytes
    saved = 0.0
    for op, what in zip(block.ops, choice.ops, strict=True):
        if what == SAVE:
            # Held until the recomputation consumes it; then only what the block saves stays.
            device += op.saved_bytes + op.other_bytes
            saved += op.seconds
        elif what == OFFLOAD:
            host += op.saved_bytes + op.other_bytes
            saved += op.seconds
    seconds = (block.policy_seconds if any(choice.ops) else 0.0) - saved
    seconds += exposed_seconds(block, host, bandwidth)
    return Outcome(device, backward, host, ticked(seconds))


def plan_peak(table: CostTable, outcomes: Sequence[Outcome]) -> int:
    """The predicted peak of device bytes held for backward (see NOTE [The cost model])."""
    held = table.fixed_bytes
    peak = 0
    for outcome in outcomes:
        peak = max(peak, held + outcome.backward)
        held += outcome.device
    return max(peak, held + table.after_bytes)


def plan_seconds(table: CostTable, outcomes: Sequence[Outcome]) -> float:
    """The predicted step time."""
    change = 0.0
    for outcome in outcomes:
        change += outcome.seconds
    return table.base_seconds + change


def _input_parts(block: BlockProfile, threshold: int) -> tuple[int, int]:
    # An input other parts save too stays on the device for them: offloading it frees nothing.
    moved = [item for item in block.inputs if item.tensor_bytes >= threshold and not item.shared]
    return (
        sum(item.nbytes for item in moved),
        sum(item.nbytes for item in moved if not item.saved),
    )


def cost_table(
    profile: StepProfile, bandwidth: float | None, min_offload_bytes: int
) -> tuple[CostTable, list[list[OpKey]]]:
    """The cost table of ``profile``, and each block's candidate ops by key, in table order."""
    blocks = []
    keys: list[list[OpKey]] = []
    count = len(profile.blocks)
    grain = max(TICK, NOISE * profile.checkpointed_step_seconds / max(count, 1))
    for index, block in enumerate(profile.blocks):
        following = profile.blocks[index + 1] if index + 1 < count else None
        forward_window = following.forward_seconds if following else profile.after_forward_seconds
        backward_window = (
            following.backward_seconds if following else profile.after_backward_seconds
        )
        candidates = [op for op in block.ops if op.cacheable and op.seconds > 0]
        keys.append([(op.op, op.call) for op in candidates])
        offload_in, offload_in_unsaved = (0, 0)
        if bandwidth is not None:
            offload_in, offload_in_unsaved = _input_parts(block, min_offload_bytes)
        blocks.append(
            BlockCosts(
                ops=tuple(
                    OpCost(
                        saved_bytes=op.saved_bytes,
                        other_bytes=op.other_bytes,
                        seconds=_down(op.seconds - profile.cached_op_seconds, grain),
                        offloadable=bandwidth is not None
                        and op.smallest_output >= min_offload_bytes,
                    )
                    for op in candidates
                ),
                saved_bytes=block.saved_bytes,
                input_bytes=block.input_bytes,
                input_unsaved_bytes=block.saved_and_input_bytes - block.saved_bytes,
                offloadable_input_bytes=offload_in,
                offloadable_input_unsaved_bytes=offload_in_unsaved,
                keep_seconds=-_down(
                    block.recompute_seconds + profile.checkpoint_overhead_seconds, grain
                ),
                policy_seconds=_up(
                    profile.policy_op_seconds * (block.forward_ops + block.recompute_ops), grain
                ),
                forward_window=forward_window,
                backward_window=backward_window,
                following_bytes=block.following_bytes,
            )
        )
    table = CostTable(
        blocks=tuple(blocks),
        fixed_bytes=profile.fixed_bytes,
        after_bytes=profile.after_bytes,
        base_seconds=profile.checkpointed_step_seconds,
        bandwidth=bandwidth,
    )
    return table, keys
