"""What a profiled step says about a model's blocks: the inputs of the cost model.

Made by `profiling.profile_step` from one recorded step (`summary`); every figure can be
replaced (``dataclasses.replace``) to plan for another machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tensorhooks._core.errors import PlanArgumentValueError
from tensorhooks._core.torch_compat import OpOverload

from .shapes import SizeModel

__all__ = ["BlockProfile", "InputProfile", "OpProfile", "StepProfile"]


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
        shared: whether other parts of the step save it too (it is then never offloaded with
            the block's input: the others would still hold it on the device).
    """

    nbytes: int
    tensor_bytes: int
    saved: bool
    shared: bool = False


@dataclass(frozen=True)
class BlockProfile:
    """One block, as profiled.

    Attributes:
        name: the block's qualified name in the model.
        ops: the ops of its forward, in order.
        inputs: the inputs a checkpoint of it keeps.
        input_bytes: bytes held from its forward to its backward when it is checkpointed: the
            inputs a checkpoint of it keeps (not the model's parameters or buffers), and the
            outputs of its own that later parts of the step save.
        saved_bytes: bytes held from its forward to its backward when it is kept: what its
            forward saves, and inputs that later parts save too (held then all the same, at
            most until its backward). A storage several parts save is counted at the first.
        saved_and_input_bytes: bytes of those two sets together (the input is often saved).
        forward_seconds: op time of its forward pass.
        backward_seconds: op time of its backward pass, recomputation left out.
        recompute_seconds: time of its recomputation (its forward's, up to its last save).
        forward_ops: ops its forward runs (each pays a selective policy's dispatch).
        recompute_ops: ops its recomputation runs.
        following_bytes: bytes saved after it and before the next block (or, for the last
            block, none: those are the profile's ``after_bytes``), held whatever it chooses
            until the next block's backward has run.
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
    following_bytes: int = 0


@dataclass(frozen=True)
class StepProfile:
    """What one profiled step says about a model's blocks: the inputs of the cost model.

    Made by `profile_step`; every figure can be replaced (``dataclasses.replace``) to plan for
    another machine, such as ``bandwidth`` of a GPU's host link on a CPU-only one.

    Attributes:
        blocks: one `BlockProfile` per block, in forward order.
        device: the device the step ran on (``"cpu"``, ``"cuda:0"``).
        fixed_bytes: bytes saved for backward before the first block (embeddings), held the
            whole step.
        after_bytes: bytes saved after the last block (final norm, head, loss), released
            before the blocks' backward starts.
        after_forward_seconds: op time of the forward after the last block.
        after_backward_seconds: op time of the backward of that part.
        checkpointed_step_seconds: the step with every block recomputed: predicted step times
            are this, plus or minus what each block's choice changes. From the recorded step,
            less what recording cost.
        unplanned_step_seconds: the step with no plan, likewise.
        checkpoint_overhead_seconds: what checkpointing a block costs beyond its recomputation
            (hooks, RNG state), per block; measured once per process (see `calibration`).
        policy_op_seconds: what a selective policy costs per op it sees, forward and
            recomputation; measured once per process.
        cached_op_seconds: what a policy costs per op whose output it caches (the entry in
            the forward pass, handing it back in recomputation), beyond that op's own time
            saved; measured once per process.
        bandwidth: host↔device bytes per second of pinned copies (the slower direction),
            measured on CUDA; None on a CPU, where there is no link.
        checkpointed_peak_bytes: the peak with every block recomputed, device bytes held for
            backward: measured when the step was recorded so (``unplanned=False``), else from
            the recorded bytes.
        unplanned_peak_bytes: the measured peak with no plan, or None when the step was
            recorded with every block recomputed (``unplanned=False``).
        sizes: how the byte figures grow with the sizes of the step's inputs (see `SizeModel`),
            or None (a profile made by hand). Kept by each rank as its own under FSDP2.
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
    sizes: SizeModel | None = None

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
