"""What the recorded step says, as a `StepProfile`: bytes per block and op, times, growth.

See NOTE [Who holds a storage saved by several parts] below; the step itself is recorded by
`recording` (NOTE [Recording one step]).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch

from tensorhooks._core.torch_compat import OpOverload

from .calibration import Overheads
from .profiles import BlockProfile, InputProfile, OpProfile, StepProfile
from .recording import BEFORE, Recorder, gap, median
from .shapes import BlockSizes, Exps, Growth, SizeModel

__all__ = ["candidates", "summary"]

# NOTE [Who holds a storage saved by several parts]
#
# Backward runs the parts of the step last to first, and a part lets go of what it saved once
# its backward has run. A storage that several parts save (a block's output that the next
# block saves as its input, T5's position bias that every layer of a stack is handed, the
# encoder's output every decoder layer reads) is therefore held from the first save until the
# backward of the first part that saved it: the profile counts it once, at that part, and not at
# the later ones. At a block, whatever the block chooses: a storage that only its checkpoint
# would keep (an input its ops do not save) counts in the kept choice too, and an output of its
# own that later parts save counts in the checkpointed choices too; both are then upper bounds,
# exact wherever the first saver holds it itself. Before the first block it is held the whole
# step (``fixed_bytes``); in the gap after a block, until that block's backward starts
# (``following_bytes``); after the last block, until the blocks' backward starts
# (``after_bytes``).


def _order(recorder: Recorder) -> dict[int, int]:
    """Each part's place in the forward pass: before, block, gap after it, next block..."""
    places = {BEFORE: -1}
    for position, index in enumerate(recorder.order):
        places[index] = 2 * position
        places[gap(index)] = 2 * position + 1
    return places


def _owners(recorder: Recorder) -> dict[int, int]:
    """The part each saved storage is counted at: the first that saves it."""
    places = _order(recorder)
    last = len(places)
    return {
        name: min(record.parts, key=lambda part: places.get(part, last))
        for name, record in recorder.saved.items()
    }


def _growth(terms: Iterable[tuple[Exps, int]]) -> Growth:
    """Terms summed per exponent vector, in a stable order."""
    totals: dict[Exps, int] = {}
    for exps, nbytes in terms:
        if nbytes:
            totals[exps] = totals.get(exps, 0) + nbytes
    return tuple(sorted(totals.items()))


class _Bytes:
    """Sums of storages' bytes, with their growth."""

    def __init__(self, recorder: Recorder) -> None:
        self.saved = recorder.saved
        self.tensor_bytes = recorder.tensor_bytes

    def of(self, names: Iterable[int]) -> tuple[int, Growth]:
        records = [self.saved[name] for name in names]
        return (
            sum(record.nbytes for record in records),
            _growth((record.exps, record.nbytes) for record in records),
        )

    def tensor(self, name: int) -> tuple[int, Growth]:
        record = self.saved[name]
        size = self.tensor_bytes.get(name, record.nbytes)
        return size, ((record.exps, size),)


def _ops(
    recorder: Recorder, index: int, kept: set[int]
) -> tuple[list[OpProfile], list[tuple[Growth, Growth, Growth]]]:
    saved = recorder.saved
    ops, sizes = [], []
    for position, record in enumerate(recorder.ops[index]):
        in_block: list[tuple[Exps, int]] = []
        unsaved: list[tuple[Exps, int]] = []
        elsewhere = any(item in recorder.mutated for item, _, _, _ in record.outputs)
        for item, nbytes, _, exps in record.outputs:
            if item in kept and len(saved[item].parts) == 1:
                in_block.append((exps, nbytes))
            elif item in saved:
                elsewhere = True  # saved by another part too, or only by another
            else:
                unsaved.append((exps, nbytes))
        again = recorder.runs_again(index, position)
        smallest = min(record.outputs, key=lambda output: output[2], default=None)
        ops.append(
            OpProfile(
                op=record.op,
                call=record.call,
                seconds=record.seconds,
                flops=record.flops,
                saved_bytes=sum(nbytes for _, nbytes in in_block),
                other_bytes=sum(nbytes for _, nbytes in unsaved),
                smallest_output=0 if smallest is None else smallest[2],
                recomputed=again,
                cacheable=again and not record.alias and not elsewhere and bool(record.outputs),
            )
        )
        sizes.append(
            (
                _growth(in_block),
                _growth(unsaved),
                _growth([] if smallest is None else [(smallest[3], smallest[2])]),
            )
        )
    return ops, sizes


def _block(
    recorder: Recorder, index: int, owners: dict[int, int], plain: float
) -> tuple[BlockProfile, BlockSizes]:
    """Block ``index`` (listed), see NOTE [Who holds a storage saved by several parts]."""
    saved = recorder.saved
    counted = _Bytes(recorder)
    kept = {item for item in recorder.kept_by[index] if owners[item] == index}
    inputs = {item for item in recorder.inputs_of[index] if owners[item] == index}
    shared = {item for item in kept | inputs if len(saved[item].parts) > 1}
    held_kept = kept | (inputs & shared)  # held when kept, at most until its backward
    held_checkpointed = inputs | (kept & shared)
    ops, op_sizes = _ops(recorder, index, kept)
    following = [name for name, part in owners.items() if part == gap(index)]
    input_list = sorted(inputs)
    saved_bytes, saved_growth = counted.of(held_kept)
    input_bytes, input_growth = counted.of(held_checkpointed)
    both_bytes, both_growth = counted.of(held_kept | held_checkpointed)
    following_bytes, following_growth = counted.of(following)
    op_seconds = sum(op.seconds for op in ops)
    forward_ops = len(ops)
    recompute_ops = sum(1 for op in ops if op.recomputed)
    share = recompute_ops / forward_ops if forward_ops else 0.0
    profile = BlockProfile(
        name="",
        ops=tuple(ops),
        inputs=tuple(
            InputProfile(
                saved[item].nbytes,
                recorder.tensor_bytes.get(item, saved[item].nbytes),
                item in held_kept,
                item in shared,
            )
            for item in input_list
        ),
        input_bytes=input_bytes,
        saved_bytes=saved_bytes,
        saved_and_input_bytes=both_bytes,
        forward_seconds=recorder.forward_seconds[index],
        backward_seconds=recorder.backward_seconds[index],
        recompute_seconds=max(op_seconds, plain) * share,
        forward_ops=forward_ops,
        recompute_ops=recompute_ops,
        following_bytes=following_bytes,
    )
    sizes = BlockSizes(
        saved=saved_growth,
        input=input_growth,
        saved_and_input=both_growth,
        following=following_growth,
        inputs=tuple((counted.of([item])[1], counted.tensor(item)[1]) for item in input_list),
        ops=tuple(op_sizes),
    )
    return profile, sizes


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
        seconds = [
            median([block.ops[at].seconds for block in group]) for at in range(len(group[0].ops))
        ]
        forward = median([block.forward_seconds for block in group])
        backward = median([block.backward_seconds for block in group])
        recompute = median([block.recompute_seconds for block in group])
        for index in members:
            smoothed[index] = dataclasses.replace(
                blocks[index],
                ops=tuple(
                    dataclasses.replace(op, seconds=value)
                    for op, value in zip(blocks[index].ops, seconds, strict=True)
                ),
                forward_seconds=forward,
                backward_seconds=backward,
                recompute_seconds=recompute,
            )
    return tuple(smoothed)


def _checkpointed_peak(blocks: Sequence[BlockProfile], fixed: int, after: int) -> int:
    """The peak with every block recomputed (see NOTE [The cost model of a plan] in `costs`)."""
    held, peak = fixed, 0
    for block in blocks:
        peak = max(peak, held + block.saved_and_input_bytes)
        held += block.input_bytes + block.following_bytes
    return max(peak, held + after)


def summary(
    recorder: Recorder,
    names: Sequence[str],
    *,
    overheads: Overheads,
    bandwidth: float | None,
    device: torch.device,
) -> StepProfile:
    """The `StepProfile` of a recorded step; ``names`` are the blocks' names, as listed.

    Blocks are taken in the order the step ran them; those that did not run are left out.
    """
    owners = _owners(recorder)
    counted = _Bytes(recorder)
    order = recorder.order
    profiles, block_sizes = [], []
    for index in order:
        plain = (
            recorder.function_seconds[index]
            - recorder.overhead.get(index, 0.0)
            - overheads.dispatch_op_seconds * len(recorder.ops[index])
        )
        profile, sizes = _block(recorder, index, owners, plain)
        profiles.append(dataclasses.replace(profile, name=names[index]))
        block_sizes.append(sizes)
    last = order[-1]
    after_names = [name for name, part in owners.items() if part == gap(last)]
    after, after_growth = counted.of(after_names)
    # The last block's gap is the part after the blocks: its bytes are `after_bytes`.
    profiles[-1] = dataclasses.replace(profiles[-1], following_bytes=0)
    block_sizes[-1] = dataclasses.replace(block_sizes[-1], following=())
    fixed, fixed_growth = counted.of(n for n, part in owners.items() if part == BEFORE)
    blocks = _alike_smoothed(tuple(profiles))
    recompute = sum(block.recompute_seconds for block in blocks)
    dispatch = overheads.dispatch_op_seconds * recorder.op_count
    own = max(0.0, recorder.step_seconds - recorder.overhead_total - dispatch)
    ckpt = overheads.checkpoint_seconds * len(blocks)
    if recorder.keep:
        unplanned, checkpointed = own, own + recompute + ckpt
        measured_full, measured_unplanned = None, recorder.held.peak[0]
    else:
        unplanned, checkpointed = max(0.0, own - recompute - ckpt), own
        measured_full, measured_unplanned = recorder.held.peak[0], None
    model = SizeModel(
        signature=recorder.sizes.signature or (),
        source=recorder.sizes.source,
        classes=recorder.sizes.class_sizes(),
        bases=recorder.sizes.bases,
        fixed=fixed_growth,
        after=after_growth,
        blocks=tuple(block_sizes),
    )
    return StepProfile(
        blocks=blocks,
        device=str(device),
        fixed_bytes=fixed,
        after_bytes=after,
        after_forward_seconds=recorder.forward_seconds[recorder.count],
        after_backward_seconds=recorder.backward_seconds[recorder.count],
        checkpointed_step_seconds=checkpointed,
        unplanned_step_seconds=unplanned,
        checkpoint_overhead_seconds=overheads.checkpoint_seconds,
        policy_op_seconds=overheads.policy_op_seconds,
        cached_op_seconds=overheads.cached_op_seconds,
        bandwidth=bandwidth,
        checkpointed_peak_bytes=(
            _checkpointed_peak(blocks, fixed, after) if measured_full is None else measured_full
        ),
        unplanned_peak_bytes=measured_unplanned,
        sizes=model if recorder.sizes.started else None,
    )
